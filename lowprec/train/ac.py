"""Activation checkpointing per transformer block (``train.ac``), with torchtitan's modes.

torchtitan (``torchtitan/distributed/activation_checkpoint.py``, earlier
``torchtitan/models/llama3/infra/parallelize.py``: ``apply_ac`` / ``_apply_ac_to_transformer_block``) wraps
every ``model.layers[i]`` in ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``,
``preserve_rng_state=False``):

- ``full``: each block keeps only its inputs; its whole forward is recomputed when backward reaches it;
- ``selective`` (``selective_ac_option="op"``, the default here): op-level SAC through
  ``create_selective_checkpoint_contexts`` with torchtitan's policy: the outputs of the ops in ``_save_list``
  (matmuls, SDPA kernels with their logsumexp, ``reduce_scatter_tensor`` of sequence parallelism,
  ``max``) are saved, except every second matmul in call order (its ``"{mode}_mm_count"`` counter), so
  in a Llama block ``wq``, ``wv``, ``w1`` and ``w2`` are saved and ``wk``, ``wo``, ``w3`` recomputed;
  ``selective_option=N`` (an int) is torchtitan's layer SAC: every N-th block fully checkpointed.

What lowprec does differently, and why:

- **FQNs unchanged.** ``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module.`` into every FQN and
  state-dict key; lowprec's checkpoints, FQN filters and telemetry names use plain FQNs. The block keeps
  its place and its class's behaviour: its class is swapped for a subclass whose ``forward`` runs the
  original one under ``torch.utils.checkpoint`` (FSDP2 swaps classes the same way, and composes with it).
- **What counts as a matmul.** ``aten.mm`` (torchtitan's), ``aten.addmm`` (a biased linear) and
  ``aten._scaled_mm`` (an FP8 GEMM) are matmuls. A linear whose GEMM runs inside an autograd Function
  (lowprec's ``Float8Linear``, emulated CPU kernels) declares it with ``lowprec.kernels.recompute.matmul_unit``:
  one matmul whatever ops the kernel dispatches (one ``_scaled_mm``; an FP32 ``mm`` and a cast; 128-wide K
  chunks), its output (in the linear's output dtype) saved or recomputed as a whole; an attention computed
  inside a Function (the emulated CPU attention) declares ``attention_unit``, saved whole. Outside units,
  ops are keyed as torch dispatches them: every SDPA kernel torch may pick is saved, including
  ``_scaled_dot_product_flash_attention_for_cpu``, and an FP32 ``mm`` is a matmul like any other.
- **Recompute side effects.** While a block is recomputed ``lowprec.kernels.recompute.in_recompute()`` is
  true: delayed-scaling amaxes are not recorded (nor all-reduced over the TP group) again and FP8 telemetry
  is not observed again.
- **Measurement.** The forward context also enters ``lowprec.measure.saved_tensors.recomputed_region`` and
  the policy reports the outputs it caches with ``note_kept``, so ``measure_saved_bytes`` counts what the
  forward keeps plus the largest block's recomputed set (a no-op outside a measurement).

Apply before parallelizing (torchtitan applies AC before ``torch.compile`` and FSDP; TP is hooks on the
submodules, unaffected): ``fully_shard`` then gathers a block's parameters around the checkpointed forward,
and again before its backward, whose first saved-tensor unpack triggers the recompute. Gradients are
identical to those without checkpointing (FP32: bit for bit), since the recompute runs the same kernels on
the same inputs with the same scales.

Under ``torch.compile`` (``train.compile``, blocks compiled after this) dynamo traces the checkpoint as a
higher-order op and accepts a ``context_fn`` only as torch's two dispatch modes: the block then gets
torchtitan's policy exactly (op-level, no units), and the compiled backward recomputes what AOTAutograd's
partitioner chooses; no eager recompute runs, so ``in_recompute`` is never true and the measurement counts
what the compiled graph saves.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lowprec.kernels import recompute
from lowprec.kernels.recompute import UNIT_KINDS
from lowprec.measure.saved_tensors import note_kept, recomputed_region
from lowprec.train.spec import AC_MODES

_aten = torch.ops.aten

#: Matmuls for the "every second matmul" rule (torchtitan counts ``aten.mm``; see the module doc).
MATMUL_OPS = {_aten.mm.default, _aten.addmm.default, _aten._scaled_mm.default}

#: torchtitan's ``_op_sac_save_list`` (llama3) plus the CPU flash kernel and the matmuls above.
SAVE_OPS = MATMUL_OPS | {
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_attention_math.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # torchtitan: "for low precision training, it's useful to always save the result of max, since the
    # absolute maximum is used to compute the scaling factor for quantization" (torchao's amaxes).
    _aten.max.default,
}


def _saves(meta: dict[str, int], is_recompute: bool, func) -> bool:
    """torchtitan's ``_custom_policy``: save the ops of ``SAVE_OPS`` except every second matmul, counted per
    pass in ``meta["{mode}_mm_count"]`` (``is_recompute`` is only ever true on torch < 2.13, where the policy
    also runs during the recompute)."""
    if func in MATMUL_OPS:
        key = "recompute_mm_count" if is_recompute else "forward_mm_count"
        meta[key] += 1
        return meta[key] % 2 == 1
    return func in SAVE_OPS


def _decision(save: bool) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


class _PlainUnit:
    @staticmethod
    def output(gemm):
        return gemm()


class _SavingUnit:
    """One matmul or attention unit in a selectively checkpointed block (``lowprec.kernels.recompute``)."""

    def __init__(self, region: _Region, kind: str):
        self.region, self.kind, self.used = region, kind, False

    def output(self, compute):
        if self.used:
            raise RuntimeError("a recompute unit's output() was called twice")
        self.used = True
        r = self.region
        save = _saves(r.meta, r.recomputing, _aten.mm.default) if self.kind == "matmul" else True
        if not r.recomputing:
            out = compute()
            r.units.append(tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out) if save else None)
            if save:
                note_kept(out)
            return out
        if r.replay >= len(r.units):
            raise RuntimeError(f"{r.name}: the recompute ran more units than the forward")
        cached, r.units[r.replay] = r.units[r.replay], None
        r.replay += 1
        return compute() if cached is None else cached


class _Region:
    """One checkpointed call of one block: the state the policy, the matmul units and the recompute flag
    share between the forward and the recompute (``lowprec.kernels.recompute.Region``)."""

    def __init__(self, name: str, selective: bool):
        self.name, self.selective = name, selective
        self.recomputing = False
        #: torchtitan's ``meta``: matmuls seen so far, per pass.
        self.meta: dict[str, int] = defaultdict(int)
        #: The matmul units' outputs in forward order (``None``: recomputed), and the replay position.
        self.units: list[torch.Tensor | None] = []
        self.replay = 0
        self.caching = self.cached = None
        if selective:
            self.caching, self.cached = create_selective_checkpoint_contexts(self.policy)

    def policy(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        save = _saves(self.meta, ctx.is_recompute, func)
        if save and not ctx.is_recompute:
            note_kept(getattr(ctx, "op_output", None))  # for measure_saved_bytes (torch >= 2.13 passes it)
        return _decision(save)

    @contextlib.contextmanager
    def unit(self, kind: str) -> Iterator:
        if kind not in UNIT_KINDS:
            raise ValueError(f"unit kind {kind!r} is not one of {UNIT_KINDS}")
        if not self.selective:
            yield _PlainUnit
            return
        mode = self.cached if self.recomputing else self.caching
        if _get_current_dispatch_mode() is not mode:
            raise RuntimeError(
                f"{self.name}: a TorchDispatchMode entered inside a selectively checkpointed block hides its "
                "policy from a recompute unit; enter it outside the model's forward"
            )
        unit = _SavingUnit(self, kind)
        with _pop_mode_temporarily():  # the unit's own ops are not the policy's to save or count
            yield unit
        if not unit.used:
            raise RuntimeError(f"{self.name}: a recompute unit ended without calling output()")

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(recompute.entered(self))
            if self.caching is not None:
                stack.enter_context(self.caching)
            stack.enter_context(recomputed_region())
            yield

    @contextlib.contextmanager
    def recompute_context(self) -> Iterator[None]:
        self.recomputing, self.replay = True, 0
        self.meta["recompute_mm_count"] = 0
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(recompute.entered(self))
                if self.cached is not None:
                    stack.enter_context(self.cached)
                yield
        finally:
            self.recomputing = False

    def contexts(self):
        return self.forward_context(), self.recompute_context()


class _Checkpointed:
    """Mixed in before a block's class: its forward runs under non-reentrant ``torch.utils.checkpoint``."""

    _ac_mode: str
    _ac_name: str

    def forward(self, *args, **kwargs):
        inner = super().forward
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return inner(*args, **kwargs)
        name, selective = self._ac_name, self._ac_mode == "selective"
        if torch.compiler.is_compiling():
            # dynamo takes a context_fn only as a function or a partial, and none at all for full AC
            if selective:
                kwargs["context_fn"] = functools.partial(_compiled_context_fn)
        else:
            kwargs["context_fn"] = lambda: _Region(name, selective).contexts()
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def _compiled_context_fn():
    """Under ``torch.compile`` (dynamo traces the block): torchtitan's op-level policy as torch's two dispatch
    modes, the only form compile accepts; the partitioner then decides what the compiled backward recomputes, so
    no eager recompute runs (no ``in_recompute``, no matmul units, no measurement hooks)."""
    meta: dict[str, int] = defaultdict(int)
    return create_selective_checkpoint_contexts(
        lambda ctx, func, *a, **k: _decision(_saves(meta, ctx.is_recompute, func))
    )


