"""Byte-level BPE tokenizer trained with HF ``tokenizers`` (GPT-2 style byte-level pre-tokenization)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lowprec.data.errors import DataError

EOT = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (including the ``<|endoftext|>`` token).

    Every byte is in the initial alphabet, so any text encodes without unknown tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a saved tokenizer; raises ``DataError`` if the file is missing or unreadable."""
    if not path.exists():
        raise DataError(f"tokenizer file {str(path)!r} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"tokenizer file {str(path)!r} is corrupt: {e}") from e
