"""Versions of an alias: list them, remove orphans, apply retention, promote, roll back.

Example:
    >>> rollback(store, "docs")        # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v2'

Only `complete` versions are ever served: promote and rollback refuse anything else. When the
alias moves, the version it leaves is stamped `retired_at`; retention deletes a retired version
only after a grace period, so a process that resolved the alias just before the move can finish
its queries (and follows the alias on its next one). Shards that several versions share (deltas,
see edge.py) are deleted with the last version that names them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rag_retriever.errors import CollectionNotFound, InvalidRequest, VersionIncompatible
from rag_retriever.settings import default_of
from rag_retriever.store.base import (
    INCOMPATIBLE,
    CollectionInfo,
    Store,
    parse_collection_name,
    retired_for,
)
from rag_retriever.store.record import STATUS_BUILDING, STATUS_COMPLETE, Lineage, VersionRecord

log = logging.getLogger(__name__)

DEFAULT_KEEP_VERSIONS: int = default_of("keep_versions")
DEFAULT_RETENTION_GRACE_S: float = default_of("retention_grace_s")


def remove_orphans(store: Store, alias: str) -> list[str]:
    """Delete collections of `alias` that never completed and are not served. A complete
    version this rag-retriever cannot read (a newer schema) is not one: retention ages it out
    like the others."""
    served = set(store.aliases().values())
    removed = []
    for info in store.versions(alias):
        if info.status == STATUS_BUILDING and info.name not in served:
            log.warning("removing incomplete collection %s left by an interrupted write", info.name)
            store.delete(info.name)
            removed.append(info.name)
    return removed


def apply_retention(
    store: Store,
    alias: str,
    keep: int = DEFAULT_KEEP_VERSIONS,
    *,
    grace_s: float = DEFAULT_RETENTION_GRACE_S,
) -> list[str]:
    """Keep the `keep` newest complete versions and the served one; delete older ones that
    stopped serving at least `grace_s` seconds ago."""
    served = set(store.aliases().values())
    # versions this rag-retriever cannot read (another schema) age out like complete ones
    complete = [i for i in store.versions(alias) if i.status in (STATUS_COMPLETE, INCOMPATIBLE)]
    # A compaction holds the same points as the version it compacted: the two count as one, so a
    # compaction never pushes out an older version (a rollback target that differs). Only a
    # compaction that was served: one killed before its promotion is no stand-in for its base
    # (the base was deleted past RAG_KEEP_VERSIONS, and nothing served could be rolled back to).
    compacted = {
        i.record.lineage.base
        for i in complete
        if i.record is not None
        and i.record.lineage.compacted
        and (i.name in served or i.record.retired_at is not None)
    }
    counted = [i for i in complete if i.name not in compacted]
    candidates = counted[: max(0, len(counted) - keep)] + [
        i for i in complete if i.name in compacted
    ]
    now = time.time()
    doomed = []
    for info in candidates:
        retired = retired_for(info.record, now) if info.record is not None else None
        if info.name not in served and (retired is None or retired >= grace_s):
            doomed.append(info)
    for info in doomed:
        store.delete(info.name)
    return [i.name for i in doomed]


def point_alias(store: Store, alias: str, name: str, *, rolled_back: Sequence[str] = ()) -> None:
    """Move `alias` to `name` and stamp the version it leaves as retired now (and the versions
    `rolled_back` names as rolled back from, so that no later rollback returns to them). The
    stamps are written before the move: a process killed between the two left the version it
    moved off looking never served (no grace before retention, no rollback to it); stamped
    early, a version still served keeps its stamp only until it is left for good."""
    previous = store.aliases().get(alias)
    now = time.time()
    stamps: dict[str, dict[str, float]] = {r: {"rolled_back_at": now} for r in rolled_back}
    if previous is not None and previous != name:
        stamps[previous] = {**stamps.get(previous, {}), "retired_at": now}
    before: dict[str, VersionRecord] = {}
    for left, changes in stamps.items():
        if left == name:
            continue
        # a version this rag-retriever cannot read is left as it is (retention still counts it)
        with contextlib.suppress(CollectionNotFound, VersionIncompatible):
            record = store.record(left)
            store.put_record(left, dataclasses.replace(record, **changes))  # type: ignore[arg-type]
            before[left] = record
    try:
        store.point_alias(alias, name)
    except BaseException:
        # not moved: the versions stamped keep what they held (a served version left stamped
        # `rolled_back_at` would be passed over by every later rollback)
        for left, record in before.items():
            with contextlib.suppress(Exception):
                store.put_record(left, record)
        raise
    with contextlib.suppress(CollectionNotFound):
        record = store.record(name)
        if record.retired_at is not None or record.rolled_back_at is not None:
            store.put_record(
                name, dataclasses.replace(record, retired_at=None, rolled_back_at=None)
            )


def promote_version(store: Store, alias: str, version: int) -> str:
    """Point `alias` at its complete version `version`; returns the collection name."""
    infos = store.versions(alias)
    match = [i for i in infos if i.version == version]
    if not match:
        known = ", ".join(str(i.version) for i in infos) or "none"
        raise CollectionNotFound(f"{alias!r} has no version {version}; versions: {known}")
    info = match[0]
    if info.status != STATUS_COMPLETE or info.record is None:
        raise InvalidRequest(
            f"{info.name} is {info.status!r}, not complete; only complete versions can be served"
            + (f" ({info.problem})" if info.problem else "")
        )
    point_alias(store, alias, info.name)
    return info.name


def rollback(store: Store, alias: str) -> str:
    """Point `alias` back: at the newest (highest-numbered) complete version older than the one
    it serves now that was served once (never one that was only built: a gate's
    refusal, `--no-promote`) and that no rollback has left since (a second rollback goes
    further back, not forth). A compaction and the version it compacted count as one."""
    served = store.aliases().get(alias)
    if served is None:
        raise CollectionNotFound(f"alias {alias!r} does not exist; nothing to roll back")
    infos = store.versions(alias)
    current = next((i.version for i in infos if i.name == served), None)
    same = same_points(infos, served)
    older = [
        i
        for i in infos
        if i.status == STATUS_COMPLETE
        and i.record is not None
        and current is not None
        and i.version < current
        and i.name not in same
        and i.record.retired_at is not None  # served once
        and i.record.rolled_back_at is None
    ]
    if not older:
        known = ", ".join(str(i.version) for i in infos if i.name not in same) or "none"
        raise InvalidRequest(
            f"{alias!r} serves {served} and no older version that it served before is kept "
            f"(RAG_KEEP_VERSIONS keeps the newest versions after each write; a compaction and "
            f"the version it compacted count as one; versions rolled back from are skipped). "
            f"To serve another version: rag-retriever promote {alias} VERSION (kept: {known})"
        )
    target = older[-1]
    point_alias(store, alias, target.name, rolled_back=sorted(same))
    return target.name


def same_points(infos: Sequence[CollectionInfo], name: str) -> set[str]:
    """`name` and the versions it holds the same points as: the ones compacted into it (a
    compaction of a compaction... of them)."""
    records = {i.name: i.record for i in infos}
    same = {name}
    record = records.get(name)
    while record is not None and record.lineage.compacted and record.lineage.base:
        same.add(record.lineage.base)
        record = records.get(record.lineage.base)
    return same


def describe_versions(
    infos: Sequence[CollectionInfo],
    served: str | None,
    widths: Mapping[str, tuple[int, ...] | None] | None = None,
) -> list[dict[str, Any]]:
    """Each version as the listings show it; `widths`: each one's graph widths
    (Store.graph_widths), where they were read."""
    out = []
    for i in infos:
        r = i.record
        out.append(
            {
                "collection": i.name,
                "version": i.version,
                "status": i.status,
                "points": i.points,
                "serving": i.name == served,
                "fingerprint": r.fingerprint.id if r else None,
                "model": r.fingerprint.model if r else None,
                # how its dense vectors are held (RAG_QUANTIZATION when it was built)
                "quantization": r.quantization if r else None,
                # the ef_construct its HNSW graphs were built at (several: shards of each)
                "graph_widths": list(w) if (w := (widths or {}).get(i.name)) else None,
                # a fusion tuned for this version (`tune-fusion`), else null: the settings' (RAG_FUSION)
                "fusion": dict(r.fusion) if r and r.fusion is not None else None,
                "created_at": r.created_at if r else None,
                # which version it was made from, and deltas since the last full build (not
                # the chunk ids a delta changed: a serving process's cache hint)
                "lineage": _lineage(r.lineage) if r else None,
                "documents": r.documents if r else None,
                "problem": i.problem,
            }
        )
    return out


def _lineage(lineage: Lineage) -> dict[str, Any]:
    out = lineage.to_json()
    out.pop("changed", None)
    return out


def describe_collections(store: Store) -> dict[str, dict[str, Any]]:
    """{alias: {"serving": collection or None, "versions": [...]}} for every versioned alias."""
    aliases = store.aliases()
    groups = sorted({p[0] for n in store.collection_names() if (p := parse_collection_name(n))})
    out = {}
    for alias in groups:
        infos = store.versions(alias)
        out[alias] = {
            "serving": aliases.get(alias),
            "versions": describe_versions(
                infos, aliases.get(alias), {i.name: _graph_widths(store, i) for i in infos}
            ),
        }
    return out


def _graph_widths(store: Store, info: CollectionInfo) -> tuple[int, ...] | None:
    if info.record is None:
        return None
    try:
        return store.graph_widths(info.name)
    except CollectionNotFound:  # deleted while we listed
        return None
