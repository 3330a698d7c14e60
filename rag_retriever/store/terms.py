"""A version's BM25 document frequencies on disk, for the embedded store.

A full build writes every term's frequency into an SQLite table (`terms.sqlite`: term, frequency,
`term_index` hash; indexed by term and by hash), which is never written again. A version made from it by
deltas holds a hard link to the same file and, beside it, the changes since it
(`term_changes.json`: term -> frequency now, 0 = in no document any more, and the number of
terms). A delta therefore reads the frequencies of the terms it touches and writes the changes,
not the vocabulary: with one JSON of the whole vocabulary read, changed and written again by
each delta, the BM25 step of a 10-document delta took 0.18 s at 54k terms, 1.50 s at 500k and
6.46 s at 2M; 8-13 ms so (`python -m bench.bench_update --sizes --vocabulary ...`). When the changes pass `REBASE_FRACTION` of the table, the next version
writes a new table (the cost of a full build's, once in that many changes). A hard link shares
the file without a copy; a version's files are deleted with it, and the table goes with its last
link. Versions written before this hold one `doc_freqs.json` and are read as they are.

Beside the frequencies, a version records their histogram (frequency -> how many terms have it:
the table's in its `histogram` table, the version's own in the changes file, updated by each
delta from the terms it touches). It is what rank-bm25's IDF floor needs of the whole
vocabulary, so a query reads only its own terms' frequencies and opening a version reads none.
Tables and changes written before it lack it; it is then counted from them when first needed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

from rag_retriever.models import bm25
from rag_retriever.models.bm25 import DictTable, DocFreqs
from rag_retriever.store.files import read_json, write_atomic

log = logging.getLogger(__name__)

TABLE_FILE = "terms.sqlite"
CHANGES_FILE = "term_changes.json"
WHOLE_FILE = "doc_freqs.json"  # the single file of versions written before the table
# Changes past this share of the table's terms: the next version writes a new table.
REBASE_FRACTION = 0.25
# Terms per SQL statement (SQLite's default limit on bound parameters is 32,766).
_BATCH = 900
_SCHEMA = (
    "CREATE TABLE terms (term TEXT NOT NULL, df INTEGER NOT NULL, hash INTEGER NOT NULL)",
    "CREATE TABLE info (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    # df -> how many terms have it (the IDF floor's input; tables written before it lack it)
    "CREATE TABLE histogram (df INTEGER PRIMARY KEY, terms INTEGER NOT NULL)",
)
# Built after the rows are in (2M terms: 6.0 s in all, against 21.6 s for the rows inserted sorted
# into a table keyed by term with the hash index in place).
_INDEXES = (
    "CREATE UNIQUE INDEX terms_by_term ON terms (term)",
    "CREATE INDEX terms_by_hash ON terms (hash)",
)


class SqliteTable:
    """A `TermTable` in a read-only SQLite file (never written once complete, so opened as
    immutable: no locking). One connection, shared by threads under a lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(
            f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False
        )
        self._lock = threading.Lock()
        with self._lock:
            (self._len,) = self._db.execute("SELECT value FROM info WHERE key = 'terms'").fetchone()

    def __len__(self) -> int:
        return int(self._len)

    def _select(self, sql: str, keys: Collection[object]) -> list[tuple[object, object]]:
        keys = list(keys)
        out: list[tuple[object, object]] = []
        with self._lock:
            for at in range(0, len(keys), _BATCH):
                part = keys[at : at + _BATCH]
                out.extend(self._db.execute(sql.format(",".join("?" * len(part))), part))
        return out

    def lookup(self, terms: Collection[str]) -> dict[str, int]:
        rows = self._select("SELECT term, df FROM terms WHERE term IN ({})", terms)
        return {str(t): int(n) for t, n in rows}  # type: ignore[call-overload]

    def holders(self, hashes: Collection[int]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for h, term in self._select("SELECT hash, term FROM terms WHERE hash IN ({})", hashes):
            out.setdefault(int(h), []).append(str(term))  # type: ignore[call-overload]
        return out

    def items(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            rows = self._db.execute("SELECT term, df FROM terms").fetchall()
        return ((str(t), int(n)) for t, n in rows)

    def histogram(self) -> dict[int, int]:
        with self._lock:
            (written,) = self._db.execute(
                "SELECT count(*) FROM sqlite_master WHERE name = 'histogram'"
            ).fetchone()
            sql = (
                "SELECT df, terms FROM histogram"
                if written
                else "SELECT df, count(*) FROM terms GROUP BY df"
            )
            return {int(df): int(n) for df, n in self._db.execute(sql)}


def write_table(path: Path, doc_freqs: Iterable[tuple[str, int]]) -> None:
    """Write a complete table at `path` (a temporary file, fsynced, then renamed: a reader or a
    crash sees no half-written table)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        db = sqlite3.connect(tmp)
        try:
            db.execute("PRAGMA journal_mode = OFF")
            db.execute("PRAGMA synchronous = OFF")
            for statement in _SCHEMA:
                db.execute(statement)
            rows = db.executemany(
                "INSERT INTO terms VALUES (?, ?, ?)",
                ((t, n, bm25.term_index(t)) for t, n in doc_freqs),
            ).rowcount
            for statement in _INDEXES:
                db.execute(statement)
            db.execute("INSERT INTO histogram SELECT df, count(*) FROM terms GROUP BY df")
            db.execute("INSERT INTO info VALUES ('terms', ?)", (rows,))
            db.commit()
        finally:
            db.close()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def read_doc_freqs(directory: Path) -> DocFreqs:
    """The document frequencies in a version's directory. FileNotFoundError when it has none."""
    table = directory / TABLE_FILE
    if not table.exists():
        return DocFreqs(DictTable(read_json(directory / WHOLE_FILE)))
    changes = read_json(directory / CHANGES_FILE)
    histogram = changes.get("histogram")  # absent in versions written before it
    return DocFreqs(
        SqliteTable(table),
        changes["changes"],
        int(changes["size"]),
        None if histogram is None else {int(df): int(n) for df, n in histogram},
    )


def write_doc_freqs(directory: Path, doc_freqs: Mapping[str, int]) -> None:
    """Write `doc_freqs` into a version's directory: a link to the table they are layered on
    and the changes since it, or (a full build's, a store's kept whole, or changes past
    REBASE_FRACTION) a new table."""
    table = directory / TABLE_FILE
    if isinstance(doc_freqs, DocFreqs) and isinstance(doc_freqs.base, SqliteTable):
        base = doc_freqs.base
        if len(doc_freqs.changes) <= REBASE_FRACTION * max(len(base), 1):
            try:
                os.link(base.path, table)
            except OSError as exc:  # its version was deleted, or no hard links here
                log.info("%s: the BM25 table is written again (%s)", directory.name, exc)
            else:
                _write_changes(directory, doc_freqs.changes, len(doc_freqs), doc_freqs.histogram)
                return
    write_table(table, doc_freqs.items())  # renamed over the name: never written through a link
    _write_changes(directory, {}, len(doc_freqs), None)


def _write_changes(
    directory: Path, changes: Mapping[str, int], size: int, histogram: Mapping[int, int] | None
) -> None:
    """The changes since the table and (for a version made by deltas) the frequencies'
    histogram now, kept up to date by each delta, so that the IDF floor needs neither the
    table's terms nor a lookup of the changes."""
    data: dict[str, object] = {"changes": changes, "size": size}
    if histogram is not None:
        data["histogram"] = sorted(histogram.items())
    write_atomic(directory / CHANGES_FILE, json.dumps(data).encode())
