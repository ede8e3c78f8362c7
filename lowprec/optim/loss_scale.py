"""Dynamic loss scaling for FP16 training, with ``torch.amp.GradScaler`` semantics, on any device.

FP16 has 5 exponent bits: gradients below its smallest subnormal 2**-24 ~ 6e-8 flush to zero (and
below 2**-14 ~ 6e-5 lose precision). Multiplying the loss by ``S`` multiplies every gradient by ``S`` and
lifts them into range; before the optimizer step the gradients are divided by ``S`` again. ``S`` is
adapted: a step whose gradients hold inf/NaN is skipped and ``S *= backoff_factor``; after
``growth_interval`` consecutive clean steps ``S *= growth_factor`` (Micikevicius et al., "Mixed Precision
Training", arXiv 1710.03740; ``torch.amp.GradScaler``; Megatron ``DynamicGradScaler``). BF16 has FP32's
exponent range and needs no scaling: recipes without FP16 use ``NoLossScaler``, so the training loop makes
the same calls for every recipe::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # before gradient clipping
    clip_grad_norm_(...)                # inf on an overflow step; the step is then skipped
    scaler.step(optimizer)              # -> False if skipped
    scaler.update()

Everything is plain Python state (``scale``, counters), so it can be logged and checkpointed.
Unlike ``GradScaler`` there is no per-device ``_amp_foreach_non_finite_check_and_unscale_`` kernel: the
unscale is ``grad.mul_(1/S)`` and the inf check ``isfinite(grad).all()`` per gradient, with one host sync
in ``step``. On DTensor gradients the reductions are global; with local sharded gradients (no DTensor)
the caller must all-reduce the found-inf flag across ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class DynamicLossScaler:
    """Dynamic loss scaler (``torch.amp.GradScaler`` semantics, device-agnostic, inspectable).

    Args: ``init_scale`` (the first ``S``), ``growth_factor`` (> 1), ``backoff_factor`` (in (0, 1)),
    ``growth_interval`` (clean steps before growth, >= 1), ``enabled`` (False: every method is a no-op
    pass-through, ``scale`` is 1). Counters: ``skipped_steps`` (steps skipped for inf/NaN), ``steps``
    (calls to ``step``), ``growths``, ``backoffs``; ``last_step_skipped``. Raises ``ValueError`` for bad
    arguments and ``RuntimeError`` when the call order is wrong (``unscale_`` twice in a step, ``update``
    without ``step``).

    Note: the brief named both a ``scale(loss)`` method and a ``scale`` property; a class cannot have both,
    so as in ``GradScaler`` the method is ``scale(loss)`` and the factor is ``get_scale()`` /
    ``loss_scale``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                f"invalid loss-scaler arguments init_scale={init_scale} growth_factor={growth_factor} "
                f"backoff_factor={backoff_factor} growth_interval={growth_interval}"
            )
        self.enabled = enabled
        self._scale = float(init_scale) if enabled else 1.0
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self.skipped_steps = 0
        self.steps = 0
        self.growths = 0
        self.backoffs = 0
        self.last_step_skipped = False
        self._found_inf: Tensor | None = None  # set by unscale_, consumed by step/update
        self._stepped = False

    # ---- inspection -------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current loss scale ``S`` (1.0 when disabled)."""
        return self._scale

    @property
    def loss_scale(self) -> float:
        """The current loss scale ``S`` (1.0 when disabled)."""
        return self._scale

    @property
    def skips_nonfinite(self) -> bool:
        """True when a non-finite gradient is handled by skipping the step (the loop must not raise)."""
        return self.enabled

    def metrics(self) -> dict[str, float]:
        """``loss_scale`` and ``loss_scale_skipped_steps`` for logging (empty when disabled)."""
        if not self.enabled:
            return {}
        return {"loss_scale": self._scale, "loss_scale_skipped_steps": float(self.skipped_steps)}

    # ---- the step ---------------------------------------------------------------------------------
    def scale(self, loss: Tensor) -> Tensor:
        """``loss * S`` (``loss`` itself when disabled). Call ``.backward()`` on the result."""
        if not self.enabled:
            return loss
        return loss * self._scale

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient of ``optimizer.param_groups`` by ``S`` in place and record whether any holds
        inf/NaN. Call once per step, after backward and before clipping; ``step`` calls it if needed."""
        if not self.enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        inv = 1.0 / self._scale
        found = None
        for g in _grads(optimizer):
            bad = ~torch.isfinite(g).all()
            found = bad if found is None else found | bad
            g.mul_(inv)
        self._found_inf = found if found is not None else torch.zeros((), dtype=torch.bool)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs) -> bool:
        """``optimizer.step(*args, **kwargs)`` unless the unscaled gradients hold inf/NaN; returns True if the
        step ran. Disabled: always steps and returns True."""
        self.steps += 1
        if not self.enabled:
            optimizer.step(*args, **kwargs)
            return True
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = True
        self.last_step_skipped = bool(self._found_inf.item())
        if self.last_step_skipped:
            self.skipped_steps += 1
            return False
        optimizer.step(*args, **kwargs)
        return True

    def update(self) -> None:
        """Back off (``S *= backoff_factor``) after a skipped step; grow (``S *= growth_factor``) after
        ``growth_interval`` consecutive clean steps. Call once per step after ``step``."""
        if not self.enabled:
            return
        if not self._stepped:
            raise RuntimeError("update() called without a preceding step() in this iteration")
        if self.last_step_skipped:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
            self.backoffs += 1
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
                self.growths += 1
        self._found_inf = None
        self._stepped = False

    def discard_step(self) -> None:
        """Forget this step's ``unscale_`` without ``step``/``update``: the caller drops the step's update (a health
        policy, ``lowprec.train.health``), so the scale and every counter stay as they were before the step."""
        self._found_inf = None
        self._stepped = False

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Scale, factors, growth tracker and counters (plain Python numbers)."""
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "growth_tracker": self._growth_tracker,
            "skipped_steps": self.skipped_steps,
            "steps": self.steps,
            "growths": self.growths,
            "backoffs": self.backoffs,
            "enabled": self.enabled,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``; raises ``ValueError`` when enabled-ness differs."""
        if bool(state.get("enabled", True)) != self.enabled:
            raise ValueError(
                f"loss-scaler state was saved with enabled={state.get('enabled')}, this one is {self.enabled}"
            )
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["growth_tracker"])
        for k in ("skipped_steps", "steps", "growths", "backoffs"):
            setattr(self, k, int(state.get(k, 0)))
        self._found_inf, self._stepped = None, False


class NoLossScaler(DynamicLossScaler):
    """The same interface doing nothing: ``scale(loss)`` is ``loss``, ``step`` always steps, ``S`` is 1."""

    def __init__(self) -> None:
        super().__init__(enabled=False)


@torch.no_grad()
def grad_underflow_share(params) -> float:
    """Share (0..1) of gradient elements that are exactly zero, over all ``params`` with a ``.grad``.

    Shows FP16 underflow: without loss scaling small gradients flush to 0. Returns NaN when no
    parameter has a gradient. ``params``: an iterable of tensors (e.g. ``model.parameters()``).
    Some zeros are structural, not underflow: embedding rows of tokens absent from the batch (about half
    of the debug model's gradient elements at batch 2 x 32); leave ``tok_embeddings`` out, or compare
    with the same step of an FP32/BF16 run.
    """
    zeros = total = 0
    for p in params:
        if p.grad is not None:
            zeros += int((p.grad == 0).sum())
            total += p.grad.numel()
    return zeros / total if total else float("nan")
