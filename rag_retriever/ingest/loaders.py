"""Load documents from a `.jsonl` file or a directory of `.md`, `.txt`, `.html` and `.pdf` files,
strictly.

Example:
    >>> docs = load_documents(Path("docs"))                     # doctest: +SKIP
    >>> docs.documents[0].id, docs.skipped_empty                # doctest: +SKIP
    ('architecture.md', 0)

Every problem in the input is collected and reported together, each with its file and line, and
nothing is returned when there is any: a half-loaded corpus must never reach Qdrant. Each
document is checked by the rules of `validation.py` (the same ones the HTTP write routes and
`update_documents` apply): valid Unicode, metadata the engine stores and filters (finite numbers,
bounded nesting and size, filterable names), at most `max_chars` characters.

jsonl lines are `{"id", "title", "text", ...}`; extra fields become document metadata. In a
directory, the id is the path relative to the directory; the title is the first markdown heading
or the HTML `<title>` (else the file name); HTML is reduced to its visible text with the standard
library's parser; a PDF's text comes from pypdf, page by page, and its metadata records where each
page starts (`page_starts`). Files of other types are skipped and counted by type; a symlink that
leaves the directory is refused unless `follow_symlinks=True`. Not handled: scanned PDFs (no OCR),
HTML rendered by JavaScript.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from rag_retriever.errors import DocumentError
from rag_retriever.ingest.validation import (
    MAX_DOCUMENT_CHARS,
    document_problems,
    duplicate_problems,
    raise_if_problems,
)
from rag_retriever.records import DocKey, Document, Heading

# An ATX heading; a closing run of #s counts only after a space (CommonMark: "# C#" is "C#").
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)(?:\s+#+)?\s*$", re.MULTILINE)
# A byte order mark some editors put at the start of a UTF-8 file (not text).
_BOM = "\ufeff"


@dataclass(frozen=True)
class LoadedCorpus:
    documents: tuple[Document, ...]
    skipped_empty: int
    source: str
    # Files of a directory that were not loaded, by type (".pdf", "no suffix", ...).
    skipped_files: Mapping[str, int] = field(default_factory=dict)
    # Where each document skipped as empty came from ("file:line", a file's path).
    empty: tuple[str, ...] = ()


def load_documents(
    path: Path,
    *,
    max_chars: int = MAX_DOCUMENT_CHARS,
    follow_symlinks: bool = False,
    root: Path | None = None,
    include_hidden: bool = False,
) -> LoadedCorpus:
    """Load a `.jsonl` file or a directory; raise DocumentError listing every problem found.
    A directory's ids are its files' paths relative to `root` (a folder that holds it; default:
    the directory itself). A directory's hidden files and folders (`.git`, `.venv`, `.github`:
    a name that starts with a dot) are skipped and counted unless `include_hidden`."""
    if not path.exists():
        raise DocumentError(f"{path} does not exist; expected a .jsonl file or a directory")
    if path.is_dir():
        corpus = _load_directory(
            path,
            max_chars=max_chars,
            follow_symlinks=follow_symlinks,
            include_hidden=include_hidden,
            prefix=id_prefix(path, root) if root is not None else "",
        )
    elif path.suffix.lower() == ".jsonl":
        corpus = _load_jsonl(path, max_chars=max_chars)
    else:
        raise DocumentError(
            f"{path}: unsupported input; expected a .jsonl file of "
            f'{{"id", "title", "text"}} lines or a directory of {describe_suffixes()} files'
        )
    if not corpus.documents:
        raise DocumentError(
            f"{path}: no document with text to ingest ({corpus.skipped_empty} empty skipped); "
            f"nothing was written"
        )
    _check_indexable(corpus, path)
    return corpus


def _check_indexable(corpus: LoadedCorpus, path: Path) -> None:
    """At least one word BM25 can index (stops at the first document that has one): a corpus of
    stop words and punctuation alone has no term statistics to build."""
    from rag_retriever.models.bm25 import Tokenizer  # the stemmer loads only for an ingest

    tokenizer = Tokenizer()
    if any(tokenizer.tokenize(f"{d.title}\n{d.text}") for d in corpus.documents):
        return
    raise DocumentError(
        f"{path}: no document has a word to index: every word of its {len(corpus.documents)} "
        f"document(s) is a stop word or too short (e.g. 'the', 'of', 's'), so there is nothing "
        f"to search; add documents with content words. Nothing was written"
    )


def jsonl_records(raw: bytes, source: Path, problems: list[str]) -> Iterator[tuple[int, str, Any]]:
    """(line number, "file:line", parsed value) of each non-blank line of a .jsonl file's bytes; a line that
    is not UTF-8 or not JSON becomes a problem in `problems` instead (documents and labelled
    questions are read the same way)."""
    for lineno, line_bytes in enumerate(raw.split(b"\n"), start=1):
        where = f"{source}:{lineno}"
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{where}: not valid UTF-8 (byte {exc.start}): {exc.reason}")
            continue
        if lineno == 1:
            line = line.removeprefix(_BOM)
        if not line.strip():
            continue
        try:
            yield lineno, where, json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})")
        except ValueError as exc:  # an integer of more digits than Python converts
            problems.append(f"{where}: malformed JSON ({exc})")
        except RecursionError:
            problems.append(f"{where}: malformed JSON (nested too deeply to read)")


def _load_jsonl(path: Path, *, max_chars: int) -> LoadedCorpus:
    problems: list[str] = []
    documents: list[Document] = []
    ids: list[tuple[DocKey, str]] = []
    empty: list[str] = []
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"{path}: cannot read: {exc}") from None
    for _, where, record in jsonl_records(raw, path, problems):
        doc, problem = _document_from_record(record, where)
        if problem:
            problems.append(problem)
            continue
        assert doc is not None
        text_problems = document_problems(doc, where, max_chars)
        if text_problems:
            problems.extend(text_problems)
            continue
        ids.append((doc.key, where))
        if doc.text.strip():
            documents.append(doc)
        else:
            empty.append(where)
    problems.extend(duplicate_problems(ids))
    raise_if_problems(problems, path)
    return LoadedCorpus(tuple(documents), len(empty), str(path), empty=tuple(empty))


def id_prefix(folder: Path, root: Path) -> str:
    """What goes before a file's path under `folder` to make it relative to `root`: "" when
    they are the same folder, "policies/" for kb/policies under kb; DocumentError when `root`
    does not hold `folder`."""
    if not root.is_dir():
        raise DocumentError(f"--root {root}: not a folder; it must hold the folder {folder}")
    try:
        rel = folder.resolve().relative_to(root.resolve())
    except ValueError:
        raise DocumentError(
            f"--root {root} does not hold {folder}: ids are paths relative to the root, so the "
            f"root must be the folder (or a folder above it)"
        ) from None
    return "" if rel == Path() else f"{rel.as_posix()}/"


def documents_from_records(
    records: Sequence[Any], source: str, *, max_chars: int = MAX_DOCUMENT_CHARS
) -> list[Document]:
    """Documents from records shaped as .jsonl lines (`{"id", "text", "title"?, ...}`, extra
    fields are metadata), each checked by validation.py's rules: DocumentError lists every
    problem with the record's position, and nothing is returned when there is any. Documents
    that are Documents already are checked as they are."""
    problems: list[str] = []
    documents: list[Document] = []
    ids: list[tuple[DocKey, str]] = []
    for i, record in enumerate(records):
        where = f"{source}[{i}]"
        if isinstance(record, Document):
            doc: Document | None = record
        else:
            doc, problem = _document_from_record(record, where)
            if problem:
                problems.append(problem)
                continue
        assert doc is not None
        problems.extend(document_problems(doc, where, max_chars))
        ids.append((doc.key, where))
        documents.append(doc)
    problems.extend(duplicate_problems(ids))
    raise_if_problems(problems, source)
    return documents


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
    """The first heading outside fenced code blocks, else `fallback`."""
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := _HEADING.match(line)):
            return match.group(1).strip()
    return fallback


_FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def markdown_headings(text: str, title: str) -> tuple[Heading, ...]:
    """The ATX headings (`## Install`) of a markdown text, outside fenced code blocks; the first
    heading is left out when it is the title (it prefixes every chunk already).

    >>> markdown_headings("# Guide\\n\\n## Install\\n\\n```\\n# not one\\n```\\n", "Guide")
    (Heading(start=9, level=2, text='Install'),)

    Not handled: setext headings (a line underlined with === or ---)."""
    headings: list[Heading] = []
    fenced = False
    at = 0
    for line in text.splitlines(keepends=True):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := _HEADING.match(line.rstrip("\r\n"))):
            level = len(line.lstrip(" ")) - len(line.lstrip(" ").lstrip("#"))
            headings.append(Heading(at, level, match.group(1).strip()))
        at += len(line)
    if headings and headings[0].text == title:
        headings.pop(0)
    return tuple(headings)


class _HTMLText(HTMLParser):
    """Visible text of an HTML page (scripts and styles dropped) and its <title>."""

    _SKIP = frozenset({"script", "style", "noscript", "template"})
    _HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
    _BLOCK = frozenset({"p", "div", "section", "article", "li", "br", "tr"}) | _HEADINGS

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self.headings: list[tuple[int, str]] = []  # (level, text) of each h1-h6, in order
        self._heading: tuple[int, list[str]] | None = None
        self._skipping = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skipping += 1
        elif tag == "title":
            self._in_title = True
        elif tag in self._BLOCK:
            self.parts.append("\n\n")
            if tag in self._HEADINGS:
                self._heading = (int(tag[1]), [])

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self._skipping:
            self._skipping -= 1
        elif tag == "title":
            self._in_title = False
        elif tag in self._BLOCK:
            self.parts.append("\n\n")
            if tag in self._HEADINGS and self._heading is not None:
                level, words = self._heading
                self.headings.append((level, " ".join("".join(words).split())))
                self._heading = None

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skipping:
            self.parts.append(data)
            if self._heading is not None:
                self._heading[1].append(data)

    def paragraphs(self) -> list[str]:
        joined = "".join(self.parts)
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", joined)]
        return [p for p in paragraphs if p]

    def text_and_headings(self, title: str) -> tuple[str, tuple[Heading, ...]]:
        """The visible text (paragraphs joined by a blank line) and where its headings are: each
        heading is a paragraph of its own (a block tag), found in order."""
        paragraphs = self.paragraphs()
        starts, at = [], 0
        for p in paragraphs:
            starts.append(at)
            at += len(p) + 2
        headings: list[Heading] = []
        i = 0
        for level, text in self.headings:
            j = next((j for j in range(i, len(paragraphs)) if paragraphs[j] == text), None)
            if j is None or not text:
                continue
            headings.append(Heading(starts[j], level, text))
            i = j + 1
        if headings and headings[0].text == title:
            headings.pop(0)
        return "\n\n".join(paragraphs), tuple(headings)


def html_document(raw: str, rel: str, fallback_title: str) -> Document:
    parser = _HTMLText()
    parser.feed(raw)
    parser.close()
    title = " ".join(parser.title.split()) or fallback_title
    text, headings = parser.text_and_headings(title)
    return Document(id=rel, title=title, text=text, metadata={"path": rel}, headings=headings)


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


# What a directory file becomes: (path, id) -> (Document, None) or (None, problem).
Reader = Callable[[Path, str], tuple[Document | None, str | None]]


def _read_pdf(path: Path, rel: str) -> tuple[Document | None, str | None]:
    try:
        return pdf_document(path, rel), None
    except Exception as exc:  # pypdf raises many types for a damaged file
        return None, f"{path}: cannot read this PDF ({type(exc).__name__}: {exc})"


def _read_utf8(path: Path) -> tuple[str | None, str | None]:
    """The file's text (without a byte order mark), or a problem: the file cannot be read, or
    the line of the first byte that is not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return None, f"{path}: cannot read this file ({exc.strerror or exc})"
    try:
        return raw.decode("utf-8").removeprefix(_BOM), None
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return None, f"{path}:{line}: not valid UTF-8 (byte {exc.start}): {exc.reason}"


