"""Helper processes: started by spawn without the parent's main module, deaf to Ctrl-C, ended
with their parent. Used by the chunking workers (rag_retriever/ingest/parallel_chunking.py) and
the shard writer (rag_retriever/store/edge_writer.py).

Example:
    >>> with spawning():                                             # doctest: +SKIP
    ...     process = multiprocessing.get_context("spawn").Process(target=work)
    ...     process.start()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

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
