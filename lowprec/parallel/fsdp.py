"""FSDP2 (``fully_shard``) for the Llama model, in torchtitan's order: each transformer block, then the root.

``torchtitan/models/llama3/infra/parallelize.py`` ``apply_fsdp`` is the model. HSDP when the data-parallel
mesh is 2-D (``dp_replicate``, ``dp_shard``): parameters are sharded within a replica group and gradients
all-reduced across groups. The ``MixedPrecisionPolicy`` comes from the recipe (``lowprec.train.build``);
communication hooks (FP8 reduce-scatter) are installed after sharding.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool = True
) -> list[FSDPModule]:
    """Shard ``model`` (a ``lowprec.model.Transformer``) over ``dp_mesh`` in place; returns the FSDP modules,
    blocks first and the root last.

    The last block is not resharded after forward (its parameters are needed again at once in backward),
    as in torchtitan. Works on the meta device, before ``to_empty``.
    """
    modules: list[FSDPModule] = []
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
        )
        modules.append(block)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    modules.append(model)
    return modules