def _read_html(path: Path, rel: str) -> tuple[Document | None, str | None]:
    text, problem = _read_utf8(path)
    return (None, problem) if text is None else (html_document(text, rel, path.stem), None)


def _read_text(path: Path, rel: str) -> tuple[Document | None, str | None]:
    text, problem = _read_utf8(path)
    if text is None:
        return None, problem
    return Document(
        id=rel, title=_title_of(text, path.stem), text=text, metadata={"path": rel}
    ), None


def _read_markdown(path: Path, rel: str) -> tuple[Document | None, str | None]:
    doc, problem = _read_text(path, rel)
    if doc is None:
        return None, problem
    return dataclasses.replace(doc, headings=markdown_headings(doc.text, doc.title)), None


# The file types a directory ingest reads, by suffix (lower case); any other file is skipped
# and counted. A new type is one entry.
READERS: dict[str, Reader] = {
    ".md": _read_markdown,
    ".markdown": _read_markdown,
    ".txt": _read_text,
    ".html": _read_html,
    ".htm": _read_html,
    ".pdf": _read_pdf,
}
SUFFIXES = tuple(READERS)
# Kind of a skipped entry that is a link to a folder outside the ingested one (not followed).
LINKED_FOLDER = "link to a folder outside"
HIDDEN = "hidden (a name starting with a dot)"


