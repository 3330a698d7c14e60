"""Queries of concurrent requests encoded together: one forward pass for all that arrived while
the previous one ran.

Example:
    >>> batcher = QueryBatcher(encoder.encode_queries)                 # doctest: +SKIP
    >>> batcher.encode(["how do I roll back?"]).vectors.shape          # doctest: +SKIP
    (1, 384)

A caller that finds the encoder idle encodes its own queries at once: no wait, so a lone query
costs what it did. A caller that finds it busy queues its queries; when the running pass ends,
the first caller waiting becomes the next leader and encodes everything queued by then (up to
`max_batch` queries) in one pass, and hands each caller its rows. On a CPU a pass over 8 short
queries costs far less than 8 passes (the HTTP service at load: docs/benchmarks.md, "The brief
under load"), so throughput grows with the load instead of queries queueing behind one another.

Vectors do not depend on their batch-mates: pooling is masked (encoder.py), so a query's vector
is the one it gets alone, to float rounding. `truncated` of a shared pass is the pass's count,
so a caller that sees it non-zero counts its own queries' tokens (as the retriever does).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the encoder module imports torch; a BM25-only search must not
    from rag_retriever.models.encoder import Encoded

# Queries one pass takes at most (more wait for the next pass).
MAX_BATCH = 64


@dataclass
class _Request:
    texts: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to encode the queue, not with a result
    result: Encoded | None = None
    error: BaseException | None = None


class QueryBatcher:
    """Concurrent `encode` calls share passes of `encode_queries` (see the module docstring)."""

    def __init__(
        self, encode_queries: Callable[[list[str]], Encoded], *, max_batch: int = MAX_BATCH
    ) -> None:
        self._encode = encode_queries
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Request] = []
        self._busy = False
        self.passes = 0  # forward passes run, for tests and metrics

    def encode(self, texts: Sequence[str]) -> Encoded:
        request = _Request(list(texts))
        with self._lock:
            self._queue.append(request)
            leading = not self._busy  # idle: the queue was empty, this request is its head
            self._busy = True
        if not leading:
            request.done.wait()  # for its rows, or to lead the next pass (it is the head)
            leading = request.lead
        if leading:
            self._run()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _run(self) -> None:
        """Encode the queue's head in one pass, answer its callers, then hand the lead to the
        next caller waiting (or mark the encoder idle)."""
        with self._lock:
            taken: list[_Request] = []
            size = 0
            while self._queue and (not taken or size + len(self._queue[0].texts) <= self.max_batch):
                size += len(self._queue[0].texts)
                taken.append(self._queue.pop(0))
        try:
            encoded = self._encode([t for r in taken for t in r.texts])
            self.passes += 1
            start = 0
            for r in taken:
                rows = encoded.vectors[start : start + len(r.texts)]
                start += len(r.texts)
                r.result = dataclasses.replace(encoded, vectors=rows)
        except BaseException as exc:  # every caller of the pass gets the encoder's error
            for r in taken:
                r.error = exc
        for r in taken:
            r.done.set()
        with self._lock:
            if self._queue:  # the oldest waiting caller leads the next pass
                self._queue[0].lead = True
                self._queue[0].done.set()
            else:
                self._busy = False
