"""What quantized vectors cost in recall: each RAG_QUANTIZATION the embedded engine applies,
against exact search and against float32, on the same vectors, in one run.

Usage:
    python -m bench.bench_quantization [--dataset squad|scifact] [--questions 1000]
        [--distractors 100000] [--shard-points 10000] [--settings int8 binary binary2]
        [--builds 3] [--paired] [--keep DIR | --reuse DIR]

The set's documents are ingested once with the default model (float32, Qdrant Edge); the same
points (vectors, BM25 weights, payloads) are then written into a version of each other setting
(int8, which Edge holds as TurboQuant's 8 bits, and binary: docs/versions.md). For
`--questions` labelled questions: dense recall@10 and @100 against an exact search
(brute-force cosine over the stored float32 vectors), and the end-to-end recall@10 and
nDCG@10 of dense and hybrid retrieval as `eval/recall_at_k.py` scores them (the product's
`evaluate`), for each setting. `squad` (the default): SQuAD's 48 articles and its dev
questions, the gold chunk (span level). `scifact`: the 5,183 SciFact abstracts and its 809
labelled claims, the gold abstract (document level, as BEIR scores it; only the train claims
are in ../shared/data, and nothing here trains on them: the figures compare settings on the
same claims). The peer is float32 (`none`), the engine's own HNSW with the same ef. Disk: the
version's directory. Latency is not reported (bench_engine measures it at scale).

SQuAD alone (2,467 chunks) is small enough to be scanned (under the engine's indexing
threshold), so its recall against exact search is not HNSW's. `--distractors N` ingests N more
documents beside the set's, each 2-4 real sentences of the other set
(bench_bm25.iter_synthetic_chunks; SciFact's beside SQuAD, SQuAD's beside SciFact, so none
repeats a gold passage; most are one chunk: 100,000 made 102,646), embedded by the same model:
HNSW then searches them all, and the end-to-end recall says how often the gold still ranks
among them. `--shard-points N` writes every version in base shards of at most N chunks
(RAG_BASE_SHARD_POINTS), so the recall is that of a query asking several shards (the first for
the whole limit, the others for their share: store/edge.py, SHARE_OVERASK).

`--ef-per-result A B ...` and `--oversampling X Y ...` score the same versions again with each
HNSW breadth (ef = A times the neighbours asked for; the product's is HNSW_EF_PER_RESULT) and
each quantized oversampling (QUANTIZATION_OVERSAMPLING, the product's per setting; float32 has
none to vary: scored once at each breadth), the product's
constants patched between passes in this process; each line then also gives the median time of
the engine's part of a dense query (`timings_ms["search"]`, no encoding): read it as a ratio
to the product's setting of the same run, not as a latency (bench_engine measures those).

An HNSW graph is built anew with each version, and its recall moves with the build (two builds of
one corpus at 315k chunks, at ef 4×: float32 0.9516 and 0.9575 of the exact top 10). `--builds N` builds each
setting's version N times from the same points (float32's too: the ingested one, then copies) and
prints each setting's mean and range over its builds and each quantized setting's difference from
float32 build by build, so a difference between settings can be told from one between builds.
`--paired` also searches each quantized version with its float32 originals throughout (Qdrant's
`ignore`), on the same graph, and counts the questions whose dense top 10 changed: what the
quantization alone changes. `--settings` limits the quantized settings scored (float32 is always
the peer). `--keep DIR` leaves the versions in DIR with what they were built from; `--reuse DIR`
takes the float32 version such a run left instead of ingesting again (most of a run at 300,000
distractors) and builds the other settings again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import tempfile
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_bm25 import iter_synthetic_chunks
from bench.bench_common import (
    factor,
    graph_width,
    positive_count,
    read_jsonl,
    real_sentences,
    shared_path,
)
from rag_retriever import Settings
from rag_retriever.eval.evaluation import Level, evaluate
from rag_retriever.eval.questions import load_questions
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import load_encoder
from rag_retriever.ops.plan import search_asked, search_text
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import QUANTIZATIONS, Document, Mode, Quantization
from rag_retriever.store import HNSW_EF_PER_RESULT, EdgeStore
from rag_retriever.store import edge as edge_module
from rag_retriever.store.base import HNSW_EF_CONSTRUCT, QUANTIZATION_OVERSAMPLING
from rag_retriever.store.shards import BASE_SHARD_POINTS

SETTINGS: tuple[Quantization, ...] = QUANTIZATIONS


@dataclasses.dataclass(frozen=True)
class Dataset:
    folder: str  # under ../shared/data
    questions: str
    level: Level  # what counts as found: the gold chunk (span) or the gold document
    distractors_from: str  # the other set, so no distractor repeats a gold passage
    label: str


DATASETS = {
    "squad": Dataset(
        "squad_v11_dev",
        "questions_dev.jsonl",
        "chunk",
        "scifact",
        "SQuAD dev questions, gold chunk",
    ),
    "scifact": Dataset(
        "scifact", "questions_train.jsonl", "doc", "squad_v11_dev", "SciFact claims, gold abstract"
    ),
}
MODES: tuple[Mode, ...] = ("dense", "hybrid")


# Points copied from the float32 version into each other setting's per call.
COPY_BATCH = 1024


@contextlib.contextmanager
def walked_with_originals(store: EdgeStore) -> Iterator[None]:
    """Within: `store`'s quantized versions searched with their float32 originals throughout
    (Qdrant's `ignore`: the graph walked and the candidates scored with the originals), on the
    graph the quantized search walks: what the quantization alone changes, with no other build's
    graph in the comparison. Set by handing the store an engine module whose
    QuantizationSearchParams always asks for that."""
    engine = store._edge
    shim = types.SimpleNamespace(
        **{name: getattr(engine, name) for name in dir(engine) if not name.startswith("__")}
    )
    shim.QuantizationSearchParams = lambda **_: engine.QuantizationSearchParams(ignore=True)
    store._edge = shim  # type: ignore[assignment]
    try:
        yield
    finally:
        store._edge = engine


@contextlib.contextmanager
def search_params(ef_per_result: int, oversampling: float | None) -> Iterator[None]:
    """Within: Qdrant Edge's dense searches at this breadth, and every quantized setting at this
    oversampling (None: each its own, the product's)."""
    saved = edge_module.HNSW_EF_PER_RESULT, edge_module.QUANTIZATION_OVERSAMPLING
    edge_module.HNSW_EF_PER_RESULT = ef_per_result
    if oversampling is not None:
        edge_module.QUANTIZATION_OVERSAMPLING = dict.fromkeys(
            QUANTIZATION_OVERSAMPLING, oversampling
        )
    try:
        yield
    finally:
        edge_module.HNSW_EF_PER_RESULT, edge_module.QUANTIZATION_OVERSAMPLING = saved


def run(
    n_questions: int = 1000,
    distractors: int = 0,
    dataset: str = "squad",
    shard_points: int | None = None,
    ef_per_result: Sequence[int] = (),
    oversampling: Sequence[float] = (),
    *,
    quantized: Sequence[Quantization] = SETTINGS[1:],
    builds: int = 1,
    paired: bool = False,
    ef_construct: int | None = None,
    keep: Path | None = None,
    reuse: Path | None = None,
) -> dict[str, Any]:
    if "none" in quantized:
        raise ValueError("float32 (none) is always scored, as the peer: not a quantized setting")
    settings: tuple[Quantization, ...] = ("none", *dict.fromkeys(quantized))
    data = DATASETS[dataset]
    questions, problems = load_questions(shared_path(data.folder, data.questions))
    if problems:
        raise ValueError(f"{data.questions}: {problems[:3]}")
    questions = questions[:n_questions]
    kept = {"dataset": dataset, "distractors": distractors, "shard_points": shard_points}
    out: dict[str, Any] = {"dataset": dataset, "questions": len(questions)}
    cap = shard_points or BASE_SHARD_POINTS
    with _workdir(keep, reuse, kept) as root:
        encoder = load_encoder(Settings(data_dir=root))
        base = EdgeStore(root / "none", shard_points=cap)
        if reuse is None:
            ingest_documents(
                LoadedCorpus(_documents(data, distractors), 0, dataset),
                alias="kb",
                encoder=encoder,
                store=base,
                lock_dir=root,
            )
        stores: dict[Quantization, EdgeStore] = {}
        again: dict[Quantization, EdgeStore] = {}
        width = ef_construct or HNSW_EF_CONSTRUCT
        # at another width, float32 too is scored from a copy built at it (the ingested or kept
        # version, built at the default, is only the points' source)
        copied = ".copy" if ef_construct is not None else None
        try:
            name = base.resolve("kb")
            if copied:
                stores |= _copies(base, name, encoder.dim, ("none",), root, copied, width)
            else:
                stores["none"] = base
            stores |= _copies(base, name, encoder.dim, settings[1:], root, "", width)
            matrix, point_ids = _dense(base, name)
            vectors = encoder.encode_queries([q.question for q in questions]).vectors
            exact = np.stack(
                [np.argsort(-(matrix @ vector), kind="stable")[:100] for vector in vectors]
            )
            top = [[point_ids[j] for j in row] for row in exact]
            del matrix

            def score(store: EdgeStore, top10: list[set[str]] | None = None) -> dict[str, Any]:
                retriever = Retriever(encoder=encoder, store=store, collection="kb")
                return _score(retriever, questions, top, data.level, top10)

            searched: dict[str, list[set[str]]] = {label: [] for label in settings}
            for label, served in stores.items():
                folder = root / (f"{label}{copied}" if copied and label == "none" else label)
                out[label] = score(served, searched[label]) | {"disk_mb": _disk_mb(folder)}
            if paired:
                out["paired"] = {}
                for label in settings[1:]:
                    walked: list[set[str]] = []
                    with walked_with_originals(stores[label]):
                        out["paired"][label] = score(stores[label], walked)
                    out["paired"][label]["top10_differing"] = sum(
                        a != b for a, b in zip(searched[label], walked, strict=True)
                    )
            out["sweep"] = []
            for ef, over, passes in sweep(ef_per_result, oversampling, settings):
                with search_params(ef, over):
                    for label, used in passes:
                        out["sweep"].append(
                            {"setting": label, "ef_per_result": ef, "oversampling": used}
                            | score(stores[label])
                        )
            if builds > 1:  # each setting built again from the same points, its graph anew
                out["builds"] = {label: [out[label]] for label in settings}
                for build in range(2, builds + 1):
                    suffix = f".build{build}"
                    again = _copies(base, name, encoder.dim, settings, root, suffix, width)
                    for label in settings:
                        out["builds"][label].append(score(again[label]))
                        again.pop(label).close()
                        shutil.rmtree(root / f"{label}{suffix}")
        finally:
            for served in (*again.values(), *stores.values()):
                served.close()
            if stores.get("none") is not base:
                base.close()
    out["chunks"] = len(point_ids)
    out["ef_construct"] = ef_construct
    out["distractors"] = distractors
    out["shard_points"] = shard_points
    return out


# What a `--keep` folder was built from, checked by `--reuse`.
KEPT = "kept.json"


class KeptFolderError(ValueError):
    """A `--keep` folder that is not empty, or a `--reuse` folder no finished `--keep` run
    with the same corpus left."""


@contextlib.contextmanager
def _workdir(keep: Path | None, reuse: Path | None, kept: dict[str, Any]) -> Iterator[Path]:
    """Where the versions are built: a new temporary folder, removed after the run; `keep`, left
    in place with what it was built from; or `reuse`, a kept folder whose float32 version is
    taken as it is (the other settings' are built again in it)."""
    if reuse is not None:
        written = _kept(reuse)
        if written != kept:
            raise KeptFolderError(
                f"--reuse {reuse}: built from {written}, this run asks for {kept}"
            )
        yield reuse
        return
    if keep is not None:
        try:
            keep.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KeptFolderError(f"--keep {keep}: {exc.strerror or exc}") from None
        if any(keep.iterdir()):
            raise KeptFolderError(
                f"--keep {keep}: not empty (what a finished --keep run left is taken with "
                f"--reuse; remove what an unfinished one left)"
            )
        yield keep
        (keep / KEPT).write_text(json.dumps(kept) + "\n", encoding="utf-8")
        return
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        yield Path(tmp)


def _kept(folder: Path) -> dict[str, Any]:
    """What a `--keep` run built `folder` from; a ValueError naming the folder otherwise."""
    try:
        kept = json.loads((folder / KEPT).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KeptFolderError(
            f"--reuse {folder}: not a folder a finished --keep run left ({exc})"
        ) from None
    if not isinstance(kept, dict):
        raise KeptFolderError(f"--reuse {folder}: {KEPT} holds {kept!r}")
    return kept


def _documents(data: Dataset, distractors: int) -> tuple[Document, ...]:
    articles = read_jsonl(shared_path(data.folder, "docs.jsonl"))
    docs = tuple(Document(a["id"], a["title"], a["text"]) for a in articles)
    if distractors:
        texts = iter_synthetic_chunks(distractors, real_sentences((data.distractors_from,)))
        docs += tuple(Document(f"distractor-{i}", "", text) for i, text in enumerate(texts))
    return docs


def _copies(
    base: EdgeStore,
    name: str,
    dim: int,
    settings: Sequence[Quantization],
    root: Path,
    suffix: str,
    ef_construct: int = HNSW_EF_CONSTRUCT,
) -> dict[Quantization, EdgeStore]:
    """A new version of `name` for each setting, in `root / (setting + suffix)`, holding the
    float32 version's points (vectors, BM25 weights, payloads) and its document frequencies,
    sealed (its HNSW graph a build of its own) and served as "kb". A folder left from an earlier
    run is removed first."""
    stores: dict[Quantization, EdgeStore] = {}
    for setting in settings:
        folder = root / f"{setting}{suffix}"
        if folder == root / "none":
            raise ValueError(f"{folder} holds the float32 version the copies are made from")
        shutil.rmtree(folder, ignore_errors=True)
        stores[setting] = EdgeStore(
            folder, shard_points=base.shard_points, ef_construct=ef_construct
        )
        record = dataclasses.replace(base.record(name), quantization=setting)
        stores[setting].create(name, dim, record)
        stores[setting].put_doc_freqs(name, base.doc_freqs(name))
    for part, block in _parts(base, name):
        for store in stores.values():
            store.upsert(
                name,
                [p.id for p in part],
                block,
                [p.sparse for p in part if p.sparse is not None],
                [dict(p.payload) for p in part],
            )
    for store in stores.values():
        store.seal(name, {"doc_id": "keyword"})
        store.point_alias("kb", name)
    return stores


def _parts(base: EdgeStore, name: str) -> Iterator[tuple[list[Any], np.ndarray]]:
    """The version's points with their vectors, COPY_BATCH at a time, in its scroll order, each
    batch with its float32 vectors as one matrix."""
    stored = [r.id for r in base.scroll(name)]
    for at in range(0, len(stored), COPY_BATCH):
        part = base.retrieve(name, stored[at : at + COPY_BATCH], with_dense=True, with_sparse=True)
        yield part, np.stack([np.asarray(p.dense, dtype=np.float32) for p in part])


def _dense(base: EdgeStore, name: str) -> tuple[np.ndarray, list[str]]:
    """The version's float32 vectors as one matrix and the ids of its rows, in the same order."""
    blocks, point_ids = [], []
    for part, block in _parts(base, name):
        blocks.append(block)
        point_ids += [p.id for p in part]
    return np.concatenate(blocks), point_ids


def _disk_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def sweep(
    ef_per_result: Sequence[int],
    oversampling: Sequence[float],
    settings: Sequence[Quantization] = SETTINGS,
) -> list[tuple[int, float | None, list[tuple[Quantization, float | None]]]]:
    """The sweep's passes beyond the product's own: (ef, the oversampling patched in (None: each
    setting's own), and each setting scored under them with the oversampling it searches at).
    float32 has nothing to oversample: it is scored once at each breadth."""
    overs: Sequence[float | None] = oversampling or (None,)
    out = []
    for ef in ef_per_result or (HNSW_EF_PER_RESULT,):
        for at, over in enumerate(overs):
            passes: list[tuple[Quantization, float | None]] = []
            for label in settings:
                own = QUANTIZATION_OVERSAMPLING.get(label)
                if own is None and at > 0:
                    continue
                used = own if own is None or over is None else over
                if (ef, used) != (HNSW_EF_PER_RESULT, own):  # the product's: scored already
                    passes.append((label, used))
            if passes:
                out.append((ef, over, passes))
    return out


def _score(
    retriever: Retriever,
    questions: Sequence[Any],
    top: list[list[str]],
    level: Level,
    top10: list[set[str]] | None = None,
) -> dict[str, Any]:
    """Dense recall@10/@100 of the exact top lists, the median engine time of a dense query, and
    the end-to-end recall@10 and nDCG@10 of each mode. `top10`, when given, receives each
    question's dense top 10."""
    of_exact = {"dense@10": 0.0, "dense@100": 0.0}
    search_ms = []
    for q, exact in zip(questions, top, strict=True):
        result = retriever.retrieve(q.question, k=100, mode="dense")
        got = [h.chunk_id for h in result.hits]
        if top10 is not None:
            top10.append(set(got[:10]))
        search_ms.append(result.timings_ms.get("search", 0.0))
        of_exact["dense@10"] += len(set(got[:10]) & set(exact[:10])) / 10
        of_exact["dense@100"] += len(set(got) & set(exact)) / 100
    scored = evaluate(
        retriever, list(questions), collection="kb", modes=MODES, ks=(10,), level=level
    ).summary["modes"]
    figures: dict[str, Any] = {k: v / len(questions) for k, v in of_exact.items()}
    figures["dense_search_p50_ms"] = statistics.median(search_ms)
    for mode in MODES:
        figures[f"{mode}_recall@10"] = scored[mode]["recall@10"]
        figures[f"{mode}_ndcg@10"] = scored[mode]["ndcg@10"]
    return figures


def report(result: dict[str, Any]) -> list[str]:
    data = DATASETS[result["dataset"]]
    extra = result.get("distractors", 0)
    beside = f" among {extra:,} distractor documents" if extra else ""
    if result.get("shard_points"):
        beside += f", base shards of {result['shard_points']:,}"
    if result.get("ef_construct"):
        beside += f", every graph built at ef_construct {result['ef_construct']}"
    lines = [
        f"== quantized vectors: {data.folder}{beside}, {result['chunks']:,} chunks, "
        f"{result['questions']:,} {data.label} (Qdrant Edge, all-MiniLM-L6-v2) =="
    ]
    peer = result["none"]
    for setting in (s for s in SETTINGS if s in result):
        r = result[setting]
        moved = ", ".join(f"{r[f'{m}_recall@10'] - peer[f'{m}_recall@10']:+.4f}" for m in MODES)
        lines.append(
            f"{setting}: dense recall@10 / @100 of exact search {r['dense@10']:.4f} / "
            f"{r['dense@100']:.4f}; recall@10 dense {r['dense_recall@10']:.4f}, hybrid "
            f"{r['hybrid_recall@10']:.4f} (vs none: {moved}); nDCG@10 dense "
            f"{r['dense_ndcg@10']:.4f}, hybrid {r['hybrid_ndcg@10']:.4f}; "
            f"disk {r['disk_mb']:.1f} MB; dense engine time p50 {r['dense_search_p50_ms']:.2f} ms"
        )
    for r in result.get("sweep", ()):
        base = result[r["setting"]]
        lines.append(
            f"{r['setting']} at {search_text(r['ef_per_result'], r['oversampling'])}: "
            f"dense recall@10 / @100 of exact search {r['dense@10']:.4f} / {r['dense@100']:.4f}; "
            f"recall@10 dense {r['dense_recall@10']:.4f}, hybrid {r['hybrid_recall@10']:.4f}; "
            f"dense engine time p50 {r['dense_search_p50_ms']:.2f} ms "
            f"({r['dense_search_p50_ms'] / max(base['dense_search_p50_ms'], 1e-9):.2f}x the "
            f"product's {search_asked(r['setting'])})"
        )
    for setting, r in (result.get("paired") or {}).items():
        own = result[setting]
        lines.append(
            f"{setting} on the same graph walked with its float32 originals (ignore): dense "
            f"recall@10 / @100 of exact search {r['dense@10']:.4f} / {r['dense@100']:.4f}; "
            f"recall@10 dense {r['dense_recall@10']:.4f}, hybrid {r['hybrid_recall@10']:.4f} "
            f"(as searched: {own['dense_recall@10']:.4f}, {own['hybrid_recall@10']:.4f}); "
            f"dense top-10 sets differing from as searched: {r['top10_differing']} of "
            f"{result['questions']:,}"
        )
    return lines + builds_report(result.get("builds"))


BUILD_FIGURES = ("dense@10", "dense@100", "dense_recall@10", "hybrid_recall@10")


def builds_report(builds: dict[str, list[dict[str, Any]]] | None) -> list[str]:
    """Each setting's figures over its builds (mean, lowest, highest), and each quantized
    setting's difference from float32: the mean (the difference of the two means), and the
    lowest and highest of its build i less float32's build i, builds paired in the order they
    were built (float32's first is the ingested version, every other build a copy)."""
    if not builds:
        return []
    count = len(builds["none"])
    lines = [f"-- each setting built {count} times from the same points (the product's search) --"]
    for setting, runs in builds.items():
        parts = []
        for key in BUILD_FIGURES:
            values = [r[key] for r in runs]
            parts.append(
                f"{key} {statistics.fmean(values):.4f} ({min(values):.4f}-{max(values):.4f})"
            )
        line = f"{setting}: " + ", ".join(parts)
        if setting != "none":
            gaps = [
                [r[key] - peer[key] for r, peer in zip(runs, builds["none"], strict=True)]
                for key in BUILD_FIGURES
            ]
            line += "; vs none, build by build: " + ", ".join(
                f"{key} {statistics.fmean(g):+.4f} ({min(g):+.4f} to {max(g):+.4f})"
                for key, g in zip(BUILD_FIGURES, gaps, strict=True)
            )
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_quantization", description=__doc__)
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="squad")
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument(
        "--distractors",
        type=int,
        default=0,
        help="documents of 2-4 sentences of the other set ingested beside the set's (an index HNSW searches)",
    )
    parser.add_argument(
        "--shard-points",
        type=positive_count,
        help="most chunks in one base shard of each version (RAG_BASE_SHARD_POINTS; default: "
        "the product's, one shard at these sizes)",
    )
    parser.add_argument(
        "--ef-per-result",
        type=positive_count,
        nargs="+",
        default=(),
        help=f"also score at these HNSW breadths (ef = this x neighbours asked; the product's: "
        f"{HNSW_EF_PER_RESULT})",
    )
    parser.add_argument(
        "--oversampling",
        type=factor,
        nargs="+",
        default=(),
        help="also score the quantized settings at these oversamplings (the product's: "
        + ", ".join(f"{k} {v:g}" for k, v in QUANTIZATION_OVERSAMPLING.items())
        + ")",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=SETTINGS[1:],
        default=SETTINGS[1:],
        help="the quantized settings scored beside float32 (default: all)",
    )
    parser.add_argument(
        "--builds",
        type=positive_count,
        default=1,
        help="build each setting's version this many times from the same points (float32's "
        "too) and report each setting's spread over its builds: an HNSW graph is built anew "
        "each time, and its recall moves with it",
    )
    parser.add_argument(
        "--ef-construct",
        type=graph_width,
        help="build every scored version's HNSW graph this wide (RAG_HNSW_EF_CONSTRUCT; "
        f"default: the product's, {HNSW_EF_CONSTRUCT}); float32 is then scored from a copy "
        "built at it too",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="also search each quantized version with its float32 originals throughout "
        "(Qdrant's ignore), on the same graph: what the quantization alone changes, free of "
        "the spread between builds",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--keep",
        type=Path,
        help="build the versions in this folder (absent or empty) and leave them there",
    )
    where.add_argument(
        "--reuse",
        type=Path,
        help="take the float32 version a --keep run with the same --dataset, --distractors and "
        "--shard-points left in this folder instead of ingesting again (at 300,000 "
        "distractors: 22 minutes on 2 cores); the other settings are built again",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--constants-out",
        type=Path,
        help="add this run's dense recall of the exact top 10/100 to a plan constants file "
        "(`recall`, which `rag-retriever plan` prints beside its figures; the file's other "
        "constants are kept), with the width its graphs were built at (--ef-construct)",
    )
    args = parser.parse_args(argv)
    if args.questions < 1 or args.distractors < 0:
        parser.error("--questions must be at least 1 and --distractors at least 0")
    if args.constants_out is not None and set(args.settings) != set(SETTINGS[1:]):
        # the plan's recall entry is written whole: a setting left out would lose its figure
        parser.error("--constants-out takes a run of every setting (leave --settings out)")
    if args.constants_out is not None and not args.constants_out.is_file():
        # checked before the run (an hour at 300,000 distractors), not after it
        parser.error(
            f"--constants-out {args.constants_out}: no such file (a plan constants "
            f"file, written by bench_engine --constants-out)"
        )
    try:
        result = run(
            args.questions,
            args.distractors,
            args.dataset,
            args.shard_points,
            args.ef_per_result,
            args.oversampling,
            quantized=args.settings,
            builds=args.builds,
            paired=args.paired,
            ef_construct=args.ef_construct,
            keep=args.keep,
            reuse=args.reuse,
        )
    except KeptFolderError as exc:
        parser.error(str(exc))
    for text in report(result):
        print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.constants_out:
        constants = json.loads(args.constants_out.read_text(encoding="utf-8"))
        constants["recall"] = recall_constants(result, argv)
        args.constants_out.write_text(json.dumps(constants, indent=1) + "\n", encoding="utf-8")
    return 0


def recall_constants(result: dict[str, Any], argv: Sequence[str] | None) -> dict[str, Any]:
    """The plan's `recall` entry: each setting's dense recall of an exact search at the
    product's breadth and oversampling (the mean over its builds), and the command that
    measured it."""
    import datetime
    import sys

    args = [a for a in (sys.argv[1:] if argv is None else argv)]
    # the command, not where it wrote or kept its versions
    for flag in ("--constants-out", "--json", "--keep", "--reuse"):
        if flag in args:
            at = args.index(flag)
            del args[at : at + 2]
        args = [a for a in args if not a.startswith(f"{flag}=")]
    scored = [s for s in SETTINGS if s in result]
    # over several builds, each setting's mean (one build's graph is a sample)
    runs = result.get("builds") or {s: [result[s]] for s in scored}

    def mean(setting: str, key: str) -> float:
        return round(statistics.fmean(r[key] for r in runs[setting]), 4)

    return {
        "chunks": result["chunks"],
        "builds": len(runs["none"]),
        "dense_at10_of_exact": {s: mean(s, "dense@10") for s in scored},
        "dense_at100_of_exact": {s: mean(s, "dense@100") for s in scored},
        # how the product's pass searched each setting (the plan says when today's differs)
        "searched": {s: search_asked(s) for s in scored},
        # how wide its graphs were built (the plan names it where the deployment's differs)
        "ef_construct": result.get("ef_construct") or HNSW_EF_CONSTRUCT,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m bench.bench_quantization", *args]),
    }


if __name__ == "__main__":
    raise SystemExit(main())
