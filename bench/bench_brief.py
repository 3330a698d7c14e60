"""The brief under load: queries offered at a fixed rate from several processes to
`rag-retriever serve`, without edits, then with edits at the brief's rate and at 10x it through
the HTTP write API, in one run; failed queries and latency per phase, beside the phase without
edits (the peer).

Setup: SQuAD v1.1 dev (48 articles, ~2,500 chunks) ingested with all-MiniLM-L6-v2 into a
temporary data dir (Qdrant Edge), served by `rag-retriever serve` in a process of its own with
a write key.

Load: open loop. Each of `--clients` processes sends hybrid searches (k=10, the dev questions in
turn) at Poisson arrivals of `--qps / --clients` a second, on schedule whether or not earlier
answers came back; a query's latency runs from its scheduled time (so a server that falls behind
shows it), and it fails on anything but a 200 or after 10 s.

Edits: one more process upserts SQuAD articles with one paragraph changed (a sentence appended
to a random paragraph: the delta encodes that article's changed chunks) at Poisson arrivals of
`--edits-per-day` (20,000, the brief's) and 10 times that, without waiting for the commit (the
service commits edits in groups, RAG_WRITE_WINDOW_MS); an edit fails on anything but a 200 or
202. After the phase, its last edit is polled until committed: an edit accepted and never served
would count as failed.

Before the phases, a query at a time (2 a second, one process) measures what one costs through
the service alone; `--constants FILE` adds that and the phase without edits to the constants
`rag-retriever plan` reads (rag_retriever/ops/capacity.json holds this machine's).

Usage: python -m bench.bench_brief [--qps 50] [--seconds 60] [--clients 2]
    [--edits-per-day 20000] [--out FILE] [--constants FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from bench.bench_common import percentile, read_jsonl, shared_path

ALIAS = "squad"
WRITE_KEY = "bench-write-key"
QUERY_TIMEOUT_S = 10.0
SECONDS_A_DAY = 86_400


async def _on_schedule(
    rate: float,
    seconds: float,
    rng: random.Random,
    send: Callable[[int, float], Coroutine[Any, Any, None]],
) -> int:
    """Open loop: `send(n, scheduled time)` at Poisson arrivals of `rate` a second for
    `seconds`, each as its own task, whether or not earlier ones are done; returns how many."""
    tasks = []
    start = time.perf_counter()
    at = rng.expovariate(rate)
    n = 0
    while at < seconds:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(n, start + at)))
        n += 1
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return n


async def _queries(url: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    questions = [
        r["question"] for r in read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"))
    ]
    rng = random.Random(seed)
    rng.shuffle(questions)
    # each answer's latency and the encoding and engine search its timings_ms report (None: an
    # answer without them, a query cache's hit)
    answers: list[tuple[float, float | None, float | None]] = []
    errors: list[str] = []

    async def one(client: httpx.AsyncClient, question: str, scheduled: float) -> None:
        try:
            response = await client.post(
                "/v1/search", json={"query": question, "k": 10, "mode": "hybrid"}
            )
            if response.status_code != 200:
                errors.append(f"{response.status_code}")
                return
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
            return
        latency = (time.perf_counter() - scheduled) * 1000
        timings = response.json().get("timings_ms") or {}
        answers.append((latency, timings.get("encode"), timings.get("search")))

    async with httpx.AsyncClient(
        base_url=url,
        timeout=QUERY_TIMEOUT_S,
        limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
    ) as client:
        i = await _on_schedule(
            rate, seconds, rng, lambda n, at: one(client, questions[n % len(questions)], at)
        )
    return {"sent": i, "answers_ms": answers, "errors": errors}


async def _edits(url: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    docs = read_jsonl(shared_path("squad_v11_dev", "docs.jsonl"))
    rng = random.Random(seed)
    accepted: list[float] = []
    errors: list[str] = []
    last_change: str | None = None
    headers = {"X-API-Key": WRITE_KEY}

    async def one(client: httpx.AsyncClient, n: int) -> None:
        nonlocal last_change
        doc = dict(rng.choice(docs))
        paragraphs = doc["text"].split("\n\n")
        k = rng.randrange(len(paragraphs))
        paragraphs[k] += f" Edit number {n} of this benchmark changed this paragraph."
        doc["text"] = "\n\n".join(paragraphs)
        t0 = time.perf_counter()
        try:
            response = await client.put(
                f"/v1/collections/{ALIAS}/documents",
                json={"documents": [doc], "wait": 0},
                headers=headers,
            )
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
            return
        if response.status_code not in (200, 202):
            errors.append(f"{response.status_code}: {response.text[:200]}")
            return
        accepted.append((time.perf_counter() - t0) * 1000)
        last_change = response.json().get("change_id") or last_change

    committed = None
    async with httpx.AsyncClient(base_url=url, timeout=QUERY_TIMEOUT_S) as client:
        n = await _on_schedule(rate, seconds, rng, lambda n, _at: one(client, n))
        if last_change is not None:
            response = await client.get(
                f"/v1/changes/{last_change}", params={"wait": 60}, headers=headers, timeout=90
            )
            committed = response.json().get("status")
    return {"sent": n, "accepted_ms": accepted, "errors": errors, "last_committed": committed}


def worker(kind: str, url: str, rate: float, seconds: float, seed: int) -> None:
    """One load process: prints its figures as JSON."""
    run = _queries if kind == "queries" else _edits
    print(json.dumps(asyncio.run(run(url, rate, seconds, seed))))


def _spawn(kind: str, url: str, rate: float, seconds: float, seed: int) -> subprocess.Popen[str]:
    code = "import sys; from bench.bench_brief import worker; worker(*sys.argv[1:3], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, kind, url, str(rate), str(seconds), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(data: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {
        **os.environ,
        "RAG_DATA_DIR": str(data),
        "RAG_WRITE_API_KEY": WRITE_KEY,
        "RAG_LOG_LEVEL": "WARNING",
        # off, as by default: a cached answer's time is not a query's (nor does it say its split)
        "RAG_CACHE_SIZE": "0",
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rag_retriever.cli",
            "serve",
            "--collection",
            ALIAS,
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("rag-retriever serve did not become ready in 300 s")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used, all its threads; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """`pid`'s child processes now and theirs (the writer, the compactions it starts)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *descendants(kid)]
    return found


