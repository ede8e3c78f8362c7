"""``lowprec data prepare key=value ...``: the command-line glue of ``lowprec.data.prepare_source``.

    lowprec data prepare source=PATH|HF_DATASET out=DIR [tokenizer=bpe|FILE|HF_NAME] [text_column=text]
                         [vocab_size=8192] [max_tokens=0] [shard_tokens=67108864] [val_fraction=0.05]
                         [config=NAME] [split=train] [pattern=**/*] [eot_token=TOKEN] [progress=true]

Every key is a field of ``PrepareSpec`` plus ``progress``; values are read with Hydra's override grammar
(``pattern=**/*.txt``, ``config=null``, quotes) and typed and checked by OmegaConf, as ``train``'s are. Bad input
ends in one line (exit 2); an interrupted preparation continues when the same command runs again (exit 130 on
Ctrl-C, saying so).
"""

from __future__ import annotations

import sys

USAGE = (
    "usage: lowprec data prepare source=PATH|HF_DATASET out=DIR [tokenizer=bpe|FILE|HF_NAME] [text_column=text] "
    "[vocab_size=8192] [max_tokens=0] [shard_tokens=N] [val_fraction=0.05] [config=NAME] [split=train] "
    "[pattern=GLOB] [eot_token=TOKEN] [progress=true]"
)


def parse_prepare_args(argv: list[str]):
    """``key=value`` arguments -> (``PrepareSpec``, progress). Hydra's override parser reads the values (a value it
    cannot read raises ``OverrideParseException``) and OmegaConf checks every key and type against the dataclass (an
    unknown key, a value of the wrong type or a missing ``source``/``out`` raises its ``OmegaConfBaseException``);
    an argument without ``=`` raises ``ConfigError``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from lowprec.data.prepare_source import PrepareSpec
    from lowprec.errors import ConfigError

    bare = [a for a in argv if "=" not in a]
    if bare:
        raise ConfigError(f"{bare[0]!r} is not key=value; {USAGE.removeprefix('usage: ')}")
    given = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(list(argv))}
    progress = bool(given.pop("progress", True))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrepareSpec), given)), progress


def data_main(argv: list[str], user_errors: tuple[type[BaseException], ...], one_line) -> int:
    """``lowprec data SUBCOMMAND ...``; returns the exit status. ``user_errors`` are the exceptions printed as one
    line with ``one_line(e)`` (the command line's own, passed down so this module never imports the top)."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "prepare":
        print(USAGE, file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(USAGE)
        return 0
    from lowprec.data.prepare_source import prepare_shards

    try:
        spec, progress = parse_prepare_args(argv[1:])
        done = prepare_shards(spec, progress=progress)
    except user_errors as e:
        print(f"lowprec data prepare: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowprec data prepare: interrupted; the same command continues it", file=sys.stderr)
        return 130
    m = done.meta
    what = "already prepared" if done.skipped else "prepared"
    if done.resumed_docs:
        what += f" (resumed after {done.resumed_docs:,} documents)"
    print(
        f"{what}: {m['tokens']['train']:,} train + {m['tokens']['val']:,} val tokens ({m['dtype']}, vocab "
        f"{m['vocab_size']:,}) from {m['corpus']}, {m['documents']:,} documents, in {done.out} "
        f"(fingerprint {m['fingerprint'][:16]})"
    )
    print(
        f"train on it: lowprec train data.source=tokens data.path={done.out} "
        f"(needs model.vocab_size >= {m['vocab_size']})"
    )
    return 0
