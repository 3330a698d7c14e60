"""Versions of an alias: list them, remove orphans, apply retention, promote, roll back.

Example:
    >>> rollback(store, "docs")        # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v2'

Only `complete` versions are ever served: promote and rollback refuse anything else. When the
alias moves, the version it leaves is stamped `retired_at`; retention deletes a retired version
only after a grace period, so a process that resolved the alias just before the move can finish
its queries (and follows the alias on its next one).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from rag_retriever.errors import CollectionNotFound, InvalidRequest
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.records import Chunk, Document
from rag_retriever.store import (
    STATUS_COMPLETE,
    CollectionInfo,
    Store,
    parse_collection_name,
    retired_for,
)

log = logging.getLogger(__name__)


def remove_orphans(store: Store, alias: str) -> list[str]:
    """Delete collections of `alias` that never completed and are not served."""
    served = set(store.aliases().values())
    removed = []
    for info in store.versions(alias):
        if info.status != STATUS_COMPLETE and info.name not in served:
            log.warning(
                "removing incomplete collection %s left by an interrupted ingest", info.name
            )
            store.delete(info.name)
            removed.append(info.name)
    return removed


def apply_retention(store: Store, alias: str, keep: int, *, grace_s: float = 60.0) -> list[str]:
    """Keep the `keep` newest complete versions and the served one; delete older ones that
    stopped serving at least `grace_s` seconds ago."""
    served = set(store.aliases().values())
    complete = [i for i in store.versions(alias) if i.status == STATUS_COMPLETE]
    now = time.time()
    doomed = []
    for info in complete[: max(0, len(complete) - keep)]:
        retired = retired_for(info.meta, now)
        if info.name not in served and (retired is None or retired >= grace_s):
            doomed.append(info)
    for info in doomed:
        store.delete(info.name)
    return [i.name for i in doomed]


def point_alias(store: Store, alias: str, name: str) -> None:
    """Move `alias` to `name` and stamp the version it leaves as retired now."""
    previous = store.aliases().get(alias)
    store.point_alias(alias, name)
    if previous is not None and previous != name:
        with contextlib.suppress(CollectionNotFound):
            meta = store.metadata(previous)
            store.update_metadata(previous, {**meta, "retired_at": time.time()})
    with contextlib.suppress(CollectionNotFound):
        meta = store.metadata(name)
        if "retired_at" in meta:
            store.update_metadata(name, {k: v for k, v in meta.items() if k != "retired_at"})


def promote_version(store: Store, alias: str, version: int) -> str:
    """Point `alias` at its complete version `version`; returns the collection name."""
    infos = store.versions(alias)
    match = [i for i in infos if i.version == version]
    if not match:
        known = ", ".join(str(i.version) for i in infos) or "none"
        raise CollectionNotFound(f"{alias!r} has no version {version}; versions: {known}")
    info = match[0]
    if info.status != STATUS_COMPLETE:
        raise InvalidRequest(
            f"{info.name} is {info.status!r}, not complete; only complete versions can be served"
        )
    point_alias(store, alias, info.name)
    return info.name


def rollback(store: Store, alias: str) -> str:
    """Point `alias` at the newest complete version older than the one it serves now."""
    served = store.aliases().get(alias)
    if served is None:
        raise CollectionNotFound(f"alias {alias!r} does not exist; nothing to roll back")
    infos = store.versions(alias)
    current = next((i.version for i in infos if i.name == served), None)
    older = [
        i
        for i in infos
        if i.status == STATUS_COMPLETE and current is not None and i.version < current
    ]
    if not older:
        raise InvalidRequest(
            f"{alias!r} serves {served} and no older complete version is kept "
            f"(RAG_KEEP_VERSIONS keeps the newest versions after each ingest)"
        )
    point_alias(store, alias, older[-1].name)
    return older[-1].name


def describe_versions(infos: Sequence[CollectionInfo], served: str | None) -> list[dict[str, Any]]:
    return [
        {
            "collection": i.name,
            "version": i.version,
            "status": i.status,
            "points": i.points,
            "serving": i.name == served,
            "fingerprint": (i.fingerprint or {}).get("id"),
            "model": (i.fingerprint or {}).get("model"),
            # a fusion tuned for this version (`tune-fusion`), else null: the settings' RRF
            "fusion": i.meta.get("fusion"),
            "created_at": i.meta.get("created_at"),
        }
        for i in infos
    ]


def describe_collections(store: Store) -> dict[str, dict[str, Any]]:
    """{alias: {"serving": collection or None, "versions": [...]}} for every versioned alias."""
    aliases = store.aliases()
    groups = sorted({p[0] for n in store.collection_names() if (p := parse_collection_name(n))})
    return {
        alias: {
            "serving": aliases.get(alias),
            "versions": describe_versions(store.versions(alias), aliases.get(alias)),
        }
        for alias in groups
    }


def documents_of(store: Store, name: str) -> LoadedCorpus:
    """The documents version `name` was built from, put together again from its chunks (which
    tile each document: `doc.text[c.start:c.end] == c.text`), with their titles and metadata; a
    new version built from them (another model, a copy) holds the same text."""
    by_doc: dict[str, list[Chunk]] = {}
    for record in store.scroll(name):
        chunk = Chunk.from_payload(record.payload)
        by_doc.setdefault(chunk.doc_id, []).append(chunk)
    documents = []
    for doc_id in sorted(by_doc):
        chunks = sorted(by_doc[doc_id], key=lambda c: c.chunk_index)
        text = ""
        for chunk in chunks:
            if chunk.start > len(text):
                raise InvalidRequest(
                    f"{name}: the chunks of document {doc_id!r} leave a gap at character "
                    f"{len(text)}; re-ingest it from its source files"
                )
            text = text[: chunk.start] + chunk.text
        documents.append(Document(doc_id, chunks[0].title, text, chunks[0].metadata))
    return LoadedCorpus(tuple(documents), 0, f"{name} (its own chunks)")
