"""Llama 3 model definition."""

from lowprec.model.llama import LLAMA_CONFIGS, ModelArgs, Transformer, model_args

__all__ = ["LLAMA_CONFIGS", "ModelArgs", "Transformer", "model_args"]
