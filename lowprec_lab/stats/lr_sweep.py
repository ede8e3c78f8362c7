"""The learning-rate study's statistics: one row per grid point, and the setting a verdict experiment should train.

A row summarises one ablation of the grid (``lowprec_lab.plan.grid``): the control's final validation loss over
seeds, how many of its runs spiked (the stability detector's loss and grad-norm events,
``lowprec_lab.stats.stability``), and the paired relative difference of one real precision change against the
control (e.g. ``fp32`` against ``bf16``): its sd over seeds is the noise a verdict at that setting rests on.

The choice (``choose``): among the points whose control had no loss spike and no divergence in any run and whose mean
final loss is within ``within`` (1%) of the best point's, the one with the smallest paired sd (ties: the lower
loss). Turning the learning
rate down until every pair agrees is the degenerate way to a conclusive verdict; the loss condition is what keeps
the control trained well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lowprec_lab.stats.noise import seeds_for_zero_gap

#: The chosen setting's control must end within this share of the sweep's best final loss.
WITHIN_BEST = 0.01


@dataclass(frozen=True)
class SweepRow:
    """One grid point. ``point``: its settings (dotted key -> value). ``seeds``: control runs with a finite final
    loss; ``loss_mean``/``loss_sd``: their final validation loss in nats (sd over seeds, None below 2).
    ``spiking_runs``/``runs``: control runs with at least one loss or grad-norm spike, of all control runs;
    ``loss_spikes``/``grad_spikes``: the events summed over the control's runs; ``diverged``: control runs that
    diverged or ended non-finite. ``pair``: the compared recipe; ``pairs``: seeds where both finished finite;
    ``paired_mean``/``paired_sd``: mean and sd over those seeds of (pair - control) / control (dimensionless; sd
    None below 2 pairs); ``seeds_needed``: the seeds a zero-gap recipe with that paired sd needs for a
    ``non-inferior`` verdict at the margin (``seeds_for_zero_gap``). ``gap_to_best``: (loss_mean - best) / best,
    set by ``rank``; ``chosen``: the point ``choose`` picked."""

    point: dict
    seeds: int
    loss_mean: float | None
    loss_sd: float | None
    runs: int
    spiking_runs: int
    loss_spikes: int
    grad_spikes: int
    diverged: int
    pair: str | None
    pairs: int
    paired_mean: float | None
    paired_sd: float | None
    seeds_needed: int | None
    gap_to_best: float | None = None
    chosen: bool = False

    @property
    def stable(self) -> bool:
        """No control run had a loss spike or diverged, and at least one finished. Grad-norm spikes are counted
        but do not disqualify: on ``tiny`` the detector flags them at every learning rate of the sweep, down to
        7.5e-4 where ``bf16`` and ``fp32`` stay within 0.004% of each other (docs/lr-study.md), so they do not mark
        the instability that parts the pairs; the paired sd measures that directly."""
        return self.seeds > 0 and self.loss_spikes == 0 and self.diverged == 0

    def as_dict(self) -> dict:
        return {**asdict(self), "stable": self.stable}


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def sweep_row(
    point: Mapping,
    control: Mapping[int, float | None],
    spikes: Mapping[int, tuple[int, int, bool]],
    pair: str | None,
    paired: Mapping[int, float | None],
    margin: float,
    alpha: float,
) -> SweepRow:
    """One grid point's row.

    Args:
        point: the point's settings (dotted key -> value).
        control: seed -> the control's final validation loss (nats; None or non-finite: the run did not finish).
        spikes: seed -> (loss spikes, grad-norm spikes, diverged) of the control's run.
        pair: the compared recipe's name (None: no pair in this ablation).
        paired: seed -> the compared recipe's final validation loss (nats).
        margin: the relative non-inferiority margin; alpha: the one-sided level (``seeds_for_zero_gap``).
    """
    finite = {s: v for s, v in control.items() if _finite(v)}
    values = np.array(list(finite.values()), dtype=np.float64)
    both = sorted(s for s in finite if _finite(paired.get(s)))
    d = np.array([(paired[s] - finite[s]) / finite[s] for s in both], dtype=np.float64)
    sd = float(d.std(ddof=1)) if d.size >= 2 else None
    return SweepRow(
        point=dict(point),
        seeds=len(finite),
        loss_mean=float(values.mean()) if values.size else None,
        loss_sd=float(values.std(ddof=1)) if values.size >= 2 else None,
        runs=len(control),
        spiking_runs=sum(1 for ls, gs, _ in spikes.values() if ls or gs),
        loss_spikes=sum(ls for ls, _, _ in spikes.values()),
        grad_spikes=sum(gs for _, gs, _ in spikes.values()),
        diverged=sum(1 for s, (_, _, div) in spikes.items() if div or not _finite(control.get(s))),
        pair=pair,
        pairs=len(both),
        paired_mean=float(d.mean()) if d.size else None,
        paired_sd=sd,
        seeds_needed=seeds_for_zero_gap(sd, margin, alpha) if sd is not None else None,
    )


def rank(rows: Sequence[SweepRow], within: float = WITHIN_BEST) -> tuple[list[SweepRow], SweepRow | None]:
    """``rows`` with ``gap_to_best`` set and the chosen one marked (``choose``), and the chosen row (None when no
    point qualifies: every stable point is over ``within`` from the best, or none is stable)."""
    losses = [r.loss_mean for r in rows if r.loss_mean is not None and r.diverged == 0]
    best = min(losses) if losses else None
    out = [
        r if best is None or r.loss_mean is None else _with(r, gap_to_best=(r.loss_mean - best) / best) for r in rows
    ]
    pick = choose(out, within)
    out = [_with(r, chosen=True) if r is pick else r for r in out]
    return out, next((r for r in out if r.chosen), None)


def choose(rows: Sequence[SweepRow], within: float = WITHIN_BEST) -> SweepRow | None:
    """Among stable rows (``SweepRow.stable``) whose ``gap_to_best`` is at most ``within``, the smallest paired sd
    (a row without one counts as infinite), ties to the lower loss; None when none qualifies."""
    # a point exactly at the boundary counts as within (its gap computed from two rounded losses)
    ok = [r for r in rows if r.stable and r.gap_to_best is not None and r.gap_to_best <= within * (1 + 1e-9)]
    if not ok:
        return None
    return min(ok, key=lambda r: (r.paired_sd if r.paired_sd is not None else math.inf, r.loss_mean))


def _with(r: SweepRow, **kw) -> SweepRow:
    return SweepRow(**{**asdict(r), **kw})
