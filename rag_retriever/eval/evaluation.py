"""Replay labelled questions through the retriever and measure every mode in one pass.

Example:
    >>> run = evaluate(retriever, questions, collection="squad", modes=("dense", "hybrid"))  # doctest: +SKIP
    >>> run.summary["modes"]["hybrid"]["recall@10"]                                          # doctest: +SKIP
    0.93

One traced search per question yields the dense, BM25, fused and (with a reranker) reranked
lists, so all modes are scored from the same retrieval. Gold keys are chunk rows (span level when
the question has spans, else any chunk of a gold document) or document ids (`level="doc"`, a
document ranked at its best chunk, as BEIR computes it). Used by `eval/recall_at_k.py` and the
promotion gate, so both measure the same thing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rag_retriever.errors import InvalidRequest
from rag_retriever.eval.metrics import (
    FAILURE_CLASSES,
    classify_failure,
    item_ranks,
    mrr_at_k,
    ndcg_at_k,
    recall_from_ranks,
)
from rag_retriever.eval.questions import Question
from rag_retriever.progress import progress as progress_of
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.retriever import Retriever, Trace
from rag_retriever.records import Mode

Level = Literal["chunk", "doc"]
DEFAULT_KS = (1, 5, 10, 20, 100)
BATCH = 64


@dataclass
class QuestionResult:
    id: str
    line: int
    question: str
    gold_chunk_ids: list[str]
    gold_doc_ids: list[str]
    # mode -> rank of each gold item (None = not retrieved)
    item_ranks: dict[str, list[int | None]] = field(default_factory=dict)
    # mode -> {"mrr@10": ..., "ndcg@10": ...}
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    in_dense: bool | None = None
    in_bm25: bool | None = None
    in_candidates: bool | None = None
    failure_class: str = ""

    def first_rank(self, mode: str) -> int | None:
        ranks = [r for r in self.item_ranks.get(mode, []) if r is not None]
        return min(ranks) if ranks else None

    def to_row(self, ks: Sequence[int]) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": self.id,
            "line": self.line,
            "question": self.question,
            "gold_chunk_ids": self.gold_chunk_ids,
            "gold_doc_ids": self.gold_doc_ids,
        }
        for mode, ranks in self.item_ranks.items():
            row[f"rank_{mode}"] = self.first_rank(mode)
            for k in ks:
                row[f"hit@{k}_{mode}"] = recall_from_ranks(ranks, k) > 0
            row[f"item_ranks_{mode}"] = ranks
            for metric, value in self.scores.get(mode, {}).items():
                row[f"{metric}_{mode}"] = round(value, 4)
        row["in_dense_top_n"] = self.in_dense
        row["in_bm25_top_n"] = self.in_bm25
        row["in_rerank_candidates"] = self.in_candidates
        row["failure_class"] = self.failure_class
        return row


@dataclass
class EvalRun:
    collection: str
    level: Level
    modes: tuple[Mode, ...]
    ks: tuple[int, ...]
    results: list[QuestionResult]
    problems: list[str]
    summary: dict[str, Any]


def trace_mode_for(modes: Sequence[Mode]) -> Mode:
    """The one mode whose trace contains every requested mode's list."""
    if "rerank" in modes:
        return "rerank"
    if "hybrid" in modes or ("dense" in modes and "bm25" in modes):
        return "hybrid"
    return modes[0]


def primary_mode(modes: Sequence[Mode]) -> Mode:
    for mode in ("rerank", "hybrid", "dense", "bm25"):
        if mode in modes:
            return mode
    raise ValueError("no modes to evaluate")


