"""Labelled questions: load and validate the jsonl format of ../shared/data/README.md.

Example:
    >>> questions, problems = load_questions(Path("questions_dev.jsonl"))   # doctest: +SKIP

A line is `{"id", "question", "gold_doc_ids": [...], "gold_spans": [{"doc_id", "start", "end"}],
"answers": [...]}`; `gold_spans` and `answers` are optional, other fields are ignored. Bad lines
are returned as problems with their line numbers, never dropped silently.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_retriever.errors import ConfigError
from rag_retriever.ingest.loaders import jsonl_records


@dataclass(frozen=True)
class Span:
    doc_id: str
    start: int
    end: int


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    gold_doc_ids: tuple[str, ...]
    gold_spans: tuple[Span, ...]
    answers: tuple[str, ...]
    line: int


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_questions(path: Path) -> tuple[list[Question], list[str]]:
    """Valid questions and a list of `file:line: problem` strings."""
    questions: list[Question] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"questions file {path} cannot be read ({exc.strerror}): give a .jsonl of labelled "
            "questions"
        ) from None
    for lineno, where, record in jsonl_records(data, path, problems):
        question, problem = _parse(record, where, lineno)
        if problem:
            problems.append(problem)
            continue
        assert question is not None
        if question.id in seen:
            problems.append(
                f"{where}: duplicate question id {question.id!r} (first on line {seen[question.id]})"
            )
            continue
        seen[question.id] = lineno
        questions.append(question)
    return questions, problems


def _parse(record: Any, where: str, lineno: int) -> tuple[Question | None, str | None]:
    if not isinstance(record, dict):
        return None, f"{where}: expected a JSON object"
    qid, text, gold = record.get("id"), record.get("question"), record.get("gold_doc_ids")
    if not isinstance(qid, str | int) or isinstance(qid, bool):
        return None, f"{where}: 'id' must be a string"
    if not isinstance(text, str) or not text.strip():
        return None, f"{where}: 'question' must be a non-empty string"
    if not isinstance(gold, list) or not gold or not all(isinstance(g, str) for g in gold):
        return None, f"{where}: 'gold_doc_ids' must be a non-empty list of strings"
    spans = []
    for span in record.get("gold_spans") or []:
        if not (
            isinstance(span, dict)
            and isinstance(span.get("doc_id"), str)
            and isinstance(span.get("start"), int)
            and isinstance(span.get("end"), int)
            and 0 <= span["start"] < span["end"]
        ):
            return None, f"{where}: each gold span must be {{doc_id, start, end}} with start < end"
        if span["doc_id"] not in gold:
            return None, f"{where}: gold span of {span['doc_id']!r}, which is not in gold_doc_ids"
        spans.append(Span(span["doc_id"], span["start"], span["end"]))
    answers = record.get("answers") or []
    if not isinstance(answers, list):
        return None, f"{where}: 'answers' must be a list"
    return (
        Question(
            id=str(qid),
            question=text,
            gold_doc_ids=tuple(gold),
            gold_spans=tuple(spans),
            answers=tuple(str(a) for a in answers),
            line=lineno,
        ),
        None,
    )
