"""``lowprec sync PATH``: replay the tracking writes a run spooled while its server did not answer
(``experiments/spool.py``), in order, to the server named in each spool (or ``tracking.uri=...``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hydra.errors import HydraException
from mlflow.tracking import MlflowClient
from omegaconf.errors import OmegaConfBaseException

from experiments.spool import ReplayInterrupted, SpoolError, read_header, replay, short_reason
from experiments.tracking import TrackingError, check_reachable, resolve_uri
from lowprec.errors import UserError

USAGE = "usage: lowprec sync PATH [tracking.uri=URI]   (PATH: a spool file, a folder of them, or a runs folder)"


def spool_files(path: Path) -> list[Path]:
    """The spool files ``path`` names: itself, the ``*.jsonl`` files in it, or those of its ``spool/`` subfolder
    (``paths.runs``). Raises ``SpoolError`` for a missing path or a file that is not a spool."""
    if not path.exists():
        raise SpoolError(f"no spool file or folder at '{path}'")
    if path.is_dir():
        folder = path / "spool" if (path / "spool").is_dir() else path
        files = sorted(folder.glob("*.jsonl"))
    else:
        files = [path]
    for f in files:
        read_header(f)  # every file is a spool before anything is replayed
    return files


def _warn(msg: str) -> None:
    print(f"lowprec sync: warning: {msg}", file=sys.stderr)


_OVERRIDE = re.compile(r"^[+~]{0,2}[\w.]+=")


def sync_main(argv: list[str], compose) -> int:
    """Run ``lowprec sync PATH [key=value ...]``; ``compose`` builds the ``ablate`` config from the overrides (a
    ``tracking.uri=...`` among them replays to that store instead of the server each spool names). Returns 0 when
    everything spooled under the path has been replayed (or there was nothing), 2 with one line for a missing path,
    a file that is not a spool, a bad override, or a server that still fails."""
    paths = [a for a in argv if not _OVERRIDE.match(a)]
    overrides = [a for a in argv if _OVERRIDE.match(a)]
    if len(paths) != 1 or paths[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        files = spool_files(Path(paths[0]))
        cfg = compose("ablate", overrides)
        named = any(a.lstrip("+~").startswith("tracking.uri=") for a in overrides)
        if not files:
            print(f"sync: nothing spooled under {paths[0]}")
            return 0
        for f in files:
            target = resolve_uri(cfg.tracking.uri) if named else read_header(f)["uri"]
            check_reachable(target)
            try:
                r = replay(MlflowClient(target), f, warn=_warn)
            except ReplayInterrupted as e:
                raise TrackingError(
                    f"tracking server {target} failed after {e.done} of {e.of} write(s) of {f} "
                    f"({short_reason(e.cause)}); the rest stays spooled: run lowprec sync again"
                ) from None
            end = f", ended {r.end}" if r.end else ", no end status in the spool (its process did not end the run)"
            print(f"sync: run {r.run_id}: replayed {r.writes} write(s) ({r.metrics} metric values){end} to {target}")
    except (UserError, HydraException, OmegaConfBaseException) as e:
        line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        print(f"lowprec sync: error: {line}", file=sys.stderr)
        return 2
    return 0
