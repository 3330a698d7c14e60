"""The query log and feedback: what was asked, what came back, and what the chat app said of it.

Example:
    >>> log = QueryLog(Path("rag-data/query-log"))                            # doctest: +SKIP
    >>> retriever = Retriever(..., query_log=log)                             # doctest: +SKIP
    >>> log.feedback(result.query_id, chunk_id=result.hits[0].chunk_id, relevant=True)  # doctest: +SKIP
    >>> rows, report = questions_from_log([Path("rag-data/query-log")], alias="docs")  # doctest: +SKIP

Opt-in (`RAG_QUERY_LOG` = a directory). One JSON line per query: its id (returned with every
result), time, alias and served version, mode, k, filter, each returned chunk with its doc id,
offsets and every stage's rank, latency, truncation, and the query text (or only its sha256 with
`RAG_QUERY_LOG_TEXT=false`). Never an API key: nothing of the request but these fields is logged.

Lines are queued and written by one background thread, off the request path, and flushed at
least every FLUSH_S seconds (a crash loses at most that; a process that ends normally, `serve`
stopped by SIGTERM included, writes every queued line first). Each process writes its own files
(`queries-<host>-<pid>-<n>.jsonl`, `feedback-<host>-<pid>-<n>.jsonl`), so several `serve`
processes share a directory; a file is closed at `max_file_bytes` and the oldest files of the
directory are deleted beyond `max_total_bytes`. Feedback is checked against what its query
returned: from this process's memory, else from the query lines of the directory (any process's,
the newest FEEDBACK_SCAN_BYTES), so it may reach any replica that shares the directory. A directory that cannot be written, or a full
queue, drops lines and counts them (`dropped`), with one warning: a query never waits or fails
for its log line.

`questions_from_log` turns logged queries with positive feedback into labelled questions in the
evaluation's format (a chunk judged relevant becomes a gold span: its document and offsets),
deduplicated by query text, for `eval/recall_at_k.py`, `tune-fusion` and `improve`. Questions
are evaluated against one collection, so it reads one alias's queries (`read_queries`, which
`doctor` reads too): a log of several aliases needs the alias named.

Does not do: sampling, PII scrubbing of query texts (use RAG_QUERY_LOG_TEXT=false), shipping
logs anywhere.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import heapq
import json
import logging
import mmap
import os
import queue
import re
import socket
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from rag_retriever import access, tracing
from rag_retriever.errors import Busy, InvalidRequest, QueryNotLogged
from rag_retriever.records import SearchFilter, SearchResult

log = logging.getLogger(__name__)

# A crash loses at most this many seconds of lines.
FLUSH_S = 1.0
# Lines waiting for the writer; past this, new lines are dropped (and counted).
QUEUE_LINES = 10_000
# Queries whose returned chunks are remembered for checking feedback (per process).
REMEMBER_QUERIES = 100_000
# Feedback on a query this process did not answer (another `serve` behind the same load
# balancer, or one from before a restart) is checked against the query lines of the shared
# directory, the newest first, up to this many bytes: at 50 queries/s of ~1.9 KB lines (10 hits),
# the last ten minutes or so. A scan that finds nothing reads all of it (~0.1-0.2 s of one core;
# one scan at a time, off the event loop); only feedback that misses this process's memory, with
# an id of the form new_query_id makes, pays it.
FEEDBACK_SCAN_BYTES = 64 * 2**20
# The scan reads the files backwards in windows of this many bytes, newest window first: where a
# window's lines were written is estimated from its file's first line's time and the file's
# mtime, so the windows of several live writers interleave and a closed file comes after them.
FEEDBACK_SCAN_WINDOW = 2**20
_QUERY_ID = re.compile(r"[0-9a-f]{32}")


def new_query_id() -> str:
    return uuid.uuid4().hex


class IdSet:
    """Ids held as their sorted 64-bit hashes: 8 bytes an id where a frozenset held a string and
    a slot (the 100,000 queries remembered for feedback took 3 KB each at k=10, 29 KB at 100:
    2.9 GB a process). `in` is a binary search; a false match needs two ids of one 64-bit hash.
    Hashes are this process's (str hashing is seeded per process): never stored."""

    __slots__ = ("_hashes",)

    def __init__(self, ids: Iterable[str]) -> None:
        self._hashes = np.sort(np.fromiter((hash(i) for i in ids), dtype=np.int64))

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        wanted = hash(value)
        at = int(np.searchsorted(self._hashes, wanted))
        return at < len(self._hashes) and int(self._hashes[at]) == wanted

    def __len__(self) -> int:
        return len(self._hashes)


