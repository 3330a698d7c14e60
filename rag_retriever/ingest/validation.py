"""What a document must be before anything is chunked, encoded or written: one set of rules for
documents from a file (`loaders`), from Python (`ingest_documents`, `update_documents`) and over
HTTP (the write routes), so the three refuse the same input the same way.

Example:
    >>> validate_documents([Document("a", "A", "text", {"year": float("nan")})], source="docs")
    Traceback (most recent call last):
    ...
    rag_retriever.errors.DocumentError: 1 problem(s) in docs; nothing was ingested:
      docs[0] (id 'a'): metadata['year'] is nan; metadata numbers must be finite (send null or a string)

The rules: text, title and id are strings of valid Unicode (no lone surrogate: it cannot be
written as UTF-8); metadata holds JSON values the engine stores and filters exactly (strings of
valid Unicode, booleans, null, finite numbers, integers within ±MAX_EXACT_INT, arrays and objects
with string keys), nested at most MAX_METADATA_DEPTH levels and at most MAX_METADATA_BYTES as
JSON; a top-level metadata name can be filtered on (not empty, no double quote or backslash).
Every problem is reported at once, each naming the document (position and id) and the field.
Does not check what only a store knows (whether an id exists, the model of the live version).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rag_retriever.errors import DocumentError
from rag_retriever.records import (
    BLANK_CHARS,
    GROUPS_FIELD,
    MAX_EXACT_INT,
    MAX_GROUP_CHARS,
    MAX_GROUPS,
    TENANT_FIELD,
    DocKey,
    Document,
    check_tenant,
    show_key,
)
from rag_retriever.settings import default_of

MAX_REPORTED_PROBLEMS = 20
# RAG_MAX_DOCUMENT_CHARS's default (settings.py says why).
MAX_DOCUMENT_CHARS: int = default_of("max_document_chars")
# Levels of metadata nesting (the metadata object is level 1, each object or array in it one
# more). The engine decodes a chunk's payload with a recursion limit: a seal failed at 127 levels
# of metadata (Qdrant Edge 0.9, issue 39), after the whole version was encoded. 16 is far deeper
# than document metadata needs (a PDF's page list is 2 levels) and far from that limit.
MAX_METADATA_DEPTH = 16
# A document's metadata as compact UTF-8 JSON. It is copied into the payload of every chunk of
# the document and returned with every hit: 64 KiB holds the page offsets of a 5,000-page PDF
# (about 8 bytes a page) and keeps a 1,000-chunk document's payloads under 64 MB; larger data
# belongs elsewhere, with a reference to it in the metadata.
MAX_METADATA_BYTES = 64 * 1024
# "Holds a character that is not white space", as JSON Schema (ECMA regex) can say it, for the HTTP
# schema of ids and texts: the white space of ECMAScript (records.BLANK_CHARS) and of Python's
# str.strip (which also strips \x1c-\x1f and \x85), so a value that matches is never empty here.
NOT_BLANK_PATTERN = f"[^{BLANK_CHARS}\\x1c-\\x1f\\x85]"
# The metadata values the engine stores as they are (JSON's), named for the messages.
METADATA_TYPES = "string, finite number, boolean, null, array or object"


def invalid_unicode(text: str) -> int | None:
    """The position of the first lone surrogate (text that cannot be written as UTF-8), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def validate_documents(
    documents: Sequence[Document],
    *,
    source: str,
    max_chars: int = MAX_DOCUMENT_CHARS,
    allow_empty_text: bool = False,
) -> None:
    """The checks a loaded file gets, for documents given in code or over HTTP: raise
    DocumentError listing every problem (with the document's position), nothing else done.
    `allow_empty_text`: a whole corpus may hold empty documents (they make no chunk); an update
    may not (an empty upsert is a delete: say so)."""
    problems: list[str] = []
    ids: list[tuple[DocKey, str]] = []
    for i, doc in enumerate(documents):
        at = f"{source}[{i}]"
        if not isinstance(doc.id, str) or not doc.id.strip():
            problems.append(f"{at}: field 'id' is empty or not a string")
            continue
        where = f"{at} (id {doc.id!r})"
        doc_problems = document_problems(doc, where, max_chars)
        problems.extend(doc_problems)
        if not doc_problems and not allow_empty_text and not doc.text.strip():
            problems.append(f"{where}: the document has no text (to remove it, delete it)")
        ids.append((doc.key, at))
    problems.extend(duplicate_problems(ids))
    raise_if_problems(problems, source)


def validate_delete_ids(ids: Sequence[str], *, source: str) -> None:
    """Ids to delete are non-empty strings of valid Unicode (as document ids are); DocumentError
    lists every one that is not, by position."""
    problems = []
    for i, doc_id in enumerate(ids):
        if not isinstance(doc_id, str) or not doc_id:
            problems.append(f"{source}[{i}]: {doc_id!r} is not a document id (a non-empty string)")
        elif (at := invalid_unicode(doc_id)) is not None:
            problems.append(
                f"{source}[{i}]: id {doc_id!r} is not valid Unicode (lone surrogate at {at})"
            )
    if problems:
        raise DocumentError(
            f"{len(problems)} problem(s) in the ids to delete ({source}); nothing was written:\n  "
            + "\n  ".join(problems[:MAX_REPORTED_PROBLEMS])
        )


