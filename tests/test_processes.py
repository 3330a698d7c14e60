"""Helper processes (rag_retriever/processes.py): a call in a process of its own returns what the
function returns here, its errors and its death are clear errors, and it ends with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_retriever.models.encoder import Encoder, Tokens, tokenize
from rag_retriever.processes import CallProcess, HelperFailed
from tests.test_edge_writer import _running

ROOT = Path(__file__).resolve().parents[1]


def _fail_on_boom(texts: list[str]) -> int:
    if "boom" in texts:
        raise ValueError("boom (injected)")
    return len(texts)


@pytest.fixture(scope="module")
def passage_process(tiny_encoder: Encoder) -> Iterator[CallProcess[Sequence[str], Tokens]]:
    helper = CallProcess(tiny_encoder.passage_tokenizer, "tokenizer")
    yield helper
    helper.close()


@settings(max_examples=25, deadline=None)  # a pipe round trip per example
@given(st.lists(st.text(max_size=300), min_size=1, max_size=6))
def test_tokens_made_in_the_helper_equal_the_encoders(
    passage_process: CallProcess[Sequence[str], Tokens], tiny_encoder: Encoder, texts: list[str]
) -> None:
    """Oracle: `prepare_passages` here (lengths, truncation, ids and types, padding side)."""
    assert passage_process(texts) == tiny_encoder.prepare_passages(texts)


def test_the_passage_tokenizer_is_prepare_passages(tiny_encoder: Encoder) -> None:
    texts = ["a short one", "word " * 400]  # the second is over the model window
    want = tokenize(tiny_encoder.tokenizer, texts, tiny_encoder.max_seq_length)
    assert tiny_encoder.passage_tokenizer(texts) == want
    assert want.truncated == 1


def test_an_error_in_the_helper_is_raised_with_its_traceback_and_the_helper_goes_on() -> None:
    helper: CallProcess[list[str], int] = CallProcess(_fail_on_boom, "test helper")
    try:
        assert helper(["a", "b"]) == 2
        with pytest.raises(
            HelperFailed, match=r"test helper process failed(.|\n)*boom \(injected\)"
        ):
            helper(["boom"])
        assert helper(["c"]) == 1
    finally:
        helper.close()
    assert not helper._process.is_alive() and helper._process.exitcode == 0


def test_a_helper_that_died_is_a_clear_error() -> None:
    helper: CallProcess[list[str], int] = CallProcess(_fail_on_boom, "test helper")
    assert helper(["a"]) == 1
    assert helper._process.pid is not None
    os.kill(helper._process.pid, signal.SIGKILL)
    helper._process.join(10)
    with pytest.raises(HelperFailed, match=r"test helper process exited \(code -9\)"):
        helper(["b"])
    helper.close()


_ORPHAN = """
import time
from rag_retriever.processes import CallProcess
helper = CallProcess(len, "orphan")
assert helper([1, 2]) == 2
print(helper._process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_helper_ends_when_its_parent_is_killed() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
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
