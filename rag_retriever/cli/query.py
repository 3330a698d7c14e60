"""The read commands: `search`, and the versions of a collection (`collections`, `promote`,
`rollback`)."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Callable
from typing import Any

from rag_retriever.cli.common import (
    MODEL,
    QUERY,
    STORE,
    command_settings,
    parse_where,
    setting_flags,
)
from rag_retriever.cli.ingest import cmd_compact
from rag_retriever.errors import ConfigError
from rag_retriever.query.context import EXPAND_KINDS
from rag_retriever.records import MODES, SearchFilter, SearchResult


def cmd_search(args: argparse.Namespace) -> int:
    from rag_retriever.query.retriever import Retriever

    settings = command_settings(args)
    # a bad filter is refused before the model loads, naming the flags it came from
    try:
        condition = json.loads(args.filter) if args.filter is not None else None
    except ValueError as exc:  # json.JSONDecodeError
        raise ConfigError(f"--filter: {exc}") from None
    try:
        flt = SearchFilter(
            doc_ids=tuple(args.doc) if args.doc else None,
            equals=parse_where(args.where),
            where=condition,
        )
    except (ValueError, TypeError) as exc:
        given = [f for f, v in (("--filter", args.filter), ("--where", args.where)) if v]
        raise ConfigError(f"{', '.join(given) or '--doc'}: {exc}") from None
    retriever = Retriever.from_settings(settings, mode=args.mode)  # bm25: no model loads
    result = retriever.retrieve(
        args.query,
        k=args.k,
        mode=args.mode,
        filter=flt,
        diversity=args.diversity,
        expand=args.expand,
        min_score=args.min_score,
        tenant=args.tenant,
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
    from rag_retriever.query.fusion import Fusion
    from rag_retriever.records import UNQUANTIZED
    from rag_retriever.store import open_store
    from rag_retriever.store.catalog import describe_collections

    settings = command_settings(args)
    store = open_store(settings)
    out = describe_collections(store)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if not out:
        print(
            f"no collections yet in {store.where}; run `rag-retriever ingest PATH --collection NAME`"
        )
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
            if v.get("quantization") not in (None, UNQUANTIZED):
                print(f"         vectors: {v['quantization']} (float32 originals on disk)")
            if (line := _width_line(v.get("graph_widths"), settings.hnsw_ef_construct)) is not None:
                print(f"         {line}")
            if v.get("fusion"):
                print(f"         fusion tuned: {Fusion.from_json(v['fusion']).describe()}")
    return 0


def _width_line(widths: list[int] | None, now: int) -> str | None:
    """A version's graph width, said where it is not the width new shards are built at."""
    if not widths or widths == [now]:
        return None
    built = ", ".join(str(w) for w in widths)
    return (
        f"graph width{'s' if len(widths) > 1 else ''}: {built} (new shards build at {now}, "
        f"RAG_HNSW_EF_CONSTRUCT; a full build, `ingest --full`, rebuilds every graph at it)"
    )


def cmd_rollback(args: argparse.Namespace) -> int:
    from rag_retriever.store.catalog import rollback

    return _move_alias(args, lambda store: rollback(store, args.name))


def cmd_promote(args: argparse.Namespace) -> int:
    from rag_retriever.store.catalog import promote_version

    return _move_alias(args, lambda store: promote_version(store, args.name, args.version))


def _move_alias(args: argparse.Namespace, move: Callable[[Any], str]) -> int:
    """`move` the alias while holding its write lock (waiting up to RAG_LOCK_WAIT_S for a write
    in flight): a write that finished after a rollback would move the alias back to a version
    made from the one rolled back from, and retention would run between the choice of a version
    and the move."""
    from rag_retriever.ingest.lock import IngestLock
    from rag_retriever.store import open_store

    settings = command_settings(args)
    store = open_store(settings)
    with IngestLock(settings.data_dir, args.name, wait_s=settings.lock_wait_s):
        name = move(store)
    print(f"{args.name} -> {name}")
    return 0


def add_search(sub: Any) -> None:
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
        "--filter",
        metavar="JSON",
        help='a metadata condition: {"field": F, "equals"|"in"|"range": ...}, or "all", "any", '
        '"not" of conditions, e.g. \'{"field": "year", "range": {"gte": 2020}}\' '
        "(docs/querying.md)",
    )
    p.add_argument(
        "--tenant", help="only this tenant's documents (docs/tenants.md); default: every one"
    )
    p.add_argument(
        "--min-score",
        type=float,
        default=None,
        help="leave out hits scoring below it (the mode's scale: dense cosine, bm25 score, "
        "hybrid fused score; rerank: the fused rank score, at most ~0.033, by default "
        "(RAG_RERANK_FUSION=rrf), the cross-encoder's logit with RAG_RERANK_FUSION=none)",
    )
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
    setting_flags(p, "collection", *QUERY, "default_k", "max_k", "max_query_chars", *MODEL, *STORE)
    p.set_defaults(func=cmd_search)


def add_versions(sub: Any) -> None:
    """`collections`, `rollback`, `promote`: the versions behind an alias."""
    p = sub.add_parser("collections", help="list aliases, versions, point counts, fingerprints")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    setting_flags(p, *STORE)
    p.set_defaults(func=cmd_collections)

    p = sub.add_parser(
        "compact",
        help="merge the shards of an alias's served version (into one base, or its newest delta "
        "shards into one; embedded store)",
    )
    p.add_argument(
        "--force", action="store_true", help="merge even when the deltas have not outgrown the base"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    setting_flags(
        p,
        "collection",
        "lock_wait_s",
        "keep_versions",
        "retention_grace_s",
        "base_shard_points",
        "hnsw_ef_construct",
        *STORE,
    )
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser("rollback", help="point an alias at its previous complete version")
    p.add_argument("name", help="the alias")
    setting_flags(p, *STORE)
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("promote", help="point an alias at a given complete version")
    p.add_argument("name", help="the alias")
    p.add_argument("--version", type=int, required=True, help="the version number to serve")
    setting_flags(p, *STORE)
    p.set_defaults(func=cmd_promote)
