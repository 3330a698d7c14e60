"""The query path on a real in-memory Qdrant with a tiny encoder, checked against oracles."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from rank_bm25 import BM25Okapi

from rag_retriever.errors import (
    CollectionNotFound,
    ConfigError,
    FingerprintMismatch,
    InvalidRequest,
    ModelLoadError,
)
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.bm25 import Tokenizer
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.profiles import ModelProfile, write_profile_file
from rag_retriever.models.reranker import CrossEncoderReranker, PairScores, Scorer
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.fusion import METHODS, rrf
from rag_retriever.query.retriever import RetrievalConfig, Retriever
from rag_retriever.records import Document, FusionMethod, SearchFilter
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, Store
from tests.conftest import OutOfMemoryAbove, collection_retriever

TOPICS = ["apples", "pears", "wine", "river", "mountain", "city", "king", "queen", "war", "peace"]
DOCS = tuple(
    Document(
        f"doc{i}",
        f"{topic.title()} notes",
        f"The {topic} of {TOPICS[(i + 1) % 10]} and the {topic}. A {TOPICS[(i + 3) % 10]} story.",
        {"lang": "en" if i % 2 == 0 else "fr", "year": 2000 + i % 3},
    )
    for i, topic in enumerate(TOPICS)
)


@pytest.fixture
def collection(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> tuple[Retriever, ChunkTable]:
    report = ingest_documents(
        LoadedCorpus(DOCS, 0, "t"),
        alias="kb",
        encoder=tiny_encoder,
        store=store,
    )
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="kb")
    index = ChunkTable.load(store, report.collection)
    assert index is not None
    return retriever, index


def test_dense_order_equals_brute_force_cosine(collection, tiny_encoder: Encoder) -> None:
    retriever, index = collection
    query = "the king and the queen"
    hits = retriever.search(query, k=10, mode="dense")
    vectors = tiny_encoder.encode_passages(index.embed_texts(range(len(index)))).vectors
    qv = tiny_encoder.encode_queries([query]).vectors[0]
    cos = vectors @ qv
    assert [h.chunk_id for h in hits] == [index.chunks[i].id for i in np.argsort(-cos)[:10]]
    for h in hits:
        assert h.dense is not None and h.dense.score == pytest.approx(
            cos[index.row_of[h.chunk_id]], abs=1e-4
        )
        assert h.bm25 is None and h.fused is None and h.rerank is None  # stages that did not run
        assert h.score == h.dense.score


def test_bm25_equals_rank_bm25_and_explains_matches(collection) -> None:
    retriever, index = collection
    tok = Tokenizer()
    ref = BM25Okapi([tok.tokenize(t) for t in index.embed_texts(range(len(index)))])
    hits = retriever.search("Wine and the city", k=5, mode="bm25")
    scores = ref.get_scores(tok.tokenize("Wine and the city"))
    for h in hits:
        # the engine stores and sums float32 weights
        assert h.bm25 is not None
        assert h.bm25.score == pytest.approx(scores[index.row_of[h.chunk_id]], rel=1e-5)
        assert set(h.matched_terms) <= {"wine", "city"} and h.matched_terms
        assert h.dense is None
    assert [h.bm25.rank for h in hits if h.bm25] == list(range(1, len(hits) + 1))


@pytest.mark.parametrize("backend", ["edge", "server"])
def test_equal_scores_come_in_chunk_id_order(
    backend: str, store: Store, server_store: Store, tiny_encoder: Encoder
) -> None:
    # Every chunk has the same length and one "city": twelve equal BM25 scores, which the engine
    # returned in a different order on every run (and mined training examples changed with it).
    words = [w for w in TOPICS if w != "city"]
    docs = [Document(f"d{i}", "Note", f"The {w} of the city.") for i, w in enumerate(words)]
    on = {"edge": store, "server": server_store}[backend]
    retriever = collection_retriever(docs, on, tiny_encoder)
    hits = retriever.search("city", k=100, mode="bm25")
    assert len(hits) == len(docs) and len({h.score for h in hits}) == 1
    assert [h.chunk_id for h in hits] == sorted(h.chunk_id for h in hits)


@pytest.mark.parametrize("method", list(METHODS))
def test_hybrid_is_the_configured_fusion_of_the_two_lists(collection, method: FusionMethod) -> None:
    retriever, _ = collection
    retriever = retriever.with_config(fusion=method)
    query = "river mountain"
    dense_hits = retriever.search(query, k=100, mode="dense")
    bm25_hits = retriever.search(query, k=100, mode="bm25")
    dense = [h.chunk_id for h in dense_hits]
    bm25 = [h.chunk_id for h in bm25_hits]
    hybrid = retriever.search(query, k=100, mode="hybrid")
    if method == "rrf":
        expected = rrf([dense, bm25], k=60)
    else:
        expected = METHODS[method].fuse(
            [
                [(h.chunk_id, h.score) for h in dense_hits],
                [(h.chunk_id, h.score) for h in bm25_hits],
            ],
            k=60,
            weights=(1.0, 1.0),
        )
    assert [h.chunk_id for h in hybrid] == [i for i, _ in expected]
    top = hybrid[0]
    assert top.fused is not None and top.fused.rank == 1 and top.score == top.fused.score
    assert top.dense is not None  # both branches saw it
    for h in hybrid:
        assert (h.bm25 is not None) == (h.chunk_id in bm25)


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_filters_apply_to_both_branches(collection, mode: str) -> None:
    retriever, _ = collection
    flt = SearchFilter(equals={"lang": "fr"})
    hits = retriever.search("the wine of the king", k=20, mode=mode, filter=flt)
    assert hits and all(h.metadata["lang"] == "fr" for h in hits)
    by_doc = retriever.search(
        "the wine of the king", k=20, mode=mode, filter=SearchFilter(doc_ids=("doc2", "doc7"))
    )
    assert {h.doc_id for h in by_doc} <= {"doc2", "doc7"} and by_doc
    both = SearchFilter(doc_ids=("doc2", "doc7", "doc4"), equals={"year": 2002})
    assert {h.doc_id for h in retriever.search("king", k=20, mode=mode, filter=both)} <= {"doc2"}


def test_hybrid_filtered_equals_fusion_of_filtered_lists(collection) -> None:
    retriever, _ = collection
    flt = SearchFilter(equals={"lang": "en"})
    q = "apples wine river"
    dense = [h.chunk_id for h in retriever.search(q, k=100, mode="dense", filter=flt)]
    bm25 = [h.chunk_id for h in retriever.search(q, k=100, mode="bm25", filter=flt)]
    hybrid = [
        h.chunk_id
        for h in retriever.with_config(fusion="rrf").search(q, k=100, mode="hybrid", filter=flt)
    ]
    assert hybrid == [i for i, _ in rrf([dense, bm25])]


def test_result_carries_timings_and_notices(collection) -> None:
    retriever, _ = collection
    result = retriever.retrieve("king", k=3)
    assert result.mode == "hybrid"
    assert {"encode", "search", "fuse", "total"} <= set(result.timings_ms)
    assert any("reranking is off" in n for n in result.notices)
    assert [h.rank for h in result.hits] == [1, 2, 3]


def test_batch_equals_single(collection) -> None:
    retriever, _ = collection
    queries = ["king", "the river runs", "pears and apples"]
    batch = retriever.search_batch(queries, k=5)
    for q, hits in zip(queries, batch, strict=True):
        single = retriever.search(q, k=5)
        assert [h.chunk_id for h in hits] == [h.chunk_id for h in single]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"query": "   "}, "the query is empty"),
        ({"query": "x", "k": 0}, "k must be an integer from 1 to 100"),
        ({"query": "x", "k": 101}, "k must be an integer from 1 to 100"),
        ({"query": "x", "mode": "sparse"}, "unknown mode 'sparse'"),
        ({"query": "x", "mode": "rerank"}, "reranking is off"),
        ({"query": "x" * 2001}, "the limit is 2000"),
        ({"query": b"king"}, "the query must be a string, got bytes"),  # not "empty"
        ({"query": None}, "the query must be a string, got NoneType"),
        ({"query": "x", "collection": ""}, "collection must be an alias or version name"),
        ({"query": "x", "filter": ["doc2"]}, "filter must be a SearchFilter or its dict form"),
        ({"query": "x", "filter": {"doc_ids": "doc2"}}, "'doc_ids' must be a list of strings"),
    ],
)
def test_bad_requests(collection, kwargs: dict, message: str) -> None:
    retriever, _ = collection
    query = kwargs.pop("query")
    with pytest.raises(InvalidRequest, match=message):
        retriever.search(query, **kwargs)


def test_a_filter_in_its_dict_form_is_the_same_filter(collection) -> None:
    retriever, _ = collection
    as_dict = {"doc_ids": ["doc2", "doc7", "doc4"], "equals": {"year": 2002}}
    as_filter = SearchFilter(doc_ids=("doc2", "doc7", "doc4"), equals={"year": 2002})
    by_dict = retriever.search("the wine of the king", k=20, filter=as_dict)
    by_filter = retriever.search("the wine of the king", k=20, filter=as_filter)
    assert [h.chunk_id for h in by_dict] == [h.chunk_id for h in by_filter]
    assert by_dict and {h.doc_id for h in by_dict} == {"doc2"}


def test_one_string_where_a_sequence_goes_is_refused(collection) -> None:
    retriever, _ = collection
    with pytest.raises(InvalidRequest, match="not one string"):  # not "k", "i", "n", "g"
        retriever.search_batch("king")
    with pytest.raises(TypeError, match=r"write doc_ids=\('doc2',\)"):  # ("doc2") for ("doc2",)
        SearchFilter(doc_ids="doc2")  # type: ignore[arg-type]


def test_unknown_collection_lists_the_existing_ones(collection) -> None:
    retriever, _ = collection
    with pytest.raises(CollectionNotFound, match="existing: kb"):
        retriever.search("x", collection="nope")


def test_over_long_query_is_truncated_and_reported(collection) -> None:
    retriever, _ = collection
    result = retriever.retrieve("king " * 100, k=3)  # the tiny window is 64 tokens
    assert result.query_truncated
    assert any("truncated" in n for n in result.notices)
    assert not retriever.retrieve("king", k=3).query_truncated
    dense = retriever.retrieve("king " * 100, k=3, mode="dense").notices
    assert any("truncated" in n for n in dense) and not any("BM25" in n for n in dense)


def test_what_a_review_found_on_the_query_path(collection) -> None:
    """A stop-word-only question says why BM25 found nothing; NumPy numbers are numbers; a
    batch names its bad query with the cache on too; queries that are not a list are a clear
    error (each found by a review)."""
    import numpy as np

    from rag_retriever.query.cache import SemanticCache

    retriever, _ = collection
    quiet = retriever.retrieve("to be or not to be", k=3, mode="bm25")
    assert not quiet.hits and any("no word BM25 indexes" in n for n in quiet.notices)
    assert not any("BM25" in n for n in retriever.retrieve("king", k=3, mode="bm25").notices)
    hits = retriever.retrieve("king", k=np.int64(2), mode="dense", min_score=np.float32(-1)).hits
    assert len(hits) == 2
    with pytest.raises(InvalidRequest, match="queries must be a list of questions, got NoneType"):
        retriever.retrieve_batch(None)
    retriever.cache = SemanticCache(size=10, threshold=0.99)
    with pytest.raises(InvalidRequest, match=r"queries\[1\]: the query is empty"):
        retriever.retrieve_batch(["king", "  "], k=3, mode="bm25")


def test_collection_of_another_model_is_refused(
    collection, store: Store, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    _retriever, _ = collection
    other_dir = Path(shutil.copytree(tiny_encoder_dir, tmp_path / "other"))
    write_profile_file(other_dir, ModelProfile("other-bert", "q: ", "p: ", "mean", 64))
    other = Retriever(
        encoder=Encoder.load(str(other_dir), device="cpu"),
        store=store,
        collection="kb",
    )
    with pytest.raises(
        FingerprintMismatch,
        match=r"embedded with tiny-bert@\w+, but the query encoder is other-bert@",
    ):
        other.search("king")
    assert other.search("king", mode="bm25")  # BM25 does not depend on the encoder


def test_a_second_process_view_of_the_data_dir_answers_the_same(collection, tmp_path: Path) -> None:
    """No state outside the engine: a fresh store on the same data dir (as another process
    would open it) returns the same hits, BM25 included."""
    retriever, _ = collection
    other_store = EdgeStore(tmp_path / "edge")
    other = Retriever(encoder=retriever.encoder, store=other_store, collection="kb")
    for mode in ("dense", "bm25", "hybrid"):
        ours = [(h.chunk_id, h.score) for h in retriever.search("wine river", mode=mode)]
        theirs = [(h.chunk_id, h.score) for h in other.search("wine river", mode=mode)]
        assert ours == theirs
    other_store.close()


def test_server_store_serves_the_same_hits_as_edge(
    collection, server_store: Store, tiny_encoder: Encoder
) -> None:
    """The same corpus on both engines: the same ranked ids and (float32-equal) scores.

    Hybrid is left out: equal BM25 scores may come in another order from each engine, and RRF
    turns a swapped tie into different fused scores (hybrid = RRF of the lists is tested above).
    """
    retriever, _ = collection
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=tiny_encoder, store=server_store
    )
    on_server = Retriever(encoder=tiny_encoder, store=server_store, collection="kb")
    flt = SearchFilter(equals={"lang": "en"})
    for mode in ("dense", "bm25"):
        for f in (None, flt):
            edge_hits = retriever.search("wine river king", k=100, mode=mode, filter=f)
            server_hits = on_server.search("wine river king", k=100, mode=mode, filter=f)
            np.testing.assert_allclose(
                [h.score for h in edge_hits], [h.score for h in server_hits], rtol=1e-5
            )
            # equal scores may come in either order: compare (score, id) pairs
            assert {(round(h.score, 4), h.chunk_id) for h in edge_hits} == {
                (round(h.score, 4), h.chunk_id) for h in server_hits
            }


class OracleScorer:
    """Scores by a fixed table, so the expected order is known exactly."""

    def __init__(self, table: dict[str, float]) -> None:
        self.table = table
        self.calls: list[int] = []

    def score(self, query: str, passages: Sequence[str]) -> PairScores:
        self.calls.append(len(passages))
        return PairScores(np.array([self.table.get(p, 0.0) for p in passages], dtype=np.float32), 0)


def reranking_retriever(
    encoder: Encoder, store: Store, root: Path, scorer: Scorer, config: RetrievalConfig
) -> Retriever:
    return Retriever(
        encoder=encoder,
        store=store,
        reranker=scorer,
        config=config,
        collection="kb",
    )


def test_rerank_orders_exactly_by_scorer(
    collection, tiny_encoder: Encoder, store: Store, tmp_path: Path
) -> None:
    _, index = collection
    texts = index.embed_texts(range(len(index)))
    table = {t: float(len(t)) + i * 1e-3 for i, t in enumerate(texts)}
    scorer = OracleScorer(table)
    retriever = reranking_retriever(
        tiny_encoder,
        store,
        tmp_path,
        scorer,
        RetrievalConfig(rerank_candidates=6, rerank_fusion="none"),
    )
    result = retriever.retrieve("king queen war", k=6)
    assert result.mode == "rerank"
    fused = retriever.search("king queen war", k=6, mode="hybrid")
    expected = sorted(fused, key=lambda h: -table[index.embed_texts([index.row_of[h.chunk_id]])[0]])
    assert [h.chunk_id for h in result.hits] == [h.chunk_id for h in expected]
    assert scorer.calls == [6]  # only the top-M candidates are scored
    for h in result.hits:
        assert h.rerank is not None and h.fused is not None and h.score == h.rerank.score


def test_cross_encoder_loads_scores_and_counts_truncation(tiny_reranker_dir: Path) -> None:
    reranker = CrossEncoderReranker.load(
        tiny_reranker_dir, device="cpu", dtype="fp32", batch_size=2, max_length=32
    )
    passages = ["red apples", "the king " * 40, "river", "blue wine"]
    out = reranker.score("apples", passages)
    assert out.scores.shape == (4,) and out.truncated == 1
    # Scores do not depend on batch composition or order (padding is masked).
    for i, p in enumerate(passages):
        assert reranker.score("apples", [p]).scores[0] == pytest.approx(out.scores[i], abs=1e-4)


def test_a_reranker_out_of_memory_halves_its_batch_once_with_one_warning(
    tiny_reranker_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the error is simulated (a batch of more than 2 pairs raises CUDA's out-of-memory);
    the scores are the real model's, in the passages' order."""
    reranker = CrossEncoderReranker.load(
        tiny_reranker_dir, device="cpu", dtype="fp32", batch_size=8
    )
    passages = ["red apples", "the king and the queen", "river", "blue wine", "a", "b c"]
    reference = reranker.score("apples", passages).scores
    small = OutOfMemoryAbove(reranker.model, rows=2)
    reranker.model = small
    with caplog.at_level(logging.WARNING, logger="rag_retriever.models.reranker"):
        out = reranker.score("apples", passages)
        again = reranker.score("apples", passages)
    assert out.scores == pytest.approx(reference, abs=1e-5)
    assert again.scores == pytest.approx(reference, abs=1e-5)
    calls = small.calls
    assert calls[:2] == [6, 4] and max(calls[2:]) == 2 and reranker.batch_size == 2
    assert not any(small.in_handler)
    assert len([r for r in caplog.records if "out of memory" in r.getMessage()]) == 1
    small.rows, reranker.batch_size = 0, 1
    with pytest.raises(torch.OutOfMemoryError):
        reranker.score("apples", ["river"])


