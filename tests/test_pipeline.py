"""The ingest pipeline: stages overlap but keep their order, errors and stops end every stage,
and the collection it writes is, point for point, what the stages run one after another give."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rag_retriever.ingest.chunking import Chunker
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.pipeline import Pipeline
from rag_retriever.ingest.writer import chunking_config_for, document_hash, ingest_documents
from rag_retriever.models.bm25 import BM25Model, Tokenizer
from rag_retriever.models.encoder import Encoder
from rag_retriever.records import Document
from rag_retriever.store import EdgeStore, Store
from tests.test_parallel_chunking import ROOT, _alive, _wait_gone, start_with_workers


def _stage_threads() -> list[threading.Thread]:
    names = ("ingest-chunk", "ingest-tokenize", "ingest-write")
    return [t for t in threading.enumerate() if t.name in names]


def test_items_keep_their_order_and_the_write_queue_stays_bounded() -> None:
    pipeline: Pipeline[int, int] = Pipeline(depth=2)
    transformed: list[int] = []
    seen: list[int] = []
    ahead: list[int] = []

    def transform(x: int) -> int:
        transformed.append(x)
        ahead.append(len(transformed) - len(seen))
        return x * 10

    def consume(x: int) -> None:
        time.sleep(0.01)  # the slowest stage
        seen.append(x)

    pipeline.run(iter(range(50)), transform, consume)
    assert seen == [x * 10 for x in range(50)]
    # one being written + `depth` queued + the one just transformed
    assert max(ahead) <= 2 + 2
    assert pipeline.busy_s["consume"] >= 0.4
    assert not _stage_threads()


def test_the_prepare_stage_runs_apart_in_order_and_bounded() -> None:
    """prepare runs in its own thread (not the producer's, not the caller's), items keep their
    order through four stages, and prepare runs at most its queue's depth ahead of transform."""
    pipeline: Pipeline[int, int] = Pipeline(depth=2)
    prepared: list[int] = []
    transformed: list[int] = []
    ahead: list[int] = []
    threads: set[str] = set()

    def prepare(x: int) -> int:
        threads.add(threading.current_thread().name)
        prepared.append(x)
        ahead.append(len(prepared) - len(transformed))
        return x + 1

    def transform(x: int) -> int:
        time.sleep(0.005)  # the slowest stage, as the encoder is
        transformed.append(x)
        return x * 10

    seen: list[int] = []
    pipeline.run(iter(range(40)), transform, seen.append, prepare=prepare)
    assert seen == [(x + 1) * 10 for x in range(40)]
    assert threads == {"ingest-tokenize"}
    # the one being transformed + `depth` queued + the one just prepared
    assert max(ahead) <= 1 + 2 + 1
    assert pipeline.busy_s["prepare"] > 0
    assert not _stage_threads()


@pytest.mark.parametrize("stage", ["produce", "prepare", "transform", "consume"])
def test_an_error_in_any_stage_stops_all_and_is_raised_here(stage: str) -> None:
    closed = threading.Event()
    produced: list[int] = []

    def produce():
        try:
            for i in range(1000):
                if stage == "produce" and i == 5:
                    raise RuntimeError("boom in produce")
                produced.append(i)
                yield i
        finally:
            closed.set()  # the generator is closed in its own thread

    def transform(x: int) -> int:
        if stage == "transform" and x == 5:
            raise RuntimeError("boom in transform")
        return x

    def consume(x: int) -> None:
        if stage == "consume" and x == 5:
            raise RuntimeError("boom in consume")
        time.sleep(0.001)

    def prepare(x: int) -> int:
        if stage == "prepare" and x == 5:
            raise RuntimeError("boom in prepare")
        return x

    with pytest.raises(RuntimeError, match=f"boom in {stage}"):
        pipeline: Pipeline[int, int] = Pipeline(depth=2, produce_ahead=4)
        pipeline.run(produce(), transform, consume, prepare=prepare)
    # The other stages stopped instead of running the producer dry: past the failing item, at
    # most what the bounded queues hold was produced (however slow the machine).
    assert len(produced) <= 5 + 1 + 2 + 2 + 4 + 2, len(produced)
    assert closed.wait(60)  # a hang guard, not a time limit
    assert not _stage_threads()


def test_ctrl_c_in_the_calling_thread_stops_the_stages() -> None:
    def transform(x: int) -> int:
        if x == 3:
            raise KeyboardInterrupt
        return x

    pipeline: Pipeline[int, int] = Pipeline(depth=1)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(iter(range(10**6)), transform, lambda x: None)
    assert not _stage_threads()


