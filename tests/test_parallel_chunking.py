"""Chunking in worker processes: the serial chunker is the oracle (ids, order, offsets, token
counts identical); workers stop with the command and never outlive it."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_retriever.ingest.chunking import Chunker, ChunkingConfig
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.parallel_chunking import chunk_documents
from rag_retriever.models.profiles import resolve_model
from rag_retriever.models.token_counter import TokenizerCounter
from rag_retriever.records import Chunk, Document
from tests.conftest import shared_data
from tests.test_chunking import CFG, chars, document_text
from tests.word_counters import words

ROOT = Path(__file__).resolve().parents[1]


def serial(docs: Sequence[Document], counter, config: ChunkingConfig) -> list[list[Chunk]]:
    chunker = Chunker(counter, config)
    return [chunker.chunk(doc) for doc in docs]


documents = st.lists(
    st.tuples(st.text(st.characters(codec="utf-8"), max_size=12), document_text),
    min_size=12,
    max_size=30,
).map(lambda rows: [Document(id=f"d{i}", title=t, text=x) for i, (t, x) in enumerate(rows)])


@settings(max_examples=60)
@given(docs=documents, counter=st.sampled_from([words, chars]))
def test_batched_counting_gives_the_serial_chunks(docs: list[Document], counter) -> None:
    """chunk_many counts tokens for many documents at once; `chars` is not additive, so some
    documents fail the window check and take the serial path's retries."""
    assert Chunker(counter, CFG).chunk_many(docs) == serial(docs, counter, CFG)


@pytest.mark.slow
@settings(max_examples=4)
@given(docs=documents)
def test_workers_give_the_serial_chunks(docs: list[Document]) -> None:
    """Each example starts a pool (4 slices of at most 3 documents, 2 workers)."""
    assert chunk_documents(docs, words, CFG, workers=2, docs_per_task=3) == serial(docs, words, CFG)


def test_few_documents_are_chunked_in_this_process() -> None:
    docs = [Document(id="a", title="T", text="One two. Three four.\n\nFive.")]
    assert chunk_documents(docs, lambda t: [len(x) for x in t], CFG) == serial(
        docs, lambda t: [len(x) for x in t], CFG
    )  # a lambda cannot be pickled: this proves no worker was started
    with pytest.raises(ValueError, match="positive"):
        chunk_documents(docs, words, CFG, workers=0)


def minilm_counter() -> TokenizerCounter:
    import transformers

    source = resolve_model("all-MiniLM-L6-v2").source
    return TokenizerCounter(transformers.AutoTokenizer.from_pretrained(source))


@pytest.mark.data
@pytest.mark.slow
@pytest.mark.parametrize("name", ["scifact", "squad_v11_dev"])
def test_real_corpora_chunk_the_same_in_workers(name: str) -> None:
    docs = list(load_documents(shared_data(name, "docs.jsonl")).documents[:600])
    counter = minilm_counter()
    config = ChunkingConfig(chunk_tokens=200, overlap_tokens=48, max_seq_length=256)
    ours = chunk_documents(docs, counter, config, workers=2, docs_per_task=16)
    assert ours == serial(docs, counter, config)
    for doc, chunks in zip(docs, ours, strict=True):
        assert all(doc.text[c.start : c.end] == c.text for c in chunks)


@pytest.mark.data
def test_the_token_counter_counts_as_the_tokenizer_and_pickles() -> None:
    text = shared_data("scifact", "docs.jsonl").read_text(encoding="utf-8")[:200_000]
    lines = [p for p in text.replace("\\n", "\n").split("\n") if p][:2000]
    pieces = [*lines, "", " ", "naïve 日本"]
    counter = minilm_counter()
    expected = [
        len(ids)
        for ids in counter.tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]
    ]
    assert counter(pieces) == expected
    assert pickle.loads(pickle.dumps(counter))(pieces) == expected


# Chunks a corpus that takes minutes in 2 workers; prints their pids once they run. SIGTERM
# raises like the CLI's handler (rag_retriever.cli._stop_on_sigterm).
_SCRIPT = """
import multiprocessing, signal, sys, threading, time
from rag_retriever.ingest.parallel_chunking import chunk_documents
from rag_retriever.records import Chunk, Document
from tests.test_chunking import CFG
from tests.word_counters import SlowWords

def stop(signum, frame):
    raise SystemExit(143)

def announce():
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.05)
    time.sleep(0.5)  # the workers are chunking now
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)

signal.signal(signal.SIGTERM, stop)
threading.Thread(target=announce, daemon=True).start()
docs = [Document(id=str(i), title="T", text="Alpha bravo. Charlie delta. " * 40) for i in range(5000)]
chunk_documents(docs, SlowWords(), CFG, workers=2, docs_per_task=4)
"""


def start_with_workers(script: str, *args: str) -> tuple[subprocess.Popen[str], list[int]]:
    """`python -c script args` in a session of its own, and the pids of the 2 worker processes
    it prints once they run."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    workers = [int(p) for p in proc.stdout.readline().split()]
    if len(workers) != 2:
        proc.kill()
        raise AssertionError(proc.stderr.read() if proc.stderr else "no workers announced")
    return proc, workers


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c", "sigkill"])
def test_workers_stop_with_the_command(how: str) -> None:
    """SIGTERM to the command, Ctrl-C (SIGINT to its process group), or SIGKILL: the command
    ends (the corpus would take minutes) with the handler's exit status, and no worker outlives
    it."""
    proc, workers = start_with_workers(_SCRIPT)
    try:
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.kill()
        # It ends long before the corpus is chunked; these waits only keep a hung process from
        # hanging the suite (how fast it stops is bench/bench_stop.py's figure).
        proc.wait(timeout=300)
        assert _wait_gone(workers, 300.0) == []
        if how == "sigterm":
            assert proc.returncode == 143
        elif how == "ctrl-c":
            assert proc.returncode == -signal.SIGINT  # Python's exit on KeyboardInterrupt
            assert proc.stderr is not None
            assert proc.stderr.read().count("KeyboardInterrupt") == 1
    finally:
        if proc.poll() is None:
            proc.kill()
