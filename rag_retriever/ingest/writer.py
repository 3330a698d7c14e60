"""Write documents into a new, versioned collection; move the alias only when it is complete.

Example:
    >>> report = ingest_documents(corpus, alias="docs", encoder=enc, store=store)   # doctest: +SKIP
    >>> report.collection, report.kind                                               # doctest: +SKIP
    ('docs__all-minilm-l6-v2-384__v2', 'full')
    >>> update_documents([doc], ["old-id"], alias="docs", encoder=enc, store=store)  # doctest: +SKIP

Two ways in, one job. `ingest_documents` takes a whole corpus (documents missing from it are
removed); `update_documents` takes only documents to upsert and ids to delete. Both end in one of:

- a delta (`kind="delta"`), when the live version has the same model fingerprint and chunking:
  the changed documents are found by document hash, and the new version is made from the live
  one (`Store.derive`) minus the points of changed and deleted documents, plus the chunks of
  changed and new ones. Nothing unchanged is read, encoded or rewritten; a chunk whose text is
  unchanged keeps its vector. BM25's document frequencies are updated by the delta (IDF on the
  query side, bm25.py); the document side keeps the lineage's average length until it drifts past
  `rebase_drift`, and then the job re-bases with a full build and says why.
- a full build (`kind="full"`): first version, `full=True`, a model or chunking change (through
  `ingest`; `update` refuses them), or a re-base. Every chunk is written into a new collection; a
  vector is reused from the live version when an identical chunk text was embedded with the same
  fingerprint.
- nothing (`kind="unchanged"`): every upserted document is unchanged and no deleted id exists.

Steps: lock the alias -> remove orphans -> read the live record -> chunk -> BM25 statistics ->
create or derive `<alias>__<model>-<dim>__v<N>` marked `building` -> encode (or reuse) and upsert
in blocks -> seal -> check that the engine holds every chunk -> mark `complete` -> optional gate ->
swap the alias in one atomic step -> retention. Chunking, tokenising, encoding and upserting
overlap (rag_retriever/ingest/pipeline.py): a full build encodes the first block while the rest
is chunked, and every write tokenises block n+1 and upserts block n-1 while block n encodes; the
first upsert waits for the last chunk, since the document side of BM25 needs the corpus's
average length (a delta's chunks are all cut first: whether it re-bases depends on them). A full
build keeps none of its chunks: BM25's counts and the version's tallies are kept as they pass,
and the chunked blocks the encoder has not reached wait on disk past SPILL_AFTER
(rag_retriever/ingest/spill.py), so its memory does not grow with the corpus.
`timings_s` then holds each stage's own time (`chunk`, `tokenize`, `encode`, `write`; they
overlap) and `pipeline`, their wall time together. Any exception (or Ctrl-C) before the swap deletes
the new version and leaves the alias as it was; a process killed outright leaves a `building`
version that the next write of the alias removes.

Why one module: it is one job (`_Job`), the steps above in order, each a method reading the
state the previous ones left (the live record, the delta, the new version); the records it is
given and returns are ingest/options.py, chunking, the pipeline, locking and compaction their
own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rag_retriever import tracing
from rag_retriever.errors import (
    DocumentError,
    GateRejected,
    InvalidRequest,
    UpdateRefused,
    VersionIncompatible,
)
from rag_retriever.ingest.chunking import Chunker, ChunkingConfig
from rag_retriever.ingest.compaction import compact_in_background
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.lock import IngestLock, default_lock_dir
from rag_retriever.ingest.options import (
    IngestReport,
    Kind,
    PassageEncoder,
    PreparingEncoder,
    WriteOptions,
)
from rag_retriever.ingest.parallel_chunking import iter_chunk_documents
from rag_retriever.ingest.pipeline import Pipeline, StageStopped
from rag_retriever.ingest.validation import validate_delete_ids, validate_documents
from rag_retriever.ingest.versions import documents_of
from rag_retriever.models.bm25 import BM25Counts, BM25Model, Tokenizer
from rag_retriever.progress import progress as progress_of
from rag_retriever.records import (
    Chunk,
    DocKey,
    Document,
    chunk_point_id,
    content_hash,
    doc_key,
    show_key,
)
from rag_retriever.settings import default_of
from rag_retriever.store import (
    STATUS_BUILDING,
    IndexKind,
    Lineage,
    Store,
    VersionRecord,
    collection_name,
    index_kind,
    metadata_path,
    parse_collection_name,
)
from rag_retriever.store.catalog import apply_retention, point_alias, remove_orphans
from rag_retriever.store.record import (
    CHANGED_IDS_KEPT,
    field_kinds,
    merged_fields,
    stamp,
    value_kind,
)

log = logging.getLogger(__name__)

# Chunks per step: reuse is looked up and missing vectors are encoded for a whole block at once
# (few, full encoder batches even when only a handful of chunks changed), then upserted in
# smaller batches so that memory stays flat on any corpus size.
ENCODE_BLOCK = 1024
UPSERT_BATCH = 256
# Documents per read of the live version (a delta reads only what it touches).
LOOKUP_BATCH = 256
# How many chunk ids of each document the first read of an edit's live documents asks for, and
# how much more each next read asks for (of the documents that had all of them).
FIRST_PROBE = 16
PROBE_GROWTH = 4
# Encoded blocks waiting for the write stage: one being written, one ready, while the next one
# is encoded (rag_retriever/ingest/pipeline.py); each is ENCODE_BLOCK x dim float32 (1.5 MB for MiniLM).
PIPELINE_DEPTH = 2
# A full build of at least this many chunks upserts from a process of its own (Store.bulk_write;
# Edge: rag_retriever/store/edge_writer.py), off the interpreter lock the other stages share;
# the process's start (~0.3 s) is then a few percent of the write.
WRITE_PROCESS_MIN_CHUNKS = 10_000
# Blocks the chunk stage of a full build may have ready in RAM before the encoder takes them;
# the rest wait on disk (rag_retriever/ingest/spill.py), so a build's memory does not grow with
# its corpus: 8 blocks is 8,192 chunks, about 20 MB (2.3 KB a chunk with its terms, measured by
# bench/bench_memory.py).
SPILL_AFTER = 8


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
    encoder: PassageEncoder | None = None,
    store: Store,
    full: bool = False,
    load_encoder: Callable[[], PassageEncoder] | None = None,
    options: WriteOptions | None = None,
    **option_values: Any,
) -> IngestReport:
    """Make `corpus` the next version of `alias` (documents not in it are removed): a delta from
    the live version when its model and chunking are the same and `full` is not asked, else a
    full build. `encoder`, or `load_encoder` to load it when the write needs it. Options:
    `WriteOptions` fields, as keywords or as `options`."""
    opts = dataclasses.replace(options or WriteOptions(), **option_values)
    # a corpus built in code gets the checks a loaded file got (nothing reaches the engine that
    # it cannot store: issue 39)
    validate_documents(
        corpus.documents,
        source=corpus.source,
        allow_empty_text=True,
        max_chars=opts.max_document_chars,
    )
    # a document without text is skipped, as the loaders skip it: kept, it made no chunk, so it
    # was never found in the live version and each ingest wrote a new version counting it again
    kept = tuple(d for d in corpus.documents if d.text.strip())
    if len(kept) < len(corpus.documents):
        empty = len(corpus.documents) - len(kept)
        corpus = dataclasses.replace(
            corpus, documents=kept, skipped_empty=corpus.skipped_empty + empty
        )
    if not corpus.documents:
        raise DocumentError(f"{corpus.source}: no document with text to ingest")
    with tracing.span("rag.ingest", alias=alias, documents=len(corpus.documents), full=full):
        with IngestLock(opts.lock_dir or default_lock_dir(store), alias, wait_s=opts.lock_wait_s):
            job = _Job(alias, _EncoderSlot(encoder, load_encoder), store, opts)
            report = job.ingest(corpus, full=full)
        _traced(report)
        return _compaction(report, store, opts)


def update_documents(
    upsert: Sequence[Document] = (),
    delete: Sequence[str | DocKey] = (),
    *,
    alias: str,
    encoder: PassageEncoder | None = None,
    store: Store,
    source: str = "update",
    load_encoder: Callable[[], PassageEncoder] | None = None,
    options: WriteOptions | None = None,
    **option_values: Any,
) -> IngestReport:
    """Upsert these documents and delete these documents (an id, or (tenant, id) for a tenant's
    document) in a new version of `alias`, made from the live
    version plus the change. Refused (UpdateRefused) when `alias` has no live version or the
    encoder or chunking differ from the live version's (run `ingest` then). Invalid documents
    are reported all at once (DocumentError) and nothing is written.

    With `load_encoder` instead of `encoder`, the model is loaded only when there is something
    to chunk and embed: a change that only deletes, or upserts documents exactly as they are,
    loads none (it keeps the live version's model and chunking, which need no checking then)."""
    # an update waits for another write of the alias (and then sees its documents)
    waiting = WriteOptions(lock_wait_s=default_of("lock_wait_s"))
    opts = dataclasses.replace(options or waiting, **option_values)
    validate_documents(upsert, source=source, max_chars=opts.max_document_chars)
    wrong = [r for r in delete if not isinstance(r, str) and not _is_doc_key(r)]
    if wrong:  # sorted below: an int among strings was a TypeError traceback
        raise DocumentError(
            f"{source}: a document to delete is an id (a string) or a (tenant, id) pair of "
            f"strings, got {wrong[0]!r}; nothing was written"
        )
    deletes = sorted({doc_key(ref) for ref in delete})
    validate_delete_ids([i for _, i in deletes], source=source)
    both = sorted({d.key for d in upsert} & set(deletes))
    if both:
        shown = ", ".join(show_key(k) for k in both[:5])
        raise DocumentError(
            f"{source}: {len(both)} document(s) are both upserted and deleted ({shown}); "
            f"send each document once"
        )
    with tracing.span("rag.update", alias=alias, upserts=len(upsert), deletes=len(delete)):
        with IngestLock(opts.lock_dir or default_lock_dir(store), alias, wait_s=opts.lock_wait_s):
            job = _Job(alias, _EncoderSlot(encoder, load_encoder), store, opts)
            report = job.update(list(upsert), deletes, source=source)
        _traced(report)
        return _compaction(report, store, opts)


def _traced(report: IngestReport) -> None:
    """What the write did, on its span (each step is a child span: `_Job.lap`)."""
    tracing.set_attributes(
        collection=report.collection,
        version=report.version,
        kind=report.kind,
        chunks=report.chunks,
        encoded=report.encoded,
        reused=report.reused,
        promoted=report.promoted,
    )


def _compaction(report: IngestReport, store: Store, opts: WriteOptions) -> IngestReport:
    """After the write let go of the alias: when the served version is due for a compaction
    (its deltas outgrew its base, or too many delta shards piled up), start a background
    compaction (or, `deferred`, say that one is due)."""
    if opts.compaction == "inline" or not report.promoted or report.kind != "delta":
        return report
    if not store.compaction_due(report.collection):
        return report
    if store.running_compaction(report.alias) is not None:
        return dataclasses.replace(report, compaction="running")
    if opts.compaction == "deferred":
        return dataclasses.replace(report, compaction="due")
    compact_in_background(
        store,
        report.alias,
        lock_dir=opts.lock_dir or default_lock_dir(store),
        keep_versions=opts.keep_versions,
        retention_grace_s=opts.retention_grace_s,
    )
    return dataclasses.replace(report, compaction="started")


def document_hash(doc: Document) -> str:
    """What decides that a document is unchanged: its title, text and metadata."""
    return content_hash(json.dumps([doc.title, doc.text, dict(doc.metadata)], sort_keys=True))


def kept_chunks(live: Sequence[Chunk], new: Sequence[Chunk]) -> set[str]:
    """The ids of a rewritten document's chunks that stay as the live version holds them: the
    same id (document and position) with the same payload (text, offsets, heading, metadata).
    Their points are neither removed nor written again, so an edit costs the chunks it changed
    (a sentence added to one paragraph rewrites that chunk and those whose offsets it moved).
    The first chunk is always rewritten: it carries the document's hash.

    >>> a = Chunk("id0", "d", "T", 0, 0, 5, "Intro", 2, "h0")
    >>> b = Chunk("id1", "d", "T", 1, 6, 10, "Body", 2, "h1")
    >>> sorted(kept_chunks([a, b], [a, b])), kept_chunks([a, b], [a, dataclasses.replace(b, end=11)])
    (['id1'], set())
    """
    by_id = {c.id: c for c in live}
    return {c.id for c in new if c.chunk_index > 0 and by_id.get(c.id) == c}


@dataclass
class _LiveDocs:
    """What the live version holds of some documents: each one's hash and chunks."""

    hashes: dict[DocKey, str] = field(default_factory=dict)
    chunks: dict[DocKey, list[Chunk]] = field(default_factory=dict)

    def add(self, payload: dict[str, Any]) -> None:
        chunk = Chunk.from_payload(payload)
        # the first chunk holds the document's hash: an edit rewrites it always, and may keep
        # later chunks (with the hash of an earlier text) as they are (`kept_chunks`)
        if chunk.chunk_index == 0 or chunk.doc_key not in self.hashes:
            self.hashes[chunk.doc_key] = str(payload.get("doc_hash") or "")
        self.chunks.setdefault(chunk.doc_key, []).append(chunk)

    def sort(self) -> _LiveDocs:
        for kept in self.chunks.values():
            kept.sort(key=lambda c: c.chunk_index)
        return self


@dataclass(frozen=True)
class _Delta:
    """A change to apply to the live version: documents to (re)write, ids to remove."""

    write: list[Document]
    remove: list[DocKey]  # live documents whose points go
    unchanged: int
    not_found: int


@dataclass(frozen=True)
class _Block:
    """Chunks to encode and write together, with their BM25 terms; once prepared, the vectors
    reused from the live version, the rows still to encode and what the encoder is given for
    them (tokens, or their texts)."""

    chunks: list[Chunk]
    terms: list[list[str]]
    vectors: np.ndarray | None = None
    todo: list[int] = field(default_factory=list)
    prepared: Any = None


@dataclass(frozen=True)
class _Encoded:
    block: _Block
    vectors: np.ndarray


class _Tally:
    """What a version's record and the write's report need of the chunks written, counted as
    they pass (a full build does not keep its chunks): how many, their tokens, one value of each
    kind per metadata field (all that the field kinds and payload indexes depend on), and how
    many of the chunk texts it replaces it no longer holds."""

    def __init__(self, replaced: Iterable[Chunk] = ()) -> None:
        self.chunks = 0
        self.tokens = 0
        self._examples: dict[str, dict[str, Any]] = {}
        self._gone = {c.content_hash for c in replaced}

    def add(self, chunks: Iterable[Chunk]) -> None:
        for c in chunks:
            self.chunks += 1
            self.tokens += c.n_tokens
            self._gone.discard(c.content_hash)
            for key, value in c.metadata.items():
                kinds = self._examples.setdefault(key, {})
                for item in value if isinstance(value, list) else [value]:
                    kinds.setdefault(value_kind(item), item)

    @property
    def removed(self) -> int:
        return len(self._gone)

    def metadatas(self) -> list[dict[str, Any]]:
        """Metadata with the same field kinds as all the chunks': each example value in a list
        of its own (both read a list by its elements), and a field only ever an empty list as
        one."""
        return [
            {key: [item]} if kinds else {key: []}
            for key, kinds in self._examples.items()
            for item in (kinds.values() if kinds else [None])
        ]


@dataclass
class _Chunked:
    """What the chunk stage of a full build has counted so far (BM25's, the version's); `done`
    once every chunk is counted."""

    bm25: BM25Counts = field(default_factory=BM25Counts)
    tally: _Tally = field(default_factory=_Tally)
    done: threading.Event = field(default_factory=threading.Event)


def _blocks(chunks: Sequence[Chunk], terms: Sequence[list[str]]) -> list[_Block]:
    return [
        _Block(list(chunks[at : at + ENCODE_BLOCK]), list(terms[at : at + ENCODE_BLOCK]))
        for at in range(0, len(chunks), ENCODE_BLOCK)
    ]


def _is_doc_key(ref: object) -> bool:
    return isinstance(ref, tuple) and len(ref) == 2 and all(isinstance(x, str) for x in ref)


def _refuse_case_twin(store: Store, alias: str) -> None:
    """InvalidRequest for a new alias that differs from an existing one only in case: on a
    case-insensitive disk (macOS's default) `docs` and `Docs` share their folders, aliases and
    locks, and a write of one could reach the other's versions."""
    names = {p[0] for n in store.collection_names() if (p := parse_collection_name(n))}
    known = names | set(store.aliases())
    if alias in known:  # an alias that exists is written as before (twins made earlier too)
        return
    twins = sorted(a for a in known if a.lower() == alias.lower())
    if twins:
        raise InvalidRequest(
            f"alias {alias!r} differs from the existing {twins[0]!r} only in case: on a "
            f"case-insensitive disk they would share their files; write {twins[0]!r}, or name "
            f"another alias"
        )


class _Job:
    """One write of an alias, as named steps; `timings` records each step's wall time."""

    def __init__(
        self, alias: str, encoder: _EncoderSlot, store: Store, options: WriteOptions
    ) -> None:
        self.alias = alias
        self._encoder = encoder
        self.store = store
        self.opts = options
        self.tokenizer = Tokenizer()
        # The encode stage reads reusable vectors while the write stage upserts: one store call
        # at a time (qdrant-client's local mode is not thread-safe).
        self._store_lock = threading.Lock()
        # the versions this job made (a failure deletes only those: a name that was already
        # there, another writer's or a case twin on a case-insensitive disk, is not its own)
        self._made: set[str] = set()
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()
        _refuse_case_twin(store, alias)
        self.orphans = remove_orphans(store, alias)
        self.live_name = store.aliases().get(alias)
        self.live: VersionRecord | None = None
        # a live version this rag-retriever cannot read: ingest rebuilds, update refuses
        self.live_problem: VersionIncompatible | None = None
        if self.live_name:
            try:
                self.live = store.record(self.live_name)
            except VersionIncompatible as exc:
                self.live_problem = exc
        self.lap("load_live")

    @property
    def encoder(self) -> PassageEncoder:
        """The passage encoder (loaded now if it was deferred)."""
        return self._encoder.get()

    @functools.cached_property
    def chunking(self) -> ChunkingConfig:
        return chunking_config_for(self.encoder, self.opts.chunk_tokens, self.opts.overlap_tokens)

    @functools.cached_property
    def chunker(self) -> Chunker:
        return Chunker(self.encoder.count_tokens, self.chunking)

    def lap(self, stage: str, **attributes: float) -> None:
        """The step `stage` ended: its time into the report and, tracing, a span of its own."""
        now = time.perf_counter()
        self.timings[stage] = round(self.timings.get(stage, 0.0) + now - self._clock, 3)
        tracing.finished_span(f"rag.ingest.{stage}", now - self._clock, **attributes)
        self._clock = now

    def _delta_refusal(self, *, model: bool = True, quantization: bool = False) -> str | None:
        """Why the live version cannot be extended with this encoder and chunking (or None);
        without `model`, only whether there is a live version this job can read; with
        `quantization`, also whether the live version holds its vectors as the options ask (an
        ingest; an update keeps the live version's)."""
        live = self.live
        if self.live_problem is not None:
            return str(self.live_problem)
        if live is None:
            return f"{self.alias!r} has no live version"
        if not model:
            return None
        if live.fingerprint.id != self.encoder.fingerprint.id:
            return (
                f"{self.live_name} was embedded with {live.fingerprint.model}@"
                f"{live.fingerprint.id}, the encoder is {self.encoder.fingerprint.describe()}"
            )
        if dict(live.chunking) != dataclasses.asdict(self.chunking):
            return f"{self.live_name} was chunked with {dict(live.chunking)}, not {dataclasses.asdict(self.chunking)}"
        if quantization and live.quantization != self.opts.quantization:
            return (
                f"{self.live_name} holds its vectors as {live.quantization!r}, "
                f"RAG_QUANTIZATION asks for {self.opts.quantization!r}"
            )
        return None

    # -- entry points -------------------------------------------------------------------------

    def ingest(self, corpus: LoadedCorpus, *, full: bool) -> IngestReport:
        refusal = "--full was asked" if full else self._delta_refusal(quantization=True)
        if refusal is not None:
            first = self.live is None and self.live_problem is None
            return self._full(corpus, reason=None if first else refusal)
        assert self.live_name is not None
        live = _LiveDocs()
        for point in self.store.scroll(self.live_name):
            live.add(dict(point.payload))
        live.sort()
        self.lap("read_live")
        wanted = {d.key for d in corpus.documents}
        write = [d for d in corpus.documents if live.hashes.get(d.key) != document_hash(d)]
        delta = _Delta(
            write=write,
            remove=sorted(set(live.hashes) - wanted),
            unchanged=len(corpus.documents) - len(write),
            not_found=0,
        )
        return self._delta(delta, live, corpus)

    def update(self, upsert: list[Document], delete: list[DocKey], *, source: str) -> IngestReport:
        self._refuse_update(self._delta_refusal(model=False))
        assert self.live_name is not None and self.live is not None
        # an update keeps the live version's quantization (a re-base by drift too)
        self.opts = dataclasses.replace(self.opts, quantization=self.live.quantization)
        live = self._read_live_docs([d.key for d in upsert] + delete)
        self.lap("read_live")
        upsert = [_kept_provenance(d, live) for d in upsert]
        write = [d for d in upsert if live.hashes.get(d.key) != document_hash(d)]
        if write:  # something to chunk and embed: the model and chunking must be the live ones
            self._refuse_update(self._delta_refusal())
        delta = _Delta(
            write=write,
            remove=[i for i in delete if i in live.hashes],
            unchanged=len(upsert) - len(write),
            not_found=sum(1 for i in delete if i not in live.hashes),
        )
        return self._delta(delta, live, LoadedCorpus(tuple(upsert), 0, source))

    def _refuse_update(self, refusal: str | None) -> None:
        if refusal is not None:
            raise UpdateRefused(
                f"cannot update {self.alias!r} as a delta: {refusal}; run `rag-retriever ingest "
                f"PATH --collection {self.alias}` with the whole corpus (a model or chunking "
                f"change re-encodes every chunk)"
            )

    def _read_live_docs(self, keys: Sequence[DocKey]) -> _LiveDocs:
        """The live version's chunks of these documents only, read by chunk id: a document's
        chunks are numbered from 0 without gaps, so ids past its last are asked for and not
        found. The first read asks for FIRST_PROBE chunks of each document, and each next read,
        of the documents that had all of them, for PROBE_GROWTH times more."""
        assert self.live_name is not None
        live = _LiveDocs()
        keys = sorted(set(keys))
        for at in range(0, len(keys), LOOKUP_BATCH):
            pending, start, width = keys[at : at + LOOKUP_BATCH], 0, FIRST_PROBE
            while pending:
                ids = [
                    chunk_point_id(doc_id, index, tenant)
                    for tenant, doc_id in pending
                    for index in range(start, start + width)
                ]
                found: Counter[DocKey] = Counter()
                for point in self.store.retrieve(self.live_name, ids):
                    payload = dict(point.payload)
                    found[Chunk.from_payload(payload).doc_key] += 1
                    live.add(payload)
                pending = [key for key in pending if found[key] == width]
                start, width = start + width, width * PROBE_GROWTH
        return live.sort()

    # -- a delta ------------------------------------------------------------------------------

    def _delta(self, delta: _Delta, live: _LiveDocs, corpus: LoadedCorpus) -> IngestReport:
        assert self.live is not None and self.live_name is not None
        if not delta.write and not delta.remove:
            return self._report(
                corpus, kind="unchanged", name=self.live_name, record=self.live, delta=delta
            )
        new_chunks: list[Chunk] = []
        gone: list[Chunk] = []
        for doc, its_chunks in zip(delta.write, self._chunk(delta.write), strict=True):
            old = live.chunks.get(doc.key, [])
            kept = kept_chunks(old, its_chunks)
            new_chunks += [c for c in its_chunks if c.id not in kept]
            gone += [c for c in old if c.id not in kept]
        gone += [c for key in delta.remove for c in live.chunks.get(key, [])]
        self.lap("chunk")
        new_terms = [self._terms(c) for c in new_chunks]
        bm25 = BM25Model(self.live.bm25, self.store.doc_freqs(self.live_name)).with_delta(
            added=new_terms, removed=[self._terms(c) for c in gone]
        )
        self.lap("bm25_stats")
        if bm25.stats.drift > self.opts.rebase_drift:
            reason = (
                f"the average chunk length drifted {bm25.stats.drift:.1%} from the lineage's "
                f"(RAG_BM25_REBASE_DRIFT={self.opts.rebase_drift:g}): BM25 is re-based"
            )
            log.debug("%s: %s", self.alias, reason)  # the report's full_reason says it
            # a re-base embeds every chunk with this job's encoder and chunking: an update whose
            # own documents asked for no embedding (deletes, unchanged texts) would otherwise
            # switch the version's model or chunking without a word (an ingest got here only
            # with the live version's)
            self._refuse_update(self._delta_refusal())
            whole = _apply(self._live_documents(), delta)
            rebuilt = LoadedCorpus(tuple(whole), corpus.skipped_empty, corpus.source)
            return self._full(rebuilt, reason=reason, delta=delta)
        changed = {c.id for c in gone} | {c.id for c in new_chunks}
        lineage = Lineage(
            base=self.live_name,
            full_build=self.live.lineage.full_build,
            deltas=self.live.lineage.deltas + 1,
            changed=tuple(sorted(changed)) if len(changed) <= CHANGED_IDS_KEPT else None,
        )
        version = self.store.next_version(self.alias)
        name = collection_name(self.alias, self.live.fingerprint.slug, version)
        added_docs = sum(1 for d in delta.write if d.key not in live.hashes)
        documents = self.live.documents + added_docs - len(delta.remove)
        chunks = self.live.chunks - len(gone) + len(new_chunks)
        record = self._new_record(version, bm25, lineage, corpus.source)
        reusable = {c.content_hash: c.id for c in gone}
        with self._building(name):
            self.store.derive(name, self.live_name, record, [c.id for c in gone])
            self._made.add(name)
            self.lap("derive")
            blocks = iter(_blocks(new_chunks, new_terms))
            stats = self._write(
                Pipeline(PIPELINE_DEPTH),
                name,
                blocks,
                lambda: bm25,
                reusable=reusable,
                reuse_from=self.live_name,
                documents=delta.write,
                total=len(new_chunks),
            )
            written = _Tally(gone)
            written.add(new_chunks)
            self._finish(name, record, bm25, written, documents=documents, chunks=chunks)
        return self._report(
            corpus,
            kind="delta",
            name=name,
            record=self.store.record(name),
            delta=delta,
            written=written,
            stats=stats,
        )

    def _live_documents(self) -> list[Document]:
        assert self.live_name is not None
        return list(documents_of(self.store, self.live_name).documents)

    # -- a full build -------------------------------------------------------------------------

    def _full(
        self, corpus: LoadedCorpus, *, reason: str | None, delta: _Delta | None = None
    ) -> IngestReport:
        """Every chunk into a new collection; unchanged documents keep their live chunks and
        identical chunk texts their vectors (same fingerprint and chunking)."""
        live = _LiveDocs()
        reuse = self.live is not None and self.live.fingerprint.id == self.encoder.fingerprint.id
        if reuse and self.live_name is not None:
            for point in self.store.scroll(self.live_name):
                live.add(dict(point.payload))
            live.sort()
        same_chunking = reuse and self._delta_refusal() is None
        self.lap("read_live")
        kept = [
            live.chunks.get(doc.key)
            if same_chunking and live.hashes.get(doc.key) == document_hash(doc)
            else None
            for doc in corpus.documents
        ]
        reused_documents = sum(k is not None for k in kept)
        version = self.store.next_version(self.alias)
        name = collection_name(self.alias, self.encoder.fingerprint.slug, version)
        reusable = {c.content_hash: c.id for cs in live.chunks.values() for c in cs}
        # Chunk -> encode -> write overlap (rag_retriever/ingest/pipeline.py). The document side of BM25
        # needs the corpus's average length, so the first write waits for the last chunk:
        # chunking runs ahead (it is several times faster than encoding), the blocks it made past
        # SPILL_AFTER waiting on disk, and the encoder starts on the first block at once.
        pipeline: Pipeline[_Block, _Encoded] = Pipeline(PIPELINE_DEPTH, spill_after=SPILL_AFTER)
        chunked = _Chunked(tally=_Tally(c for cs in live.chunks.values() for c in cs))
        built: list[tuple[BM25Model, VersionRecord]] = []
        writing = contextlib.ExitStack()

        def create() -> BM25Model:  # the write stage, before its first upsert
            pipeline.wait(chunked.done)
            began = time.perf_counter()
            bm25 = chunked.bm25.model()
            self.timings["bm25_stats"] = round(time.perf_counter() - began, 3)
            record = self._new_record(version, bm25, Lineage(full_build=name), corpus.source)
            with self._store_lock:
                self.store.create(name, self.encoder.fingerprint.dim, record)
                self._made.add(name)
                if chunked.tally.chunks >= WRITE_PROCESS_MIN_CHUNKS:
                    writing.enter_context(self.store.bulk_write(name))
            built.append((bm25, record))
            return bm25

        with self._building(name), writing:
            stats = self._write(
                pipeline,
                name,
                self._chunk_blocks(corpus.documents, kept, chunked, pipeline.stop),
                create,
                reusable=reusable,
                reuse_from=self.live_name,
                documents=corpus.documents,
                total=None,
            )
            self.timings["chunk"] = round(pipeline.busy_s["produce"], 3)
            if pipeline.spilled:
                log.info(
                    "%s: %d blocks of chunks waited on disk for the encoder", name, pipeline.spilled
                )
            bm25, record = built[0]
            writing.close()  # a writer process flushes its shard
            self._finish(name, record, bm25, chunked.tally, documents=len(corpus.documents))
        return self._report(
            corpus,
            kind="full",
            name=name,
            record=self.store.record(name),
            delta=delta or _Delta(list(corpus.documents), [], 0, 0),
            written=chunked.tally,
            stats=stats,
            reused_documents=reused_documents,
            full_reason=reason,
        )

    # -- shared steps -------------------------------------------------------------------------

    def _chunk(self, documents: Sequence[Document]) -> list[list[Chunk]]:
        """Each document's chunks (`_iter_chunk`, all at once)."""
        return [chunks for part in self._iter_chunk(documents) for chunks in part]

    def _iter_chunk(
        self, documents: Sequence[Document], stop: threading.Event | None = None
    ) -> Iterator[list[list[Chunk]]]:
        """Each document's chunks, slice by slice, in worker processes when there are many
        (exact offsets and ids unchanged: rag_retriever/ingest/parallel_chunking.py); an encoder without a
        picklable token counter (a test wrapper) chunks here. No documents: no encoder needed."""
        if not documents:
            return iter(())
        counter = getattr(self.encoder, "token_counter", None)
        if counter is None:
            return ([self.chunker.chunk_all([d])] for d in documents)
        return iter_chunk_documents(documents, counter, self.chunking, stop=stop)

    def _chunk_blocks(
        self,
        documents: Sequence[Document],
        kept: Sequence[list[Chunk] | None],
        out: _Chunked,
        stop: threading.Event,
    ) -> Iterator[_Block]:
        """The chunk stage of a full build: every document's chunks in document order (an
        unchanged document's live chunks as they are), with their BM25 terms, in blocks of
        ENCODE_BLOCK, as the workers return them; `out` counts them all."""
        todo = [d for d, k in zip(documents, kept, strict=True) if k is None]
        slices = self._iter_chunk(todo, stop)
        fresh = (chunks for part in slices for chunks in part)
        bar = progress_of(
            total=len(documents), desc="chunking", unit="doc", enabled=self.opts.progress
        )
        block = _Block([], [])  # not yet full
        try:
            for k in kept:
                chunks = k if k is not None else next(fresh)
                out.tally.add(chunks)
                for c in chunks:
                    terms = self._terms(c)
                    out.bm25.add(terms)
                    block.chunks.append(c)
                    block.terms.append(terms)
                    if len(block.chunks) == ENCODE_BLOCK:
                        yield block
                        block = _Block([], [])
                bar.update(1)
            if block.chunks:
                yield block
            out.done.set()
        finally:
            bar.close()
            close = getattr(slices, "close", None)
            if close is not None:
                close()  # ends the chunking workers (an error, a stop)

    def _terms(self, chunk: Chunk) -> list[str]:
        return self.tokenizer.tokenize(chunk.embed_text)

    def _new_record(
        self, version: int, bm25: BM25Model, lineage: Lineage, source: str
    ) -> VersionRecord:
        live = self.live
        # A delta has the live version's model and chunking (checked when it embeds anything; one
        # that only deletes never loaded the encoder).
        same = live if live is not None and lineage.base else None
        return VersionRecord(
            alias=self.alias,
            version=version,
            status=STATUS_BUILDING,
            fingerprint=same.fingerprint if same else self.encoder.fingerprint,
            chunking=dict(same.chunking) if same else dataclasses.asdict(self.chunking),
            bm25=bm25.stats,
            lineage=lineage,
            source=source,
            model_source=getattr(self._encoder.loaded, "source", None)
            or (same.model_source if same else None),
            created_at=stamp(),
            quantization=same.quantization if same else self.opts.quantization,
            # a delta keeps what was tuned for the version it extends
            fusion=live.fusion if live is not None and lineage.base else None,
            reranker=live.reranker if live is not None and lineage.base else None,
        )

    @contextlib.contextmanager
    def _building(self, name: str) -> Iterator[None]:
        """Any exception (or Ctrl-C) inside deletes the partial version, if this job made it
        (one it failed to make, half made, is an orphan the next write removes), and is raised
        again."""
        try:
            yield
        except Exception:
            log.error("write of %s failed; removing the partial version %s", self.alias, name)
            self._unmake(name)
            raise
        except BaseException:  # Ctrl-C, SIGTERM: a requested stop, not a failure
            log.info("write of %s stopped; removing the partial version %s", self.alias, name)
            self._unmake(name)
            raise

    def _unmake(self, name: str) -> None:
        with self._store_lock:  # after the write stage's last store call
            if name in self._made:
                self.store.delete(name)

    def _write(
        self,
        pipeline: Pipeline[_Block, _Encoded],
        name: str,
        blocks: Iterator[_Block],
        prepare: Callable[[], BM25Model],
        *,
        reusable: dict[str, str],
        reuse_from: str | None,
        documents: Iterable[Document],
        total: int | None,
    ) -> tuple[int, int, int]:
        """Encode (or reuse) and upsert the chunks of `blocks` (ENCODE_BLOCK each, as before, so
        the encoder sees the same batches): blocks are encoded in this thread while the previous
        ones are written in another and the next ones chunked (`pipeline`). `prepare` runs once
        in the write stage before its first upsert (a full build creates the collection there)
        and gives the BM25 model of the document side. Returns (reused, encoded, truncated)."""
        counts = {"reused": 0, "encoded": 0, "truncated": 0}
        busy = {"encode": 0.0, "write": 0.0}
        hashes = {doc.key: document_hash(doc) for doc in documents}
        models: list[BM25Model] = []
        bars = [
            progress_of(
                total=total,
                desc=f"{stage} {name}",
                unit="chunk",
                position=position,
                enabled=self.opts.progress,
            )
            for position, stage in ((1, "tokenising"), (2, "embedding"), (3, "writing"))
        ]
        tokenised, embedded, written = bars

        def tokenize(block: _Block) -> _Block:
            """The tokenise stage: vectors reused from the live version, and the rest
            tokenised (by an encoder that can) while the previous block is encoded."""
            # blocks come only with chunks to embed: the encoder is loaded here, not before
            # (a write that only deletes never loads it)
            encoder = self.encoder
            preparing = encoder if isinstance(encoder, PreparingEncoder) else None
            vectors = np.empty((len(block.chunks), encoder.fingerprint.dim), np.float32)
            with self._store_lock:
                found = self._vectors(reuse_from, reusable, [c.content_hash for c in block.chunks])
            todo = []
            for i, c in enumerate(block.chunks):
                if c.content_hash in found:
                    vectors[i] = found[c.content_hash]
                else:
                    todo.append(i)
            texts = [block.chunks[i].embed_text for i in todo]
            prepared = preparing.prepare_passages(texts) if preparing and todo else texts
            tokenised.update(len(block.chunks))
            return dataclasses.replace(block, vectors=vectors, todo=todo, prepared=prepared)

        def encode(block: _Block) -> _Encoded:
            began = time.perf_counter()
            assert block.vectors is not None, "blocks are prepared before they are encoded"
            counts["reused"] += len(block.chunks) - len(block.todo)
            if block.todo:
                encoder = self.encoder
                result = (
                    encoder.encode_prepared(block.prepared)
                    if isinstance(encoder, PreparingEncoder)
                    else encoder.encode_passages(block.prepared)
                )
                block.vectors[block.todo] = result.vectors
                counts["encoded"] += len(block.todo)
                counts["truncated"] += result.truncated
            embedded.update(len(block.chunks))
            busy["encode"] += time.perf_counter() - began
            return _Encoded(block, block.vectors)

        def write(item: _Encoded) -> None:
            if not models:
                models.append(prepare())
            began = time.perf_counter()
            block, bm25 = item.block, models[0]
            for at in range(0, len(block.chunks), UPSERT_BATCH):
                if pipeline.stop.is_set():  # another stage failed or the command stops
                    raise StageStopped
                part = block.chunks[at : at + UPSERT_BATCH]
                sparse = [bm25.document_vector(t) for t in block.terms[at : at + UPSERT_BATCH]]
                payloads = [{**c.to_payload(), "doc_hash": hashes[c.doc_key]} for c in part]
                with self._store_lock:
                    self.store.upsert(
                        name,
                        [c.id for c in part],
                        item.vectors[at : at + len(part)],
                        sparse,
                        payloads,
                    )
                written.update(len(part))
            busy["write"] += time.perf_counter() - began

        try:
            pipeline.run(blocks, encode, write, prepare=tokenize)
            if not models:  # no chunk to write (a delta that only deletes)
                prepare()
        finally:
            for bar in bars:
                bar.close()
        self.timings["tokenize"] = round(pipeline.busy_s["prepare"], 3)
        self.timings["encode"] = round(busy["encode"], 3)
        self.timings["write"] = round(busy["write"], 3)
        # the stages overlap: their busy seconds are attributes of the pipeline's one span
        self.lap(
            "pipeline",
            tokenize_busy_s=self.timings["tokenize"],
            encode_busy_s=self.timings["encode"],
            write_busy_s=busy["write"],
        )
        return counts["reused"], counts["encoded"], counts["truncated"]

    def _vectors(
        self, source: str | None, reusable: dict[str, str], text_hashes: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Dense vectors of these chunk texts in `source` (content hash -> vector), where any."""
        points = {h: p for h in text_hashes if (p := reusable.get(h)) is not None}
        if source is None or not points:
            return {}
        records = self.store.retrieve(source, sorted(set(points.values())), with_dense=True)
        found = {r.id: r.dense for r in records if r.dense is not None}
        return {h: found[p] for h, p in points.items() if p in found}

    def _finish(
        self,
        name: str,
        record: VersionRecord,
        bm25: BM25Model,
        written: _Tally,
        *,
        documents: int,
        chunks: int | None = None,
    ) -> None:
        """Seal, check that the engine holds one point per chunk (`chunks`: the version's, when
        it holds more than it wrote), mark the version complete."""
        chunks = written.chunks if chunks is None else chunks
        metadatas = written.metadatas()
        self.store.put_doc_freqs(name, bm25.doc_freqs)
        self.store.seal(
            name, _payload_indexes(metadatas), merge_base=self.opts.compaction == "inline"
        )
        self.lap("seal")
        points = self.store.count(name)
        if points != chunks:
            raise RuntimeError(
                f"collection {name} is inconsistent: {points} points, {chunks} chunks"
            )
        fields: dict[str, str] | None = field_kinds(metadatas)
        if record.lineage.base:  # a delta: the live version's fields and the new ones
            live = self.live.fields if self.live is not None else None
            fields = None if live is None else merged_fields(live, fields or {})
        self.store.put_record(
            name,
            record.completed(documents=documents, chunks=chunks, at=stamp(), fields=fields),
        )
        self.lap("verify")

    def _report(
        self,
        corpus: LoadedCorpus,
        *,
        kind: Kind,
        name: str,
        record: VersionRecord,
        delta: _Delta,
        written: _Tally | None = None,
        stats: tuple[int, int, int] = (0, 0, 0),
        reused_documents: int = 0,
        full_reason: str | None = None,
    ) -> IngestReport:
        """Gate, promote, apply retention (for a new version); the report of the whole write."""
        decision = None
        promoted = False
        deleted: list[str] = []
        if kind != "unchanged":
            gate = self.opts.gate
            decision = gate(name, self.live_name) if gate is not None else None
            self.lap("gate")
            if self.opts.promote and (decision is None or decision.promote):
                point_alias(self.store, self.alias, name)
                promoted = True
                deleted = apply_retention(
                    self.store,
                    self.alias,
                    self.opts.keep_versions,
                    grace_s=self.opts.retention_grace_s,
                )
            self.lap("promote")
        reused, encoded, truncated = stats
        report = IngestReport(
            alias=self.alias,
            collection=name,
            version=record.version,
            fingerprint=record.fingerprint.describe(),
            documents=record.documents,
            skipped_empty=corpus.skipped_empty,
            chunks=record.chunks,
            tokens=written.tokens if written else 0,
            truncated=truncated,
            reused=reused,
            encoded=encoded,
            removed=written.removed if written else 0,
            promoted=promoted,
            previous=self.live_name,
            deleted_versions=tuple(deleted),
            orphans_removed=tuple(self.orphans),
            timings_s=self.timings,
            gate=decision,
            reused_documents=reused_documents,
            skipped_files=dict(corpus.skipped_files),
            kind=kind,
            base=record.lineage.base if kind == "delta" else None,
            upserted=len(delta.write),
            deleted=len(delta.remove),
            unchanged=delta.unchanged,
            not_found=delta.not_found,
            full_reason=full_reason,
        )
        if decision is not None and not decision.promote and self.opts.promote:
            raise GateRejected(decision.summary, report)
        return report


# Metadata that ingest gives a document from where it came (a folder's file path) and that a
# replacement without it keeps: a document replaced over HTTP or from a .jsonl is still the file
# it was (LangChain's `source` comes from it).
PROVENANCE_KEYS = ("path",)


def _kept_provenance(doc: Document, live: _LiveDocs) -> Document:
    """`doc` with the live document's provenance metadata that it does not set itself."""
    chunks = live.chunks.get(doc.key)
    if not chunks:
        return doc
    kept = {
        key: chunks[0].metadata[key]
        for key in PROVENANCE_KEYS
        if key in chunks[0].metadata and key not in doc.metadata
    }
    return dataclasses.replace(doc, metadata={**doc.metadata, **kept}) if kept else doc


class _EncoderSlot:
    """A write's encoder: given, or loaded on first use by `load` (once, then kept)."""

    def __init__(
        self, encoder: PassageEncoder | None, load: Callable[[], PassageEncoder] | None
    ) -> None:
        if (encoder is None) == (load is None):
            raise TypeError("a write needs an encoder or a function that loads one (not both)")
        self.loaded = encoder
        self._load = load

    def get(self) -> PassageEncoder:
        if self.loaded is None:
            assert self._load is not None
            # the loader logs a load; a service's writer keeps its model between writes
            log.debug("this write has chunks to embed: getting the embedding model")
            self.loaded = self._load()
        return self.loaded


def _apply(documents: Sequence[Document], delta: _Delta) -> list[Document]:
    """The whole corpus after a delta (for a re-base)."""
    changed = {d.key: d for d in delta.write}
    gone = set(delta.remove)
    out = [changed.pop(d.key, d) for d in documents if d.key not in gone]
    return out + list(changed.values())


def _payload_indexes(metadatas: Iterable[Mapping[str, Any]]) -> dict[str, IndexKind]:
    """doc_id, and every metadata field whose values one index kind can serve."""
    values: dict[str, list[Any]] = {}
    for metadata in metadatas:
        for key, value in metadata.items():
            values.setdefault(key, []).append(value)
    indexes: dict[str, IndexKind] = {"doc_id": "keyword"}
    for key, seen in values.items():
        kind = index_kind(seen)
        if kind is not None:
            indexes[metadata_path(key)] = kind
    return indexes
