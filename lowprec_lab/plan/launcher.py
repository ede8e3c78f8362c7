"""Where an ablation's runs are launched (``launcher=...``): this machine, or one job per run
through ``submitit`` (SLURM, or submitit's local executor: the same submission path on this machine).

``launcher=local`` (the default) is the ablation as it always ran: in this process or in worker processes
(``lowprec_lab.runner.scheduler``). ``launcher=slurm`` submits each run as its own SLURM job with ``submitit``
(``lowprec_lab.runner.submitit_jobs``) and waits for them; ``launcher=submitit_local`` does the same with
submitit's ``LocalExecutor`` (each job a process of this machine), which is what the tests run.

The Hydra group ``launcher`` holds one option per name of the executor registry (``lowprec_lab.runner.executors``),
each a ``LauncherSpec`` node; ``lowprec_lab.plan.config.launcher_from_cfg`` turns the composed node into the checked
``LauncherSpec`` the ``Plan`` carries, and ``check_launcher`` refuses, in one line before any MLflow run, what
cannot be submitted from here (no ``submitit``, no ``sbatch`` on PATH, a layout larger than a node, a value out of
range). A parallel layout runs under torchrun inside each job (``lowprec_lab.runner.job_ranks``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from lowprec.errors import ConfigError
from lowprec_lab.plan.launch import under_torchrun

#: Free-text fields submitit writes into the job's sbatch script (``#SBATCH --partition=...``, the ``--output`` path
#: of the job folder) or, for ``setup``, as one line each: a newline there would start a line of its own.
TEXT_FIELDS = ("partition", "account", "qos", "constraint", "folder")


@dataclass(frozen=True)
class LauncherKind:
    """One launcher's registry entry: ``executor``, its executor class as ``"module:Class"`` (resolved by
    ``lowprec_lab.runner.executors.executor_class``, so the plan never imports the runner), and its traits:
    ``submitit`` (runs are submitit jobs), ``cluster`` (jobs go to a SLURM cluster: ``sbatch`` needed, the cluster
    queues every job, each alone on its allocation), ``job_id_tag`` (the run tag naming the job; "" when runs are no
    jobs)."""

    executor: str
    submitit: bool = False
    cluster: bool = False
    job_id_tag: str = ""


#: ``launcher.name`` -> its ``LauncherKind``: the one registry of launchers. Adding a launcher is one executor class
#: (``lowprec_lab.runner.executors.Executor``) and one line here.
LAUNCHERS = {
    "local": LauncherKind("lowprec_lab.runner.scheduler:LocalExecutor"),
    "slurm": LauncherKind("lowprec_lab.runner.submitit_jobs:SlurmExecutor", True, True, "slurm_job_id"),
    "submitit_local": LauncherKind(
        "lowprec_lab.runner.submitit_jobs:SubmititLocalExecutor", True, False, "submitit_job_id"
    ),
}


@dataclass(unsafe_hash=True)
class LauncherSpec:
    """Group ``launcher`` (conf: ``launcher=local|slurm|submitit_local``, the names of the launcher registry
    ``LAUNCHERS``), as the Hydra schema and, checked, as the ``Plan`` carries it. ``name``: the
    option. For the submitit launchers: ``partition`` (SLURM partition; null: the cluster's default),
    ``gpus_per_node`` (GPUs of one node of the partition; null: not checked; a run's layout must fit one node),
    ``time`` (each job's time limit, minutes; SLURM sends SIGUSR2 90 s before it, the run stops after its step with
    a checkpoint and is recorded KILLED, so ``resume=`` continues it), ``cpus_per_task``, ``mem_gb``, ``account``,
    ``qos``, ``constraint`` (sbatch's own options; null: not passed), ``setup`` (shell lines each job runs first,
    e.g. ``source .venv/bin/activate``; a tuple once checked), ``folder`` (submitit's job folder: pickles and logs;
    null: ``<paths.runs>/submitit/<ablation id>``), ``max_running`` (jobs in flight at once; null: every run at
    once on SLURM, ``workers`` with ``submitit_local``), ``poll_s`` (how often the ablation looks at its jobs,
    seconds).

    Not declared ``frozen``: OmegaConf makes a frozen dataclass's node read-only, and Hydra could not override
    ``launcher.time=...``. Instead an instance refuses any assignment once built (``AttributeError``), so the
    ``Plan`` that carries one is still a value."""

    name: str = "local"
    partition: str | None = None
    gpus_per_node: int | None = None
    time: int = 60
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: tuple[str, ...] = ()
    folder: str | None = None
    max_running: int | None = None
    poll_s: float = 1.0

    def __setattr__(self, key, value) -> None:
        if "poll_s" in self.__dict__:  # the last field ``__init__`` sets: built (no extra attribute marks it)
            raise AttributeError(f"LauncherSpec is a value: launcher.{key} cannot be assigned (dataclasses.replace)")
        object.__setattr__(self, key, value)

    def _kind(self) -> LauncherKind:
        """The traits registered for ``name`` in ``LAUNCHERS``. Raises ``ConfigError`` (one line) for a name not
        registered."""
        kind = LAUNCHERS.get(self.name)
        if kind is None:
            raise ConfigError(f"launcher.name={self.name} is not one of {', '.join(LAUNCHERS)}")
        return kind

    @property
    def submitit(self) -> bool:
        """True when runs are submitted as submitit jobs (``slurm``, ``submitit_local``)."""
        return self._kind().submitit

    @property
    def cluster(self) -> bool:
        """True when the jobs go to a SLURM cluster: every job submitted at once (the cluster queues them), each
        alone on its own allocation, and ``sbatch`` needed on PATH."""
        return self._kind().cluster

    @property
    def needs_sbatch(self) -> bool:
        """True when submitting needs ``sbatch`` on PATH (``cluster``)."""
        return self._kind().cluster

    @property
    def local_jobs(self) -> bool:
        """True when each run is a submitit job process of this machine (submitit's ``LocalExecutor``)."""
        kind = self._kind()
        return kind.submitit and not kind.cluster

    @property
    def job_id_tag(self) -> str:
        """The run tag naming the job that trained it: ``slurm_job_id`` on SLURM, ``submitit_job_id`` otherwise."""
        return self._kind().job_id_tag


#: One option per launcher name in the Hydra group ``launcher`` (lowprec_lab/plan/config.py registers them).
LAUNCHER_OPTIONS = {name: LauncherSpec(name=name) for name in LAUNCHERS}


def check_one_line(name: str, value: str | None) -> None:
    """Refuse (``ConfigError``, one line) a ``value`` of the setting ``name`` that holds a newline or another
    control character (Unicode category ``Cc``, or a line or paragraph separator): it goes into the job's sbatch
    script, where it would end the line and start a shell line of its own. None passes."""
    if value is None:
        return
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        raise ConfigError(
            f"{name}={value!r} holds the control character {bad!r}: it would become a line of its own in the "
            "job's sbatch script; refused"
        )


def check_private_folder(path: Path, follow: bool = True) -> None:
    """Refuse (``ConfigError``, one line) a job folder ``path`` whose files another user could have written or
    replaced: not a folder (with ``follow=False``, a symbolic link counts as not a folder), not owned by this
    user, or writable by group or others. Nothing is read from a folder refused."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        raise ConfigError(f"job folder {path} cannot be read ({e.strerror}); nothing was read from it") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"job folder {path} is not a folder (a link?); nothing was read from it")
    if st.st_uid != os.getuid():
        raise ConfigError(f"job folder {path} belongs to uid {st.st_uid}, not to this user; nothing was read from it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"job folder {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): its files "
            f"could have been replaced; nothing was read from it (chmod 700 {path})"
        )


def check_launcher(spec: LauncherSpec, world_size: int, which=shutil.which) -> None:
    """Refuse (``ConfigError``, one line) a launcher that cannot submit from here, before any MLflow run:
    an unknown ``name``; a newline or control character in a free-text field (``TEXT_FIELDS``, each ``setup``
    line: ``check_one_line``); a ``folder`` that exists and another user could write (``check_private_folder``);
    ``slurm`` without the ``submitit`` package or without ``sbatch`` on PATH (``which``: how
    PATH is searched); a submitit launcher under torchrun (the ablation process submits; each job of a parallel
    layout, ``world_size`` > 1, starts torchrun with its ranks itself); ``time``, ``cpus_per_task``, ``mem_gb``,
    ``gpus_per_node``, ``max_running`` or ``poll_s`` out of range; a layout that needs more GPUs than
    ``gpus_per_node`` (one run per node at most: a job's torchrun is ``--standalone``)."""
    if not spec.submitit:  # an unknown name is refused here (the registry's one line)
        return
    for key in TEXT_FIELDS:
        check_one_line(f"launcher.{key}", getattr(spec, key))
    for i, line in enumerate(spec.setup):
        check_one_line(f"launcher.setup[{i}]", line)
    if spec.folder is not None and os.path.lexists(spec.folder):  # one the ablation makes is made 0700
        check_private_folder(Path(spec.folder))
    if importlib.util.find_spec("submitit") is None:
        raise ConfigError(f"launcher={spec.name} needs the submitit package: pip install submitit")
    if spec.needs_sbatch and which("sbatch") is None:
        raise ConfigError(
            "launcher=slurm: sbatch is not on PATH; run lowprec ablate on a SLURM login node "
            "(launcher=submitit_local runs the same submission path on this machine)"
        )
    for key in ("time", "cpus_per_task", "gpus_per_node", "max_running"):
        value = getattr(spec, key)
        if value is not None and value < 1:
            raise ConfigError(f"launcher.{key}={value} must be >= 1")
    for key in ("mem_gb", "poll_s"):
        value = getattr(spec, key)
        if value is not None and value <= 0:
            raise ConfigError(f"launcher.{key}={value} must be > 0")
    if spec.gpus_per_node is not None and world_size > spec.gpus_per_node:
        raise ConfigError(
            f"the parallel layout needs {world_size} GPUs per run but launcher.gpus_per_node={spec.gpus_per_node}"
        )
    if under_torchrun():  # every rank would submit every run
        raise ConfigError(
            f"launcher={spec.name} submits from one process: run lowprec ablate without torchrun "
            "(each job starts torchrun itself for a parallel layout)"
        )
