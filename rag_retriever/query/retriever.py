"""The query path: dense + BM25 -> fusion (RAG_FUSION) -> optional cross-encoder -> hits.

Example:
    >>> retriever = Retriever.from_settings(Settings.from_env())               # doctest: +SKIP
    >>> hits = retriever.search("who founded Normandy?", k=5, mode="hybrid")    # doctest: +SKIP
    >>> hits[0].title, hits[0].dense, hits[0].bm25                               # doctest: +SKIP
    ('Normans', StageScore(rank=1, score=0.71), StageScore(rank=2, score=14.2))

Modes: `dense` (Qdrant cosine), `bm25` (the version's BM25 sparse vectors in the same Qdrant
collection), `hybrid` (the version's fusion of both, adaptive by default; the two lists come
from one batched engine call),
`rerank` (hybrid, then the cross-encoder scores the top `rerank_candidates`; with
`rerank_fusion="rrf"` their final order is the RRF of the cross-encoder order and their hybrid
order, with `"none"` the cross-encoder order alone; hits beyond them follow in fused order, with
no rerank stage and their fused score). Filters apply to
both branches before fusion. The collection's stored model fingerprint must equal the encoder's
for any mode that embeds the query. Each hit says what every stage that saw it said; timings
per stage come with the result. The serving process holds no chunk table: hits are read from the
engine's payloads (a bounded cache keeps recent ones), and the alias is resolved on every call,
so a new version is served as soon as it is promoted. This module does not write collections.

Why one module: `Retriever` is one object whose stages (validation, the cache, the engine call,
fusion, rerank, shaping the hits) share a query's trace and the versions it keeps open; what
stands alone is in query/options.py, fusion.py, cache.py, context.py and diversity.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import numpy as np

from rag_retriever import tracing
from rag_retriever.errors import (
    CollectionNotFound,
    FingerprintMismatch,
    InvalidRequest,
)
from rag_retriever.models.batching import QueryBatcher
from rag_retriever.models.bm25 import BM25Model, Tokenizer
from rag_retriever.query.cache import CacheKey, SemanticCache
from rag_retriever.query.chunk_table import BoundedReads, ChunkCache, VectorCache
from rag_retriever.query.context import ExpandKind, check_expand, merge, neighbour_ids, window
from rag_retriever.query.diversity import check_diversity, mmr
from rag_retriever.query.fusion import Fusion, rrf
from rag_retriever.query.hits import SearchHits
from rag_retriever.query.options import (
    MODE_STAGES,
    HitOptions,
    OpenCollection,
    RetrievalConfig,
    SearchOptions,
    Trace,
    at_least,
    check_filter,
    check_min_score,
    check_query,
    check_request,
    serving_record,
    tenant_filter,
)
from rag_retriever.query.querylog import QueryLog, new_query_id
from rag_retriever.records import (
    Chunk,
    Hit,
    Mode,
    SearchFilter,
    SearchResult,
    StageScore,
    tenant_of,
)
from rag_retriever.settings import Settings, default_of
from rag_retriever.store import DENSE, SPARSE, StageQuery, Store, VersionRecord, open_store

if TYPE_CHECKING:
    # Types only: importing them costs torch and transformers, which BM25 alone never needs.
    from rag_retriever.models.encoder import Encoder
    from rag_retriever.models.reranker import Scorer

log = logging.getLogger(__name__)


# How `rerank` mode orders the candidates: "none" = the cross-encoder's order alone; "rrf" =
# reciprocal rank fusion (k = rrf_k) of the cross-encoder's order with the candidates' hybrid
# order, so a reranker trained on a few thousand questions corrects the hybrid list instead of
# replacing it. SQuAD dev (5,708 questions, 20 candidates), recall@1: hybrid 0.720, cross-encoder
# order 0.776, rrf 0.791. Hit.rerank keeps the cross-encoder's rank and score either way;
# Hit.rank/score are the final order (with rrf, the RRF score).


# How many chunks on each side of a hit `expand` reads first; a window that reaches them reads
# four times as far (two 200-token neighbours fill the default 600-token budget).
EXPAND_FIRST_REACH = 2

# A version's metadata is read again after this many seconds, so a fusion tuned by another
# process is served without a restart.
METADATA_TTL_S = 1.0
# Versions whose record and BM25 document frequencies a retriever keeps open: the ones served
# (a collection per tenant is several) and a few more. A serving process sees a new version at
# every write (20,000 edits a day is a version every few seconds); it used to keep each one's
# frequencies for as long as it ran.
OPENED_KEPT = 32


class Retriever:
    def __init__(
        self,
        *,
        encoder: Encoder | None = None,
        store: Store,
        reranker: Scorer | None = None,
        config: RetrievalConfig | None = None,
        collection: str = default_of("collection"),
        load_encoder: Callable[[], Encoder] | None = None,
        query_log: QueryLog | None = None,
        cache: SemanticCache | None = None,
    ) -> None:
        """`encoder`, or `load_encoder` to load it on first use (a BM25-only command)."""
        if (encoder is None) == (load_encoder is None):
            raise TypeError("Retriever needs an encoder or a function that loads one (not both)")
        self._encoder = encoder
        self._load_encoder = load_encoder
        self._encoder_lock = threading.Lock()
        self.query_log = query_log
        self.cache = cache
        # query vectors a cache lookup made, for the search of its misses (per thread)
        self._encoded_here = threading.local()
        self._query_batcher = QueryBatcher(lambda texts: self.encoder.encode_queries(texts))
        self.store = store
        self.reranker = reranker
        self.config = config or RetrievalConfig()
        self.default_collection = collection
        self.tokenizer = Tokenizer()
        self.chunk_cache = ChunkCache(store)
        self.vector_cache: BoundedReads[np.ndarray] = VectorCache(store)
        self._opened: dict[str, OpenCollection] = {}
        self._open_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, *, mode: Mode | None = None) -> Retriever:
        """The retriever the settings describe. Models the settings do not name are those that
        the default collection's serving version records (the embedder that built it, the
        reranker `improve` trained for it); a process keeps the models it started with.

        With `mode`, only the models it needs are loaded: the reranker only for `rerank`, and
        for `bm25` the encoder only if a mode that embeds asks for it later (torch is not even
        imported until then)."""
        store = open_store(settings)
        version = serving_record(store, settings.collection)

        def encoder() -> Encoder:
            from rag_retriever.models.encoder import load_encoder

            return load_encoder(settings, version)

        reranker = None
        if mode is None or MODE_STAGES[mode].rerank:
            from rag_retriever.models.reranker import CrossEncoderReranker

            reranker = CrossEncoderReranker.from_settings(settings, version)
            if mode is not None and reranker is None:
                store.close()
                raise _no_reranker()  # before the embedder loads, not after
        embeds = mode is None or MODE_STAGES[mode].dense
        return cls(
            encoder=encoder() if embeds else None,
            load_encoder=None if embeds else encoder,
            store=store,
            reranker=reranker,
            config=RetrievalConfig.from_settings(settings),
            collection=settings.collection,
            query_log=QueryLog(settings.query_log, keep_text=settings.query_log_text)
            if settings.query_log is not None
            else None,
            cache=SemanticCache(size=settings.cache_size, threshold=settings.cache_threshold)
            if settings.cache_size
            else None,
        )

    @property
    def encoder(self) -> Encoder:
        """The query encoder (loaded now if it was deferred)."""
        if self._encoder is None:
            with self._encoder_lock:
                if self._encoder is None:
                    assert self._load_encoder is not None
                    self._encoder = self._load_encoder()
        return self._encoder

    def with_config(self, **changes: object) -> Retriever:
        """This retriever (the same models, store and caches) under a changed config, e.g. the
        limits of one HTTP app."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, **changes)  # type: ignore[arg-type]
        return other

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes this retriever can run (`rerank` only with a reranker)."""
        return tuple(m for m, s in MODE_STAGES.items() if not s.rerank or self.reranker is not None)

    @property
    def default_mode(self) -> Mode:
        return "rerank" if self.reranker is not None else "hybrid"

    # -- public API -------------------------------------------------------------------------

    def search(self, query: str, **options: Unpack[SearchOptions]) -> SearchHits:
        """The hits of `query`, a list with the search's `query_id` (for feedback)."""
        return SearchHits.of(self.retrieve(query, **options))

    def search_batch(
        self, queries: Sequence[str], **options: Unpack[SearchOptions]
    ) -> list[SearchHits]:
        """The hits of each query, each list with its own `query_id`."""
        return [SearchHits.of(r) for r in self.retrieve_batch(queries, **options)]

    def retrieve(self, query: str, **options: Unpack[SearchOptions]) -> SearchResult:
        return self.retrieve_batch([query], **options)[0]

    def retrieve_batch(
        self,
        queries: Sequence[str],
        *,
        k: int | None = None,
        mode: Mode | None = None,
        filter: SearchFilter | Mapping[str, Any] | None = None,
        collection: str | None = None,
        diversity: float | None = None,
        expand: ExpandKind | None = None,
        expand_tokens: int | None = None,
        min_score: float | None = None,
        tenant: str | None = None,
    ) -> list[SearchResult]:
        """Results for many queries; query vectors are encoded in one batched call. With a
        cache, repeated (and near-identical) questions are answered from it (see cache.py).

        `diversity` (0-1) reorders the top `diversity_candidates` of the ranked list by maximal
        marginal relevance (diversity.py); `expand` ("neighbours" or "section") returns with each
        hit the chunks around it, up to `expand_tokens` (context.py; unused without `expand`).
        `min_score` leaves out hits whose score (the mode's last stage: SCORE_RANGES says what it
        is) is below it; in rerank mode, the chunks past the reranked ones too. `filter`'s fields
        must be fields of the version's documents (InvalidRequest lists them). `tenant`: that
        tenant's documents only (docs/tenants.md)."""
        flt = check_request(queries, collection, filter, self.default_collection)
        filter = tenant_filter(flt, tenant)
        k = self._check_k(k)
        chosen_mode = self._check_mode(mode)
        shape = self._check_options(diversity, expand, expand_tokens, min_score, chosen_mode)
        alias = collection or self.default_collection
        with tracing.span(
            "rag.search",
            alias=alias,
            mode=chosen_mode,
            k=k,
            queries=len(queries),
            filtered=filter is not None,
            diversity=shape.diversity or None,
            expand=shape.expand,
        ):
            if self.cache is not None and queries:
                with tracing.span("rag.search.cache", queries=len(queries)):
                    results = self._cached(
                        queries, k, chosen_mode, mode is None, filter, collection, shape
                    )
            else:
                results = self._search(
                    queries, k, chosen_mode, mode is None, filter, collection, shape
                )
            tracing.set_attributes(
                collection=results[0].collection if results else None,
                query_id=results[0].query_id if len(results) == 1 else None,
                query_ids=[r.query_id or "" for r in results] if len(results) > 1 else None,
                hits=sum(len(r.hits) for r in results),
            )
            if self.query_log is not None:  # inside the span: its line carries the trace id
                for result in results:
                    self.query_log.record(result, alias=alias, k=k, flt=filter, tenant=tenant)
        return results

    def _search(
        self,
        queries: Sequence[str],
        k: int,
        mode: Mode,
        default_mode: bool,
        flt: SearchFilter | None,
        collection: str | None,
        shape: HitOptions,
    ) -> list[SearchResult]:
        name, traces = self.trace(queries, mode=mode, filter=flt, collection=collection)
        results = []
        for trace in traces:
            hits = self._shaped_hits(name, trace, mode, k, shape)
            notices = []
            if trace.query_truncated:
                notices.append(
                    f"the query was longer than the encoder's {self.encoder.max_seq_length}-token "
                    f"window and was truncated for the dense search"
                    + (" (BM25 used all of it)" if MODE_STAGES[mode].bm25 else "")
                )
            if trace.no_indexed_words:
                notices.append(
                    "the query has no word BM25 indexes (only stop words or punctuation): BM25 "
                    "found nothing"
                    + ("" if MODE_STAGES[mode].dense else "; a dense or hybrid search reads it")
                )
            if default_mode and self.reranker is None:
                notices.append("reranking is off: RAG_RERANK_MODEL is not set")
            if trace.rerank_truncated:
                limit = getattr(self.reranker, "max_length", None)
                notices.append(
                    f"{trace.rerank_truncated} of the {len(trace.rerank or ())} reranked chunks "
                    f"did not fit the cross-encoder's {limit or 'maximum'}-token window with the "
                    f"question and were cut at the end (RAG_RERANK_MAX_LENGTH)"
                )
            results.append(
                SearchResult(
                    query=trace.query,
                    mode=mode,
                    collection=name,
                    hits=tuple(hits),
                    timings_ms={s: round(ms, 3) for s, ms in trace.timings_ms.items()},
                    query_truncated=trace.query_truncated,
                    notices=tuple(notices),
                    fusion=trace.fusion if MODE_STAGES[mode].fuse else None,
                    query_id=new_query_id(),
                )
            )
        return results

    def _cached(
        self,
        queries: Sequence[str],
        k: int,
        mode: Mode,
        default_mode: bool,
        flt: SearchFilter | None,
        collection: str | None,
        shape: HitOptions,
    ) -> list[SearchResult]:
        """Exact hits first, then (for modes that embed the query) near-identical questions;
        the rest searched and cached. A cached answer says so in its notices."""
        assert self.cache is not None
        t0 = time.perf_counter()
        self._check_queries(queries)
        opened = self.open_collection(collection or self.default_collection, "bm25")
        record = opened.record
        key = CacheKey(
            opened.name,
            mode,
            k,
            json.dumps(flt.to_dict(), sort_keys=True) if flt else "",
            shape.key,
            json.dumps([record.fusion, record.reranker], sort_keys=True),
            # the query path's knobs: `with_config` shares the cache (a fusion or depth of
            # another configuration ranks otherwise)
            repr(self.config),
        )
        out: list[SearchResult | None] = [self.cache.get_exact(key, q) for q in queries]
        vectors: dict[int, np.ndarray] = {}
        todo = [i for i, r in enumerate(out) if r is None]
        known: dict[str, tuple[np.ndarray, bool]] = {}
        if todo and MODE_STAGES[mode].dense:
            encoded, cut = self._encode_queries([queries[i] for i in todo])
            vectors = dict(zip(todo, encoded, strict=True))
            known = {queries[i]: (encoded[j], cut[j]) for j, i in enumerate(todo)}
            for i in todo:
                out[i] = self.cache.get_similar(key, queries[i], vectors[i])
        lookup_ms = (time.perf_counter() - t0) * 1000 / len(queries)
        misses = [i for i, r in enumerate(out) if r is None]
        tracing.set_attributes(answered=len(queries) - len(misses), misses=len(misses))
        # a miss is searched with the vector the lookup already made (not encoded twice)
        self._encoded_here.vectors = known
        try:
            fresh = self._search(
                [queries[i] for i in misses], k, mode, default_mode, flt, collection, shape
            )
        finally:
            self._encoded_here.vectors = None
        for i, searched in zip(misses, fresh, strict=True):
            out[i] = searched
            if searched.collection == opened.name:  # the alias did not move meanwhile
                self.cache.put(key, queries[i], vectors.get(i), searched)
        answers = []
        for i, cached in enumerate(out):
            assert cached is not None
            if i in misses:
                answers.append(cached)
                continue
            note = f"answered from the cache: {cached.query!r} was asked before"
            answers.append(
                dataclasses.replace(
                    cached,
                    query=queries[i],
                    query_id=new_query_id(),
                    timings_ms={"cache": round(lookup_ms, 3), "total": round(lookup_ms, 3)},
                    notices=(*cached.notices, note),
                )
            )
        return answers

    def trace(
        self,
        queries: Sequence[str],
        *,
        mode: Mode,
        filter: SearchFilter | Mapping[str, Any] | None = None,
        collection: str | None = None,
    ) -> tuple[str, list[Trace]]:
        """Every stage's full ranked list for each query (what evaluation needs).

        Returns the collection version's name and one Trace per query. `rerank` runs all four
        stages at once, so one pass evaluates every mode.
        """
        chosen_mode = self._check_mode(mode)
        # checked and read as the other search calls read them (a filter's dict form too)
        filter = check_request(queries, collection, filter, self.default_collection)
        self._check_queries(queries)
        requested = collection or self.default_collection
        try:
            return self._trace(queries, chosen_mode, filter, requested)
        except CollectionNotFound:
            # The alias moved and retention deleted the version we had just resolved: the
            # alias now points at a complete newer version, so resolve it again once.
            if self.store.resolve(requested) == requested:
                raise
            log.info("collection behind %r changed during the request; retrying", requested)
            return self._trace(queries, chosen_mode, filter, requested)

    def _check_queries(self, queries: Sequence[str]) -> None:
        """InvalidRequest for a query `check_query` refuses; in a batch, naming which one."""
        for i, q in enumerate(queries):
            try:
                check_query(q, self.config.max_query_chars)
            except InvalidRequest as exc:
                if len(queries) == 1:
                    raise
                raise InvalidRequest(f"queries[{i}]: {exc}") from None

    def chunks(self, name: str, ids: Sequence[str]) -> dict[str, Chunk]:
        """Chunk records of a version by id (from the engine's payloads, cached)."""
        return self.chunk_cache.get(name, ids)

    def open_collection(self, alias_or_name: str, mode: Mode = "hybrid") -> OpenCollection:
        """Resolve the alias; check the model fingerprint (for modes that embed the query)."""
        name = self.store.resolve(alias_or_name)
        opened = self._opened.get(name)
        if opened is None or time.monotonic() - opened.opened_at > METADATA_TTL_S:
            record = self.store.record(name)
            bm25 = self._bm25_of(name, record)
            tuned = Fusion.from_json(record.fusion) if record.fusion else None
            opened = OpenCollection(name, bm25, record, tuned, time.monotonic())
            with self._open_lock:
                self._opened.pop(name, None)
                self._opened[name] = opened  # newest last
                while len(self._opened) > OPENED_KEPT:  # the least recently opened goes
                    del self._opened[next(iter(self._opened))]
            lineage = record.lineage
            if lineage.base is not None and lineage.changed is not None:
                for cache in (self.chunk_cache, self.vector_cache):
                    cache.link(name, lineage.base, lineage.changed)
        if MODE_STAGES[mode].dense:  # the query is embedded: the model must be the version's
            self._check_fingerprint(alias_or_name, opened)
        return opened

    # -- validation -------------------------------------------------------------------------

    def _check_mode(self, mode: str | None) -> Mode:
        if mode is None:
            return self.default_mode
        if mode not in MODE_STAGES:
            raise InvalidRequest(f"unknown mode {mode!r}; expected one of {', '.join(MODE_STAGES)}")
        if MODE_STAGES[mode].rerank and self.reranker is None:
            raise _no_reranker()
        return mode

    def _check_k(self, k: int | None) -> int:
        if k is None:
            return self.config.default_k
        if (
            isinstance(k, bool)
            or not isinstance(k, numbers.Integral)
            or not 1 <= k <= self.config.max_k
        ):
            raise InvalidRequest(
                f"k must be an integer from 1 to {self.config.max_k} (RAG_MAX_K), got {k!r}"
            )
        return int(k)  # a NumPy integer too

    def _check_options(
        self,
        diversity: float | None,
        expand: str | None,
        expand_tokens: int | None,
        min_score: float | None,
        mode: Mode,
    ) -> HitOptions:
        try:
            kind, tokens = check_expand(
                expand, self.config.expand_tokens if expand_tokens is None else expand_tokens
            )
            return HitOptions(
                diversity=0.0 if diversity is None else check_diversity(diversity),
                expand=kind,
                expand_tokens=tokens,
                min_score=None if min_score is None else check_min_score(min_score, mode),
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def _bm25_of(self, name: str, record: VersionRecord) -> BM25Model:
        """The version's BM25 query side; the document frequencies of a version are read once
        (a version never changes them), the record's tuned parts again after METADATA_TTL_S."""
        cached = self._opened.get(name)
        if cached is not None:
            return cached.bm25
        return BM25Model(record.bm25, self.store.doc_freqs(name))

    def _check_fingerprint(self, requested: str, opened: OpenCollection) -> None:
        stored = opened.record.fingerprint
        ours = self.encoder.fingerprint
        if stored.id != ours.id:
            theirs = stored.describe()
            raise FingerprintMismatch(
                f"collection {requested!r} ({opened.name}) was embedded with {theirs}, but the "
                f"query encoder is {ours.describe()}; re-ingest the collection with this model, "
                f"or set RAG_EMBED_MODEL (and the prefix/pooling settings) to the model it was "
                f"built with"
            )

    # -- stages -----------------------------------------------------------------------------

    def _trace(
        self, queries: Sequence[str], mode: Mode, flt: SearchFilter | None, requested: str
    ) -> tuple[str, list[Trace]]:
        stages = MODE_STAGES[mode]
        opened = self.open_collection(requested, mode)
        try:
            check_filter(flt, opened)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        traces = [Trace(query=q) for q in queries]
        if not queries:
            return opened.name, traces
        vectors = None
        if stages.dense:
            t0 = time.perf_counter()
            with tracing.span("rag.search.encode", queries=len(queries)):
                vectors, truncated = self._encode_queries(queries)
                tracing.set_attributes(truncated=sum(truncated))
            encode_ms = (time.perf_counter() - t0) * 1000 / len(queries)
            for trace, cut in zip(traces, truncated, strict=True):
                trace.query_truncated = cut
                trace.timings_ms["encode"] = encode_ms
        self._first_stage(opened, traces, vectors, stages.bm25, flt)
        fusion = self.fusion_for(opened)
        for trace in traces:
            trace.fusion = fusion.describe()
            if stages.fuse:
                self._fuse(trace, fusion)
            if stages.rerank:
                self._rerank(opened.name, trace)
            trace.timings_ms["total"] = sum(trace.timings_ms.values())
        return opened.name, traces

    def _encode_queries(self, queries: Sequence[str]) -> tuple[np.ndarray, list[bool]]:
        known = getattr(self._encoded_here, "vectors", None)  # see _cached
        if known is not None and all(q in known for q in queries):
            return np.stack([known[q][0] for q in queries]), [known[q][1] for q in queries]
        # concurrent requests (the HTTP service's threads) share one forward pass
        encoded = self._query_batcher.encode(queries)
        if not encoded.truncated:
            return encoded.vectors, [False] * len(queries)
        lengths = self.encoder.count_tokens(
            [self.encoder.profile.query_prefix + q for q in queries]
        )
        limit = self.encoder.max_seq_length - self.encoder.special_tokens
        return encoded.vectors, [n > limit for n in lengths]

    def _first_stage(
        self,
        opened: OpenCollection,
        traces: list[Trace],
        vectors: np.ndarray | None,
        lexical: bool,
        flt: SearchFilter | None,
    ) -> None:
        """The dense (when there are query vectors) and BM25 (when `lexical`) lists of every
        query, from one batched engine call."""
        cfg = self.config
        requests: list[StageQuery] = []
        slots: list[tuple[Trace, bool]] = []  # (trace, is the dense list)
        for i, trace in enumerate(traces):
            if vectors is not None:
                requests.append(StageQuery(DENSE, vectors[i], cfg.dense_top_n, flt))
                slots.append((trace, True))
            if lexical:
                sparse = opened.bm25.query_vector(self.tokenizer.tokenize(trace.query))
                trace.bm25 = []
                trace.no_indexed_words = sparse.is_empty
                if not sparse.is_empty:  # only stop words: no BM25 list
                    requests.append(StageQuery(SPARSE, sparse, cfg.bm25_top_n, flt))
                    slots.append((trace, False))
        t0 = time.perf_counter()
        with tracing.span(
            "rag.search.retrieve",
            collection=opened.name,
            dense=sum(slot[1] for slot in slots),
            bm25=sum(not slot[1] for slot in slots),
        ):
            results = self.store.search(opened.name, requests)
        per_query_ms = (time.perf_counter() - t0) * 1000 / len(traces)
        for (trace, is_dense), found in zip(slots, results, strict=True):
            ranked = [(pid, StageScore(rank, s)) for rank, (pid, s) in enumerate(found, start=1)]
            if is_dense:
                trace.dense = ranked
            else:
                trace.bm25 = ranked
        for trace in traces:
            trace.timings_ms["search"] = per_query_ms

    def fusion_for(self, opened: OpenCollection) -> Fusion:
        """The version's tuned fusion, else the settings' (method, k, weights and depths)."""
        if opened.tuned_fusion is not None:
            return opened.tuned_fusion
        return self.untuned_fusion()

    def untuned_fusion(self) -> Fusion:
        """The fusion of a version that stored none: the settings' method, k, weights, depths."""
        cfg = self.config
        return Fusion(
            cfg.fusion,
            k=cfg.rrf_k,
            weights=cfg.rrf_weights,
            depths=(cfg.dense_top_n, cfg.bm25_top_n),
        )

    def _fuse(self, trace: Trace, fusion: Fusion) -> None:
        t0 = time.perf_counter()
        assert trace.dense is not None and trace.bm25 is not None
        with tracing.span("rag.search.fuse", fusion=fusion.describe()):
            fused = fusion.fuse(
                [(cid, s.score) for cid, s in trace.dense],
                [(cid, s.score) for cid, s in trace.bm25],
                asked=(self.config.dense_top_n, self.config.bm25_top_n),
            )
        trace.fused = [
            (cid, StageScore(rank, score)) for rank, (cid, score) in enumerate(fused, start=1)
        ]
        trace.timings_ms["fuse"] = (time.perf_counter() - t0) * 1000

    def _rerank(self, name: str, trace: Trace) -> None:
        cfg = self.config
        assert self.reranker is not None and trace.fused is not None
        t0 = time.perf_counter()
        candidates = [cid for cid, _ in trace.fused[: cfg.rerank_candidates]]
        with tracing.span("rag.search.rerank", candidates=len(candidates)):
            chunks = self.chunks(name, candidates)
            scored = self.reranker.score(trace.query, [chunks[c].embed_text for c in candidates])
            tracing.set_attributes(truncated=scored.truncated)
        # Stable: equal scores keep the fused order.
        order = np.argsort(-scored.scores, kind="stable")
        trace.rerank = [
            (candidates[i], StageScore(rank, float(scored.scores[i])))
            for rank, i in enumerate(order, start=1)
        ]
        trace.rerank_truncated = scored.truncated
        if cfg.rerank_fusion == "rrf":
            final = rrf(
                [[cid for cid, _ in trace.rerank], candidates],
                k=cfg.rrf_k,
                weights=cfg.rerank_fusion_weights,
            )
            trace.rerank_fused = [
                (cid, StageScore(rank, score)) for rank, (cid, score) in enumerate(final, start=1)
            ]
        trace.timings_ms["rerank"] = (time.perf_counter() - t0) * 1000

    def _shaped_hits(
        self, name: str, trace: Trace, mode: Mode, k: int, shape: HitOptions
    ) -> list[Hit]:
        """The top k hits, diversified and expanded as `shape` asks (each step timed)."""
        final = trace.final(mode)
        if shape.min_score is not None:
            final = at_least(final, trace, mode, shape.min_score)
        picked: dict[str, StageScore] = {}
        if shape.diversity > 0 and final:
            t0 = time.perf_counter()
            with tracing.span("rag.search.diversity", diversity=shape.diversity):
                final, picked = self._diversify(name, trace, mode, final, k, shape.diversity)
            trace.timings_ms["diversity"] = (time.perf_counter() - t0) * 1000
        hits = self._hits(name, trace, final[:k], picked)
        if shape.expand is not None and hits:
            t0 = time.perf_counter()
            with tracing.span("rag.search.expand", expand=shape.expand, hits=len(hits)):
                hits = self._expand(name, hits, shape.expand, shape.expand_tokens)
            trace.timings_ms["expand"] = (time.perf_counter() - t0) * 1000
        trace.timings_ms["total"] = sum(ms for s, ms in trace.timings_ms.items() if s != "total")
        return hits

    def _diversify(
        self,
        name: str,
        trace: Trace,
        mode: Mode,
        final: list[tuple[str, StageScore]],
        k: int,
        diversity: float,
    ) -> tuple[list[tuple[str, StageScore]], dict[str, StageScore]]:
        """The final list with its top reordered by MMR, and each pick's MMR rank and score.

        MMR chooses among the first `diversity_candidates` (at least k); in rerank mode only
        among the reranked ones, whose scores share a scale (those after them are in fused
        order, with fusion scores)."""
        depth = max(self.config.diversity_candidates, k)
        if MODE_STAGES[mode].rerank:
            depth = min(depth, len(trace.rerank_fused or trace.rerank or ()))
        pool = final[:depth]
        if len(pool) < 2:
            return final, {}
        found = self.vector_cache.get(name, [cid for cid, _ in pool])
        vectors = np.stack([found[cid] for cid, _ in pool])
        scores = np.array([s.score for _, s in pool])
        picks = mmr(scores, vectors, diversity=diversity, k=min(k, len(pool)))
        head = [pool[i] for i, _ in picks]
        chosen = {cid for cid, _ in head}
        ranks = {
            pool[i][0]: StageScore(rank, score) for rank, (i, score) in enumerate(picks, start=1)
        }
        rest = [item for item in final if item[0] not in chosen]
        return [(cid, ranks[cid]) for cid, _ in head] + rest, ranks

    def _expand(self, name: str, hits: list[Hit], kind: ExpandKind, budget: int) -> list[Hit]:
        """Each hit with its context: the chunks around it (see context.window), merged.

        The neighbours are read by id (a chunk's id comes from its document and position), a
        few on each side first and further only for a hit whose window reached the edge."""
        known: dict[str, dict[int, Chunk]] = {}  # by hit chunk id: chunk index -> chunk
        for hit in hits:
            own = self.chunks(name, [hit.chunk_id])[hit.chunk_id]
            known[hit.chunk_id] = {hit.chunk_index: own}
        windows: dict[str, list[int]] = {}
        todo = list(hits)
        reach = EXPAND_FIRST_REACH
        while todo:
            wanted = {
                h.chunk_id: neighbour_ids(h.doc_id, h.chunk_index, reach, tenant_of(h.metadata))
                for h in todo
            }
            found = self.chunk_cache.find(name, [cid for ids in wanted.values() for cid in ids])
            later = []
            for hit in todo:
                chunks = known[hit.chunk_id]
                chunks.update(
                    {i: found[cid] for cid, i in wanted[hit.chunk_id].items() if cid in found}
                )
                span = window(chunks, hit.chunk_index, budget=budget, kind=kind)
                windows[hit.chunk_id] = span
                edge = span[0] == hit.chunk_index - reach or span[-1] == hit.chunk_index + reach
                if edge:  # the window may go on beyond what was read
                    later.append(hit)
            todo, reach = later, reach * 4
        return [
            dataclasses.replace(
                h, context=merge([known[h.chunk_id][i] for i in windows[h.chunk_id]])
            )
            for h in hits
        ]

    def _hits(
        self,
        name: str,
        stages: Trace,
        final: list[tuple[str, StageScore]],
        mmr_stage: dict[str, StageScore],
    ) -> list[Hit]:
        dense = dict(stages.dense or [])
        bm25 = dict(stages.bm25 or [])
        fused = dict(stages.fused or [])
        rerank = dict(stages.rerank or [])
        chunks = self.chunks(name, [cid for cid, _ in final])
        query_terms = self.tokenizer.analyze(stages.query) if bm25 else []
        hits = []
        for rank, (cid, stage) in enumerate(final, start=1):
            chunk = chunks[cid]
            lexical = bm25.get(cid)
            hits.append(
                Hit.of_chunk(
                    chunk,
                    rank=rank,
                    score=stage.score,
                    dense=dense.get(cid),
                    bm25=lexical,
                    fused=fused.get(cid),
                    rerank=rerank.get(cid),
                    mmr=mmr_stage.get(cid),
                    matched_terms=() if lexical is None else self._matched(query_terms, chunk),
                )
            )
        return hits

    def _matched(self, query_terms: Sequence[tuple[str, str]], chunk: Chunk) -> tuple[str, ...]:
        """The query's words whose index term occurs in the chunk, in query order, once each."""
        present = set(self.tokenizer.tokenize(chunk.embed_text))
        seen: dict[str, str] = {}
        for word, term in query_terms:
            if term in present and term not in seen:
                seen[term] = word
        return tuple(seen.values())


def _no_reranker() -> InvalidRequest:
    return InvalidRequest(
        "mode 'rerank' needs a reranker, and reranking is off: set RAG_RERANK_MODEL to a "
        "cross-encoder directory (train one with `rag-retriever train-reranker`)"
    )