@dataclass(frozen=True)
class _Logged:
    chunks: IdSet
    docs: IdSet
    scope: str | None = None  # the name of the key that asked (access.current)


class QueryLog:
    """Writes query and feedback lines to `directory` from a background thread."""

    def __init__(
        self,
        directory: Path,
        *,
        keep_text: bool = True,
        max_file_bytes: int = 64 * 2**20,
        max_total_bytes: int = 2**30,
    ) -> None:
        self.directory = directory
        self.keep_text = keep_text
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.written = 0
        self.dropped = 0
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(QUEUE_LINES)
        self._recent: OrderedDict[str, _Logged] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._files: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._serial = 0
        self._warned = False
        # one writer per file: host, process and this log object (several may share a process)
        self._prefix = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._alive: int | None = None  # the descriptor holding this writer's lock
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="query-log", daemon=True)
        self._thread.start()
        _OPEN.add(self)  # written out when the process ends (a stopped server, a script's end)

    # -- what callers log ---------------------------------------------------------------------

    def record(
        self,
        result: SearchResult,
        *,
        alias: str,
        k: int,
        flt: SearchFilter | None,
        tenant: str | None = None,
    ) -> None:
        """Queue one query's line (never blocks: a full queue drops it)."""
        entry: dict[str, Any] = {
            "query_id": result.query_id,
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "alias": alias,
            "collection": result.collection,
            "mode": result.mode,
            "k": k,
            "filter": flt.to_dict() if flt is not None and not flt.is_empty else None,
            "hits": [
                {
                    "chunk_id": h.chunk_id,
                    "doc_id": h.doc_id,
                    "start": h.start,
                    "end": h.end,
                    "rank": h.rank,
                    **{
                        f"{stage}_rank": getattr(h, stage).rank if getattr(h, stage) else None
                        for stage in ("dense", "bm25", "fused", "rerank")
                    },
                }
                for h in result.hits
            ],
            "latency_ms": result.timings_ms.get("total"),
            "query_truncated": result.query_truncated,
            "query_sha256": hashlib.sha256(result.query.encode("utf-8")).hexdigest(),
        }
        trace_id = tracing.current_trace_id()  # this search's trace, when tracing is on
        if trace_id is not None:
            entry["trace_id"] = trace_id
        if self.keep_text:
            entry["query"] = result.query
        scope = access.current()
        if scope is not None:  # the key's name and scope, never the key
            entry["scope"] = scope.label()
        tenant = tenant or access.current_tenant()
        if tenant is not None:  # the one tenant searched (`questions --tenant` reads it)
            entry["tenant"] = tenant
        if result.query_id is not None:
            self._keep(
                result.query_id,
                _Logged(
                    IdSet(h.chunk_id for h in result.hits),
                    IdSet(h.doc_id for h in result.hits),
                    None if scope is None else scope.name,
                ),
            )
        self._put("queries", entry)

    def _keep(self, query_id: str, logged: _Logged) -> None:
        """Remember what a query returned, for its feedback (the newest REMEMBER_QUERIES)."""
        with self._recent_lock:
            self._recent[query_id] = logged
            while len(self._recent) > REMEMBER_QUERIES:
                self._recent.popitem(last=False)

    def feedback(
        self,
        query_id: str,
        *,
        relevant: bool,
        chunk_id: str | None = None,
        doc_id: str | None = None,
    ) -> dict[str, Any]:
        """Record a judgement of one returned chunk (or document) of a logged query; refuses an
        unknown query id, or a chunk or document that query did not return (QueryNotLogged:
        404 over HTTP)."""
        if (chunk_id is None) == (doc_id is None):
            raise InvalidRequest("feedback names exactly one of chunk_id and doc_id")
        with self._recent_lock:
            logged = self._recent.get(query_id)
        if logged is None:  # another process's query, or one before this process's memory
            logged = self._find_in_files(query_id)
        asking = access.current()
        if logged is not None and asking is not None and logged.scope != asking.name:
            # another key's query, or one made outside a request (the CLI, a script): as unknown
            # as one never made
            logged = None
        if logged is None:
            raise QueryNotLogged(
                f"no logged query {query_id!r} in this process (the last {REMEMBER_QUERIES:,} "
                f"are remembered) nor in the newest {FEEDBACK_SCAN_BYTES // 2**20} MiB of query "
                f"lines of the query log (each process writes its lines every {FLUSH_S:g} s: "
                f"feedback sent at once to another process may need a retry)"
            )
        if chunk_id is not None and chunk_id not in logged.chunks:
            raise QueryNotLogged(f"query {query_id!r} did not return chunk {chunk_id!r}")
        if doc_id is not None and doc_id not in logged.docs:
            raise QueryNotLogged(f"query {query_id!r} did not return document {doc_id!r}")
        entry = {
            "query_id": query_id,
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "chunk_id": chunk_id,
            "doc_id": doc_id,
            "relevant": relevant,
            **({"scope": asking.label()} if asking is not None else {}),
        }
        self._put("feedback", entry)
        return entry

    def _find_in_files(self, query_id: str) -> _Logged | None:
        """Query `query_id`'s line in the directory's query files (every process's), the newest
        lines first, reading at most FEEDBACK_SCAN_BYTES; remembered when found."""
        if not _QUERY_ID.fullmatch(query_id):  # no query id this product makes: nothing to read
            return None
        needle = b'{"query_id": "' + query_id.encode("ascii") + b'",'
        # a bounded wait: feedback on made-up ids, each a scan, held a worker thread each until
        # every search waited behind them
        if not _SCAN_LOCK.acquire(timeout=SCAN_WAIT_S):
            raise Busy(
                f"another feedback is reading the query log for an older query; retry query "
                f"{query_id!r} in a second"
            )
        try:
            line = _scan(self.directory, needle)
        finally:
            _SCAN_LOCK.release()
        if line is None:
            return None
        try:
            entry = json.loads(line)
            hits = entry["hits"]
            found = _Logged(
                IdSet(str(h["chunk_id"]) for h in hits),
                IdSet(str(h["doc_id"]) for h in hits),
                (entry.get("scope") or {}).get("key"),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # a damaged line: as unknown as none
        self._keep(query_id, found)
        return found

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued line is written and flushed to its file, at most `timeout`
        seconds (tests, shutdown, feedback); False when it was not (a closed log, a stalled
        disk)."""
        if self._closed:
            return False
        done = threading.Event()
        try:
            self._queue.put(("flush", {"event": done}), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self) -> None:
        """Write every queued line and close the files; again, it does nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        _OPEN.discard(self)
        # a writer that cannot drain a full queue (a stalled disk) must not hang the shutdown
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=5)
        self._thread.join(timeout=5)

    def _put(self, kind: str, entry: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait((kind, entry))
        except queue.Full:
            self.dropped += 1

    # -- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        last_flush = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                item = ("tick", {})
            if item is None:
                self._close_files()
                return
            kind, entry = item
            try:
                if kind == "flush":
                    self._flush_files()
                    continue
                if kind != "tick":
                    self._write(kind, entry)
                if time.monotonic() - last_flush >= FLUSH_S:
                    self._flush_files()
                    last_flush = time.monotonic()
            except Exception as exc:  # the thread must outlive any line: queries go on
                self.dropped += kind not in ("flush", "tick")
                self._warn(exc)
            finally:
                if kind == "flush":
                    entry["event"].set()

    def _write(self, kind: str, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            fh = self._file(kind)
            fh.write(line)
            self._sizes[kind] += len(line)
            self.written += 1
            if self._sizes[kind] >= self.max_file_bytes:
                # forgotten before it is closed: a close that fails (a full disk) left a closed
                # file in place, and every later write raised until the writer thread died
                del self._files[kind]
                fh.close()
                self._enforce_total()
        except OSError as exc:
            self.dropped += 1
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "query log %s cannot be written (%s); queries go on, lines are dropped and "
                "counted (rag_query_log_dropped_total)",
                self.directory,
                exc,
            )

    def _file(self, kind: str) -> Any:
        fh = self._files.get(kind)
        if fh is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self._alive is None:  # held while this writer runs: another's rotation asks it
                self._alive = _hold(self.directory / f"{WRITER_LOCK}{self._prefix}.lock")
            self._serial += 1
            path = self.directory / f"{kind}-{self._prefix}-{self._serial}.jsonl"
            fh = self._files[kind] = path.open("ab")
            self._sizes[kind] = 0
        return fh

    def _flush_files(self) -> None:
        for fh in self._files.values():
            try:
                fh.flush()
            except OSError as exc:  # the buffered lines are lost: said, once
                self._warn(exc)

    def _close_files(self) -> None:
        for fh in self._files.values():
            with contextlib.suppress(OSError):
                fh.close()
        self._files.clear()
        if self._alive is not None:
            with contextlib.suppress(OSError):
                (self.directory / f"{WRITER_LOCK}{self._prefix}.lock").unlink()
            with contextlib.suppress(OSError):
                os.close(self._alive)
            self._alive = None

    def _enforce_total(self) -> None:
        """Delete the oldest files past `max_total_bytes`: not a file this process or another
        live writer of this host still writes (each writer's newest file of a kind; its loss
        would be silent and its space never freed), and a file another writer deleted
        meanwhile is passed over."""
        sized = []
        for path in self.directory.glob("*.jsonl"):
            with contextlib.suppress(FileNotFoundError):
                info = path.stat()
                sized.append((info.st_mtime, info.st_size, path))
        sized.sort()
        total = sum(size for _, size, _ in sized)
        kept = {Path(fh.name) for fh in self._files.values()} | _written_by_live_writers(
            self.directory, [path for *_, path in sized]
        )
        for _, size, path in sized:
            if total <= self.max_total_bytes:
                break
            if path in kept:
                continue
            total -= size
            path.unlink(missing_ok=True)


# A writer's lock file (`.writer-<host>-<pid>-<id>.lock`), held while it writes: a writer is
# alive while its lock is held, whatever host or PID namespace it runs in (a PID test took a
# restarted container's earlier runs, PID 1 each, for alive).
WRITER_LOCK = ".writer-"


def _hold(path: Path) -> int | None:
    """An open descriptor holding an exclusive lock on `path` (None: it could not be made). The
    lock is on the file `path` names after it was taken: another writer's probe (`_held`) may
    have locked, unlinked and closed the file between this open and this lock, and a lock on an
    unlinked file would tell the next probe nothing."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held, named = os.fstat(fd), os.stat(path)
        except OSError:
            os.close(fd)
            return None
        if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
            return fd
        os.close(fd)
    return None


def _held(path: Path) -> bool:
    """Whether another writer holds `path`'s lock; a lock nobody holds (its writer died) is
    removed."""
    fd = _hold(path)
    if fd is None:
        return path.exists()
    with contextlib.suppress(OSError):
        path.unlink()
    os.close(fd)
    return False


def _written_by_live_writers(directory: Path, paths: Sequence[Path]) -> set[Path]:
    """Of `<kind>-<writer>-<serial>.jsonl` files, each writer's newest file of a kind where the
    writer still holds its lock (`WRITER_LOCK`)."""
    newest: dict[tuple[str, str], tuple[int, Path]] = {}
    for path in paths:
        kind, _, rest = path.stem.partition("-")
        writer, _, serial = rest.rpartition("-")
        if serial.isdigit() and int(serial) > newest.get((kind, writer), (-1, path))[0]:
            newest[(kind, writer)] = (int(serial), path)
    alive = {writer: _held(directory / f"{WRITER_LOCK}{writer}.lock") for _, writer in newest}
    return {path for (_, writer), (_, path) in newest.items() if alive[writer]}


# The logs of this process not closed yet: the writer thread is a daemon, so without this a
# process that ends normally (`serve` stopped by SIGTERM, `search`, a script) would lose the lines
# of its last FLUSH_S seconds.
_OPEN: weakref.WeakSet[QueryLog] = weakref.WeakSet()


# One scan of the log directory at a time in a process: feedback on unknown ids cannot make
# many threads read the same files at once.
_SCAN_LOCK = threading.Lock()
# How long feedback waits for another's scan before it answers Busy (429).
SCAN_WAIT_S = 1.0


def _scan(directory: Path, needle: bytes) -> bytes | None:
    """The line of a query file of `directory` that starts with `needle`, reading the files'
    windows (FEEDBACK_SCAN_WINDOW) newest first, at most FEEDBACK_SCAN_BYTES; None: not there.

    A window's age is estimated as if its file's lines were written evenly between its first
    line's time and its mtime; a file's last window may hold lines written during the scan."""
    # (-when the window's newest line was written, path, window's end, file's size, first, last)
    heap: list[tuple[float, str, int, int, float, float]] = []
    for path in directory.glob("queries-*.jsonl"):
        try:
            stat = path.stat()
            if stat.st_size:
                first = min(_first_time(path) or stat.st_mtime, stat.st_mtime)
                heap.append(
                    (-stat.st_mtime, str(path), stat.st_size, stat.st_size, first, stat.st_mtime)
                )
        except OSError:  # deleted by a writer's bound meanwhile
            continue
    heapq.heapify(heap)
    budget = FEEDBACK_SCAN_BYTES
    while heap and budget > 0:
        _, name, end, size, first, last = heapq.heappop(heap)
        start = max(0, end - min(FEEDBACK_SCAN_WINDOW, budget))
        try:
            line = _find_line(Path(name), needle, start, None if end == size else end)
        except OSError:  # deleted meanwhile: nothing of it read
            continue
        budget -= end - start
        if line is not None:
            return line
        if start > 0:
            when = first + (last - first) * start / size
            heapq.heappush(heap, (-when, name, start, size, first, last))
    return None


def _first_time(path: Path) -> float | None:
    """When the first line of a query file was written (its `time`); None: not readable."""
    with path.open("rb") as fh:
        head = fh.read(200)
    at = head.find(b'"time": "')
    if at < 0:
        return None
    try:
        return datetime.fromisoformat(head[at + 9 : at + 38].split(b'"')[0].decode()).timestamp()
    except (ValueError, UnicodeDecodeError):
        return None


def _find_line(path: Path, needle: bytes, start: int, end: int | None) -> bytes | None:
    """The line of `path` that starts with `needle` at an offset in [start, end) (None: none);
    `end` None: up to the file's size now."""
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0 or start >= size:
            return None
        with mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as data:
            # a line that starts before `end` is read whole
            stop = size if end is None else min(size, end + len(needle))
            at = data.find(needle, start, stop)
            while at > 0 and data[at - 1 : at] != b"\n":  # the text of a line, not its start
                at = data.find(needle, at + 1, stop)
            if at < 0:
                return None
            line_end = data.find(b"\n", at)
            return data[at : line_end if line_end >= 0 else size]


@atexit.register
def _close_open_logs() -> None:
    for query_log in list(_OPEN):
        query_log.close()


# -- reading a log back -------------------------------------------------------------------------


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def read_lines(directories: Iterable[Path], kind: str) -> Iterator[dict[str, Any]]:
    """Every line of every `<kind>-*.jsonl` file (all processes), oldest file first; a torn last
    line (a crash mid-write) is skipped."""
    for directory in directories:
        if not directory.is_dir():
            raise InvalidRequest(f"{directory} is not a query log directory (RAG_QUERY_LOG)")
        for path in sorted(directory.glob(f"{kind}-*.jsonl"), key=_mtime):
            try:
                opened = path.open(encoding="utf-8", errors="replace")
            except FileNotFoundError:  # deleted by a writer's rotation since it was listed
                continue
            with opened as fh:
                for line in fh:
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        continue


@dataclass(frozen=True)
class LoggedQueries:
    """The query lines of a log, oldest file first: every line, or one alias's when `alias` is
    set; `aliases` names every alias the log holds (for messages that list what is there)."""

    lines: tuple[dict[str, Any], ...]
    aliases: tuple[str, ...]
    alias: str | None = None
    # the lines that matched, of which `lines` holds the newest when fewer were asked for
    matched: int = 0

    def aliases_text(self) -> str:
        return ", ".join(self.aliases) or "none (no query is logged there yet)"


def read_queries(
    directories: Iterable[Path],
    *,
    alias: str | None = None,
    tenant: str | None = None,
    newest: int | None = None,
) -> LoggedQueries:
    """The logged queries of `directories`, only those asked of `alias` when it is given (the
    `alias` field of each line: the name the search was asked with), and only those that
    searched `tenant` alone when it is given. A log without any line of `alias` gives no lines;
    the caller decides whether that is an error (`aliases` says what the log holds instead).
    With `newest`, only that many, the newest by their time, oldest first, kept as the log is
    read (`doctor`: a 1 GB log read whole took ~3.4 GB; the last lines in file order were
    one replica's)."""
    aliases: set[str] = set()
    matched = 0

    def wanted() -> Iterator[dict[str, Any]]:
        nonlocal matched
        for entry in read_lines(directories, "queries"):
            if tenant is not None and entry.get("tenant") != tenant:
                continue
            aliases.add(str(entry.get("alias")))
            if alias is None or entry.get("alias") == alias:
                matched += 1
                yield entry

    if newest is None:
        lines = list(wanted())
    else:
        lines = heapq.nlargest(newest, wanted(), key=lambda e: str(e.get("time", "")))[::-1]
    return LoggedQueries(tuple(lines), tuple(sorted(aliases)), alias, matched)


@dataclass(frozen=True)
class ExportReport:
    queries: int
    judged: int
    questions: int
    duplicates_merged: int
    without_text: int
    negative_only: int
    # the alias whose queries were read (None: the log held no query at all)
    alias: str | None = None
    tenants: int = 0  # tenants the read queries searched alone (0: none named one)

    def to_dict(self) -> dict[str, int | str | None]:
        return dict(self.__dict__)


def _one_alias(logged: LoggedQueries, where: str) -> str | None:
    """The alias questions are made for: the one asked for, which the log must hold, or the
    log's only one. InvalidRequest otherwise, listing the aliases the log holds."""
    if logged.alias is not None:
        if logged.aliases and logged.alias not in logged.aliases:
            raise InvalidRequest(
                f"the query log {where} holds no query of alias {logged.alias!r}; aliases in it: "
                f"{logged.aliases_text()}; pass one of them to --collection"
            )
        return logged.alias
    if len(logged.aliases) > 1:
        raise InvalidRequest(
            f"the query log {where} holds queries of {len(logged.aliases)} aliases "
            f"({logged.aliases_text()}), and labelled questions are evaluated against one "
            f"collection (eval refuses gold documents it does not hold); pass --collection ALIAS"
        )
    return logged.aliases[0] if logged.aliases else None


def questions_from_log(
    directories: Iterable[Path], *, alias: str | None = None, tenant: str | None = None
) -> tuple[list[dict[str, Any]], ExportReport]:
    """Labelled questions from logged queries with positive feedback (the last judgement of each
    chunk or document wins). A relevant chunk becomes a gold span (its document and offsets); a
    relevant document a gold document. Queries of the same text (case and spaces ignored) and
    tenant are merged into one question, which names its tenant (`tenant`) where it has one.

    Only the queries of `alias` are read. Without it, the log must hold one alias (or none);
    InvalidRequest when it holds several, or none of the lines are of `alias`, naming the aliases
    it holds. With `tenant`, only the queries that searched that tenant alone (the `tenant` of
    their line). A log without any query gives no question."""
    dirs = list(directories)
    logged = read_queries(dirs, alias=alias, tenant=tenant)
    chosen = _one_alias(logged, ", ".join(str(d) for d in dirs))
    queries = {q["query_id"]: q for q in logged.lines}
    verdicts: dict[str, dict[tuple[str, str], bool]] = {}
    # the last judgement by its time (UTC ISO 8601 sorts as text), not by its file's place: of
    # two processes' files, the one written to last was read last, whatever it held
    judgements = sorted(read_lines(dirs, "feedback"), key=lambda fb: str(fb.get("time", "")))
    for fb in judgements:
        target = ("chunk", fb["chunk_id"]) if fb.get("chunk_id") else ("doc", fb["doc_id"])
        verdicts.setdefault(fb["query_id"], {})[target] = bool(fb["relevant"])
    merged: OrderedDict[tuple[str | None, str], dict[str, Any]] = OrderedDict()
    without_text = negative_only = 0
    for query_id, judged in verdicts.items():
        entry = queries.get(query_id)
        positive = [t for t, ok in judged.items() if ok]
        if entry is None or not positive:
            negative_only += entry is not None
            continue
        if "query" not in entry:
            without_text += 1
            continue
        hits = {h["chunk_id"]: h for h in entry["hits"]}
        # one question per text and tenant: merged across tenants, one row named each tenant's
        # gold documents (another tenant's document ids in a tenant's labelled set)
        key = (entry.get("tenant"), " ".join(entry["query"].lower().split()))
        row = merged.setdefault(
            key,
            {
                "id": f"log-{query_id}",
                "question": entry["query"],
                "gold_doc_ids": [],
                "gold_spans": [],
            }
            | ({"tenant": entry["tenant"]} if "tenant" in entry else {}),
        )
        for kind, value in positive:
            if kind == "chunk":
                hit = hits[value]
                span = {"doc_id": hit["doc_id"], "start": hit["start"], "end": hit["end"]}
                if span not in row["gold_spans"]:
                    row["gold_spans"].append(span)
                doc = hit["doc_id"]
            else:
                doc = value
            if doc not in row["gold_doc_ids"]:
                row["gold_doc_ids"].append(doc)
    rows = [
        r if r["gold_spans"] else {k: v for k, v in r.items() if k != "gold_spans"}
        for r in merged.values()
    ]
    judged_count = sum(1 for q in verdicts if q in queries)
    report = ExportReport(
        queries=len(queries),
        judged=judged_count,
        questions=len(rows),
        duplicates_merged=judged_count - negative_only - without_text - len(rows),
        without_text=without_text,
        negative_only=negative_only,
        alias=chosen,
        tenants=len({q["tenant"] for q in queries.values() if "tenant" in q}),
    )
    return rows, report
