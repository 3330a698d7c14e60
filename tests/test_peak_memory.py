"""The benchmarks' memory sampler (bench/peak_memory.py) reads a build's peak from a process of
its own: it sees memory held only while the measured process holds the interpreter lock, as a
seal's optimize does, and counts the process's descendants but not itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from bench.peak_memory import PeakSampler, status_mb, tree_mb

HELD_MB = 200
# A child that says it started, then holds HELD_MB of private memory for a moment and exits.
_CHILD = f"""
import time
print("started", flush=True)
time.sleep(0.3)
held = b"x" * ({HELD_MB} << 20)
time.sleep(0.5)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_child_holding_memory_while_this_process_holds_the_lock_is_seen() -> None:
    """Oracle: the child's 200 MB exist only while this process runs one C call that keeps the
    interpreter lock (builtin sum over a range, seconds): a sampling thread here would not run
    then (one runs beside the sampler here, as bench_engine's did)."""
    before = tree_mb(["RssAnon"], os.getpid())["RssAnon"]  # this process and any it runs
    sampler = PeakSampler("RssAnon")
    thread_peak = [0.0]
    stop = threading.Event()

    def thread_sampler() -> None:  # what bench_engine used before: a thread beside the work
        while not stop.wait(0.1):
            thread_peak[0] = max(thread_peak[0], tree_mb(["RssAnon"], os.getpid())["RssAnon"])

    threading.Thread(target=thread_sampler, daemon=True).start()
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "started"
    sum(range(400_000_000))  # the lock held for seconds: the child allocates, then exits
    ended_in_time = child.poll() is not None
    child.wait(timeout=60)
    stop.set()
    peaks = sampler.stop()
    if not ended_in_time:
        pytest.skip("the child outlived the lock's hold (a very slow or loaded machine)")
    assert peaks["RssAnon"] >= before + 0.9 * HELD_MB
    assert thread_peak[0] < before + 0.5 * HELD_MB  # the thread saw none of it


# A child that starts a grandchild, prints the grandchild's pid once it runs, and waits.
_PARENT = """
import subprocess, sys, time
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True,
)
grandchild.stdout.readline()
print(grandchild.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_tree_sums_descendants_and_leaves_out_the_one_asked() -> None:
    """Oracle: each process's own /proc status. A tree rooted at a child of this test, so that
    whatever else this process runs does not count."""
    child = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = 0
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        own = status_mb(child.pid)["VmRSS"]
        below = status_mb(grandchild)["VmRSS"]
        assert tree_mb(["VmRSS"], child.pid)["VmRSS"] == pytest.approx(own + below, abs=2.0)
        assert tree_mb(["VmRSS"], child.pid, leave_out=child.pid)["VmRSS"] == pytest.approx(
            below, abs=2.0
        )
        assert tree_mb(["VmRSS"], grandchild, leave_out=grandchild)["VmRSS"] == 0.0
    finally:
        if grandchild:
            os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x", "0.1", "RssAnon"], "argument pid: takes a positive count (got 'x')"),
        (["1", "0", "RssAnon"], "every_s must be more than 0 (got 0.0)"),
        (["1", "0.1"], "the following arguments are required: fields"),
        (["999999999", "0.1", "RssAnon"], "no process 999999999 to sample"),
    ],
)
def test_the_sampler_command_refuses_bad_arguments(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peak_memory", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""
