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


#: End-of-document tokens of common tokenizers, tried in order when ``eot_token`` is not given: lowprec's and
#: GPT-2's, Llama 3's, and the SentencePiece-style ``</s>``/``<eos>`` of Llama 2, Mistral and Gemma.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def load_pretrained_tokenizer(name: str) -> Tokenizer:
    """A Hugging Face tokenizer as a ``tokenizers.Tokenizer``: ``name`` a ``tokenizer.json`` file, a folder holding
    one, or a hub name (``meta-llama/Meta-Llama-3-8B``), loaded with ``transformers.AutoTokenizer`` when installed
    (its fast tokenizer's backend) and with ``tokenizers.Tokenizer.from_pretrained`` otherwise.

    Raises ``DataError`` (one line) when nothing loads: a missing file, no network, a gated model, or a slow-only
    tokenizer (no ``tokenizers`` backend to encode with).
    """
    path = Path(name).expanduser()
    if path.is_dir() and (path / "tokenizer.json").exists():
        path = path / "tokenizer.json"
    if path.is_file():
        return load_tokenizer(path)
    if path.is_absolute() or name.startswith((".", "~")) or name.endswith(".json"):
        raise DataError(f"tokenizer={name!r}: no such file or folder")
    try:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return Tokenizer.from_pretrained(name)
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # no network, unknown or gated repo: each library raises its own kind
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"tokenizer={name!r} is no local file and did not load from the Hugging Face hub: {first}"
        ) from e
    if not getattr(tok, "is_fast", False):
        raise DataError(f"tokenizer={name!r} has no fast (tokenizers) version to encode with")
    return tok.backend_tokenizer


def eot_id(tok: Tokenizer, eot_token: str | None = None) -> int:
    """The id of the token that ends each document: ``eot_token`` if given, else the first of ``EOT_CANDIDATES``
    in the vocabulary. Raises ``DataError`` naming the candidates when there is none."""
    names = (eot_token,) if eot_token else EOT_CANDIDATES
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    which = f"({eot_token})" if eot_token else f"among {', '.join(names)}"
    raise DataError(f"the tokenizer has no end-of-document token {which}; name one with eot_token=...")


def vocab_size_of(tok: Tokenizer) -> int:
    """Ids the tokenizer can produce: one past its largest id, added (special) tokens included."""
    return max(tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab(with_added_tokens=True).values()) + 1)
