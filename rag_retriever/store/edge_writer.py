"""A Qdrant Edge shard written, or sealed, by a process of its own, for a large build.

Example:
    >>> with store.bulk_write(name):      # EdgeStore: this shard's upserts go to a writer process
    ...     store.upsert(name, ids, dense, sparse, payloads)                # doctest: +SKIP
    >>> seal_apart(directory, functools.partial(seal_shard, indexes=kinds))  # doctest: +SKIP

Why: Qdrant Edge's Python bindings hold the interpreter lock inside their calls, and turning a
chunk into the engine's point (its vector as a list, its sparse vector, its payload converted)
costs as much Python as the rest of the write. In the ingest's process that time is taken from
the chunk, tokenise and encode stages, which share the lock; a GPU ingest was bound by it. The
writer process takes each batch as it is pickled (the vectors as one array) and does the
conversion and the engine's upsert on its own core.

Contract:
- `ShardWriter(directory)` starts the process, which opens the (created, closed) shard.
- `upsert` sends a batch; it blocks only while the pipe is full (the process is behind), so a
  build's memory stays bounded. An error the process met is raised by the next `upsert` or by
  `close` as `StoreUnavailable`, with the engine's message.
- `close()` asks the process to flush and close the shard and waits for it; the shard is then
  complete on disk, to be opened again (for the seal) by the caller.
- `kill()` (any failure or stop of the build) ends the process without flushing: the caller
  deletes the partial version. The process stops when its pipe closes, so it ends with its
  parent (SIGKILL included).

`seal_apart(directory, seal)` runs `seal(shard)` (picklable; the store's seal) on the closed
shard at `directory` in a process of its own and returns what it returns. Why: the engine's
optimize is one call of minutes (10-13 for a 1M-chunk int8 shard on 2 cores) that holds the
interpreter lock, so a seal in the build's process stops every other thread there and defers a
signal's handler (the CLI's SIGTERM, `docker stop`) until it returns; here the caller waits on a
pipe, and a stop kills the sealer at once. What each seal leaves allocated also goes with its
process. The memory it costs is the same: 1M binary chunks as two shards of 500k peaked at
1,310 MB private sealed apart, 1,294 MB sealed in the build's process, one 500k shard 1,260 MB
(sampled from outside the process: docs/benchmarks.md, "A build's private peak, read from
outside"). An error the seal raises is raised here as `StoreUnavailable` with the engine's
message, and so is the process's death (the kernel's OOM killer included) with its exit code;
on any exception here the process is killed, and it ends with its parent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from rag_retriever.errors import StoreUnavailable
from rag_retriever.models.bm25 import SparseVector
from rag_retriever.processes import become_helper, start_piped
from rag_retriever.store.base import DENSE, SPARSE

# A batch: ids, dense vectors (one array), sparse vectors as (indices, values), payloads.
Batch = tuple[list[str], np.ndarray, list[tuple[Sequence[int], Sequence[float]]], list[Any]]
# How long close() waits for the process to flush the shard, and kill() for it to end.
CLOSE_TIMEOUT_S = 600.0
KILL_TIMEOUT_S = 10.0


def engine_points(
    edge: Any,
    ids: Sequence[str],
    dense: np.ndarray,
    sparse: Sequence[tuple[Sequence[int], Sequence[float]]],
    payloads: Sequence[Mapping[str, Any]],
) -> list[Any]:
    """The engine's `Point`s of a batch (in this process or in the writer's)."""
    return [
        edge.Point(
            pid,
            {DENSE: vec.tolist(), SPARSE: edge.SparseVector(list(indices), list(values))},
            dict(payload),
        )
        for pid, vec, (indices, values), payload in zip(ids, dense, sparse, payloads, strict=True)
    ]


class ShardWriter:
    """The parent's end: one writer process for one shard directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._process, self._conn = start_piped(_serve, directory, "shard writer")
        self.batches = 0

    def upsert(
        self,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None:
        self._raise_reported()
        batch: Batch = (
            list(ids),
            np.ascontiguousarray(dense, dtype=np.float32),
            [(s.indices, s.values) for s in sparse],
            [dict(p) for p in payloads],
        )
        try:
            self._conn.send(("upsert", batch))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._raise_reported()
            raise self._gone() from None
        self.batches += 1

    def close(self) -> None:
        """Flush and close the shard in the writer process; wait for it to end."""
        try:
            self._conn.send(("close", None))
            if not self._conn.poll(CLOSE_TIMEOUT_S):
                raise StoreUnavailable(
                    f"the shard writer of {self.directory} did not finish in "
                    f"{CLOSE_TIMEOUT_S:.0f} s"
                )
            kind, message = self._conn.recv()
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._raise_reported()  # the error it sent before it stopped, if any
            raise self._gone() from None
        finally:
            self._end(KILL_TIMEOUT_S)
        if kind != "closed":
            raise StoreUnavailable(f"the Qdrant engine failed writing {self.directory}: {message}")

    def kill(self) -> None:
        """End the process without flushing (the caller removes the partial version)."""
        self._process.kill()
        self._end(KILL_TIMEOUT_S)

    def _end(self, timeout: float) -> None:
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(KILL_TIMEOUT_S)
        self._conn.close()

    def _raise_reported(self) -> None:
        """An error the process sent back (it stops after sending one)."""
        try:
            reported = self._conn.poll() and self._conn.recv()
        except (EOFError, ConnectionResetError):
            return
        if reported:
            raise StoreUnavailable(
                f"the Qdrant engine failed writing {self.directory}: {reported[1]}"
            )

    def _gone(self) -> StoreUnavailable:
        self._process.join(KILL_TIMEOUT_S)
        return StoreUnavailable(
            f"the shard writer of {self.directory} exited (code {self._process.exitcode}) "
            "before the build was written"
        )


def _serve(directory: str, conn: Connection, parent: int) -> None:
    """The writer process: batches into the shard until "close" (flush, close, answer) or the
    pipe's end (the parent is gone: stop, unflushed). An error is sent back and ends it."""
    become_helper(parent, end_with_parent=False)  # started by the write stage's thread
    import qdrant_edge as edge

    try:
        shard = edge.EdgeShard.load(directory)
        while True:
            try:
                kind, batch = conn.recv()
            except EOFError:
                return
            if kind == "close":
                shard.flush()
                shard.close()
                conn.send(("closed", None))
                return
            ids, dense, sparse, payloads = batch
            shard.update(
                edge.UpdateOperation.upsert_points(
                    engine_points(edge, ids, dense, sparse, payloads)
                )
            )
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def seal_apart(directory: str, seal: Callable[[Any], int]) -> int:
    """`seal(shard)` on the closed shard at `directory`, in a process of its own (see the module
    docstring); its result."""
    process, conn = start_piped(_seal_serve, (directory, seal), "shard sealer")
    try:
        kind, value = conn.recv()
    except (EOFError, ConnectionResetError):
        process.join(KILL_TIMEOUT_S)
        raise StoreUnavailable(
            f"the shard sealer of {directory} exited (code {process.exitcode}) before the seal "
            "was done"
        ) from None
    except BaseException:  # Ctrl-C, SIGTERM: the seal is not wanted any more
        process.kill()
        raise
    finally:
        process.join(KILL_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(KILL_TIMEOUT_S)
        conn.close()
    if kind != "sealed":
        raise StoreUnavailable(f"the Qdrant engine failed sealing {directory}: {value}")
    return int(value)


def _seal_serve(job: tuple[str, Callable[[Any], int]], conn: Connection, parent: int) -> None:
    """The sealer process: open the shard, seal it, close it, answer ("sealed", its result)
    or ("error", the message). The thread that started it waits for it, so it may end with
    the parent."""
    become_helper(parent)
    directory, seal = job
    import qdrant_edge as edge

    try:
        shard = edge.EdgeShard.load(directory)
        result = seal(shard)
        shard.close()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("sealed", result))
