"""Writing an evaluation: per-question JSONL/CSV, summary.json, the recall@k curve, comparisons.

Example:
    >>> write_outputs(run, Path("eval-out"))          # doctest: +SKIP
    >>> print(summary_table(run.summary))             # doctest: +SKIP
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_retriever.eval.evaluation import EvalRun, QuestionResult
from rag_retriever.eval.metrics import recall_from_ranks

CURVE_MAX_K = 100


def write_outputs(run: EvalRun, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.to_row(run.ks) for r in run.results]
    paths = {
        "per_question_jsonl": out / "per_question.jsonl",
        "per_question_csv": out / "per_question.csv",
        "summary": out / "summary.json",
        "problems": out / "problems.txt",
        "curve": out / "recall_curve.png",
    }
    with paths["per_question_jsonl"].open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    with paths["per_question_csv"].open("w", encoding="utf-8", newline="") as fh:
        columns = [c for c in rows[0] if not c.startswith("item_ranks_")] if rows else ["id"]
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})
    paths["summary"].write_text(json.dumps(run.summary, indent=2) + "\n", encoding="utf-8")
    paths["problems"].write_text("".join(p + "\n" for p in run.problems), encoding="utf-8")
    plot_recall_curve(run, paths["curve"])
    return paths


def _csv_value(value: Any) -> Any:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "" if value is None else value


def recall_curve(
    results: Sequence[QuestionResult], mode: str, max_k: int = CURVE_MAX_K
) -> list[float]:
    """recall@k for k = 1..max_k (mean over questions)."""
    ranks = [r.item_ranks.get(mode, [None]) for r in results]
    if not ranks:
        return [0.0] * max_k
    return [sum(recall_from_ranks(x, k) for x in ranks) / len(ranks) for k in range(1, max_k + 1)]


def plot_recall_curve(run: EvalRun, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ks = list(range(1, CURVE_MAX_K + 1))
    for mode in run.modes:
        ax.plot(ks, recall_curve(run.results, mode), label=mode, linewidth=1.8)
    ax.set_xscale("log")
    ax.set_xticks([1, 2, 5, 10, 20, 50, 100], labels=["1", "2", "5", "10", "20", "50", "100"])
    ax.set_xlabel("k")
    ax.set_ylabel("recall@k")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    n = run.summary.get("questions_evaluated", len(run.results))
    ax.set_title(f"{run.collection} ({run.level} level, {n} questions)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary_table(summary: dict[str, Any]) -> str:
    modes: dict[str, dict[str, float]] = summary["modes"]
    metrics = list(next(iter(modes.values())).keys()) if modes else []
    lines = [f"{'mode':<8}" + "".join(f"{m:>11}" for m in metrics)]
    for mode, figures in modes.items():
        lines.append(f"{mode:<8}" + "".join(f"{figures[m]:>11.4f}" for m in metrics))
    classes = ", ".join(f"{c} {n}" for c, n in summary["failure_classes"].items() if n)
    level = f"{summary['level']} level"
    without_spans = summary.get("questions_without_spans", 0)
    if summary["level"] == "chunk" and without_spans:
        level += f"; {without_spans} without gold spans count any chunk of their gold document"
    skipped = sum(summary.get("questions_skipped", {}).values())
    if skipped:
        level += f"; {skipped} skipped: {summary['questions_skipped']}"
    ceiling = (
        f"; candidate recall (top-{summary['rerank_candidates']} fused, the reranker's ceiling) "
        f"{summary['candidate_recall']:.4f}"
        if summary["candidate_recall"] is not None
        else "; no fused list in this run (no candidate recall)"
    )
    lines.append(
        f"questions {summary['questions_evaluated']} ({level}) in {summary['time_s']}s{ceiling}"
    )
    lines.append(
        f"failure classes at k={summary['failure_k']} ({summary['primary_mode']}): {classes}"
    )
    return "\n".join(lines)


def compare_runs(current: Path, previous: Path, k: int) -> dict[str, Any]:
    """Per-question improvements and regressions of `current` against `previous` (hit@k)."""
    now = _load_rows(current)
    before = _load_rows(previous)
    shared = sorted(set(now) & set(before))
    modes = sorted(
        {c[len("rank_") :] for c in next(iter(now.values()), {}) if c.startswith("rank_")}
        & {c[len("rank_") :] for c in next(iter(before.values()), {}) if c.startswith("rank_")}
    )
    out: dict[str, Any] = {"k": k, "questions_compared": len(shared), "modes": {}}
    for mode in modes:
        improved, regressed = [], []
        for qid in shared:
            a, b = before[qid].get(f"rank_{mode}"), now[qid].get(f"rank_{mode}")
            hit_a, hit_b = a is not None and a <= k, b is not None and b <= k
            entry = {"id": qid, "question": now[qid]["question"], "rank_before": a, "rank_now": b}
            if hit_b and not hit_a:
                improved.append(entry)
            elif hit_a and not hit_b:
                regressed.append(entry)
        out["modes"][mode] = {
            "improved": len(improved),
            "regressed": len(regressed),
            "improvements": improved,
            "regressions": regressed,
        }
    return out


def _load_rows(directory: Path) -> dict[str, dict[str, Any]]:
    path = directory / "per_question.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; --compare needs the --out dir of an earlier run"
        )
    with path.open(encoding="utf-8") as fh:
        return {row["id"]: row for row in map(json.loads, fh)}


def parse_threshold(spec: str, default_mode: str) -> tuple[str, str, float]:
    """`recall@10=0.9` or `hybrid:mrr@10=0.5` -> (mode, metric, minimum)."""
    target, sep, raw = spec.partition("=")
    if not sep:
        raise ValueError(f"--fail-under expects METRIC=VALUE, got {spec!r}")
    mode, colon, metric = target.partition(":")
    if not colon:
        mode, metric = default_mode, target
    try:
        minimum = float(raw)
    except ValueError:
        raise ValueError(f"--fail-under {spec!r}: the minimum must be a number") from None
    if not math.isfinite(minimum):  # nothing is below NaN: the check would never fail
        raise ValueError(f"--fail-under {spec!r}: the minimum must be a finite number")
    return mode, metric, minimum


def check_thresholds(summary: dict[str, Any], specs: Sequence[str]) -> list[str]:
    """Failures as readable lines; an unknown metric is itself a failure (never ignored)."""
    failures = []
    for spec in specs:
        mode, metric, minimum = parse_threshold(spec, summary["primary_mode"])
        if metric == "candidate_recall":
            value = summary["candidate_recall"]
            if value is None:
                failures.append(f"{spec}: no fused list in this run, so no candidate recall")
                continue
        else:
            figures = summary["modes"].get(mode)
            if figures is None or metric not in figures:
                known = sorted(next(iter(summary["modes"].values()), {}))
                failures.append(
                    f"{spec}: unknown mode or metric (modes {sorted(summary['modes'])}, metrics {known})"
                )
                continue
            value = figures[metric]
        if value < minimum:
            failures.append(f"{mode}:{metric} = {value:.4f} is below {minimum}")
    return failures
