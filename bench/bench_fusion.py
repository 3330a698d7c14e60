"""Which fusion of the dense and BM25 lists should serve untuned: every label-free fusion against
BM25 alone and dense alone, on every labelled set, on held-out halves, and fitted on synthetic
questions.

Usage (through `make bench`, or alone):
    python -m bench --only fusion --out bench-out

Each set is ingested with the defaults (all-MiniLM-L6-v2, 200-token chunks) under
`<out>/data` (SQuAD: the 48 articles, for questions_dev and questions_train, which ask about
different articles of the same docs.jsonl; SciFact: the 5,183 abstracts), the dense and BM25
lists of every question (100 each) are fetched once through `Retriever.trace` and cached in
`<out>/fusion-lists.json.gz`, so a rerun costs seconds. Every fusion is then scored on the
cached lists: recall@1/@5/@10 at chunk level (SQuAD: the chunk holding the answer span) and
document level, plus recall@50/@100.

Selection: a fusion *loses* on a (set, level, cut-off) by max(dense, BM25) - its recall; the
rule kept is the one whose worst loss over every set, level and cut-off 1/5/10 is smallest (ties:
the higher mean recall). It is chosen on one half of each set's questions (split by document) and
reported on the other half, both ways, so a rule that only fits its data shows it. Synthetic:
the best weight of each family fitted on 1,000 synthetic questions per corpus
(training/synthetic.py), scored on the real questions.
"""

from __future__ import annotations

import gzip
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bench_common import shared_path
from rag_retriever.eval.metrics import item_ranks
from rag_retriever.query.fusion import Fusion
from rag_retriever.training import fusion as tuning
from rag_retriever.training.fusion import Lists

DEPTH = 100
CUTS = (1, 5, 10)
SYNTHETIC = 300  # per corpus: encoding the cut chunks is the slow part on 2 shared cores
SQUAD_TRAIN_SAMPLE = 2000  # of 4,862, seeded: the same reason
# The label-free candidates: RRF's k and weights, and each score fusion's BM25 weight (dense 1).
RRF_KS = (2, 5, 10, 20, 40, 60)
BM25_WEIGHTS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
SETS = {  # name -> (data folder, question file, levels)
    "squad-dev": ("squad_v11_dev", "questions_dev.jsonl", ("chunk", "doc")),
    "squad-train": ("squad_v11_dev", "questions_train.jsonl", ("chunk", "doc")),
    "scifact": ("scifact", "questions_train.jsonl", ("doc",)),
}
COLLECTION = {"squad_v11_dev": "squad", "scifact": "scifact"}


@dataclass(frozen=True)
class Case:
    """One question's cached lists: rows and scores, the gold chunk rows, the gold doc ids, and
    which half it belongs to (0/1, by document)."""

    dense: list[tuple[int, float]]
    bm25: list[tuple[int, float]]
    gold_rows: list[list[int]]
    gold_docs: list[str]
    half: int


def candidates() -> list[tuple[str, Fusion | str]]:
    out: list[tuple[str, Fusion | str]] = [("dense alone", "dense"), ("bm25 alone", "bm25")]
    depths = (DEPTH, DEPTH)
    for k in RRF_KS:
        for w in BM25_WEIGHTS:
            out.append((f"rrf k={k} w={w:g}", Fusion("rrf", k=k, weights=(1, w), depths=depths)))
    for method in ("dbsf", "minmax", "zscore", "adaptive"):
        for w in BM25_WEIGHTS:
            out.append((f"{method} w={w:g}", Fusion(method, weights=(1, w), depths=depths)))
    return out


