"""Every CPU forward pass runs on one thread, whichever thread asks (models/device.py says why:
one OpenMP team instead of one per asking thread). Oracles: the thread a forward hook sees,
and plain values through `ComputeThread.run`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_retriever.models.device import (
    BACKGROUND,
    COMPUTE,
    SMALL_PASS_TOKENS,
    URGENT,
    ComputeThread,
    threads_for,
    training_thread,
)
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.reranker import CrossEncoderReranker


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10  # a hang guard, not a time limit
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _threads_seen(model: object) -> set[str]:
    seen: set[str] = set()
    model.register_forward_hook(  # type: ignore[attr-defined]
        lambda *_: seen.add(threading.current_thread().name)
    )
    return seen


def test_passes_asked_from_many_threads_run_on_one(
    tiny_encoder_dir: Path, tiny_reranker_dir: Path
) -> None:
    encoder = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32", batch_size=2)
    reranker = CrossEncoderReranker.load(tiny_reranker_dir, device="cpu", dtype="fp32")
    encoder_seen, reranker_seen = _threads_seen(encoder.model), _threads_seen(reranker.model)
    expected = encoder.encode_queries(["apples and pears"] * 5).vectors
    results: list[np.ndarray] = []

    def ask() -> None:
        results.append(encoder.encode_queries(["apples and pears"] * 5).vectors)
        reranker.score("apples", ["pears", "apples grow on trees"])

    askers = [threading.Thread(target=ask, name=f"asker-{i}") for i in range(4)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(60)
    assert len(results) == 4 and all(np.array_equal(r, expected) for r in results)
    assert encoder_seen == reranker_seen == {"rag-compute"}


def test_an_error_is_raised_in_the_caller_and_the_thread_goes_on() -> None:
    compute = ComputeThread()
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: 2) == 2
    assert compute.started == 1


def test_a_pass_asked_from_the_compute_thread_runs_there() -> None:
    """No deadlock: the thread does not wait on itself."""
    compute = ComputeThread()
    outer = threading.Thread(
        target=lambda: results.append(compute.run(lambda: compute.run(lambda: 5)))
    )
    results: list[int] = []
    outer.start()
    outer.join(10)  # a hang guard, not a time limit
    assert results == [5]


def test_the_thread_ends_when_idle_and_a_later_pass_starts_another() -> None:
    compute = ComputeThread(idle_s=0.05)
    assert compute.run(lambda: threading.current_thread().name) == "rag-compute"
    deadline = time.monotonic() + 10  # a hang guard, not a time limit
    while any(t.name == "rag-compute" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the idle compute thread did not end"
        time.sleep(0.02)
    assert compute.run(lambda: 3) == 3
    assert compute.started == 2


def test_a_query_pass_goes_before_queued_background_passes() -> None:
    """While one pass runs, two background passes and then an urgent one queue: the urgent one
    runs next, the background ones after it in their order."""
    compute = ComputeThread()
    running, release = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        running.set()
        release.wait(10)

    def ask(name: str, priority: int) -> threading.Thread:
        t = threading.Thread(target=lambda: compute.run(lambda: order.append(name), priority))
        t.start()
        return t

    blocker = threading.Thread(target=lambda: compute.run(first, BACKGROUND))
    blocker.start()
    assert running.wait(10)
    askers = [ask("edit-1", BACKGROUND), ask("edit-2", BACKGROUND)]
    _until(lambda: compute._tasks.qsize() == 2)  # both queued before the query
    askers.append(ask("query", URGENT))
    _until(lambda: compute._tasks.qsize() == 3)
    release.set()
    for t in [blocker, *askers]:
        t.join(10)
    assert order == ["query", "edit-1", "edit-2"]


def test_stop_lets_the_running_pass_finish_cancels_the_waiting_ones_and_refuses_more() -> None:
    compute = ComputeThread(idle_s=60)  # stop, not the idle timeout, must end the thread
    running, release = threading.Event(), threading.Event()
    done: list[str] = []

    def first() -> None:
        running.set()
        release.wait(10)
        done.append("first")

    outcomes: dict[str, BaseException | None] = {}

    def ask(name: str, fn: Callable[[], None]) -> threading.Thread:
        def target() -> None:
            try:
                compute.run(fn, BACKGROUND)
                outcomes[name] = None
            except BaseException as exc:  # the waiting pass's cancellation, seen by its caller
                outcomes[name] = exc

        t = threading.Thread(target=target)
        t.start()
        return t

    askers = [ask("first", first)]
    assert running.wait(10)
    thread = compute._thread
    assert thread is not None
    askers.append(ask("waiting", lambda: done.append("waiting")))
    _until(lambda: compute._tasks.qsize() == 1)
    stopper = threading.Thread(target=compute.stop)
    stopper.start()
    _until(lambda: compute._stopping)
    release.set()
    for t in [stopper, *askers]:
        t.join(10)
    assert done == ["first"] and outcomes["first"] is None
    assert type(outcomes["waiting"]).__name__ == "CancelledError"
    assert not thread.is_alive() and compute._thread is None
    with pytest.raises(RuntimeError, match="the process is stopping"):
        compute.run(lambda: 1)


# A process whose main thread stops waiting for a pass (Ctrl-C) and exits at once. A pass still
# running while the interpreter tears down aborted the process (exit 134, "terminate called
# without an active exception": the thread, back from torch, is ended inside a C++ destructor),
# seen on `update` stopped by SIGTERM. The exit now waits for it: its last line is written.
_STOPPED_WHILE_A_PASS_RUNS = """
import signal, sys, threading, time
from pathlib import Path
from rag_retriever.models.device import COMPUTE

