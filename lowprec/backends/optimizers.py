"""The AdamW implementations a recipe's ``optim.impl`` names, one object each: what states they provide, how
they are built (on plain tensors and on FSDP2/TP DTensors), which tensors they quantize and how many bytes
their states take (the estimator's rule, checked to the byte against measurement in the tests).

Both 8-bit libraries keep tensors with fewer than ``MIN_8BIT_NUMEL`` elements in 32-bit states
(bitsandbytes' ``min_8bit_size``; torchao's ``block_size``-aligned ``_new_buffer`` threshold).

bitsandbytes and torchao are imported when an optimizer of theirs is built: together they cost ~2 s of start-up
in every process (each rank, each CLI call), most of which never use them.
"""

from __future__ import annotations

import math

import torch

from lowprec.backends.registry import OptimizerImpl, register_optim_impl
from lowprec.optim.local_shards import LocalShardOptimizer
from lowprec.optim.lowbit_adamw import LowBitAdamW

MIN_8BIT_NUMEL = 4096
#: bitsandbytes' 8-bit block (elements) and its 256-entry fp32 quantization map.
BNB_BLOCK = 256
QMAP_BYTES = 256 * 4
#: torchao's blocks: 256 for 8-bit states (with a 256-entry qmap per state), 128 for 4-bit (16-entry qmap).
TORCHAO_BLOCK = {"int8": 256, "int4": 128}
INT4_QMAP_BYTES = 16 * 4
#: LowBitAdamW bytes per element of (m + v) and per tensor (fp32 ``step`` + scales) for each state dtype.
_LOWPREC_STATE = {"fp32": (8, 4), "bf16": (4, 4), "fp8_fp16": (3, 12)}


def _dense_bytes(numel: int, stepped_bytes: int) -> int:
    return 2 * numel * stepped_bytes + 4  # m and v in the stepped dtype, plus an fp32 ``step``


class TorchAdamW(OptimizerImpl):
    name = "torch"
    states = ("param",)
    description = "torch.optim.AdamW"

    def build(self, groups, *, state, stepped_dtype, update_rounding, hparams, sharded):
        return torch.optim.AdamW(groups, **hparams)

    def state_bytes(self, numel, stepped_bytes, state, kahan) -> int:
        return _dense_bytes(numel, stepped_bytes)


class LowprecAdamW(OptimizerImpl):
    name = "lowprec"
    states = ("param", "fp32", "bf16", "fp8_fp16")
    roundings = ("nearest", "stochastic", "kahan")
    description = "lowprec.optim.LowBitAdamW"

    def build(self, groups, *, state, stepped_dtype, update_rounding, hparams, sharded):
        dtype = stepped_dtype if state == "param" else state

        def make(g):
            return LowBitAdamW(g, **hparams, state_dtype=dtype, update_rounding=update_rounding)

        # FSDP2/TP: its FP8/FP16 moment scales are then per local shard.
        return LocalShardOptimizer(groups, make) if sharded else make(groups)

    def state_bytes(self, numel, stepped_bytes, state, kahan) -> int:
        per_elem, per_tensor = (2 * stepped_bytes, 4) if state == "param" else _LOWPREC_STATE[state]
        return per_elem * numel + per_tensor + (2 * numel if kahan else 0)


class BitsandbytesAdamW8bit(OptimizerImpl):
    name = "bitsandbytes"
    states = ("int8",)
    description = "bitsandbytes.optim.AdamW8bit (block-wise dynamic 8-bit, Dettmers et al. 2022)"

    def build(self, groups, *, state, stepped_dtype, update_rounding, hparams, sharded):
        import bitsandbytes as bnb

        def make(g):
            return bnb.optim.AdamW8bit(g, min_8bit_size=MIN_8BIT_NUMEL, **hparams)

        # FSDP2/TP: bitsandbytes cannot step DTensors (bitsandbytes#1633); it steps each rank's local shard.
        return LocalShardOptimizer(groups, make) if sharded else make(groups)

    def is_quantized(self, state, numel) -> bool:
        return numel >= MIN_8BIT_NUMEL

    def state_bytes(self, numel, stepped_bytes, state, kahan) -> int:
        if self.is_quantized(state, numel):  # uint8 m and v, one fp32 absmax per 256-element block each
            return 2 * numel + 2 * 4 * math.ceil(numel / BNB_BLOCK)
        return 8 * numel

    def shared_state_bytes(self, any_quantized) -> int:
        return 2 * QMAP_BYTES if any_quantized else 0  # the two qmaps, shared by every tensor


class TorchaoAdamW(OptimizerImpl):
    name = "torchao"
    states = ("param", "int8", "int4")
    roundings = ("nearest", "stochastic")
    description = "torchao.optim AdamW8bit / AdamW4bit / _AdamW (bf16_stochastic_round)"

    def build(self, groups, *, state, stepped_dtype, update_rounding, hparams, sharded):
        from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

        cls = {"int8": AdamW8bit, "int4": AdamW4bit, "param": _AdamW}[state]
        return cls(groups, **hparams, bf16_stochastic_round=update_rounding == "stochastic")

    def is_quantized(self, state, numel) -> bool:
        block = TORCHAO_BLOCK.get(state)
        return block is not None and numel >= MIN_8BIT_NUMEL and numel % block == 0

    def state_bytes(self, numel, stepped_bytes, state, kahan) -> int:
        if not self.is_quantized(state, numel):
            return _dense_bytes(numel, stepped_bytes)
        if state == "int4":
            # per state: packed 4-bit codes (n/2 B), one fp32 scale per 128-element block, a 16-entry fp32 qmap
            return 2 * (numel // 2 + 4 * (numel // TORCHAO_BLOCK["int4"]) + INT4_QMAP_BYTES) + 4
        return 2 * (numel + 4 * (numel // TORCHAO_BLOCK["int8"]) + QMAP_BYTES) + 4


for _impl in (TorchAdamW(), LowprecAdamW(), BitsandbytesAdamW8bit(), TorchaoAdamW()):
    register_optim_impl(_impl)
