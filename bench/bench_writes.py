"""What a small write costs from each way in: a delete, and an upsert of one changed document,
from the CLI (a process of its own), from Python and over HTTP (a warm service).

Usage:
    python -m bench.bench_writes [--docs 200] [--rounds 5]

The collection is the first `--docs` SQuAD dev articles, ingested with the default model into a
temporary data dir. Each round deletes one article and then upserts it back with a sentence
added (a changed document: chunked and embedded), so every write is a real delta version. The
peer of a delete is the upsert in the same way in, measured in the same run: the CLI's upsert
loads the model (its whole process is timed, start-up included), the warm ways have it loaded.
The figure is the median over rounds. Does not measure several writers at once
(tests/test_write_api.py) or the group commit window beyond its default (RAG_WRITE_WINDOW_MS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.bench_common import read_jsonl, shared_path
from rag_retriever import Collection, Settings
from rag_retriever.query.retriever import Retriever
from rag_retriever.service.server import create_app, serve_in_thread

WRITE_KEY = "bench-write-key"


def _timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds for `call(*args, **kwargs)`; an HTTP answer must be a success."""
    start = time.perf_counter()
    answer = call(*args, **kwargs)
    seconds = time.perf_counter() - start
    if isinstance(answer, httpx.Response):
        answer.raise_for_status()
    return seconds


def _cli(data_dir: Path, *args: str) -> float:
    """Seconds for one `rag-retriever` command, its process's start-up included."""
    env = {**os.environ, "RAG_DATA_DIR": str(data_dir), "RAG_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "rag_retriever.cli", *args, "--collection", "kb", "--json"]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def run(docs: int = 200, rounds: int = 5) -> dict[str, Any]:
    articles = list(read_jsonl(shared_path("squad_v11_dev", "docs.jsonl"), limit=docs))
    times: dict[str, list[float]] = {
        f"{way} {what}": [] for way in ("cli", "python", "http") for what in ("delete", "upsert")
    }
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        settings = Settings.from_env(data_dir=data, collection="kb", write_api_key=WRITE_KEY)
        kb = Collection.open("kb", settings=settings)
        kb.ingest(articles)
        kb.retriever.store.close()

        def changed(i: int, r: int) -> dict[str, Any]:
            row = articles[i]
            return {**row, "text": f"{row['text']}\n\nRevision {r} of this article."}

        upsert_file = Path(tmp) / "one.jsonl"
        for r in range(rounds):  # the CLI: a fresh process each time
            doc = changed(r, r)
            times["cli delete"].append(_cli(data, "update", "--delete", doc["id"]))
            upsert_file.write_text(json.dumps(doc) + "\n", encoding="utf-8")
            times["cli upsert"].append(_cli(data, "update", "--upsert", str(upsert_file)))

        kb = Collection.open("kb", settings=settings)
        kb.upsert([changed(0, 99)])  # warm: the model loaded, the collection open
        for r in range(rounds):
            doc = changed(rounds + r, r)
            times["python delete"].append(_timed(kb.delete, [doc["id"]]))
            times["python upsert"].append(_timed(kb.upsert, [doc]))
        kb.retriever.store.close()

        retriever = Retriever.from_settings(settings)
        with serve_in_thread(create_app(retriever, settings)) as url:
            headers = {"Authorization": f"Bearer {WRITE_KEY}"}
            with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
                base = "/v1/collections/kb/documents"
                http.put(base, json={"documents": [_as_body(changed(0, 98))]}).raise_for_status()
                for r in range(rounds):
                    doc = changed(2 * rounds + r, r)
                    ids = {"ids": [doc["id"]]}
                    times["http delete"].append(_timed(http.post, f"{base}:delete", json=ids))
                    body = {"documents": [_as_body(doc)]}
                    times["http upsert"].append(_timed(http.put, base, json=body))
        retriever.store.close()
    return {
        "docs": len(articles),
        "rounds": rounds,
        "write_window_ms": settings.write_window_ms,
        **{key: statistics.median(values) for key, values in times.items()},
    }


def _as_body(row: dict[str, Any]) -> dict[str, Any]:
    """A .jsonl row as the HTTP write body's document (extra fields under metadata)."""
    own = {"id", "title", "text"}
    return {
        **{k: row[k] for k in own if k in row},
        "metadata": {k: v for k, v in row.items() if k not in own},
    }


def report(result: dict[str, Any]) -> list[str]:
    lines = [
        f"== a small write, by way in ({result['docs']} SQuAD articles, median of "
        f"{result['rounds']} rounds) =="
    ]
    for way, note in (
        ("cli", "a process each, start-up included; the upsert loads the model"),
        ("python", "a warm Collection"),
        ("http", f"a warm service, group commit window {result['write_window_ms']} ms"),
    ):
        delete, upsert = result[f"{way} delete"], result[f"{way} upsert"]
        lines.append(
            f"{way} ({note}): delete {delete:.2f} s vs upsert of one changed article "
            f"{upsert:.2f} s -> {upsert / delete:.1f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_writes", description=__doc__)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for text in report(run(args.docs, args.rounds)):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
