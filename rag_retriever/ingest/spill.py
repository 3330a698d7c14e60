"""A first-in first-out queue that never blocks its writer and keeps at most `memory` items in
RAM: the ones past that wait pickled in an unnamed temporary file, read back in order.

Example:
    >>> box = SpillQueue(memory=2)
    >>> for item in range(5):
    ...     box.put(item)
    >>> box.spilled, [box.get() for _ in range(5)]
    (3, [0, 1, 2, 3, 4])
    >>> box.close()

What it is for: a full build's chunk stage runs ahead of the encoder (the first upsert waits for
the corpus's BM25 statistics, which need the last chunk), so everything chunked but not yet
encoded waits somewhere. In RAM that was every chunk of the corpus (a 1M-chunk ingest held them
all); here it is `memory` items and the rest on disk, about the chunks' own size. The file is
unlinked at creation (`tempfile.TemporaryFile`), so a killed process leaves nothing behind; it
lives in the temp dir (`TMPDIR`).

It answers `put(item, timeout)` and `get(timeout)` as `queue.Queue` does (`queue.Empty` when
nothing comes within `timeout`), for one writer thread and one reader thread. A temp dir that
cannot take a spill (full, not writable) raises `NoTempSpace`, naming it and what to do: the CLI
prints it as one line, exit 2, and the build removes its partial version.
"""

from __future__ import annotations

import collections
import pickle
import queue
import tempfile
import threading
from typing import IO, Any

from rag_retriever.errors import NoTempSpace


class SpillQueue:
    """FIFO; `put` never waits; items past `memory` go to disk (module docstring)."""

    def __init__(self, memory: int) -> None:
        if memory < 1:
            raise ValueError(f"memory must be at least 1 item, got {memory}")
        self.memory = memory
        self.spilled = 0  # items that went to disk, in all
        self._ram: collections.deque[Any] = collections.deque()
        self._file: IO[bytes] | None = None
        self._ends: collections.deque[int] = collections.deque()  # end offset of each on disk
        self._read_at = 0
        self._ready = threading.Condition()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Add `item` (never waits: `block` and `timeout` are there for `queue.Queue`'s callers)."""
        with self._ready:
            if not self._ends and len(self._ram) < self.memory:
                self._ram.append(item)
            else:  # while anything is on disk, later items go after it there (the order holds)
                try:
                    if self._file is None:
                        # closed by close()
                        self._file = tempfile.TemporaryFile(prefix="rag-ingest-spill-")  # noqa: SIM115
                    self._file.seek(0, 2)
                    pickle.dump(item, self._file, protocol=pickle.HIGHEST_PROTOCOL)
                except OSError as exc:
                    raise NoTempSpace(
                        exc.errno,
                        f"cannot keep the chunks waiting for the encoder in {tempfile.gettempdir()} "
                        f"({exc.strerror or exc}): a full build needs about 1.3 KB a chunk there; "
                        "point TMPDIR at a disk with room",
                    ) from exc
                self._ends.append(self._file.tell())
                self.spilled += 1
            self._ready.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        with self._ready:
            if not self._ready.wait_for(self._waiting, timeout if block else 0):
                raise queue.Empty
            item = self._ram.popleft() if self._ram else self._load()
            if not self._ram and not self._ends and self._file is not None:
                self._file.seek(0)  # drained: the next spill reuses the space
                self._file.truncate()
                self._read_at = 0
            return item

    def close(self) -> None:
        """Drop what is left and free the file."""
        with self._ready:
            self._ram.clear()
            self._ends.clear()
            if self._file is not None:
                self._file.close()
                self._file = None

    def _waiting(self) -> bool:
        return bool(self._ram or self._ends)

    def _load(self) -> Any:
        assert self._file is not None
        end = self._ends.popleft()
        self._file.seek(self._read_at)
        data = self._file.read(end - self._read_at)
        self._read_at = end
        return pickle.loads(data)