_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:
        name = f"Checkpointed{cls.__name__}"
        _CLASSES[cls] = type(name, (_Checkpointed, cls), {"__module__": __name__, "__qualname__": name})
        globals().setdefault(name, _CLASSES[cls])  # so a pickled model finds it
    return _CLASSES[cls]


def is_checkpointed(block: nn.Module) -> bool:
    return isinstance(block, _Checkpointed)


def apply_ac(model: nn.Module, mode: str, selective_option: str | int = "op") -> list[str]:
    """Checkpoint the blocks of ``model.layers`` in place (see the module doc); returns their FQNs.

    ``mode``: ``none`` (nothing), ``full`` or ``selective``. ``selective_option``: ``"op"`` (op-level SAC,
    what ``train.ac=selective`` runs) or a positive int N (every N-th block fully checkpointed, counted from
    1 as torchtitan does). Parameters, buffers, FQNs and state-dict keys are unchanged; works on the meta
    device. Raises ``ValueError`` for an unknown mode or option, or blocks already checkpointed.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "none":
        return []
    every = None
    if mode == "selective" and selective_option != "op":
        if not str(selective_option).isdigit() or int(selective_option) < 1:
            raise ValueError(f"selective_option={selective_option!r} is not 'op' or a positive int")
        every = int(selective_option)
    done = []
    layers = model.get_submodule("layers")
    for i, (layer_id, block) in enumerate(layers.named_children(), start=1):
        if is_checkpointed(block):
            raise ValueError(f"layers.{layer_id} is already checkpointed")
        if every is not None and i % every:
            continue
        block.__class__ = _checkpointed_class(type(block))
        block._ac_mode = "full" if every is not None else mode
        block._ac_name = f"layers.{layer_id}"
        done.append(block._ac_name)
    return done
