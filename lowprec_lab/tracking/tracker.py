"""MLflow tracking: parent/child runs, buffered metric logging, provenance tags.

Every write of a run goes through ``Tracker`` and its ``Spooler`` (``lowprec_lab/tracking/spool.py``): a write that a
tracking
server (``http(s)://``) cannot take, or that a local sqlite store cannot take because its disk is full, is spooled
locally and replayed later; training goes on. A sqlite store's first creation is serialized by a lock file beside it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import nullcontext
from pathlib import Path

# MLflow 3 prints a deprecation banner for some stores and tries to reach the network for nothing we use.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import mlflow  # noqa: E402
import torch
from filelock import FileLock  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from lowprec.errors import UserError
from lowprec.parallel.runtime import is_rank0
from lowprec.storage import disk_errno, disk_error
from lowprec.train.fault_points import reached
from lowprec_lab.plan.config import check_store_uri  # noqa: E402
from lowprec_lab.tracking.spool import (  # noqa: E402
    Spooler,
    batch_record,
    drop_note,
    end_record,
    is_transient,
    reserve_note,
    short_reason,
    write_note,
)

ABLATION_TAG = "lowprec.ablation_id"
PARENT_TAG = "mlflow.parentRunId"
#: MLflow shows this tag as the run's description (the UI's "Description" box).
DESCRIPTION_TAG = "mlflow.note.content"
#: The experiment tag from which MLflow 3's UI chooses its view. Without it the UI infers the kind and showed a
#: lowprec store as GenAI ("Evaluation runs", "Traces 0"). The values are the UI's ``ExperimentKind`` enum
#: (mlflow/server/js: ``CUSTOM_MODEL_DEVELOPMENT = "custom_model_development"``, shown as "Machine learning").
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: Written for a package whose distribution metadata is absent (``importlib.metadata.PackageNotFoundError``).
NOT_INSTALLED = "not installed"


class TrackingError(UserError, ConnectionError):
    """The tracking server cannot be reached (or answers with an error) where a command needs it."""


def is_server(uri: str) -> bool:
    """True for an ``http(s)://`` tracking URI (an ``mlflow server``), False for a local store."""
    return uri.startswith(("http://", "https://"))


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """For a server URI, ask its ``/health`` endpoint once; nothing for a local store.

    MLflow's client retries an unreachable server with backoff for minutes before it fails, with a traceback; a
    command that needs the server asks first. Raises ``TrackingError`` naming the URI and the reason.
    """
    if not is_server(uri):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as r:
            if r.status != 200:
                raise TrackingError(f"tracking server {uri} answered /health with HTTP {r.status}")
    except urllib.error.HTTPError as e:
        raise TrackingError(f"tracking server {uri} answered /health with HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TrackingError(f"tracking server {uri} is unreachable ({reason})") from None


def resolve_uri(uri: str) -> str:
    """Make a relative ``sqlite:///`` path absolute and create its folder (MLflow needs both)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = Path(uri[len(prefix) :]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    if uri.startswith(prefix + "/"):
        Path(uri[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
    return uri


def store_lock(uri: str):
    """For a sqlite URI, an exclusive lock file beside the database (``<db>.lock``), else a no-op context.

    MLflow's sqlite store creates its tables on first use without a lock (``SqlAlchemyStore.__init__`` calls
    ``_initialize_tables`` unguarded): two processes opening a new database at once failed with ``table experiments
    already exists`` or ``duplicate column name: step`` (tests/integration/test_sqlite_concurrency.py). Once the
    tables exist, MLflow's sessions wait on each other (``PRAGMA busy_timeout = 20000``).
    """
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return nullcontext()
    db = Path(uri[len(prefix) :].split("?", 1)[0])
    return FileLock(str(db.with_name(db.name + ".lock")))


class Tracker:
    """One MLflow experiment behind a client; all lowprec logging goes through it.

    On a tracking server, every write of a run goes through ``self.spool`` (``lowprec_lab.tracking.spool.Spooler``): it
    fails
    fast and is spooled under ``<artifact_root>/spool/`` when the server does not answer, and replayed in order when
    it does. Creating a run still needs the server.
    """

    def __init__(self, uri: str, experiment: str, artifact_root: str | Path):
        """Raises ``TrackingError`` when ``uri`` is a server that cannot be reached, ``DiskError`` (one line) when a
        local store's disk is full or read-only before it holds the experiment (no run exists yet whose writes a
        spool could keep), ``ConfigError`` for a file store or a database URI without its driver
        (``lowprec_lab.plan.config.check_store_uri``: every command that opens a store, one line)."""
        check_store_uri(uri)
        self.uri = resolve_uri(uri)
        check_reachable(self.uri)
        mlflow.set_tracking_uri(self.uri)
        folder = Path(artifact_root).resolve() / "spool"
        quiet_disk_full_logs()  # before MLflow first writes: a full disk is told in one line, not in its logs
        try:
            with store_lock(self.uri):  # a new sqlite store's tables, and the experiment, created by one process
                self.client = MlflowClient(self.uri)
                self.experiment_id = self._experiment(experiment, artifact_root)
        except Exception as e:  # MLflow creating its tables or the experiment on a full disk: hundreds of lines
            err = disk_error(f"opening the tracking store {self.uri}", folder.parent, e)
            if err is None:
                raise
            raise err from e
        self._noted: set[str] = set()  # runs whose stop note is reserved (``_write``)
        if is_server(self.uri):
            self.spool = Spooler(folder, self.uri)
        else:  # a full disk under the sqlite store: the run goes on, its writes wait in the spool
            self.spool = Spooler(
                folder,
                self.uri,
                _disk_full,
                what=f"tracking store {self.uri}",
                down="does not take writes (disk full or read-only)",
                back="it has space again",
            )

    def _experiment(self, name: str, artifact_root: str | Path) -> str:
        """The experiment's id, created on first use with its kind (``EXPERIMENT_KIND_TAG``); an existing experiment
        without a kind (a store written before the tag) gets it, one whose kind a user chose keeps it."""
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if EXPERIMENT_KIND_TAG not in exp.tags:
                self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return exp.experiment_id
        kind = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        try:
            if is_server(self.uri):
                # The server chooses (and serves) the artifact store: a client path would not exist on its machine.
                return self.client.create_experiment(name, tags=kind)
            root = Path(artifact_root).resolve() / "mlartifacts"
            root.mkdir(parents=True, exist_ok=True)
            return self.client.create_experiment(name, artifact_location=root.as_uri(), tags=kind)
        except MlflowException as e:  # another process (a second ablation on the same server) created it first
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def _write(self, run_id: str, rec: dict, final: bool = False) -> None:
        """One write of ``run_id`` through the spool. The run's first write reserves its stop note
        (``lowprec_lab.tracking.spool.reserve_note``); when the store and the spool both refuse for a full disk,
        the note says so (the process stops here with a ``DiskError``, and the next command's orphan sweep records
        the run ``failure_kind=disk`` instead of a process that died)."""
        if run_id not in self._noted:
            self._noted.add(run_id)
            reserve_note(self.spool.folder, run_id)
        try:
            self.spool.send(self.client, run_id, rec, final)
        except Exception as e:  # the store's disk and the spool's are both full: one line, not a traceback
            err = disk_error(f"writing run {run_id} to {self.uri} and to its spool", self.spool.folder, e)
            if err is None:
                raise
            write_note(self.spool.folder, run_id, "disk", str(err))
            raise err from e

    def start_run(self, name: str, tags: dict[str, str], parent_id: str | None = None) -> str:
        """Create the run (with MLflow's own retries: a run cannot be spooled before the server has given it an id).
        Raises ``TrackingError`` when the server still fails after them."""
        if parent_id:
            tags = {**tags, PARENT_TAG: parent_id}
        try:
            return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
        except MlflowException as e:
            if _disk_full(e):
                raise disk_error(f"creating run {name} in {self.uri}", self.spool.folder, e) from e
            if not (is_server(self.uri) and is_transient(e)):
                raise
            raise TrackingError(f"tracking server {self.uri} failed to create run {name} ({short_reason(e)})") from e

    def log_batch(
        self, run_id: str, metrics: list[Metric] = (), params: list[Param] = (), tags: list[RunTag] = ()
    ) -> None:
        """``MlflowClient.log_batch`` through the spool (metrics keep their timestamp and step)."""
        self._write(run_id, batch_record(metrics, params, tags))

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.log_batch(run_id, params=items[i : i + 100])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.log_batch(run_id, tags=[RunTag(k, str(v)[:8000]) for k, v in tags.items()])

    def log_dict(self, run_id: str, obj: dict, name: str) -> None:
        self._write(run_id, {"op": "dict", "name": name, "obj": obj})

    def log_text(self, run_id: str, text: str, name: str) -> None:
        """``text`` as the run's artifact ``name`` (e.g. ``failure_traceback.txt``)."""
        self._write(run_id, {"op": "text", "name": name, "text": text})

    def log_artifact(self, run_id: str, path: str | Path, folder: str | None = None) -> None:
        """The file ``path`` as an artifact of the run (at the artifact root, or under ``folder``)."""
        self._write(run_id, {"op": "file", "path": str(Path(path).resolve()), "folder": folder})

    def set_description(self, run_id: str, text: str) -> None:
        """The run's description as the MLflow UI shows it."""
        self.set_tags(run_id, {DESCRIPTION_TAG: text})

    def log_corpus(self, run_id: str, data) -> None:
        """The run's training data (``lowprec.data.TokenData``) as a run input (``corpus_dataset``), which the MLflow
        UI shows in its Datasets column; through the spool like every other write."""
        self._write(run_id, {"op": "input", "dataset": corpus_dataset(data), "context": "training"})

    def run_url(self, run_id: str) -> str | None:
        """The run's page in the MLflow UI of a tracking server; None for a local store (no server to link to)."""
        if not is_server(self.uri):
            return None
        return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"

    def end_run(self, run_id: str, status: str, reason: str | None = None) -> None:
        """The run's final status (and ``failure_reason``), its last write: on a server that does not answer, the
        run ends here and its spool holds the status for ``lowprec sync`` (a line on stderr says where)."""
        if reason:
            self.set_tags(run_id, {"failure_reason": reason[:8000]})
        self._write(run_id, end_record(status), final=True)
        drop_note(self.spool.folder, run_id)  # ended (in the store or in its spool): nothing left to explain

    def drain_spools(self, run_ids: list[str]) -> list[Path]:
        """Replay what is spooled for ``run_ids`` (an ablation's runs, some spooled by its worker processes);
        returns the spool files the store still did not take."""
        return self.spool.drain(self.client, run_ids)


class _QuietDiskFull(logging.Filter):
    """Drops MLflow's ERROR log of a sqlite write that failed for a full (or read-only) disk
    (``mlflow.store.db.utils`` logs each with its traceback: hundreds of lines per write); the spool says it in one
    line, once per run."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and _disk_full(exc)) or disk_errno(Exception(record.getMessage())) is not None)


_QUIET_DISK_FULL = _QuietDiskFull()


def quiet_disk_full_logs() -> None:
    """Install ``_QuietDiskFull`` on MLflow's sqlite logger (once: the same filter instance is not added twice), and
    keep that logger and alembic's to warnings: a new sqlite store's ``Creating initial MLflow database tables...``
    and ``Updating database tables`` (INFO, once per new store) say nothing a user acts on. Set here, after MLflow
    is imported: its logging setup at import resets the level of every ``mlflow.*`` logger."""
    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("mlflow.store.db.utils").addFilter(_QUIET_DISK_FULL)


def _disk_full(e: BaseException) -> bool:
    """True when a local store's write failed for a full (or read-only) disk: sqlite's ``database or disk is full``
    (``SQLITE_FULL``) inside MLflow's exception, or an ``OSError`` ``ENOSPC``/``EDQUOT``/``EROFS`` (its artifacts)."""
    return disk_errno(e) is not None


class NullTracker:
    """The ``Tracker`` interface for ranks other than 0 under torchrun: only rank 0 talks to MLflow (the
    metrics it logs are reduced across ranks first), the others log nothing."""

    uri = "(rank 0 logs)"

    def __init__(self) -> None:
        self._n = 0
        self.client = self

    def start_run(self, name: str, tags: dict[str, str], parent_id: str | None = None) -> str:
        self._n += 1
        return f"nolog-{self._n}"

    def log_params(self, run_id: str, params: dict[str, str]) -> None: ...
    def set_tags(self, run_id: str, tags: dict[str, str]) -> None: ...
    def log_dict(self, run_id: str, obj: dict, name: str) -> None: ...
    def log_text(self, run_id: str, text: str, name: str) -> None: ...
    def log_artifact(self, run_id: str, path, folder: str | None = None) -> None: ...
    def set_description(self, run_id: str, text: str) -> None: ...
    def log_corpus(self, run_id: str, data) -> None: ...
    def end_run(self, run_id: str, status: str, reason: str | None = None) -> None: ...
    def log_batch(self, run_id: str, **kwargs) -> None: ...
    def drain_spools(self, run_ids: list[str]) -> list[Path]:
        return []


def make_tracker(uri: str, experiment: str, runs: str) -> Tracker | NullTracker:
    """``Tracker`` on the store ``uri`` (``tracking.uri``), experiment ``experiment``, spooling under ``runs``
    (``paths.runs``), on rank 0 (or one process); ``NullTracker`` on the other ranks."""
    return Tracker(uri, experiment, runs) if is_rank0() else NullTracker()


class MetricBuffer:
    """``MetricSink`` that batches metrics into ``log_batch`` calls (one sqlite write per ``every`` steps).

    Call ``flush()`` before ending the run; ``log_metrics`` never drops values.
    """

    def __init__(self, tracker: Tracker, run_id: str, every: int = 25):
        self.tracker, self.run_id, self.every = tracker, run_id, every
        self._pending: list[Metric] = []
        self._steps = 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())
        self._steps += 1
        if self._steps % self.every == 0:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            reached("log.flush")
        for i in range(0, len(self._pending), 1000):
            self.tracker.log_batch(self.run_id, metrics=self._pending[i : i + 1000])
        self._pending = []


