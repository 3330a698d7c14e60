"""Edge's writer and sealer processes (rag_retriever/store/edge_writer.py): what they write is
what the store writes itself, their errors reach the caller as StoreUnavailable, and they never
outlive the build or its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rag_retriever.errors import StoreUnavailable
from rag_retriever.models.bm25 import BM25Model, SparseVector
from rag_retriever.store import DENSE, EdgeStore, StageQuery
from rag_retriever.store.edge import seal_shard
from rag_retriever.store.edge_writer import ShardWriter, seal_apart
from rag_retriever.store.record import bare_record

ROOT = Path(__file__).resolve().parents[1]
DIM = 8


def _batch(first: int, n: int) -> tuple[list[str], np.ndarray, list[SparseVector], list[dict]]:
    ids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(first, first + n)]
    rng = np.random.default_rng(first)
    dense = rng.standard_normal((n, DIM)).astype(np.float32)
    sparse = [SparseVector((i, i + 7), (0.5, float(i))) for i in range(first, first + n)]
    payloads = [
        {"chunk_id": pid, "text": f"text {i}", "metadata": {"n": i}} for i, pid in enumerate(ids)
    ]
    return ids, dense, sparse, payloads


def _create(store: EdgeStore, name: str) -> None:
    bm25 = BM25Model.build([["a"]])
    store.create(name, DIM, bare_record(name, dim=DIM, bm25=bm25.stats))


def test_points_written_by_the_process_equal_those_written_here(tmp_path: Path) -> None:
    """Oracle: the same batches upserted in this process into another version."""
    store = EdgeStore(tmp_path / "edge")
    _create(store, "a__m__v1")
    _create(store, "a__m__v2")
    batches = [_batch(first, 30) for first in range(0, 90, 30)]
    with store.bulk_write("a__m__v1"):
        for batch in batches:
            store.upsert("a__m__v1", *batch)
    for batch in batches:
        store.upsert("a__m__v2", *batch)
    for name in ("a__m__v1", "a__m__v2"):
        store.seal(name, {})
    ids = [pid for batch in batches for pid in batch[0]]
    got = store.retrieve("a__m__v1", ids, with_dense=True, with_sparse=True)
    want = store.retrieve("a__m__v2", ids, with_dense=True, with_sparse=True)
    assert len(got) == len(want) == 90 == store.count("a__m__v1")
    for g, w in zip(sorted(got, key=lambda r: r.id), sorted(want, key=lambda r: r.id), strict=True):
        assert g.id == w.id and dict(g.payload) == dict(w.payload)
        assert g.dense is not None and w.dense is not None and np.array_equal(g.dense, w.dense)
        assert g.sparse == w.sparse
    store.close()


def test_an_engine_error_in_the_process_is_raised_here_and_ends_it(tmp_path: Path) -> None:
    """A vector of the wrong size fails inside the writer process: the caller gets the engine's
    message as StoreUnavailable, and the process is gone."""
    store = EdgeStore(tmp_path / "edge")
    _create(store, "a__m__v1")
    ids, _, sparse, payloads = _batch(0, 3)
    with (
        pytest.raises(StoreUnavailable, match="the Qdrant engine failed writing") as raised,
        store.bulk_write("a__m__v1"),
    ):
        writer = store._writers[store._own("a__m__v1")]
        store.upsert("a__m__v1", ids, np.ones((3, DIM + 1), np.float32), sparse, payloads)
        for _ in range(100):  # the error is raised by an upsert after it, or by close
            time.sleep(0.02)
            store.upsert("a__m__v1", *_batch(3, 3))
    assert "dim" in str(raised.value).lower() or "vector" in str(raised.value).lower()
    assert not writer._process.is_alive()
    store.delete("a__m__v1")
    store.close()


def test_a_writer_process_that_dies_is_a_clear_error(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path / "edge")
    _create(store, "a__m__v1")
    with (
        pytest.raises(StoreUnavailable, match=r"exited \(code -9\) before the build"),
        store.bulk_write("a__m__v1"),
    ):
        writer = store._writers[store._own("a__m__v1")]
        store.upsert("a__m__v1", *_batch(0, 3))
        assert writer._process.pid is not None
        os.kill(writer._process.pid, signal.SIGKILL)
        writer._process.join(10)
        store.upsert("a__m__v1", *_batch(3, 3))
    store.close()


def test_an_exception_in_the_build_kills_the_process_unflushed(tmp_path: Path) -> None:
    store = EdgeStore(tmp_path / "edge")
    _create(store, "a__m__v1")
    with pytest.raises(KeyboardInterrupt), store.bulk_write("a__m__v1"):
        writer = store._writers[store._own("a__m__v1")]
        store.upsert("a__m__v1", *_batch(0, 3))
        raise KeyboardInterrupt
    assert not writer._process.is_alive() and writer._process.exitcode == -signal.SIGKILL
    assert not store._writers
    store.delete("a__m__v1")
    assert store.collection_names() == []
    store.close()


_ORPHAN = """
import sys, time
from pathlib import Path
from rag_retriever.models.bm25 import BM25Model
from rag_retriever.store import DENSE, EdgeStore, StageQuery
from rag_retriever.store.edge import seal_shard
from rag_retriever.store.edge_writer import ShardWriter, seal_apart
from rag_retriever.store.record import bare_record
store = EdgeStore(Path(sys.argv[1]))
store.create("a__m__v1", 8, bare_record("a__m__v1", dim=8, bm25=BM25Model.build([["a"]]).stats))
with store.bulk_write("a__m__v1"):
    print(store._writers[store._own("a__m__v1")]._process.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_process_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the build's process: its writer sees the pipe close and exits."""
    assert_helper_ends_with_parent(_ORPHAN, str(tmp_path / "edge"))


def assert_helper_ends_with_parent(script: str, *args: str) -> None:
    """Run `script` (it prints its helper's pid, then waits), SIGKILL it: the helper must end."""
    proc = _run_script(script, *args)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert _running(child)
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60  # a hang guard, not a speed check
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child)
    finally:
        if proc.poll() is None:
            proc.kill()


