"""The health monitor: every step's loss and gradient norm, the FP8 linears on sampled steps, and the policy.

Checks (``AnomalyEvent.kind``), each step after backward and clipping and before the optimizer step:

- ``nonfinite_loss``, ``nonfinite_grad_norm``: NaN or inf. A non-finite gradient norm under dynamic loss scaling is
  the loss scaler's business (it skips the step and lowers the scale, as always) and is not an anomaly.
- ``loss_spike``, ``grad_norm_spike``: the lab's one spike rule (``lowprec.measure.spikes``, parameters
  ``stability.*``), applied online with the same numbers as the ``stability/*`` metrics computed at the end of the
  run over the logged series.
- ``fp8_overflow``, ``fp8_underflow`` (sampled steps, ``lowprec.train.fp8_fallback``): an FP8 linear whose share
  stayed above ``train.fp8_fallback_threshold`` on ``train.fp8_fallback_samples`` consecutive samples.

Policy (``train.on_anomaly``) for a non-finite value or a loss spike; grad-norm spikes are recorded only (clipping
already bounds their update), FP8 alarms are the FP8 fallback's (``train.fp8_fallback``):

- ``fail`` (default): a non-finite value fails the run (``NonFiniteError``, as before the monitor existed); a spike
  is recorded and the step applied: a spike is not an error.
- ``skip``: the step's update is dropped (no optimizer step, no loss-scaler update, no LR-schedule step, and the
  model's buffers, delayed-scaling amax histories included, are put back as they were before the step), so the run
  goes on as one that never saw that batch, one LR-schedule position later (Megatron-LM's skipped iteration). More
  than ``train.max_consecutive_skips`` skipped steps in a row (a NaN in the weights: nothing a skip can fix) fail
  the run.
- ``rollback``: reload the last complete, verified checkpoint and skip the offending batch
  (``lowprec.train.data_position``), at most ``train.max_rollbacks`` times in the run's whole training (resumes
  included), then fail; an anomaly before the first checkpoint fails the run (nothing to roll back to).

Every event is handed to ``on_event`` as it happens (the run records it in MLflow) with its action (``failed``,
``skipped``, ``rolled_back``, ``recorded``, ``fp8_fallback``), and ``pop_metrics`` gives the ``anomaly/*`` counters to
log at the event's step. Under torchrun every rank decides alike: the loss and the gradient norm are global values
and the FP8 shares are max-reduced over ranks.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lowprec.measure.spikes import OnlineSpikes, SpikeRule
from lowprec.train.build import Built
from lowprec.train.data_position import DataPosition
from lowprec.train.fp8_fallback import FP8Health, LayerAlarm
from lowprec.train.spec import TrainSpec
from lowprec.train.step import AnomalyError, NonFiniteError, StepDecision

KINDS = ("nonfinite_loss", "nonfinite_grad_norm", "loss_spike", "grad_norm_spike", "fp8_overflow", "fp8_underflow")
#: The kinds the ``train.on_anomaly`` policy acts on.
ACTING = ("nonfinite_loss", "nonfinite_grad_norm", "loss_spike")


def _json_float(x: float | None) -> float | str | None:
    """NaN and inf as strings, so the events are strict JSON."""
    return x if x is None or math.isfinite(x) else str(x)


@dataclass(frozen=True)
class AnomalyEvent:
    """One anomaly: ``step`` (0-based optimizer step), ``kind`` (``KINDS``), ``value`` (the loss in nats, the
    gradient norm, or the share 0..1), ``threshold`` (what it was compared with: a spike's ``EMA + k * robust sd``,
    the FP8 share threshold; None for a non-finite value), ``action`` (``failed``, ``skipped``, ``rolled_back``,
    ``recorded`` or ``fp8_fallback``), ``batch`` (the batch index the step trained on), ``layer`` (an FP8 linear's
    FQN) and ``detail`` (one line: the role and streak, the checkpoint rolled back to, the limit reached)."""

    step: int
    kind: str
    value: float
    threshold: float | None
    action: str
    batch: int | None = None
    layer: str | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON form (non-finite numbers as strings; absent fields left out)."""
        d = asdict(self)
        d["value"], d["threshold"] = _json_float(self.value), _json_float(self.threshold)
        return {k: v for k, v in d.items() if v is not None and v != ""}


