"""Write a corpus into a new, versioned collection and move the alias only when it is complete.

Example:
    >>> report = ingest_documents(corpus, alias="docs", encoder=enc, store=store,
    ...                           index_root=Path("rag-data/indexes"))    # doctest: +SKIP
    >>> report.collection                                                   # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v2'

Steps: chunk every document (all input was validated before this point) -> create collection
`<alias>__<model>-<dim>__v<N>` marked `building` -> for each block of chunks, reuse the vector of
an identical chunk of the live version when it was embedded with the same model fingerprint, else
encode -> upsert -> build and save the BM25 sidecar -> check that Qdrant, the chunk table and BM25
hold the same number of chunks -> mark `complete` -> optional promotion gate -> swap the alias in
one call -> delete versions beyond the retention count.

Any exception (or Ctrl-C) before the swap deletes the new collection and leaves the alias as it
was. A process killed outright leaves a `building` collection behind; the next ingest of the
alias removes such orphans before it starts. A new fingerprint lands in a collection named after
the new model, so vectors of two models never share a collection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm

from ingest.chunking import Chunker, ChunkingConfig
from ingest.loaders import LoadedCorpus
from ingest.lock import IngestLock
from ingest.versions import apply_retention, remove_orphans
from rag_retriever.chunk_index import ChunkIndex
from rag_retriever.encoder import Encoded, Fingerprint
from rag_retriever.errors import GateRejected
from rag_retriever.records import Chunk
from rag_retriever.store import STATUS_BUILDING, STATUS_COMPLETE, QdrantStore, collection_name

log = logging.getLogger(__name__)

# Chunks per step: reuse is looked up and missing vectors are encoded for a whole block at once
# (few, full encoder batches even when only a handful of chunks changed), then upserted in
# smaller batches so that memory stays flat on any corpus size.
ENCODE_BLOCK = 1024
UPSERT_BATCH = 256


class PassageEncoder(Protocol):
    """What the writer needs of an encoder (a real `Encoder`, or a wrapper in tests)."""

    fingerprint: Fingerprint
    max_seq_length: int

    @property
    def special_tokens(self) -> int: ...

    def count_tokens(self, texts: Sequence[str]) -> list[int]: ...

    def encode_passages(self, passages: Sequence[str], *, progress: bool = False) -> Encoded: ...


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    summary: str  # printed whatever the decision
    details: dict[str, Any] = field(default_factory=dict)


# (new collection, live collection or None) -> decision
Gate = Callable[[str, str | None], GateDecision]


@dataclass(frozen=True)
class IngestReport:
    alias: str
    collection: str
    version: int
    fingerprint: str
    documents: int
    skipped_empty: int
    chunks: int
    tokens: int
    truncated: int
    reused: int
    encoded: int
    removed: int
    promoted: bool
    previous: str | None
    deleted_versions: tuple[str, ...]
    orphans_removed: tuple[str, ...]
    timings_s: dict[str, float]
    gate: GateDecision | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "gate"}
        out["deleted_versions"] = list(self.deleted_versions)
        out["orphans_removed"] = list(self.orphans_removed)
        if self.gate is not None:
            out["gate"] = {
                "promote": self.gate.promote,
                "summary": self.gate.summary,
                **self.gate.details,
            }
        return out


def chunking_config_for(
    encoder: PassageEncoder, chunk_tokens: int, overlap_tokens: int
) -> ChunkingConfig:
    """Chunk sizes that fit the encoder's window with its passage prefix and special tokens."""
    prefix = encoder.fingerprint.passage_prefix
    return ChunkingConfig(
        chunk_tokens=chunk_tokens,
        overlap_tokens=overlap_tokens,
        max_seq_length=encoder.max_seq_length,
        special_tokens=encoder.special_tokens,
        prefix_tokens=encoder.count_tokens([prefix])[0] if prefix else 0,
    )


def ingest_documents(
    corpus: LoadedCorpus,
    *,
    alias: str,
    encoder: PassageEncoder,
    store: QdrantStore,
    index_root: Path,
    lock_dir: Path | None = None,
    chunk_tokens: int = 200,
    overlap_tokens: int = 48,
    keep_versions: int = 2,
    promote: bool = True,
    gate: Gate | None = None,
    progress: bool = False,
) -> IngestReport:
    """Ingest `corpus` as the next version of `alias`; see the module docstring for the steps."""
    if not corpus.documents:
        raise ValueError(f"{corpus.source}: no non-empty documents to ingest")
    with IngestLock(lock_dir or index_root.parent, alias):
        return _ingest_locked(
            corpus,
            alias=alias,
            encoder=encoder,
            store=store,
            index_root=index_root,
            chunking=chunking_config_for(encoder, chunk_tokens, overlap_tokens),
            keep_versions=keep_versions,
            promote=promote,
            gate=gate,
            progress=progress,
        )


