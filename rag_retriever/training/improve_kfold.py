"""`improve` with k-fold decisions: every labelled question judges a step, and the kept steps are
refitted on every question before the version is built (the default below improver.KFOLD_BELOW
questions).

Example:
    rag-retriever improve --collection docs --questions questions.jsonl --folds 5

Why: a team's first labelled set is a few hundred questions. Split three ways (train, fusion,
held out), the embedder trains on fewer than half of them and is judged on a few hundred: on
SciFact's 809 claims it trained on 404, judged worse on 243, and was dropped, while an embedder
trained on all of them helps. Here the questions are split by document into k folds, and:

  1. `baseline`: the live version on every question, in the mode it serves;
  2. `embedder`: for each fold, an embedder trained on the other folds encodes a scratch version
     (deleted at once) whose dense and BM25 lists of the fold's questions are kept: every
     question gets lists from a model that never saw it ("out-of-fold lists"). Scored with the
     live fusion, they judge the step against the live lists; when kept, the embedder is trained
     again on every question, and that model builds the new version;
  3. `fusion` (nested, on the cached lists, so cheap): for each fold, the fusion fitted on the
     other folds' out-of-fold lists ranks the fold; kept when that beats the version's fusion
     without losing recall@50/@100, then fitted on all the lists. Out-of-fold lists are how the
     final embedder will rank questions it never saw, so the fusion does not over-trust it;
  4. `reranker`: for each fold, a cross-encoder trained on the other folds reranks the fold's
     fused out-of-fold lists; kept when that helps, then trained on every question;
  5. the gate: the pooled out-of-fold figures of the kept steps against the baseline, as the
     held-out gate of `improve` does.

Every figure a decision uses comes from questions the step's models never saw (only the choice
among a handful of steps is made on them). Each fold's lists are saved as they are made, so a
stopped run resumes with the next fold. The cost: an embedder trained k+1 times and the corpus
encoded k+1 times; `--budget` sizes the training to fit, and `--folds 1` is the cheaper
three-part split.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rag_retriever.eval.evaluation import gold_items
from rag_retriever.eval.metrics import mrr_at_k, recall_at_k
from rag_retriever.eval.questions import Question, load_questions
from rag_retriever.models.profiles import ResolvedModel
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.fusion import Fusion
from rag_retriever.query.retriever import RetrievalConfig, Retriever, Trace
from rag_retriever.records import StageScore
from rag_retriever.training.common import write_question_subset
from rag_retriever.training.folds import folds_by_document
from rag_retriever.training.fusion import (
    MIN_QUESTIONS,
    Lists,
    candidates,
    usable_questions,
)
from rag_retriever.training.fusion import (
    _best_fusion as best_fusion,
)
from rag_retriever.training.improve import (
    EMBEDDER_PASSES_PER_QUESTION,
    MIN_TRAINING_QUESTIONS,
    RERANKER_PASSES_PER_QUESTION,
    Improve,
    _better,
    _describe,
)

TRACE_BATCH = 64
# A cached list: (chunk id, score) best first, per question id and list ("dense", "bm25").
Cached = dict[str, dict[str, list[tuple[str, float]]]]


class KFoldImprove(Improve):
    """`improve` whose steps are judged by k-fold cross-validation (module docstring)."""

    def run(self) -> dict[str, Any]:
        self.judged_part = "all"
        return super().run()

    # -- the folds ----------------------------------------------------------------------------

    @property
    def k(self) -> int:
        assert self.options.folds is not None
        return self.options.folds

    def _split(self, live: str) -> None:
        """Every usable question (`questions_all.jsonl`) in k folds by document."""
        questions, problems = load_questions(self.questions_path)
        table = ChunkTable.load(self.store, live)
        usable = usable_questions(
            questions, table, live, minimum=MIN_TRAINING_QUESTIONS + MIN_QUESTIONS, job="improve"
        )
        if problems:
            self.say(f"questions  {len(problems)} invalid lines of {self.questions_path} skipped")
        folds = folds_by_document(usable, self.k, seed=self.options.seed)
        for stale in self.work_dir.glob("lists_*.json"):  # an earlier run's, of other folds
            stale.unlink()
        write_question_subset(
            self.questions_path, {q.id for q in usable}, self._questions_file("all")
        )
        for i, fold in enumerate(folds):
            write_question_subset(
                self.questions_path, {q.id for q in fold}, self._questions_file(f"fold{i}")
            )
            rest = {q.id for j, other in enumerate(folds) if j != i for q in other}
            write_question_subset(self.questions_path, rest, self._questions_file(f"train{i}"))
        self.state["split"] = {
            "folds": [len(f) for f in folds],
            "train": len(usable),
            "held_out": 0,
        }
        self.say(
            f"questions  {len(usable)} in {self.k} folds of {', '.join(str(len(f)) for f in folds)}"
            f" (by document; {len(questions) - len(usable)} without a gold chunk left out): each "
            "step is judged on the folds it never trained on, then refitted on all of them"
        )

    def _folds(self) -> list[list[Question]]:
        return [self._questions(f"fold{i}") for i in range(self.k)]

    # -- cached first-stage lists -------------------------------------------------------------

    def _lists_file(self, which: str) -> Path:
        return self.work_dir / f"lists_{which}.json"

    def _cached(self, which: str, make: Callable[[], Cached]) -> Cached:
        """The lists saved as `which`, made (and saved) by `make()` when not saved yet."""
        path = self._lists_file(which)
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            return {
                q: {side: [(c, s) for c, s in ranked] for side, ranked in sides.items()}
                for q, sides in saved.items()
            }
        lists: Cached = make()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(lists), encoding="utf-8")
        tmp.replace(path)
        return lists

    def _trace(self, name: str, questions: Sequence[Question]) -> Cached:
        """Version `name`'s dense and BM25 lists of `questions`."""
        retriever = self._retriever(name)
        out: Cached = {}
        for at in range(0, len(questions), TRACE_BATCH):
            batch = questions[at : at + TRACE_BATCH]
            _, traces = retriever.trace([q.question for q in batch], mode="hybrid", collection=name)
            for q, trace in zip(batch, traces, strict=True):
                out[q.id] = {
                    "dense": [(c, s.score) for c, s in trace.dense or []],
                    "bm25": [(c, s.score) for c, s in trace.bm25 or []],
                }
        return out

    def _live_lists(self) -> Cached:
        live = self.state["identity"]["live"]
        return self._cached("live", lambda: self._trace(live, self._questions("all")))

    @functools.cached_property
    def _table(self) -> ChunkTable:
        """The live version's chunk table: every version built here has the same chunks."""
        return ChunkTable.load(self.store, self.state["identity"]["live"])

    def _as_lists(self, cached: Cached, questions: Sequence[Question]) -> list[Lists]:
        table = self._table
        return [
            Lists(
                dense=[(table.row_of[c], s) for c, s in cached[q.id]["dense"]],
                bm25=[(table.row_of[c], s) for c, s in cached[q.id]["bm25"]],
                items=gold_items(q, table, table.rows_of_doc, "chunk"),
            )
            for q in questions
        ]

    def _fusion_of(self, name: str) -> Fusion:
        retriever = self._retriever(name)
        return retriever.fusion_for(retriever.open_collection(name, "hybrid"))

    # -- steps --------------------------------------------------------------------------------

    def _embedder(self) -> dict[str, Any]:
        live = self.state["identity"]["live"]
        retriever = self._retriever(live)
        max_questions = self._sized(
            "embedder",
            EMBEDDER_PASSES_PER_QUESTION,
            retriever.encoder,
            trainings=float(self.k),
            builds=self.k + 1,
        )
        if max_questions is None:
            return {
                "kept": False,
                "summary": f"skipped: the time budget is too small for {self.k} folds "
                "(raise --budget, or --folds 1 for one held-out part)",
            }
        base = ResolvedModel(str(self.store.record(live).model_source), retriever.encoder.profile)
        oof: Cached = {}
        for i, fold in enumerate(self._folds()):
            oof.update(
                self._cached(
                    f"embedder_fold{i}",
                    functools.partial(self._fold_lists, i, fold, base, max_questions),
                )
            )
        fusion = self._fusion_of(live)
        questions = self._questions("all")
        before = _pooled(fusion_rankings(fusion, self._as_lists(self._live_lists(), questions)))
        after = _pooled(fusion_rankings(fusion, self._as_lists(oof, questions)))
        kept = _better(after, before)
        summary = (
            f"out-of-fold {_describe(before)} (live model) -> {_describe(after)} "
            f"(trained on the other folds)"
        )
        result: dict[str, Any] = {
            "kept": kept,
            "questions": max_questions,
            "folds": {"before": before, "after": after},
            "figures": after if kept else before,
        }
        if not kept:
            return {**result, "summary": f"dropped: {summary}"}
        out = self._models_dir() / "embedder"
        trained = self._train_embedder(self._questions_file("all"), out, base, max_questions)
        validation = [
            trained["validation_before"].get("mrr@10"),
            trained["validation_after"].get("mrr@10"),
        ]
        return {
            **result,
            "model": str(out),
            "validation_mrr@10": validation,
            "summary": f"kept, retrained on all {len(questions)} questions: {summary}",
        }

    def _fold_lists(
        self, i: int, fold: Sequence[Question], base: ResolvedModel, max_questions: int
    ) -> Cached:
        """Fold `i`'s lists from a scratch version encoded by a model trained on the others."""
        self.say(f"embedder   fold {i + 1} of {self.k}: training on the other folds")
        out = self._models_dir() / f"embedder-fold{i}"
        self._train_embedder(self._questions_file(f"train{i}"), out, base, max_questions)
        name, _ = self._build(str(out))
        try:
            return self._trace(name, fold)
        finally:
            self._forget(name)
            self.store.delete(name)
            shutil.rmtree(out, ignore_errors=True)

    def _candidate(self) -> dict[str, Any]:
        """The new version: built with the embedder trained on every question when the step was
        kept, else with the live model (vectors copied); its figures are the step's."""
        embedder = self.state["results"].get("embedder") or {}
        model = embedder.get("model") if embedder.get("kept") else None
        name, report = self._build(model)
        figures = embedder.get("figures") or self._current_figures(name)
        how = "the embedder retrained on every question" if model else "live model"
        return self._built(name, figures, report, how)

    def _current_figures(self, name: str) -> dict[str, Any]:
        questions = self._questions("all")
        return _pooled(
            fusion_rankings(self._fusion_of(name), self._as_lists(self._lists(), questions))
        )

    def _lists(self) -> Cached:
        """Each question's lists from a model that never saw it: the fold models' when the
        embedder was kept, else the live model's (which saw none)."""
        if (self.state["results"].get("embedder") or {}).get("kept"):
            oof: Cached = {}
            for i in range(self.k):
                oof.update(self._cached(f"embedder_fold{i}", _missing))
            return oof
        return self._live_lists()

    def _fusion(self) -> dict[str, Any]:
        name, before = self._current()
        current = self._fusion_of(name)
        cached = self._lists()
        folds = [self._as_lists(cached, fold) for fold in self._folds()]
        grid = list(candidates(min(current.depths)))
        rankings: list[Ranked] = []
        chosen = []
        for i, fold in enumerate(folds):
            train = [q for j, other in enumerate(folds) if j != i for q in other]
            fitted, _ = best_fusion(current, grid, train, progress=False)
            chosen.append(fitted.describe())
            rankings.extend(fusion_rankings(fitted, fold))
        after = _pooled(rankings)
        everything = [q for fold in folds for q in fold]
        unchanged = _pooled(fusion_rankings(current, everything))
        kept = _better(after, unchanged) and _keeps_depth(after, unchanged)
        final, _ = best_fusion(current, grid, everything, progress=self.options.progress)
        if kept and final != current:
            tuning = {"folds": self.k, "fold_choices": chosen, "out_of_fold": after}
            self._update_record(name, fusion={**final.to_json(), "tuning": tuning})
            verdict = f"kept {final.describe()} (fitted on all {len(everything)} questions)"
        else:
            kept = False
            verdict = f"dropped (out-of-fold {_describe(after)})"
        return {
            "kept": kept,
            "fusion": final.to_json(),
            "fitted_on": f"{len(everything)} questions ({self.k} folds, out-of-fold lists)",
            "fold_choices": chosen,
            "figures": after if kept else before,
            "summary": f"{verdict}: {_describe(unchanged)} -> {_describe(after)} out of fold",
        }

    def _reranker(self) -> dict[str, Any]:
        name, before = self._current()
        retriever = self._retriever(name)
        total = self.state["split"]["train"]
        max_questions = self._sized(
            "reranker",
            RERANKER_PASSES_PER_QUESTION,
            retriever.encoder,
            trainings=float(self.k),
            judged=total,
        )
        if max_questions is None:
            return {"kept": False, "summary": "skipped: the time budget is too small"}
        fusion = self._fusion_of(name)
        cached = self._lists()
        rankings: list[Ranked] = []
        for i, fold in enumerate(self._folds()):
            self.say(f"reranker   fold {i + 1} of {self.k}: training on the other folds")
            out = self._models_dir() / f"reranker-fold{i}"
            self._train_reranker(name, self._questions_file(f"train{i}"), out, max_questions)
            reranker = CrossEncoderReranker.from_settings(
                self.settings.replace(rerank_model=str(out))
            )
            assert reranker is not None
            rankings.extend(self._reranked(reranker, fusion, cached, fold))
            shutil.rmtree(out, ignore_errors=True)
        after = {**_pooled(rankings), "mode": "rerank"}
        kept = _better(after, before)
        result: dict[str, Any] = {
            "kept": kept,
            "questions": max_questions,
            "figures": after if kept else before,
        }
        if not kept:
            return {
                **result,
                "summary": f"dropped (the version serves without it): {_describe(before)} -> "
                f"{_describe(after)} out of fold",
            }
        out = self._models_dir() / "reranker"
        self._train_reranker(name, self._questions_file("all"), out, max_questions)
        self._update_record(name, reranker={"source": str(out.resolve()), "trained_by": "improve"})
        return {
            **result,
            "model": str(out),
            "summary": f"kept, retrained on all {total} questions: {_describe(before)} -> "
            f"{_describe(after)} out of fold",
        }

    def _reranked(
        self,
        reranker: CrossEncoderReranker,
        fusion: Fusion,
        cached: Cached,
        fold: Sequence[Question],
    ) -> Iterator[Ranked]:
        """The fold's fused out-of-fold lists reranked by `reranker`, by the serving code."""
        live = self.state["identity"]["live"]
        serving = Retriever(
            encoder=self._retriever(live).encoder,
            store=self.store,
            reranker=reranker,
            config=RetrievalConfig.from_settings(self.settings),
            collection=live,
        )
        table = self._table
        for q, lists in zip(fold, self._as_lists(cached, fold), strict=True):
            trace = Trace(
                q.question,
                dense=_staged(cached[q.id]["dense"]),
                bm25=_staged(cached[q.id]["bm25"]),
            )
            serving._fuse(trace, fusion)
            serving._rerank(live, trace)
            yield [table.row_of[c] for c, _ in trace.final("rerank")], lists.items