def describe_suffixes() -> str:
    """The suffixes a directory ingest reads, for messages: ".md/.markdown/.../.pdf"."""
    return "/".join(SUFFIXES)


def _entries(
    root: Path, *, follow_outside: bool, problems: list[str], hidden: list[Path] | None = None
) -> list[Path]:
    """Every entry under `root`, sorted, as `root.rglob("*")` lists them (links to folders are
    listed, not entered), except that a folder that cannot be read is a problem, not silently
    left out (its documents would be deleted by a re-ingest); with `follow_outside`, a link to a
    folder outside `root` is entered too. With a `hidden` list, an entry whose name starts with
    a dot is put there instead, and a hidden folder is not entered. No folder is read twice: a followed folder, or a
    folder inside one, that is `root`'s own or one already read (a link to a parent, a loop) is
    not entered; of two links to one folder, the first by name is."""
    entries: list[Path] = []
    home = root.resolve()
    entered = {home}
    folders = [(root, False)]  # (folder, reached through a followed link)
    while folders:
        folder, outside = folders.pop()
        try:
            with os.scandir(folder) as listing:
                found = sorted((folder / e.name, e.is_dir(follow_symlinks=False)) for e in listing)
        except OSError as exc:
            problems.append(
                f"{folder}: cannot read this folder ({exc.strerror or exc}); its documents would "
                f"be left out (and removed from the collection by a re-ingest)"
            )
            continue
        pushed: list[tuple[Path, bool]] = []
        for path, is_folder in found:
            if hidden is not None and path.name.startswith("."):
                hidden.append(path)
                continue
            entries.append(path)
            if is_folder and not outside:
                pushed.append((path, False))  # root's own tree: each folder once already
            elif is_folder or (follow_outside and path.is_symlink() and path.is_dir()):
                target = path.resolve()
                if not (target.is_relative_to(home) or target in entered):
                    entered.add(target)
                    pushed.append((path, True))
        folders.extend(reversed(pushed))  # popped in name order
    return sorted(entries)


