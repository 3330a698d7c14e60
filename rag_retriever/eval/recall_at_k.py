"""Did the retriever find the gold chunk? Per question, per mode, and which stage lost it.

Usage:
    python eval/recall_at_k.py --questions questions.jsonl --collection docs \\
        [--k 1 5 10 20 100] [--modes dense bm25 hybrid rerank] [--level chunk|doc] \\
        [--sample N --seed S] [--out DIR] [--json] [--compare PREVIOUS_OUT_DIR] \\
        [--fail-under recall@10=0.9 ...]

Writes per_question.jsonl/.csv, summary.json, problems.txt and recall_curve.png to --out, prints
the summary table (or the summary as JSON with --json), and exits 1 when a --fail-under figure is
not met (2 on bad input). Settings (model, data dir, Qdrant URL, reranker) come from RAG_*.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any, cast

from rag_retriever.errors import RagError
from rag_retriever.eval.evaluation import DEFAULT_KS, EvalRun, Level, evaluate
from rag_retriever.eval.questions import file_sha256, load_questions
from rag_retriever.eval.report import (
    check_thresholds,
    compare_runs,
    parse_threshold,
    summary_table,
    write_outputs,
)
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import MODES, Mode
from rag_retriever.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--questions", type=Path, required=True, help="labelled questions (.jsonl)")
    p.add_argument("--collection", help="alias or collection (default RAG_COLLECTION)")
    p.add_argument(
        "--k", type=int, nargs="+", default=list(DEFAULT_KS), help="cut-offs for recall@k"
    )
    p.add_argument("--modes", nargs="+", choices=MODES, help="default: every mode available")
    p.add_argument(
        "--level", choices=("chunk", "doc"), default="chunk", help="gold unit (default chunk)"
    )
    p.add_argument("--sample", type=int, help="evaluate a random sample of N questions")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    p.add_argument(
        "--failure-k", type=int, default=10, help="k of the failure classes (default 10)"
    )
    p.add_argument("--out", type=Path, default=Path("eval-out"), help="output directory (eval-out)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--compare", type=Path, help="an earlier --out dir: improvements/regressions")
    p.add_argument("--fail-under", action="append", default=[], metavar="[MODE:]METRIC=MIN")
    p.add_argument("--rerank-model", help="RAG_RERANK_MODEL for this run")
    p.add_argument(
        "--allow-missing-gold",
        action="store_true",
        help="skip questions whose gold documents are not in the collection (default: exit 2)",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def check_arguments(args: argparse.Namespace) -> None:
    """Everything that can be wrong with the arguments, before minutes of work."""
    if any(k <= 0 for k in args.k):
        raise ValueError(f"--k takes positive cut-offs, got {args.k}")
    if args.failure_k <= 0:
        raise ValueError(f"--failure-k must be positive, got {args.failure_k}")
    if args.sample is not None and args.sample <= 0:
        raise ValueError(f"--sample must be positive, got {args.sample}")
    for spec in args.fail_under:
        mode, metric, _ = parse_threshold(spec, "hybrid")
        known = [f"recall@{k}" for k in sorted(set(args.k))] + ["mrr@10", "ndcg@10"]
        if metric not in [*known, "candidate_recall"]:
            raise ValueError(
                f"--fail-under {spec!r}: unknown metric {metric!r}; this run computes "
                f"{', '.join(known)} and candidate_recall (recall@K needs K in --k)"
            )
        allowed = args.modes or MODES
        if ":" in spec.partition("=")[0] and mode not in allowed:
            raise ValueError(
                f"--fail-under {spec!r}: mode {mode!r} is not evaluated in this run "
                f"({', '.join(allowed)})"
            )
    if not args.questions.is_file():
        raise ValueError(f"--questions {args.questions} is not a file")
    if args.compare is not None:
        earlier = args.compare / "per_question.jsonl"
        if args.compare.resolve() == args.out.resolve():
            raise ValueError(
                f"--compare {args.compare} is this run's --out: its rows would be overwritten "
                f"before the comparison; move the earlier run or pass another --out"
            )
        if not earlier.is_file():
            raise ValueError(f"--compare {args.compare}: no {earlier.name} there (an --out dir)")


def run(args: argparse.Namespace, retriever: Retriever | None = None) -> int:
    """Evaluate, write the outputs, print the summary; the exit status (0, 1 under a
    --fail-under figure, 2 on bad input)."""
    check_arguments(args)
    settings = Settings.from_env(collection=args.collection, rerank_model=args.rerank_model)
    questions, problems = load_questions(args.questions)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if not questions:
        print(f"error: no valid questions in {args.questions}", file=sys.stderr)
        return 2
    if args.sample is not None and args.sample < len(questions):
        questions = sorted(
            random.Random(args.seed).sample(questions, args.sample), key=lambda q: q.line
        )
    retriever = retriever or Retriever.from_settings(settings)
    modes = cast(list[Mode], args.modes or list(retriever.modes))
    missing = [m for m in modes if m not in retriever.modes]
    if missing:
        print(
            f"error: mode(s) {missing} need a reranker: set RAG_RERANK_MODEL or --rerank-model",
            file=sys.stderr,
        )
        return 2
    result = evaluate(
        retriever,
        questions,
        collection=settings.collection,
        modes=modes,
        ks=sorted(set(args.k)),
        level=cast(Level, args.level),
        failure_k=args.failure_k,
        progress=not args.no_progress,
        allow_missing_gold=args.allow_missing_gold,
    )
    _record_inputs(result, args, retriever, problems)
    paths = write_outputs(result, args.out)
    comparison = _compare(args)
    _print_run(result, comparison, paths, as_json=args.json)
    failures = check_thresholds(result.summary, args.fail_under)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _record_inputs(
    result: EvalRun, args: argparse.Namespace, retriever: Retriever, problems: list[str]
) -> None:
    """Put what the run was made of into its result: the input file's problems first (the
    evaluation's own are printed here), the questions file and its hash, the sample, the models."""
    result.problems[:0] = problems
    result.summary.update(
        questions_file=str(args.questions),
        questions_sha256=file_sha256(args.questions),
        sample=args.sample,
        seed=args.seed,
        encoder=retriever.encoder.fingerprint.describe(),
        reranker=getattr(retriever.reranker, "name", None),
        input_problems=len(problems),
    )
    for problem in result.problems[len(problems) :]:
        print(f"problem: {problem}", file=sys.stderr)


