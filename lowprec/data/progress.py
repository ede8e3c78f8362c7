"""What a cold data build is doing, on stderr: a line per phase, a tqdm bar (counts and ETA) where the total is known.

Only ``prepare`` on a cold cache uses it; a warm cache prints nothing. Disabled, it prints nothing at all.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

PHASES = 4  # reading corpus files, training the BPE, tokenizing, writing shards


class BuildProgress:
    """``bar``/``track`` show phase ``i`` of ``PHASES`` with its count and ETA; ``phase`` names one whose progress
    is unknown, leaving its line open until ``done`` adds the elapsed time."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._t0 = self._phase_t0 = time.perf_counter()
        self._tty = enabled and sys.stderr.isatty()

    def _write(self, text: str, end: str = "\n") -> None:
        if self.enabled:
            sys.stderr.write(text + end)
            sys.stderr.flush()

    @staticmethod
    def _label(i: int, text: str) -> str:
        return f"lowprec data [{i}/{PHASES}] {text}"

    def start(self, text: str) -> None:
        self._write(f"lowprec data: {text}")

    def phase(self, i: int, text: str) -> None:
        self._phase_t0 = time.perf_counter()
        self._write(self._label(i, text) + " ...", end="")

    def done(self) -> None:
        self._write(f" done in {time.perf_counter() - self._phase_t0:.1f} s")

    def finish(self, text: str) -> None:
        self._write(f"lowprec data: {text} in {time.perf_counter() - self._t0:.0f} s")

    def bar(self, i: int, text: str, total: int, unit: str = "B") -> tqdm:
        """A bar for phase ``i`` of ``total`` units (bytes by default, shown as kB/MB); ``leave``s its final
        line. Redraws at most every 0.5 s on a terminal, every 15 s in a log file."""
        return tqdm(
            total=total,
            desc=self._label(i, text),
            unit=unit,
            unit_scale=unit == "B",
            unit_divisor=1000,
            file=sys.stderr,
            disable=not self.enabled,
            leave=True,
            dynamic_ncols=True,
            mininterval=0.5 if self._tty else 15.0,
        )

    def track(self, i: int, text: str, items: Iterable[T], sizes: list[int]) -> Iterator[T]:
        """Yield ``items`` while a bar for phase ``i`` advances by each item's size."""
        with self.bar(i, text, sum(sizes)) as b:
            for item, n in zip(items, sizes, strict=True):
                yield item
                b.update(n)
