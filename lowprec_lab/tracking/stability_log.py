"""Per-run loss-stability metrics: logged to MLflow at the run's last step (finished or failed), and read back.

``StabilityRecorder`` sits between the training loop and the MLflow sink: it forwards every step's metrics and
keeps the ``loss`` and ``grad_norm`` series and the loss scaler's skipped-step counter, so that when the run ends,
however it ends, ``lowprec_lab.stats.stability_metrics`` turns them into spike counts, the largest excursion,
non-finite events and the divergence step (rule: ``lowprec_lab/stats/stability.py``, parameters ``stability.*``).
A run stopped by a non-finite loss records that step as a non-finite value, so a run that blows up at its end
counts as diverged there. ``run_stability`` reads them back for the report (a ``RunData``: ``metrics``, ``curves``).
"""

from __future__ import annotations

import math

from lowprec.train.loop import MetricSink
from lowprec_lab.stats import SpikeRule, StabilityMetrics, stability_metrics


def rule_tag(rule: SpikeRule) -> str:
    """The spike rule as the one-line ``stability_rule`` tag of a run."""
    return (
        f"loss/grad-norm spike: value - EMA(span {rule.ema_window}) of the previous steps > {rule.k:g} robust sd "
        f"(of those residuals over {rule.sd_window} steps after a degree-4 trend, MAD or 98th percentile, from "
        f"{rule.min_history}); spikes counted as events; divergence: stays "
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

    def flush(self) -> None:
        """Hand the buffered metrics to the tracking store now (the loop calls it after each checkpoint)."""
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            flush()

    def carry(self, loss: list[float], grad_norm: list[float], skipped: float) -> None:
        """Start from the series of steps ``0 .. len(loss)-1`` that an interrupted run logged before the checkpoint it
        continues from (``lowprec_lab.runner.continued_runs.history_before``), so the continued run's stability metrics
        cover all its steps, as an uninterrupted run's do."""
        self.loss, self.grad_norm = [float(x) for x in loss], [float(x) for x in grad_norm]
        self.skipped = float(skipped)
        self.last_step = len(self.loss) - 1

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


#: The ``stability/*`` metric every run logs at its last step (``StabilityMetrics.as_metrics``) since they exist.
STABILITY_KEY = "stability/loss_spikes"


def run_stability(r) -> StabilityMetrics | None:
    """The run's stability metrics (``lowprec_lab.stats.stability``): the ``stability/*`` metrics the run logged
    at its last step (finished or failed), else, for a run that predates them, recomputed here from its logged
    ``loss`` and ``grad_norm`` curves with the default ``SpikeRule``. The one place that fallback lives.

    A run stopped by ``NonFiniteError`` never logged the step that stopped it, so its recomputed series may end
    finite; ``lowprec_lab.report.verdict_table.judged_stability`` counts such a run as diverged from its failure reason.
    Spike steps are not logged: ``loss_spike_steps`` is empty for logged metrics. Returns None for a run without a
    loss (it stopped before its first step).
    """
    if STABILITY_KEY in r.metrics:
        return _logged_stability(r)
    loss = [v for _, v in r.curves.get("loss", [])]
    grad = [v for _, v in r.curves.get("grad_norm", [])]
    if not loss:
        return None
    return stability_metrics(loss, grad or None)


def stability_rule_of(r, tags: dict) -> str:
    """The spike rule of ``run_stability``'s figures: the run's tag when it logged them, else the default rule."""
    if STABILITY_KEY in r.metrics:
        return tags.get("stability_rule", "")
    return f"{rule_tag(SpikeRule())} (recomputed by the report)" if r.stability else ""


def _logged_stability(r) -> StabilityMetrics:
    m = r.metrics
    diverged = m.get("stability/diverged", 0.0) > 0
    steps = len(r.curves.get("loss", []))
    grad = m.get("stability/grad_norm_spikes")
    return StabilityMetrics(
        steps=steps,
        loss_spikes=int(m[STABILITY_KEY]),
        loss_spike_steps=(),
        largest_excursion=m.get("stability/loss_max_excursion", 0.0),
        nonfinite_loss=int(m.get("stability/loss_nonfinite", 0)),
        # a diverged run always logs its divergence step; the last step stands in for one that is missing
        divergence_step=int(m.get("stability/divergence_step", max(steps - 1, 0))) if diverged else None,
        grad_norm_spikes=None if grad is None else int(grad),
        nonfinite_grad_norm=None if grad is None else int(m.get("stability/grad_norm_nonfinite", 0)),
        skipped_steps=int(m.get("stability/skipped_steps", 0)),
    )
