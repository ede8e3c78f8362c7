"""Data: corpora, BPE tokenizer, uint16/uint32 token shards, ``data prepare`` and deterministic batches."""

from lowprec.data.dataset import DataSpec, DataUsage, TokenData, check_vocab_fits, data_usage, prepare
from lowprec.data.errors import DataError
from lowprec.data.loader import TokenBatches

__all__ = [
    "check_vocab_fits",
    "data_usage",
    "DataError",
    "DataSpec",
    "DataUsage",
    "TokenBatches",
    "TokenData",
    "prepare",
]
