"""Compaction: a version's shards merged into one new shard (or a base of several, past
RAG_BASE_SHARD_POINTS), off the write path.

Example:
    >>> compact(store, "docs").outcome                                  # doctest: +SKIP
    'compacted'

On the embedded engine (Qdrant Edge, see store/edge.py) a delta adds a small shard to the shards
of the version it is made from. When the deltas outgrow the base (`BASE_MERGE_FRACTION`), every
shard is worth merging into a new base: a full HNSW build, minutes at a million chunks. When
more than MAX_DELTA_SHARDS delta shards pile up and merging them is more than an update should
wait for (INLINE_MERGE_POINTS), the newest of them are worth merging into one delta shard. With
`RAG_COMPACTION=background` (the default) the update that finds either does not merge: it serves
its version at once, and a compaction runs beside it:

1. under the alias's write lock, briefly: the served version's shards are noted in a marker
   that the compacting process keeps locked (retention keeps the new shard; updates leave the
   noted shards unmerged);
2. without the lock: their live points are copied into a new shard (vectors as they are, nothing
   embedded again) and its HNSW graph is built, while updates go on;
3. under the lock again: the next version is the new shard in place of the noted shards, plus
   the delta shards that updates added meanwhile (with the ids they tombstoned in the noted
   shards tombstoned in the new one); the alias moves to it and retention runs.

A background compaction goes on with the next one while the version it made is still due (the
updates that landed meanwhile may have piled up delta shards), so nothing due waits for the next
update.

The compacted version holds the same points with the same vectors and BM25 weights as the one
it replaces, so answers do not change (tested). A process killed at any step leaves the alias on
a complete version, and the next write removes what it left (a stale marker names nothing).

Where it runs: in a child process of the process that wrote (`compaction="background"`: the
Python API and the HTTP service; not a thread, see `compact_in_background`); as `rag-retriever
compact --collection ALIAS`, which the CLI's `ingest` and `update` start detached
(`compaction="deferred"` leaves the start to the caller); or inside the write itself
(`RAG_COMPACTION=inline`, the behaviour before compaction moved off the write path). On a Qdrant server a version is a filter over one physical collection (store/server.py):
nothing to compact.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rag_retriever import tracing
from rag_retriever.errors import RagError
from rag_retriever.ingest.lock import COMPACTION, IngestLock, default_lock_dir
from rag_retriever.settings import Compaction as Mode
from rag_retriever.settings import default_of
from rag_retriever.store import EdgeStore, Store, collection_name, shards
from rag_retriever.store.base import HNSW_EF_CONSTRUCT
from rag_retriever.store.catalog import apply_retention, point_alias
from rag_retriever.store.record import STATUS_BUILDING, Lineage, stamp
from rag_retriever.store.shards import BASE_SHARD_POINTS

# named, not __name__: the child process runs this module as __main__
log = logging.getLogger("rag_retriever.ingest.compaction")

__all__ = [
    "CompactionReport",
    "Mode",
    "compact",
    "compact_in_background",
    "compact_while_due",
    "merged_into",
    "spawn_compaction",
]

Outcome = Literal["compacted", "not_due", "running", "dropped", "not_sharded"]


@dataclass(frozen=True)
class CompactionReport:
    alias: str
    outcome: Outcome
    # "base": every shard into a new base; "deltas": the newest delta shards into one
    kind: str | None = None
    # the new version, and the version whose shards it merged
    collection: str | None = None
    source: str | None = None
    shards_merged: int = 0
    # the shards it wrote: one, or a base of several past RAG_BASE_SHARD_POINTS
    shards_made: int = 1
    points: int = 0
    seconds: float = 0.0
    deleted_versions: tuple[str, ...] = ()
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["deleted_versions"] = list(self.deleted_versions)
        return out


def compact(
    store: Store,
    alias: str,
    *,
    force: bool = False,
    lock_dir: Path | None = None,
    lock_wait_s: float = default_of("lock_wait_s"),
    keep_versions: int = default_of("keep_versions"),
    retention_grace_s: float = default_of("retention_grace_s"),
) -> CompactionReport:
    """Merge shards of the version `alias` serves, as the next version (see the module
    docstring): all of them into a new base when the deltas have outgrown it (or `force`), else
    its newest delta shards into one when more than MAX_DELTA_SHARDS are read; else not due."""
    with tracing.span("rag.compaction", alias=alias, force=force):
        report = _compact(
            store,
            alias,
            force=force,
            lock_dir=lock_dir,
            lock_wait_s=lock_wait_s,
            keep_versions=keep_versions,
            retention_grace_s=retention_grace_s,
        )
        tracing.set_attributes(
            outcome=report.outcome,
            kind=report.kind,
            collection=report.collection,
            source=report.source,
            shards=report.shards_merged,
            points=report.points,
        )
    return report


def _compact(
    store: Store,
    alias: str,
    *,
    force: bool,
    lock_dir: Path | None,
    lock_wait_s: float,
    keep_versions: int,
    retention_grace_s: float,
) -> CompactionReport:
    if not isinstance(store, EdgeStore):
        return CompactionReport(
            alias,
            "not_sharded",
            message="a Qdrant server version is a filter over one physical collection: nothing to compact",
        )
    started = time.perf_counter()
    lock_dir = lock_dir or default_lock_dir(store)
    if store.running_compaction(alias) is not None:
        return CompactionReport(alias, "running", message="another compaction of it runs")
    with IngestLock(lock_dir, alias, wait_s=lock_wait_s, holder=COMPACTION):
        job = store.begin_compaction(alias, force=force)
    if job is None:
        if store.running_compaction(alias) is not None:
            return CompactionReport(alias, "running", message="another compaction of it runs")
        return CompactionReport(
            alias,
            "not_due",
            message="nothing to compact: its deltas have not outgrown its base and it reads at "
            f"most {shards.MAX_DELTA_SHARDS} delta shards (--force merges them anyway)"
            if not force
            else "nothing to compact: it reads one shard without tombstones",
        )
    deleted: list[str] = []
    try:
        live = sum(s.live for s in job.segments)
        log.info(
            "%s: compacting %d shards of %s (%d live points) into %s",
            alias,
            len(job.segments),
            job.source,
            live,
            merged_into(job.kind, len(job.shards)),
        )
        job = store.build_compaction(job)
        with IngestLock(lock_dir, alias, wait_s=lock_wait_s, holder=COMPACTION):
            onto = store.aliases().get(alias)
            if onto is None:
                return _dropped(job.source, alias, started, "the alias was removed meanwhile")
            record = store.record(onto)
            version = store.next_version(alias)
            name = collection_name(alias, record.fingerprint.slug, version)
            building = dataclasses.replace(
                record,
                version=version,
                status=STATUS_BUILDING,
                lineage=Lineage(
                    base=onto,
                    full_build=record.lineage.full_build,
                    deltas=record.lineage.deltas,
                    compacted=True,
                    changed=(),  # the same points, in fewer shards
                ),
                source=f"compaction of {onto}"
                + ("" if job.kind == "base" else f" ({len(job.segments)} delta shards merged)"),
                created_at=stamp(),
                completed_at=None,
                retired_at=None,
            )
            if not store.adopt_compaction(job, name, building, onto=onto):
                return _dropped(
                    job.source, alias, started, f"{onto} no longer reads the compacted shards"
                )
            try:
                points = store.count(name)
                if points != record.chunks:
                    raise RuntimeError(
                        f"compaction of {onto} is inconsistent: {points} points in {name}, "
                        f"{record.chunks} chunks in {onto}"
                    )
                store.put_record(
                    name,
                    building.completed(
                        documents=record.documents, chunks=record.chunks, at=stamp()
                    ),
                )
            except BaseException:
                store.delete(name)
                raise
            point_alias(store, alias, name)
            deleted = apply_retention(store, alias, keep_versions, grace_s=retention_grace_s)
    finally:
        store.end_compaction(job)
    seconds = round(time.perf_counter() - started, 3)
    # the report says it to the caller (`compact` prints it, the background child logs it)
    log.debug(
        "%s: compacted %d shards of %s into %s (%d points) in %.1f s; serving %s",
        alias,
        len(job.segments),
        job.source,
        merged_into(job.kind, len(job.shards)),
        job.points,
        seconds,
        name,
    )
    return CompactionReport(
        alias,
        "compacted",
        kind=job.kind,
        collection=name,
        source=job.source,
        shards_merged=len(job.segments),
        shards_made=len(job.shards),
        points=job.points,
        seconds=seconds,
        deleted_versions=tuple(deleted),
    )


def merged_into(kind: str | None, shards: int) -> str:
    """What a compaction of `kind` merged the shards into, for messages."""
    if kind == "deltas":
        return "one delta shard"
    return "one base" if shards == 1 else f"a base of {shards} shards"


# How many compactions a background run does in a row at most (each one merges what the last left
# due); a stream of updates that keeps it due longer waits for the next update to start another.
MAX_ROUNDS = 16


def compact_while_due(store: Store, alias: str, **options: Any) -> list[CompactionReport]:
    """`compact(store, alias, **options)`, then again while the version it made is due (at most
    MAX_ROUNDS): the reports, in order. `force` applies to the first only."""
    reports = [compact(store, alias, **options)]
    options = {**options, "force": False}
    while (
        len(reports) < MAX_ROUNDS
        and reports[-1].outcome == "compacted"
        and reports[-1].collection is not None
        and store.compaction_due(reports[-1].collection)
    ):
        reports.append(compact(store, alias, **options))
    return reports


def _dropped(source: str, alias: str, started: float, why: str) -> CompactionReport:
    log.warning("%s: compaction of %s dropped: %s", alias, source, why)
    return CompactionReport(
        alias,
        "dropped",
        source=source,
        seconds=round(time.perf_counter() - started, 3),
        message=why,
    )


# -- starting one ---------------------------------------------------------------------------------

# Why a process and not a thread: the engine holds the GIL while it builds a shard's HNSW graph
# (measured: a thread optimizing a 20,000-point shard for 7.2 s stopped the other threads of its
# process for 7.1 s). In a thread, a compaction stalled every query and update of the process (the
# HTTP service's) for the whole build: at 100k chunks one update waited 23.8 s on it.
_MODULE = "rag_retriever.ingest.compaction"
_children: list[subprocess.Popen[bytes]] = []
_children_lock = threading.Lock()


def compact_in_background(
    store: Store,
    alias: str,
    *,
    lock_dir: Path | None = None,
    lock_wait_s: float = default_of("lock_wait_s"),
    keep_versions: int = default_of("keep_versions"),
    retention_grace_s: float = default_of("retention_grace_s"),
) -> subprocess.Popen[bytes]:
    """`compact_while_due` of `alias` in a child process (`python -m
    rag_retriever.ingest.compaction`), on the embedded store's root. Its log lines go to this
    process's stderr at this process's log level; errors are logged there, not raised here. It
    finishes even when this process exits first (killing it at any step is safe, see the module
    docstring); Ctrl-C in a terminal stops both."""
    if not isinstance(store, EdgeStore):
        raise TypeError("only the embedded store (Qdrant Edge) keeps shards to compact")
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    command = [
        sys.executable,
        "-m",
        _MODULE,
        "--root",
        str(store.root),
        "--alias",
        alias,
        "--lock-dir",
        str(lock_dir or default_lock_dir(store)),
        "--lock-wait-s",
        str(lock_wait_s),
        "--keep-versions",
        str(keep_versions),
        "--retention-grace-s",
        str(retention_grace_s),
        # the merged shards are built as this store builds its own
        "--shard-points",
        str(store.shard_points),
        "--ef-construct",
        str(store.ef_construct),
        "--log-level",
        str(level),
    ]
    # the child imports this package from where this process did: the folder holding
    # rag_retriever/ (this file is rag_retriever/ingest/compaction.py)
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    with _children_lock:
        _children[:] = [c for c in _children if c.poll() is None]  # reaps finished ones
        child = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            # traced as this process is, flags included (the child reads its environment)
            env={**os.environ, **tracing.child_environment(), "PYTHONPATH": path},
        )
        _children.append(child)
    log.info("%s: compaction started in process %d", alias, child.pid)
    return child


def wait_for_compactions(timeout_s: float | None = None) -> bool:
    """Wait for the compactions this process started; True when none is left running."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _children_lock:
        children = list(_children)
    for child in children:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(left)
    return all(c.poll() is not None for c in children)


