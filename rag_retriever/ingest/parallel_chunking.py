"""Chunking across documents in worker processes, with exactly the serial chunker's output.

Example:
    >>> per_doc = chunk_documents(docs, encoder.token_counter, config, workers=2)  # doctest: +SKIP
    >>> [c for chunks in per_doc for c in chunks] == Chunker(encoder.count_tokens, config).chunk_all(docs)  # doctest: +SKIP
    True

Each worker builds one `Chunker` from the same token counter and config and chunks whole
documents, so every chunk (id, index, offsets, token count, hash) is what `Chunker.chunk` gives
for that document alone; results come back in the documents' order, one list per document.
Documents travel to the workers in slices, so a process's start-up and the pickling are paid per
slice, not per document.

Workers ignore SIGINT (Ctrl-C reaches the whole process group; the parent decides), are
terminated when the parent leaves `chunk_documents` for any reason (an error, KeyboardInterrupt,
the CLI's SIGTERM exception), and on Linux receive SIGTERM if the parent dies without cleaning up
(SIGKILL), so none outlives the command.

`iter_chunk_documents` yields the chunks slice by slice, so the ingest pipeline
(rag_retriever/ingest/pipeline.py) encodes the first ones while the workers cut the rest.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Iterator, Sequence

from rag_retriever.ingest.chunking import Chunker, ChunkingConfig, TokenCounter
from rag_retriever.processes import become_helper, cores, spawning
from rag_retriever.records import Chunk, Document

__all__ = ["chunk_documents", "cores", "default_workers", "iter_chunk_documents"]

# Documents per task: big enough that pickling and the task round trip stay small next to the
# chunking (~0.3 ms per SciFact abstract), small enough that the two workers finish together.
DOCS_PER_TASK = 64
# Below this many tasks the workers' start-up (~0.3 s each: a fresh interpreter imports the
# chunker and unpickles the tokenizer) costs more than it saves; chunk in this process.
MIN_TASKS_FOR_WORKERS = 4
# On 2 cores one process chunked SciFact faster than two workers (5,537 vs 2,853 chunks/s,
# bench_gpu --chunking-only): each worker starts an interpreter and learns the word pieces
# again, and the encoder needs the other core anyway.
MAX_CORES_IN_PROCESS = 2
# How often a waiting iter_chunk_documents looks at its `stop` event.
_POLL_S = 0.05

_chunker: Chunker | None = None  # one per worker process, built by _start_worker


def default_workers() -> int:
    """One worker per core, or this process alone on a machine of MAX_CORES_IN_PROCESS or fewer."""
    n = cores()
    return 1 if n <= MAX_CORES_IN_PROCESS else n


def chunk_documents(
    docs: Sequence[Document],
    count_tokens: TokenCounter,
    config: ChunkingConfig,
    *,
    workers: int | None = None,
    docs_per_task: int = DOCS_PER_TASK,
) -> list[list[Chunk]]:
    """The chunks of each document, in the documents' order, chunked by `workers` processes
    (default: one per core; 1 = in this process). `count_tokens` must be picklable, such as
    `Encoder.token_counter`, a `TokenizerCounter` (a bound method of a loaded model is not), and
    importable by the workers (not defined in the `__main__` script)."""
    return [
        chunks
        for part in iter_chunk_documents(
            docs, count_tokens, config, workers=workers, docs_per_task=docs_per_task
        )
        for chunks in part
    ]


def iter_chunk_documents(
    docs: Sequence[Document],
    count_tokens: TokenCounter,
    config: ChunkingConfig,
    *,
    workers: int | None = None,
    docs_per_task: int = DOCS_PER_TASK,
    stop: threading.Event | None = None,
) -> Iterator[list[list[Chunk]]]:
    """`chunk_documents`, slice by slice as the workers finish them (in order), so that a caller
    can encode the first chunks while the rest are cut. Closing the generator, or setting
    `stop` while it waits for a worker, ends the workers (the ingest pipeline does both from
    the thread that iterates)."""
    workers = default_workers() if workers is None else workers
    if workers < 1 or docs_per_task < 1:
        raise ValueError(
            f"workers and docs_per_task must be positive, got {workers}, {docs_per_task}"
        )
    slices = [list(docs[i : i + docs_per_task]) for i in range(0, len(docs), docs_per_task)]
    if workers == 1 or len(docs) < MIN_TASKS_FOR_WORKERS * docs_per_task:
        chunker = Chunker(count_tokens, config)
        for piece in slices:
            if stop is not None and stop.is_set():
                return
            yield chunker.chunk_many(piece)
        return
    # spawn, not fork: the parent holds torch's and the encoder's threads, and a forked copy of
    # a multi-threaded process can deadlock on a lock some thread held.
    context = multiprocessing.get_context("spawn")
    with spawning():
        pool = context.Pool(
            min(workers, len(slices)),
            initializer=_start_worker,
            initargs=(count_tokens, config, os.getpid()),
        )
    try:
        results = pool.imap(_chunk_slice, slices)
        for _ in slices:
            while True:
                if stop is not None and stop.is_set():
                    return
                try:
                    done = results.next(timeout=_POLL_S)
                    break
                except multiprocessing.TimeoutError:
                    continue
            yield done
        pool.close()
    finally:
        pool.terminate()  # at once on an error, Ctrl-C or SIGTERM; after close(), a no-op wait
        pool.join()


def _start_worker(count_tokens: TokenCounter, config: ChunkingConfig, parent: int) -> None:
    global _chunker
    become_helper(parent)
    # one tokenizer thread per worker: the workers are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _chunker = Chunker(count_tokens, config)


def _chunk_slice(docs: list[Document]) -> list[list[Chunk]]:
    assert _chunker is not None, "worker not started"
    return _chunker.chunk_many(docs)
