"""Model definitions: the Llama 3 decoder (``llama``) and the DeepSeekMoE decoder (``moe``), one registry of
named sizes (``MODEL_CONFIGS``) and one constructor (``build_model``) chosen by the arguments' type."""

from dataclasses import replace

from lowprec.errors import ConfigError
from lowprec.model.llama import LLAMA_CONFIGS, ModelArgs, Transformer
from lowprec.model.moe import MOE_CONFIGS, MoE, MoEArgs, MoETransformer

#: Every named size: Llama's (``debug``, ``tiny``, ...) and the MoE ones (``moe_debug``, ``moe_tiny``, ...).
MODEL_CONFIGS: dict[str, ModelArgs] = {**LLAMA_CONFIGS, **MOE_CONFIGS}


def model_args(name: str, **overrides) -> ModelArgs:
    """Named size (``MODEL_CONFIGS``) with optional field overrides. Raises ``ConfigError`` listing the known
    names."""
    if name not in MODEL_CONFIGS:
        raise ConfigError(f"unknown model size {name!r}; known: {', '.join(MODEL_CONFIGS)}")
    return replace(MODEL_CONFIGS[name], **overrides)


def build_model(args: ModelArgs) -> Transformer | MoETransformer:
    """``MoETransformer`` for ``MoEArgs``, ``Transformer`` for ``ModelArgs`` (on the current default device:
    build under ``torch.device("meta")`` to allocate nothing)."""
    return MoETransformer(args) if isinstance(args, MoEArgs) else Transformer(args)


__all__ = [
    "LLAMA_CONFIGS",
    "MODEL_CONFIGS",
    "MOE_CONFIGS",
    "MoE",
    "MoEArgs",
    "MoETransformer",
    "ModelArgs",
    "Transformer",
    "build_model",
    "model_args",
]
