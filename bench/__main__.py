"""Every benchmark in one run (`make bench`): each prints its peer, measured in the same run, and
the ratio. Results go to `<out>/bench.json` and `<out>/bench.txt`.

Usage:
    python -m bench [--out bench-out] [--only bm25 engine ingest update query load operate training
        fusion context few_labels stop tracing writes tenants quantization brief fuzz memory gpu
        improve]
        [--reranker DIR]
        [--context-questions N] [--fuzz-examples N]

Needs ../shared/data (SQuAD and SciFact). Takes about an hour on 2 CPU cores: the engine at 100k
chunks (with qdrant-client's local mode as its peer), the update deltas at 100k, and the fusion
and context benchmarks' first runs (each encodes SQuAD and SciFact once and caches them under
--out) take most of it; `few_labels` (bench/bench_few_labels.py: three other ways to use
SciFact's labelled claims, judged on folds by document) about 7 minutes; `stop`
(bench/bench_stop.py: how fast an ingest stops on SIGTERM and Ctrl-C) about 2 minutes; `tracing`
(bench/bench_tracing.py: a search's latency with tracing off, on, and without the calls) about
3 minutes; `writes` (bench/bench_writes.py: a delete and a one-document upsert from the CLI,
Python and HTTP) about 3 minutes; `tenants` (bench/bench_tenants.py: 10,000 requests of 101 scoped
keys in 50 tenants checked for leaks, one BM25 table vs per-tenant tables, a scoped query at 100k
chunks) about 15 minutes; `quantization` (bench/bench_quantization.py: each setting's dense recall
against exact search and the end-to-end recall on SQuAD and on SciFact) about 8 minutes; `brief`
(bench/bench_brief.py: 50 queries/s offered to the HTTP service, without edits and with edits at
20,000 and 200,000 a day) about 6 minutes; `fuzz` (bench/bench_fuzz.py: schemathesis over every HTTP route, the write key sent
and missing, counting requests and 5xx) about 10 minutes at the default 150 examples; `memory`
(bench/bench_memory.py: a full build's peak RSS at 25k and 100k chunks, the chunked blocks
waiting on disk vs all in RAM) about 4 minutes. `gpu`
(bench/bench_gpu.py) says "skipped" in one line without a CUDA device.
`improve` (bench/bench_improve.py: `improve` cross-validated on SciFact and on 800 SQuAD train
questions, each fold's run against the stock version) runs only when named: it takes hours.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

BENCHES = (
    "bm25",
    "engine",
    "ingest",
    "update",
    "query",
    "load",
    "operate",
    "training",
    "fusion",
    "context",
    "few_labels",
    "stop",
    "tracing",
    "writes",
    "tenants",
    "quantization",
    "brief",
    "fuzz",
    "memory",
    "gpu",
)
# Hours on 2 cores (it trains the embedder a dozen times): only when asked for (--only improve).
OPT_IN = ("improve",)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    report = _Report()
    results.update(_run_standalone(args, report))
    if {"query", "load", "operate", "training"} & set(args.only):
        results.update(_run_on_squad(args, report))
    (args.out / "bench.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    (args.out / "bench.txt").write_text("\n".join(report.lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'bench.json'}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument(
        "--only",
        nargs="+",
        choices=BENCHES + OPT_IN,
        default=list(BENCHES),
        help="benchmarks to run (default: all but improve, which takes hours: ask for it)",
    )
    parser.add_argument(
        "--reranker",
        type=Path,
        help="cross-encoder dir (default: an untrained one, for speed only)",
    )
    parser.add_argument(
        "--engine-sizes", type=int, nargs="+", default=[100_000], help="e.g. 100000 1000000"
    )
    parser.add_argument(
        "--update-sizes", type=int, nargs="+", default=[100_000], help="e.g. 100000 1000000"
    )
    parser.add_argument(
        "--context-questions",
        type=int,
        default=2000,
        help="questions per set for the diversity/expand benchmark (default 2000)",
    )
    parser.add_argument("--update-deltas", type=int, default=100, help="successive 1%% deltas")
    parser.add_argument(
        "--fuzz-examples",
        type=int,
        default=150,
        help="schemathesis examples per route, mode and path choice (default 150)",
    )
    parser.add_argument("--load-seconds", type=float, default=20.0)
    parser.add_argument("--load-clients", type=int, default=8)
    return parser


class _Report:
    """The report's lines: each printed as soon as its benchmark ends, all kept for bench.txt."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def emit(self, new: list[str]) -> None:
        for text in new:
            print(text, flush=True)
        self.lines.extend(new)