def test_two_label_reranker_scores_the_positive_class_log_odds(tmp_path: Path) -> None:
    """A two-label cross-encoder ranks by P(label 1) = softmax: its log-odds l1 - l0, in the
    same order. The raw positive logit is not: (5, 3) would rank above (0, 2)."""
    from transformers import BertForSequenceClassification

    from tests.conftest import build_tiny_bert

    directory = build_tiny_bert(tmp_path / "two", classifier=True, num_labels=2)
    config = json.loads((directory / "config.json").read_text())
    model = BertForSequenceClassification.from_pretrained(directory)
    reranker = CrossEncoderReranker.load(directory, device="cpu", dtype="fp32")
    passages = ["apples", "red wine", "the river city", "kings and queens", "b"]
    batch, _ = reranker.encode_pairs("q", passages)
    with torch.no_grad():
        logits = model.eval()(**batch).logits
    scores = reranker.score("q", passages).scores
    expected = (logits[:, 1] - logits[:, 0]).numpy()
    assert scores == pytest.approx(expected, abs=1e-4)
    positive = torch.softmax(logits, dim=1)[:, 1].numpy()
    assert list(np.argsort(-scores, kind="stable")) == list(np.argsort(-positive, kind="stable"))
    assert config["architectures"] == ["BertForSequenceClassification"]