def long_pass():
    time.sleep(1.5)
    Path(sys.argv[1]).write_text("finished")

main = threading.main_thread().ident  # at the main thread, whose wait it must interrupt
threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
try:
    COMPUTE.run(long_pass)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_process_stopped_while_a_pass_runs_exits_after_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    mark = tmp_path / "finished"
    done = subprocess.run(
        [sys.executable, "-c", _STOPPED_WHILE_A_PASS_RUNS, str(mark)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert mark.read_text() == "finished"


def test_passes_asked_within_inline_run_in_the_asking_thread(tiny_encoder_dir: Path) -> None:
    """A trainer's thread (training_thread): its evaluations run where its steps do."""
    encoder = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32", batch_size=2)
    seen = _threads_seen(encoder.model)

    @training_thread
    def train() -> None:
        encoder.encode_queries(["apples"] * 3)

    train()
    assert seen == {threading.current_thread().name}
    seen.clear()
    encoder.encode_queries(["apples"])  # outside: the compute thread again
    assert seen == {"rag-compute"}


def test_a_small_pass_runs_on_one_intra_op_thread_and_a_large_one_on_the_setting(
    tiny_encoder_dir: Path, tiny_reranker_dir: Path
) -> None:
    """SMALL_PASS_TOKENS (device.py): a query's pass on one OpenMP thread, a batch of passages
    on the process's setting; the setting is the same after either. The oracle: the thread
    count a forward hook sees."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the rule only narrows a setting above one
    try:
        encoder = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32", batch_size=64)
        reranker = CrossEncoderReranker.load(tiny_reranker_dir, device="cpu", dtype="fp32")
        seen: list[int] = []
        for model in (encoder.model, reranker.model):
            model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        encoder.encode_queries(["apples and pears"])
        reranker.score("apples", ["pears"])
        assert seen == [1, 1]
        seen.clear()
        long = " ".join(["apples and pears"] * 20)  # 60 tokens a text, 64 texts in one pass
        assert SMALL_PASS_TOKENS < 64 * 60
        encoder.encode_passages([long] * 64)
        reranker.score("apples", [long] * 32)
        assert seen == [2, 2]
        assert torch.get_num_threads() == 2
        assert COMPUTE.run(torch.get_num_threads) == 2  # put back on the compute thread too
    finally:
        torch.set_num_threads(threads)


def test_threads_for_leaves_a_single_thread_setting_and_unknown_sizes_alone() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with threads_for(None):
            assert torch.get_num_threads() == 2
        with threads_for(SMALL_PASS_TOKENS + 1):
            assert torch.get_num_threads() == 2
        with pytest.raises(ZeroDivisionError), threads_for(SMALL_PASS_TOKENS):
            assert torch.get_num_threads() == 1
            _ = 1 / 0
        assert torch.get_num_threads() == 2  # put back after an error too
    finally:
        torch.set_num_threads(threads)


def test_a_models_weights_are_cast_and_packed_on_the_compute_thread(
    tiny_encoder_dir: Path, tiny_reranker_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cast's parallel kernels on the loading thread gave that thread an OpenMP team of its
    own, and every pass on the compute thread then ran 1.6x slower (device.for_inference)."""
    from rag_retriever.models import device

    seen: list[str] = []
    prepare = device.bf16_linear_layers

    def recorded(model: torch.nn.Module) -> int:
        seen.append(threading.current_thread().name)
        return prepare(model)

    monkeypatch.setattr(device, "bf16_linear_layers", recorded)
    Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="bf16")
    CrossEncoderReranker.load(tiny_reranker_dir, device="cpu", dtype="bf16")
    assert seen == ["rag-compute", "rag-compute"]
