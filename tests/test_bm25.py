"""BM25 as sparse vectors: the engine's dot product equals rank-bm25's scores.

Oracles: a hand-computed Okapi score, `rank_bm25.BM25Okapi.get_scores` on hypothesis-generated
corpora (pure dot product and through a real Qdrant Edge shard and qdrant-client's server
implementation) and on real SciFact text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from qdrant_client import QdrantClient
from rank_bm25 import BM25Okapi

from rag_retriever import bm25 as bm25_module
from rag_retriever.bm25 import BM25Model, SparseVector, Tokenizer, sparse_dot, term_index
from rag_retriever.store import SPARSE, EdgeStore, ServerStore, StageQuery, Store
from tests.conftest import shared_data

CORPUS = [["red", "apple"], ["green", "apple", "apple"], ["red", "wine", "red"], ["blue"]]
# Qdrant stores and sums sparse weights as float32.
RTOL = ATOL = 1e-5


def scores(model: BM25Model, corpus: list[list[str]], query: list[str]) -> np.ndarray:
    q = model.query_vector(query)
    return np.array([sparse_dot(q, model.document_vector(doc)) for doc in corpus])


def test_hand_computed_scores() -> None:
    model = BM25Model.build(CORPUS)
    n, avgdl, k1, b = 4, 9 / 4, 1.5, 0.75
    idf_wine = math.log(n - 1 + 0.5) - math.log(1 + 0.5)
    tf, dl = 1, 3
    wine = idf_wine * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)))
    got = scores(model, CORPUS, ["wine", "red"])
    assert model.idf["red"] == 0.0  # red is in half the documents: log(2.5 / 2.5)
    assert got[2] == pytest.approx(wine)
    assert got[0] == 0.0 and got[3] == 0.0


def test_equals_rank_bm25_including_negative_idf_floor_and_repeats() -> None:
    model = BM25Model.build(CORPUS)
    ref = BM25Okapi(CORPUS)
    assert model.idf == ref.idf  # rank-bm25's own IDF, epsilon floor included
    for query in (["apple"], ["red", "red", "apple"], ["unknown"], ["blue", "green", "wine"]):
        np.testing.assert_allclose(scores(model, CORPUS, query), ref.get_scores(query), rtol=1e-12)


def test_query_vector_counts_repeats_and_documents_hold_distinct_terms() -> None:
    model = BM25Model.build(CORPUS)
    q = model.query_vector(["red", "red", "apple"])
    assert sorted(zip(q.indices, q.values, strict=True)) == sorted(
        [(term_index("red"), 2.0), (term_index("apple"), 1.0)]
    )
    doc = model.document_vector(["red", "wine", "red"])
    assert list(doc.indices) == sorted({term_index("red"), term_index("wine")})
    with pytest.raises(KeyError):
        model.document_vector(["never-seen"])


def test_colliding_terms_get_their_own_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force every term onto two hash values: vocabulary terms are still scored exactly."""
    real = bm25_module.term_index
    monkeypatch.setattr(bm25_module, "term_index", lambda term: real(term) % 2)
    model = BM25Model.build(CORPUS)
    indices = [model.index_of(t) for t in ("red", "apple", "green", "wine", "blue")]
    assert len(set(indices)) == 5 and len(model.moved) == 3
    ref = BM25Okapi(CORPUS)
    for query in (["apple"], ["red", "wine"], ["blue", "green"]):
        np.testing.assert_allclose(scores(model, CORPUS, query), ref.get_scores(query), rtol=1e-12)
    # the moves travel with the version's metadata
    again = BM25Model.from_json(json.loads(json.dumps(model.to_json())))
    assert again.query_vector(["green"]) == model.query_vector(["green"])


def test_metadata_round_trip_encodes_queries_only() -> None:
    model = BM25Model.build(CORPUS)
    loaded = BM25Model.from_json(model.to_json())
    assert loaded == model
    assert loaded.query_vector(["red"]) == model.query_vector(["red"])
    with pytest.raises(ValueError, match="queries only"):
        loaded.document_vector(["red"])
    with pytest.raises(ValueError, match="tokenizer"):
        BM25Model.from_json({**model.to_json(), "tokenizer": "other"})


def test_tokenizer_stems_lowercases_and_drops_stopwords() -> None:
    tok = Tokenizer()
    assert tok.tokenize("The Running dogs of NORMANDY") == ["run", "dog", "normandi"]
    assert tok.analyze("Running") == [("running", "run")]
    assert tok.tokenize("the of and") == []
    assert tok.tokenize("Ｆｕｌｌ width") == ["full", "width"]  # NFKC


def test_empty_corpus_is_refused() -> None:
    with pytest.raises(ValueError):
        BM25Model.build([])


