"""``lowprec sync PATH``: replay the tracking writes a run spooled while its server did not answer
(``experiments/tracking/spool.py``), in order, to the store the user configures (``tracking.uri=...``, else the
default).

A spool file may come from someone else: it is data. It replays only to the configured store (a spool whose header
names another store is refused, unless that store is given with ``tracking.uri=``), and only files inside its own
``<run id>.files/`` folder are uploaded (``spool.spooled_file``)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from experiments.tracking.spool import ReplayInterrupted, SpoolError, is_transient, read_header, replay, short_reason
from experiments.tracking.tracker import TrackingError, check_reachable, quiet_disk_full_logs, resolve_uri
from lowprec.errors import UserError
from lowprec.storage import disk_errno

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


def sync_main(argv: list[str], tracking_of) -> int:
    """Run ``lowprec sync PATH [key=value ...]``; ``tracking_of(overrides)`` is the ``tracking`` node
    (``TrackingConfig``) of the ``ablate`` config with the overrides, a bad one a ``UserError``; the writes go to its
    ``uri``. Returns 0 when everything spooled under the path has been replayed (or there
    was nothing), 2 with one line for a missing path, a file that is not a spool or is malformed, a spool that names
    another store than the configured one (without ``tracking.uri=`` on the command line), a bad override, or a
    server that still fails."""
    paths = [a for a in argv if not _OVERRIDE.match(a)]
    overrides = [a for a in argv if _OVERRIDE.match(a)]
    if len(paths) != 1 or paths[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        files = spool_files(Path(paths[0]))
        tracking = tracking_of(overrides)
        named = any(a.lstrip("+~").startswith("tracking.uri=") for a in overrides)
        if not files:
            print(f"sync: nothing spooled under {paths[0]}")
            return 0
        target = resolve_uri(tracking.uri)
        for f in files:
            written_for = read_header(f)["uri"]
            if not named and written_for != target:
                raise SpoolError(
                    f"{f} was written for the store {written_for}, not the configured {target}: a spool replays "
                    f"only to the store you name; if {written_for} is yours, run lowprec sync "
                    f"{shlex.quote(str(f))} {shlex.quote('tracking.uri=' + written_for)}"
                )
            check_reachable(target)
            quiet_disk_full_logs()  # a store still full is told in one line below, not by MLflow's traceback log
            try:
                r = replay(MlflowClient(target), f, warn=_warn)
            except ReplayInterrupted as e:
                if disk_errno(e.cause) is not None:  # a local store whose disk is still full
                    raise TrackingError(
                        f"{target} still cannot take writes ({short_reason(e.cause)}) after {e.done} of {e.of} "
                        f"write(s) of {f}; the rest stays spooled: free space there and run lowprec sync again"
                    ) from None
                if not is_transient(e.cause):
                    raise TrackingError(
                        f"{target} refused write {e.done + 1} of {e.of} of {f} ({short_reason(e.cause)}); "
                        "the rest stays spooled"
                    ) from None
                raise TrackingError(
                    f"tracking server {target} failed after {e.done} of {e.of} write(s) of {f} "
                    f"({short_reason(e.cause)}); the rest stays spooled: run lowprec sync again"
                ) from None
            end = f", ended {r.end}" if r.end else ", no end status in the spool (its process did not end the run)"
            print(f"sync: run {r.run_id}: replayed {r.writes} write(s) ({r.metrics} metric values){end} to {target}")
    except UserError as e:
        line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        print(f"lowprec sync: error: {line}", file=sys.stderr)
        return 2
    return 0
