"""SpillQueue: first in, first out across RAM and disk, for one writer and one reader thread;
the pipeline's producer queue with it; and the tally a full build keeps instead of its chunks."""

from __future__ import annotations

import errno
import io
import os
import queue
import tempfile
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_retriever.errors import NoTempSpace
from rag_retriever.ingest.pipeline import Pipeline
from rag_retriever.ingest.spill import SpillQueue
from rag_retriever.ingest.writer import _payload_indexes, _Tally
from rag_retriever.records import Chunk, content_hash
from rag_retriever.store.record import field_kinds
from tests.test_write_properties import VALUES


@settings(max_examples=200, deadline=None)
@given(
    memory=st.integers(1, 4),
    ops=st.lists(st.one_of(st.integers(0, 10**6), st.none()), max_size=60),
)
def test_any_interleaving_of_puts_and_gets_is_first_in_first_out(
    memory: int, ops: list[int | None]
) -> None:
    """Oracle: a plain list. An int is put, None is a get (queue.Empty when the oracle is empty);
    RAM never holds more than `memory` items."""
    box, oracle = SpillQueue(memory), []
    try:
        for op in ops:
            if op is not None:
                box.put({"item": op})
                oracle.append({"item": op})
            elif oracle:
                assert box.get(timeout=0) == oracle.pop(0)
            else:
                with pytest.raises(queue.Empty):
                    box.get(timeout=0)
            assert len(box._ram) <= memory
        assert [box.get(timeout=0) for _ in oracle] == oracle
    finally:
        box.close()


def test_what_spills_goes_to_an_unnamed_file_and_a_reader_thread_gets_it_in_order() -> None:
    box = SpillQueue(memory=3)
    got: list[list[str]] = []

    def read() -> None:
        for _ in range(500):
            got.append(box.get(timeout=60))  # a hang guard

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(500):
        box.put([f"chunk {i}"] * 3)
    reader.join(60)
    assert got == [[f"chunk {i}"] * 3 for i in range(500)]
    spill_files = [n for n in os.listdir(tempfile.gettempdir()) if "rag-ingest-spill" in n]
    assert spill_files == []  # unlinked at creation: a killed process leaves nothing
    box.close()
    with pytest.raises(queue.Empty):
        box.get(timeout=0)


def test_nothing_spills_while_the_reader_keeps_up() -> None:
    box = SpillQueue(memory=1)
    for i in range(100):
        box.put(i)
        assert box.get(timeout=0) == i
    assert box.spilled == 0


def test_a_full_temp_disk_says_where_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    class Full(io.BytesIO):
        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", lambda **_: Full())
    box = SpillQueue(memory=1)
    box.put(1)
    with pytest.raises(
        NoTempSpace, match=r"No space left on device.*point TMPDIR at a disk"
    ) as err:
        box.put(2)
    assert err.value.errno == errno.ENOSPC
    assert box.get(timeout=0) == 1  # what was kept stays
    box.close()


def test_memory_below_one_item_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SpillQueue(0)
    with pytest.raises(ValueError, match="at least 1"):
        Pipeline(2, spill_after=0)
    with pytest.raises(ValueError, match="never needs to spill"):
        Pipeline(2, produce_ahead=4, spill_after=4)


def test_a_pipeline_whose_producer_runs_ahead_keeps_the_order_and_spills() -> None:
    """The writer's case: the consumer waits until the producer is done (BM25's statistics), so
    everything produced past the queues waits in the producer's queue, mostly on disk."""
    produced_all = threading.Event()
    pipeline: Pipeline[int, int] = Pipeline(depth=2, spill_after=2)

    def produce():
        yield from range(200)
        produced_all.set()

    seen: list[int] = []

    def consume(x: int) -> None:
        pipeline.wait(produced_all)
        seen.append(x)

    pipeline.run(produce(), lambda x: -x, consume, prepare=lambda x: x + 1)
    assert seen == [-(x + 1) for x in range(200)]
    assert pipeline.spilled > 150  # all but the few in RAM and the bounded queues


@settings(max_examples=150, deadline=None)
@given(
    metadatas=st.lists(st.dictionaries(st.sampled_from("abc"), VALUES, max_size=3), max_size=8),
    texts=st.lists(st.sampled_from(["x", "y", "z"]), max_size=8),
    old=st.lists(st.sampled_from(["x", "y", "w"]), max_size=4),
)
def test_the_tally_of_a_build_says_what_its_chunks_say(
    metadatas: list[dict[str, Any]], texts: list[str], old: list[str]
) -> None:
    """A full build counts its chunks as they pass instead of keeping them. Oracle: the field
    kinds, payload indexes, tokens and texts no longer held, computed over every chunk."""
    chunks = [
        _chunk(text, i, metadatas[i % len(metadatas)] if metadatas else {})
        for i, text in enumerate(texts)
    ]
    replaced = [_chunk(text, 100 + i, {}) for i, text in enumerate(old)]
    tally = _Tally(replaced)
    tally.add(chunks[:3])
    tally.add(chunks[3:])
    assert tally.chunks == len(chunks)
    assert tally.tokens == sum(c.n_tokens for c in chunks)
    assert tally.removed == len(
        {c.content_hash for c in replaced} - {c.content_hash for c in chunks}
    )
    assert field_kinds(tally.metadatas()) == field_kinds(c.metadata for c in chunks)
    assert _payload_indexes(tally.metadatas()) == _payload_indexes(c.metadata for c in chunks)


def _chunk(text: str, i: int, metadata: dict[str, Any]) -> Chunk:
    return Chunk(f"c{i}", f"d{i}", "T", 0, 0, 1, text, i % 5 + 1, content_hash(text), metadata)