def test_a_plain_encoder_is_not_accepted_as_reranker(
    tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="not a sequence-classification model"):
        CrossEncoderReranker.load(tiny_encoder_dir)
    with pytest.raises(ModelLoadError, match="no such directory"):
        CrossEncoderReranker.load(tmp_path / "missing")


def test_rerank_rrf_fusion_is_rrf_of_the_cross_encoder_and_hybrid_orders(
    collection, tiny_encoder: Encoder, store: Store, tmp_path: Path
) -> None:
    _, index = collection
    # Reverse the hybrid order: the fused order then differs from both inputs.
    texts = index.embed_texts(range(len(index)))
    table = {t: -float(len(t)) - i * 1e-3 for i, t in enumerate(texts)}
    scorer = OracleScorer(table)
    retriever = Retriever(
        encoder=tiny_encoder,
        store=store,
        reranker=scorer,
        config=RetrievalConfig(
            rerank_candidates=6, rerank_fusion="rrf", rerank_fusion_weights=(1.0, 0.5)
        ),
        collection="kb",
    )
    hybrid = retriever.search("king queen war", k=10, mode="hybrid")
    hits = retriever.search("king queen war", k=10, mode="rerank")
    candidates = [h.chunk_id for h in hybrid[:6]]
    by_ce = sorted(candidates, key=lambda c: -table[index.embed_texts([index.row_of[c]])[0]])
    expected = rrf([by_ce, candidates], k=60, weights=[1.0, 0.5])
    assert [h.chunk_id for h in hits[:6]] == [c for c, _ in expected]
    assert [h.score for h in hits[:6]] == pytest.approx([s for _, s in expected])
    assert [h.rank for h in hits] == list(range(1, len(hits) + 1))
    for h in hits[:6]:  # the cross-encoder's own rank and score stay on the hit
        assert h.rerank is not None
        assert h.rerank.rank == by_ce.index(h.chunk_id) + 1
        assert h.rerank.score == pytest.approx(
            table[index.embed_texts([index.row_of[h.chunk_id]])[0]]
        )
    # Beyond the candidates: the hybrid order, no rerank stage.
    assert [h.chunk_id for h in hits[6:]] == [h.chunk_id for h in hybrid[6:]]
    assert all(h.rerank is None for h in hits[6:])


