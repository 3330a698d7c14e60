"""The `rag-retriever` command line: ingest, search, collections, promote, rollback, serve, train.

Example:
    rag-retriever ingest docs/ --collection demo
    rag-retriever search "how are chunks sized?" --collection demo -k 5

Settings come from `RAG_*` environment variables; flags override them. Errors print one line
(what, why, the fix) and exit with status 2; a refused promotion exits with 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_retriever import __version__
from rag_retriever.context import EXPAND_KINDS
from rag_retriever.errors import ConfigError, GateRejected, RagError
from rag_retriever.ingest.loaders import describe_suffixes
from rag_retriever.records import MODES, SearchFilter, SearchResult, check_alias
from rag_retriever.settings import (
    Settings,
    choices_of,
    default_of,
    env_name,
    flag_of,
    shown_default,
)

log = logging.getLogger("rag_retriever")


# The settings each kind of command reads. Their flags, types, choices, help and defaults derive
# from the one declaration in settings.py; settings.ENV_ONLY have no flag.
STORE = ("data_dir", "qdrant_url", "log_level")
MODEL = ("embed_model", "device", "dtype", "embed_batch_size")
QUERY = (
    "fusion",
    "dense_top_n",
    "bm25_top_n",
    "rrf_k",
    "rrf_weights",
    "rerank_model",
    "rerank_candidates",
    "rerank_fusion",
    "rerank_batch_size",
    "rerank_max_length",
    "diversity_candidates",
    "expand_tokens",
)
WRITE = (
    "chunk_tokens",
    "chunk_overlap_tokens",
    "keep_versions",
    "retention_grace_s",
    "bm25_rebase_drift",
    "compaction",
    "max_document_chars",
    "qdrant_shards",
    "qdrant_replicas",
    "qdrant_write_consistency",
)
LIMITS = ("default_k", "max_k", "max_query_chars", "max_batch_size", "max_body_bytes")


def _setting_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """One flag per setting in `names`, overriding its RAG_* variable."""
    group = parser.add_argument_group("settings (each flag overrides its RAG_* variable)")
    parser.set_defaults(setting_flags=names)
    for name in names:
        group.add_argument(
            flag_of(name),
            dest=name,
            choices=choices_of(name),
            type=str.upper if name == "log_level" else str,
            metavar=None if choices_of(name) else name.upper(),
            help=f"{env_name(name)}: {Settings.model_fields[name].description} (default {shown_default(name)})",
        )


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    """The environment's settings with the flags given on the command line (values are checked
    by Settings, as environment values are)."""
    overrides = {name: getattr(args, name) for name in getattr(args, "setting_flags", ())}
    overrides.update(extra)
    return Settings.from_env(**overrides)


def _parse_where(items: Sequence[str]) -> dict[str, str | int | bool]:
    equals: dict[str, str | int | bool] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RagError(f"--where expects FIELD=VALUE, got {item!r}")
        value: str | int | bool = raw
        if raw in ("true", "false"):
            value = raw == "true"
        elif raw.lstrip("-").isdigit():
            value = int(raw)
        equals[key] = value
    return equals


# -- commands ---------------------------------------------------------------------------------


def cmd_ingest(args: argparse.Namespace) -> int:
    from rag_retriever.encoder import load_encoder
    from rag_retriever.ingest.loaders import load_documents
    from rag_retriever.ingest.lock import check_unlocked
    from rag_retriever.ingest.writer import ingest_documents
    from rag_retriever.retriever import serving_record
    from rag_retriever.store import open_store

    settings = _settings(args)
    try:
        check_alias(settings.collection)
    except ValueError as exc:
        raise ConfigError(
            f"{exc}; ingest writes a new version of an alias: name the alias"
        ) from None
    check_unlocked(settings.data_dir, settings.collection)  # before seconds of model loading
    # validated fully before anything is written
    corpus = load_documents(
        args.path, max_chars=settings.max_document_chars, follow_symlinks=args.follow_symlinks
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
        "RAG_LOG_LEVEL": "INFO",
    }
    pid = spawn_compaction(report.alias, env=env, log_path=log_path)
    return dataclasses.replace(report, compaction=f"started (pid {pid}, log {log_path})")


def cmd_update(args: argparse.Namespace) -> int:
    from rag_retriever.encoder import load_encoder
    from rag_retriever.ingest.loaders import read_delete_ids, read_upserts
    from rag_retriever.ingest.writer import update_documents
    from rag_retriever.retriever import serving_record
    from rag_retriever.store import open_store

    settings = _settings(args)
    try:
        check_alias(settings.collection)
    except ValueError as exc:
        raise ConfigError(f"{exc}; update writes a new version of an alias: name it") from None
    if not args.upsert and not args.delete and args.delete_ids is None:
        raise ConfigError(
            "nothing to do: give --upsert FILE_OR_FOLDER, --delete ID or --delete-ids FILE"
        )
    # every input is read and validated before anything is loaded or written
    upserts = read_upserts(args.upsert, max_chars=settings.max_document_chars)
    deletes = [*args.delete, *(read_delete_ids(args.delete_ids) if args.delete_ids else [])]
    store = open_store(settings)
    live = serving_record(store, settings.collection)
    encoder = load_encoder(settings, live)
    report = update_documents(
        upserts,
        deletes,
        alias=settings.collection,
        encoder=encoder,
        store=store,
        source=", ".join(str(p) for p in args.upsert) or "delete",
        options=_write_options(settings, args, lock_wait_s=settings.lock_wait_s),
    )
    report = _start_compaction(settings, report)
    _print_ingest(report.to_dict(), args.json)
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    from rag_retriever.ingest.compaction import MERGED_INTO, compact_while_due
    from rag_retriever.store import open_store

    settings = _settings(args)
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
                f"{report.source} merged into {MERGED_INTO[str(report.kind)]} ({report.points} "
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


def cmd_questions(args: argparse.Namespace) -> int:
    from rag_retriever.querylog import questions_from_log

    rows, report = questions_from_log(args.from_log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    if args.json:
        print(json.dumps({**report.to_dict(), "out": str(args.out)}, indent=2))
        return 0
    print(
        f"logged queries {report.queries}, with feedback {report.judged}\n"
        f"questions      {report.questions} written to {args.out} "
        f"({report.duplicates_merged} repeats merged into them)\n"
        f"skipped        {report.negative_only} with only negative feedback, "
        f"{report.without_text} logged without their text (RAG_QUERY_LOG_TEXT=false)"
    )
    if not rows:
        print("no question could be made: send feedback with relevant=true (POST /v1/feedback)")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from rag_retriever.doctor import Doctor, Thresholds
    from rag_retriever.retriever import Retriever

    settings = _settings(args)
    thresholds = Thresholds(
        duplicate_similarity=args.duplicate_similarity,
        max_duplicate_share=args.max_duplicate_share,
        max_boilerplate_share=args.max_boilerplate_share,
        max_truncated_share=args.max_truncated_share,
        max_far_query_share=args.max_far_query_share,
        max_empty_share=args.max_empty_share,
    )
    retriever = Retriever.from_settings(settings.replace(rerank_model=None))
    doctor = Doctor(retriever, collection=settings.collection, thresholds=thresholds)
    checks = doctor.run(log=args.log or (), questions=args.questions)
    failed = [c.name for c in checks if not c.ok]
    if args.json:
        print(
            json.dumps(
                {
                    "collection": doctor.name,
                    "ok": not failed,
                    "checks": [c.__dict__ for c in checks],
                },
                indent=2,
            )
        )
    else:
        print(f"doctor of {settings.collection} -> {doctor.name}")
        for c in checks:
            print(f"{'ok  ' if c.ok else 'FAIL'}  {c.name:<16} {c.summary}")
            if c.meaning:
                print(f"      {'':<16} ({c.meaning})")
        if not args.log:
            print("(no --log: drift and stage health need the query log, RAG_QUERY_LOG)")
    return 1 if failed else 0


def cmd_search(args: argparse.Namespace) -> int:
    from rag_retriever.retriever import Retriever

    settings = _settings(args)
    retriever = Retriever.from_settings(settings, mode=args.mode)  # bm25: no model loads
    flt = SearchFilter(
        doc_ids=tuple(args.doc) if args.doc else None, equals=_parse_where(args.where)
    )
    result = retriever.retrieve(
        args.query,
        k=args.k,
        mode=args.mode,
        filter=flt,
        diversity=args.diversity,
        expand=args.expand,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(format_result(result))
    return 0


def format_result(result: SearchResult, width: int = 100) -> str:
    """A readable table: rank, title, per-stage ranks, a snippet."""

    def rank(stage: Any) -> str:
        return "-" if stage is None else str(stage.rank)

    lines = [
        f"{result.mode} search in {result.collection}: {len(result.hits)} hits "
        f"({', '.join(f'{k} {v:.1f}ms' for k, v in result.timings_ms.items())})",
        f"{'#':>3}  {'score':>8}  {'dense':>5} {'bm25':>5} {'fused':>5} {'rerank':>6}  "
        "title / snippet",
    ]
    for h in result.hits:
        lines.append(
            f"{h.rank:>3}  {h.score:>8.4f}  {rank(h.dense):>5} {rank(h.bm25):>5} "
            f"{rank(h.fused):>5} {rank(h.rerank):>6}  {h.title} [{h.doc_id} {h.start}:{h.end}]"
        )
        snippet = " ".join(h.text.split())
        lines.append("     " + textwrap.shorten(snippet, width=width, placeholder=" ..."))
        if h.context is not None:
            c = h.context
            lines.append(
                f"{'':>5}context: chunks {c.first_chunk}-{c.last_chunk} [{c.start}:{c.end}] "
                f"{textwrap.shorten(' '.join(c.text.split()), width=width - 40, placeholder=' ...')}"
            )
        if h.matched_terms:
            lines.append(f"{'':>5}matched: {', '.join(h.matched_terms)}")
    if result.fusion:
        lines.append(f"fusion: {result.fusion}")
    lines.extend(f"note: {n}" for n in result.notices)
    return "\n".join(lines)


def cmd_collections(args: argparse.Namespace) -> int:
    from rag_retriever.fusion import Fusion
    from rag_retriever.store import open_store
    from rag_retriever.store.catalog import describe_collections

    out = describe_collections(open_store(_settings(args)))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if not out:
        print("no collections yet; run `rag-retriever ingest PATH --collection NAME`")
    for alias, info in out.items():
        print(f"{alias} -> {info['serving'] or '(no alias)'}")
        for v in info["versions"]:
            mark = "*" if v["serving"] else " "
            lineage = v.get("lineage") or {}
            base = f"v{lineage['base'].rsplit('__v', 1)[-1]}" if lineage.get("base") else ""
            if lineage.get("compacted"):
                made = f"compaction of {base} ({lineage['deltas']} deltas since the full build)"
            elif base:
                made = f"delta {lineage['deltas']} on {base}"
            else:
                made = "full build"
            print(
                f"  {mark} v{v['version']:<3} {v['status']:<9} {v['points']:>7} points  "
                f"{v['model']}@{v['fingerprint']}  {made:<14} {v['created_at']}  "
                f"{v['collection']}"
            )
            if v.get("problem"):
                print(f"         {v['problem']}")
            if v.get("fusion"):
                print(f"         fusion tuned: {Fusion.from_json(v['fusion']).describe()}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from rag_retriever.store import open_store
    from rag_retriever.store.catalog import rollback

    store = open_store(_settings(args))
    name = rollback(store, args.name)
    print(f"{args.name} -> {name}")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    from rag_retriever.store import open_store
    from rag_retriever.store.catalog import promote_version

    store = open_store(_settings(args))
    name = promote_version(store, args.name, args.version)
    print(f"{args.name} -> {name}")
    return 0


def cmd_train_embedder(args: argparse.Namespace) -> int:
    from rag_retriever.profiles import resolve_model
    from rag_retriever.retriever import Retriever
    from rag_retriever.training.embedder import EmbedderTrainingConfig, train_embedder

    settings = _settings(args, collection=args.collection)
    retriever = Retriever.from_settings(settings)  # the collection's own model mines negatives
    base = (
        resolve_model(args.base)
        if args.base
        else resolve_model(
            settings.embed_model,
            query_prefix=settings.query_prefix,
            passage_prefix=settings.passage_prefix,
            pooling=settings.pooling,
        )
    )
    prefixes = {"query_prefix": args.query_prefix, "passage_prefix": args.passage_prefix}
    config = EmbedderTrainingConfig(
        **{name: value for name, value in prefixes.items() if value is not None},
        hard_negatives=args.hard_negatives,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        epochs=args.epochs,
        learning_rate=args.lr,
        temperature=args.temperature,
        max_questions=args.max_questions,
        val_fraction=args.val_fraction,
        seed=args.seed,
        name=args.name,
    )
    meta = train_embedder(
        retriever,
        args.questions,
        args.out,
        collection=settings.collection,
        base=base,
        config=config,
        device=settings.device,
        dtype=settings.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    return _print_training(
        meta,
        f"{args.out} ({meta['fingerprint']['model']}@{meta['fingerprint']['id']})",
        f"RAG_EMBED_MODEL={args.out} rag-retriever ingest CORPUS --collection "
        f"{settings.collection} --gate QUESTIONS.jsonl  (a new model means a full re-ingest)",
        verdict=training_verdict(meta, new="mrr@10", old="mrr@10", what="the fine-tuned embedder"),
        allow_worse=args.allow_worse,
    )


# Exit status of a training command whose model validated worse than what it would replace.
EXIT_WORSE = 4


def training_verdict(meta: dict[str, Any], *, new: str, old: str, what: str) -> tuple[bool, str]:
    """(keep?, one plain line): the new model's validation MRR@10 against what it would replace
    (the embedder before training; for a reranker, hybrid search without it)."""
    from rag_retriever.eval.judge import judge

    before, after = meta["validation_before"], meta["validation_after"]
    baseline = after.get(old) if old != new else before.get(old)
    n = int(after.get("questions", 0))
    if not n or baseline is None or new not in after:
        return True, f"unjudged: {what} was not validated (no held-out questions)"
    verdict = judge({"mrr@10": after[new]}, {"mrr@10": baseline}, metric="mrr@10")
    interval = meta.get("mrr10_gain_ci95")
    ci = f", 95% CI {interval[0]:+.4f}..{interval[1]:+.4f}" if interval else ""
    figures = (
        f"MRR@10 {after[new]:.4f} vs {baseline:.4f} ({verdict.change:+.4f}{ci}) "
        f"on {n} held-out questions"
    )
    if verdict.worse:
        return False, f"WORSE: {what} would make retrieval worse: {figures}"
    return True, f"better: {figures}" if verdict.better else f"no change: {figures}"


def _print_training(
    meta: dict[str, Any],
    model: str,
    next_step: str,
    *,
    verdict: tuple[bool, str] = (True, ""),
    allow_worse: bool = False,
) -> int:
    """The summary both training commands print: examples, loss, validation before -> after,
    the verdict; the next step only when the model helps. Returns the exit status."""
    before, after = meta["validation_before"], meta["validation_after"]
    examples = meta["examples"]
    print(f"model       {model}")
    print(
        f"examples    {examples['train']} train, {examples['validation']} validation "
        f"(held out: {meta['validation_questions']}), skipped {examples['skipped']}"
    )
    print(
        f"loss        {meta['loss_first_20']:.3f} -> {meta['loss_last_20']:.3f} "
        f"over {meta['steps']} steps"
    )
    for key in (k for k in after if "@" in k):  # the metrics, not the counts
        was = f"{before[key]:.4f}" if key in before else "  -   "
        print(f"validation  {key}: {was} -> {after[key]:.4f}")
    if any("@" in k and k not in before for k in after):
        print("            (-: the head was new; a random head is not validated before training)")
    print(f"time        {meta['time_s']:.0f}s")
    keep, line = verdict
    print(f"verdict     {line}")
    if keep:
        print(f"next        {next_step}")
        return 0
    print("next        none: keep what you serve now (the model was written, but do not use it)")
    return 0 if allow_worse else EXIT_WORSE


def cmd_train_reranker(args: argparse.Namespace) -> int:
    from rag_retriever.retriever import Retriever
    from rag_retriever.training.reranker import RerankerTrainingConfig, train_reranker

    settings = _settings(args, collection=args.collection, rerank_model=None)
    retriever = Retriever.from_settings(settings.replace(rerank_model=None))
    config = RerankerTrainingConfig(
        negatives=args.negatives,
        epochs=args.epochs,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        learning_rate=args.lr,
        head_learning_rate=args.head_lr,
        max_length=args.max_length,
        max_questions=args.max_questions,
        val_fraction=args.val_fraction,
        seed=args.seed,
        depth=args.depth,
        loss=args.loss,
        freeze_layers=args.freeze_layers,
        pooler_init=args.pooler_init,
        name=args.name,
    )
    meta = train_reranker(
        retriever,
        args.questions,
        args.out,
        collection=settings.collection,
        base=args.base or default_of("embed_model"),
        config=config,
        device=settings.device,
        dtype=settings.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    return _print_training(
        meta,
        f"{args.out} ({meta['name']})",
        f"RAG_RERANK_MODEL={args.out} rag-retriever search QUESTION --mode rerank",
        verdict=training_verdict(
            meta, new="rerank+hybrid mrr@10", old="hybrid mrr@10", what="the reranker"
        ),
        allow_worse=args.allow_worse,
    )


def cmd_tune_fusion(args: argparse.Namespace) -> int:
    from rag_retriever.eval.questions import load_questions
    from rag_retriever.retriever import Retriever
    from rag_retriever.training.fusion import tune_fusion

    settings = _settings(args, collection=args.collection, rerank_model=None)
    questions, problems = load_questions(args.questions)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    retriever = Retriever.from_settings(settings.replace(rerank_model=None))
    report = tune_fusion(
        retriever,
        questions,
        collection=settings.collection,
        held_out_fraction=args.held_out,
        seed=args.seed,
        store=not args.dry_run,
        progress=not args.no_progress,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    print(f"collection  {report.collection}: {report.candidates} fusions tried")
    print(f"default     {report.default.describe()}")
    print(f"best        {report.best.describe()}")
    names = ("mrr@10", "recall@1", "recall@5", "recall@50", "recall@100")
    print(f"{'':<22}" + "".join(f"{n:>11}" for n in names) + f"{'questions':>11}")
    for part, figures in (("train", report.train), ("held-out", report.held_out)):
        for which, f in figures.items():
            values = f.metrics()
            print(
                f"{part + ' ' + which:<22}"
                + "".join(f"{values[n]:>11.4f}" for n in names)
                + f"{f.questions:>11}"
            )
    if report.stored:
        print(f"stored      the best fusion now serves {report.collection} (rollback restores)")
    elif args.dry_run:
        print("not stored  (--dry-run)")
    else:
        print(
            "not stored  the best fusion did not beat the default on the held-out questions "
            "(MRR@10, without losing recall@50 or @100)"
        )
    return 0


def _training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--collection", required=True, help="collection to mine positives/negatives from"
    )
    p.add_argument(
        "--questions", type=Path, required=True, help="labelled training questions (.jsonl)"
    )
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    p.add_argument("--epochs", type=int, default=1, help="passes over the questions (1)")
    p.add_argument("--max-questions", type=int, help="use only the first N questions")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out validation part (0.1)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        help="texts (embedder) or pairs (reranker) per forward pass with gradients; memory "
        "follows it, not --batch-size, and the gradient does not depend on it; 0 = the whole "
        "batch at once, for a GPU with memory to spare (8)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split and shuffling (0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument(
        "--allow-worse",
        action="store_true",
        help=f"exit 0 even when the model validates worse than what it replaces ({EXIT_WORSE})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rag-retriever",
        description="Retrieval backend for RAG: ingest, search, evaluate, serve.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_ingest(sub)
    _add_update(sub)
    _add_questions(sub)
    _add_doctor(sub)
    _add_search(sub)
    _add_versions(sub)
    _add_train_embedder(sub)
    _add_train_reranker(sub)
    _add_tune_fusion(sub)
    _add_improve(sub)
    _add_serve(sub)
    return parser


def _add_ingest(sub: Any) -> None:
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
    p.add_argument("--gate-k", type=int, default=10, help="the k of the gate's recall@k (10)")
    p.add_argument("--min-recall", type=float, default=0.0, help="refuse below this recall@k (0)")
    p.add_argument(
        "--max-regression", type=float, default=0.01, help="refuse if recall@k drops more (0.01)"
    )
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="ingest files that a folder links to outside itself (refused by default)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="rebuild every chunk into a new collection (default: a delta from the live version "
        "when its model and chunking are unchanged)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # The gate evaluates in the query path's primary mode, so the query settings apply.
    _setting_flags(p, "collection", *WRITE, *MODEL, *QUERY, *STORE)
    p.set_defaults(func=cmd_ingest)


def _add_doctor(sub: Any) -> None:
    """`doctor`: noise floor, duplicates, truncation, drift, stage health; exit 1 on a failure."""
    from rag_retriever.doctor import Thresholds

    default = Thresholds()
    p = sub.add_parser(
        "doctor",
        help="monitoring checks of a collection and its query log (exit 1 when one fails)",
    )
    p.add_argument("--log", type=Path, nargs="+", metavar="DIR", help="query log directories")
    p.add_argument("--questions", type=Path, help="labelled questions: drift is measured from them")
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
    _setting_flags(p, "collection", *MODEL, *STORE)
    p.set_defaults(func=cmd_doctor)


def _add_questions(sub: Any) -> None:
    """`questions --from-log DIR`: labelled questions from logged queries with feedback."""
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
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _setting_flags(p, "log_level")
    p.set_defaults(func=cmd_questions)


def _add_update(sub: Any) -> None:
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
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--delete", action="append", default=[], metavar="ID", help="a document id to delete"
    )
    group.add_argument(
        "--delete-ids", type=Path, metavar="FILE", help="a file of document ids, one per line"
    )
    p.add_argument(
        "--no-promote", action="store_true", help="build the version, do not move the alias"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _setting_flags(p, "collection", *WRITE, "lock_wait_s", *MODEL, *STORE)
    p.set_defaults(func=cmd_update)


def _add_search(sub: Any) -> None:
    """`search QUERY`."""
    p = sub.add_parser("search", help="search a collection")
    p.add_argument("query", help="the question")
    p.add_argument("-k", type=int, default=None, help="number of hits (default RAG_DEFAULT_K)")
    p.add_argument("--mode", choices=MODES, help="default: rerank with a reranker, else hybrid")
    p.add_argument(
        "--doc", action="append", default=[], help="only chunks of this doc id (repeatable)"
    )
    p.add_argument("--where", action="append", default=[], help="metadata FIELD=VALUE (repeatable)")
    p.add_argument(
        "--diversity",
        type=float,
        default=None,
        help="0 (ranked order) to 1: reorder the top hits by maximal marginal relevance",
    )
    p.add_argument(
        "--expand",
        choices=EXPAND_KINDS,
        default=None,
        help="print each hit's context: the chunks around it, or its section (up to "
        "RAG_EXPAND_TOKENS, --expand-tokens)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _setting_flags(p, "collection", *QUERY, "default_k", "max_k", "max_query_chars", *MODEL, *STORE)
    p.set_defaults(func=cmd_search)


def _add_versions(sub: Any) -> None:
    """`collections`, `rollback`, `promote`: the versions behind an alias."""
    p = sub.add_parser("collections", help="list aliases, versions, point counts, fingerprints")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    _setting_flags(p, *STORE)
    p.set_defaults(func=cmd_collections)

    p = sub.add_parser(
        "compact",
        help="merge the shards of an alias's served version into one base (embedded store)",
    )
    p.add_argument(
        "--force", action="store_true", help="merge even when the deltas have not outgrown the base"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _setting_flags(p, "collection", "lock_wait_s", "keep_versions", "retention_grace_s", *STORE)
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser("rollback", help="point an alias at its previous complete version")
    p.add_argument("name", help="the alias")
    _setting_flags(p, *STORE)
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("promote", help="point an alias at a given complete version")
    p.add_argument("name", help="the alias")
    p.add_argument("--version", type=int, required=True, help="the version number to serve")
    _setting_flags(p, *STORE)
    p.set_defaults(func=cmd_promote)


def _add_train_embedder(sub: Any) -> None:
    """`train-embedder`: fine-tune the embedding model on labelled questions."""
    p = sub.add_parser("train-embedder", help="fine-tune the embedding model on labelled questions")
    _training_args(p)
    p.add_argument("--base", help="model to start from (default RAG_EMBED_MODEL)")
    # Unset: the trainer's own defaults (E5's prefixes, EmbedderTrainingConfig), whatever the
    # base model's profile says (RAG_QUERY_PREFIX is the prefix of the model being served).
    p.add_argument(
        "--query-prefix", help="prefix learned for questions (default: E5's query prefix)"
    )
    p.add_argument(
        "--passage-prefix", help="prefix learned for chunks (default: E5's passage prefix)"
    )
    p.add_argument(
        "--hard-negatives", type=int, default=1, help="mined hard negatives per question (1)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="questions per step (32)")
    p.add_argument("--lr", type=float, default=3e-5, help="learning rate (3e-05)")
    p.add_argument(
        "--temperature", type=float, default=0.05, help="contrastive loss temperature (0.05)"
    )
    p.add_argument(
        "--name", help="model name recorded in its profile (default <base>-ft-<collection>)"
    )
    _setting_flags(p, *MODEL, *STORE)
    p.set_defaults(func=cmd_train_embedder)


def _add_train_reranker(sub: Any) -> None:
    """`train-reranker`: train a cross-encoder reranker on labelled questions."""
    p = sub.add_parser(
        "train-reranker", help="train a cross-encoder reranker on labelled questions"
    )
    _training_args(p)
    p.add_argument("--base", help=f"model to start from (default {shown_default('embed_model')})")
    # The same defaults as RerankerTrainingConfig (a test checks), without importing torch here.
    p.add_argument(
        "--negatives", type=int, default=3, help="hybrid-mined negatives per question (3)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="questions per step (8)")
    p.add_argument("--lr", type=float, default=1e-4, help="body learning rate (0.0001)")
    p.add_argument(
        "--head-lr", type=float, default=1e-3, help="pooler + classifier learning rate (0.001)"
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=256,
        help="tokens of question + chunk (256 = RAG_RERANK_MAX_LENGTH's default)",
    )
    p.add_argument(
        "--pooler-init",
        choices=("auto", "identity", "keep"),
        default="auto",
        help="identity: reset the pooler to the identity; auto (default): do so when the head "
        "is new and the base's pooler was never trained (sentence-transformers); keep: leave it",
    )
    p.add_argument(
        "--depth", type=int, default=30, help="hybrid candidates mined per question (30)"
    )
    p.add_argument(
        "--loss",
        choices=("listwise", "pointwise"),
        default="listwise",
        help="listwise: softmax over each question's candidates (default); pointwise: BCE",
    )
    p.add_argument(
        "--freeze-layers", type=int, default=0, help="freeze embeddings + first N layers"
    )
    p.add_argument("--name", help="reranker name recorded with it")
    _setting_flags(p, *MODEL, *STORE)
    p.set_defaults(func=cmd_train_reranker)


def _add_tune_fusion(sub: Any) -> None:
    """`tune-fusion`: fit a version's fusion on labelled questions."""
    p = sub.add_parser(
        "tune-fusion",
        help="fit the fusion of dense and BM25 (RRF k, weights, depths, or DBSF) on questions",
    )
    p.add_argument("--collection", required=True, help="alias or version to tune")
    p.add_argument("--questions", type=Path, required=True, help="labelled questions (.jsonl)")
    p.add_argument(
        "--held-out", type=float, default=0.3, help="part checked, split by document (0.3)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split (0)")
    p.add_argument("--dry-run", action="store_true", help="report only; store nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _setting_flags(p, *MODEL, *STORE)
    p.set_defaults(func=cmd_tune_fusion)


def _add_improve(sub: Any) -> None:
    """`improve`: embedder, fusion and reranker fitted to the user's questions, then a gate."""
    p = sub.add_parser(
        "improve",
        help="fit the embedder, the fusion and a reranker to labelled questions; promote the "
        "result only when it beats the live version on held-out questions",
    )
    p.add_argument("--collection", required=True, help="the alias to improve")
    p.add_argument("--questions", type=Path, required=True, help="labelled questions (.jsonl)")
    p.add_argument(
        "--steps",
        default="embedder,fusion,reranker",
        help="comma-separated steps to try; they run in the order embedder, fusion, reranker "
        "(embedder,fusion,reranker)",
    )
    p.add_argument(
        "--budget",
        type=_duration,
        help="time budget of this invocation, e.g. 45m or 2h; the steps are sized to it",
    )
    p.add_argument(
        "--folds",
        type=int,
        help="judge each step by k-fold cross-validation over every question and refit the kept "
        "ones on all of them (2-10), or 1 for one held-out part (--held-out, --fusion-part); "
        "default 5 folds below 2,000 questions, else 1",
    )
    p.add_argument(
        "--held-out",
        type=float,
        default=0.3,
        help="with --folds 1: the part judged on, split by document (0.3)",
    )
    p.add_argument(
        "--fusion-part",
        type=float,
        default=0.2,
        help="with --folds 1: the part the fusion is fitted on, split by document; no model "
        "trains on it (0.2)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split and training (0)")
    p.add_argument(
        "--max-regression",
        type=float,
        default=0.01,
        help="refuse to promote if held-out recall@10 falls by more (0.01)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        help="where the run keeps its state and question splits, to resume "
        "(default RAG_DATA_DIR/improve/ALIAS)",
    )
    p.add_argument("--json", action="store_true", help="print the final state as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    # The models are the versions' own; these settings shape the run.
    _setting_flags(
        p,
        "device",
        "dtype",
        "embed_batch_size",
        "rerank_candidates",
        "keep_versions",
        "retention_grace_s",
        *STORE,
    )
    p.set_defaults(func=cmd_improve)


def _duration(text: str) -> float:
    """Seconds in "90s", "45m", "2h" or a bare number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration like 45m, 2h or 90s: {text!r}"
        ) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"the budget must be positive: {text!r}")
    return seconds


def cmd_improve(args: argparse.Namespace) -> int:
    from rag_retriever.training.improve import ImproveOptions, improver

    settings = _settings(args, collection=args.collection)
    options = ImproveOptions(
        steps=tuple(s.strip() for s in args.steps.split(",") if s.strip()),
        budget_s=args.budget,
        held_out=args.held_out,
        fusion_part=args.fusion_part,
        seed=args.seed,
        max_regression=args.max_regression,
        progress=not args.no_progress,
        folds=args.folds,
    )
    work_dir = args.work_dir or settings.data_dir / "improve" / settings.collection
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    run = improver(settings, args.questions, work_dir=work_dir, options=options, say=say)
    state = run.run()
    if args.json:
        print(json.dumps(state, indent=2, default=str))
    else:
        _print_improve_table(state)
    return 0


def _print_improve_table(state: dict[str, Any]) -> None:
    """One before -> after row per step, on the held-out questions."""
    results = state["results"]
    print(
        f"\n{'step':<10}{'kept':>6}{'mrr@10':>9}{'recall@1':>10}{'recall@10':>11}"
        f"{'time':>8}{'peak MB':>9}"
    )
    for step in ("baseline", "embedder", "candidate", "fusion", "reranker", "gate"):
        r = results.get(step)
        if r is None:
            continue
        figures = r.get("figures") or r.get("new") or {}
        kept = {True: "yes", False: "no"}.get(r.get("kept", r.get("promoted")), "")
        row = f"{step:<10}{kept:>6}"
        if figures:
            row += f"{figures['mrr@10']:>9.4f}{figures['recall@1']:>10.4f}{figures['recall@10']:>11.4f}"
        else:
            row += " " * 30
        print(f"{row}{r.get('time_s', 0):>7.0f}s{r.get('peak_rss_mb') or 0:>9.0f}")


def _add_serve(sub: Any) -> None:
    """`serve`: the HTTP service."""
    p = sub.add_parser("serve", help="serve search over HTTP (FastAPI; OpenAPI docs at /docs)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default 127.0.0.1, this machine only; 0.0.0.0 for all)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    _setting_flags(
        p,
        "collection",
        *QUERY,
        *LIMITS,
        *MODEL,
        *STORE,
        "write_window_ms",
        "lock_wait_s",
        "query_log",
        "query_log_text",
        "metrics_port",
        "cache_size",
        "cache_threshold",
    )
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from rag_retriever import server  # FastAPI and the models load only for this command

    server.serve(_settings(args), host=args.host, port=args.port)
    return 0


# What a stop keeps, for the commands that write: an ingest removes its unfinished version before
# it exits (the alias is only ever moved to a complete one); training writes its model only when
# it is done; improve saves each finished step. Other commands (serve, search, ...) keep nothing.
_TRAINING_STOP = "no model was written (a model is written only when training is done)"
_STOP_NOTES = {
    "ingest": "nothing unfinished was kept (an unpromoted partial version is removed, the alias "
    "serves what it served before, the ingest lock is released)",
    "train-embedder": _TRAINING_STOP,
    "train-reranker": _TRAINING_STOP,
    "tune-fusion": "nothing was stored",
    "improve": "each finished step is saved; run the same command again to resume",
}


def _stopped(how: str, command: str) -> str:
    note = _STOP_NOTES.get(command)
    return f"{how}: {note}" if note else how


class Stopped(BaseException):
    """SIGTERM arrived (`docker stop`, systemd): unwinds like Ctrl-C, so cleanup runs."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise Stopped()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        level = _settings(args).log_level
        logging.basicConfig(
            level=getattr(logging, level.upper(), logging.INFO),
            format="%(levelname)s %(name)s: %(message)s",
        )
        return int(args.func(args))
    except RagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_stopped("interrupted", args.command), file=sys.stderr)
        return 130
    except Stopped:
        print(_stopped("stopped by SIGTERM", args.command), file=sys.stderr)
        return 143
    except BrokenPipeError:  # `rag-retriever search ... | head`: the reader left, not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
