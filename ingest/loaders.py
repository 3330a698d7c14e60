"""Load documents from a `.jsonl` file or a directory of `.md`, `.txt`, `.html` and `.pdf` files,
strictly.

Example:
    >>> docs = load_documents(Path("docs"))                     # doctest: +SKIP
    >>> docs.documents[0].id, docs.skipped_empty                # doctest: +SKIP
    ('architecture.md', 0)

Every problem in the input is collected and reported together, each with its file and line, and
nothing is returned when there is any: a half-loaded corpus must never reach Qdrant. Text must be
valid Unicode (no lone surrogates), metadata field names must be filterable (no double quote or
backslash), and a document may hold at most `max_chars` characters.

jsonl lines are `{"id", "title", "text", ...}`; extra fields become document metadata. In a
directory, the id is the path relative to the directory; the title is the first markdown heading
or the HTML `<title>` (else the file name); HTML is reduced to its visible text with the standard
library's parser; a PDF's text comes from pypdf, page by page, and its metadata records where each
page starts (`page_starts`). Files of other types are skipped and counted by type; a symlink that
leaves the directory is refused unless `follow_symlinks=True`. Not handled: scanned PDFs (no OCR),
HTML rendered by JavaScript.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from rag_retriever.errors import DocumentError
from rag_retriever.records import Document
from rag_retriever.settings import default_of

TEXT_SUFFIXES = (".md", ".markdown", ".txt")
HTML_SUFFIXES = (".html", ".htm")
PDF_SUFFIXES = (".pdf",)
SUFFIXES = TEXT_SUFFIXES + HTML_SUFFIXES + PDF_SUFFIXES
MAX_REPORTED_PROBLEMS = 20
# RAG_MAX_DOCUMENT_CHARS's default (settings.py says why).
MAX_DOCUMENT_CHARS: int = default_of("max_document_chars")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


@dataclass(frozen=True)
class LoadedCorpus:
    documents: tuple[Document, ...]
    skipped_empty: int
    source: str
    # Files of a directory that were not loaded, by type (".pdf", "no suffix", ...).
    skipped_files: Mapping[str, int] = field(default_factory=dict)


def load_documents(
    path: Path, *, max_chars: int = MAX_DOCUMENT_CHARS, follow_symlinks: bool = False
) -> LoadedCorpus:
    """Load a `.jsonl` file or a directory; raise DocumentError listing every problem found."""
    if not path.exists():
        raise DocumentError(f"{path} does not exist; expected a .jsonl file or a directory")
    if path.is_dir():
        corpus = _load_directory(path, max_chars=max_chars, follow_symlinks=follow_symlinks)
    elif path.suffix == ".jsonl":
        corpus = _load_jsonl(path, max_chars=max_chars)
    else:
        raise DocumentError(
            f"{path}: unsupported input; expected a .jsonl file of "
            f'{{"id", "title", "text"}} lines or a directory of {"/".join(SUFFIXES)} files'
        )
    if not corpus.documents:
        raise DocumentError(
            f"{path}: no document with text to ingest ({corpus.skipped_empty} empty skipped); "
            f"nothing was written"
        )
    return corpus


def invalid_unicode(text: str) -> int | None:
    """The position of the first lone surrogate (text that cannot be written as UTF-8), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _text_problems(doc: Document, where: str, max_chars: int) -> list[str]:
    problems = []
    for name, value in (("id", doc.id), ("title", doc.title), ("text", doc.text)):
        at = invalid_unicode(value)
        if at is not None:
            problems.append(
                f"{where}: field {name!r} is not valid Unicode (lone surrogate at {at})"
            )
    if len(doc.text) > max_chars:
        problems.append(
            f"{where}: the text has {len(doc.text):,} characters, over the limit of "
            f"{max_chars:,} (RAG_MAX_DOCUMENT_CHARS); split the document"
        )
    for key in doc.metadata:
        if '"' in key or "\\" in key or invalid_unicode(key) is not None or not key:
            problems.append(
                f"{where}: metadata field name {key!r} cannot be filtered on; rename it "
                f"(no double quote, backslash or invalid Unicode, not empty)"
            )
    return problems


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


