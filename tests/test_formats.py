"""docs/formats.md against the real loaders: every ```json / ```jsonl block of the page is read
here by the code that reads that format, so the page cannot drift from it."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from rag_retriever.errors import DocumentError
from rag_retriever.eval.questions import Span, load_questions
from rag_retriever.ingest.loaders import LoadedCorpus, load_documents
from rag_retriever.ingest.writer import _payload_indexes
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.querylog import QueryLog, questions_from_log
from rag_retriever.records import Chunk, Hit, SearchFilter, SearchResult, StageScore
from rag_retriever.store import Store
from tests.conftest import collection_retriever

PAGE = Path(__file__).resolve().parents[1] / "docs" / "formats.md"
SECTIONS = ("Documents", "Labelled questions", "The query log line", "The feedback line")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(lang: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """The page's fenced blocks (language, body) under each `## ` section."""
    out: dict[str, list[tuple[str, str]]] = {}
    for part in re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        title, _, body = part.partition("\n")
        out[title.strip()] = [
            (m[1], m[2]) for m in _FENCE.finditer(body) if lang is None or m[1] == lang
        ]
    return out


def example(section: str, lang: str) -> str:
    found = blocks(lang)[section]
    assert len(found) == 1, f"{section}: expected one ```{lang} block, found {len(found)}"
    return found[0][1]


def documents_file(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text(example("Documents", "jsonl"), encoding="utf-8")
    return path


def test_every_json_block_of_the_page_is_one_of_the_checked_formats() -> None:
    found = {
        title: [lang for lang, _ in bs if lang in ("json", "jsonl")]
        for title, bs in blocks().items()
    }
    assert {t: ls for t, ls in found.items() if ls} == {
        "Documents": ["jsonl"],
        "Labelled questions": ["jsonl"],
        "The query log line": ["json"],
        "The feedback line": ["json"],
    }
    assert tuple(found) == SECTIONS


def test_documents_load_with_extra_fields_as_metadata(tmp_path: Path) -> None:
    corpus = load_documents(documents_file(tmp_path))
    returns, shipping = corpus.documents
    assert (returns.id, returns.title) == ("returns", "Returns policy")
    assert (shipping.id, shipping.title) == ("shipping", "shipping")  # the title defaults to the id
    assert dict(returns.metadata) == {"lang": "en", "team": "support", "year": 2024}
    assert dict(shipping.metadata) == {
        "lang": "en",
        "tags": ["orders", "delivery"],
        "internal": False,
    }
    # the table's "required": a line without text is refused with its line, nothing loaded
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "title": "no text"}\n', encoding="utf-8")
    with pytest.raises(DocumentError, match=r"bad.jsonl:1: missing required field 'text'"):
        load_documents(bad)


def test_every_metadata_field_of_the_example_is_indexed(tmp_path: Path) -> None:
    docs = load_documents(documents_file(tmp_path)).documents
    chunks = [
        Chunk.from_payload(
            {
                "chunk_id": d.id,
                "doc_id": d.id,
                "title": d.title,
                "chunk_index": 0,
                "start": 0,
                "end": len(d.text),
                "text": d.text,
                "n_tokens": 1,
                "content_hash": d.id,
                "metadata": dict(d.metadata),
            }
        )
        for d in docs
    ]
    assert set(_payload_indexes(c.metadata for c in chunks)) == {
        "doc_id",
        *(f"metadata.{k}" for k in ("lang", "team", "year", "tags", "internal")),
    }


@pytest.mark.parametrize(
    ("equals", "expected"),
    [
        ({"lang": "en"}, {"returns", "shipping"}),
        ({"tags": "orders"}, {"shipping"}),  # a list matches on any element
        ({"year": 2024}, {"returns"}),
        # qdrant-edge-py 0.9 read a Python bool as an integer: a boolean filter matched nothing
        ({"internal": False}, {"shipping"}),
        ({"internal": True}, set()),  # "returns" has no such field
    ],
)
def test_the_example_s_metadata_filters(
    equals: dict[str, str | int | bool],
    expected: set[str],
    tmp_path: Path,
    store: Store,
    tiny_encoder: Encoder,
) -> None:
    docs = load_documents(documents_file(tmp_path)).documents
    retriever = collection_retriever(list(docs), store, tiny_encoder)
    flt = SearchFilter(equals=equals)
    hits = retriever.search("returned ship orders days", k=5, mode="bm25", filter=flt)
    assert {h.doc_id for h in hits} == expected


