"""tune-fusion on a real collection (tiny encoder): cached lists, split by document, the winner
stored only when it beats the default on held-out questions, served and rolled back with its
version."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from rag_retriever.cli import main
from rag_retriever.errors import ConfigError, IngestLocked, InvalidRequest
from rag_retriever.eval.questions import Question, load_questions
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.lock import IngestLock
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.bm25 import sparse_dot
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.fusion import METHODS, Fusion
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.settings import Settings
from rag_retriever.store import Store
from rag_retriever.store.catalog import rollback
from rag_retriever.training.folds import document_groups, folds_by_document
from rag_retriever.training.fusion import (
    Lists,
    _best_fusion,
    score,
    split_by_document,
    tune_fusion,
)
from rag_retriever.training.synthetic import synthetic_lists, synthetic_questions
from tests.conftest import write_jsonl

# Each document has a rare keyword that BM25 finds at once; the tiny random encoder does not.
KEYWORDS = [f"kw{chr(97 + i)}{chr(97 + j)}" for i in range(6) for j in range(8)]
DOCS = tuple(
    Document(f"d{i}", f"Note {i}", f"The {w} of the city. Rivers and the city and the hills.")
    for i, w in enumerate(KEYWORDS)
)


def questions_file(tmp_path: Path) -> Path:
    rows: list[dict[str, object]] = [
        {"id": f"q{i}", "question": f"{w} city hills", "gold_doc_ids": [f"d{i}"]}
        for i, w in enumerate(KEYWORDS)
    ]
    return write_jsonl(tmp_path / "q.jsonl", rows)


@pytest.fixture
def retriever(store: Store, tiny_encoder: Encoder) -> Retriever:
    for _ in range(2):  # two versions, for the rollback check
        ingest_documents(
            LoadedCorpus(DOCS, 0, "t"),
            alias="kb",
            encoder=tiny_encoder,
            store=store,
            full=True,  # a second version of the same corpus
            retention_grace_s=0,
        )
    # RRF k=60 as the default: it lets the tiny encoder's noise in, so tuning has a loss to fix
    # (the adaptive default already ranks the rare keyword first here)
    return Retriever(encoder=tiny_encoder, store=store, collection="kb").with_config(fusion="rrf")


def test_split_keeps_each_document_on_one_side() -> None:
    qs = [Question(f"q{i}", "x", (f"d{i % 7}",), (), (), i) for i in range(40)]
    train, held = split_by_document(qs, 0.3, seed=1)
    assert {q.gold_doc_ids for q in train}.isdisjoint({q.gold_doc_ids for q in held})
    assert len(train) + len(held) == 40 and 0.2 <= len(held) / 40 <= 0.5


@hypothesis_settings(max_examples=60, deadline=None)
@given(
    golds=st.lists(
        st.lists(st.sampled_from([f"d{i}" for i in range(12)]), min_size=0, max_size=3),
        min_size=4,
        max_size=40,
    ),
    seed=st.integers(0, 5),
)
def test_no_gold_document_lies_on_two_sides_of_a_split_or_in_two_folds(
    golds: list[list[str]], seed: int
) -> None:
    """Questions with several gold documents (SciFact's claims cite several abstracts): grouped
    by the first alone, the others landed on both sides (20 questions of golds (d_i, d_i+1)
    put 7 documents on both sides)."""
    qs = [Question(f"q{i}", "x", tuple(g), (), (), i) for i, g in enumerate(golds)]

    def docs(part: list[Question]) -> set[str]:
        return {d for q in part for d in q.gold_doc_ids}

    train, held = split_by_document(qs, 0.3, seed=seed)
    assert docs(train).isdisjoint(docs(held))
    assert sorted(q.id for q in train + held) == sorted(q.id for q in qs)
    groups = document_groups(qs)
    if len(groups) >= 3:
        folds = folds_by_document(qs, 3, seed=seed)
        for a, b in itertools.combinations(folds, 2):
            assert docs(a).isdisjoint(docs(b))


def test_tuned_fusion_is_stored_served_shown_and_rolled_back(
    retriever: Retriever, tmp_path: Path
) -> None:
    questions, _ = load_questions(questions_file(tmp_path))
    report = tune_fusion(retriever, questions, collection="kb", held_out_fraction=0.3)
    default, best = report.held_out["default"], report.held_out["best"]
    # BM25 alone answers every question here, and the default RRF lets dense noise in
    assert not report.train["default"].beats(report.train["best"])
    assert report.stored == best.beats(default)
    assert report.stored, report.to_json()
    assert best.recall1 > default.recall1
    served = retriever.store.aliases()["kb"]
    fusion = retriever.store.record(served).fusion
    assert fusion is not None and Fusion.from_json(fusion) == report.best
    # the query path applies it: hybrid equals the stored fusion of the two lists (oracle)
    retriever._opened.clear()
    query = "kwab city hills"
    result = retriever.retrieve(query, k=20, mode="hybrid")
    assert result.fusion == report.best.describe()
    dense = [(h.chunk_id, h.score) for h in retriever.search(query, k=100, mode="dense")]
    bm25 = [(h.chunk_id, h.score) for h in retriever.search(query, k=100, mode="bm25")]
    expected = [cid for cid, _ in report.best.fuse(dense, bm25)][:20]
    assert [h.chunk_id for h in result.hits] == expected
    # the older version has no tuned fusion: rollback serves the default again
    rollback(retriever.store, "kb")
    retriever._opened.clear()
    assert retriever.retrieve(query, mode="hybrid").fusion == report.default.describe()


def test_questions_of_another_collection_are_refused(retriever: Retriever, tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [
        {"id": f"q{i}", "question": "city", "gold_doc_ids": ["ghost"]} for i in range(30)
    ]
    questions, _ = load_questions(write_jsonl(tmp_path / "q.jsonl", rows))
    with pytest.raises(InvalidRequest, match="0 of 30 questions have a gold chunk"):
        tune_fusion(retriever, questions, collection="kb")


def test_tune_fusion_command_dry_run(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_jsonl(
        tmp_path / "docs.jsonl", [{"id": d.id, "title": d.title, "text": d.text} for d in DOCS]
    )
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    capsys.readouterr()
    code = main(
        [
            "tune-fusion",
            "--collection",
            "kb",
            "--questions",
            str(questions_file(tmp_path)),
            "--dry-run",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "held-out default" in out and "held-out best" in out and "(--dry-run)" in out


# -- a fitted fusion never cuts depth (issue 21, item 5) ----------------------------------------


def _depth_case() -> list[Lists]:
    """Two questions on disjoint lists of 60: q1's gold is BM25's first (a BM25-heavy fusion
    ranks it 1, equal RRF 2); q2's gold is dense's 20th, absent from BM25 (equal RRF ranks it
    40th, a BM25 weight of 4 puts all 60 BM25 ids above it: 80th)."""
    dense = [(i, 1.0 - i / 100) for i in range(60)]
    bm25 = [(1000 + i, 60.0 - i) for i in range(60)]
    return [Lists(dense, bm25, [{1000}]), Lists(dense, bm25, [{19}])]


def test_a_fusion_that_loses_recall_at_depth_is_never_chosen() -> None:
    lists = _depth_case()
    default = Fusion("rrf")
    heavy = Fusion("rrf", weights=(1.0, 4.0))
    base, candidate = score(default, lists), score(heavy, lists)
    assert (base.recall1, base.recall50) == (0.0, 1.0)
    assert (candidate.recall1, candidate.recall50) == (0.5, 0.5)
    assert candidate.mrr10 > base.mrr10  # better by the objective alone ...
    assert not candidate.keeps_depth_of(base) and not candidate.beats(base)  # ... lost at 50
    assert _best_fusion(default, [heavy], lists, progress=False) == (default, base)
    # a candidate that keeps the depth is chosen as before
    light = Fusion("rrf", weights=(1.0, 1.01))
    assert _best_fusion(default, [light], lists, progress=False)[0] == light


def test_the_fusion_chosen_does_not_depend_on_the_grid_s_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gains depth over the default, B has the higher objective and keeps the default's depth
    but not A's: B must win in either order (against A's depth, B lost when A came first)."""
    from rag_retriever.training import fusion as tuning

    default, a, b = Fusion("rrf"), Fusion("rrf", k=10), Fusion("rrf", k=20)
    figures = {
        default: tuning.Figures(0.50, 0.40, 0.60, 10, 0.90, 0.95),
        a: tuning.Figures(0.60, 0.50, 0.70, 10, 0.95, 0.97),
        b: tuning.Figures(0.70, 0.60, 0.80, 10, 0.92, 0.96),
    }
    monkeypatch.setattr(tuning, "score", lambda fusion, lists: figures[fusion])
    for grid in ([a, b], [b, a]):
        assert _best_fusion(default, grid, [], progress=False)[0] == b


def test_depths_chosen_by_tuning_leave_the_fused_list_whole(
    retriever: Retriever, tmp_path: Path
) -> None:
    """A stored fusion of depths 1,1 (the shallowest) still serves k=100 and 50 candidates."""
    served = retriever.store.aliases()["kb"]
    shallow = Fusion("dbsf", weights=(1.0, 3.0), depths=(1, 1))
    record = retriever.store.record(served)
    retriever.store.put_record(served, dataclasses.replace(record, fusion=shallow.to_json()))
    retriever._opened.clear()
    query = "kwab city hills"
    result = retriever.retrieve(query, k=100, mode="hybrid")
    assert result.fusion == shallow.describe()
    dense = {h.chunk_id for h in retriever.search(query, k=100, mode="dense")}
    bm25 = {h.chunk_id for h in retriever.search(query, k=100, mode="bm25")}
    assert len(result.hits) == min(100, len(dense | bm25)) > 2
    assert {h.chunk_id for h in result.hits} == dense | bm25


def test_the_tuning_report_shows_recall_at_depth(retriever: Retriever, tmp_path: Path) -> None:
    questions, _ = load_questions(questions_file(tmp_path))
    report = tune_fusion(retriever, questions, collection="kb", store=False)
    for part in (report.train, report.held_out):
        for figures in part.values():
            assert {"recall@50", "recall@100"} <= set(figures.to_json())
    assert report.held_out["best"].keeps_depth_of(report.held_out["default"])


# -- the untuned default is a setting -----------------------------------------------------------


def test_the_untuned_fusion_is_the_settings_and_a_bad_one_is_refused(
    retriever: Retriever,
) -> None:
    for method in METHODS:
        configured = retriever.with_config(fusion=method)
        configured._opened.clear()
        result = configured.retrieve("kwab city hills", k=5, mode="hybrid")
        assert result.fusion == Fusion(method).describe()
    with pytest.raises(
        ConfigError, match="RAG_FUSION must be one of rrf, dbsf, minmax, zscore, adaptive"
    ):
        Settings.from_env({"RAG_FUSION": "max"})
    with pytest.raises(ConfigError, match="RAG_RRF_WEIGHTS"):
        Settings.from_env({"RAG_RRF_WEIGHTS": "0,0"})


# -- fitting on synthetic questions (issue 21, item 2) ------------------------------------------

# Six-word sentences: the tiny encoder's chunks are short, and a chunk must keep some text once
# its sentence is taken out.
SENTENCES = (
    "Ice carved this deep valley slowly.",
    "Ships came to the old harbour.",
    "Wheat grew on the high terraces.",
    "Trains ran to the northern coast.",
)
PROSE = tuple(
    Document(f"p{i}", f"P{i}", f"{SENTENCES[i % 4]} The {KEYWORDS[i]} stands by the river.")
    for i in range(24)
)


def test_synthetic_questions_are_sentences_from_many_documents(
    store: Store, tiny_encoder: Encoder
) -> None:
    ingest_documents(LoadedCorpus(PROSE, 0, "t"), alias="prose", encoder=tiny_encoder, store=store)
    table = ChunkTable.load(store, store.resolve("prose"))
    made = synthetic_questions(table, 12, seed=3)
    assert made == synthetic_questions(table, 12, seed=3)  # deterministic
    assert made != synthetic_questions(table, 12, seed=4)
    assert len({q.doc_id for q in made}) == 12  # one per document before any second
    docs = {d.id: d.text for d in PROSE}
    for q in made:
        assert docs[q.doc_id][q.start : q.end] == q.question
        assert q.question in SENTENCES or KEYWORDS[int(q.doc_id[1:])] in q.question
        chunk = table.chunks[q.row]
        assert chunk.doc_id == q.doc_id and chunk.start <= q.start < q.end <= chunk.end
    with pytest.raises(ValueError):
        synthetic_questions(table, 0)


def test_synthetic_lists_take_the_sentence_out_of_the_corpus(
    store: Store, tiny_encoder: Encoder
) -> None:
    ingest_documents(LoadedCorpus(PROSE, 0, "t"), alias="prose", encoder=tiny_encoder, store=store)
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="prose")
    name = store.resolve("prose")
    table = ChunkTable.load(store, name)
    made = synthetic_questions(table, 4, seed=0)
    lists = synthetic_lists(retriever, table, made)
    opened = retriever.open_collection(name)
    for q, (dense, bm25, items) in zip(made, lists, strict=True):
        assert items == [{q.row}]
        # oracle: the chunk's own text with the sentence cut, scored by BM25 and the encoder
        text = table.embed_texts([q.row])[0].replace(q.question, " ")
        terms = retriever.tokenizer.tokenize(q.question)
        expected_bm25 = sparse_dot(
            opened.bm25.query_vector(terms),
            opened.bm25.document_vector(retriever.tokenizer.tokenize(text)),
        )
        got = dict(bm25)
        if expected_bm25 > 0:
            assert got[q.row] == pytest.approx(expected_bm25, rel=1e-5)
        else:
            assert q.row not in got
        _, traces = retriever.trace([q.question], mode="hybrid", collection=name)
        before = {table.row_of[c]: s.score for c, s in traces[0].bm25 or []}
        assert before[q.row] > got.get(q.row, 0.0)  # the sentence itself no longer matches
        qv = tiny_encoder.encode_queries([q.question]).vectors[0]
        pv = tiny_encoder.encode_passages([" ".join(text.split())]).vectors[0]
        assert dict(dense)[q.row] == pytest.approx(float(np.dot(qv, pv)), abs=1e-4)
        for ranked in (dense, bm25):
            assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)


def test_a_tuned_fusion_is_stored_under_the_alias_lock(
    retriever: Retriever, tmp_path: Path
) -> None:
    """The record is rewritten under the alias's write lock, read inside it: racing an update's
    alias move, a rewrite of a record read before would undo the move's `retired_at` stamp."""
    questions, _ = load_questions(questions_file(tmp_path))
    locks = tmp_path / "locks-dir"
    served = retriever.store.aliases()["kb"]
    with IngestLock(locks, "kb"), pytest.raises(IngestLocked, match="another write of 'kb'"):
        tune_fusion(retriever, questions, collection="kb", lock_dir=locks)
    assert retriever.store.record(served).fusion is None
    # a stamp written just before the store is kept (the record is read under the lock)
    stamped = dataclasses.replace(retriever.store.record(served), retired_at=123.0)
    retriever.store.put_record(served, stamped)
    report = tune_fusion(retriever, questions, collection="kb", lock_dir=locks)
    assert report.stored
    record = retriever.store.record(served)
    assert record.fusion is not None and record.retired_at == 123.0