def document_problems(doc: Document, where: str, max_chars: int) -> list[str]:
    """What is wrong with one document's fields and metadata (empty when nothing is)."""
    problems = []
    for name, value in (("id", doc.id), ("title", doc.title), ("text", doc.text)):
        if not isinstance(value, str):
            problems.append(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
        elif (at := invalid_unicode(value)) is not None:
            problems.append(
                f"{where}: field {name!r} is not valid Unicode (lone surrogate at {at})"
            )
    if isinstance(doc.text, str) and len(doc.text) > max_chars:
        problems.append(
            f"{where}: the text has {len(doc.text):,} characters, over the limit of "
            f"{max_chars:,} (RAG_MAX_DOCUMENT_CHARS); split the document"
        )
    return problems + [f"{where}: {p}" for p in metadata_problems(doc.metadata)]


def metadata_problems(metadata: object) -> list[str]:
    """What keeps `metadata` from being stored and filtered as it is, each naming its place:

    >>> metadata_problems({"year": 2020, "tags": ["a", float("inf")]})
    ["metadata['tags'][1] is inf; metadata numbers must be finite (send null or a string)"]
    """
    if not isinstance(metadata, Mapping):
        return [f"metadata must be an object of field: value, got {type(metadata).__name__}"]
    problems = []
    for key in metadata:
        if not _filterable_name(key):
            problems.append(
                f"metadata field name {key!r} cannot be filtered on; rename it "
                f"(no double quote, backslash or invalid Unicode, not empty)"
            )
    # Walked with a stack, never deeper than the bound: a hostile nesting cannot recurse here.
    stack: list[tuple[str, Any, int]] = [
        (f"metadata[{k!r}]", v, 2) for k, v in reversed(list(metadata.items()))
    ]
    while stack:
        path, value, level = stack.pop()
        problem = _value_problem(value)
        if problem is not None:
            problems.append(f"{path} {problem}")
            continue
        if not isinstance(value, Mapping | list | tuple):
            continue
        if level > MAX_METADATA_DEPTH:
            problems.append(
                f"{path} nests deeper than {MAX_METADATA_DEPTH} levels (MAX_METADATA_DEPTH, "
                f"counting the metadata object); flatten it"
            )
            continue
        if isinstance(value, Mapping):
            for k in value:
                if not isinstance(k, str) or invalid_unicode(k) is not None:
                    problems.append(f"{path} has the key {k!r}; keys must be valid Unicode strings")
            children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
        else:
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        stack.extend((p, v, level + 1) for p, v in reversed(children))
    problems.extend(access_problems(metadata))
    if not problems:
        size = len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode())
        if size > MAX_METADATA_BYTES:
            problems.append(
                f"metadata is {size:,} bytes as JSON, over the limit of {MAX_METADATA_BYTES:,} "
                f"(MAX_METADATA_BYTES: it is copied into every chunk and every hit); keep large "
                f"data elsewhere and store a reference to it"
            )
    return problems


def access_problems(metadata: Mapping[str, Any]) -> list[str]:
    """What is wrong with the access fields (docs/tenants.md): `tenant` a tenant name, `groups`
    a list of group names (non-empty strings without control characters)."""
    problems = []
    if TENANT_FIELD in metadata:
        try:
            check_tenant(metadata[TENANT_FIELD])
        except ValueError as exc:
            problems.append(f"metadata[{TENANT_FIELD!r}]: {exc}")
    if GROUPS_FIELD in metadata:
        groups = metadata[GROUPS_FIELD]
        if not isinstance(groups, list | tuple) or len(groups) > MAX_GROUPS:
            problems.append(
                f"metadata[{GROUPS_FIELD!r}] must be a list of at most {MAX_GROUPS} group names"
            )
        else:
            for i, group in enumerate(groups):
                if not _group_name(group):
                    problems.append(
                        f"metadata[{GROUPS_FIELD!r}][{i}] is {group!r}; a group name is a string "
                        f"of 1-{MAX_GROUP_CHARS} characters without control characters"
                    )
    return problems


def _group_name(group: object) -> bool:
    return (
        isinstance(group, str)
        and 0 < len(group) <= MAX_GROUP_CHARS
        and group.isprintable()
        and invalid_unicode(group) is None
    )


def _filterable_name(key: object) -> bool:
    """A top-level metadata name a filter can address (`metadata.<name>` in the engine)."""
    return (
        isinstance(key, str)
        and key != ""
        and '"' not in key
        and "\\" not in key
        and invalid_unicode(key) is None
    )


def _value_problem(value: object) -> str | None:
    """Why one metadata value cannot be stored as it is, or None (containers are walked apart)."""
    if value is None or isinstance(value, bool | Mapping | list | tuple):
        return None
    if isinstance(value, int):
        if abs(value) > MAX_EXACT_INT:
            return (
                f"is {value}, outside ±{MAX_EXACT_INT} (what JSON clients and the engine keep "
                f"exact, and what a filter matches); store it as a string"
            )
        return None
    if isinstance(value, float):
        return (
            None
            if math.isfinite(value)
            else (f"is {value}; metadata numbers must be finite (send null or a string)")
        )
    if isinstance(value, str):
        at = invalid_unicode(value)
        return None if at is None else f"is not valid Unicode (lone surrogate at {at})"
    return f"is a {type(value).__name__}; metadata values must be a {METADATA_TYPES}"


def raise_if_problems(problems: list[str], source: Path | str) -> None:
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


def duplicate_problems(ids: list[tuple[DocKey, str]]) -> list[str]:
    """`ids` are ((tenant, id), where) pairs; report each duplicated document once with every
    place it occurs (the same id in two tenants is two documents)."""
    counts = Counter(key for key, _ in ids)
    problems = []
    for key, n in counts.items():
        if n > 1:
            places = ", ".join(where for d, where in ids if d == key)
            problems.append(f"duplicate id {show_key(key)} ({n} times: {places})")
    return problems
