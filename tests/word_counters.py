"""Token counters for tests that start chunking worker processes: importable without pytest,
transformers or the store, so a spawned worker starts fast."""

from __future__ import annotations

import time
from collections.abc import Sequence


def words(texts: Sequence[str]) -> list[int]:
    """A tokenizer whose counts add up across whitespace joins, like WordPiece's."""
    return [len(t.split()) for t in texts]


class SlowWords:
    """Word counts, slowly: keeps the workers busy long enough to be signalled mid-work."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.delay_s = delay_s

    def __call__(self, texts: Sequence[str]) -> list[int]:
        time.sleep(self.delay_s)
        return words(texts)
