"""Per-layer FP8 health: an FP8 linear that keeps saturating or flushing to zero, and its switch to high precision.

On the steps the FP8 telemetry samples (``train.telemetry_every``; ``lowprec.measure.telemetry``), each lowprec FP8
linear's worst share over its three operand roles (``input``, ``weight``, ``grad_output``) and two statistics
(``overflow``: elements that saturate at the format's max; ``underflow``: non-zero elements that quantize to zero)
is compared with ``train.fp8_fallback_threshold``. A layer above it on ``train.fp8_fallback_samples`` consecutive
samples is reported once per such streak; with ``train.fp8_fallback=layer`` it is switched to high precision for
the rest of the run (``Float8Linear.fallback_kernel``: the run's compute dtype under its autocast, with the run's
BF16 kernel), as Megatron-LM and Transformer Engine keep sensitive layers out of FP8. Under torchrun every rank sees
its own shard and micro-batch, so the shares are max-reduced over ranks first: every rank switches the same layers
after the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lowprec.float8 import Float8Linear
from lowprec.float8.config import ROLES

STATS = ("overflow", "underflow")


@dataclass(frozen=True)
class LayerAlarm:
    """A layer whose worst share stayed above the threshold for the required samples: its FQN, the statistic and
    role of its worst share at the last sample, that share (0..1), and the sampled steps of the streak."""

    fqn: str
    stat: str
    role: str
    share: float
    steps: tuple[int, ...]


class FP8Health:
    """Streaks of above-threshold samples per lowprec FP8 linear of ``model``, and the switch.

    Args:
        model: the built model (its ``Float8Linear`` modules, by FQN).
        threshold: share (0, 1] above which a sample counts.
        samples: consecutive sampled steps above it before an alarm.
        every: the telemetry's sampling interval in steps (>= 1).
        switch: switch an alarmed layer to high precision (``train.fp8_fallback=layer``), else only report it.
        kernel: ``native`` | ``emulated``, the high-precision kernel of a switched layer (the run's BF16 one).
    """

    def __init__(self, model: nn.Module, threshold: float, samples: int, every: int, switch: bool, kernel: str):
        self.modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
        self.threshold, self.samples, self.every = threshold, samples, every
        self.switch, self.kernel = switch, kernel
        self.streaks: dict[str, list[int]] = {fqn: [] for fqn in self.modules}
        #: FQN -> what switched it (``LayerAlarm`` fields and ``from_step``, the first step in high precision).
        self.switched: dict[str, dict] = {}

    def worst(self, metrics: dict[str, float]) -> dict[str, tuple[float, str, str]]:
        """Per watched layer, ``(share, stat, role)`` of its largest overflow/underflow share in ``metrics`` (the
        step's telemetry), each share max-reduced over ranks first under torchrun (so every rank finds the same);
        ``(0.0, "", "")`` for a layer without a sample (one that runs in high precision). NaN shares (a step with
        non-finite values) count as 0."""
        keys = [(fqn, role, stat) for fqn in self.modules for role in ROLES for stat in STATS]
        shares = [metrics.get(f"fp8/{fqn}/{role}/{stat}", 0.0) for fqn, role, stat in keys]
        shares = [0.0 if math.isnan(v) else v for v in shares]
        if dist.is_available() and dist.is_initialized() and keys:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            t = torch.tensor(shares, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            shares = t.tolist()
        out: dict[str, tuple[float, str, str]] = {fqn: (0.0, "", "") for fqn in self.modules}
        for (fqn, role, stat), v in zip(keys, shares):
            if v > out[fqn][0]:
                out[fqn] = (float(v), stat, role)
        return out

    def observe(self, step: int, metrics: dict[str, float]) -> list[LayerAlarm]:
        """After step ``step`` (call on every step; only sampled ones, ``step % every == 0``, count): update the
        streaks from the step's telemetry ``metrics`` and return the layers whose streak reached ``samples`` at this
        step (each switched first when ``switch``: from step ``step + 1`` on)."""
        if step % self.every != 0 or not self.modules:
            return []
        alarms = []
        for fqn, (share, stat, role) in self.worst(metrics).items():
            if fqn in self.switched:
                continue
            streak = self.streaks[fqn]
            if share > self.threshold:
                streak.append(step)
            else:
                streak.clear()
            if len(streak) == self.samples:  # once per streak
                alarms.append(LayerAlarm(fqn, stat, role, share, tuple(streak)))
        for a in alarms:
            if self.switch:
                self.switched[a.fqn] = {"stat": a.stat, "role": a.role, "share": a.share, "from_step": step + 1}
                self.modules[a.fqn].fallback_kernel = self.kernel
        return alarms

    def record(self) -> dict:
        """The effective recipe's ``fp8_fallback`` entry (empty when no layer switched): which layers run in high
        precision since which step, and why."""
        if not self.switched:
            return {}
        return {
            "fp8_fallback": {
                "layers": {f: dict(v) for f, v in sorted(self.switched.items())},
                "kernel": self.kernel,
                "fp8_linears_left": len(self.modules) - len(self.switched),
            }
        }

    def state_dict(self) -> dict:
        return {"streaks": {f: list(s) for f, s in self.streaks.items()}, "switched": dict(self.switched)}

    def load_state_dict(self, state: dict, keep_switched: bool = False) -> None:
        """Restore streaks and switched layers (applying the switches). ``keep_switched``: layers switched now stay
        switched (a rollback: a switch holds for the rest of the run)."""
        self.streaks = {f: list(state["streaks"].get(f, [])) for f in self.modules}
        switched = dict(state["switched"])
        if keep_switched:
            switched = {**switched, **self.switched}
        self.switched = switched
        for fqn, m in self.modules.items():
            m.fallback_kernel = self.kernel if fqn in self.switched else None
