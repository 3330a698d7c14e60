"""One ingest per alias at a time: an advisory file lock that dies with its process.

Example:
    >>> with IngestLock(Path("rag-data"), "docs"):              # doctest: +SKIP
    ...     pass

`fcntl.flock` is released by the kernel when the holding process exits, SIGKILL included, so a
killed ingest cannot leave the alias locked forever; the PID written in the file is only there
to name the holder in the error. The lock is per machine (a shared data dir on one host); two
hosts ingesting the same alias into one Qdrant server are not serialised by it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from rag_retriever.errors import ConfigError, IngestLocked, InvalidRequest
from rag_retriever.records import check_alias
from rag_retriever.store.base import parse_collection_name

# How often a waiting writer tries the lock again.
_POLL_S = 0.05
# A compaction names itself in the lock (`holder`); it holds the lock to note the shards it
# merges and to serve the merged version (a count, the alias, retention: seconds at most), so
# even a writer that does not wait (an ingest) waits this long for it.
COMPACTION = "compaction"
COMPACTION_WAIT_S = 60.0


def default_lock_dir(store: Any) -> Path:
    """Where the locks of a store's aliases live: the data dir of an embedded store (the parent
    of its root, as the CLI's RAG_DATA_DIR), else the temp dir."""
    root = getattr(store, "root", None)
    return Path(root).parent if root is not None else Path(tempfile.gettempdir()) / "rag-retriever"


def update_record(
    store: Any, name: str, *, lock_dir: Path | None = None, wait_s: float = 0.0, **changes: Any
) -> None:
    """Replace fields of version `name`'s record (its tuned fusion, its reranker) under its
    alias's write lock, reading the record inside it: a rewrite racing an update's alias move
    would undo the `retired_at` stamp the move gave the version it left, and retention would
    then delete that version with no grace."""
    parsed = parse_collection_name(name)
    alias = parsed[0] if parsed else name
    with IngestLock(lock_dir or default_lock_dir(store), alias, wait_s=wait_s):
        store.put_record(name, dataclasses.replace(store.record(name), **changes))


def check_unlocked(data_dir: Path, alias: str) -> None:
    """IngestLocked now if another ingest holds `alias`'s lock (taken and let go at once), so a
    second ingest says so before it loads documents and a model. The ingest takes the lock again
    to write, so one that starts in between is still refused there."""
    with IngestLock(data_dir, alias):
        pass


class IngestLock:
    """`wait_s` > 0: wait up to that long for another writer of the alias to finish."""

    def __init__(
        self, data_dir: Path, alias: str, *, wait_s: float = 0.0, holder: str = ""
    ) -> None:
        try:
            check_alias(alias)  # before the name becomes part of a path
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self.path = data_dir / "locks" / f"{alias}.lock"
        self.alias = alias
        self.wait_s = wait_s
        # what the holder is, written after its pid: a compaction holds the lock only for
        # moments, so a writer that would not wait waits for it (COMPACTION_WAIT_S)
        self.holder = holder
        self._fh: int | None = None

    def __enter__(self) -> IngestLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create {self.path.parent} ({exc.strerror}): the data dir "
                f"{self.path.parent.parent} must be a folder this user can write; set "
                f"RAG_DATA_DIR or --data-dir"
            ) from None
        if not self.path.resolve().is_relative_to(self.path.parent.parent.resolve()):
            raise ConfigError(
                f"{self.path} leads outside the data dir (to {self.path.resolve()}); "
                f"locks are written only under {self.path.parent.parent}: remove the link"
            )
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        started = time.monotonic()
        deadline = started + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                if holder.endswith(COMPACTION):
                    deadline = max(deadline, started + COMPACTION_WAIT_S)
                if time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
                os.close(fd)
                waited = f" (waited {self.wait_s:g} s, RAG_LOCK_WAIT_S)" if self.wait_s else ""
                raise IngestLocked(
                    f"another write of {self.alias!r} is running (pid {holder}, lock "
                    f"{self.path}){waited}; wait for it to finish. The lock is released "
                    f"automatically if that process dies."
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.holder}".strip().encode("ascii"), 0)
        self._fh = fd
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fh is not None:
            os.ftruncate(self._fh, 0)
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            os.close(self._fh)
            self._fh = None