def test_rerank_fusion_none_is_the_cross_encoder_order(
    collection, tiny_encoder: Encoder, store: Store, tmp_path: Path
) -> None:
    _, index = collection
    texts = index.embed_texts(range(len(index)))
    table = {t: -float(len(t)) - i * 1e-3 for i, t in enumerate(texts)}
    retriever = reranking_retriever(
        tiny_encoder,
        store,
        tmp_path,
        OracleScorer(table),
        RetrievalConfig(rerank_candidates=6, rerank_fusion="none"),
    )
    hits = retriever.search("king queen war", k=6, mode="rerank")
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert all(h.rerank is not None and h.score == h.rerank.score for h in hits)


def test_rerank_fusion_is_validated() -> None:
    with pytest.raises(ValueError, match="RAG_RERANK_FUSION must be one of none, rrf"):
        RetrievalConfig(rerank_fusion="max")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="RAG_RERANK_FUSION must be one of none, rrf"):
        Settings.from_env({"RAG_RERANK_FUSION": "max"})
    settings = Settings.from_env({"RAG_RERANK_FUSION": "none"})
    assert RetrievalConfig.from_settings(settings).rerank_fusion == "none"
    assert RetrievalConfig.from_settings(Settings()).rerank_fusion == Settings().rerank_fusion


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rrf_k": 0}, "RAG_RRF_K=0 is invalid: Input should be greater than 0"),
        ({"default_k": 500, "max_k": 10}, "RAG_DEFAULT_K (500) must not exceed RAG_MAX_K (10)"),
        ({"rrf_weights": (0.0, 0.0)}, "RAG_RRF_WEIGHTS"),
    ],
)
def test_retrieval_config_is_validated_like_the_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RetrievalConfig(**kwargs)


