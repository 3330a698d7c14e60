"""The semantic query cache: exact and near-duplicate lookups, bounds, invalidation.

Oracles: hand-made unit vectors at known cosines; the cache's own counters.
"""

from __future__ import annotations

import numpy as np
import pytest

from rag_retriever.query.cache import CacheKey, SemanticCache
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
    """The near pairs of SQuAD dev differ in these (see rag_retriever/query/cache.py)."""
    cache = SemanticCache(size=10, threshold=0.9)
    cache.put(KEY, "Where did the Wesleys teach in 1735?", unit(0.0), result("a"))
    close = unit(0.01)
    assert cache.get_similar(KEY, "Who did the Wesleys teach in 1735?", close) is None
    assert cache.get_similar(KEY, "Where did the Wesleys teach in 1736?", close) is None
    assert cache.get_similar(KEY, "where did the wesleys preach in 1735", close) == result("a")


def test_the_retriever_answers_a_repeat_from_the_cache_until_the_alias_moves(
    tmp_path, tiny_encoder
) -> None:
    from rag_retriever.ingest.writer import update_documents
    from rag_retriever.records import Document
    from rag_retriever.store import EdgeStore
    from tests.conftest import collection_retriever
    from tests.test_retriever import DOCS

    store = EdgeStore(tmp_path / "edge")
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.cache = SemanticCache(size=10, threshold=0.99)
    first = retriever.retrieve("the king and the queen", k=3, mode="hybrid")
    again = retriever.retrieve("The King and the  Queen", k=3, mode="hybrid")
    assert [h.chunk_id for h in again.hits] == [h.chunk_id for h in first.hits]
    assert any("answered from the cache" in n for n in again.notices)
    assert again.query == "The King and the  Queen" and again.query_id != first.query_id
    assert set(again.timings_ms) == {"cache", "total"}
    other_k = retriever.retrieve("the king and the queen", k=2, mode="hybrid")
    assert not any("cache" in n for n in other_k.notices)
    assert retriever.cache.hits["exact"] == 1
    update_documents(
        [Document("new", "new", "the king and the queen of the river city")],
        alias="kb",
        encoder=tiny_encoder,
        store=store,
        lock_dir=tmp_path,
        rebase_drift=1.0,
    )
    moved = retriever.retrieve("the king and the queen", k=3, mode="hybrid")
    assert not any("cache" in n for n in moved.notices)  # a new version: asked afresh
    assert moved.collection != first.collection
    store.close()


def test_a_fusion_tuned_in_place_is_not_answered_from_the_cache(
    tmp_path, tiny_encoder, monkeypatch
) -> None:
    """`tune-fusion` rewrites the served version's record in place: the alias does not move, so
    a cache keyed by the version alone served the old fusion's ranking (found by a review)."""
    import dataclasses

    from rag_retriever.query import retriever as retriever_module
    from rag_retriever.query.fusion import Fusion
    from rag_retriever.store import EdgeStore
    from tests.conftest import collection_retriever
    from tests.test_retriever import DOCS

    monkeypatch.setattr(retriever_module, "METADATA_TTL_S", 0.0)  # the record read each time
    store = EdgeStore(tmp_path / "edge")
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.cache = SemanticCache(size=10, threshold=0.99)
    first = retriever.retrieve("the king and the queen", k=3, mode="hybrid")
    name = store.resolve("kb")
    tuned = Fusion("rrf", k=5, weights=(0.0, 1.0))
    store.put_record(name, dataclasses.replace(store.record(name), fusion=tuned.to_json()))
    again = retriever.retrieve("the king and the queen", k=3, mode="hybrid")
    assert not any("cache" in n for n in again.notices)
    assert again.fusion == tuned.describe() != first.fusion
    store.close()


def test_a_retriever_of_another_configuration_is_not_answered_from_the_shared_cache(
    tmp_path, tiny_encoder
) -> None:
    """`with_config` shares the cache: a retriever fusing otherwise was answered with the first
    configuration's ranking (found by a review)."""
    from rag_retriever.store import EdgeStore
    from tests.conftest import collection_retriever
    from tests.test_retriever import DOCS

    store = EdgeStore(tmp_path / "edge")
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.cache = SemanticCache(size=10, threshold=0.99)
    first = retriever.retrieve("the king and the queen", k=3, mode="hybrid")
    other = retriever.with_config(fusion="rrf")
    assert other.cache is retriever.cache
    again = other.retrieve("the king and the queen", k=3, mode="hybrid")
    assert not any("cache" in n for n in again.notices)
    assert again.fusion != first.fusion
    same = retriever.retrieve("the king and the queen", k=3, mode="hybrid")
    assert any("answered from the cache" in n for n in same.notices)
    store.close()


@pytest.mark.model
@pytest.mark.data
def test_no_false_hit_on_squad_questions_that_ask_different_things(minilm) -> None:
    """SQuAD dev questions of the articles where the nearest different-answer pairs are (0.98+
    cosine): no question is answered with another's result at the default threshold."""
    import json
    import random

    from rag_retriever.query.cache import DEFAULT_THRESHOLD
    from tests.conftest import shared_data

    articles = {"United_Methodist_Church", "Ctenophora", "Yuan_dynasty", "Normans"}
    with shared_data("squad_v11_dev", "questions_dev.jsonl").open(encoding="utf-8") as fh:
        rows = [r for line in fh if (r := json.loads(line))["gold_doc_ids"][0] in articles]
    bowl = shared_data("squad_v11_dev", "questions_dev.jsonl").read_text(encoding="utf-8")
    rows += [
        r
        for line in bowl.splitlines()
        if (r := json.loads(line))["gold_doc_ids"][0] == "Super_Bowl_50"
        and "halftime" in r["question"]
    ]
    random.Random(0).shuffle(rows)
    vectors = minilm.encode_queries([r["question"] for r in rows]).vectors
    cache = SemanticCache(size=len(rows), threshold=DEFAULT_THRESHOLD)
    false_hits = []
    for r, v in zip(rows, vectors, strict=True):
        found = cache.get_exact(KEY, r["question"]) or cache.get_similar(KEY, r["question"], v)
        if found is not None and not set(r["answers"]) & set(found.notices):
            false_hits.append((r["question"], found.query))
        answer = result(r["question"])
        cache.put(
            KEY,
            r["question"],
            v,
            SearchResult(**{**answer.__dict__, "notices": tuple(r["answers"])}),
        )
    assert len(rows) > 700 and false_hits == []


def test_a_miss_is_encoded_once(tmp_path, tiny_encoder, monkeypatch) -> None:
    """The lookup's query vector is the one the search uses: the cache costs a miss nothing."""
    from rag_retriever.store import EdgeStore
    from tests.conftest import collection_retriever
    from tests.test_retriever import DOCS

    store = EdgeStore(tmp_path / "edge")
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.cache = SemanticCache(size=10, threshold=0.99)
    calls: list[int] = []
    original = tiny_encoder.encode_queries

    def counting(queries, **kw):
        calls.append(len(queries))
        return original(queries, **kw)

    monkeypatch.setattr(tiny_encoder, "encode_queries", counting)
    fresh = retriever.retrieve("wine of the city", k=3, mode="hybrid")
    assert calls == [1] and not any("cache" in n for n in fresh.notices)
    monkeypatch.setattr(tiny_encoder, "encode_queries", original)
    retriever.cache = None
    plain = retriever.retrieve("wine of the city", k=3, mode="hybrid")
    assert [h.chunk_id for h in plain.hits] == [h.chunk_id for h in fresh.hits]
    store.close()
