"""Progress of a long stage: a bar on a terminal, plain periodic lines everywhere else.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> bar = progress(total=3, desc="embedding", unit="text", stream=out, tty=False)
    >>> bar.update(3)
    >>> bar.close()
    >>> out.getvalue().startswith("embedding: 3/3 text (100%) in ")
    True

On a terminal (the stream's `isatty()`) or in a Jupyter kernel this is tqdm's bar, as before.
Off a terminal (CI, `docker logs`, a pipe, a file) a bar's carriage returns and cursor-up
escapes stay in the log as they are, stacked bars interleave and each closes with a second
final line; there a stage prints a plain line at most every LINE_EVERY_S seconds, or at a
tenth of its total (but never closer than MIN_GAP_S), and one line when it closes. A stage
that did nothing prints nothing.

Does not do: estimates of the time left off a terminal, nested or positioned lines off a
terminal (each stage's lines name the stage instead), or progress of anything but counts.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

__all__ = ["LINE_EVERY_S", "MIN_GAP_S", "PlainProgress", "Progress", "is_terminal", "progress"]

# Off a terminal: a line at least every 30 s while a stage runs (a CI job that prints nothing
# for minutes looks hung, and some CI systems kill a job after 10 silent minutes), and at each
# tenth of a known total, but not more often than every 5 s, so that a stage of seconds prints
# its closing line only and a 10-minute ingest about 20 lines per stage.
LINE_EVERY_S = 30.0
MIN_GAP_S = 5.0
STEPS = 10  # a line at each tenth of the total


class Progress(Protocol):
    """What the stages call: tqdm's own methods, so a tqdm bar is one."""

    def update(self, n: int = 1) -> Any: ...

    def set_postfix(self, **values: Any) -> Any: ...

    def close(self) -> Any: ...


class _Off:
    """Progress not asked for: every call does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


class PlainProgress:
    """Plain lines `desc: done/total unit (pct%) in 12.0 s, 40.1 unit/s` on `stream`, from any
    thread: at most every LINE_EVERY_S, at each tenth of `total` (MIN_GAP_S apart), and at
    `close` (once, when it has something new to say)."""

    def __init__(
        self,
        *,
        total: int | None,
        desc: str,
        unit: str,
        stream: TextIO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self._stream, self._clock = stream, clock
        self._lock = threading.Lock()
        self.n = 0
        self._postfix = ""
        self._started = self._last = clock()
        self._step = 0  # the tenths of the total already reported
        self._shown = 0  # the count on the last line
        self._closed = False

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            now = self._clock()
            step = self._step_of(self.n)
            since = now - self._last
            if self.total is not None and self.n >= self.total:
                return  # the closing line says it
            if since >= LINE_EVERY_S or (step > self._step and since >= MIN_GAP_S):
                self._step, self._last = step, now
                self._write(now)

    def set_postfix(self, **values: Any) -> None:
        with self._lock:
            self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.n != self._shown:  # nothing new since the last line: it said it
                self._write(self._clock())

    def _step_of(self, n: int) -> int:
        return n * STEPS // self.total if self.total else 0

    def _write(self, now: float) -> None:
        self._shown = self.n
        elapsed = now - self._started
        done = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        pct = f" ({100 * self.n // self.total}%)" if self.total else ""
        rate = f", {self.n / elapsed:.1f} {self.unit}/s" if elapsed > 0 else ""
        extra = f", {self._postfix}" if self._postfix else ""
        print(
            f"{self.desc}: {done} {self.unit}{pct} in {elapsed:.1f} s{rate}{extra}",
            file=self._stream,
            flush=True,
        )


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (where a bar redraws in place)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:  # a closed stream
        return False


def _in_notebook() -> bool:
    """A Jupyter kernel, where tqdm.auto draws a widget (its stderr is no terminal)."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress(
    *,
    total: int | None,
    desc: str,
    unit: str,
    enabled: bool = True,
    position: int = 0,
    stream: TextIO | None = None,
    tty: bool | None = None,
) -> Progress:
    """The progress of one stage: nothing when not `enabled`; tqdm's bar (at `position`, for
    stages shown together) when `stream` (stderr by default) is a terminal or `tty` is True;
    plain periodic lines otherwise."""
    if not enabled:
        return _Off()
    out = stream if stream is not None else sys.stderr
    if tty if tty is not None else (is_terminal(out) or _in_notebook()):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, position=position, file=out)
    return PlainProgress(total=total, desc=desc, unit=unit, stream=out)