def run(out: Path, *, synthetic: int = SYNTHETIC) -> dict[str, Any]:
    cache, cache_synthetic = out / "fusion-lists.json.gz", out / "fusion-synthetic.json.gz"
    began = time.perf_counter()
    if not cache.exists() or not cache_synthetic.exists():
        _write_cache(out, cache, cache_synthetic, synthetic)
    cache_s = time.perf_counter() - began
    data = json.loads(gzip.decompress(cache.read_bytes()))
    data["synthetic"] = json.loads(gzip.decompress(cache_synthetic.read_bytes()))
    sets = {name: [Case(**c) for c in cases] for name, cases in data["sets"].items()}
    doc_of = data["doc_of"]
    began = time.perf_counter()
    figures = _all_figures(sets, doc_of)
    table = _table(figures["all"])
    default = dict(candidates())[table["best"]]
    assert isinstance(default, Fusion)
    return {
        "cache_s": round(cache_s, 1),
        "table": table,
        "halves": _halves(figures),
        "synthetic": _synthetic(sets, doc_of, data["synthetic"], default),
        "figures_s": round(time.perf_counter() - began, 1),
    }


# -- the cache ----------------------------------------------------------------------------------


def _write_cache(out: Path, cache: Path, cache_synthetic: Path, synthetic: int) -> None:
    from rag_retriever.eval.evaluation import gold_items
    from rag_retriever.eval.questions import load_questions
    from rag_retriever.ingest.loaders import load_documents
    from rag_retriever.ingest.writer import ingest_documents
    from rag_retriever.query.chunk_table import ChunkTable
    from rag_retriever.query.retriever import Retriever
    from rag_retriever.settings import Settings
    from rag_retriever.training.fusion import split_by_document

    settings = Settings.from_env(data_dir=out / "data", rerank_model=None)
    retriever = Retriever.from_settings(settings)
    doc_of: dict[str, list[str]] = {}
    tables: dict[str, ChunkTable] = {}
    for folder, alias in COLLECTION.items():
        if alias not in retriever.store.aliases():
            ingest_documents(
                load_documents(shared_path(folder, "docs.jsonl")),
                alias=alias,
                encoder=retriever.encoder,
                store=retriever.store,
            )
        name = retriever.store.resolve(alias)
        tables[folder] = ChunkTable.load(retriever.store, name)
        doc_of[alias] = [c.doc_id for c in tables[folder].chunks]
    if cache.exists():
        _write_synthetic(retriever, tables, cache_synthetic, synthetic)
        return
    sets: dict[str, list[dict[str, Any]]] = {}
    for set_name, (folder, file, _) in SETS.items():
        table = tables[folder]
        questions, _ = load_questions(shared_path(folder, file))
        questions = [q for q in questions if all(d in table.rows_of_doc for d in q.gold_doc_ids)]
        if set_name == "squad-train":
            questions = sorted(
                random.Random(0).sample(questions, SQUAD_TRAIN_SAMPLE), key=lambda q: q.line
            )
        first, _second = split_by_document(questions, 0.5, seed=0)
        in_first = {q.id for q in first}
        cases = []
        for begin in range(0, len(questions), 64):
            batch = questions[begin : begin + 64]
            _, traces = retriever.trace(
                [q.question for q in batch], mode="hybrid", collection=COLLECTION[folder]
            )
            for q, trace in zip(batch, traces, strict=True):
                items = gold_items(q, table, table.rows_of_doc, "chunk")
                cases.append(
                    {
                        "dense": [(table.row_of[c], s.score) for c, s in trace.dense or []],
                        "bm25": [(table.row_of[c], s.score) for c, s in trace.bm25 or []],
                        "gold_rows": [sorted(int(str(r)) for r in item) for item in items],
                        "gold_docs": list(q.gold_doc_ids),
                        "half": 0 if q.id in in_first else 1,
                    }
                )
        sets[set_name] = cases
        print(f"fusion: cached the lists of {len(cases)} {set_name} questions", flush=True)
    cache.write_bytes(gzip.compress(json.dumps({"doc_of": doc_of, "sets": sets}).encode()))
    _write_synthetic(retriever, tables, cache_synthetic, synthetic)


