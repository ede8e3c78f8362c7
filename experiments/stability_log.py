"""Per-run loss-stability metrics, logged to MLflow at the run's last step (finished or failed).

``StabilityRecorder`` sits between the training loop and the MLflow sink: it forwards every step's metrics and
keeps the ``loss`` and ``grad_norm`` series and the loss scaler's skipped-step counter, so that when the run ends,
however it ends, ``experiments.stats.stability_metrics`` turns them into spike counts, the largest excursion,
non-finite events and the divergence step (rule: ``experiments/stats/stability.py``, parameters ``stability.*``).
A run stopped by a non-finite loss records that step as a non-finite value, so a run that blows up at its end
counts as diverged there.
"""

from __future__ import annotations

import math

from experiments.stats import SpikeRule, StabilityMetrics, stability_metrics
from lowprec.train.loop import MetricSink


def rule_tag(rule: SpikeRule) -> str:
    """The spike rule as the one-line ``stability_rule`` tag of a run."""
    return (
        f"loss/grad-norm spike: value - EMA(span {rule.ema_window}) of the previous steps > {rule.k:g} robust sd "
        f"(MAD of step differences over {rule.sd_window} steps, from {rule.min_history}); divergence: stays "
        f"non-finite or > {rule.divergence_factor:g}x the first loss to the end"
    )


class StabilityRecorder:
    """A ``MetricSink`` that forwards to ``sink`` and records the series the stability metrics need.

    Args:
        sink: where every step's metrics go (the run's ``MetricBuffer``).
        rule: spike and divergence parameters.
    """

    def __init__(self, sink: MetricSink, rule: SpikeRule):
        self.sink, self.rule = sink, rule
        self.loss: list[float] = []
        self.grad_norm: list[float] = []
        self.skipped = 0.0
        self.last_step = -1

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss" in metrics:
            self.loss.append(float(metrics["loss"]))
            self.grad_norm.append(float(metrics.get("grad_norm", math.nan)))
            self.skipped = float(metrics.get("loss_scale_skipped_steps", self.skipped))
            self.last_step = step
        self.sink.log_metrics(metrics, step)

    def record_failed_step(self, loss: float, grad_norm: float) -> None:
        """The step after the last logged one stopped the run (``NonFiniteError``): its loss and grad norm,
        one of them non-finite, are part of the series though the step never reached the sink."""
        self.loss.append(float(loss))
        self.grad_norm.append(float(grad_norm))
        self.last_step += 1

    def metrics(self) -> StabilityMetrics | None:
        """The run's stability metrics; None before any step."""
        if not self.loss:
            return None
        return stability_metrics(self.loss, self.grad_norm, skipped_steps=int(self.skipped), rule=self.rule)

    def log_summary(self) -> None:
        """Log ``StabilityMetrics.as_metrics()`` (``stability/*``) at the last step; nothing before any step."""
        m = self.metrics()
        if m is not None:
            self.sink.log_metrics(m.as_metrics(), max(self.last_step, 0))
