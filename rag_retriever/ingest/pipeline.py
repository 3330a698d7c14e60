"""Ingest stages at once: produce (chunk) -> prepare (tokenise) -> transform (encode) -> consume
(write), in order, with bounded queues between them.

Example:
    >>> pipeline = Pipeline(depth=2)
    >>> out = []
    >>> pipeline.run(iter([1, 2, 3]), lambda x: x * 10, out.append, prepare=lambda x: x + 1)
    >>> out, sorted(pipeline.busy_s)
    ([20, 30, 40], ['consume', 'prepare', 'produce', 'transform'])

`produce` runs in a thread, `prepare` (optional) in a thread, `transform` in the calling thread
(the encoder and its device stay where they were, and Ctrl-C, which Python delivers to the main
thread, interrupts it there), and `consume` in a thread. While item n is transformed, item n+1
is prepared, item n+2 produced and item n-1 consumed, so the device (or the CPU encoder) does not
wait for the tokenizer; the queues after `produce` hold at most `depth` items each (tokenised
texts, encoded vectors: memory stays flat however slow the writes), the queue from `produce` at
most `produce_ahead` (None: the producer never waits, since a write stage that waits for the
version's BM25 statistics must not stop the chunking that makes them; with `spill_after` the
items past that many wait on disk, rag_retriever/ingest/spill.py, so memory stays flat then
too). Items reach `consume` in the order `produce` made them.

Stopping: an exception in any stage, or a KeyboardInterrupt / SystemExit (the CLI's SIGTERM) in
the calling thread, sets `stop`; the other stages see it within `POLL_S` between items, the
producer's iterator is closed in its own thread (so a generator's `finally` runs there: worker
pools are terminated), the stage threads are joined, and the first error is raised in the calling
thread. The caller then cleans up (the writer deletes the partial version) knowing no stage is
still writing. `busy_s` holds each stage's own time (they overlap: their sum exceeds the wall
time).

Not handled: more than one thread per stage, or reordering.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from rag_retriever.ingest.spill import SpillQueue

A = TypeVar("A")
B = TypeVar("B")

# How often a waiting stage looks at `stop` (and the calling thread at the others' errors).
POLL_S = 0.05
# How long the calling thread waits for a stopping stage (one item's work at most: one upsert
# batch, or one task of the chunking workers) before it gives up on it: both within 2 s.
JOIN_S = 0.8


# What a stage reads from or writes to.
Box = queue.Queue[Any] | SpillQueue


class _Done:
    """Marks the end of a queue."""

    def __reduce__(self) -> str:
        return "_DONE"  # the one marker, also after a spill to disk and back


_DONE = _Done()


class StageStopped(Exception):
    """Raised inside a stage that waits for something when the pipeline stops."""


class Pipeline(Generic[A, B]):
    """One run of produce -> prepare -> transform -> consume (module docstring)."""

    def __init__(
        self, depth: int = 2, *, produce_ahead: int | None = None, spill_after: int | None = None
    ) -> None:
        if depth < 1 or any(n is not None and n < 1 for n in (produce_ahead, spill_after)):
            raise ValueError(
                "depth, produce_ahead and spill_after must be at least 1, got "
                f"{depth}, {produce_ahead}, {spill_after}"
            )
        if produce_ahead is not None and spill_after is not None:
            raise ValueError("a producer that waits (produce_ahead) never needs to spill")
        self.depth = depth
        self.produce_ahead = produce_ahead
        self.spill_after = spill_after
        self.spilled = 0  # items the producer's queue kept on disk
        self.stop = threading.Event()
        self.busy_s: dict[str, float] = {
            "produce": 0.0,
            "prepare": 0.0,
            "transform": 0.0,
            "consume": 0.0,
        }
        self._errors: list[BaseException] = []

    def wait(self, event: threading.Event) -> None:
        """Wait in a stage for `event`, or raise StageStopped when the pipeline stops first."""
        while not event.wait(POLL_S):
            if self.stop.is_set():
                raise StageStopped

    def run(
        self,
        produce: Iterator[A],
        transform: Callable[[A], B],
        consume: Callable[[B], None],
        *,
        prepare: Callable[[A], A] | None = None,
    ) -> None:
        inbox: Box = (
            SpillQueue(self.spill_after)
            if self.spill_after
            else queue.Queue(self.produce_ahead or 0)
        )
        prepared: Box = queue.Queue(self.depth) if prepare else inbox
        outbox: Box = queue.Queue(self.depth)
        consumer = threading.Thread(
            target=self._stage,
            args=("consume", consume, outbox, None),
            name="ingest-write",
            daemon=True,
        )
        threads = [
            threading.Thread(
                target=self._produce, args=(produce, inbox), name="ingest-chunk", daemon=True
            ),
            consumer,
        ]
        if prepare is not None:
            threads.append(
                threading.Thread(
                    target=self._stage,
                    args=("prepare", prepare, inbox, prepared),
                    name="ingest-tokenize",
                    daemon=True,
                )
            )
        for thread in threads:
            thread.start()
        try:
            while True:
                item = self._get(prepared)
                if item is _DONE:
                    break
                began = time.perf_counter()
                result = transform(item)
                self.busy_s["transform"] += time.perf_counter() - began
                self._put(outbox, result)
            self._put(outbox, _DONE)
            while consumer.is_alive():
                consumer.join(POLL_S)
                self._raise_errors()
        except BaseException:
            self.stop.set()
            raise
        finally:
            self.stop.set()  # the producer may still run if the consumer failed
            for thread in threads:
                thread.join(JOIN_S)
            if isinstance(inbox, SpillQueue):
                self.spilled = inbox.spilled
                inbox.close()
        self._raise_errors()

    # -- the calling thread -----------------------------------------------------------------

    def _raise_errors(self) -> None:
        if self._errors:
            raise self._errors[0]

    def _get(self, box: Box) -> Any:
        while True:
            self._raise_errors()
            try:
                return box.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def _put(self, box: Box, item: Any) -> None:
        while True:
            self._raise_errors()
            try:
                box.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    # -- the stage threads ------------------------------------------------------------------

    def _produce(self, produce: Iterator[A], inbox: Box) -> None:
        try:
            while not self.stop.is_set():
                began = time.perf_counter()
                try:
                    item = next(produce)
                except StopIteration:
                    break
                finally:
                    self.busy_s["produce"] += time.perf_counter() - began
                if not self._offer(inbox, item):
                    return
            self._offer(inbox, _DONE)
        except StageStopped:
            pass
        except BaseException as exc:  # raised again in the calling thread
            self._fail(exc)
        finally:
            close = getattr(produce, "close", None)
            if close is not None:
                try:
                    close()
                except BaseException as exc:  # raised again in the calling thread
                    self._fail(exc)

    def _stage(
        self,
        name: str,
        work: Callable[[Any], Any],
        inbox: Box,
        outbox: Box | None,
    ) -> None:
        """`work` on each item of `inbox`, in order, its results to `outbox` (if any)."""
        try:
            while not self.stop.is_set():
                try:
                    item = inbox.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is _DONE:
                    if outbox is not None:
                        self._offer(outbox, _DONE)
                    return
                began = time.perf_counter()
                try:
                    result = work(item)
                finally:
                    self.busy_s[name] += time.perf_counter() - began
                if outbox is not None and not self._offer(outbox, result):
                    return
        except StageStopped:
            pass
        except BaseException as exc:  # raised again in the calling thread
            self._fail(exc)

    def _offer(self, box: Box, item: Any) -> bool:
        """Put `item` unless the pipeline stops first."""
        while not self.stop.is_set():
            try:
                box.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _fail(self, exc: BaseException) -> None:
        self._errors.append(exc)
        self.stop.set()
