"""Helper processes: started by spawn without the parent's main module, deaf to Ctrl-C, ended
with their parent. Used by the chunking workers (rag_retriever/ingest/parallel_chunking.py), the
shard writer (rag_retriever/store/edge_writer.py) and the HTTP service's writer process
(`CallProcess`, rag_retriever/service/writes.py).

Example:
    >>> with spawning():                                             # doctest: +SKIP
    ...     process = multiprocessing.get_context("spawn").Process(target=work)
    ...     process.start()
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar

A = TypeVar("A")
R = TypeVar("R")
# How long close() waits for a helper to end before it is killed.
END_TIMEOUT_S = 10.0

# prctl(2): PR_SET_PDEATHSIG asks the kernel for a signal when the parent process exits.
_PR_SET_PDEATHSIG = 1


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Around starting spawned processes. They start with SIGINT blocked (a child inherits the
    mask): Ctrl-C, which reaches the whole process group, interrupts the parent alone, even
    while a child is still starting. And they start with the main module's name and path hidden,
    as for `python -c`: a spawned child runs the parent's main module again before its work (the
    CLI, a benchmark script: torch and transformers, seconds per process; measured on 16 cores, 8
    chunking workers ran 6x slower), and no helper needs it."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    main = sys.modules["__main__"]
    saved = {name: getattr(main, name) for name in ("__spec__", "__file__") if hasattr(main, name)}
    main.__spec__ = None
    if hasattr(main, "__file__"):
        del main.__file__
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def become_helper(parent: int, *, end_with_parent: bool = True) -> None:
    """First thing in a helper process: ignore Ctrl-C (the parent stops it) and, with
    `end_with_parent`, get SIGTERM when the parent exits (a SIGKILL of the parent included);
    exit at once if it already has. The kernel sends that signal when the parent's *thread* that
    started the helper ends: a helper started from a short-lived thread passes False and ends
    on its own (the shard writer stops when its pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent:  # the parent died before this ran
        os._exit(1)
    if end_with_parent and sys.platform == "linux":
        # not glibc: the parent's terminate alone stops the helper
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def start_piped(
    target: Callable[[Any, Connection, int], None], argument: Any, label: str
) -> tuple[BaseProcess, Connection]:
    """A spawned daemon process running `target(argument, its end of a pipe, this pid)`; returns
    it and this end of the pipe. Spawn, not fork: the parent runs threads."""
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    with spawning():
        process = context.Process(
            target=target,
            args=(argument, child, os.getpid()),
            name=f"rag-retriever {label}",
            daemon=True,
        )
        process.start()
    child.close()
    return process, conn


class HelperFailed(RuntimeError):
    """A helper process died, or its function raised an exception that does not pickle (its
    traceback is the message)."""


class CallProcess(Generic[A, R]):
    """`function` (picklable: sent once) called in a process of its own, one call at a time: the
    caller's thread waits on a pipe without the interpreter lock while the helper works. An
    exception the function raises is raised here again, as itself when it pickles (so a
    `RagError` keeps its type and HTTP status). The helper stops when its pipe closes (so with
    its parent, also one killed), on `close()`, or at once on `kill()`."""

    def __init__(self, function: Callable[[A], R], label: str) -> None:
        self.label = label
        self._process, self._conn = start_piped(_call_loop, function, label)

    @property
    def pid(self) -> int:
        return int(self._process.pid or 0)

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def __call__(self, argument: A) -> R:
        try:
            self._conn.send(argument)
            ok, result = self._conn.recv()
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._process.join(END_TIMEOUT_S)
            raise HelperFailed(
                f"the {self.label} process exited (code {self._process.exitcode})"
            ) from None
        if ok:
            return result
        if isinstance(result, BaseException):
            raise result
        raise HelperFailed(f"the {self.label} process failed: {result}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()  # the helper reads the end of its pipe and returns
        self._process.join(END_TIMEOUT_S)
        if self._process.is_alive():
            self.kill()

    def kill(self) -> None:
        self._process.kill()
        self._process.join(END_TIMEOUT_S)
        with contextlib.suppress(OSError):
            self._conn.close()


def _call_loop(function: Callable[[Any], Any], conn: Connection, parent: int) -> None:
    # started by any thread of the parent (the kernel's parent-death signal follows the thread):
    # the pipe's end stops it instead
    become_helper(parent, end_with_parent=False)
    while True:
        try:
            argument = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[bool, Any] = (True, function(argument))
        except Exception as exc:
            try:
                pickle.loads(pickle.dumps(exc))
                reply = (False, exc)
            except Exception:
                reply = (False, traceback.format_exc(limit=-3))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
