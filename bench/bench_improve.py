"""What a few hundred labelled questions buy: the embedder's learning curve, and `improve`
cross-validated (issue 21, item 7).

Usage:
    python -m bench.bench_improve curve [--out bench-out] [--splits 2]
    python -m bench.bench_improve cv [--out bench-out] [--set scifact|squad] [--folds 3] [--inner 3]
        [--outer N]
    python -m bench.bench_improve report [--out bench-out]

- `curve`: fine-tune all-MiniLM-L6-v2 (train-embedder, its defaults) on 200 / 400 / all the
  SciFact claims of the other folds (4 folds by document), judged on the held-out fold
  (document level), then on 200 / 400 / 800 SQuAD train questions (random draws), judged on all
  5,708 SQuAD **dev** questions (chunk level, never trained on). Each model gets a new,
  unpromoted version of the collection (every chunk re-encoded), evaluated dense and hybrid
  (the default fusion) next to the stock model on the same questions.
- `cv`: `improve` itself (steps embedder and fusion), cross-validated: the questions (SciFact's
  809 claims, or 800 drawn from SQuAD train) are split by document into `--folds` folds; for each
  fold, `improve` runs on the others, with k-fold decisions (`--inner` folds) and then with the
  single held-out split it used before (`--folds 1`), each from the stock version, and what each
  serves is judged on the fold it never saw, next to the stock version (nDCG@10 and the rest;
  document level for SciFact, chunk level for SQuAD).

Results go to `<out>/improve.json` as each part finishes, and a run resumes where it stopped.
Timings on a loaded machine mean little here; the figures are the point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bench_common import shared_path
from rag_retriever.eval.evaluation import evaluate
from rag_retriever.eval.questions import Question, load_questions
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.versions import documents_of
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.profiles import ResolvedModel, resolve_model
from rag_retriever.query.retriever import RetrievalConfig, Retriever
from rag_retriever.settings import Settings
from rag_retriever.store.catalog import point_alias
from rag_retriever.training.embedder import EmbedderTrainingConfig, train_embedder
from rag_retriever.training.folds import folds_by_document
from rag_retriever.training.improve import ImproveOptions
from rag_retriever.training.improver import improver

SIZES = (200, 400, 800)
SCIFACT_FOLDS = 4
METRICS = ("ndcg@10", "mrr@10", "recall@1", "recall@5", "recall@10")
log = logging.getLogger("bench.improve")


class Results:
    """`<out>/improve.json`, written after every figure (a stopped run resumes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = (
            json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        )

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def _figures(
    retriever: Retriever, questions: Sequence[Question], collection: str, level: str
) -> dict[str, dict[str, float]]:
    run = evaluate(
        retriever,
        questions,
        collection=collection,
        modes=("dense", "hybrid"),
        ks=(1, 5, 10),
        level=level,  # type: ignore[arg-type]
    )
    return {
        mode: {m: round(run.summary["modes"][mode][m], 4) for m in METRICS}
        for mode in ("dense", "hybrid")
    }


def _write(questions: Sequence[Question], source: Path, out: Path) -> Path:
    ids = {q.id for q in questions}
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    out.write_text(
        "\n".join(line for line in lines if str(json.loads(line)["id"]) in ids) + "\n",
        encoding="utf-8",
    )
    return out


def _fine_tuned_figures(
    stock: Retriever,
    settings: Settings,
    alias: str,
    train_file: Path,
    seed: int,
    questions: Sequence[Question],
    level: str,
    work: Path,
) -> dict[str, Any]:
    """Train on `train_file`, build an unpromoted version with the model, judge it, delete it."""
    live = stock.store.resolve(alias)
    record = stock.store.record(live)
    out = work / "model"
    trained = train_embedder(
        stock,
        train_file,
        out,
        collection=alias,
        base=ResolvedModel(str(record.model_source), stock.encoder.profile),
        config=EmbedderTrainingConfig(seed=seed),
        overwrite=True,
        progress=False,
    )
    encoder = Encoder.load(resolve_model(str(out)), batch_size=settings.embed_batch_size)
    report = ingest_documents(
        documents_of(stock.store, live),
        alias=alias,
        encoder=encoder,
        store=stock.store,
        full=True,
        promote=False,
        progress=False,
    )
    tuned = Retriever(
        encoder=encoder,
        store=stock.store,
        reranker=None,
        config=RetrievalConfig.from_settings(settings),
        collection=report.collection,
    )
    figures = _figures(tuned, questions, report.collection, level)
    stock.store.delete(report.collection)
    return {
        "figures": figures,
        "validation_mrr@10": [
            trained["validation_before"].get("mrr@10"),
            trained["validation_after"].get("mrr@10"),
        ],
        "train_s": trained.get("time_s"),
    }


def curve(out: Path, splits: int, sets: Sequence[str] = ("scifact", "squad")) -> None:
    results = Results(out / "improve.json")
    work = out / "improve-work"
    work.mkdir(parents=True, exist_ok=True)
    settings = Settings.from_env(data_dir=out / "improve-data", collection="squad")
    stock = Retriever.from_settings(settings.replace(rerank_model=None), mode="hybrid")
    for alias, folder in (("squad", "squad_v11_dev"), ("scifact", "scifact")):
        if alias not in stock.store.aliases():
            ingest_documents(
                load_documents(shared_path(folder, "docs.jsonl")),
                alias=alias,
                encoder=stock.encoder,
                store=stock.store,
            )
    if "scifact" in sets:
        _scifact_curve(splits, stock, settings, results, work)
    if "squad" in sets:
        _squad_curve(splits, stock, settings, results, work)
    stock.store.close()


def _scifact_curve(
    splits: int,
    stock: Retriever,
    settings: Settings,
    results: Results,
    work: Path,
) -> None:
    """SciFact: folds by document; train on the other folds, judge on the held-out one."""
    scifact_path = shared_path("scifact", "questions_train.jsonl")
    claims = load_questions(scifact_path)[0]
    folds = folds_by_document(claims, SCIFACT_FOLDS, seed=0)
    for split in range(min(splits, SCIFACT_FOLDS)):
        held = folds[split]
        pool = [q for i, fold in enumerate(folds) if i != split for q in fold]
        random.Random(split).shuffle(pool)
        key = f"curve/scifact/stock/{split}"
        if results.get(key) is None:
            results.put(key, _figures(stock, held, "scifact", "doc"))
        for n in (200, 400, len(pool)):
            point = Point("scifact", scifact_path, split, held, "doc")
            _measure(point, pool[:n], stock, settings, results, work)


def _squad_curve(
    splits: int, stock: Retriever, settings: Settings, results: Results, work: Path
) -> None:
    """SQuAD: train on draws from questions_train, judge on all of questions_dev."""
    squad_train_path = shared_path("squad_v11_dev", "questions_train.jsonl")
    squad_train = load_questions(squad_train_path)[0]
    squad_dev = load_questions(shared_path("squad_v11_dev", "questions_dev.jsonl"))[0]
    if results.get("curve/squad/stock") is None:
        results.put("curve/squad/stock", _figures(stock, squad_dev, "squad", "chunk"))
    for split in range(splits):
        draw = sorted(squad_train, key=lambda q: q.id)
        random.Random(split).shuffle(draw)
        for n in SIZES:
            point = Point("squad", squad_train_path, split, squad_dev, "chunk")
            _measure(point, draw[:n], stock, settings, results, work)


@dataclass(frozen=True)
class Point:
    """One point of the curve: a set, its questions file, the draw, what it is judged on."""

    alias: str
    source: Path
    split: int
    judged: Sequence[Question]
    level: str


def _measure(
    point: Point,
    train: Sequence[Question],
    stock: Retriever,
    settings: Settings,
    results: Results,
    work: Path,
) -> None:
    """Train on `train`, judge on the point's questions (once: a saved figure is kept)."""
    key = f"curve/{point.alias}/{len(train)}/{point.split}"
    if results.get(key) is not None:
        return
    log.warning("%s", key)
    train_file = _write(train, point.source, work / "train.jsonl")
    figures = _fine_tuned_figures(
        stock, settings, point.alias, train_file, point.split, point.judged, point.level, work
    )
    results.put(key, figures)


# What `cv` runs on: (alias, data folder, questions file, level, questions drawn or None for all).
CV_SETS = {
    "scifact": ("scifact", "scifact", "questions_train.jsonl", "doc", None),
    # a first labelled set's size, drawn from SQuAD train (4,862 questions would take the
    # three-part split, unchanged)
    "squad": ("squad", "squad_v11_dev", "questions_train.jsonl", "chunk", 800),
}


def cv(out: Path, folds: int, inner: int, which: str, only: int | None = None) -> None:
    """`improve` on all but one fold of a set's questions, judged on that fold (module
    docstring); every fold, or the one numbered `only` (0-based)."""
    alias_of_set, folder, filename, level, drawn = CV_SETS[which]
    results = Results(out / "improve-cv.json")
    # its own data directory: `curve` may be writing to the other one
    settings = Settings.from_env(data_dir=out / "improve-cv-data", collection=alias_of_set)
    stock = Retriever.from_settings(settings.replace(rerank_model=None), mode="hybrid")
    if alias_of_set not in stock.store.aliases():
        ingest_documents(
            load_documents(shared_path(folder, "docs.jsonl")),
            alias=alias_of_set,
            encoder=stock.encoder,
            store=stock.store,
        )
    stock_version = stock.store.resolve(alias_of_set)
    path = shared_path(folder, filename)
    claims = load_questions(path)[0]
    if drawn is not None:
        claims = random.Random(0).sample(claims, drawn)
    outer = folds_by_document(claims, folds, seed=1)  # not the curve's folds (seed 0)
    prefix = "" if which == "scifact" else f"{which}/"
    # fold by fold, both ways of judging on the same fold before the next (a stopped run has
    # paired figures)
    for o, held in enumerate(outer):
        if only is not None and o != only:
            continue
        for method, k in (("kfold", inner), ("split", 1)):
            key = f"cv/{prefix}{method}/{o}"
            if results.get(key) is not None:
                continue
            log.warning("%s", key)
            alias = f"cv{prefix.strip('/')}{o}{method}"
            point_alias(stock.store, alias, stock_version)
            train = [q for j, fold in enumerate(outer) if j != o for q in fold]
            questions = _write(train, path, out / f"cv-{which}-{o}.jsonl")
            run = improver(
                settings.replace(collection=alias),
                questions,
                work_dir=out / "improve-cv-work" / alias,
                options=ImproveOptions(
                    steps=("embedder", "fusion"), folds=k, seed=o, progress=False
                ),
                say=lambda line: log.warning("  %s", line),
            )
            state = run.run()
            run.store.close()
            served = Retriever.from_settings(settings.replace(collection=alias, rerank_model=None))
            name = served.store.resolve(alias)
            results.put(
                key,
                {
                    "served": name,
                    "kept_steps": state["results"]["gate"]["kept_steps"],
                    "promoted": state["results"]["gate"]["promoted"],
                    "train_questions": len(train),
                    "figures": _figures(served, held, name, level),
                    "stock": _figures(stock, held, stock_version, level),
                },
            )
            served.store.close()
    stock.store.close()


def report(data: dict[str, Any]) -> list[str]:
    """One line per (set, questions): mean over draws of dense / hybrid nDCG@10 and MRR@10, the
    stock model's on the same questions beside it."""
    lines = []
    for name in ("squad", "scifact"):
        rows: dict[str, list[dict[str, Any]]] = {}
        for key, value in data.items():
            parts = key.split("/")
            if parts[:2] == ["curve", name] and parts[2] != "stock":
                rows.setdefault(parts[2], []).append(value["figures"])
        stock = [v for k, v in data.items() if k.startswith(f"curve/{name}/stock")]
        if not stock:
            continue
        base = _mean(stock)
        lines.append(
            f"{name}: stock dense nDCG@10 {base['dense']['ndcg@10']:.4f}, hybrid "
            f"{base['hybrid']['ndcg@10']:.4f} (MRR@10 {base['hybrid']['mrr@10']:.4f})"
        )
        for n in sorted(rows, key=int):
            got = rows[n]
            mean = _mean(got)
            lines.append(
                f"  {n:>4} questions ({len(got)} draws): dense nDCG@10 "
                f"{mean['dense']['ndcg@10']:.4f} ({mean['dense']['ndcg@10'] - base['dense']['ndcg@10']:+.4f}), "
                f"hybrid {mean['hybrid']['ndcg@10']:.4f} "
                f"({mean['hybrid']['ndcg@10'] - base['hybrid']['ndcg@10']:+.4f}), hybrid MRR@10 "
                f"{mean['hybrid']['mrr@10']:.4f} ({mean['hybrid']['mrr@10'] - base['hybrid']['mrr@10']:+.4f})"
            )
    return lines


def _mean(figures: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each mode's metrics averaged over draws."""
    return {
        mode: {m: sum(f[mode][m] for f in figures) / len(figures) for m in METRICS}
        for mode in ("dense", "hybrid")
    }


def report_cv(data: dict[str, Any]) -> list[str]:
    """Per way of deciding: what `improve` served on each held-out fold against stock."""
    lines = []
    for which, method in itertools.product(CV_SETS, ("kfold", "split")):
        prefix = "" if which == "scifact" else f"{which}/"
        rows = [v for k, v in sorted(data.items()) if k.startswith(f"cv/{prefix}{method}/")]
        if not rows:
            continue
        label = {"kfold": "k-fold decisions", "split": "one held-out part"}[method]
        served = [r["figures"]["hybrid"]["ndcg@10"] for r in rows]
        stock = [r["stock"]["hybrid"]["ndcg@10"] for r in rows]
        gains = [a - b for a, b in zip(served, stock, strict=True)]
        lines.append(
            f"{which} train, improve cross-validated ({label}, {len(rows)} held-out folds, "
            f"{rows[0]['train_questions']} questions to improve on): "
            f"served nDCG@10 {sum(served) / len(rows):.4f} vs stock {sum(stock) / len(rows):.4f} "
            f"({sum(gains) / len(rows):+.4f}; per fold "
            + ", ".join(
                f"{g:+.4f} kept {'+'.join(r['kept_steps']) or 'nothing'}"
                for g, r in zip(gains, rows, strict=True)
            )
            + ")"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_improve", description=__doc__)
    parser.add_argument("part", choices=("curve", "cv", "report"))
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--splits", type=int, default=2)
    parser.add_argument(
        "--sets", nargs="+", choices=("scifact", "squad"), default=["scifact", "squad"]
    )
    parser.add_argument("--folds", type=int, default=3, help="outer folds of `cv` (3)")
    parser.add_argument("--set", choices=sorted(CV_SETS), default="scifact")
    parser.add_argument("--inner", type=int, default=3, help="improve's folds in `cv` (3)")
    parser.add_argument(
        "--outer", type=int, help="run this outer fold of `cv` only (0-based; default: all)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "curve":
        curve(args.out, args.splits, args.sets)
    if args.part == "cv":
        if args.outer is not None and not 0 <= args.outer < args.folds:
            parser.error(f"--outer must be in [0, {args.folds}), got {args.outer}")
        cv(args.out, args.folds, args.inner, args.set, args.outer)
    lines = report(Results(args.out / "improve.json").data)
    lines += report_cv(Results(args.out / "improve-cv.json").data)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