def _load_jsonl(path: Path, *, max_chars: int) -> LoadedCorpus:
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
        text_problems = _text_problems(doc, where, max_chars)
        if text_problems:
            problems.extend(text_problems)
            continue
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


class _HTMLText(HTMLParser):
    """Visible text of an HTML page (scripts and styles dropped) and its <title>."""

    _SKIP = frozenset({"script", "style", "noscript", "template"})
    _BLOCK = frozenset(
        {"p", "div", "section", "article", "li", "br", "tr", "h1", "h2", "h3", "h4", "h5", "h6"}
    )

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self._skipping = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skipping += 1
        elif tag == "title":
            self._in_title = True
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self._skipping:
            self._skipping -= 1
        elif tag == "title":
            self._in_title = False
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skipping:
            self.parts.append(data)

    def text(self) -> str:
        joined = "".join(self.parts)
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", joined)]
        return "\n\n".join(p for p in paragraphs if p)


def html_document(raw: str, rel: str, fallback_title: str) -> Document:
    parser = _HTMLText()
    parser.feed(raw)
    parser.close()
    title = " ".join(parser.title.split()) or fallback_title
    return Document(id=rel, title=title, text=parser.text(), metadata={"path": rel})


def pdf_document(path: Path, rel: str) -> Document:
    """The text of every page, pages separated by a blank line; `page_starts` in metadata."""
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    pages, starts, at = [], [], 0
    for page in reader.pages:
        text = (page.extract_text() or "").strip()
        starts.append(at)
        pages.append(text)
        at += len(text) + 2
    info = reader.metadata
    title = (str(info.get("/Title") or "") if info is not None else "") or path.stem
    return Document(
        id=rel,
        title=title,
        text="\n\n".join(pages),
        metadata={"path": rel, "pages": len(pages), "page_starts": starts},
    )


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _skipped_kind(path: Path) -> str:
    return path.suffix.lower() or "no suffix"


def _read_file(path: Path, rel: str) -> tuple[Document | None, str | None]:
    """One directory file as a Document, or a problem."""
    suffix = path.suffix.lower()
    if suffix in PDF_SUFFIXES:
        try:
            return pdf_document(path, rel), None
        except Exception as exc:  # pypdf raises many types for a damaged file
            return None, f"{path}: cannot read this PDF ({type(exc).__name__}: {exc})"
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Report the line, so the user can find the bad byte.
        line = raw[: exc.start].count(b"\n") + 1
        return None, f"{path}:{line}: not valid UTF-8 (byte {exc.start}): {exc.reason}"
    if suffix in HTML_SUFFIXES:
        return html_document(text, rel, path.stem), None
    return Document(
        id=rel, title=_title_of(text, path.stem), text=text, metadata={"path": rel}
    ), None


def _load_directory(root: Path, *, max_chars: int, follow_symlinks: bool) -> LoadedCorpus:
    problems: list[str] = []
    documents: list[Document] = []
    skipped = 0
    skipped_files: Counter[str] = Counter()
    files = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        if path.is_symlink() and not follow_symlinks and not _inside(path, root):
            problems.append(
                f"{path}: a symlink to {path.resolve()}, outside {root}; refused "
                f"(pass --follow-symlinks to ingest it)"
            )
        elif path.suffix.lower() in SUFFIXES:
            files.append(path)
        else:
            skipped_files[_skipped_kind(path)] += 1
    if not files and not problems:
        raise DocumentError(
            f"{root}: no {'/'.join(SUFFIXES)} files found"
            + (f" (skipped: {_describe(skipped_files)})" if skipped_files else "")
        )
    for path in files:
        rel = path.relative_to(root).as_posix()
        doc, problem = _read_file(path, rel)
        if problem is not None:
            problems.append(problem)
            continue
        assert doc is not None
        text_problems = _text_problems(doc, str(path), max_chars)
        if text_problems:
            problems.extend(text_problems)
        elif not doc.text.strip():
            skipped += 1
        else:
            documents.append(doc)
    _raise_if_problems(problems, root)
    return LoadedCorpus(tuple(documents), skipped, str(root), dict(skipped_files))


def _describe(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