def evaluate(
    retriever: Retriever,
    questions: Sequence[Question],
    *,
    collection: str,
    modes: Sequence[Mode] = ("dense", "bm25", "hybrid"),
    ks: Sequence[int] = DEFAULT_KS,
    level: Level = "chunk",
    failure_k: int = 10,
    progress: bool = False,
    allow_missing_gold: bool = False,
) -> EvalRun:
    """Score every mode on `questions`. Gold documents missing from the collection are an error
    (InvalidRequest, naming how many and a few) unless `allow_missing_gold`: then those
    questions are skipped and counted in the summary."""
    if not modes:
        raise ValueError("no modes to evaluate")
    if any(k <= 0 for k in ks):
        raise ValueError(f"every k must be positive, got {list(ks)}")
    started = time.perf_counter()
    trace_mode = trace_mode_for(modes)
    name = retriever.open_collection(collection, trace_mode).name
    index = ChunkTable.load(retriever.store, name)
    if not allow_missing_gold:
        _refuse_missing_gold(questions, index, name)
    plan = _Plan.of(questions, index, name, modes, level)
    candidates_m = retriever.config.rerank_candidates
    results = _score_runnable(
        retriever,
        plan.runnable,
        index,
        name=name,
        trace_mode=trace_mode,
        modes=modes,
        level=level,
        candidates_m=candidates_m,
        failure_k=failure_k,
        progress=progress,
    )
    results.extend(plan.chunking_misses)
    summary = summarize(results, modes=modes, ks=ks, failure_k=failure_k)
    summary.update(
        collection=name,
        level=level,
        questions_given=len(questions),
        questions_skipped=dict(plan.skipped),
        # questions scored on any chunk of a gold document (no gold span given)
        questions_without_spans=sum(1 for q, _ in plan.runnable if not q.gold_spans)
        if level == "chunk"
        else 0,
        problems=len(plan.problems),
        time_s=round(time.perf_counter() - started, 2),
        rerank_candidates=candidates_m,
        dense_top_n=retriever.config.dense_top_n,
        bm25_top_n=retriever.config.bm25_top_n,
    )
    return EvalRun(name, level, tuple(modes), tuple(ks), results, plan.problems, summary)


def _refuse_missing_gold(questions: Sequence[Question], index: ChunkTable, name: str) -> None:
    """InvalidRequest when any question names a gold document that `name` does not hold."""
    rows_of_doc = index.rows_of_doc
    missing = [q for q in questions if any(d not in rows_of_doc for d in q.gold_doc_ids)]
    if missing:
        example = ", ".join(
            sorted({d for q in missing[:5] for d in q.gold_doc_ids if d not in rows_of_doc})
        )
        raise InvalidRequest(
            f"{len(missing)} of {len(questions)} questions name gold documents that are not in "
            f"{name} (e.g. {example}); evaluate the collection the questions were written for "
            f"(--collection), or pass --allow-missing-gold to skip them"
        )