def git_sha() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if sha.returncode:
            return "unknown"
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def package_version(name: str) -> str:
    """The installed version of distribution ``name`` from its metadata, or ``NOT_INSTALLED`` when it has none.

    Provenance never stops a run: a GPU machine whose image lacks bitsandbytes' metadata died here before its first
    run (``PackageNotFoundError``). The metadata, not an import: importing torchao and bitsandbytes costs ~2 s.
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def provenance_tags(device) -> dict[str, str]:
    """Git SHA, library versions and device, as the README's tracking section lists them; the commit also under
    MLflow's own source tags (``mlflow.source.git.commit``, ``mlflow.source.name``, ``mlflow.source.type``), which
    fill the UI's Source column. A library that is not installed is recorded as ``NOT_INSTALLED``."""
    sha = git_sha()
    tags = {
        "git_sha": sha,
        "torch_version": torch.__version__,
        "torchao_version": package_version("torchao"),
        "bitsandbytes_version": package_version("bitsandbytes"),
        "device": device_name(device),
        "device_type": device.type,
        "mlflow.source.name": "lowprec",
        "mlflow.source.type": "LOCAL",
    }
    if sha != "unknown":  # MLflow shows the commit as given: the bare SHA; ``git_sha`` keeps the -dirty mark
        tags["mlflow.source.git.commit"] = sha.removesuffix("-dirty")
    return tags


def corpus_dataset(data) -> dict[str, str]:
    """The fields of an ``mlflow.entities.Dataset`` for ``data`` (``lowprec.data.TokenData``): its digest the
    corpus fingerprint's first 16 hex digits (as the report and the shard folder name it; MLflow allows 36), its
    source the shard folder (``local``), its profile the full fingerprint and the token counts."""
    name = data.description.split(":", 1)[0] if ":" in data.description else data.shard_dir.name
    profile = {
        "fingerprint": data.fingerprint,
        "train_tokens": data.n_train_tokens,
        "val_tokens": data.n_val_tokens,
        "vocab_size": data.vocab_size,
        "description": data.description,
    }
    return {
        "name": name[:500],
        "digest": data.fingerprint[:16],
        "source_type": "local",
        "source": json.dumps({"uri": str(data.shard_dir)}),
        "profile": json.dumps(profile),
    }


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)