def engine_scores(store: Store, corpus: list[list[str]], queries: list[list[str]]) -> list[dict]:
    """Index `corpus` as sparse vectors in a real collection; every query's scores by row."""
    model = BM25Model.build(corpus)
    ids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(len(corpus))]
    store.create("t__x__v1", 1, {"status": "building"})
    store.upsert(
        "t__x__v1",
        ids,
        np.ones((len(corpus), 1), dtype=np.float32),
        [model.document_vector(d) for d in corpus],
        [{} for _ in corpus],
    )
    store.seal("t__x__v1", {})
    vectors = [model.query_vector(q) for q in queries]
    requests = [StageQuery(SPARSE, v, len(corpus)) for v in vectors if not v.is_empty]
    out = []
    for found in store.search("t__x__v1", requests):
        out.append({int(pid[-12:]): score for pid, score in found})
    return out


WORD = st.sampled_from(["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay"])


@given(
    corpus=st.lists(st.lists(WORD, min_size=0, max_size=12), min_size=1, max_size=25),
    queries=st.lists(st.lists(WORD, min_size=1, max_size=5), min_size=1, max_size=4),
)
def test_edge_engine_scores_equal_rank_bm25(
    tmp_path_factory: pytest.TempPathFactory, corpus: list[list[str]], queries: list[list[str]]
) -> None:
    if not any(corpus):
        return  # rank-bm25 divides by the average length
    store = EdgeStore(tmp_path_factory.mktemp("edge"))
    try:
        got = engine_scores(store, corpus, queries)
    finally:
        store.close()
    ref = BM25Okapi(corpus)
    for query, found in zip(queries, got, strict=True):
        expected = ref.get_scores(query)
        for row, score in found.items():
            np.testing.assert_allclose(score, expected[row], rtol=RTOL, atol=ATOL)
        # every document that scores above 0 comes back, and none without a query term
        with_term = {i for i, d in enumerate(corpus) if set(query) & set(d)}
        assert {i for i, s in enumerate(expected) if s > 0} <= set(found) <= with_term


def test_server_engine_scores_equal_rank_bm25() -> None:
    corpus = [["ant", "bee", "bee"], ["cat"], ["ant", "cat", "dog", "dog"], ["eel"], ["bee"]]
    queries = [["bee"], ["ant", "dog", "dog"], ["cat", "eel"]]
    server = ServerStore(QdrantClient(":memory:"))
    got = engine_scores(server, corpus, queries)
    ref = BM25Okapi(corpus)
    for query, found in zip(queries, got, strict=True):
        expected = ref.get_scores(query)
        assert found.keys() == {i for i, s in enumerate(expected) if s != 0}
        for row, score in found.items():
            np.testing.assert_allclose(score, expected[row], rtol=RTOL, atol=ATOL)


def test_sparse_vector_checks_its_shape() -> None:
    with pytest.raises(ValueError):
        SparseVector((1, 2), (1.0,))


@pytest.mark.data
def test_identical_top_100_on_a_real_corpus(tmp_path: Path) -> None:
    """SciFact abstracts (5,183 documents), 100 real claims, through a Qdrant Edge shard."""
    tok = Tokenizer()
    with shared_data("scifact", "docs.jsonl").open(encoding="utf-8") as fh:
        docs = [json.loads(line) for line in fh]
    corpus = tok.tokenize_many([d["title"] + "\n\n" + d["text"] for d in docs])
    ref = BM25Okapi(corpus)
    with shared_data("scifact", "questions_train.jsonl").open(encoding="utf-8") as fh:
        claims = [tok.tokenize(json.loads(line)["question"]) for line in fh][:100]
    model = BM25Model.build(corpus)
    store = EdgeStore(tmp_path)
    ids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(len(corpus))]
    store.create("t__x__v1", 1, {})
    for start in range(0, len(corpus), 1000):
        part = corpus[start : start + 1000]
        store.upsert(
            "t__x__v1",
            ids[start : start + len(part)],
            np.ones((len(part), 1), dtype=np.float32),
            [model.document_vector(d) for d in part],
            [{} for _ in part],
        )
    store.seal("t__x__v1", {})
    results = store.search(
        "t__x__v1", [StageQuery(SPARSE, model.query_vector(q), 100) for q in claims]
    )
    for query, found in zip(claims, results, strict=True):
        expected = ref.get_scores(query)
        rows = [int(pid[-12:]) for pid, _ in found]
        np.testing.assert_allclose([s for _, s in found], expected[rows], rtol=RTOL, atol=ATOL)
        # the same top 100 up to ties at the cut: everything scoring above the 100th is there
        cut = np.sort(expected)[-100]
        assert set(np.flatnonzero(expected > cut + 1e-4)) <= set(rows)
    store.close()
