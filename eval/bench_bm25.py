"""BM25 query speed at 10k and 100k chunks: our inverted index vs rank_bm25.get_scores.

The chunks are sliding windows of 2-3 real sentences from SciFact and SQuAD; the queries are
real SciFact claims and SQuAD questions. Both sides score with the same tokenizer and return the
same scores (checked here on every query), so only speed differs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from rank_bm25 import BM25Okapi

from eval.bench_common import percentile, read_jsonl, real_sentences, shared_path
from rag_retriever.bm25 import BM25Index, Tokenizer


def synthetic_chunks(n: int, sentences: list[str]) -> list[str]:
    chunks: list[str] = []
    width = 2
    while len(chunks) < n:
        for i in range(0, len(sentences) - width):
            chunks.append(" ".join(sentences[i : i + width]))
            if len(chunks) == n:
                break
        width += 1
    return chunks


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
        t0 = time.perf_counter()
        ours = BM25Index.build(corpus)
        build_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        peer = BM25Okapi(corpus)
        build_peer = time.perf_counter() - t0
        ours_ms, peer_ms = [], []
        for q in tokenized_queries:
            t0 = time.perf_counter()
            top = ours.top_k(q, 100)
            ours_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            scores = peer.get_scores(q)
            # the peer's own top-100 selection, so both sides do the same job
            best = np.argsort(-scores, kind="stable")[:100]
            peer_ms.append((time.perf_counter() - t0) * 1000)
            if not np.array_equal(top.scores, scores[top.indices]):
                raise AssertionError("BM25 scores differ from rank_bm25")
            if len(top.indices) == 100 and not np.array_equal(
                np.sort(scores[best]), np.sort(top.scores)
            ):
                raise AssertionError("BM25 top-100 differs from rank_bm25")
        results[str(n)] = {
            "chunks": n,
            "queries": len(queries),
            "ours_ms_mean": float(np.mean(ours_ms)),
            "ours_ms_p95": percentile(ours_ms, 95),
            "rank_bm25_ms_mean": float(np.mean(peer_ms)),
            "rank_bm25_ms_p95": percentile(peer_ms, 95),
            "speedup": float(np.mean(peer_ms) / np.mean(ours_ms)),
            "build_s_ours": build_ours,
            "build_s_rank_bm25": build_peer,
        }
    return results


def report(results: dict[str, Any]) -> list[str]:
    return [
        f"BM25 top-100 at {r['chunks']:,} chunks: ours {r['ours_ms_mean']:.2f} ms vs rank_bm25.get_scores "
        f"{r['rank_bm25_ms_mean']:.1f} ms per query -> {r['speedup']:.0f}x (identical scores; build "
        f"{r['build_s_ours']:.1f}s vs {r['build_s_rank_bm25']:.1f}s)"
        for r in results.values()
    ]