def main(argv: list[str] | None = None) -> int:
    """The child process of `compact_in_background`: exit 0 when done (compacted, or nothing
    was due), 1 when the compaction failed (logged; the alias is unchanged)."""
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--alias", required=True)
    parser.add_argument("--lock-dir", type=Path, required=True)
    parser.add_argument("--lock-wait-s", type=float, default=default_of("lock_wait_s"))
    parser.add_argument("--keep-versions", type=int, default=default_of("keep_versions"))
    parser.add_argument("--retention-grace-s", type=float, default=default_of("retention_grace_s"))
    parser.add_argument("--shard-points", type=int, default=BASE_SHARD_POINTS)
    parser.add_argument("--ef-construct", type=int, default=HNSW_EF_CONSTRUCT)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:  # the parent's RAG_TRACING, passed on in the environment: a trace of its own
        tracing.configure(
            os.environ.get("RAG_TRACING", "off"),
            endpoint=os.environ.get("RAG_OTLP_ENDPOINT") or None,
        )
    except RagError as exc:
        log.warning("%s: background compaction runs without tracing: %s", args.alias, exc)
    store = EdgeStore(args.root, shard_points=args.shard_points, ef_construct=args.ef_construct)
    try:
        reports = compact_while_due(
            store,
            args.alias,
            lock_dir=args.lock_dir,
            lock_wait_s=args.lock_wait_s,
            keep_versions=args.keep_versions,
            retention_grace_s=args.retention_grace_s,
        )
    except RagError as exc:  # a message for the operator, not a stack trace
        log.error("%s: background compaction failed; the alias is unchanged: %s", args.alias, exc)
        return 1
    except Exception:
        log.exception("%s: background compaction failed; the alias is unchanged", args.alias)
        return 1
    finally:
        store.close()
    for report in reports:
        if report.outcome == "dropped":
            log.warning("%s: background compaction dropped: %s", args.alias, report.message)
        elif report.outcome == "compacted":
            log.info(
                "%s: compacted %d shards of %s into %s (%d points) in %.1f s; serving %s",
                args.alias,
                report.shards_merged,
                report.source,
                merged_into(report.kind, report.shards_made),
                report.points,
                report.seconds,
                report.collection,
            )
    return 0


def spawn_compaction(alias: str, *, env: Mapping[str, str], log_path: Path) -> int:
    """`rag-retriever compact --collection ALIAS` as a detached process (it outlives the caller,
    in its own session); its output goes to `log_path`. Returns its pid."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "rag_retriever.cli", "compact", "--collection", alias]
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    return process.pid


if __name__ == "__main__":
    sys.exit(main())
