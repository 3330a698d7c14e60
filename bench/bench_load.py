"""Load benchmark of the HTTP service, against its peer: the same queries in-process.

    RAG_DATA_DIR=rag-data python -m bench.bench_load --collection squad \\
        --questions ../shared/data/squad_v11_dev/questions_dev.jsonl --clients 8 --seconds 30

Loads the collection's models once, starts `rag-retriever serve`'s app on a free loopback port in
this process, and runs N concurrent clients (asyncio, AsyncRetrieverClient, no retries, so every
failure counts) for a bounded time, cycling through the questions. Then, in the same run, the
same questions go through `Retriever.retrieve` sequentially for the same time. It prints
requests/s, p50/p95/p99 latency and errors of both, and the ratio of HTTP to in-process
throughput; `--out` writes the same numbers as JSON.

What it does not measure: a network (loopback only), several server processes, or a client on
another machine. Clients and server share this process and its GIL, so on a small machine the
ratio is a lower bound of what the HTTP layer costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rag_retriever.client import AsyncRetrieverClient, ClientError
from rag_retriever.errors import RagError
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import MODES, Mode
from rag_retriever.service.server import check_ready, create_app, serve_in_thread
from rag_retriever.settings import Settings

# Queries answered before each measured phase (loads the BM25 sidecar, warms the caches).
WARMUP_QUERIES = 8


@dataclass
class Phase:
    """What one phase measured; latencies in milliseconds."""

    name: str
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    latency_ms: dict[str, float]
    error_examples: list[str] = field(default_factory=list)


def load_questions(path: Path, limit: int | None = None) -> list[str]:
    """The "question" field of each line of a jsonl file (the labelled-questions format)."""
    questions = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            question = record.get("question") if isinstance(record, dict) else None
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{path}:{number}: no non-empty string field 'question'")
            questions.append(question)
            if limit is not None and len(questions) >= limit:
                break
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    if not latencies_ms:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan"), "mean": float("nan")}
    values = np.asarray(latencies_ms, dtype=np.float64)
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(values.mean())}


def phase(name: str, seconds: float, latencies_ms: list[float], errors: list[str]) -> Phase:
    done = len(latencies_ms)
    return Phase(
        name=name,
        seconds=round(seconds, 3),
        requests=done + len(errors),
        errors=len(errors),
        requests_per_s=done / seconds if seconds > 0 else 0.0,
        latency_ms=latency_summary(latencies_ms),
        error_examples=sorted(set(errors))[:5],
    )


async def _http_clients(
    url: str,
    queries: Sequence[str],
    *,
    clients: int,
    seconds: float,
    k: int,
    mode: Mode,
    collection: str | None,
    api_key: str | None,
) -> Phase:
    latencies: list[float] = []
    errors: list[str] = []
    next_query = 0

    async def worker(client: AsyncRetrieverClient, deadline: float) -> None:
        nonlocal next_query
        while time.perf_counter() < deadline:
            query = queries[next_query % len(queries)]
            next_query += 1  # one event loop: no lock needed
            t0 = time.perf_counter()
            try:
                await client.retrieve(query, k=k, mode=mode, collection=collection)
            except ClientError as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            latencies.append((time.perf_counter() - t0) * 1000)

    async with AsyncRetrieverClient(url, api_key=api_key, retries=0, timeout=60.0) as client:
        for q in queries[:WARMUP_QUERIES]:
            await client.retrieve(q, k=k, mode=mode, collection=collection)
        start = time.perf_counter()
        deadline = start + seconds
        await asyncio.gather(*(worker(client, deadline) for _ in range(clients)))
        elapsed = time.perf_counter() - start
    return phase(f"http ({clients} clients)", elapsed, latencies, errors)


def in_process(
    retriever: Retriever,
    queries: Sequence[str],
    *,
    seconds: float,
    k: int,
    mode: Mode,
    collection: str | None,
) -> Phase:
    """The peer: the same queries through the same Retriever, one after another."""
    for q in queries[:WARMUP_QUERIES]:
        retriever.retrieve(q, k=k, mode=mode, collection=collection)
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    deadline = start + seconds
    i = 0
    while time.perf_counter() < deadline:
        query = queries[i % len(queries)]
        i += 1
        t0 = time.perf_counter()
        try:
            retriever.retrieve(query, k=k, mode=mode, collection=collection)
        except RagError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        latencies.append((time.perf_counter() - t0) * 1000)
    return phase("in-process (sequential)", time.perf_counter() - start, latencies, errors)


def run_load(
    retriever: Retriever,
    settings: Settings,
    queries: Sequence[str],
    *,
    clients: int = 8,
    seconds: float = 30.0,
    k: int = 10,
    mode: Mode = "hybrid",
    collection: str | None = None,
) -> dict[str, Any]:
    """Both phases on one loaded retriever; returns the JSON-ready report.

    `collection` None = the retriever's default collection.
    """
    if clients < 1 or seconds <= 0:
        raise ValueError("clients must be >= 1 and seconds > 0")
    with serve_in_thread(create_app(retriever, settings)) as url:
        http = asyncio.run(
            _http_clients(
                url,
                queries,
                clients=clients,
                seconds=seconds,
                k=k,
                mode=mode,
                collection=collection,
                api_key=settings.api_key,
            )
        )
    peer = in_process(retriever, queries, seconds=seconds, k=k, mode=mode, collection=collection)
    ratio = http.requests_per_s / peer.requests_per_s if peer.requests_per_s else float("nan")
    return {
        "config": {
            "collection": retriever.store.resolve(collection or retriever.default_collection),
            "mode": mode,
            "k": k,
            "clients": clients,
            "seconds": seconds,
            "questions": len(queries),
            "model": retriever.encoder.fingerprint.describe(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "http": asdict(http),
        "in_process": asdict(peer),
        "http_over_in_process_throughput": ratio,
    }


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"{cfg['collection']}  mode={cfg['mode']} k={cfg['k']}  {cfg['questions']} questions  "
        f"{cfg['cpu_count']} CPUs  model {cfg['model']}",
        f"{'phase':<26} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'requests':>9} "
        f"{'errors':>7}",
    ]
    for key in ("http", "in_process"):
        p = report[key]
        lat = p["latency_ms"]
        lines.append(
            f"{p['name']:<26} {p['requests_per_s']:>8.1f} {lat['p50']:>8.1f} {lat['p95']:>8.1f} "
            f"{lat['p99']:>8.1f} {p['requests']:>9} {p['errors']:>7}"
        )
        lines.extend(f"  error: {e}" for e in p["error_examples"])
    lines.append(
        f"HTTP throughput / in-process throughput = {report['http_over_in_process_throughput']:.2f}"
    )
    return "\n".join(lines)


def run_benchmark(
    retriever: Retriever,
    settings: Settings,
    *,
    collection: str,
    clients: int = 8,
    seconds: float = 30.0,
    questions: Path | None = None,
    k: int = 10,
    mode: Mode = "hybrid",
) -> dict[str, Any]:
    """The `load` entry of bench/__main__.py: SQuAD dev questions unless `questions` is given."""
    if questions is None:
        from bench.bench_common import shared_path

        questions = shared_path("squad_v11_dev", "questions_dev.jsonl")
    return run_load(
        retriever,
        settings,
        load_questions(questions),
        clients=clients,
        seconds=seconds,
        k=k,
        mode=mode,
        collection=collection,
    )


def report(results: dict[str, Any]) -> list[str]:
    """The printed lines of bench/__main__.py's `load` section."""
    return ["== load: HTTP service vs in-process ==", *format_report(results).splitlines()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Load benchmark of the HTTP service.")
    parser.add_argument("--collection", required=True, help="alias or collection to query")
    parser.add_argument("--questions", type=Path, required=True, help="jsonl with 'question'")
    parser.add_argument("--data-dir", type=Path, help="RAG_DATA_DIR (default: the environment)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients (8)")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase (30)")
    parser.add_argument("--mode", choices=MODES, default="hybrid", help="search mode (hybrid)")
    parser.add_argument("-k", type=int, default=10, help="hits per query (10)")
    parser.add_argument("--limit", type=int, help="use only the first N questions")
    parser.add_argument("--out", type=Path, help="also write the report here as JSON")
    args = parser.parse_args(argv)

    settings = Settings.from_env(collection=args.collection, data_dir=args.data_dir)
    queries = load_questions(args.questions, args.limit)
    retriever = Retriever.from_settings(settings)
    ready, status = check_ready(retriever)
    if not ready:
        print(f"error: {status['detail']}", file=sys.stderr)
        return 2
    results = run_load(
        retriever,
        settings,
        queries,
        clients=args.clients,
        seconds=args.seconds,
        k=args.k,
        mode=args.mode,
    )
    print(format_report(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
