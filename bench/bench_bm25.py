"""BM25 inside Qdrant Edge (sparse vectors) vs rank_bm25.get_scores, at 10k and 100k chunks.

The chunks are sliding windows of 2-3 real sentences from SciFact and SQuAD; the queries are
real SciFact claims and SQuAD questions. Both sides score with the same tokenizer; the largest
absolute and relative score differences over every query's top 100 are printed (the engine
stores and sums float32), and the top-100 sets must agree up to ties at the cut.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rank_bm25 import BM25Okapi

from bench.bench_common import percentile, read_jsonl, real_sentences, shared_path
from rag_retriever.models.bm25 import BM25Model, Tokenizer
from rag_retriever.store import SPARSE, EdgeStore, StageQuery
from rag_retriever.store.record import bare_record

BATCH = 1024


def synthetic_chunks(n: int, sentences: list[str]) -> list[str]:
    return list(iter_synthetic_chunks(n, sentences))


def iter_synthetic_chunks(n: int, sentences: list[str]) -> Iterator[str]:
    """`n` distinct chunks of 2-4 real sentences, the same at every size: the windows of 2, then
    3, then 4 consecutive sentences; past those (3 x ~55,000 of them), a sentence joined with
    the 1-3 that follow it at a growing gap. The windows once grew with `n` instead (~11
    sentences a chunk at 1M, ~20 at 2M), which made a large corpus's chunks longer than a
    small one's."""
    made, rounds, count = 0, 0, len(sentences)
    while made < n:
        width, gap = 2 + rounds % 3, rounds // 3
        for i in range(count - width if gap == 0 else count):
            yield " ".join(sentences[(i + gap * bool(k) + k) % count] for k in range(width))
            made += 1
            if made == n:
                return
        rounds += 1


def run(sizes: tuple[int, ...] = (10_000, 100_000), n_queries: int = 100) -> dict[str, Any]:
    tok = Tokenizer()
    sentences = real_sentences()
    queries = [
        r["question"]
        for r in read_jsonl(shared_path("scifact", "questions_train.jsonl"), n_queries // 2)
    ]
    queries += [
        r["question"]
        for r in read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), n_queries // 2)
    ]
    tokenized_queries = [tok.tokenize(q) for q in queries]
    results: dict[str, Any] = {}
    for n in sizes:
        corpus = tok.tokenize_many(synthetic_chunks(n, sentences))
        with tempfile.TemporaryDirectory() as tmp:
            results[str(n)] = _compare(Path(tmp), corpus, tokenized_queries)
    return results


def _compare(root: Path, corpus: list[list[str]], queries: list[list[str]]) -> dict[str, Any]:
    n = len(corpus)
    t0 = time.perf_counter()
    model = BM25Model.build(corpus)
    store = EdgeStore(root)
    store.create("bm25__bench__v1", 1, bare_record("bm25__bench__v1", dim=1, bm25=model.stats))
    ids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(n)]
    for start in range(0, n, BATCH):
        part = corpus[start : start + BATCH]
        store.upsert(
            "bm25__bench__v1",
            ids[start : start + len(part)],
            np.ones((len(part), 1), dtype=np.float32),
            [model.document_vector(d) for d in part],
            [{} for _ in part],
        )
    store.seal("bm25__bench__v1", {})
    build_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    peer = BM25Okapi(corpus)
    build_peer = time.perf_counter() - t0
    row_of = {pid: i for i, pid in enumerate(ids)}
    ours_ms, peer_ms, abs_diff, rel_diff = [], [], 0.0, 0.0
    for q in queries:
        t0 = time.perf_counter()
        (found,) = store.search("bm25__bench__v1", [StageQuery(SPARSE, model.query_vector(q), 100)])
        ours_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        scores = peer.get_scores(q)
        # the peer's own top-100 selection, so both sides do the same job
        best = np.argsort(-scores, kind="stable")[:100]
        peer_ms.append((time.perf_counter() - t0) * 1000)
        rows = [row_of[pid] for pid, _ in found]
        ours = np.array([s for _, s in found])
        diff = np.abs(ours - scores[rows])
        abs_diff = max(abs_diff, float(diff.max(initial=0.0)))
        rel_diff = max(
            rel_diff, float((diff / np.maximum(np.abs(scores[rows]), 1e-9)).max(initial=0.0))
        )
        cut = scores[best[-1]] if len(best) else 0.0
        # the same documents above the 100th score (ties at the cut may be either)
        if set(np.flatnonzero(scores > cut + 1e-4)) - set(rows):
            raise AssertionError("BM25 top-100 in Qdrant differs from rank_bm25")
    store.close()
    return {
        "chunks": n,
        "queries": len(queries),
        "ours_ms_mean": float(np.mean(ours_ms)),
        "ours_ms_p95": percentile(ours_ms, 95),
        "rank_bm25_ms_mean": float(np.mean(peer_ms)),
        "rank_bm25_ms_p95": percentile(peer_ms, 95),
        "speedup": float(np.mean(peer_ms) / np.mean(ours_ms)),
        "max_abs_diff": abs_diff,
        "max_rel_diff": rel_diff,
        "build_s_ours": build_ours,
        "build_s_rank_bm25": build_peer,
    }


def report(results: dict[str, Any]) -> list[str]:
    return [
        f"BM25 top-100 at {r['chunks']:,} chunks: Qdrant Edge sparse {r['ours_ms_mean']:.2f} ms vs "
        f"rank_bm25.get_scores {r['rank_bm25_ms_mean']:.1f} ms per query -> {r['speedup']:.0f}x; "
        f"max |score diff| {r['max_abs_diff']:.2e} (relative {r['max_rel_diff']:.1e}); build "
        f"(stats + write + seal) {r['build_s_ours']:.1f}s vs {r['build_s_rank_bm25']:.1f}s"
        for r in results.values()
    ]