def _docs(n: int) -> list[Document]:
    return [
        Document(
            f"d{i}",
            f"Title {i}",
            f"The river {i} runs to the city. Apples grow on trees number {i}.\n\n"
            + "Kings drink wine in Paris. " * (i % 7),
            {"n": i},
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("spill_after", "write_process"), [(10**6, False), (1, False), (10**6, True)]
)
def test_the_pipelined_collection_is_the_sequential_one(
    store: Store,
    tiny_encoder: Encoder,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    spill_after: int,
    write_process: bool,
) -> None:
    """Oracle: the chunker, BM25 over every chunk, and the encoder called on the same blocks,
    one after another; every point's dense vector, sparse vector and payload match, also when
    the chunked blocks waiting for the encoder went to disk and back (spill_after=1), and when
    Edge's writer process wrote the points (store/edge_writer.py)."""
    monkeypatch.setattr("rag_retriever.ingest.writer.ENCODE_BLOCK", 8)
    monkeypatch.setattr("rag_retriever.ingest.writer.UPSERT_BATCH", 3)
    monkeypatch.setattr("rag_retriever.ingest.writer.SPILL_AFTER", spill_after)
    monkeypatch.setattr(
        "rag_retriever.ingest.writer.WRITE_PROCESS_MIN_CHUNKS", 0 if write_process else 10**12
    )
    docs = _docs(80)
    with (
        caplog.at_level("INFO", logger="rag_retriever.ingest.writer"),
        caplog.at_level("DEBUG", logger="rag_retriever.store.edge"),
    ):
        report = ingest_documents(
            LoadedCorpus(tuple(docs), 0, "test"), alias="kb", encoder=tiny_encoder, store=store
        )
    # the write waits for the last chunk, so the blocks past the queues' few waited on disk
    assert ("waited on disk" in caplog.text) == (spill_after == 1)
    assert ("by a process of their own" in caplog.text) == write_process
    config = chunking_config_for(tiny_encoder, 200, 48)
    chunks = Chunker(tiny_encoder.count_tokens, config).chunk_all(docs)
    terms = [Tokenizer().tokenize(c.embed_text) for c in chunks]
    bm25 = BM25Model.build(terms)
    dense = np.concatenate(
        [
            tiny_encoder.encode_passages([c.embed_text for c in chunks[at : at + 8]]).vectors
            for at in range(0, len(chunks), 8)
        ]
    )
    assert report.chunks == len(chunks) > 8 * 8  # more blocks than the queues hold
    assert report.tokens == sum(c.n_tokens for c in chunks)
    assert store.record(report.collection).bm25 == bm25.stats
    points = {
        p.id: p
        for p in store.retrieve(
            report.collection, [c.id for c in chunks], with_dense=True, with_sparse=True
        )
    }
    hashes = {d.id: document_hash(d) for d in docs}
    for i, c in enumerate(chunks):
        point = points[c.id]
        assert point.dense is not None and np.array_equal(point.dense, dense[i])
        assert point.sparse is not None
        expected = bm25.document_vector(terms[i])
        assert point.sparse.indices == expected.indices
        assert np.allclose(point.sparse.values, expected.values, rtol=1e-6)
        assert dict(point.payload) == {**c.to_payload(), "doc_hash": hashes[c.doc_id]}


@pytest.mark.parametrize(
    ("owner", "method"),
    [
        ("store", "upsert"),  # the write stage
        ("encoder", "prepare_passages"),  # the tokenise stage
        ("encoder", "encode_prepared"),  # the encode stage
    ],
)
def test_a_failing_stage_leaves_the_alias_and_no_partial_version(
    store: Store, tiny_encoder: Encoder, monkeypatch: pytest.MonkeyPatch, owner: str, method: str
) -> None:
    corpus = LoadedCorpus(tuple(_docs(6)), 0, "test")
    good = ingest_documents(corpus, alias="kb", encoder=tiny_encoder, store=store)
    monkeypatch.setattr("rag_retriever.ingest.writer.ENCODE_BLOCK", 4)
    calls = []
    target = type(store) if owner == "store" else type(tiny_encoder)
    original = getattr(target, method)

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(target, method, failing)
    with pytest.raises(OSError, match="injected"):
        ingest_documents(
            LoadedCorpus(tuple(_docs(30)), 0, "test"),
            alias="kb",
            encoder=tiny_encoder,
            store=store,
            full=True,
        )
    assert store.aliases() == {"kb": good.collection}
    assert [v.name for v in store.versions("kb")] == [good.collection]
    assert not _stage_threads()


# An ingest whose chunking runs in 2 worker processes (5,000 documents, a slow token counter)
# while a slow fake encoder encodes; prints the workers' pids once they run. SIGTERM raises as
# the CLI's handler does.
_SCRIPT = """
import multiprocessing, signal, sys, threading, time
import numpy as np
from rag_retriever.models.encoder import Encoded
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.profiles import Fingerprint
from rag_retriever.records import Document
from rag_retriever.store import EdgeStore
from tests.word_counters import SlowWords

class SlowEncoder:
    fingerprint = Fingerprint("fake", "0" * 64, "mean", "", "", 8, 128)
    max_seq_length = 128
    special_tokens = 2
    token_counter = SlowWords(0.2)
    def count_tokens(self, texts):
        return self.token_counter(texts)
    def encode_passages(self, passages, *, progress=False):
        time.sleep(0.05)
        vectors = np.ones((len(passages), 8), dtype=np.float32) / np.sqrt(8)
        return Encoded(vectors, 0, 0)

def stop(signum, frame):
    raise SystemExit(143)

def announce():
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.05)
    time.sleep(0.5)
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)

import rag_retriever.ingest.parallel_chunking as parallel_chunking
parallel_chunking.MAX_CORES_IN_PROCESS = 0  # worker processes even on a 2-core machine
signal.signal(signal.SIGTERM, stop)
threading.Thread(target=announce, daemon=True).start()
docs = [Document(str(i), "T", "Alpha bravo. Charlie delta. " * 40) for i in range(5000)]
from pathlib import Path
store = EdgeStore(Path(sys.argv[1]))
ingest_documents(LoadedCorpus(tuple(docs), 0, "t"), alias="kb", encoder=SlowEncoder(),
                 store=store, lock_dir=Path(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_the_pipeline_stops_with_the_command(how: str, tmp_path: Path) -> None:
    """Mid-ingest (chunking workers running, the encoder busy): the command ends, no chunking
    worker outlives it, and no version is left but for the partial one being removed."""
    proc, workers = start_with_workers(_SCRIPT, str(tmp_path / "edge"))
    try:
        assert all(_alive(p) for p in workers)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=300)  # a hang guard: how fast it stops is bench/bench_stop.py's
        assert _wait_gone(workers, 300.0) == []
        assert proc.returncode == (143 if how == "sigterm" else -signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()


# An ingest whose `stage` (argv[2]) takes 0.3 s an item and says "in <stage>" when it first
# runs; the other stages are fast. Blocks of 8 chunks, so there are many. SIGTERM raises as the
# CLI's handler does.
_STAGE_SCRIPT = """
import signal, sys, time
from pathlib import Path
import numpy as np
import rag_retriever.ingest.writer as writer
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.models.encoder import Encoded
from rag_retriever.models.profiles import Fingerprint
from rag_retriever.records import Document
from rag_retriever.store import EdgeStore
from tests.word_counters import words

stage = sys.argv[2]
if stage == "write-process":  # Edge's writer process holds the shard while the stage works
    writer.WRITE_PROCESS_MIN_CHUNKS = 0
    stage = "write"
said = []

def work(name):
    if name == stage:
        if not said:
            said.append(1)
            print("in " + name, flush=True)
        time.sleep(0.3)

class Encoder:
    fingerprint = Fingerprint("fake", "0" * 64, "mean", "", "", 8, 128)
    max_seq_length = 128
    special_tokens = 2
    def count_tokens(self, texts):
        return words(texts)
    def encode_passages(self, passages, *, progress=False):
        raise AssertionError("a preparing encoder is called with tokens")
    def prepare_passages(self, passages):
        work("tokenise")
        return list(passages)
    def encode_prepared(self, prepared, *, progress=False):
        work("encode")
        return Encoded(np.ones((len(prepared), 8), dtype=np.float32) / np.sqrt(8), 0, 0)

class Store(EdgeStore):
    def upsert(self, *args, **kwargs):
        work("write")
        return super().upsert(*args, **kwargs)

def stop(signum, frame):
    raise SystemExit(143)

signal.signal(signal.SIGTERM, stop)
writer.ENCODE_BLOCK = 8
docs = [Document(str(i), "T", f"Alpha {i} bravo. Charlie delta. " * 20) for i in range(400)]
root = Path(sys.argv[1])
writer.ingest_documents(LoadedCorpus(tuple(docs), 0, "t"), alias="kb", encoder=Encoder(),
                        store=Store(root), lock_dir=root)
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["tokenise", "encode", "write", "write-process"])
def test_a_sigterm_while_a_stage_works_stops_the_ingest_and_serves_nothing(
    stage: str, tmp_path: Path, tiny_encoder: Encoder
) -> None:
    """SIGTERM while the tokenise, encode or write stage is at work (the chunk stage's case is
    the test above; write-process: Edge's writer process holds the shard): the command exits
    143, the partial version is removed, the version served before is served still, and the
    next ingest of the alias succeeds (its lock was released)."""
    root = tmp_path / "edge"
    corpus = LoadedCorpus(tuple(_docs(3)), 0, "t")
    served = ingest_documents(
        corpus, alias="kb", encoder=tiny_encoder, store=EdgeStore(root), lock_dir=root
    ).collection
    proc = subprocess.Popen(
        [sys.executable, "-c", _STAGE_SCRIPT, str(root), stage],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line == f"in {stage.removesuffix('-process')}\n", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)  # a hang guard: how fast it stops is bench/bench_stop.py's
        assert proc.returncode == 143, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    store = EdgeStore(root)
    assert store.aliases() == {"kb": served}
    assert store.collection_names() == [served]
    report = ingest_documents(
        corpus, alias="kb", encoder=tiny_encoder, store=store, lock_dir=root, full=True
    )
    assert report.promoted and store.aliases() == {"kb": report.collection} != {"kb": served}
