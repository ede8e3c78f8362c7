"""``train.compile=true``: ``torch.compile`` each transformer block, torchtitan's way.

torchtitan (``torchtitan/models/llama3/infra/parallelize.py`` ``apply_compile``) compiles every
``model.layers[i]`` separately with ``fullgraph=True``: the blocks are identical, so one compiled graph
(forward and backward, AOTAutograd) serves them all, and FSDP2's per-block hooks stay outside the compiled
code. lowprec does the same with ``nn.Module.compile`` (in place, so FQNs and state-dict keys are unchanged),
inductor on CPU and CUDA. ``fullgraph=True`` is the no-silent-fallback rule: a graph break raises at the
first step instead of running part of a block in eager. The embedding, final norm and output linear stay eager;
the loss (the FP32 cast of the logits and the cross-entropy) is compiled apart, as torchtitan does
(``compile.components = ["model", "loss"]``), and the optimizer stays eager.

Inductor's ``emulate_precision_casts`` is turned on for these compiles (and only these): without it inductor
keeps the intermediates of a fused BF16 expression in FP32 (``silu(w1 x) * w3 x`` rounded once instead of
twice), which is a different numerics from the eager run being compared; with it, every eager rounding to
BF16/FP16 is kept.

Under ``train.ac`` the checkpoint is traced with the block (``lowprec.train.ac``: torchtitan's op-level policy),
and dynamo is told not to replay forward side effects in the recompute.

Which parts cannot be compiled is known before training (``compile_blocker``): a part that cannot is refused
with one line, never run in eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def cross_entropy_fp32(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token, 0-dim FP32) of ``logits`` (B, S, V) in any dtype against ``targets``
    (B, S) int64, computed in FP32 whatever the compute dtype (torchtitan does the same)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def z_loss_fp32(logits: torch.Tensor, weight: float) -> torch.Tensor:
    """The z-loss term ``weight * mean(logsumexp(logits, -1) ** 2)`` (0-dim FP32) of ``logits`` (B, S, V) in any
    dtype, computed in FP32 like ``cross_entropy_fp32`` (PaLM, Chowdhery et al. 2022, section 5; Wortsman et al.
    2023, section 3.2): the mean is over every token position."""
    return weight * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def build_z_loss(weight: float, compile: bool = False) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``train.z_loss`` as the function the training step adds to its objective: ``logits -> z_loss_fp32(logits,
    weight)``, compiled apart like the cross-entropy under ``compile``; ``None`` for ``weight`` 0 (off: the step
    computes nothing more than without it)."""
    if weight == 0:
        return None

    def z_loss(logits: torch.Tensor) -> torch.Tensor:
        return z_loss_fp32(logits, weight)

    return compile_loss(z_loss) if compile else z_loss


#: Inductor settings for lowprec's own compiles only (``torch.compile(options=...)``), not process-global:
#: libraries that compile their own code in the same process (torchao's 8-bit/4-bit AdamW steps) keep theirs.
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def compile_loss(fn):
    """``fn`` compiled whole (``fullgraph=True``, inductor): on CPU the FP32 cast, log-softmax and NLL fuse
    into one pass over the (tokens, vocab) logits instead of three."""
    return torch.compile(fn, fullgraph=True, options=_INDUCTOR_OPTIONS)


def apply_compile(model: nn.Module) -> int:
    """Compile every block of ``model.layers`` in place (``fullgraph=True``, inductor); returns how many."""
    import torch._dynamo.config as dynamo_config

    # Under train.ac, a Python side effect in a checkpointed forward (the effective-recipe hook recording each
    # linear's output dtype on the first step) must happen once, not again in the recompute: what eager
    # lowprec does too (lowprec.kernels.recompute). Without this dynamo refuses any such side effect.
    dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # A fresh dynamo state per built model, as in a fresh process: a sequential ablation compiles each run's model
    # in the same worker, and dynamo's memory of the previous run made the recipe constants that differ between
    # runs dynamic (``amax_floor`` 1e-12 then 1e-4 became a SymFloat), which failed inside the FP8 autograd Function
    # ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer", torch 2.13 CPU; first seen on an
    # H200). It also keeps one run's cache entries from counting against the next one's recompile limit.
    torch._dynamo.reset()
    blocks = list(model.layers.values())
    for block in blocks:
        block.compile(fullgraph=True, options=_INDUCTOR_OPTIONS)
    return len(blocks)


def is_compiled(module: nn.Module) -> bool:
    """True when ``module`` runs through ``torch.compile`` (``nn.Module.compile`` was called on it)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_time_now() -> float:
    """Seconds this process has spent compiling so far (dynamo + AOTAutograd + inductor for forward graphs,
    ``_compile.compile_inner``, and the lazily compiled backward graphs, ``backward._backward_impl``, from
    ``torch._dynamo.utils.compilation_time_metrics``), so compile time can be kept out of step times."""
    from torch._dynamo.utils import compilation_time_metrics as m

    return float(sum(m.get("_compile.compile_inner", ())) + sum(m.get("backward._backward_impl", ())))
