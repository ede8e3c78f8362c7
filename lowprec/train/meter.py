"""What a run measures besides the loss: step time and throughput, peak memory, the bytes autograd saves for
backward, and the bytes of the training state; ``RunMeter.summary`` turns them into the run's summary.

``step_bar`` is where the loop shows its progress: a tqdm bar on stderr, or, while ``reporting_steps`` has a reporter
installed in this process (an ablation's display: ``lowprec_lab.runner.progress``), a ``StepReport`` per step to
that reporter, which draws every run's bar in one place instead of each process writing its own to the terminal.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from lowprec.estimate.activations import predict_saved_activations
from lowprec.measure.accounting import PeakMemory, StateBytes, measure_state_bytes
from lowprec.measure.saved_tensors import SavedBytes, measure_fp8_scaling_bytes, measure_saved_bytes
from lowprec.train.build import Built
from lowprec.train.compile import compile_time_now
from lowprec.train.guards import preserve_buffers
from lowprec.train.spec import TrainSpec
from lowprec.train.step import Batch, forward_loss


class RunMeter:
    """Measurements of one ``run_training`` call whose first step is ``start``.

    Call ``start()`` first, ``probe_saved_bytes`` once before the first step, wrap each ``train_step`` in
    ``timed()`` and follow it with ``after_step``; ``summary()`` at the end.
    """

    def __init__(self, built: Built, spec: TrainSpec, start: int):
        self.built, self.spec, self.first_step = built, spec, start
        self.peak = PeakMemory(built.device)
        self.saved: SavedBytes | None = None
        #: ``lowprec estimate``'s saved-activation bytes for the probed batch under the run's ``train.ac``.
        self.saved_estimate: int | None = None
        #: Measured after the first step whose update ran: a skipped step has created no optimizer state.
        self.state: StateBytes | None = None
        #: Wall time of the last ``timed()`` block (s), and the part of it spent compiling (``train.compile``).
        self.last_step_s = math.nan
        self.last_compile_s = 0.0
        self._timed_s, self._timed_steps = 0.0, 0
        self._compile_start = 0.0

    def start(self) -> None:
        """Set the peak-memory baseline (what is resident now is not the run's growth) and the compile-time
        baseline."""
        self.peak.reset()
        self._compile_start = compile_time_now()

    def probe_saved_bytes(self, batch: Batch) -> None:
        """Measure the bytes autograd saves for backward with one extra forward on ``batch`` (the first step's
        first micro-batch), under the run's activation checkpointing (what the forward keeps plus the largest
        block recomputed, ``lowprec.measure.saved_tensors``), and the estimator's figure for the same. It runs
        under ``preserve_buffers``: delayed-scaling histories never see it. Compiled blocks (``train.compile``)
        run it in eager (``force_eager``): the figure is the eager ledger the estimator models; what a compiled
        graph saves is AOTAutograd's partitioner's choice and is not measured."""
        built = self.built
        x, y = built.dist.shard_batch(*batch)
        with preserve_buffers(built.model), torch.compiler.set_stance("force_eager"):
            self.saved = measure_saved_bytes(
                lambda: forward_loss(built, x.to(built.device), y.to(built.device)), built.model
            )
        dims = built.parallel.dims if built.parallel is not None else None
        est = predict_saved_activations(
            built.model.args,
            built.recipe,
            x.shape[0],
            x.shape[1],
            device_type=built.device.type,
            dp_shard=dims.dp_shard if dims else 1,
            tp=dims.tp if dims else 1,
        )
        self.saved_estimate = est.recompute_activations[self.spec.ac]

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time the block (one optimizer step) into ``last_step_s`` and the compilation inside it into
        ``last_compile_s``; an exception leaves them unchanged."""
        t0, c0 = time.perf_counter(), compile_time_now()
        yield
        self.last_step_s = time.perf_counter() - t0
        self.last_compile_s = compile_time_now() - c0

    def after_step(self, step: int, applied: bool = True) -> dict[str, float]:
        """The step's metrics: ``step_time_s`` (s), ``tokens_per_s`` and ``tokens`` (consumed after this step).
        ``applied``: the step's update ran (the state bytes are measured after the first such step).

        Steps from ``spec.timing_warmup_steps`` after the first count towards the summary's means, except a step
        that compiled (``train.compile``: a first step, or a recompile): compile time is ``compile_time_s``, never
        throughput. Such a step's metrics add ``step_compile_s``.
        """
        built, spec, dt = self.built, self.spec, self.last_step_s
        if self.state is None and applied:
            self.state = measure_state_bytes(built.model, built.optimizer, built.master_params)
        compiled = self.last_compile_s > 0
        if step - self.first_step >= spec.timing_warmup_steps and not compiled:
            self._timed_s += dt
            self._timed_steps += 1
        return {
            "step_time_s": dt,
            "tokens_per_s": spec.tokens_per_step / dt,
            "tokens": (step + 1) * spec.tokens_per_step,
            **({"step_compile_s": self.last_compile_s} if compiled else {}),
        }

    @property
    def peak_kind(self) -> str:
        """What ``mem_peak_bytes`` measures (``PeakMemory.kind``); final only after ``summary()``."""
        return self.peak.kind

    def summary(self) -> dict[str, float]:
        """Means over the timed steps (``mean_step_time_s`` in s, ``mean_tokens_per_s``; NaN with none), peak
        memory and its growth since ``start()``, saved-for-backward bytes (measured under ``train.ac``, and
        ``mem_saved_activations_estimate_bytes``, the estimator's for the same mode), FP8 scaling-state bytes
        and the state bytes (``StateBytes.as_metrics``), all in bytes. Needs a step whose update ran."""
        if self.saved is None or self.state is None:
            raise RuntimeError("RunMeter.summary needs probe_saved_bytes and a step whose update ran")
        timed_s, n = self._timed_s, self._timed_steps
        peak_bytes = self.peak.read()
        return {
            "mean_step_time_s": timed_s / n if n else float("nan"),
            "compile_time_s": compile_time_now() - self._compile_start,
            "mean_tokens_per_s": self.spec.tokens_per_step * n / timed_s if n else float("nan"),
            "mem_peak_bytes": peak_bytes,
            "mem_peak_growth_bytes": peak_bytes - self.peak.baseline,
            "mem_saved_activations_bytes": self.saved.activations,
            "mem_saved_activations_estimate_bytes": self.saved_estimate,
            "mem_saved_weight_copies_bytes": self.saved.weight_copies,
            "mem_fp8_scaling_state_bytes": measure_fp8_scaling_bytes(self.built.model),
            **self.state.as_metrics(),
        }


