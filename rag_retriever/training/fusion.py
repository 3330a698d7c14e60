"""Fit a version's fusion (method, RRF k, per-list weights, depths) on the user's questions.

Example:
    >>> report = tune_fusion(retriever, questions, collection="squad")   # doctest: +SKIP
    >>> report.stored, report.best.describe()                           # doctest: +SKIP
    (True, 'rrf k=10 weights(dense,bm25)=1,2 depths=100,100')

The questions are split by document (no gold document in both parts), the dense and BM25 lists
of every question are fetched once, and every candidate fusion is scored on those cached lists
(no re-encoding per trial). The winner on the training part is checked on the held-out part
against the default (the untuned fusion of the settings); it is stored in the version's metadata
only when it beats the default there, so a version never serves a fusion that lost. The objective
is MRR@10 (ties: recall@1), which rewards the top ranks a chat app reads. A fusion that loses
recall@50 or recall@100 to the default (the reranker's candidates, what a caller asking for 100
reads) is never chosen nor stored, whatever its MRR: depths only weigh the lists (the fused
list always holds every id of both, see Fusion.fuse), and the selection guards the rest.
Not handled: fusions of more than the two lists, and learning-to-rank.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rag_retriever.errors import InvalidRequest
from rag_retriever.eval.evaluation import gold_items
from rag_retriever.eval.judge import judge
from rag_retriever.eval.metrics import mrr_at_k, recall_at_k
from rag_retriever.eval.questions import Question
from rag_retriever.ingest.lock import update_record
from rag_retriever.progress import progress as progress_of
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.fusion import K_DEFAULT, METHODS, Fusion
from rag_retriever.query.retriever import Retriever
from rag_retriever.training.folds import document_groups

log = logging.getLogger(__name__)

BATCH = 64
# The grid: RRF's k from "top ranks dominate" to the paper's 60 and beyond; the BM25 list's
# weight relative to the dense one; how deep each list takes part.
RRF_KS = (2, 5, 10, 20, 40, 60, 100)
BM25_WEIGHTS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
DEPTHS = (20, 50, 100)
MIN_QUESTIONS = 20
# What a fusion is chosen by: MRR@10, ties broken by recall@1 (the top ranks a chat app reads).
OBJECTIVE = ("mrr@10", "recall@1")
# Recall at the depths a reranker (50 candidates by default) and a caller (k up to 100) read: a
# fitted fusion may not lower them (issue 21: DBSF at depths 20,20 raised nDCG@10 by 0.006 on
# SciFact and cut recall@100 from 0.963 to 0.917). Float sums of the same hits may differ in the
# last bits only.
DEEP = ("recall50", "recall100")
DEPTH_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Lists:
    """One question's cached first-stage lists (chunk rows with scores) and gold items."""

    dense: list[tuple[int, float]]
    bm25: list[tuple[int, float]]
    items: list[set[Hashable]]


@dataclass(frozen=True)
class Figures:
    mrr10: float
    recall1: float
    recall5: float
    questions: int
    recall50: float = 0.0
    recall100: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "mrr@10": self.mrr10,
            "recall@1": self.recall1,
            "recall@5": self.recall5,
            "recall@50": self.recall50,
            "recall@100": self.recall100,
        }

    def keeps_depth_of(self, other: Figures) -> bool:
        """Recall@50 and @100 at least `other`'s: what comes after the fusion loses nothing."""
        return all(getattr(self, f) >= getattr(other, f) - DEPTH_TOLERANCE for f in DEEP)

    def improves_on(self, other: Figures) -> bool:
        """Better on the objective (MRR@10, ties: recall@1)."""
        return judge(
            self.metrics(), other.metrics(), metric=OBJECTIVE[0], tie_break=OBJECTIVE[1]
        ).better

    def beats(self, other: Figures) -> bool:
        """Better on the objective, and no loss at depth."""
        return self.improves_on(other) and self.keeps_depth_of(other)

    def to_json(self) -> dict[str, float]:
        return {**{k: round(v, 4) for k, v in self.metrics().items()}, "questions": self.questions}


@dataclass
class TuningReport:
    collection: str
    default: Fusion
    best: Fusion
    train: dict[str, Figures] = field(default_factory=dict)  # "default" / "best"
    held_out: dict[str, Figures] = field(default_factory=dict)
    stored: bool = False
    candidates: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "collection": self.collection,
            "default": self.default.describe(),
            "best": self.best.describe(),
            "train": {k: v.to_json() for k, v in self.train.items()},
            "held_out": {k: v.to_json() for k, v in self.held_out.items()},
            "stored": self.stored,
            "candidates": self.candidates,
        }


def candidates(max_depth: int) -> Iterator[Fusion]:
    """Every method of fusion.METHODS at each depth and BM25 weight (and each RRF_KS value for a
    method that has the constant k)."""
    depths = [d for d in DEPTHS if d <= max_depth] or [max_depth]
    for depth, weight in itertools.product(depths, BM25_WEIGHTS):
        for method, spec in METHODS.items():
            for k in RRF_KS if spec.uses_k else (K_DEFAULT,):
                yield Fusion(method, k=k, weights=(1.0, weight), depths=(depth, depth))


def score(fusion: Fusion, lists: Sequence[Lists]) -> Figures:
    mrr = r1 = r5 = r50 = r100 = 0.0
    for q in lists:
        ranking = [row for row, _ in fusion.fuse(q.dense, q.bm25)][:100]
        mrr += mrr_at_k(ranking, q.items, 10)
        r1 += recall_at_k(ranking, q.items, 1)
        r5 += recall_at_k(ranking, q.items, 5)
        r50 += recall_at_k(ranking, q.items, 50)
        r100 += recall_at_k(ranking, q.items, 100)
    n = max(len(lists), 1)
    return Figures(mrr / n, r1 / n, r5 / n, len(lists), r50 / n, r100 / n)