def _write_synthetic(
    retriever: Any, tables: dict[str, Any], cache_synthetic: Path, synthetic: int
) -> None:
    from rag_retriever.training.synthetic import synthetic_lists, synthetic_questions

    made: dict[str, list[dict[str, Any]]] = {}
    for folder, alias in COLLECTION.items():
        table = tables[folder]
        lists = synthetic_lists(retriever, table, synthetic_questions(table, synthetic, seed=0))
        made[alias] = [{"dense": d, "bm25": b, "gold_rows": [sorted(g[0])]} for d, b, g in lists]
        print(f"fusion: cached {len(made[alias])} synthetic questions of {alias}", flush=True)
    retriever.store.close()
    cache_synthetic.write_bytes(gzip.compress(json.dumps(made).encode()))


# -- scoring ------------------------------------------------------------------------------------


def _ranking(method: Fusion | str, case: Case) -> list[int]:
    if method == "dense":
        return [r for r, _ in case.dense]
    if method == "bm25":
        return [r for r, _ in case.bm25]
    assert isinstance(method, Fusion)
    return [r for r, _ in method.fuse(case.dense, case.bm25)]


def _per_question(
    method: Fusion | str, cases: Sequence[Case], doc_of: list[str], levels: Sequence[str]
) -> list[dict[str, float]]:
    """Each question's recall@{1,5,10,50,100} per level: 'chunk r@1', 'doc r@5', ..."""
    out = []
    for case in cases:
        ranking = _ranking(method, case)[:DEPTH]
        row: dict[str, float] = {}
        for level in levels:
            if level == "chunk":
                keys: list[Any] = ranking
                items: list[set[Any]] = [set(g) for g in case.gold_rows]
            else:
                keys, items = [doc_of[r] for r in ranking], [{d} for d in case.gold_docs]
            ranks = item_ranks(keys, items)
            for k in (*CUTS, 50, 100):
                hit = sum(1 for r in ranks if r is not None and r <= k)
                row[f"{level} r@{k}"] = hit / len(items) if items else 0.0
        out.append(row)
    return out