def _load_directory(
    root: Path, *, max_chars: int, follow_symlinks: bool, include_hidden: bool, prefix: str = ""
) -> LoadedCorpus:
    problems: list[str] = []
    documents: list[Document] = []
    empty: list[str] = []
    skipped_files: Counter[str] = Counter()
    files = []
    hidden: list[Path] | None = None if include_hidden else []
    found = _entries(root, follow_outside=follow_symlinks, problems=problems, hidden=hidden)
    if hidden:
        skipped_files[HIDDEN] = len(hidden)
    for path in found:
        if path.is_symlink() and path.is_dir() and not _inside(path, root):
            if not follow_symlinks:  # not entered: counted
                skipped_files[LINKED_FOLDER] += 1
            continue
        if not path.is_file():
            continue
        if path.is_symlink() and not follow_symlinks and not _inside(path, root):
            problems.append(
                f"{path}: a symlink to {path.resolve()}, outside {root}; refused "
                f"(pass --follow-symlinks to ingest it)"
            )
        elif path.suffix.lower() in READERS:
            files.append(path)
        else:
            skipped_files[_skipped_kind(path)] += 1
    if not files and not problems:
        raise DocumentError(
            f"{root}: no {describe_suffixes()} files found"
            + (f" (skipped: {_describe(skipped_files)})" if skipped_files else "")
        )
    for path in files:
        rel = prefix + path.relative_to(root).as_posix()
        doc, problem = READERS[path.suffix.lower()](path, rel)
        if problem is not None:
            problems.append(problem)
            continue
        assert doc is not None
        text_problems = document_problems(doc, str(path), max_chars)
        if text_problems:
            problems.extend(text_problems)
        elif not doc.text.strip():
            empty.append(str(path))
        else:
            documents.append(doc)
    raise_if_problems(problems, root)
    return LoadedCorpus(
        tuple(documents), len(empty), str(root), dict(skipped_files), empty=tuple(empty)
    )