def _run_standalone(args: argparse.Namespace, report: _Report) -> dict[str, Any]:
    """The benchmarks that bring their own data: BM25, the engine, ingest, update, fusion,
    context, few_labels, stop, tracing, writes, fuzz, improve, memory, GPU (in that order).
    Each module is imported only when its benchmark runs."""
    results: dict[str, Any] = {}
    if "bm25" in args.only:
        from bench import bench_bm25

        results["bm25"] = bench_bm25.run()
        report.emit(bench_bm25.report(results["bm25"]))

    if "engine" in args.only:
        from bench import bench_engine

        results["engine"] = bench_engine.run(tuple(args.engine_sizes))
        report.emit(bench_engine.report(results["engine"]))

    if "ingest" in args.only:
        from bench import bench_ingest

        results["ingest"] = bench_ingest.run()
        report.emit(bench_ingest.report(results["ingest"]))

    if "update" in args.only:
        from bench import bench_update

        results["update"] = bench_update.run(tuple(args.update_sizes), args.update_deltas)
        results["update_server"] = bench_update.run_server()
        results["update_e2e"] = bench_update.run_e2e()
        results["update_recall"] = bench_update.run_delta_recall()
        results["update_vocabulary"] = bench_update.run_vocabulary()
        report.emit(
            bench_update.report(
                results["update"],
                results["update_e2e"],
                results["update_server"],
                results["update_recall"],
                results["update_vocabulary"],
            )
        )

    if "fusion" in args.only:
        from bench import bench_fusion

        results["fusion"] = bench_fusion.run(args.out)
        report.emit(bench_fusion.report(results["fusion"]))

    if "context" in args.only:
        from bench import bench_context

        results["context"] = bench_context.run(args.out, args.context_questions)
        report.emit(
            ["== diverse hits, context, headings ==", *bench_context.report(results["context"])]
        )

    if "few_labels" in args.only:
        from bench import bench_few_labels

        results["few_labels"] = bench_few_labels.run(args.out)
        report.emit(
            [
                "== a few hundred labels, other ways ==",
                *bench_few_labels.report(results["few_labels"]),
            ]
        )

    if "stop" in args.only:
        from bench import bench_stop

        results["stop"] = bench_stop.run()
        report.emit(bench_stop.report(results["stop"]))

    if "tracing" in args.only:
        from bench import bench_tracing

        results["tracing"] = bench_tracing.run()
        report.emit(bench_tracing.report(results["tracing"]))

    if "writes" in args.only:
        from bench import bench_writes

        results["writes"] = bench_writes.run()
        report.emit(bench_writes.report(results["writes"]))

    if "tenants" in args.only:
        from bench import bench_tenants

        results["tenants"] = bench_tenants.run()
        report.emit(bench_tenants.report(results["tenants"]))

    if "quantization" in args.only:
        from bench import bench_quantization

        for dataset in bench_quantization.DATASETS:
            results[f"quantization_{dataset}"] = bench_quantization.run(dataset=dataset)
            report.emit(bench_quantization.report(results[f"quantization_{dataset}"]))

    if "brief" in args.only:
        from bench import bench_brief

        results["brief"] = bench_brief.run()
        report.emit(bench_brief.report(results["brief"]))

    if "fuzz" in args.only:
        from bench import bench_fuzz

        results["fuzz"] = bench_fuzz.run(args.fuzz_examples)
        report.emit(bench_fuzz.report(results["fuzz"]))

    if "improve" in args.only:
        from bench import bench_improve

        bench_improve.cv(args.out, folds=3, inner=3, which="scifact")
        bench_improve.cv(args.out, folds=3, inner=3, which="squad")
        data = bench_improve.Results(args.out / "improve-cv.json").data
        results["improve"] = data
        report.emit(["== improve, cross-validated ==", *bench_improve.report_cv(data)])

    if "memory" in args.only:
        from bench import bench_memory

        results["memory"] = bench_memory.run()
        report.emit(bench_memory.report(results["memory"]))

    if "gpu" in args.only:
        from bench import bench_gpu

        results["gpu"] = bench_gpu.run()
        report.emit(bench_gpu.report(results["gpu"]))
    return results


def _run_on_squad(args: argparse.Namespace, report: _Report) -> dict[str, Any]:
    """The query, load and training benchmarks, on the SQuAD collection under `<out>/data`
    (ingested on the first run, reused after)."""
    from bench.bench_common import shared_path
    from rag_retriever.ingest.loaders import load_documents
    from rag_retriever.ingest.writer import ingest_documents
    from rag_retriever.query.retriever import Retriever
    from rag_retriever.settings import Settings

    results: dict[str, Any] = {}
    settings = Settings.from_env(data_dir=args.out / "data", collection="squad")
    retriever = Retriever.from_settings(settings)
    if "squad" not in retriever.store.aliases():
        ingest_documents(
            load_documents(shared_path("squad_v11_dev", "docs.jsonl")),
            alias="squad",
            encoder=retriever.encoder,
            store=retriever.store,
        )
    if "query" in args.only:
        from bench import bench_query

        reranker = args.reranker or bench_query.untrained_reranker(args.out / "untrained-reranker")
        results["query"] = bench_query.run(retriever, collection="squad", reranker_dir=reranker)
        report.emit(bench_query.report(results["query"]))
    if "load" in args.only:
        from bench import bench_load

        retriever.reranker = None
        results["load"] = bench_load.run_benchmark(
            retriever,
            settings,
            collection="squad",
            clients=args.load_clients,
            seconds=args.load_seconds,
        )
        report.emit(bench_load.report(results["load"]))
    retriever.store.close()
    if "operate" in args.only:
        from bench import bench_operate

        results["operate"] = bench_operate.run(args.out / "data", args.load_seconds)
        report.emit(bench_operate.report(results["operate"]))
    if "training" in args.only:
        from bench import bench_training

        results["training"] = bench_training.run(
            args.out / "data", shared_path("squad_v11_dev", "questions_train.jsonl")
        )
        report.emit(bench_training.report(results["training"]))
    return results


if __name__ == "__main__":
    sys.exit(main())
