"""`rag-retriever improve`: from labelled questions to a better served version in one command.

Example:
    rag-retriever improve --collection docs --questions questions.jsonl --budget 30m

What it does, in order, while the live version keeps serving:
  1. split the questions by document into three parts (no gold document in two): a training
     part, a fusion part and a held-out part; evaluate the live version on the held-out part
     (the baseline);
  2. `embedder`: fine-tune the embedding model on the training part (train-embedder);
  3. build a new, unpromoted version of the collection from the live version's own documents:
     with the new embedder when step 2 was kept, else with the live model (its vectors are
     reused); it starts with the live version's fusion and reranker;
  4. `fusion`: fit the fusion of the new version (tune-fusion) on questions its embedder was not
     trained on: the fusion part (with the training part too when the live model is kept). On
     its own training questions a fine-tuned embedder's list looks better than it will be on new
     ones, and a fusion fitted there leans on it too much (SQuAD: equal weights fitted there;
     BM25 weighted 4 when fitted on unseen questions);
  5. `reranker`: train a cross-encoder on the training part, starting from the new embedder
     (train-reranker), and record it with the version (a version names its reranker);
  6. the gate: evaluate new against live on the held-out part, with the code of
     `eval/recall_at_k.py`, and promote only when MRR@10 rises and recall@10 does not fall by
     more than `max_regression`.

Each step is kept only when it raises MRR@10 of the held-out part over what the version had before
it (ties: recall@1); a step that does not is dropped and said so. A reranker that hurts is
dropped: the version then serves fused hybrid. Every step's result is saved in the work
directory as it finishes, so a run that was stopped resumes with the first unfinished step.
With a time budget, the training steps are sized to it from a measured forward pass, and a step
that cannot fit is skipped. Models are kept under `<data dir>/models/<alias>/<run>/`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rag_retriever.errors import ConfigError
from rag_retriever.eval.evaluation import EvalRun, evaluate, primary_mode
from rag_retriever.eval.judge import judge
from rag_retriever.eval.questions import Question, file_sha256, load_questions
from rag_retriever.ingest.lock import IngestLock, update_record
from rag_retriever.ingest.versions import documents_of
from rag_retriever.ingest.writer import IngestReport, ingest_documents
from rag_retriever.models.device import training_thread
from rag_retriever.models.encoder import Encoder, encoder_of_version
from rag_retriever.models.profiles import ResolvedModel, resolve_model
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.retriever import RetrievalConfig, Retriever
from rag_retriever.settings import Settings
from rag_retriever.store import Store, open_store
from rag_retriever.store.catalog import apply_retention, point_alias, same_points
from rag_retriever.training.common import PeakMemory, write_question_subset
from rag_retriever.training.embedder import EmbedderTrainingConfig, train_embedder
from rag_retriever.training.fusion import (
    MIN_QUESTIONS,
    OBJECTIVE,
    split_by_document,
    tune_fusion,
    usable_questions,
)
from rag_retriever.training.reranker import RerankerTrainingConfig, train_reranker

log = logging.getLogger(__name__)

STEPS = ("embedder", "fusion", "reranker")
STATE_FILE = "state.json"
# A training step needs at least this many questions to be worth running.
MIN_TRAINING_QUESTIONS = 64
# Time per training question, in units of one text's inference pass (measured at the start of a
# run), from the trainers' measured speed on a 2-core CPU: train-embedder ~0.33 s a question
# (gradient caching included), train-reranker ~0.41 s (mining and validation included), with
# ~8 ms a pass.
EMBEDDER_PASSES_PER_QUESTION = 40.0
RERANKER_PASSES_PER_QUESTION = 50.0
# A question-chunk pair costs about this many passes of one text (it is longer; measured on
# SQuAD: 35,280 reranked pairs of the held-out part in ~13 min at ~11 ms a pass).
PAIR_PASSES = 2.0
# Of the time left after the baseline, the part each step may use.
BUDGET_SHARES = {"embedder": 0.5, "fusion": 0.1, "reranker": 0.4}


@dataclass(frozen=True)
class ImproveOptions:
    steps: tuple[str, ...] = STEPS
    budget_s: float | None = None
    held_out: float = 0.3
    fusion_part: float = 0.2  # of all questions: the fusion is fitted on these
    seed: int = 0
    max_regression: float = 0.01
    progress: bool = True
    # How the steps are judged: k folds (k >= 2; each step fitted on k-1 folds and judged on the
    # one it never saw, then refitted on every question), or 1 for one held-out part. None:
    # improver.KFOLDS_DEFAULT folds below improver.KFOLD_BELOW questions, else one held-out part.
    folds: int | None = None


def _figures(run: EvalRun) -> dict[str, Any]:
    """The held-out figures a step is judged by, with the per-question MRR@10 for intervals."""
    mode = primary_mode(run.modes)
    summary = run.summary["modes"][mode]
    return {
        "mode": mode,
        "mrr@10": summary["mrr@10"],
        "recall@1": summary["recall@1"],
        "recall@5": summary["recall@5"],
        "recall@10": summary["recall@10"],
        "questions": len(run.results),
    }


def _better(after: dict[str, Any], before: dict[str, Any]) -> bool:
    """A step is kept when it raises held-out MRR@10 (ties: recall@1): the tuner's objective."""
    return judge(after, before, metric=OBJECTIVE[0], tie_break=OBJECTIVE[1]).better


