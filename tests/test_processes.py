"""Helper processes (rag_retriever/processes.py): a call in a process of its own returns what the
function returns here, raises what it raises, says so when the process died, and the process ends
with its parent."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from rag_retriever.errors import UpdateRefused
from rag_retriever.processes import CallProcess, HelperFailed
from tests.test_edge_writer import assert_helper_ends_with_parent

ROOT = Path(__file__).resolve().parents[1]


class Unpicklable(Exception):
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("not picklable")


def _work(texts: list[str]) -> int:
    if "refuse" in texts:
        raise UpdateRefused("refused (injected)")
    if "odd" in texts:
        raise Unpicklable("odd (injected)")
    return len(texts)


def test_a_call_returns_and_raises_as_here() -> None:
    helper: CallProcess[list[str], int] = CallProcess(_work, "test helper")
    try:
        assert helper(["a", "b"]) == 2
        with pytest.raises(UpdateRefused, match=r"refused \(injected\)"):  # its own type
            helper(["refuse"])
        with pytest.raises(HelperFailed, match=r"test helper process failed(.|\n)*odd"):
            helper(["odd"])
        assert helper(["c"]) == 1  # it goes on after an error
        assert helper._process.pid != os.getpid()
    finally:
        helper.close()
    assert not helper._process.is_alive() and helper._process.exitcode == 0


def test_a_helper_that_died_is_a_clear_error() -> None:
    helper: CallProcess[list[str], int] = CallProcess(_work, "test helper")
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
    assert_helper_ends_with_parent(_ORPHAN)