def test_rrf_weights_from_settings_reach_the_fusion(collection, store: Store) -> None:
    retriever, _ = collection
    dense_only = Retriever(
        encoder=retriever.encoder,
        store=store,
        config=RetrievalConfig.from_settings(Settings.from_env({"RAG_RRF_WEIGHTS": "1,0"})),
        collection="kb",
    )
    dense = [h.chunk_id for h in retriever.search("king queen war", k=5, mode="dense")]
    assert [h.chunk_id for h in dense_only.search("king queen war", k=5, mode="hybrid")] == dense


def test_chunks_cut_for_the_cross_encoder_are_reported(
    collection, tiny_encoder: Encoder, store: Store, tmp_path: Path, tiny_reranker_dir: Path
) -> None:
    config = RetrievalConfig(rerank_candidates=6)
    for max_length, cut in [(12, True), (512, False)]:
        reranker = CrossEncoderReranker.load(
            tiny_reranker_dir, device="cpu", dtype="fp32", max_length=max_length
        )
        retriever = reranking_retriever(tiny_encoder, store, tmp_path, reranker, config)
        result = retriever.retrieve("king queen war", k=6, mode="rerank")
        notes = [n for n in result.notices if "reranked chunks" in n]
        if cut:
            assert len(notes) == 1
            assert re.match(
                r"[1-6] of the 6 reranked chunks did not fit the cross-encoder's "
                r"12-token window",
                notes[0],
            ), notes
        else:
            assert notes == []


def test_every_mode_is_described_once_by_its_stages() -> None:
    from typing import get_args

    from rag_retriever.query.retriever import MODE_STAGES
    from rag_retriever.records import Mode

    assert tuple(MODE_STAGES) == get_args(Mode)  # the order the modes are listed in
    # each mode's result is the last list it makes; a stage needs the ones it builds on
    for stages in MODE_STAGES.values():
        assert not stages.fuse or (stages.dense and stages.bm25)
        assert not stages.rerank or stages.fuse
