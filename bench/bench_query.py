"""Query latency per mode on the SQuAD collection, and cross-encoder throughput.

Latency: sequential single-question searches (k=10), p50/p95 per mode, measured after a warm-up.
Reranker: pairs/s of our CrossEncoderReranker (length-sorted batches, bf16 autocast where the
CPU has it) against `sentence_transformers.CrossEncoder(<same dir>).predict` on the same pairs.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from bench.bench_common import on_compute_thread, percentile, read_jsonl, shared_path
from rag_retriever.models.profiles import resolve_model
from rag_retriever.models.quiet import quiet_transformers
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Mode


def untrained_reranker(directory: Path) -> Path:
    """all-MiniLM-L6-v2 with a fresh one-logit head: right shape and speed, no skill."""
    if not (directory / "config.json").exists():
        source = resolve_model("all-MiniLM-L6-v2").source
        with quiet_transformers(new_head_expected=True):
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=1
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


def run(
    retriever: Retriever, *, collection: str, reranker_dir: Path, n_questions: int = 200
) -> dict[str, Any]:
    """Latency per mode on `n_questions` sampled SQuAD questions, then the reranker's
    throughput against its peer (see the module docstring)."""
    questions = [
        r["question"] for r in read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"))
    ]
    sample = random.Random(0).sample(questions, n_questions)
    reranker = CrossEncoderReranker.load(reranker_dir)
    retriever.reranker = reranker
    return {
        "latency": _latency(retriever, sample, collection),
        "questions": n_questions,
        "reranker": str(reranker_dir),
        "reranker_throughput": _reranker_throughput(
            retriever, reranker, reranker_dir, sample[:20], collection
        ),
    }


def _latency(retriever: Retriever, sample: list[str], collection: str) -> dict[str, Any]:
    """p50/p95 of sequential searches (k=10) per mode, each after a warm-up of five; the
    retriever's config is restored afterwards."""
    latency: dict[str, Any] = {}
    default = retriever.config
    runs: list[tuple[str, Mode, int]] = [
        ("dense", "dense", default.rerank_candidates),
        ("bm25", "bm25", default.rerank_candidates),
        ("hybrid", "hybrid", default.rerank_candidates),
        ("rerank (20 candidates)", "rerank", 20),
        ("rerank (50 candidates)", "rerank", 50),
    ]
    for label, mode, candidates in runs:
        retriever.config = dataclasses.replace(default, rerank_candidates=candidates)
        for q in sample[:5]:
            retriever.search(q, k=10, mode=mode, collection=collection)
        times = []
        stage_ms: dict[str, list[float]] = {}
        for q in sample:
            t0 = time.perf_counter()
            result = retriever.retrieve(q, k=10, mode=mode, collection=collection)
            times.append((time.perf_counter() - t0) * 1000)
            for stage, ms in result.timings_ms.items():
                stage_ms.setdefault(stage, []).append(ms)
        latency[label] = {
            "p50_ms": percentile(times, 50),
            "p95_ms": percentile(times, 95),
            "stages_p50_ms": {s: percentile(v, 50) for s, v in stage_ms.items()},
        }
    retriever.config = default
    return latency


def _reranker_throughput(
    retriever: Retriever,
    reranker: CrossEncoderReranker,
    reranker_dir: Path,
    questions: list[str],
    collection: str,
) -> dict[str, Any]:
    """Pairs/s of our reranker and of `sentence_transformers.CrossEncoder` on the same real
    candidate lists (the hybrid top 50 of each question), and how far their scores differ."""
    pairs: list[tuple[str, str]] = []
    for q in questions:
        hits = retriever.search(q, k=50, mode="hybrid", collection=collection)
        pairs.extend((q, f"{h.title}\n\n{h.text}") for h in hits)
    ours, ours_s = _time_ours(reranker, pairs)
    theirs, peer_s = _time_peer(reranker_dir, reranker.max_length, pairs)
    return {
        "pairs": len(pairs),
        "ours_pairs_per_s": len(pairs) / ours_s,
        "cross_encoder_pairs_per_s": len(pairs) / peer_s,
        "speedup": peer_s / ours_s,
        "precision": reranker.precision.describe(),
        "max_abs_score_difference": float(np.max(np.abs(ours - theirs))),
    }


def _time_ours(
    reranker: CrossEncoderReranker, pairs: list[tuple[str, str]]
) -> tuple[np.ndarray, float]:
    """Our scores of `pairs`, one call per question (as the query path calls it), and the
    seconds they took after a warm-up."""
    by_query: dict[str, list[str]] = {}
    for q, p in pairs:
        by_query.setdefault(q, []).append(p)
    for q, ps in list(by_query.items())[:1]:
        reranker.score(q, ps)  # warm-up
    t0 = time.perf_counter()
    ours = np.concatenate([reranker.score(q, ps).scores for q, ps in by_query.items()])
    return ours, time.perf_counter() - t0


def _time_peer(
    reranker_dir: Path, max_length: int, pairs: list[tuple[str, str]]
) -> tuple[np.ndarray, float]:
    """`sentence_transformers.CrossEncoder`'s logits of `pairs` (fp32, batches of 32), and the
    seconds they took after a warm-up."""
    from sentence_transformers import CrossEncoder

    # the peer's passes on the thread ours run on (on_compute_thread says why)
    peer = on_compute_thread(
        lambda: CrossEncoder(str(reranker_dir), device="cpu", max_length=max_length)
    )
    on_compute_thread(lambda: peer.predict(pairs[:32], batch_size=32))
    t0 = time.perf_counter()
    # Identity: CrossEncoder applies a sigmoid to one-logit models by default; we compare logits.
    logits = on_compute_thread(
        lambda: peer.predict(pairs, batch_size=32, activation_fn=torch.nn.Identity())
    )
    seconds = time.perf_counter() - t0
    return np.asarray(logits, dtype=np.float32).reshape(-1), seconds


def report(r: dict[str, Any]) -> list[str]:
    lines = [
        f"query latency ({r['questions']} SQuAD questions, k=10) {mode}: p50 {v['p50_ms']:.1f} ms, p95 {v['p95_ms']:.1f} ms"
        for mode, v in r["latency"].items()
    ]
    t = r["reranker_throughput"]
    lines.append(
        f"reranker on {t['pairs']} (question, chunk) pairs: ours {t['ours_pairs_per_s']:.0f} pairs/s ({t['precision']}) vs "
        f"sentence_transformers.CrossEncoder {t['cross_encoder_pairs_per_s']:.0f} pairs/s (fp32) -> {t['speedup']:.2f}x "
        f"(max score difference {t['max_abs_score_difference']:.3f})"
    )
    return lines
