"""Data: corpora, BPE tokenizer, uint16 token shards and deterministic batches."""

from lowprec.data.dataset import DataSpec, TokenData, check_vocab_fits, prepare
from lowprec.data.errors import DataError
from lowprec.data.loader import TokenBatches

__all__ = ["check_vocab_fits", "DataError", "DataSpec", "TokenBatches", "TokenData", "prepare"]
