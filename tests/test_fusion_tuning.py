"""tune-fusion on a real collection (tiny encoder): cached lists, split by document, the winner
stored only when it beats the default on held-out questions, served and rolled back with its
version."""

from __future__ import annotations

from pathlib import Path

import pytest

from rag_retriever.cli import main
from rag_retriever.encoder import Encoder
from rag_retriever.errors import InvalidRequest
from rag_retriever.eval.questions import Question, load_questions
from rag_retriever.fusion import Fusion
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.records import Document
from rag_retriever.retriever import Retriever
from rag_retriever.store import Store
from rag_retriever.store.catalog import rollback
from rag_retriever.training.fusion import split_by_document, tune_fusion
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
    return Retriever(encoder=tiny_encoder, store=store, collection="kb")


def test_split_keeps_each_document_on_one_side() -> None:
    qs = [Question(f"q{i}", "x", (f"d{i % 7}",), (), (), i) for i in range(40)]
    train, held = split_by_document(qs, 0.3, seed=1)
    assert {q.gold_doc_ids for q in train}.isdisjoint({q.gold_doc_ids for q in held})
    assert len(train) + len(held) == 40 and 0.2 <= len(held) / 40 <= 0.5


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
