"""The promotion gate: evaluate a freshly built version before the alias moves to it.

Example:
    rag-retriever ingest corpus.jsonl --collection docs --gate questions.jsonl \\
        --gate-k 10 --min-recall 0.8 --max-regression 0.01

The new version and the live one are evaluated with the same code as `eval/recall_at_k.py`
(`evaluate`), on the same questions, in the primary mode (rerank when a reranker is configured,
else hybrid). The gate refuses when recall@k of the new version is below `min_recall`, or below
the live version's by more than `max_regression` (an absolute difference: 0.01 = one point).
Defaults: min_recall 0 (off), max_regression 0.01. The live version is evaluated with the model
that built it (its `model_source`), so a model change is judged fairly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_retriever.errors import ConfigError
from rag_retriever.eval.evaluation import EvalRun, evaluate, primary_mode
from rag_retriever.eval.judge import judge
from rag_retriever.eval.questions import Question, load_questions
from rag_retriever.ingest.options import Gate, GateDecision
from rag_retriever.models.encoder import Encoder, encoder_of_version
from rag_retriever.models.reranker import CrossEncoderReranker, Scorer
from rag_retriever.query.retriever import RetrievalConfig, Retriever
from rag_retriever.records import Mode
from rag_retriever.settings import Settings
from rag_retriever.store import Store

MAX_LISTED_REGRESSIONS = 20
MAX_LISTED_PROBLEMS = 20


def make_gate(
    questions_path: Path,
    *,
    settings: Settings,
    encoder: Encoder,
    store: Store,
    k: int = 10,
    min_recall: float = 0.0,
    max_regression: float = 0.01,
    reranker: Scorer | None = None,
) -> Gate:
    """The gate of `ingest --gate questions_path`: checks its arguments and loads the questions
    and the reranker now, so a bad gate fails before anything is written."""
    questions, problems = load_questions(questions_path)
    if problems:  # a gate on fewer questions than were written is not the gate asked for
        shown = "\n  ".join(problems[:MAX_LISTED_PROBLEMS])
        more = len(problems) - MAX_LISTED_PROBLEMS
        raise ConfigError(
            f"--gate {questions_path}: {len(problems)} bad line(s); nothing was written:\n  "
            + shown
            + (f"\n  ... and {more} more" if more > 0 else "")
        )
    if not questions:
        raise ConfigError(f"--gate {questions_path}: no questions; nothing was written")
    # `not (a <= b)`: NaN fails every comparison (a NaN --max-regression turned the gate off)
    if not (0.0 <= min_recall <= 1.0) or not (0.0 <= max_regression <= 1.0):
        raise ConfigError(
            f"--min-recall and --max-regression must lie in [0, 1], got {min_recall} and "
            f"{max_regression}; nothing was written"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"--gate-k must be a positive integer, got {k}; nothing was written")
    if reranker is None:
        reranker = CrossEncoderReranker.from_settings(settings)
    return _RecallGate(
        questions,
        settings=settings,
        encoder=encoder,
        store=store,
        reranker=reranker,
        config=RetrievalConfig.from_settings(settings),
        k=k,
        min_recall=min_recall,
        max_regression=max_regression,
    )


class _RecallGate:
    """A `Gate`: promote the new version unless its recall@k is under `min_recall`, or under the
    live version's by more than `max_regression`."""

    def __init__(
        self,
        questions: Sequence[Question],
        *,
        settings: Settings,
        encoder: Encoder,
        store: Store,
        reranker: Scorer | None,
        config: RetrievalConfig,
        k: int,
        min_recall: float,
        max_regression: float,
    ) -> None:
        self.questions = questions
        self.settings = settings
        self.encoder = encoder
        self.store = store
        self.reranker = reranker
        self.config = config
        self.k = k
        self.min_recall = min_recall
        self.max_regression = max_regression

    def __call__(self, new: str, live: str | None) -> GateDecision:
        k = self.k
        new_retriever = self._retriever_for(new)
        mode = primary_mode(new_retriever.modes)
        new_run = self._evaluate(new_retriever, new, mode)
        new_recall = self._recall(new_run, mode)
        details: dict[str, Any] = {
            "mode": mode,
            "k": k,
            "new_recall": new_recall,
            "questions": len(self.questions),
            "new_without_gold": self._without_gold(new_run),
        }
        reasons = []
        if new_recall < self.min_recall:
            reasons.append(f"recall@{k} {new_recall:.4f} < --min-recall {self.min_recall}")
        summary = f"{mode} recall@{k}: new {new_recall:.4f}"
        if details["new_without_gold"]:
            summary += f" ({details['new_without_gold']} questions' gold not in it: misses)"
        if live is not None:
            live_details, versus, reason = self._against_live(live, mode, new_run, new_recall)
            details.update(live_details)
            summary += versus
            if reason is not None:
                reasons.append(reason)
        promote = not reasons
        summary += " -> promote" if promote else " -> REFUSED: " + "; ".join(reasons)
        if details.get("regressions"):
            listed = ", ".join(r["id"] for r in details["regressions"][:5])
            summary += f"; regressed e.g. {listed}"
        return GateDecision(promote=promote, summary=summary, details=details)

    def _against_live(
        self, live: str, mode: Mode, new_run: EvalRun, new_recall: float
    ) -> tuple[dict[str, Any], str, str | None]:
        """The live version evaluated the same way: its details (recall, the questions that
        regressed), the summary's comparison, and the reason to refuse (None: within bounds)."""
        k = self.k
        live_run = self._evaluate(self._retriever_for(live), live, mode)
        live_recall = self._recall(live_run, mode)
        regressed = _regressions(live_run, new_run, mode, k)
        details = {
            "live_recall": live_recall,
            "live_without_gold": self._without_gold(live_run),
            "regressed": len(regressed),
            "regressions": regressed[:MAX_LISTED_REGRESSIONS],
        }
        versus = f" vs live {live_recall:.4f} ({len(regressed)} questions regressed)"
        reason = None
        metric = f"recall@{k}"
        verdict = judge(
            {metric: new_recall},
            {metric: live_recall},
            metric=metric,
            max_regression=self.max_regression,
        )
        if verdict.regressed:
            reason = (
                f"recall@{k} fell by {live_recall - new_recall:.4f} > --max-regression "
                f"{self.max_regression}"
            )
        return details, versus, reason

    def _evaluate(self, retriever: Retriever, collection: str, mode: Mode) -> EvalRun:
        """`collection` evaluated on the gate's questions in `mode` (recall at 1, k and 10). A
        question whose gold documents the version does not hold is left out of the run (a
        corpus that adds or removes a gold document is what a gate is for): `_recall` counts
        it as a miss."""
        ks = sorted({1, self.k, 10})
        return evaluate(
            retriever,
            self.questions,
            collection=collection,
            modes=(mode,),
            ks=ks,
            failure_k=self.k,
            allow_missing_gold=True,
        )

    def _recall(self, run: EvalRun, mode: Mode) -> float:
        """recall@k over every gate question: those left out of `run` (no gold document in the
        version) count as misses."""
        scored = len(run.results)
        return run.summary["modes"][mode][f"recall@{self.k}"] * scored / len(self.questions)

    def _without_gold(self, run: EvalRun) -> int:
        return len(self.questions) - len(run.results)

    def _retriever_for(self, collection: str) -> Retriever:
        """A retriever of `collection` with the model that embedded it (loaded when it is not
        the ingest's own encoder)."""
        record = self.store.record(collection)
        model = self.encoder
        if record.fingerprint.id != self.encoder.fingerprint.id:
            model = encoder_of_version(record, self.settings)
        return Retriever(
            encoder=model,
            store=self.store,
            reranker=self.reranker,
            config=self.config,
        )


def _regressions(before: EvalRun, after: EvalRun, mode: str, k: int) -> list[dict[str, Any]]:
    """The questions found within k before and not after (also those `after` left out: its
    version lacks their gold documents)."""
    now_of = {r.id: r.first_rank(mode) for r in after.results}
    out = []
    for r in before.results:
        was, now = r.first_rank(mode), now_of.get(r.id)
        if was is not None and was <= k and (now is None or now > k):
            out.append({"id": r.id, "question": r.question, "rank_before": was, "rank_now": now})
    return out
