"""BM25 as sparse vectors: the engine's dot product equals rank-bm25's scores.

Oracles: a hand-computed Okapi score, `rank_bm25.BM25Okapi.get_scores` on hypothesis-generated
corpora (pure dot product and through a real Qdrant Edge shard and qdrant-client's server
implementation) and on real SciFact text.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import Stemmer
from hypothesis import given
from hypothesis import strategies as st
from qdrant_client import QdrantClient
from rank_bm25 import BM25Okapi

from rag_retriever.errors import VersionIncompatible
from rag_retriever.models import bm25 as bm25_module
from rag_retriever.models.bm25 import (
    BM25Model,
    BM25Stats,
    SparseVector,
    Tokenizer,
    as_doc_freqs,
    sparse_dot,
    term_index,
)
from rag_retriever.store import SPARSE, EdgeStore, ServerStore, StageQuery, Store
from rag_retriever.store.record import bare_record
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


def test_query_side_holds_counts_times_idf_and_documents_their_saturated_tf() -> None:
    """The IDF is the query's: a document's weights do not depend on the other documents."""
    model = BM25Model.build(CORPUS)
    q = model.query_vector(["wine", "wine", "blue", "red", "never-seen"])
    # red's IDF is 0 (in half the documents): kept at 0; never-seen is in none: left out
    assert sorted(zip(q.indices, q.values, strict=True)) == sorted(
        [
            (term_index("wine"), 2 * model.idf["wine"]),
            (term_index("blue"), model.idf["blue"]),
            (term_index("red"), 0.0),
        ]
    )
    k1, b, avgdl = 1.5, 0.75, 9 / 4
    doc = model.document_vector(["red", "wine", "red"])
    sat = {tf: tf * (k1 + 1) / (tf + k1 * (1 - b + b * 3 / avgdl)) for tf in (1, 2)}
    assert dict(zip(doc.indices, doc.values, strict=True)) == pytest.approx(
        {term_index("red"): sat[2], term_index("wine"): sat[1]}
    )
    # the same document in a bigger corpus with the same average length: the same weights
    extra = [["red", "wine", "kiwi"], ["pear", "fig"], ["plum", "fig"], ["kiwi", "pear"]]
    other = BM25Model.build([*CORPUS, *extra])
    assert other.stats.avgdl == model.stats.avgdl
    assert other.document_vector(["red", "wine", "red"]) == doc


def test_colliding_terms_get_their_own_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force every term onto two hash values: vocabulary terms are still scored exactly."""
    real = bm25_module.term_index
    monkeypatch.setattr(bm25_module, "term_index", lambda term: real(term) % 2)
    model = BM25Model.build(CORPUS)
    indices = [model.index_of(t) for t in ("red", "apple", "green", "wine", "blue")]
    assert len(set(indices)) == 5 and len(model.stats.moved) == 3
    ref = BM25Okapi(CORPUS)
    for query in (["apple"], ["red", "wine"], ["blue", "green"]):
        np.testing.assert_allclose(scores(model, CORPUS, query), ref.get_scores(query), rtol=1e-12)
    # the moves travel with the version's statistics
    stats = BM25Stats.from_json(json.loads(json.dumps(model.stats.to_json())))
    again = BM25Model(stats, model.doc_freqs)
    assert again.query_vector(["green"]) == model.query_vector(["green"])
    # a term entering the vocabulary later does not take an index that is in use
    grown = model.with_delta(added=[["kiwi", "plum", "fig"]], removed=[])
    vocabulary = [*model.doc_freqs, "kiwi", "plum", "fig"]
    assert len({grown.index_of(t) for t in vocabulary}) == len(vocabulary)
    assert all(grown.index_of(t) == model.index_of(t) for t in model.doc_freqs)


def test_statistics_round_trip_and_refuse_another_scheme() -> None:
    model = BM25Model.build(CORPUS)
    stats = BM25Stats.from_json(model.stats.to_json())
    assert stats == model.stats
    loaded = BM25Model(stats, dict(model.doc_freqs))
    assert loaded.query_vector(["red", "wine"]) == model.query_vector(["red", "wine"])
    for key in ("tokenizer", "term_hash", "weighting"):
        with pytest.raises(VersionIncompatible, match=f"{key}.*re-ingest"):
            BM25Stats.from_json({**model.stats.to_json(), key: "other"})


def test_a_corpus_without_terms_is_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="no document has a searchable term"):
        BM25Model.build([[], []])