class Improve:
    """One run of `improve` over one alias; `say` receives one line per event."""

    def __init__(
        self,
        settings: Settings,
        questions_path: Path,
        *,
        work_dir: Path,
        options: ImproveOptions,
        say: Callable[[str], None] = print,
    ) -> None:
        unknown = set(options.steps) - set(STEPS)
        if unknown or not options.steps:
            raise ConfigError(f"--steps takes a comma-separated subset of {', '.join(STEPS)}")
        self.settings = settings
        self.alias = settings.collection
        self.questions_path = questions_path
        self.work_dir = work_dir
        self.options = options
        self.say = say
        self.store: Store = open_store(settings)
        self.started = time.monotonic()
        self.state: dict[str, Any] = {}
        self._retrievers: dict[str, Retriever] = {}
        self.judged_part = "held_out"

    # -- the run ------------------------------------------------------------------------------

    @training_thread
    def run(self) -> dict[str, Any]:
        self._start()
        self._step("baseline", self._baseline)
        if "embedder" in self.options.steps:
            self._step("embedder", self._embedder)
        self._step("candidate", self._candidate)
        for name in ("fusion", "reranker"):
            if name in self.options.steps:
                self._step(name, getattr(self, f"_{name}"))
        self._step("gate", self._gate)
        return self.state

    def _step(self, name: str, work: Callable[[], dict[str, Any]]) -> None:
        done = self.state["results"].get(name)
        if done is not None:
            self.say(f"{name:<10} done in an earlier run (resumed): {done.get('summary', '')}")
            return
        self.say(f"{name:<10} ...")
        began = time.monotonic()
        with PeakMemory() as peak:
            result = work()
        result.update(time_s=round(time.monotonic() - began, 1), peak_rss_mb=peak.mb)
        self.state["results"][name] = result
        self._save()
        self.say(f"{name:<10} {result.get('summary', '')}")

    # -- state --------------------------------------------------------------------------------

    def _start(self) -> None:
        live = self.store.resolve(self.alias)
        identity = {
            "alias": self.alias,
            "live": live,
            "questions": str(self.questions_path),
            "questions_sha256": file_sha256(self.questions_path),
            "held_out": self.options.held_out,
            "fusion_part": self.options.fusion_part,
            "seed": self.options.seed,
            "steps": list(self.options.steps),
            "folds": self.options.folds,
        }
        path = self.work_dir / STATE_FILE
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("identity") == identity and "gate" not in saved.get("results", {}):
                self.state = saved
                self.say(f"resuming   the run in {self.work_dir}")
                return
            archived = path.with_name(f"state-{saved.get('run', 'old')}.json")
            path.replace(archived)
            self.say(f"new run    (the earlier one is kept in {archived})")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        run = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        self.state = {"identity": identity, "run": run, "results": {}}
        self._split(live)
        self._save()

    def _before_step(self, step: str, name: str) -> Any:
        """What version `name` held in the record field `step` changes (its fusion, its
        reranker) before the step first changed it, noted in the state before the change: a run
        stopped between the change and its judgement (minutes) resumed with the unjudged value
        as the one to restore, and could keep and promote what was judged worse."""
        noted = self.state.setdefault("before_step", {})
        if step not in noted:
            noted[step] = getattr(self.store.record(name), step)
            self._save()
        return noted[step]

    def _save(self) -> None:
        path = self.work_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(path)

    def _split(self, live: str) -> None:
        """The training, fusion and held-out question files (split by document)."""
        questions, problems = load_questions(self.questions_path)
        table = ChunkTable.load(self.store, live)
        usable = usable_questions(
            questions,
            table,
            live,
            minimum=MIN_TRAINING_QUESTIONS + 2 * MIN_QUESTIONS,
            job="improve",
        )
        if problems:
            self.say(f"questions  {len(problems)} invalid lines of {self.questions_path} skipped")
        held_out, fusion_part = self.options.held_out, self.options.fusion_part
        if not (fusion_part > 0 and held_out + fusion_part < 1):
            raise ConfigError(
                f"--held-out ({held_out}) and --fusion-part ({fusion_part}) must be positive and "
                "leave questions to train on"
            )
        rest, held = split_by_document(usable, held_out, self.options.seed)
        train, fusion = split_by_document(rest, fusion_part / (1 - held_out), self.options.seed)
        parts = {"train": train, "fusion": fusion, "held_out": held}
        for part, subset in parts.items():
            write_question_subset(
                self.questions_path, {q.id for q in subset}, self._questions_file(part)
            )
        self.state["split"] = {part: len(subset) for part, subset in parts.items()}
        self.say(
            f"questions  {len(train)} to train on, {len(fusion)} to fit the fusion on, "
            f"{len(held)} held out (split by document; {len(questions) - len(usable)} without a "
            "gold chunk left out)"
        )

    def _questions_file(self, part: str) -> Path:
        return self.work_dir / f"questions_{part}.jsonl"

    def _questions(self, part: str) -> list[Question]:
        return load_questions(self._questions_file(part))[0]

    def _models_dir(self) -> Path:
        return self.settings.data_dir / "models" / self.alias / self.state["run"]

    # -- versions and their retrievers ---------------------------------------------------------

    def _retriever(self, name: str) -> Retriever:
        """A retriever of version `name` with the models it names (and no other)."""
        if name not in self._retrievers:
            record = self.store.record(name)
            encoder = encoder_of_version(record, self.settings)
            # only the version's reranker (None pins "no reranker" when it names none)
            source = (record.reranker or {}).get("source")
            reranker = CrossEncoderReranker.from_settings(
                self.settings.replace(rerank_model=source)
            )
            self._retrievers[name] = Retriever(
                encoder=encoder,
                store=self.store,
                reranker=reranker,
                config=RetrievalConfig.from_settings(self.settings),
                collection=name,
            )
        return self._retrievers[name]

    def _forget(self, name: str) -> None:
        """Drop the cached retriever of `name` (its metadata changed)."""
        self._retrievers.pop(name, None)

    def _evaluate(self, name: str, *, mode: str | None = None) -> dict[str, Any]:
        """Version `name` on the judged questions (the held-out part), in `mode` or its own."""
        retriever = self._retriever(name)
        modes = (mode,) if mode else (retriever.default_mode,)
        run = evaluate(
            retriever,
            self._questions(self.judged_part),
            collection=name,
            modes=modes,  # type: ignore[arg-type]
            ks=(1, 5, 10),
            progress=self.options.progress,
        )
        return _figures(run)

    def _update_record(self, name: str, **changes: Any) -> None:
        """Replace what is tuned for version `name` (its fusion, its reranker)."""
        update_record(
            self.store,
            name,
            lock_dir=self.settings.data_dir,
            wait_s=self.settings.lock_wait_s,
            **changes,
        )
        self._forget(name)

    # -- steps --------------------------------------------------------------------------------

    def _baseline(self) -> dict[str, Any]:
        live = self.state["identity"]["live"]
        figures = self._evaluate(live)
        return {
            "version": live,
            "figures": figures,
            "summary": f"live {live}: {_describe(figures)}",
        }

    def _embedder(self) -> dict[str, Any]:
        live = self.state["identity"]["live"]
        retriever = self._retriever(live)
        max_questions = self._sized("embedder", EMBEDDER_PASSES_PER_QUESTION, retriever.encoder)
        if max_questions is None:
            return {"kept": False, "summary": "skipped: the time budget is too small"}
        out = self._models_dir() / "embedder"
        base = ResolvedModel(str(self.store.record(live).model_source), retriever.encoder.profile)
        trained = self._train_embedder(self._questions_file("train"), out, base, max_questions)
        before = trained["validation_before"].get("mrr@10", 0.0)
        after = trained["validation_after"].get("mrr@10", 0.0)
        kept = after > before
        verdict = "kept" if kept else "dropped (it validated no better than the live model)"
        return {
            "kept": kept,
            "model": str(out),
            "questions": max_questions,
            "validation_mrr@10": [before, after],
            "summary": f"{verdict}: validation MRR@10 {before:.4f} -> {after:.4f}",
        }

    def _candidate(self) -> dict[str, Any]:
        """The new version, built from the live version's documents, not promoted: with the new
        embedder when it was kept and helps on the held-out part, else with the live model."""
        baseline = self.state["results"]["baseline"]["figures"]
        embedder = self.state["results"].get("embedder") or {}
        note = ""
        if embedder.get("kept"):
            name, report = self._build(embedder["model"])
            figures = self._evaluate(name)
            if _better(figures, baseline):
                return self._built(name, figures, report, "new embedder")
            self.store.delete(name)
            embedder.update(kept=False, summary=embedder["summary"] + "; dropped: held-out worse")
            note = f"the new embedder gave {_describe(figures)} on the held-out part: dropped; "
        name, report = self._build(None)
        return self._built(name, self._evaluate(name), report, note + "live model")

    def _build(self, model: str | None) -> tuple[str, IngestReport]:
        """A new, unpromoted version of the live documents, encoded with `model` (None: the live
        model, whose vectors are copied), with the live version's fusion and reranker."""
        live = self.state["identity"]["live"]
        record = self.store.record(live)
        if model is not None:
            encoder = Encoder.load(
                resolve_model(model),
                device=self.settings.device,
                dtype=self.settings.dtype,
                batch_size=self.settings.embed_batch_size,
            )
        else:
            encoder = self._retriever(live).encoder  # the live vectors are copied, not encoded
        chunking = record.chunking
        report = ingest_documents(
            documents_of(self.store, live),
            alias=self.alias,
            encoder=encoder,
            store=self.store,
            full=True,  # a new, unpromoted version to judge, even from the same model
            lock_dir=self.settings.data_dir,
            chunk_tokens=int(chunking.get("chunk_tokens", self.settings.chunk_tokens)),
            overlap_tokens=int(chunking.get("overlap_tokens", self.settings.chunk_overlap_tokens)),
            promote=False,
            progress=self.options.progress,
        )
        # It starts with what the live version serves with (each step may replace it).
        self._update_record(report.collection, fusion=record.fusion, reranker=record.reranker)
        return report.collection, report

    def _built(
        self, name: str, figures: dict[str, Any], report: IngestReport, how: str
    ) -> dict[str, Any]:
        baseline = self.state["results"]["baseline"]["figures"]
        return {
            "version": name,
            "figures": figures,
            "summary": f"{name} ({how}; {report.encoded} chunks encoded, {report.reused} "
            f"reused): {_describe(baseline)} -> {_describe(figures)}",
        }

    def _current(self) -> tuple[str, dict[str, Any]]:
        """The candidate version and its latest held-out figures."""
        results = self.state["results"]
        name = results["candidate"]["version"]
        for step in ("reranker", "fusion", "candidate"):
            if step in results and "figures" in results[step]:
                return name, results[step]["figures"]
        raise AssertionError("the candidate has figures")

    def _fusion_questions(self) -> tuple[list[Question], str]:
        """The questions the fusion is fitted on, and which: none the candidate's embedder was
        trained on (see the module docstring)."""
        fusion = self._questions("fusion")
        new_embedder = (self.state["results"].get("embedder") or {}).get("kept")
        if not new_embedder:
            return self._questions("train") + fusion, "training and fusion parts"
        if len(fusion) < MIN_QUESTIONS:  # too few to fit on: the biased fit beats none
            return self._questions("train") + fusion, (
                f"training and fusion parts: the fusion part alone has {len(fusion)}, fewer "
                f"than {MIN_QUESTIONS}; raise --fusion-part or label more questions"
            )
        return fusion, "fusion part"

    def _fusion(self) -> dict[str, Any]:
        name, before = self._current()
        questions, which = self._fusion_questions()
        report = tune_fusion(
            self._retriever(name),
            questions,
            collection=name,
            seed=self.options.seed,
            store=False,
            progress=self.options.progress,
        )
        questions_fitted = f"{len(questions)} questions ({which})"
        previous = self._before_step("fusion", name)
        self._update_record(name, fusion={**report.best.to_json(), "tuning": report.to_json()})
        after = self._evaluate(name)
        kept = _better(after, before)
        if kept:
            verdict = f"kept {report.best.describe()}"
        else:
            self._update_record(name, fusion=previous)
            verdict = f"dropped {report.best.describe()} (held-out {_describe(after)})"
        figures = after if kept else before
        return {
            "kept": kept,
            "fusion": report.best.to_json(),
            "fitted_on": questions_fitted,
            "figures": figures,
            "summary": f"{verdict} (fitted on {questions_fitted}): "
            f"{_describe(before)} -> {_describe(figures)}",
        }

    def _reranker(self) -> dict[str, Any]:
        name, before = self._current()
        retriever = self._retriever(name)
        max_questions = self._sized("reranker", RERANKER_PASSES_PER_QUESTION, retriever.encoder)
        if max_questions is None:
            return {"kept": False, "summary": "skipped: the time budget is too small"}
        out = self._models_dir() / "reranker"
        self._train_reranker(name, self._questions_file("train"), out, max_questions)
        previous = self._before_step("reranker", name)
        self._update_record(name, reranker={"source": str(out.resolve()), "trained_by": "improve"})
        after = self._evaluate(name, mode="rerank")
        kept = _better(after, before)
        if not kept:
            self._update_record(name, reranker=previous)
        verdict = "kept" if kept else "dropped (the version serves without it)"
        return {
            "kept": kept,
            "model": str(out),
            "questions": max_questions,
            "figures": after if kept else before,
            "summary": f"{verdict}: {_describe(before)} -> {_describe(after)}",
        }

    def _train_embedder(
        self, questions_file: Path, out: Path, base: ResolvedModel, max_questions: int
    ) -> dict[str, Any]:
        live = self.state["identity"]["live"]
        retriever = self._retriever(live)
        return train_embedder(
            retriever,
            questions_file,
            out,
            collection=live,
            base=base,
            config=EmbedderTrainingConfig(
                max_questions=max_questions,
                seed=self.options.seed,
                name=f"{retriever.encoder.profile.name.split('/')[-1]}-ft-{self.alias}",
            ),
            device=self.settings.device,
            dtype=self.settings.dtype,
            overwrite=True,
            progress=self.options.progress,
        )

    def _train_reranker(
        self, name: str, questions_file: Path, out: Path, max_questions: int
    ) -> None:
        train_reranker(
            self._retriever(name),
            questions_file,
            out,
            collection=name,
            base=str(self.store.record(name).model_source),
            config=RerankerTrainingConfig(
                max_questions=max_questions, seed=self.options.seed, name=f"reranker-{self.alias}"
            ),
            device=self.settings.device,
            dtype=self.settings.dtype,
            overwrite=True,
            progress=self.options.progress,
        )

    def _gate(self) -> dict[str, Any]:
        """New against live on the held-out part (the figures each was last evaluated with, by
        the same code); promote only when the new version is better."""
        live = self.state["identity"]["live"]
        name, new_figures = self._current()
        live_figures = self.state["results"]["baseline"]["figures"]
        kept = [s for s in STEPS if (self.state["results"].get(s) or {}).get("kept")]
        judged = judge(
            new_figures,
            live_figures,
            metric=OBJECTIVE[0],
            tie_break=OBJECTIVE[1],
            guard="recall@10",
            max_regression=self.options.max_regression,
        )
        wanted = bool(kept) and judged.better and not judged.regressed
        moved = None
        if wanted:
            # under the alias's write lock, and only if the alias still serves the version the
            # candidate was built from, or a compaction of it (the same points): a write during
            # the run (hours) would be lost otherwise
            with IngestLock(self.settings.data_dir, self.alias, wait_s=self.settings.lock_wait_s):
                moved = self.store.aliases().get(self.alias)
                if moved is not None and live in same_points(
                    self.store.versions(self.alias), moved
                ):
                    moved = live
                if moved == live:
                    point_alias(self.store, self.alias, name)
                    apply_retention(
                        self.store,
                        self.alias,
                        self.settings.keep_versions,
                        grace_s=self.settings.retention_grace_s,
                    )
        promote = wanted and moved == live
        if promote:
            verdict = f"promoted: {self.alias} -> {name} (rollback restores {live})"
        elif wanted and moved is None:
            verdict = f"not promoted: {self.alias} no longer exists; {name} is kept unpromoted"
        elif wanted:
            verdict = (
                f"not promoted: {self.alias} moved from {live} to {moved} during the run, and "
                f"{name} was built from {live}'s documents (serving it would drop the writes "
                f"since); it is kept unpromoted (`rag-retriever promote` serves it as it is); "
                f"run improve again to build on {moved}"
            )
        elif not kept:
            self.store.delete(name)
            verdict = f"not promoted (no step helped): {self.alias} still serves {live}"
        else:
            verdict = (
                f"not promoted (the new version is not better than live): {self.alias} still "
                f"serves {live}; {name} is kept unpromoted (`rag-retriever promote` serves it)"
            )
        return {
            "promoted": promote,
            "kept_steps": kept,
            "live": live_figures,
            "new": new_figures,
            "summary": f"{_describe(live_figures)} (live) vs {_describe(new_figures)} (new): "
            + verdict,
        }

    # -- the budget ---------------------------------------------------------------------------

    def _sized(
        self,
        step: str,
        passes_per_question: float,
        encoder: Encoder,
        *,
        trainings: float = 1.0,
        builds: int = 1,
        judged: int | None = None,
    ) -> int | None:
        """How many training questions step `step` may use within the budget (all of them
        without one); None when even MIN_TRAINING_QUESTIONS would not fit. The step trains
        `trainings` times on that many questions, re-encodes the corpus `builds` times (the
        embedder) and reranks the candidates of `judged` questions (the reranker; default the
        held-out part)."""
        available = self.state["split"]["train"]
        budget = self.options.budget_s
        if budget is None:
            return available
        left = budget - (time.monotonic() - self.started)
        share = (
            left
            * BUDGET_SHARES[step]
            / sum(BUDGET_SHARES[s] for s in self.options.steps if s not in self.state["results"])
        )
        per_pass = _seconds_per_pass(encoder)
        fixed = 0.0
        if step == "embedder":  # the new version re-embeds every chunk
            chunks = self.store.record(self.state["identity"]["live"]).chunks
            fixed = chunks * per_pass * builds
        if step == "reranker":  # the judged questions are evaluated reranked
            reranked = self.state["split"]["held_out"] if judged is None else judged
            fixed = reranked * self.settings.rerank_candidates * PAIR_PASSES * per_pass
        fits = int((share - fixed) / (passes_per_question * per_pass * trainings))
        self.say(
            f"{step:<10} budget {share / 60:.1f} min: ~{per_pass * 1000:.0f} ms per text pass, "
            f"room for {max(fits, 0)} of {available} training questions"
        )
        if fits < MIN_TRAINING_QUESTIONS:
            return None
        return min(fits, available)


def _seconds_per_pass(encoder: Encoder) -> float:
    """Seconds one text of passage length takes through the encoder (a measured batch)."""
    texts = ["a passage of ordinary length " * 24] * 16
    encoder.encode_passages(texts[:2])  # warm-up
    began = time.perf_counter()
    encoder.encode_passages(texts)
    return (time.perf_counter() - began) / len(texts)


def _describe(figures: dict[str, Any]) -> str:
    return (
        f"MRR@10 {figures['mrr@10']:.4f}, recall@1 {figures['recall@1']:.4f}, "
        f"recall@10 {figures['recall@10']:.4f} ({figures['mode']})"
    )
