"""The semantic query cache: exact and near-duplicate lookups, bounds, invalidation.

Oracles: hand-made unit vectors at known cosines; the cache's own counters.
"""

from __future__ import annotations

import numpy as np
import pytest

from rag_retriever.cache import CacheKey, SemanticCache
from rag_retriever.records import SearchResult


def result(tag: str) -> SearchResult:
    return SearchResult(query=tag, mode="hybrid", collection="kb__m__v1", hits=(), timings_ms={})


def unit(angle: float) -> np.ndarray:
    """A 2-d unit vector at `angle` radians from (1, 0): cosine to it is cos(angle)."""
    return np.array([np.cos(angle), np.sin(angle)], dtype=np.float32)


KEY = CacheKey("kb__m__v1", "hybrid", 10, "")


def test_exact_then_similar_above_the_threshold_only() -> None:
    cache = SemanticCache(size=10, threshold=0.98)
    cache.put(KEY, "Who founded Normandy?", unit(0.0), result("a"))
    assert cache.get_exact(KEY, "  who FOUNDED normandy? ") == result("a")
    assert cache.get_similar(KEY, "who founded normandy then?", unit(np.arccos(0.985))) == result(
        "a"
    )  # cosine 0.985
    assert (
        cache.get_similar(KEY, "who founded normandy then?", unit(np.arccos(0.975))) is None
    )  # cosine 0.975: a miss
    assert cache.hits == {"exact": 1, "semantic": 1} and cache.misses == 1


def test_another_mode_k_filter_or_version_is_another_question() -> None:
    cache = SemanticCache(size=10, threshold=0.9)
    cache.put(KEY, "q", unit(0.0), result("a"))
    for other in (
        CacheKey("kb__m__v1", "bm25", 10, ""),
        CacheKey("kb__m__v1", "hybrid", 5, ""),
        CacheKey("kb__m__v1", "hybrid", 10, '{"equals": {"lang": "en"}}'),
        CacheKey("kb__m__v2", "hybrid", 10, ""),
    ):
        assert (
            cache.get_exact(other, "q") is None and cache.get_similar(other, "q", unit(0.0)) is None
        )


def test_a_moved_alias_drops_its_old_version_s_entries() -> None:
    cache = SemanticCache(size=10, threshold=0.9)
    cache.put(KEY, "q", unit(0.0), result("a"))
    cache.put(CacheKey("other__m__v1", "hybrid", 10, ""), "q", unit(0.0), result("b"))
    cache.put(CacheKey("kb__m__v2", "hybrid", 10, ""), "r", unit(1.0), result("c"))
    assert cache.get_exact(KEY, "q") is None  # kb moved to v2
    assert cache.get_exact(CacheKey("other__m__v1", "hybrid", 10, ""), "q") == result("b")
    assert len(cache) == 2


def test_bounded_least_recently_used_first() -> None:
    cache = SemanticCache(size=2, threshold=0.99)
    cache.put(KEY, "a", unit(0.0), result("a"))
    cache.put(KEY, "b", unit(1.0), result("b"))
    assert cache.get_exact(KEY, "a")  # a is now the most recent
    cache.put(KEY, "c", unit(2.0), result("c"))
    assert len(cache) == 2 and cache.get_exact(KEY, "b") is None
    assert cache.get_similar(KEY, "c", unit(2.0)) == result("c")


@pytest.mark.parametrize(("size", "threshold"), [(0, 0.98), (10, 0.0), (10, 1.5)])
def test_bad_settings_are_refused(size: int, threshold: float) -> None:
    with pytest.raises(ValueError):
        SemanticCache(size=size, threshold=threshold)


def test_a_similar_question_with_other_question_words_or_numbers_is_a_miss() -> None:
    """The near pairs of SQuAD dev differ in these (see rag_retriever/cache.py)."""
    cache = SemanticCache(size=10, threshold=0.9)
    cache.put(KEY, "Where did the Wesleys teach in 1735?", unit(0.0), result("a"))
    close = unit(0.01)
    assert cache.get_similar(KEY, "Who did the Wesleys teach in 1735?", close) is None
    assert cache.get_similar(KEY, "Where did the Wesleys teach in 1736?", close) is None
    assert cache.get_similar(KEY, "where did the wesleys preach in 1735", close) == result("a")
