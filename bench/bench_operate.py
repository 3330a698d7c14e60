"""Operating costs, each next to its peer in the same run, on the SQuAD collection:

- the query log and the metrics: 8-client HTTP throughput with the log on (and /metrics scraped
  once a second) next to the same app with the log off (metrics are always counted);
- the semantic cache: a replayed log of SQuAD dev questions (each asked once, then a third of
  them again: half verbatim, half reworded by case, spacing and punctuation) with the cache on,
  next to the same replay with it off: hit rate, p50 of a hit, p50 of a search;
- doctor: wall time on the SQuAD and SciFact collections (2 cores).

Usage: python -m bench.bench_operate --data-dir bench-out/data   (needs the `squad` collection
that `python -m bench` builds; the SciFact one is ingested on the first run)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_common import percentile, read_jsonl, shared_path
from bench.bench_load import _http_clients
from rag_retriever.query.cache import SemanticCache
from rag_retriever.query.querylog import QueryLog
from rag_retriever.query.retriever import Retriever
from rag_retriever.service.server import create_app, serve_in_thread
from rag_retriever.settings import Settings


def _questions(n: int) -> list[str]:
    rows = read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"))
    random.Random(0).shuffle(rows)
    return [r["question"] for r in rows[:n]]


def overhead(retriever: Retriever, settings: Settings, seconds: float = 20.0) -> dict[str, Any]:
    """8 clients, hybrid, log off then on (with a /metrics scrape each second)."""
    queries = _questions(2000)
    out: dict[str, Any] = {}
    for label in ("off", "on"):
        with tempfile.TemporaryDirectory() as tmp:
            retriever.query_log = QueryLog(Path(tmp)) if label == "on" else None
            with serve_in_thread(create_app(retriever, settings)) as url:
                phase = asyncio.run(_load(url, queries, seconds, scrape=label == "on"))
            if retriever.query_log is not None:
                retriever.query_log.close()
                out["log_lines"] = retriever.query_log.written
            out[label] = {"requests_per_s": phase.requests_per_s, "p50_ms": phase.latency_ms["p50"]}
    retriever.query_log = None
    out["overhead"] = 1 - out["on"]["requests_per_s"] / out["off"]["requests_per_s"]
    return out


async def _load(url: str, queries: list[str], seconds: float, *, scrape: bool) -> Any:
    """The 8 clients, and a scraper of /metrics once a second when `scrape`."""
    import httpx

    async def scraper() -> None:
        until = time.perf_counter() + seconds + 5
        async with httpx.AsyncClient() as http:
            while time.perf_counter() < until:
                await http.get(f"{url}/metrics")
                await asyncio.sleep(1.0)

    task = asyncio.create_task(scraper()) if scrape else None
    phase = await _http_clients(
        url,
        queries,
        clients=8,
        seconds=seconds,
        k=10,
        mode="hybrid",
        collection=None,
        api_key=None,
    )
    if task is not None:
        task.cancel()
    return phase


def _reword(q: str, rng: random.Random) -> str:
    """The same question typed differently: case, spacing, the final punctuation."""
    q = q.rstrip("?").strip()
    return rng.choice([q.lower(), q.upper(), "  " + q.replace(" ", "  ")]) + rng.choice(
        ["", "?", " ?"]
    )


def cache_replay(retriever: Retriever, n_unique: int = 600) -> dict[str, Any]:
    rng = random.Random(1)
    unique = _questions(n_unique)
    again = rng.sample(unique, n_unique // 3)
    replay = unique + [q if i % 2 else _reword(q, rng) for i, q in enumerate(again)]
    out: dict[str, Any] = {"questions": len(replay), "repeats": len(again)}
    for label in ("off", "on"):
        retriever.cache = SemanticCache(size=2000, threshold=0.99) if label == "on" else None
        times: list[tuple[float, bool]] = []
        for q in replay:
            t0 = time.perf_counter()
            result = retriever.retrieve(q, k=10, mode="hybrid")
            cached = any("answered from the cache" in n for n in result.notices)
            times.append(((time.perf_counter() - t0) * 1000, cached))
        hits = [t for t, c in times if c]
        searched = [t for t, c in times if not c]
        out[label] = {
            "total_s": sum(t for t, _ in times) / 1000,
            "hits": len(hits),
            "hit_p50_ms": percentile(hits, 50) if hits else None,
            "search_p50_ms": percentile(searched, 50),
        }
        if retriever.cache is not None:
            out["cache"] = {
                "exact": retriever.cache.hits["exact"],
                "semantic": retriever.cache.hits["semantic"],
            }
    retriever.cache = None
    out["saved"] = 1 - out["on"]["total_s"] / out["off"]["total_s"]
    return out


def _ensure(data_dir: Path) -> None:
    """The SQuAD and SciFact collections under `data_dir` (ingested once, reused after)."""
    from rag_retriever.ingest.loaders import load_documents
    from rag_retriever.ingest.writer import ingest_documents

    for alias, name in (("squad", "squad_v11_dev"), ("scifact", "scifact")):
        retriever = Retriever.from_settings(Settings.from_env(data_dir=data_dir, collection=alias))
        if alias not in retriever.store.aliases():
            ingest_documents(
                load_documents(shared_path(name, "docs.jsonl")),
                alias=alias,
                encoder=retriever.encoder,
                store=retriever.store,
                lock_dir=data_dir,
            )
        retriever.store.close()


def doctor_time(data_dir: Path) -> dict[str, Any]:
    from rag_retriever.ops.doctor import Doctor, Thresholds

    out: dict[str, Any] = {}
    for alias in ("squad", "scifact"):
        retriever = Retriever.from_settings(Settings.from_env(data_dir=data_dir, collection=alias))
        t0 = time.perf_counter()
        checks = Doctor(retriever, collection=alias, thresholds=Thresholds()).run()
        out[alias] = {
            "seconds": time.perf_counter() - t0,
            "checks": {c.name: c.summary for c in checks},
        }
        retriever.store.close()
    return out


def run(data_dir: Path, seconds: float = 20.0) -> dict[str, Any]:
    _ensure(data_dir)
    settings = Settings.from_env(data_dir=data_dir, collection="squad")
    retriever = Retriever.from_settings(settings.replace(rerank_model=None))
    results = {
        "overhead": overhead(retriever, settings, seconds),
        "cache": cache_replay(retriever),
    }
    retriever.store.close()
    results["doctor"] = doctor_time(data_dir)
    return results


def report(r: dict[str, Any]) -> list[str]:
    o, c = r["overhead"], r["cache"]
    lines = [
        "== operating costs ==",
        f"query log + /metrics scrapes, 8 HTTP clients, hybrid: {o['on']['requests_per_s']:.1f} "
        f"req/s vs {o['off']['requests_per_s']:.1f} without the log -> overhead "
        f"{o['overhead']:+.1%} ({o.get('log_lines', 0)} lines written)",
        f"semantic cache, replay of {c['questions']} SQuAD questions ({c['repeats']} repeated, half "
        f"reworded): {c['on']['hits']} hits ({c.get('cache', {})}), hit p50 "
        f"{c['on']['hit_p50_ms'] or float('nan'):.2f} ms vs search p50 {c['off']['search_p50_ms']:.1f} ms; "
        f"replay {c['on']['total_s']:.1f} s vs {c['off']['total_s']:.1f} s without -> {c['saved']:.0%} saved",
    ]
    for alias, d in r["doctor"].items():
        lines.append(f"doctor on {alias}: {d['seconds']:.1f} s")
        lines.extend(f"  {name}: {summary}" for name, summary in d["checks"].items())
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=Path("bench-out/data"))
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    for line in report(run(args.data_dir, args.seconds)):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
