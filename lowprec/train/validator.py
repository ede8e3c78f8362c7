"""Validation timing: which steps are followed by a validation pass, and the last validation loss."""

from __future__ import annotations

import warnings

from lowprec.data import TokenBatches
from lowprec.train.build import Built
from lowprec.train.ema import WeightEma
from lowprec.train.spec import TrainSpec
from lowprec.train.step import evaluate


class Validator:
    """Validates after every ``spec.val_every``-th step (never if <= 0) and after the last step, on
    ``spec.val_batches`` fixed batches loaded once here (``evaluate``: buffers are restored after each batch,
    so how often a run validates never changes its trajectory). ``spec.val_batches`` beyond what the validation
    split holds without overlapping windows is capped there with a warning (``val_batches_cap`` says so): more
    batches would only repeat tokens, and cost time. ``ema``: the run's ``WeightEma`` (``train.eval_ema``), evaluated
    on the same batches after the trained weights at each pass (``val_loss_ema``)."""

    def __init__(self, built: Built, data: TokenBatches, spec: TrainSpec, ema: WeightEma | None = None):
        self.built, self.spec, self.ema = built, spec, ema
        n = spec.val_batches
        limit = data.max_val_batches()
        #: ``None``, or the line saying that ``spec.val_batches`` was capped to the validation split.
        self.val_batches_cap = None
        if n > limit:
            self.val_batches_cap = (
                f"train.val_batches={n} capped to {limit}: the validation split holds {limit} batch(es) of "
                f"{data.batch_size} x {data.seq_len} tokens without repeating a window"
            )
            warnings.warn(self.val_batches_cap, stacklevel=2)
            n = limit
        self.batches = data.val_batches(n)
        #: Validation loss (nats/token) of the latest pass; NaN before the first.
        self.last_loss = float("nan")
        #: Validation loss of the weight EMA at the latest pass; NaN before the first or without ``ema``.
        self.last_loss_ema = float("nan")

    def due(self, step: int) -> bool:
        every = self.spec.val_every
        return step == self.spec.steps - 1 or (every > 0 and (step + 1) % every == 0)

    def maybe_validate(self, step: int) -> dict[str, float]:
        """``{"val_loss": loss}`` (and ``val_loss_ema`` with an EMA) after a validation pass if one is due after
        ``step``, else ``{}``."""
        if not self.due(step):
            return {}
        self.last_loss = evaluate(self.built, self.batches)
        if self.ema is None:
            return {"val_loss": self.last_loss}
        with self.ema.swapped():
            self.last_loss_ema = evaluate(self.built, self.batches)
        return {"val_loss": self.last_loss, "val_loss_ema": self.last_loss_ema}
