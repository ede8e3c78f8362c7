"""Batches as a pure function of (seed, step): paired runs see identical data and resumes continue exactly."""

from __future__ import annotations

import numpy as np
import torch

from lowprec.data.errors import DataError


class TokenBatches:
    """Random windows from uint16 or uint32 shards.

    ``train_batch(step, micro)`` -> (inputs, targets), each (batch_size, seq_len) int64 on CPU;
    targets are inputs shifted by one token. The window offsets come from
    ``np.random.default_rng((seed, step, micro))`` alone. ``val_batches(n)`` are ``n`` fixed,
    evenly spaced windows of the val split, the same for every seed and recipe.
    """

    def __init__(self, train: list[np.ndarray], val: list[np.ndarray], seq_len: int, batch_size: int, seed: int):
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.train, self.val = train, val
        for name, shards in (("train", train), ("val", val)):
            if max(len(s) for s in shards) < seq_len + 1:
                raise DataError(f"the {name} split has no shard longer than seq_len+1={seq_len + 1} tokens")
        # Windows never cross shards: sample a shard by its share of valid offsets, then an offset.
        self._starts = np.array([max(len(s) - seq_len - 1, 0) for s in train], dtype=np.int64)
        self._cum = np.cumsum(self._starts)

    def _window(self, shard: np.ndarray, off: int) -> np.ndarray:
        return np.asarray(shard[off : off + self.seq_len + 1], dtype=np.int64)

    def _stack(self, windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(np.stack(windows))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def train_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, step, micro))
        flat = rng.integers(0, int(self._cum[-1]), size=self.batch_size)
        shard_idx = np.searchsorted(self._cum, flat, side="right")
        offs = flat - np.concatenate(([0], self._cum[:-1]))[shard_idx]
        return self._stack([self._window(self.train[s], int(o)) for s, o in zip(shard_idx, offs)])

    def max_val_batches(self) -> int:
        """How many batches of distinct (non-overlapping) windows the validation split holds (at least 1)."""
        windows = sum(len(s) // (self.seq_len + 1) for s in self.val)
        return max(1, windows // self.batch_size)

    def val_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        windows = []
        per = max(1, n_batches * self.batch_size)
        total = [max(len(s) - self.seq_len - 1, 0) for s in self.val]
        cum = np.cumsum(total)
        for i in range(per):
            flat = int(i * (cum[-1] // per))
            s = int(np.searchsorted(cum, flat, side="right"))
            windows.append(self._window(self.val[s], flat - (int(cum[s - 1]) if s else 0)))
        return [self._stack(windows[b * self.batch_size : (b + 1) * self.batch_size]) for b in range(n_batches)]