# A question's ranking (chunk rows, best first) and its gold items.
Ranked = tuple[list[int], list[set[Any]]]


def fusion_rankings(fusion: Fusion, lists: Sequence[Lists]) -> list[Ranked]:
    return [([row for row, _ in fusion.fuse(q.dense, q.bm25)][:100], q.items) for q in lists]


def _pooled(rankings: Sequence[Ranked]) -> dict[str, Any]:
    """The figures a step is judged by (as improve's held-out ones), pooled over questions."""
    n = max(len(rankings), 1)
    out: dict[str, Any] = {"mode": "hybrid", "questions": len(rankings)}
    out["mrr@10"] = sum(mrr_at_k(r, items, 10) for r, items in rankings) / n
    for k in (1, 5, 10, 50, 100):
        out[f"recall@{k}"] = sum(recall_at_k(r, items, k) for r, items in rankings) / n
    return out


def _keeps_depth(after: dict[str, Any], before: dict[str, Any]) -> bool:
    return all(after[f"recall@{k}"] >= before[f"recall@{k}"] - 1e-9 for k in (50, 100))


def _staged(ranked: list[tuple[str, float]]) -> list[tuple[str, StageScore]]:
    return [(c, StageScore(rank, s)) for rank, (c, s) in enumerate(ranked, start=1)]


def _missing() -> Cached:
    raise AssertionError("a kept embedder has every fold's lists saved")
