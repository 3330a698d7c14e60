"""What `diversity` (MMR), `expand` and heading paths do to answers, on real labelled questions.

Usage:
    python -m bench.bench_context [--out bench-out] [--questions N]

- diversity 0 / 0.3 / 0.5 / 0.7 on SQuAD dev (hybrid, the default model): chunk-level recall@1
  (span gold), document-level recall@5 and the distinct documents in the top 5; the same on
  SciFact train claims (document-level relevance only, so "chunk level" is the document's);
- MMR's cost: our `mmr` over 50 candidates vs langchain-core's `maximal_marginal_relevance` on
  the same vectors (the peer), and a search's p50 with and without diversity, in the same run;
- expand "neighbours" (RAG_EXPAND_TOKENS) on SQuAD dev: how often the answer span is inside the
  hit's context but not inside the hit itself, at top 1 and top 5, and expand's p50;
- heading paths: the project's docs/ with and without headings (`Title > Section` vs the title
  alone in the chunk prefix), on eval/demo_questions.jsonl (12 questions: a small set, read the
  figures as a sanity check, not a measurement).

Collections are built under `<out>/context-data` once and reused. SciFact train claims are
reported only as "what diversity changes" (the same set at every setting), never as a score.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_common import percentile, read_jsonl, shared_path
from rag_retriever.ingest.loaders import LoadedCorpus, load_documents
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.query.diversity import mmr
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Hit, SearchResult
from rag_retriever.settings import Settings

DIVERSITIES = (0.0, 0.3, 0.5, 0.7)
BATCH = 64
REPO = Path(__file__).resolve().parents[1]


def _ensure(retriever: Retriever, alias: str, corpus: LoadedCorpus) -> None:
    if alias not in retriever.store.aliases():
        ingest_documents(corpus, alias=alias, encoder=retriever.encoder, store=retriever.store)


def _search(
    retriever: Retriever, questions: Sequence[dict[str, Any]], alias: str, **options: Any
) -> list[SearchResult]:
    out: list[SearchResult] = []
    for at in range(0, len(questions), BATCH):
        batch = [q["question"] for q in questions[at : at + BATCH]]
        out.extend(retriever.retrieve_batch(batch, collection=alias, mode="hybrid", **options))
    return out


def _spans_in(q: dict[str, Any], doc_id: str, start: int, end: int) -> bool:
    """Whether [start, end) of `doc_id` holds a gold span (or, without spans, is a gold doc)."""
    spans = q.get("gold_spans") or []
    if not spans:
        return doc_id in q["gold_doc_ids"]
    return any(s["doc_id"] == doc_id and start <= s["start"] and s["end"] <= end for s in spans)


def _in_hit(q: dict[str, Any], hit: Hit) -> bool:
    return _spans_in(q, hit.doc_id, hit.start, hit.end)


def _in_context(q: dict[str, Any], hit: Hit) -> bool:
    c = hit.context
    return c is not None and _spans_in(q, hit.doc_id, c.start, c.end)


def diversity_table(
    retriever: Retriever, questions: Sequence[dict[str, Any]], alias: str
) -> list[dict[str, float]]:
    rows = []
    for diversity in DIVERSITIES:
        results = _search(retriever, questions, alias, k=10, diversity=diversity)
        r1 = doc5 = distinct = 0.0
        times = []
        for q, result in zip(questions, results, strict=True):
            hits = result.hits
            r1 += bool(hits) and _in_hit(q, hits[0])
            doc5 += any(h.doc_id in q["gold_doc_ids"] for h in hits[:5])
            distinct += len({h.doc_id for h in hits[:5]})
            times.append(result.timings_ms.get("diversity", 0.0))
        n = len(questions)
        rows.append(
            {
                "diversity": diversity,
                "chunk_recall@1": r1 / n,
                "doc_recall@5": doc5 / n,
                "distinct_docs@5": distinct / n,
                "mmr_p50_ms": percentile(times, 50),
            }
        )
    return rows


def expand_table(
    retriever: Retriever, questions: Sequence[dict[str, Any]], alias: str
) -> dict[str, Any]:
    results = _search(retriever, questions, alias, k=5, expand="neighbours")
    hit1 = ctx1 = hit5 = ctx5 = 0
    for q, result in zip(questions, results, strict=True):
        hits = result.hits
        hit1 += bool(hits) and _in_hit(q, hits[0])
        ctx1 += bool(hits) and _in_context(q, hits[0])
        hit5 += any(_in_hit(q, h) for h in hits)
        ctx5 += any(_in_context(q, h) for h in hits)
    n = len(questions)
    return {
        "questions": n,
        "tokens": retriever.config.expand_tokens,
        "span_in_hit@1": hit1 / n,
        "span_in_context@1": ctx1 / n,
        "span_in_hit@5": hit5 / n,
        "span_in_context@5": ctx5 / n,
        "expand_p50_ms": percentile([r.timings_ms.get("expand", 0.0) for r in results], 50),
        "context_tokens_note": "chunks counted whole (an upper bound)",
    }


def mmr_cost(retriever: Retriever, alias: str, queries: Sequence[str]) -> dict[str, float]:
    """Our MMR vs langchain-core's on the same 50 candidates; a search with and without it."""
    from langchain_core.vectorstores.utils import maximal_marginal_relevance

    name = retriever.store.resolve(alias)
    ours: list[float] = []
    peer: list[float] = []
    plain: list[float] = []
    diverse: list[float] = []
    step_cold: list[float] = []
    step_warm: list[float] = []
    for query in queries:
        result = retriever.retrieve(query, collection=alias, mode="hybrid", k=50)
        ids = [h.chunk_id for h in result.hits]
        records = retriever.store.retrieve(name, ids, with_dense=True)
        vectors = {r.id: r.dense for r in records if r.dense is not None}
        matrix = np.stack([vectors[i] for i in ids])
        scores = np.array([h.score for h in result.hits])
        query_vector = retriever.encoder.encode_queries([query]).vectors[0]
        t0 = time.perf_counter()
        mmr(scores, matrix, diversity=0.5, k=10)
        t1 = time.perf_counter()
        maximal_marginal_relevance(query_vector, list(matrix), lambda_mult=0.5, k=10)
        t2 = time.perf_counter()
        ours.append((t1 - t0) * 1000)
        peer.append((t2 - t1) * 1000)
        for sink, diversity in ((plain, None), (diverse, 0.5)):
            t0 = time.perf_counter()
            retriever.retrieve(query, collection=alias, mode="hybrid", k=10, diversity=diversity)
            sink.append((time.perf_counter() - t0) * 1000)
        # The diversity step alone: its vectors read from the engine (the cache emptied first,
        # as for a question whose candidates no recent question had), then as served (cached).
        for sink, clear in ((step_cold, True), (step_warm, False)):
            if clear:
                retriever.vector_cache.clear()
            found = retriever.retrieve(query, collection=alias, mode="hybrid", k=10, diversity=0.5)
            sink.append(found.timings_ms["diversity"])
    return {
        "ours_p50_ms": percentile(ours, 50),
        "langchain_p50_ms": percentile(peer, 50),
        "search_p50_ms": percentile(plain, 50),
        "search_diverse_p50_ms": percentile(diverse, 50),
        "step_cold_p50_ms": percentile(step_cold, 50),
        "step_warm_p50_ms": percentile(step_warm, 50),
    }