class HealthMonitor:
    """Checks, policy, events and the state a checkpoint must carry for them (module docstring).

    Args:
        built: the run's objects (its FP8 linears, its BF16 kernel for a switched layer).
        spec: ``on_anomaly``, ``max_rollbacks``, ``max_consecutive_skips``, the ``fp8_fallback`` fields,
            ``skip_batches``, ``telemetry_every``, ``checkpoint_every``.
        rule: the spike rule (``stability.*``).
        on_event: receives every ``AnomalyEvent`` as it happens.
    """

    def __init__(
        self,
        built: Built,
        spec: TrainSpec,
        rule: SpikeRule = SpikeRule(),
        on_event: Callable[[AnomalyEvent], None] = lambda e: None,
    ):
        self.built, self.spec, self.on_event = built, spec, on_event
        self.loss = OnlineSpikes(rule)
        self.grad_norm = OnlineSpikes(rule)
        self.data = DataPosition(spec.skip_batches)
        self.fp8 = None
        if spec.telemetry_every > 0:
            self.fp8 = FP8Health(
                built.model,
                spec.fp8_fallback_threshold,
                spec.fp8_fallback_samples,
                spec.telemetry_every,
                switch=spec.fp8_fallback == "layer",
                kernel=built.kernels.bf16,
            )
        #: Counters over the run's whole training (a resume continues them): events per kind and actions taken.
        self.counts: Counter[str] = Counter()
        self.rollbacks = 0
        self.consecutive_skips = 0
        #: The step count of the newest checkpoint a rollback can reload (None: none yet).
        self.checkpoint_step: int | None = None
        self.events: list[AnomalyEvent] = []
        self._pending: dict[str, float] = {}
        self._batch: int | None = None
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- the step ----------------------------------------------------------------------------------------------
    def batch(self, step: int) -> int:
        """The batch index step ``step`` trains on; remembered for the step's events. Under ``skip`` the model's
        buffers are saved here, to be put back if the step is dropped (``restore_buffers``)."""
        self._batch = self.data.batch(step)
        if self.spec.on_anomaly == "skip":
            self._buffers = [(b, b.detach().clone()) for b in self.built.model.buffers()]
        return self._batch

    @torch.no_grad()
    def restore_buffers(self) -> None:
        """Put the buffers saved before the step back (a dropped step leaves no amax in any history)."""
        for b, v in self._buffers:
            b.copy_(v)

    def judge(self, step: int, loss: float, grad_norm: float, scaler_skips: bool) -> StepDecision:
        """The ``train_step`` judge: test the step's loss and gradient norm, record what was found and return the
        policy's decision; raises ``NonFiniteError`` (a non-finite value) or ``AnomalyError`` (a spike) when the
        policy fails the run."""
        lt, gt = self.loss.update(loss), self.grad_norm.update(grad_norm)
        found: list[tuple[str, float, float | None]] = []
        if not math.isfinite(loss):
            found.append(("nonfinite_loss", loss, None))
        elif not math.isfinite(grad_norm) and not scaler_skips:
            found.append(("nonfinite_grad_norm", grad_norm, None))
        if lt.spike:
            found.append(("loss_spike", loss, lt.threshold))
        if gt.spike:
            found.append(("grad_norm_spike", grad_norm, gt.threshold))
        acting = [f for f in found if f[0] in ACTING]
        if not acting:
            self.consecutive_skips = 0
            for kind, value, threshold in found:
                self._event(step, kind, value, threshold, "recorded")
            return StepDecision()
        kind, value, _ = acting[0]
        nonfinite = kind.startswith("nonfinite")
        policy = self.spec.on_anomaly
        if policy == "fail":
            if nonfinite:
                self._record_all(step, found, "failed")
                what = "loss" if kind == "nonfinite_loss" else "grad_norm"
                tail = "" if what == "loss" else f" (loss {loss:.4f})"
                raise NonFiniteError(f"{what} is {value} at step {step}{tail}", step, loss, grad_norm)
            self._record_all(step, found, "recorded")  # a spike under fail: recorded, the step applied
            return StepDecision()
        if policy == "skip":
            self.consecutive_skips += 1
            if self.consecutive_skips > self.spec.max_consecutive_skips:
                limit = f"train.max_consecutive_skips={self.spec.max_consecutive_skips} exhausted"
                self._fail(step, found, loss, grad_norm, limit)
            self._record_all(step, found, "skipped", f"update dropped ({self.consecutive_skips} in a row)")
            self._count("skipped_steps")
            return StepDecision(apply=False)
        if self.checkpoint_step is None:  # before the first checkpoint: a NaN fails, a spike is recorded
            none_yet = f"no checkpoint to roll back to yet (train.checkpoint_every={self.spec.checkpoint_every})"
            if nonfinite:
                self._fail(step, found, loss, grad_norm, none_yet)
            self._record_all(step, found, "recorded", none_yet)
            return StepDecision()
        if self.rollbacks >= self.spec.max_rollbacks:
            self._fail(step, found, loss, grad_norm, f"train.max_rollbacks={self.spec.max_rollbacks} exhausted")
        self.rollbacks += 1
        batch = self._batch if self._batch is not None else self.data.batch(step)
        self.data.skip(batch)
        detail = f"reload step_{self.checkpoint_step}, skip batch {batch} (rollback {self.rollbacks})"
        self._record_all(step, found, "rolled_back", detail)
        self._count("rollbacks")
        return StepDecision(apply=False, rollback=True)

    def _fail(self, step: int, found, loss: float, grad_norm: float, limit: str) -> None:
        self._record_all(step, found, "failed", limit)
        kind, value, _ = next(f for f in found if f[0] in ACTING)
        what = {"nonfinite_loss": "loss is", "nonfinite_grad_norm": "grad_norm is", "loss_spike": "loss spike"}[kind]
        msg = f"{what} {value} at step {step}: {limit}"
        raise (NonFiniteError if kind.startswith("nonfinite") else AnomalyError)(msg, step, loss, grad_norm)

    def checkpoint_written(self, steps_taken: int) -> None:
        """A complete checkpoint of ``steps_taken`` steps exists (written, or resumed from): rollbacks can reload
        it."""
        self.checkpoint_step = steps_taken

    def observe_fp8(self, step: int, metrics: dict[str, float]) -> list[LayerAlarm]:
        """After step ``step``'s telemetry (``metrics``): FP8 alarms, recorded, and switched under
        ``train.fp8_fallback=layer`` (returns them; the effective recipe changes when any switched)."""
        if self.fp8 is None:
            return []
        alarms = self.fp8.observe(step, metrics)
        for a in alarms:
            streak = ", ".join(map(str, a.steps))
            detail = f"{a.role} {a.stat} above the threshold at sampled steps {streak}"
            action = "recorded"
            if a.fqn in self.fp8.switched:
                action = "fp8_fallback"
                detail += f"; high precision ({self.fp8.kernel} kernel) from step {step + 1}"
                self._count("fp8_fallback_layers")
            threshold = self.spec.fp8_fallback_threshold
            self._event(step, f"fp8_{a.stat}", a.share, threshold, action, layer=a.fqn, detail=detail)
        return alarms

    def effective(self) -> dict:
        """What the effective recipe must record of the monitor: ``fp8_fallback`` once a layer was switched."""
        return self.fp8.record() if self.fp8 is not None else {}

    # ---- events and metrics ------------------------------------------------------------------------------------
    def _record_all(self, step: int, found, action: str, detail: str = "") -> None:
        """One event per finding; the policy's action and ``detail`` go to the kinds it acts on, the others are
        recorded."""
        for kind, value, threshold in found:
            acted = kind in ACTING
            self._event(step, kind, value, threshold, action if acted else "recorded", detail=detail if acted else "")

    def _event(self, step, kind, value, threshold, action, layer=None, detail: str = "") -> None:
        batch = None if layer is not None else self._batch
        e = AnomalyEvent(step, kind, float(value), threshold, action, batch, layer, detail)
        self.events.append(e)
        self._count(kind)
        self.on_event(e)

    def _count(self, key: str) -> None:
        self.counts[key] += 1
        self._pending[f"anomaly/{key}"] = float(self.counts[key])

    def pop_metrics(self) -> dict[str, float]:
        """The ``anomaly/*`` counters changed since the last call (cumulative counts: events per kind,
        ``skipped_steps``, ``rollbacks``, ``fp8_fallback_layers``), to log at the current step."""
        out, self._pending = self._pending, {}
        return out

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything the next step's checks and policy read: spike-rule histories, FP8 streaks and switched layers,
        skipped batches, the rollback count, the counters (plain Python values)."""
        return {
            "loss": self.loss.state_dict(),
            "grad_norm": self.grad_norm.state_dict(),
            "fp8": self.fp8.state_dict() if self.fp8 is not None else None,
            "data": self.data.state_dict(),
            "rollbacks": self.rollbacks,
            "consecutive_skips": self.consecutive_skips,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict) -> None:
        """A resume: continue exactly where the checkpoint's run was."""
        self._load_history(state, keep_switched=False)
        self.data.load_state_dict(state["data"])
        self.rollbacks = int(state["rollbacks"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.counts = Counter({k: int(v) for k, v in state["counts"].items()})

    def rolled_back(self, state: dict | None) -> None:
        """After a rollback reloaded a checkpoint whose monitor state is ``state`` (None: a checkpoint written
        before the monitor existed): its spike histories and FP8 streaks come back; what the rollback decided stays
        (skipped batches, the rollback count, counters; switched FP8 layers stay switched)."""
        if state is not None:
            self._load_history(state, keep_switched=True)
        self.consecutive_skips = 0

    def _load_history(self, state: dict, keep_switched: bool) -> None:
        self.loss.load_state_dict(state["loss"])
        self.grad_norm.load_state_dict(state["grad_norm"])
        if self.fp8 is not None and state.get("fp8") is not None:
            self.fp8.load_state_dict(state["fp8"], keep_switched=keep_switched)