@dataclass(frozen=True)
class StepReport:
    """One run's progress, as ``step_bar`` sends it to a reporter: ``desc`` (the recipe's name), ``n`` optimizer
    steps done of ``total``, ``postfix`` (``(name, value)`` pairs as the tqdm bar shows them: loss, tokens/s) and
    ``closed`` (the run's bar is gone: it ended or stopped). Picklable: an ablation's worker process sends it to the
    ablation's process."""

    desc: str
    n: int
    total: int
    postfix: tuple[tuple[str, str], ...] = ()
    closed: bool = False


StepReporter = Callable[[StepReport], None]
_reporter: StepReporter | None = None


@contextlib.contextmanager
def reporting_steps(reporter: StepReporter | None) -> Iterator[None]:
    """Send every ``step_bar``'s progress in this process to ``reporter`` for the body, instead of drawing tqdm bars
    (None: tqdm bars, as without it). Restores the previous reporter on exit."""
    global _reporter
    previous, _reporter = _reporter, reporter
    try:
        yield
    finally:
        _reporter = previous


def install_step_reporter(reporter: StepReporter | None) -> None:
    """``reporting_steps`` for the rest of this process's life (an ablation's worker process)."""
    global _reporter
    _reporter = reporter


class _ReportedBar:
    """The part of tqdm's interface the training loop uses (``n``, ``update``, ``set_postfix``, ``refresh``,
    ``close``), sending a ``StepReport`` to ``reporter`` instead of drawing."""

    def __init__(self, reporter: StepReporter, total: int, initial: int, desc: str):
        self._reporter, self.total, self.n, self.desc = reporter, total, initial, desc
        self._postfix: tuple[tuple[str, str], ...] = ()
        self._closed = False
        self.refresh()

    def update(self, k: int = 1) -> None:
        self.n += k  # sent with the postfix that follows each step (one report per step, not two)

    def set_postfix(self, **kw) -> None:
        self._postfix = tuple((k, str(v)) for k, v in kw.items())
        self.refresh()

    def refresh(self) -> None:
        if not self._closed:
            self._reporter(StepReport(self.desc, self.n, self.total, self._postfix))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._reporter(StepReport(self.desc, self.n, self.total, self._postfix, closed=True))


def step_bar(total: int, initial: int, desc: str, enabled: bool):
    """The loop's progress bar over ``total`` optimizer steps from ``initial``: with ``enabled`` and a reporter
    installed (``reporting_steps``), one that reports to it; else tqdm on stderr, shown only on a terminal
    (``disable=None``) and cleared when the run ends; not ``enabled``: nothing shown."""
    if enabled and _reporter is not None:
        return _ReportedBar(_reporter, total, initial, desc)
    return tqdm(
        total=total, initial=initial, desc=desc, disable=None if enabled else True, leave=False, dynamic_ncols=True
    )