def test_folder_ids_are_paths_relative_to_the_folder_passed(tmp_path: Path) -> None:
    section = blocks("text")["Documents"]
    assert len(section) == 1 and "policies/" in section[0][1]
    kb = tmp_path / "kb"
    (kb / "policies").mkdir(parents=True)
    (kb / "faq.md").write_text("# FAQ\n\nAsk us anything.\n", encoding="utf-8")
    (kb / "policies" / "returns.md").write_text("Returns within 30 days.\n", encoding="utf-8")
    corpus = load_documents(kb)
    assert [(d.id, d.title, dict(d.metadata)) for d in corpus.documents] == [
        ("faq.md", "FAQ", {"path": "faq.md"}),
        ("policies/returns.md", "returns", {"path": "policies/returns.md"}),
    ]


def test_labelled_questions_load_and_their_spans_point_into_the_documents(
    tmp_path: Path,
) -> None:
    path = tmp_path / "questions.jsonl"
    path.write_text(example("Labelled questions", "jsonl"), encoding="utf-8")
    questions, problems = load_questions(path)
    assert problems == []
    q1, q2 = questions
    assert q1.gold_spans == (Span("returns", 0, 49),) and q1.answers == ("30 days",)
    assert q2.gold_spans == () and q2.gold_doc_ids == ("shipping",)
    texts = {d.id: d.text for d in load_documents(documents_file(tmp_path)).documents}
    assert all(d in texts for q in questions for d in q.gold_doc_ids)
    span = texts["returns"][0:49]
    assert span == "Items can be returned within 30 days of delivery."
    assert q1.answers[0] in span


def _real_lines(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A query line and a feedback line as QueryLog writes them."""
    log = QueryLog(tmp_path / "real-log")
    hit = Hit("c1", "returns", "T", "text", 0, 49, 0, rank=1, score=0.5, dense=StageScore(1, 0.5))
    result = SearchResult("q", "hybrid", "kb__m__v1", (hit,), {"total": 1.0}, query_id="id1")
    log.record(result, alias="kb", k=1, flt=SearchFilter(equals={"lang": "en"}))
    feedback = log.feedback("id1", chunk_id="c1", relevant=True)
    log.close()
    (line,) = (tmp_path / "real-log").glob("queries-*.jsonl")
    return json.loads(line.read_text(encoding="utf-8")), feedback


def test_the_query_log_and_feedback_lines_are_what_the_log_writes(tmp_path: Path) -> None:
    query = json.loads(example("The query log line", "json"))
    feedback = json.loads(example("The feedback line", "json"))
    real_query, real_feedback = _real_lines(tmp_path)
    # trace_id only when tracing is on: the example shows it, this log had none
    assert set(query) == set(real_query) | {"trace_id"}
    assert all(set(h) == set(real_query["hits"][0]) for h in query["hits"])
    assert query["filter"] == real_query["filter"]
    assert query["query_sha256"] == hashlib.sha256(query["query"].encode("utf-8")).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{32}", query["trace_id"])
    assert set(feedback) == set(real_feedback)
    assert feedback["query_id"] == query["query_id"]
    assert feedback["chunk_id"] in {h["chunk_id"] for h in query["hits"]}


def test_the_log_lines_become_the_documented_labelled_question(tmp_path: Path) -> None:
    log_dir = tmp_path / "query-log"
    log_dir.mkdir()
    query = json.loads(example("The query log line", "json"))
    feedback = json.loads(example("The feedback line", "json"))
    (log_dir / "queries-docs-1-1.jsonl").write_text(json.dumps(query) + "\n", encoding="utf-8")
    (log_dir / "feedback-docs-1-1.jsonl").write_text(json.dumps(feedback) + "\n", encoding="utf-8")
    rows, report = questions_from_log([log_dir])
    assert report.questions == 1
    out = tmp_path / "labelled.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (question,), problems = load_questions(out)
    assert problems == []
    assert question.question == query["query"] and question.gold_doc_ids == ("returns",)
    assert question.gold_spans == (Span("returns", 0, 49),)


def test_the_documents_example_ingests(tmp_path: Path, store: Store, tiny_encoder: Encoder) -> None:
    corpus = load_documents(documents_file(tmp_path))
    assert isinstance(corpus, LoadedCorpus) and corpus.skipped_empty == 0
    retriever = collection_retriever(list(corpus.documents), store, tiny_encoder)
    assert {h.doc_id for h in retriever.search("returned", k=5, mode="bm25")} == {"returns"}
