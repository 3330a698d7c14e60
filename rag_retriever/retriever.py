"""The query path: dense + BM25 -> reciprocal rank fusion -> optional cross-encoder -> hits.

Example:
    >>> retriever = Retriever.from_settings(Settings.from_env())               # doctest: +SKIP
    >>> hits = retriever.search("who founded Normandy?", k=5, mode="hybrid")    # doctest: +SKIP
    >>> hits[0].title, hits[0].dense, hits[0].bm25                               # doctest: +SKIP
    ('Normans', StageScore(rank=1, score=0.71), StageScore(rank=2, score=14.2))

Modes: `dense` (Qdrant cosine), `bm25` (the collection's BM25 sidecar), `hybrid` (RRF of both),
`rerank` (hybrid, then the cross-encoder scores the top `rerank_candidates`; with
`rerank_fusion="rrf"` their final order is the RRF of the cross-encoder order and their hybrid
order, with `"none"` the cross-encoder order alone; hits beyond them follow in fused order, with
no rerank stage and their hybrid RRF score). Filters apply to
both branches before fusion. The collection's stored model fingerprint must equal the encoder's
for any mode that embeds the query. Each hit says what every stage that saw it said; timings
per stage come with the result. This module does not write collections.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import numpy as np

from rag_retriever.chunk_index import ChunkIndex, LexicalHit
from rag_retriever.encoder import Encoder, load_encoder
from rag_retriever.errors import CollectionNotFound, FingerprintMismatch, InvalidRequest
from rag_retriever.fusion import rrf
from rag_retriever.records import Hit, Mode, SearchFilter, SearchResult, StageScore
from rag_retriever.reranker import CrossEncoderReranker, Scorer
from rag_retriever.settings import RERANK_FUSIONS, RerankFusion, Settings
from rag_retriever.store import QdrantStore, open_client

log = logging.getLogger(__name__)

INDEX_CACHE_SIZE = 4

# How `rerank` mode orders the candidates: "none" = the cross-encoder's order alone; "rrf" =
# reciprocal rank fusion (k = rrf_k) of the cross-encoder's order with the candidates' hybrid
# order, so a reranker trained on a few thousand questions corrects the hybrid list instead of
# replacing it. SQuAD dev (5,708 questions, 20 candidates), recall@1: hybrid 0.720, cross-encoder
# order 0.776, rrf 0.791. Hit.rerank keeps the cross-encoder's rank and score either way;
# Hit.rank/score are the final order (with rrf, the RRF score).


@dataclass(frozen=True)
class RetrievalConfig:
    dense_top_n: int = 100
    bm25_top_n: int = 100
    rrf_k: int = 60
    # Weights of the dense and the BM25 list in the fusion.
    rrf_weights: tuple[float, float] = (1.0, 1.0)
    rerank_candidates: int = 50
    rerank_fusion: RerankFusion = "rrf"
    # Weights of the cross-encoder order and the hybrid order in the "rrf" rerank fusion.
    rerank_fusion_weights: tuple[float, float] = (1.0, 1.0)
    default_k: int = 10
    max_k: int = 100
    max_query_chars: int = 2000

    def __post_init__(self) -> None:
        if self.rerank_fusion not in RERANK_FUSIONS:
            raise ValueError(
                f"rerank_fusion must be one of {', '.join(RERANK_FUSIONS)}, "
                f"got {self.rerank_fusion!r}"
            )

    @classmethod
    def from_settings(cls, s: Settings) -> RetrievalConfig:
        return cls(
            dense_top_n=s.dense_top_n,
            bm25_top_n=s.bm25_top_n,
            rrf_k=s.rrf_k,
            rrf_weights=s.rrf_weights,
            rerank_candidates=s.rerank_candidates,
            rerank_fusion=s.rerank_fusion,
            default_k=s.default_k,
            max_k=s.max_k,
            max_query_chars=s.max_query_chars,
        )


@dataclass
class Trace:
    """What each stage returned for one query: (chunk row, StageScore), best first.

    A stage that did not run is None. Rows index `ChunkIndex.chunks` of the traced collection.
    """

    query: str
    dense: list[tuple[int, StageScore]] | None = None
    bm25: list[LexicalHit] | None = None
    fused: list[tuple[int, StageScore]] | None = None
    rerank: list[tuple[int, StageScore]] | None = None
    # The reranked candidates' final order when `rerank_fusion` fuses it with the hybrid order.
    rerank_fused: list[tuple[int, StageScore]] | None = None
    query_truncated: bool = False
    rerank_truncated: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)

    def final(self, mode: Mode) -> list[tuple[int, StageScore]]:
        """The ranked rows a mode returns."""
        if mode == "dense":
            return self.dense or []
        if mode == "bm25":
            return [(h.row, StageScore(h.rank, h.score)) for h in self.bm25 or []]
        if mode == "hybrid":
            return self.fused or []
        # The reranked candidates first, then the rest of the fused list in fused order.
        head = self.rerank_fused if self.rerank_fused is not None else self.rerank or []
        return head + (self.fused or [])[len(head) :]


class Retriever:
    def __init__(
        self,
        *,
        encoder: Encoder,
        store: QdrantStore,
        index_root: Path,
        reranker: Scorer | None = None,
        config: RetrievalConfig | None = None,
        collection: str = "docs",
    ) -> None:
        self.encoder = encoder
        self.store = store
        self.index_root = index_root
        self.reranker = reranker
        self.config = config or RetrievalConfig()
        self.default_collection = collection
        self._indexes: OrderedDict[str, ChunkIndex] = OrderedDict()
        self._index_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> Retriever:
        reranker = None
        if settings.rerank_model:
            reranker = CrossEncoderReranker.load(
                settings.rerank_model,
                device=settings.device,
                dtype=settings.dtype,
                batch_size=settings.rerank_batch_size,
                max_length=settings.rerank_max_length,
            )
        return cls(
            encoder=load_encoder(settings),
            store=QdrantStore(open_client(settings)),
            index_root=settings.index_dir,
            reranker=reranker,
            config=RetrievalConfig.from_settings(settings),
            collection=settings.collection,
        )

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes this retriever can run (`rerank` only with a reranker)."""
        all_modes: tuple[Mode, ...] = get_args(Mode)
        return all_modes if self.reranker is not None else all_modes[:3]

    @property
    def default_mode(self) -> Mode:
        return "rerank" if self.reranker is not None else "hybrid"

    # -- public API -------------------------------------------------------------------------

    def search(
        self,
        query: str,
        *,
        k: int | None = None,
        mode: Mode | None = None,
        filter: SearchFilter | None = None,
        collection: str | None = None,
    ) -> list[Hit]:
        return list(self.retrieve(query, k=k, mode=mode, filter=filter, collection=collection).hits)

    def search_batch(
        self,
        queries: Sequence[str],
        *,
        k: int | None = None,
        mode: Mode | None = None,
        filter: SearchFilter | None = None,
        collection: str | None = None,
    ) -> list[list[Hit]]:
        results = self.retrieve_batch(queries, k=k, mode=mode, filter=filter, collection=collection)
        return [list(r.hits) for r in results]

    def retrieve(
        self,
        query: str,
        *,
        k: int | None = None,
        mode: Mode | None = None,
        filter: SearchFilter | None = None,
        collection: str | None = None,
    ) -> SearchResult:
        return self.retrieve_batch([query], k=k, mode=mode, filter=filter, collection=collection)[0]

    def retrieve_batch(
        self,
        queries: Sequence[str],
        *,
        k: int | None = None,
        mode: Mode | None = None,
        filter: SearchFilter | None = None,
        collection: str | None = None,
    ) -> list[SearchResult]:
        """Results for many queries; query vectors are encoded in one batched call."""
        k = self._check_k(k)
        chosen_mode = self._check_mode(mode)
        name, index, traces = self.trace(
            queries, mode=chosen_mode, filter=filter, collection=collection
        )
        results = []
        for trace in traces:
            notices = []
            if trace.query_truncated:
                notices.append(
                    f"the query was longer than the encoder's {self.encoder.max_seq_length}-token "
                    f"window and was truncated for the dense search (BM25 used all of it)"
                )
            if mode is None and self.reranker is None:
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
                    mode=chosen_mode,
                    collection=name,
                    hits=tuple(self._hits(index, trace, chosen_mode, k)),
                    timings_ms={s: round(ms, 3) for s, ms in trace.timings_ms.items()},
                    query_truncated=trace.query_truncated,
                    notices=tuple(notices),
                )
            )
        return results

    def trace(
        self,
        queries: Sequence[str],
        *,
        mode: Mode,
        filter: SearchFilter | None = None,
        collection: str | None = None,
    ) -> tuple[str, ChunkIndex, list[Trace]]:
        """Every stage's full ranked list for each query (what evaluation needs).

        Returns the collection name, its chunk index (rows of the traces) and one Trace per query.
        `rerank` runs all four stages at once, so one pass evaluates every mode.
        """
        chosen_mode = self._check_mode(mode)
        for q in queries:
            self._check_query(q)
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

    def _trace(
        self, queries: Sequence[str], chosen_mode: Mode, filter: SearchFilter | None, requested: str
    ) -> tuple[str, ChunkIndex, list[Trace]]:
        name, index = self.open_collection(requested, chosen_mode)
        uses_dense = chosen_mode != "bm25"
        vectors: np.ndarray | None = None
        truncated: list[bool] = [False] * len(queries)
        encode_ms = 0.0
        if uses_dense and queries:
            t0 = time.perf_counter()
            vectors, truncated = self._encode_queries(queries)
            encode_ms = (time.perf_counter() - t0) * 1000 / len(queries)
        traces = []
        for i, query in enumerate(queries):
            trace = Trace(query=query, query_truncated=truncated[i])
            if uses_dense:
                trace.timings_ms["encode"] = encode_ms
            self._run_stages(
                trace, None if vectors is None else vectors[i], chosen_mode, name, index, filter
            )
            trace.timings_ms["total"] = sum(trace.timings_ms.values())
            traces.append(trace)
        return name, index, traces

    def open_collection(self, alias_or_name: str, mode: Mode = "hybrid") -> tuple[str, ChunkIndex]:
        """Resolve the alias, check the model fingerprint, load (or rebuild) the BM25 sidecar."""
        name = self.store.resolve(alias_or_name)
        if mode != "bm25":
            self._check_fingerprint(alias_or_name, name)
        with self._index_lock:
            index = self._indexes.get(name)
            if index is not None:
                self._indexes.move_to_end(name)
                return name, index
            index = ChunkIndex.load(self.index_root, name)
            if index is None:
                log.warning("no BM25 index for %s on this machine; rebuilding it from Qdrant", name)
                index = ChunkIndex.rebuild(self.store.payloads(name), collection=name)
                index.save(self.index_root)
            self._indexes[name] = index
            while len(self._indexes) > INDEX_CACHE_SIZE:
                self._indexes.popitem(last=False)
            return name, index

    # -- validation -------------------------------------------------------------------------

    def _check_mode(self, mode: str | None) -> Mode:
        if mode is None:
            return self.default_mode
        if mode not in get_args(Mode):
            raise InvalidRequest(
                f"unknown mode {mode!r}; expected one of {', '.join(get_args(Mode))}"
            )
        if mode == "rerank" and self.reranker is None:
            raise InvalidRequest(
                "mode 'rerank' needs a reranker, and reranking is off: set RAG_RERANK_MODEL to a "
                "cross-encoder directory (train one with `rag-retriever train-reranker`)"
            )
        return mode  # type: ignore[return-value]

    def _check_k(self, k: int | None) -> int:
        if k is None:
            return self.config.default_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.config.max_k:
            raise InvalidRequest(f"k must be an integer from 1 to {self.config.max_k}, got {k!r}")
        return k

    def _check_query(self, query: str) -> None:
        if not isinstance(query, str) or not query.strip():
            raise InvalidRequest("the query is empty; send a question with at least one word")
        if len(query) > self.config.max_query_chars:
            raise InvalidRequest(
                f"the query is {len(query)} characters long; the limit is "
                f"{self.config.max_query_chars} (RAG_MAX_QUERY_CHARS)"
            )

    def _check_fingerprint(self, requested: str, name: str) -> None:
        stored = self.store.metadata(name).get("fingerprint") or {}
        ours = self.encoder.fingerprint
        if stored.get("id") != ours.id:
            theirs = f"{stored.get('model', 'an unknown model')}@{stored.get('id', '?')}"
            raise FingerprintMismatch(
                f"collection {requested!r} ({name}) was embedded with {theirs}, but the query "
                f"encoder is {ours.describe()}; re-ingest the collection with this model, or set "
                f"RAG_EMBED_MODEL (and the prefix/pooling settings) to the model it was built with"
            )

    # -- stages -----------------------------------------------------------------------------

    def _encode_queries(self, queries: Sequence[str]) -> tuple[np.ndarray, list[bool]]:
        encoded = self.encoder.encode_queries(list(queries))
        if not encoded.truncated:
            return encoded.vectors, [False] * len(queries)
        lengths = self.encoder.count_tokens(
            [self.encoder.profile.query_prefix + q for q in queries]
        )
        limit = self.encoder.max_seq_length - self.encoder.special_tokens
        return encoded.vectors, [n > limit for n in lengths]

    def _run_stages(
        self,
        stages: Trace,
        vector: np.ndarray | None,
        mode: Mode,
        name: str,
        index: ChunkIndex,
        flt: SearchFilter | None,
    ) -> None:
        cfg = self.config
        query = stages.query
        timings = stages.timings_ms
        if vector is not None:
            t0 = time.perf_counter()
            found = self.store.search(name, vector, cfg.dense_top_n, flt)
            stages.dense = [
                (index.row_of[pid], StageScore(rank, score))
                for rank, (pid, score) in enumerate(found, start=1)
            ]
            timings["dense"] = (time.perf_counter() - t0) * 1000
        if mode != "dense":
            t0 = time.perf_counter()
            stages.bm25 = index.search_bm25(query, cfg.bm25_top_n, flt)
            timings["bm25"] = (time.perf_counter() - t0) * 1000
        if mode in ("hybrid", "rerank"):
            t0 = time.perf_counter()
            assert stages.dense is not None and stages.bm25 is not None
            fused = rrf(
                [[row for row, _ in stages.dense], [h.row for h in stages.bm25]],
                k=cfg.rrf_k,
                weights=cfg.rrf_weights,
            )
            stages.fused = [
                (row, StageScore(rank, score)) for rank, (row, score) in enumerate(fused, start=1)
            ]
            timings["fuse"] = (time.perf_counter() - t0) * 1000
        if mode == "rerank":
            assert self.reranker is not None and stages.fused is not None
            t0 = time.perf_counter()
            candidates = [row for row, _ in stages.fused[: cfg.rerank_candidates]]
            scored = self.reranker.score(query, [index.chunks[r].embed_text for r in candidates])
            # Stable: equal scores keep the fused order.
            order = np.argsort(-scored.scores, kind="stable")
            stages.rerank = [
                (candidates[i], StageScore(rank, float(scored.scores[i])))
                for rank, i in enumerate(order, start=1)
            ]
            stages.rerank_truncated = scored.truncated
            if cfg.rerank_fusion == "rrf":
                final = rrf(
                    [[row for row, _ in stages.rerank], candidates],
                    k=cfg.rrf_k,
                    weights=cfg.rerank_fusion_weights,
                )
                stages.rerank_fused = [
                    (row, StageScore(rank, score))
                    for rank, (row, score) in enumerate(final, start=1)
                ]
            timings["rerank"] = (time.perf_counter() - t0) * 1000

    def _hits(self, index: ChunkIndex, stages: Trace, mode: Mode, k: int) -> list[Hit]:
        dense = dict(stages.dense or [])
        bm25 = {h.row: h for h in stages.bm25 or []}
        fused = dict(stages.fused or [])
        rerank = dict(stages.rerank or [])
        hits = []
        for rank, (row, stage) in enumerate(stages.final(mode)[:k], start=1):
            chunk = index.chunks[row]
            lexical = bm25.get(row)
            hits.append(
                Hit(
                    chunk_id=chunk.id,
                    doc_id=chunk.doc_id,
                    title=chunk.title,
                    text=chunk.text,
                    start=chunk.start,
                    end=chunk.end,
                    chunk_index=chunk.chunk_index,
                    rank=rank,
                    score=stage.score,
                    dense=dense.get(row),
                    bm25=None if lexical is None else StageScore(lexical.rank, lexical.score),
                    fused=fused.get(row),
                    rerank=rerank.get(row),
                    matched_terms=() if lexical is None else lexical.matched_terms,
                    metadata=chunk.metadata,
                )
            )
        return hits
