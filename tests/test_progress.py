"""Progress: a bar on a terminal only; off a terminal, plain lines, periodic, each said once."""

from __future__ import annotations

import io

import pytest
from tqdm.auto import tqdm

from rag_retriever.models.encoder import Encoder
from rag_retriever.progress import LINE_EVERY_S, MIN_GAP_S, PlainProgress, is_terminal, progress

ESCAPES = ("\x1b[", "\r")


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def plain(total: int | None, clock: Clock) -> tuple[PlainProgress, io.StringIO]:
    out = io.StringIO()
    return PlainProgress(total=total, desc="embedding", unit="text", stream=out, clock=clock), out


def test_off_a_terminal_a_stage_writes_plain_lines_without_escapes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bar = progress(total=40, desc="chunking", unit="doc")  # stderr here is capsys: no terminal
    assert isinstance(bar, PlainProgress)
    for _ in range(40):
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert not any(e in err for e in ESCAPES), repr(err)
    assert err.splitlines()[-1].startswith("chunking: 40/40 doc (100%) in ")


def test_lines_come_at_tenths_no_closer_than_the_gap_and_at_least_every_period() -> None:
    clock = Clock()
    bar, out = plain(100, clock)
    for _ in range(100):  # 1 % a second: a tenth every 10 s, past MIN_GAP_S
        clock.now += 1.0
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [f"{n}/100" for n in range(10, 101, 10)]
    assert lines[-1].startswith("embedding: 100/100 text (100%) in 100.0 s, 1.0 text/s")

    clock = Clock()
    fast, out = plain(100, clock)
    for _ in range(99):  # tenths 0.1 s apart: closer than MIN_GAP_S, so no line until the end
        clock.now += 0.01
        fast.update(1)
    assert out.getvalue() == ""
    fast.update(1)
    fast.close()
    assert len(out.getvalue().splitlines()) == 1

    clock = Clock()
    slow, out = plain(None, clock)  # no total: a line every LINE_EVERY_S
    for _ in range(10):
        clock.now += LINE_EVERY_S / 2
        slow.update(5)
    slow.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["10", "20", "30", "40", "50"]
    assert MIN_GAP_S < LINE_EVERY_S


def test_the_closing_line_is_written_once_and_an_empty_stage_writes_nothing() -> None:
    clock = Clock()
    bar, out = plain(3, clock)
    bar.update(3)
    bar.close()
    bar.close()
    assert len(out.getvalue().splitlines()) == 1

    empty, out = plain(None, clock)
    empty.close()
    assert out.getvalue() == ""


def test_the_postfix_is_on_the_lines() -> None:
    bar, out = plain(2, Clock())
    bar.update(2)
    bar.set_postfix(loss="0.123")
    bar.close()
    assert out.getvalue().rstrip().endswith("loss=0.123")


def test_on_a_terminal_the_bar_is_tqdm() -> None:
    screen = Terminal()
    assert is_terminal(screen) and not is_terminal(io.StringIO())
    bar = progress(total=2, desc="chunking", unit="doc", stream=screen)
    assert isinstance(bar, tqdm)
    bar.update(2)
    bar.close()
    assert "\r" in screen.getvalue() and "2/2" in screen.getvalue()

    forced = io.StringIO()
    assert isinstance(progress(total=1, desc="x", unit="x", stream=forced, tty=True), tqdm)


def test_disabled_progress_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress(total=2, desc="chunking", unit="doc", enabled=False)
    bar.update(2)
    bar.set_postfix(loss=1)
    bar.close()
    assert capsys.readouterr() == ("", "")


def test_the_encoder_reports_progress_without_escapes_off_a_terminal(
    tiny_encoder: Encoder, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny_encoder.encode_passages(["red apples", "green pears", "blue plums"], progress=True)
    err = capsys.readouterr().err
    assert not any(e in err for e in ESCAPES), repr(err)
    assert err.splitlines() == [line for line in err.splitlines() if line.startswith("embedding:")]
    assert len(err.splitlines()) == 1 and "3/3 text (100%)" in err
