"""What tracing costs a search: off (the default) against the same code with the tracing calls
replaced by bare no-op functions (the code as if it had no tracing), and on (the OpenTelemetry
SDK, spans kept in memory), side by side in one process on one collection.

Usage:
    python -m bench.bench_tracing [--rounds 7] [--queries 200]

The collection is this project's docs/ folder, ingested with the default model into a temporary
data dir; the queries are SQuAD dev questions. Each round runs every query once per variant,
back to back in an order rotated per query, and the figure per variant is the median over rounds
of the per-round median latency. The noise between runs of the same code (a few %) is larger
than tracing's cost while off, so the calls of tracing a search makes while it is off are also
timed alone (timeit) and put against each mode's p50. Does not measure an exporter's network
cost (spans stay in memory).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from bench.bench_common import percentile, read_jsonl, shared_path
from rag_retriever import tracing
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.query.retriever import Retriever
from rag_retriever.settings import Settings

DOCS = Path(__file__).resolve().parents[1] / "docs"
MODES = ("bm25", "hybrid")


@contextmanager
def _without_tracing() -> Iterator[None]:
    """The tracing calls as bare functions that do nothing: the peer, code without tracing."""
    saved = (tracing.span, tracing.set_attributes, tracing.finished_span)
    off = nullcontext()
    tracing.span = lambda name, **attributes: off
    tracing.set_attributes = lambda **attributes: None
    tracing.finished_span = lambda name, seconds, **attributes: None
    try:
        yield
    finally:
        tracing.span, tracing.set_attributes, tracing.finished_span = saved


@contextmanager
def _on() -> Iterator[None]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracing.configure("on", provider=provider)
    try:
        yield
    finally:
        tracing.configure("off")
        provider.shutdown()


VARIANTS: dict[str, Callable[[], Any]] = {
    "no tracing calls": _without_tracing,
    "off": nullcontext,
    "on (SDK, in memory)": _on,
}


def _round(retriever: Retriever, queries: list[str], mode: str, shift: int) -> dict[str, float]:
    """One round: each query searched once under each variant, back to back, the variants'
    order rotated per query (and per round), so that drift, garbage collection after the "on"
    variant and cache warmth fall on every variant alike. The per-variant median latency, ms."""
    names = list(VARIANTS)
    times: dict[str, list[float]] = {v: [] for v in names}
    for i, q in enumerate(queries):
        for j in range(len(names)):
            variant = names[(i + j + shift) % len(names)]
            with VARIANTS[variant]():
                start = time.perf_counter()
                retriever.search(q, k=5, mode=mode)  # type: ignore[arg-type]
                times[variant].append((time.perf_counter() - start) * 1000)
    return {v: percentile(ms, 50) for v, ms in times.items()}


def _off_calls() -> None:
    """What a hybrid search with diversity and expansion calls of tracing while it is off: the
    root span and its seven stage spans, and four set_attributes."""
    with tracing.span("rag.search", query_id="q", mode="hybrid", k=5, queries=1):
        with tracing.span("rag.search.cache", queries=1):
            tracing.set_attributes(answered=0, misses=1)
        with tracing.span("rag.search.encode", queries=1):
            tracing.set_attributes(truncated=0)
        for stage in ("retrieve", "fuse", "rerank", "diversity", "expand"):
            with tracing.span(f"rag.search.{stage}", candidates=50):
                pass
        tracing.set_attributes(hits=5, candidates=50)


def off_cost_us(repeats: int = 200_000) -> float:
    """Microseconds a search spends in tracing calls while tracing is off (best of 5)."""
    tracing.configure("off")
    best = min(timeit.repeat(_off_calls, number=repeats, repeat=5))
    return best / repeats * 1e6


def run(rounds: int = 7, queries: int = 200) -> dict[str, Any]:
    questions = [
        q["question"]
        for q in read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), limit=queries)
    ]
    out: dict[str, Any] = {"rounds": rounds, "queries": len(questions), "off_us": off_cost_us()}
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.from_env(data_dir=Path(tmp), collection="docs")
        retriever = Retriever.from_settings(settings)
        ingest_documents(
            load_documents(DOCS), alias="docs", encoder=retriever.encoder, store=retriever.store
        )
        for mode in MODES:
            _round(retriever, questions[:20], mode, 0)  # warm-up
            per_round: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for r in range(rounds):
                for variant, ms in _round(retriever, questions, mode, r).items():
                    per_round[variant].append(ms)
            out[mode] = {v: statistics.median(ms) for v, ms in per_round.items()}
        retriever.store.close()
    return out


def report(result: dict[str, Any]) -> list[str]:
    lines = [
        f"== tracing cost per search ({result['queries']} queries, {result['rounds']} rounds) =="
    ]
    for mode in MODES:
        peer = result[mode]["no tracing calls"]
        for variant in ("off", "on (SDK, in memory)"):
            ours = result[mode][variant]
            lines.append(
                f"{mode} p50, tracing {variant}: {ours:.3f} ms vs no tracing calls {peer:.3f} ms"
                f" -> {ours / peer:.3f}x the time"
            )
        lines.append(
            f"{mode}: tracing calls while off cost {result['off_us']:.2f} us a search"
            f" = {result['off_us'] / 1000 / peer:.4%} of its p50 (timeit of the calls alone)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_tracing", description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args(argv)
    for text in report(run(args.rounds, args.queries)):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