def _compare(args: argparse.Namespace) -> dict[str, Any] | None:
    """With --compare: this run against the earlier one, also written to compare.json."""
    if not args.compare:
        return None
    comparison = compare_runs(args.out, args.compare, args.failure_k)
    (args.out / "compare.json").write_text(json.dumps(comparison, indent=2), encoding="utf-8")
    return comparison


def _print_run(
    result: EvalRun, comparison: dict[str, Any] | None, paths: dict[str, Path], *, as_json: bool
) -> None:
    """The summary (and the comparison) as JSON, or as a table with where the outputs are."""
    if as_json:
        print(json.dumps({"summary": result.summary, "compare": _compact(comparison)}, indent=2))
        return
    print(summary_table(result.summary))
    if comparison:
        print(_format_comparison(comparison))
    print(f"per-question results: {paths['per_question_jsonl']}; curve: {paths['curve']}")


def _compact(comparison: dict[str, Any] | None) -> dict[str, Any] | None:
    if comparison is None:
        return None
    return {
        "k": comparison["k"],
        "questions_compared": comparison["questions_compared"],
        "modes": {
            m: {"improved": v["improved"], "regressed": v["regressed"]}
            for m, v in comparison["modes"].items()
        },
    }


def _format_comparison(comparison: dict[str, Any], show: int = 5) -> str:
    lines = [
        f"compared with the earlier run on {comparison['questions_compared']} questions (hit@{comparison['k']}):"
    ]
    for mode, v in comparison["modes"].items():
        lines.append(f"  {mode:<7} {v['improved']} improved, {v['regressed']} regressed")
        for entry in v["regressions"][:show]:
            lines.append(
                f"    regressed {entry['id']}: rank {entry['rank_before']} -> {entry['rank_now']}  {entry['question'][:70]}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (RagError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