@given(
    start=st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=8), min_size=1, max_size=12),
    steps=st.lists(
        st.tuples(
            st.lists(st.lists(st.sampled_from("abcdefghij"), max_size=8), max_size=4),
            st.lists(st.integers(0, 30), max_size=3),
        ),
        max_size=5,
    ),
    query=st.lists(st.sampled_from("abcdefghij"), min_size=1, max_size=4),
)
def test_deltas_score_as_rank_bm25_on_the_current_corpus_with_the_recorded_avgdl(
    start: list[list[str]], steps: list[tuple[list[list[str]], list[int]]], query: list[str]
) -> None:
    """A random sequence of additions and removals: the document frequencies are those of the
    corpus as it is now, and the scores are rank-bm25's with the lineage's average length."""
    if not any(start):
        return
    model = BM25Model.build(start)
    corpus = [list(d) for d in start]
    for added, removed_at in steps:
        gone = sorted({i % len(corpus) for i in removed_at}, reverse=True)
        if len(gone) >= len(corpus) + len(added):
            continue
        removed = [corpus.pop(i) for i in gone]
        corpus.extend(added)
        model = model.with_delta(added=added, removed=removed)
    if not any(corpus):
        return
    ref = BM25Okapi(corpus)
    ref.avgdl = model.stats.avgdl  # the lineage's, as recorded
    assert dict(model.doc_freqs) == {
        t: n for t, n in Counter(t for d in corpus for t in set(d)).items()
    }
    assert model.stats.n_docs == len(corpus)
    assert model.stats.total_terms == sum(map(len, corpus))
    # the histogram the IDF floor comes from, kept by the deltas, is the corpus's; each term's
    # IDF (read term by term, floor included) is rank-bm25's
    df = Counter(t for d in corpus for t in set(d))
    assert as_doc_freqs(model.doc_freqs).histogram == Counter(df.values())
    idf = model.idf_of(list(df))
    assert idf.keys() == ref.idf.keys()
    for term, value in ref.idf.items():
        assert idf[term] == pytest.approx(value, rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(
        scores(model, corpus, query), ref.get_scores(query), rtol=1e-9, atol=1e-12
    )
    # re-based, it is a full build of the corpus as it is now
    full = BM25Model.build(corpus)
    assert model.rebased().stats.avgdl == pytest.approx(full.stats.avgdl)


def test_tokenizer_stems_lowercases_and_drops_stopwords() -> None:
    tok = Tokenizer()
    assert tok.tokenize("The Running dogs of NORMANDY") == ["run", "dog", "normandi"]
    assert tok.analyze("Running") == [("running", "run")]
    assert tok.tokenize("the of and") == []
    assert tok.tokenize("Ｆｕｌｌ width") == ["full", "width"]  # NFKC


def _analysed_afresh(text: str) -> list[tuple[str, str]]:
    """The analysis without the tokenizer's memory of words (the oracle)."""
    words = re.findall(r"\w+", unicodedata.normalize("NFKC", text).lower())
    words = [w for w in words if w not in bm25_module.STOPWORDS]
    return list(zip(words, Stemmer.Stemmer("english").stemWords(words), strict=True))


_WORDS = st.sampled_from(
    ["The", "running", "runs", "of", "Ｆｕｌｌ", "naïve", "café", "NORMANDY", "x2", "ß", "İ", "and"]
)


@given(st.lists(st.lists(_WORDS | st.text(max_size=12), max_size=12).map(" ".join), max_size=8))
def test_tokenizer_memory_changes_no_term(texts: list[str]) -> None:
    """A memory of 5 words starts again many times: every text is analysed as afresh."""
    tok = Tokenizer()
    for text in [*texts, *texts]:  # the second pass reads what the first remembered
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(bm25_module, "MEMO_WORDS", 5)
            assert tok.analyze(text) == _analysed_afresh(text)
            assert tok.tokenize(text) == [term for _, term in _analysed_afresh(text)]


def test_tokenizer_shared_by_threads_analyses_as_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that learn and start the memory again at once still get every text's terms."""
    monkeypatch.setattr(bm25_module, "MEMO_WORDS", 50)
    texts = [f"running dogs {i} of the café {i % 7} apples{i % 13} NORMANDY" for i in range(400)]
    expected = [[t for _, t in _analysed_afresh(text)] for text in texts]
    tok = Tokenizer()
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(tok.tokenize, texts)) == expected


def test_empty_corpus_is_refused() -> None:
    with pytest.raises(ValueError):
        BM25Model.build([])


def engine_scores(store: Store, corpus: list[list[str]], queries: list[list[str]]) -> list[dict]:
    """Index `corpus` as sparse vectors in a real collection; every query's scores by row."""
    model = BM25Model.build(corpus)
    ids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(len(corpus))]
    store.create("t__x__v1", 1, bare_record("t__x__v1", dim=1, bm25=model.stats))
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
    results = iter(store.search("t__x__v1", requests))
    # a query of terms in no document (or of IDF 0) has no vector: it scores nothing
    return [
        {} if v.is_empty else {int(pid[-12:]): score for pid, score in next(results)}
        for v in vectors
    ]


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
    store.create("t__x__v1", 1, bare_record("t__x__v1", dim=1, bm25=model.stats))
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