def headings_table(retriever: Retriever) -> dict[str, dict[str, float]]:
    corpus = load_documents(REPO / "docs")
    flat = LoadedCorpus(
        tuple(dataclasses.replace(d, headings=()) for d in corpus.documents), 0, "docs (flat)"
    )
    questions = read_jsonl(REPO / "eval" / "demo_questions.jsonl")
    out = {}
    for alias, docs in (("docs-headings", corpus), ("docs-title-only", flat)):
        _ensure(retriever, alias, docs)
        results = _search(retriever, questions, alias, k=5)
        ranks = []
        for q, result in zip(questions, results, strict=True):
            found = [i for i, h in enumerate(result.hits, 1) if h.doc_id in q["gold_doc_ids"]]
            ranks.append(found[0] if found else None)
        n = len(questions)
        out[alias] = {
            "questions": n,
            "doc_recall@1": sum(r == 1 for r in ranks) / n,
            "doc_recall@3": sum(r is not None and r <= 3 for r in ranks) / n,
            "doc_mrr@5": sum(1 / r for r in ranks if r) / n,
        }
    return out


def run(out: Path, limit: int | None = None, emit: Any = None) -> dict[str, Any]:
    """Every table; `emit(lines)` is called with each part's report as soon as it is done."""
    settings = Settings.from_env(data_dir=out / "context-data", collection="squad")
    retriever = Retriever.from_settings(settings.replace(rerank_model=None), mode="hybrid")
    _ensure(retriever, "squad", load_documents(shared_path("squad_v11_dev", "docs.jsonl")))
    _ensure(retriever, "scifact", load_documents(shared_path("scifact", "docs.jsonl")))
    squad = read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), limit)
    scifact = read_jsonl(shared_path("scifact", "questions_train.jsonl"), limit)
    parts = {
        "headings": lambda: headings_table(retriever),
        "mmr_cost": lambda: mmr_cost(retriever, "squad", [q["question"] for q in squad[:200]]),
        "squad_dev_expand": lambda: expand_table(retriever, squad, "squad"),
        "squad_dev_diversity": lambda: diversity_table(retriever, squad, "squad"),
        "scifact_train_diversity": lambda: diversity_table(retriever, scifact, "scifact"),
    }
    results: dict[str, Any] = {}
    for key, part in parts.items():
        results[key] = part()
        if emit is not None:
            emit(report({key: results[key]}))
    retriever.store.close()
    return results