def split_by_document(
    questions: Sequence[Question], held_out_fraction: float, seed: int
) -> tuple[list[Question], list[Question]]:
    """Questions grouped by document (`folds.document_groups`: no gold document on both sides);
    whole groups go to one side."""
    if not 0.0 < held_out_fraction < 1.0:
        raise InvalidRequest(f"--held-out must be between 0 and 1, got {held_out_fraction}")
    groups = document_groups(questions)
    largest = max((len(members) for members in groups.values()), default=0)
    if largest > held_out_fraction * len(questions):
        log.warning(
            "%d of %d questions are one group of shared gold documents, more than the held-out "
            "part: one side of the split by document holds most questions",
            largest,
            len(questions),
        )
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    held: list[Question] = []
    train: list[Question] = []
    for key in keys:
        side = held if len(held) < held_out_fraction * len(questions) else train
        side.extend(questions[i] for i in groups[key])
    return train, held


def tune_fusion(
    retriever: Retriever,
    questions: Sequence[Question],
    *,
    collection: str,
    held_out_fraction: float = 0.3,
    seed: int = 0,
    store: bool = True,
    progress: bool = False,
    lock_dir: Path | None = None,
    lock_wait_s: float = 0.0,
) -> TuningReport:
    """Fit the fusion of `collection` on `questions`; store it only when it beats the default on
    the held-out part (see the module docstring). It is stored under the alias's write lock in
    `lock_dir` (the CLI's data dir; default: the store's), waiting up to `lock_wait_s`."""
    opened = retriever.open_collection(collection, "hybrid")
    table = ChunkTable.load(retriever.store, opened.name)
    usable = usable_questions(questions, table, opened.name)
    train_q, held_q = split_by_document(usable, held_out_fraction, seed)
    cached = _first_stage_lists(retriever, opened.name, table, usable, progress)
    train = [cached[q.id] for q in train_q]
    held = [cached[q.id] for q in held_q]
    default = retriever.untuned_fusion()
    grid = list(candidates(min(default.depths)))
    best, best_figures = _best_fusion(default, grid, train, progress)
    # DBSF at its defaults too: the alternative default the project considers (equal weights)
    dbsf_default = Fusion("dbsf", depths=default.depths)
    report = TuningReport(
        opened.name,
        default,
        best,
        train={
            "default": score(default, train),
            "dbsf": score(dbsf_default, train),
            "best": best_figures,
        },
        held_out={
            "default": score(default, held),
            "dbsf": score(dbsf_default, held),
            "best": score(best, held),
        },
        candidates=len(grid),
    )
    wins = report.held_out["best"].beats(report.held_out["default"])
    if store and wins and best != default:
        fusion = {**report.best.to_json(), "tuning": report.to_json()}
        update_record(
            retriever.store, opened.name, lock_dir=lock_dir, wait_s=lock_wait_s, fusion=fusion
        )
        report.stored = True
    return report


def usable_questions(
    questions: Sequence[Question],
    table: ChunkTable,
    name: str,
    *,
    minimum: int = MIN_QUESTIONS,
    job: str = "tuning",
) -> list[Question]:
    """The questions whose gold documents are all in the version and that have a gold chunk;
    InvalidRequest when fewer than `minimum` are left (`job` names what needs them)."""
    usable = [
        q
        for q in questions
        if all(d in table.rows_of_doc for d in q.gold_doc_ids)
        and any(gold_items(q, table, table.rows_of_doc, "chunk"))
    ]
    if len(usable) < minimum:
        hint = (
            "label more questions"
            if len(usable) == len(questions)
            else "are they written for this collection?"
        )
        raise InvalidRequest(
            f"{len(usable)} of {len(questions)} questions have a gold chunk in {name}; "
            f"{job} needs at least {minimum} ({hint})"
        )
    return usable


def _best_fusion(
    default: Fusion, grid: Sequence[Fusion], train: Sequence[Lists], progress: bool
) -> tuple[Fusion, Figures]:
    """The fusion of `grid` that scores best on `train` without losing recall@50/@100 to
    `default`, and its figures; `default` unless one beats it (ties keep the earlier)."""
    best, best_figures = default, score(default, train)
    default_figures = best_figures
    bar = progress_of(total=len(grid), desc="fusions", unit="fusion", enabled=progress)
    for fusion in grid:
        figures = score(fusion, train)
        # the objective against the best so far, the depth against the default only (against
        # the best's depth too, a later fit with a higher objective was refused for losing
        # depth another fit had gained: the choice followed the grid's order)
        if figures.improves_on(best_figures) and figures.keeps_depth_of(default_figures):
            best, best_figures = fusion, figures
        bar.update(1)
    bar.close()
    return best, best_figures


def _first_stage_lists(
    retriever: Retriever,
    name: str,
    table: ChunkTable,
    questions: Sequence[Question],
    progress: bool,
) -> dict[str, Lists]:
    out: dict[str, Lists] = {}
    bar = progress_of(total=len(questions), desc="first-stage lists", unit="q", enabled=progress)
    for start in range(0, len(questions), BATCH):
        batch = questions[start : start + BATCH]
        _, traces = retriever.trace([q.question for q in batch], mode="hybrid", collection=name)
        for q, trace in zip(batch, traces, strict=True):
            out[q.id] = Lists(
                dense=[(table.row_of[c], s.score) for c, s in trace.dense or []],
                bm25=[(table.row_of[c], s.score) for c, s in trace.bm25 or []],
                items=gold_items(q, table, table.rows_of_doc, "chunk"),
            )
        bar.update(len(batch))
    bar.close()
    return out
