"""MLflow tracking: parent/child runs, buffered metric logging, provenance tags."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

# MLflow 3 prints a deprecation banner for some stores and tries to reach the network for nothing we use.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import mlflow  # noqa: E402
import torch
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from lowprec.errors import UserError
from lowprec.parallel.runtime import is_rank0

ABLATION_TAG = "lowprec.ablation_id"
PARENT_TAG = "mlflow.parentRunId"
#: MLflow shows this tag as the run's description (the UI's "Description" box).
DESCRIPTION_TAG = "mlflow.note.content"


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


class Tracker:
    """One MLflow experiment behind a client; all lowprec logging goes through it."""

    def __init__(self, uri: str, experiment: str, artifact_root: str | Path):
        """Raises ``TrackingError`` when ``uri`` is a server that cannot be reached."""
        self.uri = resolve_uri(uri)
        check_reachable(self.uri)
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None and is_server(self.uri):
            # The server chooses (and serves) the artifact store: a client path would not exist on its machine.
            self.experiment_id = self.client.create_experiment(experiment)
        elif exp is None:
            root = Path(artifact_root).resolve() / "mlartifacts"
            root.mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=root.as_uri())
        else:
            self.experiment_id = exp.experiment_id

    def start_run(self, name: str, tags: dict[str, str], parent_id: str | None = None) -> str:
        if parent_id:
            tags = {**tags, PARENT_TAG: parent_id}
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)[:8000]) for k, v in tags.items()])

    def log_dict(self, run_id: str, obj: dict, name: str) -> None:
        self.client.log_dict(run_id, obj, name)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        """``text`` as the run's artifact ``name`` (e.g. ``failure_traceback.txt``)."""
        self.client.log_text(run_id, text, name)

    def log_artifact(self, run_id: str, path: str | Path, folder: str | None = None) -> None:
        """The file ``path`` as an artifact of the run (at the artifact root, or under ``folder``)."""
        self.client.log_artifact(run_id, str(path), folder)

    def set_description(self, run_id: str, text: str) -> None:
        """The run's description as the MLflow UI shows it."""
        self.set_tags(run_id, {DESCRIPTION_TAG: text})

    def run_url(self, run_id: str) -> str | None:
        """The run's page in the MLflow UI of a tracking server; None for a local store (no server to link to)."""
        if not is_server(self.uri):
            return None
        return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"

    def end_run(self, run_id: str, status: str, reason: str | None = None) -> None:
        if reason:
            self.set_tags(run_id, {"failure_reason": reason[:8000]})
        self.client.set_terminated(run_id, status)


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
    def end_run(self, run_id: str, status: str, reason: str | None = None) -> None: ...
    def log_batch(self, run_id: str, **kwargs) -> None: ...


def make_tracker(cfg) -> Tracker | NullTracker:
    """``Tracker`` on rank 0 (or one process), ``NullTracker`` on the other ranks."""
    return Tracker(cfg.tracking.uri, cfg.tracking.experiment, cfg.paths.runs) if is_rank0() else NullTracker()


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
        for i in range(0, len(self._pending), 1000):
            self.tracker.client.log_batch(self.run_id, metrics=self._pending[i : i + 1000])
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


def provenance_tags(device) -> dict[str, str]:
    """Git SHA, library versions and device, as the README's tracking section lists them."""
    return {
        "git_sha": git_sha(),
        "torch_version": torch.__version__,
        # Installed versions from the package metadata: importing the two libraries only for this costs ~2 s.
        "torchao_version": importlib.metadata.version("torchao"),
        "bitsandbytes_version": importlib.metadata.version("bitsandbytes"),
        "device": device_name(device),
        "device_type": device.type,
    }


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)