def _mean(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    return {key: sum(r[key] for r in rows) / max(len(rows), 1) for key in rows[0]} if rows else {}


def _figures(
    method: Fusion | str, cases: Sequence[Case], doc_of: list[str], levels: Sequence[str]
) -> dict[str, float]:
    return _mean(_per_question(method, cases, doc_of, levels))


def _all_figures(
    sets: dict[str, list[Case]], doc_of: dict[str, list[str]]
) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """split ('all', 'half 0', 'half 1') -> candidate -> set -> figures (each question's
    figures computed once)."""
    out: dict[str, Any] = {"all": {}, "half 0": {}, "half 1": {}}
    for label, method in candidates():
        for split in out.values():
            split[label] = {}
        for set_name, cases in sets.items():
            folder, _, levels = SETS[set_name]
            rows = _per_question(method, cases, doc_of[COLLECTION[folder]], levels)
            out["all"][label][set_name] = _mean(rows)
            for h in (0, 1):
                half = [r for r, c in zip(rows, cases, strict=True) if c.half == h]
                out[f"half {h}"][label][set_name] = _mean(half)
    return out


def _loss(figures: dict[str, dict[str, dict[str, float]]], label: str) -> tuple[float, float]:
    """(worst loss to the better single list over sets, levels and cut-offs 1/5/10; mean
    recall over the same)."""
    worst, total, n = float("-inf"), 0.0, 0
    for set_name, fig in figures[label].items():
        for key, value in fig.items():
            if int(key.split("@")[1]) not in CUTS:
                continue
            best_single = max(
                figures["dense alone"][set_name][key], figures["bm25 alone"][set_name][key]
            )
            worst = max(worst, best_single - value)
            total, n = total + value, n + 1
    return worst, total / n


def _choose(figures: dict[str, dict[str, dict[str, float]]], family: str | None = None) -> str:
    labels = [
        label
        for label in figures
        if "alone" not in label and (family is None or label.startswith(family + " "))
    ]
    return min(labels, key=lambda label: (_loss(figures, label)[0], -_loss(figures, label)[1]))


def _table(figures: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    return {
        "figures": figures,
        "loss": {label: _loss(figures, label) for label in figures},
        "best": _choose(figures),
        "best_of_family": {f: _choose(figures, f) for f in _families()},
    }


def _families() -> tuple[str, ...]:
    return ("rrf", "dbsf", "minmax", "zscore", "adaptive")


def _halves(figures: dict[str, Any]) -> dict[str, Any]:
    """Choose on one half, report on the other (both ways), per family and overall."""
    halves = [figures["half 0"], figures["half 1"]]
    out: dict[str, Any] = {}
    for fit, report in ((0, 1), (1, 0)):
        chosen = {f: _choose(halves[fit], f) for f in _families()}
        chosen["overall"] = _choose(halves[fit])
        out[f"fit on half {fit}"] = {
            which: {
                "chosen": label,
                "loss on fitted half": round(_loss(halves[fit], label)[0], 4),
                "loss on other half": round(_loss(halves[report], label)[0], 4),
                "mean recall on other half": round(_loss(halves[report], label)[1], 4),
            }
            for which, label in chosen.items()
        }
    return out


def _synthetic(
    sets: dict[str, list[Case]], doc_of: dict[str, list[str]], made: dict[str, Any], default: Fusion
) -> dict[str, Any]:
    """Per corpus, what `tune-fusion` would do fitted on synthetic questions (no flag of it asks
    for them: the same grid, objective, depth guard and held-out check, 30% of the synthetic
    questions held out by document), then the fusion it would serve scored on that corpus's real
    questions next to `default`."""
    out: dict[str, Any] = {}
    for alias, rows in made.items():
        lists = [Lists(r["dense"], r["bm25"], [set(g) for g in r["gold_rows"]]) for r in rows]
        doc = [doc_of[alias][r["gold_rows"][0][0]] for r in rows]
        docs = sorted(set(doc))
        random.Random(0).shuffle(docs)
        held_docs = set(docs[: max(1, round(0.3 * len(docs)))])  # split by document
        held = [x for x, d in zip(lists, doc, strict=True) if d in held_docs]
        train = [x for x, d in zip(lists, doc, strict=True) if d not in held_docs]
        grid = list(tuning.candidates(DEPTH))
        best, fitted = tuning._best_fusion(default, grid, train, progress=False)
        served = best if tuning.score(best, held).beats(tuning.score(default, held)) else default
        real = {}
        for set_name, cases in sets.items():
            folder, _, levels = SETS[set_name]
            if COLLECTION[folder] != alias:
                continue
            real[set_name] = {
                "fitted": _figures(served, cases, doc_of[alias], levels),
                "default": _figures(default, cases, doc_of[alias], levels),
            }
        out[alias] = {
            "questions": len(lists),
            "best on synthetic": best.describe(),
            "served": served.describe(),
            "synthetic train": fitted.to_json(),
            "real": real,
        }
    return out


def report(results: dict[str, Any]) -> list[str]:
    table = results["table"]
    figures, loss = table["figures"], table["loss"]
    lines = ["", "## fusion: label-free fusions vs the better single list (recall@1/5/10)"]
    shown = [
        "dense alone",
        "bm25 alone",
        "rrf k=60 w=1",
        "dbsf w=1",
        *table["best_of_family"].values(),
    ]
    for label in dict.fromkeys(shown):
        parts = []
        for set_name, fig in figures[label].items():
            for level in SETS[set_name][2]:
                cut = "/".join(f"{fig[f'{level} r@{k}']:.4f}" for k in CUTS)
                parts.append(f"{set_name} {level} {cut}")
        lines.append(f"{label:<22} worst loss {loss[label][0]:+.4f} | " + " | ".join(parts))
    lines.append(f"best overall: {table['best']} (worst loss {loss[table['best']][0]:+.4f})")
    for fit, chosen in results["halves"].items():
        for which, row in chosen.items():
            lines.append(f"{fit}, {which}: {row}")
    for alias, row in results["synthetic"].items():
        lines.append(
            f"synthetic {alias} ({row['questions']} questions): best {row['best on synthetic']}, "
            f"served {row['served']}"
        )
        for set_name, pair in row["real"].items():
            for which, fig in pair.items():
                cut = " ".join(f"{k} {v:.4f}" for k, v in fig.items())
                lines.append(f"  {set_name} {which}: {cut}")
    return lines
