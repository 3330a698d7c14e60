"""Helpers shared by the benchmarks: timing, percentiles, the shared data sets.

Every benchmark measures rag-retriever and its peer in the same process, on the same inputs, one
after the other, and reports the ratio: absolute times on a shared 2-core machine are noisy,
ratios measured side by side much less so.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def positive_count(text: str) -> int:
    """An argparse `type`: a whole number of at least 1 (argparse exits 2 with the message
    "argument --flag: takes a positive count (got 0)" otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a positive count (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a positive count (got {value})")
    return value


def graph_width(text: str) -> int:
    """An argparse `type`: an HNSW ef_construct the product's setting (RAG_HNSW_EF_CONSTRUCT)
    accepts (argparse exits 2 with "argument --flag: takes a graph width of 4-4096 (got '5000')"
    otherwise, the bounds the setting's)."""
    from rag_retriever.errors import ConfigError
    from rag_retriever.settings import Settings, bounds_of

    low, high = bounds_of("hnsw_ef_construct")
    wrong = argparse.ArgumentTypeError(f"takes a graph width of {low}-{high} (got {text!r})")
    try:
        value = int(text)
        Settings.check(hnsw_ef_construct=value)
    except (ValueError, ConfigError):
        raise wrong from None
    return value


def factor(text: str) -> float:
    """An argparse `type`: a number of at least 1 (an oversampling, a breadth multiplier)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of at least 1 (got {text!r})") from None
    if not value >= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"takes a number of at least 1 (got {value:g})")
    return value


def child_json(
    script: str, args: list[str], env: dict[str, str], what: str, cwd: str | None = None
) -> dict[str, Any]:
    """`python -c script args` in a fresh process; the JSON object its last stdout line holds
    (RuntimeError with the tail of its stderr, naming `what`, when it fails)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def shared_path(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the benchmarks read ../shared/data")
    return path


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@contextmanager
def timer() -> Iterator[Callable[[], float]]:
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


def best_of(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The fastest of `repeats` runs, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def real_sentences(sources: Sequence[str] = ("scifact", "squad_v11_dev")) -> list[str]:
    """Every sentence of the SciFact abstracts and the SQuAD articles (real text), or of those
    of `sources` only."""
    out: list[str] = []
    for name in sources:
        for doc in read_jsonl(shared_path(name, "docs.jsonl")):
            out.extend(s for s in _SENTENCE.split(doc["text"].replace("\n\n", " ")) if s.strip())
    return out


def line(
    label: str, ours: float, peer: float, unit: str, peer_name: str, higher_is_better: bool
) -> str:
    ratio = ours / peer if higher_is_better else peer / ours
    return f"{label}: ours {ours:,.1f} {unit} vs {peer_name} {peer:,.1f} {unit} -> {ratio:.2f}x"


def on_compute_thread(fn: Callable[[], T]) -> T:
    """`fn()` (a peer's CPU forward passes) on the thread ours run on (`ComputeThread`,
    rag_retriever/models/device.py). Run on this thread instead, a peer gives the process a
    second OpenMP team, and both teams then run at about half speed: a side-by-side figure would
    measure that, not the two encoders."""
    from rag_retriever.models.device import COMPUTE

    return COMPUTE.run(fn)