class CpuMeter:
    """CPU cores a process and its helpers (all its descendants) used over a phase (Linux /proc;
    helpers that started during the phase count from 0; those that ended before its end are
    missed: a compaction process that came and went)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.t0 = time.monotonic()
        self.own0 = cpu_seconds(pid)
        self.kids0 = {k: cpu_seconds(k) for k in descendants(pid)}

    def cores(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.t0
        own = cpu_seconds(self.pid) - self.own0
        kids = sum(cpu_seconds(k) - self.kids0.get(k, 0.0) for k in descendants(self.pid))
        return {"server_cores": own / elapsed, "helpers_cores": kids / elapsed}


def _reaped_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def phase(
    url: str,
    qps: float,
    clients: int,
    seconds: float,
    edits_per_day: float,
    server_pid: int | None = None,
) -> dict[str, Any]:
    meter = CpuMeter(server_pid) if server_pid else None
    procs = [_spawn("queries", url, qps / clients, seconds, seed) for seed in range(clients)]
    editor = (
        _spawn("edits", url, edits_per_day / SECONDS_A_DAY, seconds, 99) if edits_per_day else None
    )
    reaped0, started = _reaped_cpu_s(), time.monotonic()
    results = [json.loads(p.communicate()[0]) for p in procs]
    cpu = meter.cores() if meter else {}
    answers = [a for r in results for a in r["answers_ms"]]
    latencies = [t for t, _, _ in answers]
    split = [(t, e, s) for t, e, s in answers if e is not None and s is not None]
    errors = [e for r in results for e in r["errors"]]
    out: dict[str, Any] = {
        "edits_per_day": edits_per_day,
        "queries_sent": sum(r["sent"] for r in results),
        "queries_failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99),
        # each answer's own split: its encoding, the engine, and the rest of its time through
        # the service (HTTP, JSON, fusion, queueing), the last per query, then the median
        "encode_p50_ms": percentile([e for _, e, _ in split], 50),
        "search_p50_ms": percentile([s for _, _, s in split], 50),
        "service_p50_ms": percentile([t - e - s for t, e, s in split], 50),
    }
    if editor is not None:
        edits = json.loads(editor.communicate()[0])
    if meter:  # the load's own processes, their start included, on the same cores
        cpu["load_cores"] = (_reaped_cpu_s() - reaped0) / (time.monotonic() - started)
        out["cpu"] = cpu
    if editor is not None:
        out |= {
            "edits_sent": edits["sent"],
            "edits_failed": len(edits["errors"]),
            "edit_errors": edits["errors"][:5],
            "edit_accept_p50_ms": percentile(edits["accepted_ms"], 50)
            if edits["accepted_ms"]
            else None,
            "last_edit": edits["last_committed"],
        }
    return out


def run(
    qps: float = 50, seconds: float = 60, clients: int = 2, edits_per_day: float = 20_000
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-brief-"))
    try:
        data = tmp / "data"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rag_retriever.cli",
                "ingest",
                str(shared_path("squad_v11_dev", "docs.jsonl")),
                "--collection",
                ALIAS,
                "--no-progress",
            ],
            env={**os.environ, "RAG_DATA_DIR": str(data), "RAG_LOG_LEVEL": "WARNING"},
            check=True,
            stdout=subprocess.DEVNULL,
        )
        server, url = _serve(data)
        try:
            phase(url, qps, clients, min(seconds, 10), 0)  # warm-up, not reported
            # one query at a time, near enough: what a query costs through the service alone
            single = phase(url, 2, 1, min(seconds, 30), 0, server.pid)
            phases = [
                phase(url, qps, clients, seconds, rate, server.pid)
                for rate in (0, edits_per_day, 10 * edits_per_day)
            ]
        finally:
            server.terminate()
            server.wait(30)
        chunks = _chunks(data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "qps": qps,
        "seconds": seconds,
        "clients": clients,
        "chunks": chunks,
        "single": single,
        "phases": phases,
    }


def _chunks(data: Path) -> int:
    from rag_retriever.store import EdgeStore

    store = EdgeStore(data / "edge")
    try:
        return store.count(store.resolve(ALIAS))
    finally:
        store.close()


def served_constants(results: dict[str, Any], command: str) -> dict[str, Any]:
    """What `rag-retriever plan` reads of this run: a query's cost through the service alone,
    and the load phase without edits."""
    load = results["phases"][0]
    return {
        "command": command,
        "chunks": results["chunks"],
        "single_p50_ms": results["single"]["p50_ms"],
        # the single query's own split (its answers' timings_ms): the plan adds `service_p50_ms`
        # to each setting's engine latency and encoding
        **{
            key: _measured(results["single"], source)
            for key, source in (
                ("single_encode_p50_ms", "encode_p50_ms"),
                ("single_search_p50_ms", "search_p50_ms"),
                ("service_p50_ms", "service_p50_ms"),
            )
        },
        "qps": results["qps"],
        "load_p50_ms": load["p50_ms"],
        "load_p95_ms": load["p95_ms"],
        "load_failed": load["queries_failed"],
        "load_sent": load["queries_sent"],
    }


def _measured(phase: dict[str, Any], key: str) -> float | None:
    """`phase[key]` where every query of the phase answered and the figure is a number (None:
    the plan then falls back to what it did before the figure existed)."""
    value = phase.get(key)
    if phase["queries_failed"] or value is None or not math.isfinite(value):
        return None
    return float(value)


def report(results: dict[str, Any]) -> list[str]:
    base = results["phases"][0]
    single = results["single"]
    lines = [
        f"the brief under load: {results['qps']:g} queries/s offered (open loop, "
        f"{results['clients']} processes, hybrid k=10, SQuAD dev on Edge, {results['chunks']:,} "
        f"chunks, all-MiniLM-L6-v2), {results['seconds']:g} s a phase",
        f"  alone (2 queries/s): p50 {single['p50_ms']:.1f} ms, p95 {single['p95_ms']:.1f} ms, "
        f"{single['queries_failed']} failed; of a query, p50: encoding "
        f"{single['encode_p50_ms']:.1f} ms, the engine {single['search_p50_ms']:.1f} ms, the "
        f"rest of the service {single['service_p50_ms']:.1f} ms",
    ]
    for p in results["phases"]:
        what = (
            f"edits at {p['edits_per_day']:,.0f}/day: {p['edits_sent']} sent, "
            f"{p['edits_failed']} failed, last {p['last_edit']}"
            if p["edits_per_day"]
            else "no edits (the peer)"
        )
        ratio = p["p95_ms"] / base["p95_ms"] if base["p95_ms"] else float("nan")
        lines.append(
            f"  {what}: {p['queries_sent']} queries, {p['queries_failed']} failed, p50 "
            f"{p['p50_ms']:.1f} ms, p95 {p['p95_ms']:.1f} ms ({ratio:.2f}x the peer's), "
            f"p99 {p['p99_ms']:.1f} ms"
        )
        if "cpu" in p:
            c = p["cpu"]
            lines.append(
                f"    CPU cores used: the server {c['server_cores']:.2f}, its helper processes "
                f"(the writer, compactions) {c['helpers_cores']:.2f}, the load's own processes "
                f"{c['load_cores']:.2f}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--qps", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--edits-per-day", type=float, default=20_000)
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    parser.add_argument(
        "--constants",
        type=Path,
        help='add what `rag-retriever plan` reads of this run ("served") to this constants file',
    )
    args = parser.parse_args(argv)
    results = run(args.qps, args.seconds, args.clients, args.edits_per_day)
    for line in report(results):
        print(line, flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.constants:
        data = json.loads(args.constants.read_text())
        command = "python -m bench.bench_brief " + " ".join(argv or sys.argv[1:])
        data["served"] = served_constants(results, command)
        args.constants.write_text(json.dumps(data, indent=1) + "\n")
        print(f"served figures added to {args.constants}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
