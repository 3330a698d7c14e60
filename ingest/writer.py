"""Write a corpus into a new, versioned collection and move the alias only when it is complete.

Example:
    >>> report = ingest_documents(corpus, alias="docs", encoder=enc, store=store)  # doctest: +SKIP
    >>> report.collection                                                           # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v2'

Steps: chunk every document (all input was validated before this point) -> BM25 statistics of the
new corpus -> create collection `<alias>__<model>-<dim>__v<N>` marked `building` -> for each
block of chunks, reuse the dense vector of an identical chunk of the live version when it was
embedded with the same model fingerprint, else encode; compute its BM25 sparse vector; upsert ->
seal (payload indexes, flush, optimize) -> check that the engine holds every chunk -> mark
`complete` -> optional promotion gate -> swap the alias in one atomic step -> delete versions
beyond the retention count that stopped serving more than the grace period ago.

Any exception (or Ctrl-C) before the swap deletes the new collection and leaves the alias as it
was. A process killed outright leaves a `building` collection behind; the next ingest of the
alias removes such orphans before it starts. A new fingerprint lands in a collection named after
the new model, so vectors of two models never share a collection.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm

from rag_retriever.bm25 import BM25Model, Tokenizer
from rag_retriever.encoder import Encoded, Fingerprint
from rag_retriever.errors import DocumentError, GateRejected
from rag_retriever.ingest.chunking import Chunker, ChunkingConfig
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.lock import IngestLock
from rag_retriever.ingest.versions import apply_retention, point_alias, remove_orphans
from rag_retriever.records import Chunk, Document, content_hash
from rag_retriever.store import (
    STATUS_BUILDING,
    STATUS_COMPLETE,
    IndexKind,
    Store,
    collection_name,
    index_kind,
    metadata_path,
)

log = logging.getLogger(__name__)

# Chunks per step: reuse is looked up and missing vectors are encoded for a whole block at once
# (few, full encoder batches even when only a handful of chunks changed), then upserted in
# smaller batches so that memory stays flat on any corpus size.
ENCODE_BLOCK = 1024
UPSERT_BATCH = 256
# Up to this many chunks, each chunk's BM25 terms are kept from the statistics pass for the
# write pass (~1 KB a chunk); above it they are computed again rather than held in memory.
KEEP_TERMS_UP_TO = 200_000


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
    # Unchanged documents whose chunks were taken from the live version without re-chunking.
    reused_documents: int = 0
    # Files of an ingested folder that were skipped, by type.
    skipped_files: dict[str, int] = field(default_factory=dict)

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


def default_lock_dir(store: Store) -> Path:
    """Where ingest locks live: the data dir of an embedded store (the parent of its root, as
    the CLI's RAG_DATA_DIR), else the temp dir."""
    root = getattr(store, "root", None)
    return Path(root).parent if root is not None else Path(tempfile.gettempdir()) / "rag-retriever"


def ingest_documents(
    corpus: LoadedCorpus,
    *,
    alias: str,
    encoder: PassageEncoder,
    store: Store,
    lock_dir: Path | None = None,
    chunk_tokens: int = 200,
    overlap_tokens: int = 48,
    keep_versions: int = 2,
    retention_grace_s: float = 60.0,
    promote: bool = True,
    gate: Gate | None = None,
    progress: bool = False,
) -> IngestReport:
    """Ingest `corpus` as the next version of `alias`; see the module docstring for the steps."""
    if not corpus.documents:
        raise DocumentError(f"{corpus.source}: no document with text to ingest")
    with IngestLock(lock_dir or default_lock_dir(store), alias):
        job = _Ingest(
            corpus,
            alias=alias,
            encoder=encoder,
            store=store,
            chunking=chunking_config_for(encoder, chunk_tokens, overlap_tokens),
            progress=progress,
        )
        return job.run(
            keep_versions=keep_versions,
            retention_grace_s=retention_grace_s,
            promote=promote,
            gate=gate,
        )


class _Ingest:
    """One ingest, as named steps; `timings` records each step's wall time."""

    def __init__(
        self,
        corpus: LoadedCorpus,
        *,
        alias: str,
        encoder: PassageEncoder,
        store: Store,
        chunking: ChunkingConfig,
        progress: bool,
    ) -> None:
        self.corpus = corpus
        self.alias = alias
        self.encoder = encoder
        self.store = store
        self.chunking = chunking
        self.progress = progress
        self.tokenizer = Tokenizer()
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = round(now - self._clock, 3)
        self._clock = now

    def run(
        self, *, keep_versions: int, retention_grace_s: float, promote: bool, gate: Gate | None
    ) -> IngestReport:
        """Every step in order (see the module docstring); each adds its lap to `timings`."""
        store, alias = self.store, self.alias
        orphans = remove_orphans(store, alias)
        fingerprint = self.encoder.fingerprint
        live_name = store.aliases().get(alias)
        live = _LiveVersion.read(store, live_name, fingerprint, self.chunking)
        self.lap("load_live")
        chunks, reused_documents = self._chunk(live)
        self.lap("chunk")
        terms, bm25 = self._bm25_stats(chunks)
        self.lap("bm25_stats")

        version = store.next_version(alias)
        name = collection_name(alias, fingerprint.slug, version)
        reused, encoded, truncated = self._build(name, version, chunks, bm25, live, terms)

        decision = gate(name, live_name) if gate is not None else None
        self.lap("gate")
        promoted = False
        deleted: list[str] = []
        if promote and (decision is None or decision.promote):
            point_alias(store, alias, name)
            promoted = True
            deleted = apply_retention(store, alias, keep_versions, grace_s=retention_grace_s)
        self.lap("promote")
        report = IngestReport(
            alias=alias,
            collection=name,
            version=version,
            fingerprint=fingerprint.describe(),
            documents=len(self.corpus.documents),
            skipped_empty=self.corpus.skipped_empty,
            chunks=len(chunks),
            tokens=sum(c.n_tokens for c in chunks),
            truncated=truncated,
            reused=reused,
            encoded=encoded,
            removed=len(live.vector_of_hash.keys() - {c.content_hash for c in chunks}),
            promoted=promoted,
            previous=live_name,
            deleted_versions=tuple(deleted),
            orphans_removed=tuple(orphans),
            timings_s=self.timings,
            gate=decision,
            reused_documents=reused_documents,
            skipped_files=dict(self.corpus.skipped_files),
        )
        if decision is not None and not decision.promote and promote:
            raise GateRejected(decision.summary, report)
        return report

    def _bm25_stats(self, chunks: list[Chunk]) -> tuple[list[list[str]] | None, BM25Model]:
        """The BM25 statistics of the new corpus, and each chunk's terms when there are few
        enough chunks to keep them for the write step (KEEP_TERMS_UP_TO)."""
        terms: list[list[str]] | None = None
        if len(chunks) <= KEEP_TERMS_UP_TO:
            terms = [self.tokenizer.tokenize(c.embed_text) for c in chunks]
        bm25 = BM25Model.build(
            terms if terms is not None else (self.tokenizer.tokenize(c.embed_text) for c in chunks)
        )
        return terms, bm25

    def _build(
        self,
        name: str,
        version: int,
        chunks: list[Chunk],
        bm25: BM25Model,
        live: _LiveVersion,
        terms: list[list[str]] | None,
    ) -> tuple[int, int, int]:
        """Create `name` marked building, write every chunk, seal, check that the engine holds
        every chunk, mark it complete; returns (reused, encoded, truncated). Any exception (or
        Ctrl-C) deletes the partial collection and is raised again."""
        fingerprint = self.encoder.fingerprint
        meta: dict[str, Any] = {
            "alias": self.alias,
            "version": version,
            "status": STATUS_BUILDING,
            "fingerprint": fingerprint.to_json(),
            "bm25": bm25.to_json(),
            "chunking": _chunking_json(self.chunking),
            "source": self.corpus.source,
            "model_source": getattr(self.encoder, "source", None),
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        self.store.create(name, fingerprint.dim, meta)
        try:
            reused, encoded, truncated = self._write(name, chunks, bm25, live, terms)
            self.lap("embed_upsert")
            self.store.seal(name, _payload_indexes(chunks))
            self.lap("seal")
            self._mark_complete(name, meta, chunks)
            self.lap("verify")
        except BaseException:
            log.error("ingest of %s failed; removing the partial collection %s", self.alias, name)
            self.store.delete(name)
            raise
        return reused, encoded, truncated

    def _mark_complete(self, name: str, meta: dict[str, Any], chunks: list[Chunk]) -> None:
        """Check that the engine holds one point per chunk, then mark the version complete."""
        points = self.store.count(name)
        if points != len(chunks):
            raise RuntimeError(
                f"collection {name} is inconsistent: {points} points, {len(chunks)} chunks"
            )
        meta.update(
            status=STATUS_COMPLETE,
            documents=len(self.corpus.documents),
            chunks=len(chunks),
            completed_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        self.store.update_metadata(name, meta)

    def _chunk(self, live: _LiveVersion) -> tuple[list[Chunk], int]:
        """Chunks of every document; an unchanged document keeps the live version's chunks."""
        chunker = Chunker(self.encoder.count_tokens, self.chunking)
        chunks: list[Chunk] = []
        reused = 0
        for doc in self.corpus.documents:
            kept = live.chunks_of.get((doc.id, document_hash(doc)))
            if kept is not None:
                chunks.extend(kept)
                reused += 1
            else:
                chunks.extend(chunker.chunk_all([doc]))
        return chunks, reused

    def _write(
        self,
        name: str,
        chunks: list[Chunk],
        bm25: BM25Model,
        live: _LiveVersion,
        terms: list[list[str]] | None,
    ) -> tuple[int, int, int]:
        reused = encoded = truncated = 0
        dim = self.encoder.fingerprint.dim
        hashes = {doc.id: document_hash(doc) for doc in self.corpus.documents}
        bar = tqdm(
            total=len(chunks), desc=f"embedding {name}", unit="chunk", disable=not self.progress
        )
        try:
            for start in range(0, len(chunks), ENCODE_BLOCK):
                block = chunks[start : start + ENCODE_BLOCK]
                vectors = np.empty((len(block), dim), dtype=np.float32)
                found = live.vectors(self.store, [c.content_hash for c in block])
                todo = []
                for i, c in enumerate(block):
                    if c.content_hash in found:
                        vectors[i] = found[c.content_hash]
                        reused += 1
                    else:
                        todo.append(i)
                if todo:
                    result = self.encoder.encode_passages([block[i].embed_text for i in todo])
                    vectors[todo] = result.vectors
                    encoded += len(todo)
                    truncated += result.truncated
                for at in range(0, len(block), UPSERT_BATCH):
                    part = block[at : at + UPSERT_BATCH]
                    first = start + at
                    part_terms = (
                        terms[first : first + len(part)]
                        if terms is not None
                        else [self.tokenizer.tokenize(c.embed_text) for c in part]
                    )
                    self.store.upsert(
                        name,
                        [c.id for c in part],
                        vectors[at : at + len(part)],
                        [bm25.document_vector(t) for t in part_terms],
                        [{**c.to_payload(), "doc_hash": hashes[c.doc_id]} for c in part],
                    )
                    bar.update(len(part))
                    bar.set_postfix(reused=reused, encoded=encoded)
        finally:
            bar.close()
        return reused, encoded, truncated


def document_hash(doc: Document) -> str:
    """What decides that a document is unchanged: its title, text and metadata."""
    return content_hash(json.dumps([doc.title, doc.text, dict(doc.metadata)], sort_keys=True))


def _chunking_json(config: ChunkingConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


@dataclass
class _LiveVersion:
    """What a new version can take from the live one: chunks of unchanged documents (same
    chunking) and dense vectors of identical chunk texts (same model fingerprint)."""

    name: str | None = None
    chunks_of: dict[tuple[str, str], list[Chunk]] = field(default_factory=dict)
    vector_of_hash: dict[str, str] = field(default_factory=dict)  # content hash -> point id

    @classmethod
    def read(
        cls, store: Store, live: str | None, fingerprint: Fingerprint, chunking: ChunkingConfig
    ) -> _LiveVersion:
        if live is None:
            return cls()
        meta = store.metadata(live)
        if (meta.get("fingerprint") or {}).get("id") != fingerprint.id:
            log.info("live collection %s has another model fingerprint: re-encoding all", live)
            return cls()
        same_chunking = meta.get("chunking") == _chunking_json(chunking)
        out = cls(name=live)
        for record in store.scroll(live):
            chunk = Chunk.from_payload(record.payload)
            out.vector_of_hash[chunk.content_hash] = record.id
            doc_hash = record.payload.get("doc_hash")
            if same_chunking and doc_hash:
                out.chunks_of.setdefault((chunk.doc_id, str(doc_hash)), []).append(chunk)
        for kept in out.chunks_of.values():
            kept.sort(key=lambda c: c.chunk_index)
        return out

    def vectors(self, store: Store, text_hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """Live dense vectors of these chunk texts (content hash -> vector), where there are any."""
        points = {h: p for h in text_hashes if (p := self.vector_of_hash.get(h)) is not None}
        if self.name is None or not points:
            return {}
        records = store.retrieve(self.name, sorted(set(points.values())), with_dense=True)
        found = {r.id: r.dense for r in records if r.dense is not None}
        return {h: found[p] for h, p in points.items() if p in found}


def _payload_indexes(chunks: Sequence[Chunk]) -> dict[str, IndexKind]:
    """doc_id, and every metadata field whose values one index kind can serve."""
    values: dict[str, list[Any]] = {}
    for c in chunks:
        for key, value in c.metadata.items():
            values.setdefault(key, []).append(value)
    indexes: dict[str, IndexKind] = {"doc_id": "keyword"}
    for key, seen in values.items():
        kind = index_kind(seen)
        if kind is not None:
            indexes[metadata_path(key)] = kind
    return indexes