def _run_script(script: str, *args: str) -> subprocess.Popen[str]:
    """`python -c script args` from the repository root, its stdout piped."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is reaped by init, maybe later)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_shard_the_process_cannot_open_is_the_engines_message(tmp_path: Path) -> None:
    """The shard's directory is gone before the process opens it."""
    writer = ShardWriter(str(tmp_path / "no-such-shard"))
    with pytest.raises(StoreUnavailable, match=r"the Qdrant engine failed writing .*no-such-shard"):
        writer.close()
    assert not writer._process.is_alive()


def _written_shard(tmp_path: Path, points: int = 30) -> tuple[EdgeStore, str]:
    """A store and the directory of a version's shard, written, flushed and closed, unsealed."""
    store = EdgeStore(tmp_path / "edge")
    _create(store, "a__m__v1")
    store.upsert("a__m__v1", *_batch(0, points))
    own = store._own("a__m__v1")
    store._close_shard(own, flush=True)
    return store, str(store._segment_dir(own))


def _pid_and_count(shard: Any) -> int:  # run in the sealer process
    return os.getpid() * 1000 + seal_shard(shard, {"metadata.n": "integer"})


def _fails(shard: Any) -> int:
    raise ValueError("no room on the device")


def _dies(shard: Any) -> int:
    os._exit(3)


def _waits(shard: Any) -> int:
    print(os.getpid(), flush=True)
    time.sleep(600)
    return 0


def test_a_seal_apart_runs_in_another_process_and_the_shard_serves_after_it(
    tmp_path: Path,
) -> None:
    store, directory = _written_shard(tmp_path)
    got = seal_apart(directory, _pid_and_count)
    assert got % 1000 == 30 and got // 1000 not in (0, os.getpid())
    assert seal_apart(directory, partial(seal_shard, indexes={})) == 30  # sealed twice: no harm
    assert store.count("a__m__v1") == 30
    ids, dense, _, _ = _batch(0, 30)
    (hits,) = store.search("a__m__v1", [StageQuery(DENSE, dense[4], 1)])
    assert hits[0][0] == ids[4]
    store.close()


def test_an_error_in_the_sealer_is_raised_here_with_its_message(tmp_path: Path) -> None:
    store, directory = _written_shard(tmp_path)
    with pytest.raises(
        StoreUnavailable, match=r"failed sealing .*: ValueError: no room on the device"
    ):
        seal_apart(directory, _fails)
    with pytest.raises(StoreUnavailable, match=r"sealer of .* exited \(code 3\) before the seal"):
        seal_apart(directory, _dies)
    store.close()


_SEALING = """
import sys
from tests.test_edge_writer import _waits
from rag_retriever.store.edge_writer import seal_apart
seal_apart(sys.argv[1], _waits)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_sealer_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the build's process during a seal: the sealer gets the parent-death signal."""
    store, directory = _written_shard(tmp_path, points=3)
    assert_helper_ends_with_parent(_SEALING, directory)
    store.close()


_STOPPED_SEALING = """
import signal, sys
from rag_retriever.cli import Stopped, _stop_on_sigterm
from rag_retriever.store.edge_writer import seal_apart
from tests.test_edge_writer import _waits
signal.signal(signal.SIGTERM, _stop_on_sigterm)
try:
    seal_apart(sys.argv[1], _waits)
except Stopped:
    print("stopped", flush=True)
    sys.exit(143)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sigterm_during_a_seal_apart_stops_it_at_once_and_ends_the_sealer(tmp_path: Path) -> None:
    """The CLI's SIGTERM (`docker stop`) unwinds while a shard is sealed apart: the parent waits
    on a pipe, not inside the engine's call (a seal here holds the interpreter lock until its
    optimize ends, minutes at 1M chunks), and the sealer is killed."""
    store, directory = _written_shard(tmp_path, points=3)
    proc = _run_script(_STOPPED_SEALING, directory)
    try:
        assert proc.stdout is not None
        sealer = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)  # a hang guard: the sealer sleeps 600 s
        assert proc.returncode == 143 and out.strip() == "stopped"
        assert not _running(sealer)
    finally:
        if proc.poll() is None:
            proc.kill()
    store.close()
