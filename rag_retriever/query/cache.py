"""A semantic query cache: a repeated or reworded question answered without the engine.

Example:
    >>> cache = SemanticCache(size=1000, threshold=0.98)
    >>> key = CacheKey("docs__m-384__v3", "hybrid", 10, "")
    >>> cache.put(key, "who founded Normandy?", vector, result)          # doctest: +SKIP
    >>> cache.get(key, "Who founded  Normandy?", vector)                  # doctest: +SKIP

Keyed by the served version (so a moved alias is a new key space and the old one is dropped
when the alias's new version is first cached), the mode, k and the filter. A lookup is an exact
match of the normalised text (case and spaces), else the nearest cached query vector of the same
key at cosine >= `threshold`. Bounded: at most `size` entries, least recently used evicted.

The threshold must sit above what two *different* questions ever reach. Measured on all 5,708
SQuAD dev questions with all-MiniLM-L6-v2: pairs with different answers reach cosine 0.9893
("where did the Wesleys teach" vs "who did the Wesleys teach", "Super Bowl XLVII" vs "XLVIII",
"came after" vs "came before"); 16 of the 16,095 same-paragraph pairs are at or above 0.97 and
none at 0.99. So the default is 0.99 (`DEFAULT_THRESHOLD`), and a similar question must also
ask with the same question words (who, where, when, ...) and name the same numbers (digits,
roman numerals), which is what those near pairs differ in. Thread-safe.

Does not do: caching across processes, or time-based expiry (a version never changes, so its
results stay right until the alias moves).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from rag_retriever.records import SearchResult
from rag_retriever.store import parse_collection_name

# See the module docstring for the measurement behind it.
DEFAULT_THRESHOLD = 0.99
_WH = frozenset({"who", "whom", "whose", "what", "which", "when", "where", "why", "how"})
_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"^(\d.*|[ivxlcdm]+)$")


def guard(text: str) -> tuple[frozenset[str], frozenset[str]]:
    """What a similar question must share: its question words and its numbers.

    >>> guard("Who won Super Bowl XLVII in 2013?") == (frozenset({"who"}), frozenset({"xlvii", "2013"}))
    True
    """
    words = _WORD.findall(text.lower())
    return frozenset(w for w in words if w in _WH), frozenset(w for w in words if _NUMBER.match(w))


@dataclass(frozen=True)
class CacheKey:
    version: str
    mode: str
    k: int
    filter: str  # the filter's canonical JSON, "" for none
    hit_options: str = ""  # diversity and expansion (retriever.HitOptions.key)
    # what is tuned for the version (its fusion and reranker): `tune-fusion` rewrites them in
    # place, and an answer ranked by the old ones must not be served after
    tuned: str = ""
    config: str = ""  # the retriever's RetrievalConfig (its repr)


@dataclass
class _Entry:
    key: CacheKey
    text: str
    vector: np.ndarray | None
    result: SearchResult
    guard: tuple[frozenset[str], frozenset[str]]


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


class SemanticCache:
    def __init__(self, *, size: int, threshold: float) -> None:
        if size < 1:
            raise ValueError(f"the cache size must be at least 1, got {size}")
        if not 0 < threshold <= 1:
            raise ValueError(f"the cache threshold must be in (0, 1], got {threshold}")
        self.size = size
        self.threshold = threshold
        self.hits = {"exact": 0, "semantic": 0}
        self.misses = 0
        self._entries: OrderedDict[tuple[CacheKey, str], _Entry] = OrderedDict()
        # per key, the texts and stacked vectors of its entries (rebuilt after a change)
        self._matrices: dict[CacheKey, tuple[list[str], np.ndarray]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_exact(self, key: CacheKey, text: str) -> SearchResult | None:
        """The cached result of this very question (case and spaces ignored), else None (not
        counted as a miss: a semantic lookup may follow)."""
        with self._lock:
            entry = self._entries.get((key, normalise(text)))
            if entry is None:
                return None
            self._entries.move_to_end((key, entry.text))
            self.hits["exact"] += 1
            return entry.result

    def get_similar(self, key: CacheKey, text: str, vector: np.ndarray) -> SearchResult | None:
        """The cached result of the nearest question of `key` at cosine >= threshold (vectors are
        unit length) that asks with the same question words and numbers, else None (counted as
        a miss)."""
        wanted = guard(text)
        with self._lock:
            texts, matrix = self._matrix(key)
            if texts:
                sims = matrix @ vector
                for at in np.flatnonzero(sims >= self.threshold)[
                    np.argsort(-sims[sims >= self.threshold])
                ]:
                    entry = self._entries[(key, texts[int(at)])]
                    if entry.guard == wanted:
                        self._entries.move_to_end((key, entry.text))
                        self.hits["semantic"] += 1
                        return entry.result
            self.misses += 1
            return None

    def _matrix(self, key: CacheKey) -> tuple[list[str], np.ndarray]:
        cached = self._matrices.get(key)
        if cached is None:
            entries = [e for e in self._entries.values() if e.key == key and e.vector is not None]
            texts = [e.text for e in entries]
            vectors = [e.vector for e in entries if e.vector is not None]
            matrix = np.stack(vectors) if vectors else np.empty((0, 0), np.float32)
            cached = self._matrices[key] = (texts, matrix)
        return cached

    def put(
        self, key: CacheKey, text: str, vector: np.ndarray | None, result: SearchResult
    ) -> None:
        with self._lock:
            self._drop_other_versions(key.version)
            norm = normalise(text)
            self._entries[(key, norm)] = _Entry(key, norm, vector, result, guard(text))
            self._entries.move_to_end((key, norm))
            self._matrices.pop(key, None)
            while len(self._entries) > self.size:
                (old_key, _), _ = self._entries.popitem(last=False)
                self._matrices.pop(old_key, None)

    def _drop_other_versions(self, version: str) -> None:
        """The alias moved: entries of its other versions can never be served again."""
        parsed = parse_collection_name(version)
        if parsed is None:
            return
        stale = [
            k
            for k, e in self._entries.items()
            if e.key.version != version
            and (p := parse_collection_name(e.key.version)) is not None
            and p[0] == parsed[0]
        ]
        for k in stale:
            del self._entries[k]
            self._matrices.pop(k[0], None)