def _ingest_locked(
    corpus: LoadedCorpus,
    *,
    alias: str,
    encoder: PassageEncoder,
    store: QdrantStore,
    index_root: Path,
    chunking: ChunkingConfig,
    keep_versions: int,
    promote: bool,
    gate: Gate | None,
    progress: bool,
) -> IngestReport:
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = round(now - clock, 3)
        clock = now

    orphans = remove_orphans(store, alias, index_root)
    chunks = Chunker(encoder.count_tokens, chunking).chunk_all(corpus.documents)
    lap("chunk")

    fingerprint = encoder.fingerprint
    live_name = store.aliases().get(alias)
    reusable = _reusable_vectors(store, index_root, live_name, fingerprint)
    lap("load_reusable")

    version = store.next_version(alias)
    name = collection_name(alias, fingerprint.slug, version)
    meta: dict[str, Any] = {
        "alias": alias,
        "version": version,
        "status": STATUS_BUILDING,
        "fingerprint": fingerprint.to_json(),
        "source": corpus.source,
        "model_source": getattr(encoder, "source", None),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    store.create(name, fingerprint.dim, meta)
    try:
        reused, encoded, truncated = _write_vectors(
            store, name, chunks, encoder, reusable, progress=progress
        )
        lap("embed_upsert")
        index = ChunkIndex.build(chunks, collection=name)
        index.save(index_root)
        lap("bm25")
        _verify(store, index_root, name, len(chunks))
        live_hashes = reusable.hashes if reusable else set()
        new_hashes = {c.content_hash for c in chunks}
        meta.update(
            status=STATUS_COMPLETE,
            documents=len(corpus.documents),
            chunks=len(chunks),
            completed_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        store.update_metadata(name, meta)
        lap("verify")
    except BaseException:
        log.error("ingest of %s failed; removing the partial collection %s", alias, name)
        store.delete(name)
        ChunkIndex.remove(index_root, name)
        raise

    decision = gate(name, live_name) if gate is not None else None
    lap("gate")
    promoted = False
    deleted: list[str] = []
    if promote and (decision is None or decision.promote):
        store.point_alias(alias, name)
        promoted = True
        deleted = apply_retention(store, alias, index_root, keep_versions)
    lap("promote")
    report = IngestReport(
        alias=alias,
        collection=name,
        version=version,
        fingerprint=fingerprint.describe(),
        documents=len(corpus.documents),
        skipped_empty=corpus.skipped_empty,
        chunks=len(chunks),
        tokens=sum(c.n_tokens for c in chunks),
        truncated=truncated,
        reused=reused,
        encoded=encoded,
        removed=len(live_hashes - new_hashes),
        promoted=promoted,
        previous=live_name,
        deleted_versions=tuple(deleted),
        orphans_removed=tuple(orphans),
        timings_s=timings,
        gate=decision,
    )
    if decision is not None and not decision.promote and promote:
        raise GateRejected(decision.summary, report)
    return report


@dataclass
class _Reusable:
    collection: str
    point_of_hash: dict[str, str]  # content hash -> point id in the live collection

    @property
    def hashes(self) -> set[str]:
        return set(self.point_of_hash)


def _reusable_vectors(
    store: QdrantStore, index_root: Path, live: str | None, fingerprint: Fingerprint
) -> _Reusable | None:
    """Vectors of the live version can be reused only if it was embedded by the same model."""
    if live is None:
        return None
    live_fp = store.metadata(live).get("fingerprint") or {}
    if live_fp.get("id") != fingerprint.id:
        log.info("live collection %s has another model fingerprint: re-encoding everything", live)
        return None
    index = ChunkIndex.load(index_root, live)
    chunks = (
        index.chunks if index is not None else [Chunk.from_payload(p) for p in store.payloads(live)]
    )
    return _Reusable(live, {c.content_hash: c.id for c in chunks})


def _write_vectors(
    store: QdrantStore,
    name: str,
    chunks: list[Chunk],
    encoder: PassageEncoder,
    reusable: _Reusable | None,
    *,
    progress: bool,
) -> tuple[int, int, int]:
    reused = encoded = truncated = 0
    bar = tqdm(total=len(chunks), desc=f"embedding {name}", unit="chunk", disable=not progress)
    try:
        for start in range(0, len(chunks), ENCODE_BLOCK):
            block = chunks[start : start + ENCODE_BLOCK]
            vectors = np.empty((len(block), encoder.fingerprint.dim), dtype=np.float32)
            todo = list(range(len(block)))
            if reusable is not None:
                wanted = {
                    i: reusable.point_of_hash.get(c.content_hash) for i, c in enumerate(block)
                }
                found = store.vectors(reusable.collection, [p for p in wanted.values() if p])
                todo = []
                for i, point in wanted.items():
                    if point is not None and point in found:
                        vectors[i] = found[point]
                        reused += 1
                    else:
                        todo.append(i)
            if todo:
                result = encoder.encode_passages([block[i].embed_text for i in todo])
                vectors[todo] = result.vectors
                encoded += len(todo)
                truncated += result.truncated
            for at in range(0, len(block), UPSERT_BATCH):
                part = block[at : at + UPSERT_BATCH]
                store.upsert(
                    name,
                    [c.id for c in part],
                    vectors[at : at + len(part)],
                    [c.to_payload() for c in part],
                )
                bar.update(len(part))
                bar.set_postfix(reused=reused, encoded=encoded)
    finally:
        bar.close()
    return reused, encoded, truncated


def _verify(store: QdrantStore, index_root: Path, name: str, expected: int) -> None:
    points = store.count(name)
    saved = ChunkIndex.load(index_root, name)
    rows = len(saved) if saved is not None else -1
    bm25_docs = saved.bm25.n_docs if saved is not None else -1
    if not points == rows == bm25_docs == expected:
        raise RuntimeError(
            f"collection {name} is inconsistent: {points} points in Qdrant, {rows} rows in the "
            f"chunk table, {bm25_docs} BM25 documents, {expected} chunks expected"
        )
