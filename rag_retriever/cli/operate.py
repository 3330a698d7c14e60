"""Operating commands: `serve`, `doctor`, and `questions` (labelled questions from the query log)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rag_retriever.cli.common import (
    LIMITS,
    MODEL,
    QUERY,
    STORE,
    command_settings,
    reads_files,
    setting_flags,
)
from rag_retriever.errors import ConfigError


def cmd_questions(args: argparse.Namespace) -> int:
    from rag_retriever.query.querylog import questions_from_log
    from rag_retriever.records import check_tenant

    if args.tenant is not None:
        try:
            check_tenant(args.tenant)
        except ValueError as exc:
            raise ConfigError(f"--tenant: {exc}") from None
    rows, report = questions_from_log(args.from_log, alias=args.collection, tenant=args.tenant)
    where = ", ".join(str(d) for d in args.from_log)
    if args.tenant is None and report.tenants > 1:
        print(
            f"reading the queries of every tenant ({report.tenants} tenants searched alone, and "
            f"queries across tenants); --tenant T reads one tenant's",
            file=sys.stderr,
        )
    if args.collection is None and report.alias is not None:
        print(
            f"reading every alias of the query log: {report.alias} (the only one; "
            f"--collection ALIAS reads one)",
            file=sys.stderr,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    if args.json:
        print(json.dumps({**report.to_dict(), "out": str(args.out)}, indent=2))
        return 0
    of_alias = f" of alias {report.alias}" if report.alias is not None else ""
    print(
        f"logged queries {report.queries}{of_alias}, with feedback {report.judged}\n"
        f"questions      {report.questions} written to {args.out} "
        f"({report.duplicates_merged} repeats merged into them)\n"
        f"skipped        {report.negative_only} with only negative feedback, "
        f"{report.without_text} logged without their text (RAG_QUERY_LOG_TEXT=false)"
    )
    if not report.queries:
        print(
            f"no question could be made: {where} holds no logged query yet; is it the "
            f"RAG_QUERY_LOG directory of the serving process, and has that answered a search?"
        )
    elif not rows:
        print("no question could be made: send feedback with relevant=true (POST /v1/feedback)")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from rag_retriever.ops.doctor import Doctor, Thresholds, labelled_questions
    from rag_retriever.query.retriever import Retriever

    settings = command_settings(args)
    # refused before the model loads: a bad file, or bad thresholds, is exit 2 at once
    labelled = labelled_questions(args.questions) if args.questions else None
    thresholds = Thresholds(
        duplicate_similarity=args.duplicate_similarity,
        max_duplicate_share=args.max_duplicate_share,
        max_boilerplate_share=args.max_boilerplate_share,
        max_truncated_share=args.max_truncated_share,
        max_far_query_share=args.max_far_query_share,
        max_empty_share=args.max_empty_share,
    )
    # the embedder loads when a check first needs it (mode bm25 defers it): a collection that
    # does not exist is refused by Doctor before that
    retriever = Retriever.from_settings(settings.replace(rerank_model=None), mode="bm25")
    doctor = Doctor(retriever, collection=settings.collection, thresholds=thresholds)
    checks = doctor.run(log=args.log or (), questions=labelled)
    failed = [c.name for c in checks if not c.ok]
    # an operator's view: every tenant's chunks and queries (docs/tenants.md)
    tenants = "tenant" in (doctor.record.fields or {})
    if args.json:
        print(
            json.dumps(
                {
                    "collection": doctor.name,
                    "reads": "every tenant" if tenants else "every document",
                    "ok": not failed,
                    "checks": [c.__dict__ for c in checks],
                },
                indent=2,
            )
        )
    else:
        print(f"doctor of {settings.collection} -> {doctor.name}")
        if tenants:
            print("(reading every tenant's chunks and logged queries)")
        for c in checks:
            verdict = f"{c.verdict()}: " if c.verdict() else ""
            print(f"{'ok  ' if c.ok else 'FAIL'}  {c.name:<16} {verdict}{c.summary}")
            if c.meaning:
                print(f"      {'':<16} ({c.meaning})")
        if not args.log:
            print("(no --log: drift and stage health need the query log, RAG_QUERY_LOG)")
    return 1 if failed else 0


def add_doctor(sub: Any) -> None:
    """`doctor`: noise floor, duplicates, truncation, drift, stage health; exit 1 on a failure.
    Drift and stage health read the logged queries of `--collection`'s alias only."""
    from rag_retriever.ops.doctor import Thresholds

    default = Thresholds()
    p = sub.add_parser(
        "doctor",
        help="monitoring checks of a collection and its query log (exit 1 when one fails)",
    )
    p.add_argument(
        "--log",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="query log directories (only the queries asked of --collection's alias are read)",
    )
    p.add_argument("--questions", type=Path, help="labelled questions: drift is measured from them")
    reads_files(p, "questions")
    for name, text in (
        ("duplicate_similarity", "cosine at which two chunks count as near-duplicates"),
        ("max_duplicate_share", "fail above this share of near-duplicate chunks"),
        ("max_boilerplate_share", "fail above this share of chunks repeated across documents"),
        ("max_truncated_share", "fail above this share of truncated chunks or queries"),
        ("max_far_query_share", "fail above this share of recent queries far from every question"),
        ("max_empty_share", "fail above this share of empty results"),
    ):
        value = getattr(default, name)
        p.add_argument(
            "--" + name.replace("_", "-"), type=float, default=value, help=f"{text} ({value:g})"
        )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    setting_flags(p, "collection", *MODEL, *STORE)
    p.set_defaults(func=cmd_doctor)