def report(r: dict[str, Any]) -> list[str]:
    lines = []
    for label, key in (
        ("SQuAD dev", "squad_dev_diversity"),
        ("SciFact train", "scifact_train_diversity"),
    ):
        if key not in r:
            continue
        lines.append(f"{label}, hybrid, diversity: chunk r@1 / doc r@5 / distinct docs in top 5")
        for row in r[key]:
            lines.append(
                f"  {row['diversity']:.1f}: {row['chunk_recall@1']:.3f} / {row['doc_recall@5']:.3f} / "
                f"{row['distinct_docs@5']:.2f}  (MMR p50 {row['mmr_p50_ms']:.2f} ms)"
            )
    for key, part in r.items():
        if key in DESCRIBE:
            lines.extend(DESCRIBE[key](part))
    return lines


def _describe_cost(c: dict[str, float]) -> list[str]:
    return [
        f"MMR over 50 candidates: ours p50 {c['ours_p50_ms']:.3f} ms vs langchain-core "
        f"maximal_marginal_relevance {c['langchain_p50_ms']:.3f} ms -> "
        f"{c['langchain_p50_ms'] / c['ours_p50_ms']:.2f}x; hybrid search p50 "
        f"{c['search_diverse_p50_ms']:.1f} ms with diversity vs {c['search_p50_ms']:.1f} ms without; "
        f"the diversity step p50 {c['step_cold_p50_ms']:.2f} ms with its vectors read from the "
        f"engine, {c['step_warm_p50_ms']:.2f} ms with them cached (the question asked again)"
    ]


def _describe_expand(e: dict[str, Any]) -> list[str]:
    return [
        f"SQuAD dev, expand neighbours ({e['tokens']} tokens): answer span in the hit / in its "
        f"context: top 1 {e['span_in_hit@1']:.3f} / {e['span_in_context@1']:.3f}, top 5 "
        f"{e['span_in_hit@5']:.3f} / {e['span_in_context@5']:.3f}; expand p50 {e['expand_p50_ms']:.2f} ms"
    ]


def _describe_headings(headings: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"docs/ {alias}: doc r@1 {h['doc_recall@1']:.3f}, r@3 {h['doc_recall@3']:.3f}, "
        f"MRR@5 {h['doc_mrr@5']:.3f} ({h['questions']} demo questions)"
        for alias, h in headings.items()
    ]


DESCRIBE: dict[str, Any] = {
    "mmr_cost": _describe_cost,
    "squad_dev_expand": _describe_expand,
    "headings": _describe_headings,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--questions", type=int, default=None, help="first N questions per set")
    args = parser.parse_args()
    print("== diverse hits, context, headings ==", flush=True)
    run(args.out, args.questions, emit=lambda lines: print("\n".join(lines), flush=True))


if __name__ == "__main__":
    main()
