"""Load documents from a `.jsonl` file or a directory of `.md` / `.txt` files, strictly.

Example:
    >>> docs = load_documents(Path("docs"))                     # doctest: +SKIP
    >>> docs.documents[0].id, docs.skipped_empty                # doctest: +SKIP
    ('architecture.md', 0)

Every problem in the input is collected and reported together, each with its file and line, and
nothing is returned when there is any: a half-loaded corpus must never reach Qdrant.
jsonl lines are `{"id", "title", "text", ...}`; extra fields become document metadata.
In a directory, the title is the first markdown heading, else the file name; the id is the
path relative to the directory. Other file types (PDF, HTML, ...) are not handled.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_retriever.errors import DocumentError
from rag_retriever.records import Document

TEXT_SUFFIXES = (".md", ".markdown", ".txt")
MAX_REPORTED_PROBLEMS = 20
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


@dataclass(frozen=True)
class LoadedCorpus:
    documents: tuple[Document, ...]
    skipped_empty: int
    source: str


def load_documents(path: Path) -> LoadedCorpus:
    """Load a `.jsonl` file or a directory; raise DocumentError listing every problem found."""
    if not path.exists():
        raise DocumentError(f"{path} does not exist; expected a .jsonl file or a directory")
    if path.is_dir():
        return _load_directory(path)
    if path.suffix == ".jsonl":
        return _load_jsonl(path)
    raise DocumentError(
        f"{path}: unsupported input; expected a .jsonl file of "
        f'{{"id", "title", "text"}} lines or a directory of {"/".join(TEXT_SUFFIXES)} files'
    )


def _raise_if_problems(problems: list[str], source: Path) -> None:
    if not problems:
        return
    shown = problems[:MAX_REPORTED_PROBLEMS]
    more = len(problems) - len(shown)
    tail = f"\n  ... and {more} more" if more else ""
    raise DocumentError(
        f"{len(problems)} problem(s) in {source}; nothing was ingested:\n  "
        + "\n  ".join(shown)
        + tail
    )


def _duplicate_problems(ids: list[tuple[str, str]]) -> list[str]:
    """`ids` are (id, where) pairs; report each duplicated id once with every place it occurs."""
    counts = Counter(doc_id for doc_id, _ in ids)
    problems = []
    for doc_id, n in counts.items():
        if n > 1:
            places = ", ".join(where for d, where in ids if d == doc_id)
            problems.append(f"duplicate id {doc_id!r} ({n} times: {places})")
    return problems


def _load_jsonl(path: Path) -> LoadedCorpus:
    problems: list[str] = []
    documents: list[Document] = []
    ids: list[tuple[str, str]] = []
    skipped = 0
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"{path}: cannot read: {exc}") from None
    for lineno, line_bytes in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{lineno}"
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{where}: not valid UTF-8 (byte {exc.start}): {exc.reason}")
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})")
            continue
        doc, problem = _document_from_record(record, where)
        if problem:
            problems.append(problem)
            continue
        assert doc is not None
        ids.append((doc.id, where))
        if doc.text.strip():
            documents.append(doc)
        else:
            skipped += 1
    problems.extend(_duplicate_problems(ids))
    _raise_if_problems(problems, path)
    return LoadedCorpus(tuple(documents), skipped, str(path))


def _document_from_record(record: Any, where: str) -> tuple[Document | None, str | None]:
    if not isinstance(record, dict):
        return None, f"{where}: expected a JSON object, got {type(record).__name__}"
    for key in ("id", "text"):
        if key not in record:
            return None, f"{where}: missing required field {key!r} (need 'id' and 'text')"
    for key in ("id", "title", "text"):
        if key in record and not isinstance(record[key], str):
            return None, (
                f"{where}: field {key!r} must be a string, got {type(record[key]).__name__}"
            )
    if not record["id"].strip():
        return None, f"{where}: field 'id' is empty"
    metadata = {k: v for k, v in record.items() if k not in ("id", "title", "text")}
    title = record.get("title") or record["id"]
    return Document(id=record["id"], title=title, text=record["text"], metadata=metadata), None


def _title_of(text: str, fallback: str) -> str:
    match = _HEADING.search(text)
    return match.group(1).strip() if match else fallback


def _load_directory(root: Path) -> LoadedCorpus:
    problems: list[str] = []
    documents: list[Document] = []
    skipped = 0
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DocumentError(f"{root}: no {'/'.join(TEXT_SUFFIXES)} files found")
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            # Report the line, so the user can find the bad byte.
            line = path.read_bytes()[: exc.start].count(b"\n") + 1
            problems.append(f"{path}:{line}: not valid UTF-8 (byte {exc.start}): {exc.reason}")
            continue
        if not text.strip():
            skipped += 1
            continue
        documents.append(
            Document(
                id=rel,
                title=_title_of(text, path.stem),
                text=text,
                metadata={"path": rel},
            )
        )
    _raise_if_problems(problems, root)
    return LoadedCorpus(tuple(documents), skipped, str(root))