def add_questions(sub: Any) -> None:
    """`questions --from-log DIR --collection ALIAS`: labelled questions from one alias's logged
    queries with feedback."""
    p = sub.add_parser(
        "questions",
        help="turn logged queries with positive feedback into a labelled questions file",
    )
    p.add_argument(
        "--from-log",
        type=Path,
        nargs="+",
        required=True,
        metavar="DIR",
        help="query log directories (RAG_QUERY_LOG of each serving process)",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="the questions .jsonl to write (eval format)"
    )
    p.add_argument(
        "--collection",
        metavar="ALIAS",
        help="read only the queries asked of this alias (eval scores one collection); without "
        "it the log must hold one alias (RAG_COLLECTION is not read here)",
    )
    p.add_argument(
        "--tenant",
        help="read only the queries that searched this tenant alone (docs/tenants.md); without "
        "it every tenant's queries are read",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    setting_flags(p, "log_level")
    p.set_defaults(func=cmd_questions)


def add_serve(sub: Any) -> None:
    """`serve`: the HTTP service."""
    p = sub.add_parser("serve", help="serve search over HTTP (FastAPI; OpenAPI docs at /docs)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default 127.0.0.1, this machine only; 0.0.0.0 for all)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    setting_flags(
        p,
        "collection",
        *QUERY,
        *LIMITS,
        *MODEL,
        *STORE,
        "keys_file",
        "write_window_ms",
        "write_interval_ms",
        "write_process",
        "keep_alive_s",
        "lock_wait_s",
        "query_log",
        "query_log_text",
        "metrics_port",
        "cache_size",
        "cache_threshold",
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from rag_retriever.service import server  # FastAPI and the models load only for this command

    server.serve(command_settings(args), host=args.host, port=args.port)
    return 0


def add_plan(sub: Any) -> None:
    """`plan`: memory, disk, build time, latency and edit cost of a brief, per quantization."""
    from rag_retriever.ops.plan import CONSTANTS, Brief

    default = Brief(chunks=1)
    p = sub.add_parser(
        "plan",
        help="memory, disk, build time, latency and edit cost of a corpus and a load, per "
        "quantization setting, from measured constants (docs/operating.md)",
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--chunks", type=int, help="chunks in the corpus")
    size.add_argument(
        "--documents", type=int, help="documents in the corpus (see --chunks-per-document)"
    )
    p.add_argument(
        "--chunks-per-document", type=float, default=4.0, help="chunks a document makes (4.0)"
    )
    p.add_argument(
        "--qps", type=float, default=default.qps, help=f"queries/s at peak ({default.qps})"
    )
    p.add_argument(
        "--p95-ms",
        type=float,
        default=default.p95_ms,
        help=f"p95 latency target in ms ({default.p95_ms})",
    )
    p.add_argument(
        "--edits-per-day",
        type=int,
        default=default.edits_per_day,
        help=f"document edits a day ({default.edits_per_day})",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=default.nodes,
        help=f"nodes of the cluster compared ({default.nodes})",
    )
    p.add_argument("--memory-gb", type=float, help="memory of a machine (default: this one's)")
    p.add_argument("--cores", type=int, help="cores of a machine (default: this one's)")
    p.add_argument(
        "--dim", type=int, default=default.dim, help=f"the model's dimensions ({default.dim})"
    )
    p.add_argument(
        "--recall-at10",
        type=float,
        default=default.recall_at10,
        help=f"the share of an exact search's top 10 a dense search must find, where the "
        f"constants measured it ({default.recall_at10:g}); a setting below it is not recommended",
    )
    p.add_argument(
        "--constants",
        type=Path,
        help=f"measured constants (default: {CONSTANTS.name}, measured on the development machine; "
        f"write your own with `python -m bench.bench_engine --constants-out FILE`)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    setting_flags(p, "log_level", "base_shard_points", "hnsw_ef_construct")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    import os

    from rag_retriever.ops.plan import Brief, load_constants, make_plan
    from rag_retriever.ops.plan_text import describe

    if args.chunks_per_document <= 0:
        raise ConfigError("--chunks-per-document must be > 0")
    if args.documents is not None and args.documents <= 0:
        raise ConfigError(f"--documents must be > 0; got {args.documents}")
    chunks = (
        args.chunks if args.chunks is not None else round(args.documents * args.chunks_per_document)
    )
    memory_gb = args.memory_gb
    if memory_gb is None:  # this machine's; a 0 given is refused by Brief, never replaced
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    brief = Brief(
        chunks=chunks,
        qps=args.qps,
        p95_ms=args.p95_ms,
        edits_per_day=args.edits_per_day,
        chunks_per_edit=args.chunks_per_document,
        nodes=args.nodes,
        memory_gb=memory_gb,
        cores=args.cores if args.cores is not None else os.cpu_count() or 1,
        dim=args.dim,
        recall_at10=args.recall_at10,
    )
    # the shard size and graph width the deployment builds with (the settings or their flags)
    settings = command_settings(args)
    plan = make_plan(
        brief,
        load_constants(args.constants),
        settings.base_shard_points,
        settings.hnsw_ef_construct,
    )
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print("\n".join(describe(plan)))
    return 0