@dataclass
class _Plan:
    """The questions sorted before any search: those to run (with their gold items), chunking
    misses (already scored as misses in every mode), and why others were set aside."""

    runnable: list[tuple[Question, list[set[Hashable]]]] = field(default_factory=list)
    chunking_misses: list[QuestionResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(
        cls,
        questions: Sequence[Question],
        index: ChunkTable,
        name: str,
        modes: Sequence[Mode],
        level: Level,
    ) -> _Plan:
        plan = cls()
        rows_of_doc = index.rows_of_doc
        for q in questions:
            unknown = [d for d in q.gold_doc_ids if d not in rows_of_doc]
            if unknown:
                plan.problems.append(
                    f"line {q.line}: gold doc id(s) {unknown} not in collection {name}"
                )
                if len(unknown) == len(q.gold_doc_ids):
                    plan.skipped["unknown_gold_doc"] += 1
                    continue
            items = gold_items(q, index, rows_of_doc, level)
            uncovered = sum(1 for item in items if not item)
            if uncovered and uncovered < len(items):
                plan.problems.append(
                    f"line {q.line}: {uncovered} of {len(items)} gold spans lie in no chunk of "
                    f"{name} (partial chunking miss: counted as missed items)"
                )
            if not any(items):
                plan.problems.append(
                    f"line {q.line}: no chunk of {name} contains the gold span (chunking miss)"
                )
                miss = _result(q, index, [])
                miss.failure_class = "chunking_miss"
                miss.item_ranks = {mode: [] for mode in modes}  # counted as a miss in every mode
                plan.chunking_misses.append(miss)
                continue
            plan.runnable.append((q, items))
        return plan


def _score_runnable(
    retriever: Retriever,
    runnable: Sequence[tuple[Question, list[set[Hashable]]]],
    index: ChunkTable,
    *,
    name: str,
    trace_mode: Mode,
    modes: Sequence[Mode],
    level: Level,
    candidates_m: int,
    failure_k: int,
    progress: bool,
) -> list[QuestionResult]:
    """One traced search per question, BATCH questions at a time, each scored in every mode."""
    results: list[QuestionResult] = []
    bar = progress_of(total=len(runnable), desc=f"evaluating {name}", unit="q", enabled=progress)
    for start in range(0, len(runnable), BATCH):
        batch = runnable[start : start + BATCH]
        _, traces = retriever.trace(
            [q.question for q, _ in batch], mode=trace_mode, collection=name
        )
        for (q, items), trace in zip(batch, traces, strict=True):
            results.append(_score(q, items, trace, index, modes, level, candidates_m, failure_k))
        bar.update(len(batch))
    bar.close()
    return results


def gold_items(
    q: Question, index: ChunkTable, rows_of_doc: dict[str, list[int]], level: Level
) -> list[set[Hashable]]:
    """The gold items of a question as sets of keys (chunk rows, or doc ids at doc level). A
    span that no chunk contains whole (it crosses a chunk boundary) is an empty item: never
    satisfied, it counts as a miss rather than vanishing from the question's recall."""
    if level == "doc":
        return [{d} for d in q.gold_doc_ids if d in rows_of_doc]
    if q.gold_spans:
        return [
            {
                r
                for r in rows_of_doc.get(span.doc_id, [])
                if index.chunks[r].start <= span.start and span.end <= index.chunks[r].end
            }
            for span in q.gold_spans
        ]
    return [set(rows_of_doc[d]) for d in q.gold_doc_ids if d in rows_of_doc]


def _result(q: Question, index: ChunkTable, items: list[set[Hashable]]) -> QuestionResult:
    gold_rows = sorted({k for item in items for k in item if isinstance(k, int)})
    return QuestionResult(
        id=q.id,
        line=q.line,
        question=q.question,
        gold_chunk_ids=[index.chunks[r].id for r in gold_rows],
        gold_doc_ids=list(q.gold_doc_ids),
    )


def _keys(rows: Sequence[int], index: ChunkTable, level: Level) -> list[Hashable]:
    if level == "doc":
        return list(dict.fromkeys(index.chunks[r].doc_id for r in rows))
    return list(rows)


def _score(
    q: Question,
    items: list[set[Hashable]],
    trace: Trace,
    index: ChunkTable,
    modes: Sequence[Mode],
    level: Level,
    candidates_m: int,
    failure_k: int,
) -> QuestionResult:
    result = _result(q, index, items)
    for mode in modes:
        keys = _keys(index.rows([cid for cid, _ in trace.final(mode)]), index, level)
        result.item_ranks[mode] = item_ranks(keys, items)
        result.scores[mode] = {
            "mrr@10": mrr_at_k(keys, items, 10),
            "ndcg@10": ndcg_at_k(keys, items, 10),
        }

    def found(rows: Sequence[int] | None) -> bool | None:
        if rows is None:
            return None
        return any(r is not None for r in item_ranks(_keys(rows, index, level), items))

    def rows(stage: list[tuple[str, Any]] | None) -> list[int] | None:
        return None if stage is None else index.rows([cid for cid, _ in stage])

    result.in_dense = found(rows(trace.dense))
    result.in_bm25 = found(rows(trace.bm25))
    result.in_candidates = found(rows(None if trace.fused is None else trace.fused[:candidates_m]))
    primary = primary_mode(modes)
    result.failure_class = classify_failure(
        has_gold=True,
        final_rank=result.first_rank(primary),
        k=failure_k,
        in_dense=result.in_dense if primary != "bm25" else None,
        in_bm25=result.in_bm25 if primary != "dense" else None,
        in_candidates=bool(result.in_candidates) and primary in ("hybrid", "rerank"),
        reranked=primary == "rerank",
    )
    return result


def summarize(
    results: Sequence[QuestionResult], *, modes: Sequence[Mode], ks: Sequence[int], failure_k: int
) -> dict[str, Any]:
    """Mean metrics per mode over questions (chunking misses count as misses)."""
    n = len(results)
    per_mode: dict[str, dict[str, float]] = {}
    for mode in modes:
        ranks = [r.item_ranks.get(mode, [None]) for r in results]
        figures = {f"recall@{k}": _mean(recall_from_ranks(x, k) for x in ranks) for k in ks}
        for metric in ("mrr@10", "ndcg@10"):
            figures[metric] = _mean(r.scores.get(mode, {}).get(metric, 0.0) for r in results)
        per_mode[mode] = {key: round(value, 4) for key, value in figures.items()}
    counts = Counter(r.failure_class for r in results)
    # None where no fused list was traced (a run of dense or BM25 alone): no ceiling to report
    candidate = [r.in_candidates for r in results if r.in_candidates is not None]
    return {
        "questions_evaluated": n,
        "modes": per_mode,
        "primary_mode": primary_mode(modes),
        "candidate_recall": round(_mean(1.0 if c else 0.0 for c in candidate), 4)
        if candidate
        else None,
        "failure_k": failure_k,
        "failure_classes": {c: counts.get(c, 0) for c in FAILURE_CLASSES},
    }


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