def _describe(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


@dataclass(frozen=True)
class Upserts:
    """The documents of `update --upsert` paths, and the ids that came from each folder."""

    documents: list[Document]
    folder_ids: dict[Path, list[str]]


def read_upserts(
    paths: Sequence[Path],
    *,
    max_chars: int = MAX_DOCUMENT_CHARS,
    root: Path | None = None,
    include_hidden: bool = False,
) -> Upserts:
    """The documents of every `--upsert` path (each a .jsonl or a folder, as `load_documents`,
    a folder's ids relative to `root`), all read and checked first: DocumentError lists the
    problems of every path, and an id that two paths both hold."""
    documents: list[Document] = []
    folder_ids: dict[Path, list[str]] = {}
    problems: list[str] = []
    where: list[tuple[DocKey, str]] = []
    for path in paths:
        try:
            corpus = load_documents(
                path, max_chars=max_chars, root=root, include_hidden=include_hidden
            )
        except DocumentError as exc:
            problems.append(str(exc))
            continue
        problems.extend(empty_upserts(corpus))
        documents.extend(corpus.documents)
        if path.is_dir():
            folder_ids[path] = [d.id for d in corpus.documents]
        where.extend((d.key, str(path)) for d in corpus.documents)
    problems.extend(duplicate_problems(where))
    if problems:
        raise DocumentError("nothing was written:\n" + "\n".join(problems))
    return Upserts(documents, folder_ids)


def empty_upserts(corpus: LoadedCorpus) -> list[str]:
    """A problem for each document of `corpus` whose text is empty: an upsert that skipped it
    would leave its old text served, so it is refused, as the HTTP write routes refuse it."""
    return [
        f"{where}: the document has no text; an upsert does not remove a document (give it "
        f"text, or leave it out and delete its id)"
        for where in corpus.empty
    ]


def read_delete_ids(path: Path) -> list[str]:
    """Document ids to delete, one per line (blank lines skipped)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"{path}: cannot read the ids to delete: {exc}") from None
    ids = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise DocumentError(
                f"{path}:{lineno}: not valid UTF-8 (byte {exc.start}); nothing was written"
            ) from None
        if text:
            ids.append(text)
    return ids
