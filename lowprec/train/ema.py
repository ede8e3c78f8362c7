"""``train.eval_ema``: an FP32 exponential moving average of the trained weights, evaluated beside them.

The average never feeds back into training: it is updated from the weights the optimizer steps (the FP32 masters
where the optimizer keeps them, else the parameters, upcast) after each applied optimizer step, and a validation
swaps it into the model, evaluates and swaps the exact bytes of the trained weights back, so a run with the EMA
trains bit for bit as one without it.

Semantics are ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn(decay)`` (the update itself is
that function: ``torch._foreach_lerp_(ema, current, 1 - decay)``, one fused kernel per step): the first update
copies the weights, each later one is ``ema = decay * ema + (1 - decay) * w``. Only the parameters are averaged
(``use_buffers=False``); buffers (FP8 amax histories) stay the model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from lowprec.errors import CheckpointError, ConfigError
from lowprec.train.spec import check_decay


class WeightEma:
    """The EMA of ``model``'s trainable parameters, in FP32, on their device.

    ``optimizer``: when it has ``master_of`` (``lowprec.optim.master.MasterWeightOptimizer``) the average follows
    each parameter's FP32 master, else the parameter itself (upcast to FP32). ``decay`` in (0, 1).

    Raises ``ConfigError`` for a decay out of range, or sharded (DTensor) parameters: the average of an FSDP2/TP
    layout would live on the local shards, which is not implemented (preflight refuses the combination first).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, decay: float) -> None:
        check_decay(decay)
        self.decay = float(decay)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in self.params):
            raise ConfigError("train.eval_ema is not implemented for a sharded (FSDP2/TP) model: use parallel=single")
        master_of = getattr(optimizer, "master_of", None)
        self.sources = [master_of(p) if master_of is not None else p for p in self.params]
        self.avg = [torch.zeros_like(s, dtype=torch.float32) for s in self.sources]
        #: Updates so far; 0: the next update copies the weights (``AveragedModel.n_averaged``).
        self.n_averaged = 0
        self._update = get_ema_multi_avg_fn(self.decay)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights into the average (after an applied optimizer step)."""
        current = [s.detach().float() for s in self.sources]  # no copy for FP32 masters
        if self.n_averaged == 0:
            torch._foreach_copy_(self.avg, current)
        else:
            self._update(self.avg, current, self.n_averaged)
        self.n_averaged += 1

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The average in the model's parameters (rounded to their dtype) inside the block; the trained values,
        byte for byte, after it (also when the block raises). Before the first update the model is left as is."""
        if self.n_averaged == 0:
            yield
            return
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, a in zip(self.params, self.avg, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)

    def state_dict(self) -> dict:
        """``{"decay", "n_averaged", "avg": [FP32 tensors on the CPU]}``, for ``trainer_state.pt``."""
        return {"decay": self.decay, "n_averaged": self.n_averaged, "avg": [a.detach().cpu().clone() for a in self.avg]}

    def load_state_dict(self, state: dict | None, where: str) -> None:
        """Restore ``state_dict()``'s output. Raises ``CheckpointError`` when the checkpoint ``where`` has no EMA
        (written without ``train.eval_ema``), another decay, or averages of other shapes."""
        if state is None:
            raise CheckpointError(
                f"checkpoint {where} holds no weight EMA (written without train.eval_ema): resume it without "
                "train.eval_ema"
            )
        if float(state["decay"]) != self.decay:
            raise CheckpointError(
                f"checkpoint {where} holds a weight EMA of decay {state['decay']}, not train.eval_ema={self.decay}"
            )
        avg = state["avg"]
        if len(avg) != len(self.avg) or any(a.shape != b.shape for a, b in zip(avg, self.avg, strict=True)):
            raise CheckpointError(f"checkpoint {where} holds a weight EMA of other parameter shapes")
        with torch.no_grad():
            for mine, saved in zip(self.avg, avg, strict=True):
                mine.copy_(saved)
        self.n_averaged = int(state["n_averaged"])
