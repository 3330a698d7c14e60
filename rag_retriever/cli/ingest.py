"""The write commands: `ingest`, `update` and `compact` (and their reports)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_retriever.cli.common import (
    MODEL,
    QUERY,
    STORE,
    WRITE,
    command_settings,
    reads_files,
    setting_flags,
)
from rag_retriever.errors import ConfigError, GateRejected
from rag_retriever.ingest.loaders import describe_suffixes
from rag_retriever.records import TENANT_FIELD, Document, check_alias, check_tenant, tenant_of
from rag_retriever.settings import (
    Settings,
)

# -- commands ---------------------------------------------------------------------------------


def cmd_ingest(args: argparse.Namespace) -> int:
    from rag_retriever.ingest.loaders import load_documents
    from rag_retriever.ingest.lock import check_unlocked
    from rag_retriever.ingest.writer import ingest_documents
    from rag_retriever.models.encoder import load_encoder
    from rag_retriever.query.retriever import serving_record
    from rag_retriever.store import open_store

    settings = command_settings(args)
    try:
        check_alias(settings.collection)
    except ValueError as exc:
        raise ConfigError(
            f"{exc}; ingest writes a new version of an alias: name the alias"
        ) from None
    check_unlocked(settings.data_dir, settings.collection)  # before seconds of model loading
    # validated fully before anything is written
    corpus = load_documents(
        args.path,
        max_chars=settings.max_document_chars,
        follow_symlinks=args.follow_symlinks,
        include_hidden=args.include_hidden,
    )
    store = open_store(settings)
    # a re-ingest keeps the collection's model unless the settings name one
    encoder = load_encoder(settings, serving_record(store, settings.collection))
    gate = None
    if args.gate is not None:
        from rag_retriever.eval.gate import make_gate

        gate = make_gate(
            args.gate,
            settings=settings,
            encoder=encoder,
            store=store,
            k=args.gate_k,
            min_recall=args.min_recall,
            max_regression=args.max_regression,
        )
    try:
        report = ingest_documents(
            corpus,
            alias=settings.collection,
            encoder=encoder,
            store=store,
            full=args.full,
            options=_write_options(settings, args, gate=gate, lock_wait_s=0),
        )
        report = _start_compaction(settings, report)
    except GateRejected as exc:
        if exc.report is not None:
            _print_ingest(exc.report.to_dict(), args.json)  # type: ignore[attr-defined]
        print(f"promotion refused: {exc}", file=sys.stderr)
        return 3
    _print_ingest(report.to_dict(), args.json)
    return 0


def _write_options(
    settings: Settings, args: argparse.Namespace, *, gate: Any = None, lock_wait_s: float
) -> Any:
    from rag_retriever.ingest.writer import WriteOptions

    return WriteOptions.from_settings(
        settings,
        lock_wait_s=lock_wait_s,
        promote=not args.no_promote,
        gate=gate,
        progress=not args.no_progress,
        # this process exits after the write: a background compaction runs as its own process
        compaction="inline" if settings.compaction == "inline" else "deferred",
    )


def _start_compaction(settings: Settings, report: Any) -> Any:
    """A compaction that is due, started as a detached `rag-retriever compact` (background)."""
    if report.compaction != "due" or settings.compaction in ("deferred", "inline"):
        return report
    from rag_retriever.ingest.compaction import spawn_compaction

    log_path = settings.data_dir / "logs" / f"compact-{report.alias}.log"
    env = {
        "RAG_DATA_DIR": str(settings.data_dir),
        "RAG_KEEP_VERSIONS": str(settings.keep_versions),
        "RAG_RETENTION_GRACE_S": str(settings.retention_grace_s),
        "RAG_BASE_SHARD_POINTS": str(settings.base_shard_points),
        "RAG_HNSW_EF_CONSTRUCT": str(settings.hnsw_ef_construct),
        "RAG_LOG_LEVEL": "INFO",
        "RAG_TRACING": settings.tracing,
    }
    # given as flags, these reach the child only this way (it reads the environment)
    for name, value in (
        ("RAG_OTLP_ENDPOINT", settings.otlp_endpoint),
        ("RAG_QDRANT_URL", settings.qdrant_url),
    ):
        if value:
            env[name] = str(value)
    pid = spawn_compaction(report.alias, env=env, log_path=log_path)
    return dataclasses.replace(report, compaction=f"started (pid {pid}, log {log_path})")


def cmd_update(args: argparse.Namespace) -> int:
    from rag_retriever.ingest.loaders import read_delete_ids, read_upserts
    from rag_retriever.ingest.validation import validate_delete_ids
    from rag_retriever.ingest.writer import update_documents
    from rag_retriever.query.retriever import serving_record
    from rag_retriever.store import open_store

    settings = command_settings(args)
    try:
        check_alias(settings.collection)
    except ValueError as exc:
        raise ConfigError(f"{exc}; update writes a new version of an alias: name it") from None
    if not args.upsert and not args.delete and args.delete_ids is None:
        raise ConfigError(
            "nothing to do: give --upsert FILE_OR_FOLDER, --delete ID or --delete-ids FILE"
        )
    # every input is read and validated before anything is loaded or written
    upserts = read_upserts(
        args.upsert,
        max_chars=settings.max_document_chars,
        root=args.root,
        include_hidden=args.include_hidden,
    )
    deletes = [*args.delete, *(read_delete_ids(args.delete_ids) if args.delete_ids else [])]
    validate_delete_ids(deletes, source="--delete")  # argv may hold undecodable bytes
    documents = _in_tenant(upserts.documents, args.tenant)
    store = open_store(settings)
    live = serving_record(store, settings.collection)
    if live is not None:
        from rag_retriever.ingest.path_ids import refuse_second_copies

        # a folder's ids are relative to --root when given
        bases = {args.root or folder: ids for folder, ids in upserts.folder_ids.items()}
        refuse_second_copies(store, settings.collection, bases, deleting=deletes)

    def encoder() -> Any:
        # only when there are chunks to embed: a delete-only or unchanged update loads no model
        # (nor torch)
        from rag_retriever.models.encoder import load_encoder

        return load_encoder(settings, live)

    report = update_documents(
        documents,
        [(args.tenant or "", i) for i in deletes],
        alias=settings.collection,
        load_encoder=encoder,
        store=store,
        source=", ".join(str(p) for p in args.upsert) or "delete",
        options=_write_options(settings, args, lock_wait_s=settings.lock_wait_s),
    )
    report = _start_compaction(settings, report)
    _print_ingest(report.to_dict(), args.json)
    return 0


def _in_tenant(documents: Sequence[Document], tenant: str | None) -> list[Document]:
    """`documents` in `tenant` (update --tenant): those that name no tenant get it; one that
    names another is an error (exit 2), nothing written."""
    if tenant is None:
        return list(documents)
    try:
        check_tenant(tenant)
    except ValueError as exc:
        raise ConfigError(f"--tenant: {exc}") from None
    others = [d.id for d in documents if tenant_of(d.metadata) not in ("", tenant)]
    if others:
        raise ConfigError(
            f"--tenant {tenant}: {len(others)} document(s) name another tenant "
            f"({', '.join(map(repr, others[:5]))}); nothing was written"
        )
    return [
        d
        if tenant_of(d.metadata)
        else dataclasses.replace(d, metadata={**d.metadata, TENANT_FIELD: tenant})
        for d in documents
    ]


def cmd_compact(args: argparse.Namespace) -> int:
    from rag_retriever.ingest.compaction import compact_while_due, merged_into
    from rag_retriever.store import open_store

    settings = command_settings(args)
    try:
        check_alias(settings.collection)
    except ValueError as exc:
        raise ConfigError(f"{exc}; compact makes a new version of an alias: name it") from None
    reports = compact_while_due(
        open_store(settings),
        settings.collection,
        force=args.force,
        lock_dir=settings.data_dir,
        lock_wait_s=settings.lock_wait_s,
        keep_versions=settings.keep_versions,
        retention_grace_s=settings.retention_grace_s,
    )
    if args.json:
        print(json.dumps({"compactions": [r.to_dict() for r in reports]}, indent=2))
        return 0
    for report in reports:
        if report.outcome == "compacted":
            print(
                f"{report.alias} -> {report.collection}: {report.shards_merged} shards of "
                f"{report.source} merged into {merged_into(report.kind, report.shards_made)} ({report.points} "
                f"points) in "
                f"{report.seconds:.1f} s"
            )
        else:
            print(f"{report.alias}: {report.outcome.replace('_', ' ')}: {report.message}")
    return 0


def _print_ingest(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    if report["kind"] == "unchanged":
        print(
            f"collection  {report['collection']}  (unchanged: no new version; still serving as "
            f"{report['alias']!r})"
        )
    else:
        state = "now serving" if report["promoted"] else "built, NOT promoted"
        print(f"collection  {report['collection']}  ({state} as {report['alias']!r})")
    made = {
        "full": "full build" + (f" ({report['full_reason']})" if report["full_reason"] else ""),
        "delta": f"delta on {report['base']}",
        "unchanged": "nothing to write",
    }[report["kind"]]
    print(f"made        {made}")
    print(f"model       {report['fingerprint']}")
    print(
        f"documents   {report['upserted']} upserted, {report['deleted']} deleted, "
        f"{report['unchanged']} unchanged, {report['not_found']} not found "
        f"({report['documents']} in the version, {report['skipped_empty']} empty skipped)\n"
        f"chunks      {report['chunks']} in the version; written {report['encoded'] + report['reused']} "
        f"({report['tokens']} tokens, {report['truncated']} truncated), removed {report['removed']}\n"
        f"vectors     {report['encoded']} encoded, {report['reused']} reused from "
        f"{report['previous'] or '-'}"
    )
    if report.get("skipped_files"):
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(report["skipped_files"].items()))
        print(
            f"skipped     {kinds} (a folder's files are read when {describe_suffixes()}; "
            f"ingest a .jsonl on its own; a link to a folder outside it is not followed)"
        )
    if report.get("gate"):
        print(f"gate        {report['gate']['summary']}")
    if report["orphans_removed"]:
        print(f"cleaned     {', '.join(report['orphans_removed'])} (left by an interrupted ingest)")
    if report["deleted_versions"]:
        print(f"retention   deleted {', '.join(report['deleted_versions'])}")
    if report.get("compaction"):
        print(
            f"compaction  {report['compaction']} (the deltas outgrew the base, or too many delta "
            f"shards piled up: they are merged off the write path, served as the next version "
            f"when done)"
            if report["compaction"] != "due"
            else "compaction  due: run `rag-retriever compact --collection "
            f"{report['alias']}` (RAG_COMPACTION=deferred)"
        )
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in report["timings_s"].items())
    print(f"time        {stages}")


def include_hidden_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--include-hidden",
        action="store_true",
        help="read a folder's hidden files and folders too (a name starting with a dot: .git, "
        ".venv, .github; skipped and counted by default)",
    )


def add_ingest(sub: Any) -> None:
    """`ingest PATH`: a new version of a collection."""
    p = sub.add_parser(
        "ingest", help="ingest a .jsonl file or a folder as a new collection version"
    )
    p.add_argument(
        "path",
        type=Path,
        help=f".jsonl of {{id, title, text}} or a folder of {describe_suffixes()}",
    )
    p.add_argument(
        "--no-promote", action="store_true", help="build the version, do not move the alias"
    )
    p.add_argument("--gate", type=Path, help="labelled questions: evaluate before promoting")
    reads_files(p, "gate")
    p.add_argument("--gate-k", type=int, default=10, help="the k of the gate's recall@k (10)")
    p.add_argument("--min-recall", type=float, default=0.0, help="refuse below this recall@k (0)")
    p.add_argument(
        "--max-regression", type=float, default=0.01, help="refuse if recall@k drops more (0.01)"
    )
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="ingest files and folders that a folder links to outside itself (a linked file is "
        "refused by default, a linked folder skipped and counted)",
    )
    include_hidden_flag(p)
    p.add_argument(
        "--full",
        action="store_true",
        help="rebuild every chunk into a new collection (default: a delta from the live version "
        "when its model and chunking are unchanged)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, plain lines otherwise)",
    )
    # The gate evaluates in the query path's primary mode, so the query settings apply.
    setting_flags(p, "collection", *WRITE, "quantization", *MODEL, *QUERY, *STORE)
    p.set_defaults(func=cmd_ingest)


def add_update(sub: Any) -> None:
    """`update`: upsert and delete documents of a collection as a new (delta) version."""
    p = sub.add_parser(
        "update",
        help="upsert and delete documents: a new version made from the live one plus the change",
    )
    p.add_argument(
        "--upsert",
        type=Path,
        action="append",
        default=[],
        metavar="FILE_OR_FOLDER",
        help="documents to add or replace: a .jsonl or a folder, as for ingest (repeatable)",
    )
    p.add_argument(
        "--root",
        type=Path,
        metavar="FOLDER",
        help="a folder's ids are its files' paths relative to this folder (default: the folder "
        "passed); give the folder the collection was ingested from, e.g. --upsert kb/policies "
        "--root kb",
    )
    include_hidden_flag(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--delete", action="append", default=[], metavar="ID", help="a document id to delete"
    )
    group.add_argument(
        "--delete-ids", type=Path, metavar="FILE", help="a file of document ids, one per line"
    )
    p.add_argument(
        "--tenant",
        help="the tenant of this change (docs/tenants.md): upserted documents that name none "
        "get it, and --delete ids are its documents",
    )
    p.add_argument(
        "--no-promote", action="store_true", help="build the version, do not move the alias"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, plain lines otherwise)",
    )
    setting_flags(p, "collection", *WRITE, "lock_wait_s", *MODEL, *STORE)
    p.set_defaults(func=cmd_update)
