"""``lowprec checkpoint convert SRC DST``: a checkpoint of an older lowprec (non-tensor state in DCP's pickled byte
records, which every load refuses) rewritten in the current format, without running code from it
(``lowprec.train.checkpoint_convert``)."""

from __future__ import annotations

import shlex
import sys
import warnings

USAGE = """usage: lowprec checkpoint convert SRC DST

  Rewrite the checkpoint folder SRC, written by an older lowprec (its optimizer values stored as DCP's pickled
  byte records, which every load refuses), as a new checkpoint folder DST that resumes like any other
  (resume=DST). The byte records are decoded with torch's weights-only unpickler and kept only when they are
  plain values (numbers, strings, booleans, None, lists); nothing in SRC runs. DST must not exist; SRC is not
  changed."""


def checkpoint_main(argv: list[str], user_errors: tuple[type[BaseException], ...], one_line) -> int:
    """``lowprec checkpoint SUBCOMMAND ...``; returns the exit status (0 converted, 2 a usage error or a refused
    checkpoint, printed as one line). ``user_errors`` are printed with ``one_line(e)`` (the command line's own,
    passed down so this module never imports the top)."""
    if argv[:1] in (["-h"], ["--help"]) or (argv[:1] == ["convert"] and any(a in ("-h", "--help") for a in argv)):
        print(USAGE)
        return 0
    if not argv or argv[0] != "convert":
        got = f"unknown subcommand {argv[0]!r}" if argv else "a subcommand is needed"
        print(f"lowprec checkpoint: error: {got}; usage: lowprec checkpoint convert SRC DST", file=sys.stderr)
        return 2
    args = argv[1:]
    if len(args) != 2 or any(a.startswith("-") for a in args):
        print(
            f"lowprec checkpoint convert: error: takes two folders, SRC and DST (got {len(args)} arguments: "
            f"{' '.join(repr(a) for a in args) or 'none'}); usage: lowprec checkpoint convert SRC DST",
            file=sys.stderr,
        )
        return 2
    from lowprec.train.checkpoint_convert import convert_checkpoint
    from lowprec.train.checkpoint_files import UnverifiedCheckpointWarning

    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", UnverifiedCheckpointWarning)
            done = convert_checkpoint(args[0], args[1])
    except user_errors as e:
        print(f"lowprec checkpoint convert: error: {one_line(e)}", file=sys.stderr)
        return 2
    for w in notes:
        if issubclass(w.category, UnverifiedCheckpointWarning):
            print(f"lowprec checkpoint convert: warning: {one_line(w.message)}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    print(
        f"converted {args[0]!r} to {str(done.dst)!r}: {done.tensors} tensors, {done.values} values in values.json"
        f"{', trainer_state.pt' if done.trainer_state else ', no trainer_state.pt'}"
        f"{'' if done.verified else ' (source unverified: it had no manifest)'}; "
        f"resume with resume={shlex.quote(str(done.dst))}"
    )
    return 0
