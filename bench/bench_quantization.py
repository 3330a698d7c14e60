"""What quantized vectors cost in recall: each RAG_QUANTIZATION the embedded engine applies,
against exact search and against float32, on the same vectors, in one run.

Usage:
    python -m bench.bench_quantization [--dataset squad|scifact] [--questions 1000]
        [--distractors 100000] [--shard-points 10000]

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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_bm25 import iter_synthetic_chunks
from bench.bench_common import factor, positive_count, read_jsonl, real_sentences, shared_path
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
from rag_retriever.store.base import QUANTIZATION_OVERSAMPLING
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
) -> dict[str, Any]:
    data = DATASETS[dataset]
    articles = read_jsonl(shared_path(data.folder, "docs.jsonl"))
    questions, problems = load_questions(shared_path(data.folder, data.questions))
    if problems:
        raise ValueError(f"{data.questions}: {problems[:3]}")
    questions = questions[:n_questions]
    docs = tuple(Document(a["id"], a["title"], a["text"]) for a in articles)
    if distractors:
        texts = iter_synthetic_chunks(distractors, real_sentences((data.distractors_from,)))
        docs += tuple(Document(f"distractor-{i}", "", text) for i, text in enumerate(texts))
    out: dict[str, Any] = {"dataset": dataset, "questions": len(questions)}
    cap = shard_points or BASE_SHARD_POINTS
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        root = Path(tmp)
        encoder = load_encoder(Settings(data_dir=root))
        base = EdgeStore(root / "none", shard_points=cap)
        ingest_documents(
            LoadedCorpus(docs, 0, dataset), alias="kb", encoder=encoder, store=base, lock_dir=root
        )
        name = base.resolve("kb")
        stored = [r.id for r in base.scroll(name)]
        stores: dict[Quantization, EdgeStore] = {"none": base}
        for setting in SETTINGS[1:]:
            stores[setting] = EdgeStore(root / setting, shard_points=cap)
            record = dataclasses.replace(base.record(name), quantization=setting)
            stores[setting].create(name, encoder.dim, record)
            stores[setting].put_doc_freqs(name, base.doc_freqs(name))
        blocks, point_ids = [], []  # the matrix's rows and their ids, in the same order
        for at in range(0, len(stored), COPY_BATCH):
            part = base.retrieve(
                name, stored[at : at + COPY_BATCH], with_dense=True, with_sparse=True
            )
            block = np.stack([np.asarray(p.dense, dtype=np.float32) for p in part])
            blocks.append(block)
            for setting in SETTINGS[1:]:
                stores[setting].upsert(
                    name,
                    [p.id for p in part],
                    block,
                    [p.sparse for p in part if p.sparse is not None],
                    [dict(p.payload) for p in part],
                )
            point_ids += [p.id for p in part]
        matrix = np.concatenate(blocks)
        for setting in SETTINGS[1:]:
            stores[setting].seal(name, {"doc_id": "keyword"})
            stores[setting].point_alias("kb", name)
        vectors = encoder.encode_queries([q.question for q in questions]).vectors
        exact = np.stack(
            [np.argsort(-(matrix @ vector), kind="stable")[:100] for vector in vectors]
        )
        top = [[point_ids[j] for j in row] for row in exact]
        retrievers = {
            label: Retriever(encoder=encoder, store=served, collection="kb")
            for label, served in stores.items()
        }
        for label, retriever in retrievers.items():
            out[label] = _score(retriever, questions, top, data.level)
            out[label]["disk_mb"] = (
                sum(p.stat().st_size for p in (root / label).rglob("*") if p.is_file()) / 2**20
            )
        out["sweep"] = []
        for ef, over, passes in sweep(ef_per_result, oversampling):
            with search_params(ef, over):
                for label, used in passes:
                    figures = _score(retrievers[label], questions, top, data.level)
                    out["sweep"].append(
                        {"setting": label, "ef_per_result": ef, "oversampling": used} | figures
                    )
        for served in stores.values():
            served.close()
    out["chunks"] = len(point_ids)
    out["distractors"] = distractors
    out["shard_points"] = shard_points
    return out


def sweep(
    ef_per_result: Sequence[int], oversampling: Sequence[float]
) -> list[tuple[int, float | None, list[tuple[Quantization, float | None]]]]:
    """The sweep's passes beyond the product's own: (ef, the oversampling patched in (None: each
    setting's own), and each setting scored under them with the oversampling it searches at).
    float32 has nothing to oversample: it is scored once at each breadth."""
    overs: Sequence[float | None] = oversampling or (None,)
    out = []
    for ef in ef_per_result or (HNSW_EF_PER_RESULT,):
        for at, over in enumerate(overs):
            passes: list[tuple[Quantization, float | None]] = []
            for label in SETTINGS:
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
    retriever: Retriever, questions: Sequence[Any], top: list[list[str]], level: Level
) -> dict[str, Any]:
    """Dense recall@10/@100 of the exact top lists, the median engine time of a dense query, and
    the end-to-end recall@10 and nDCG@10 of each mode."""
    of_exact = {"dense@10": 0.0, "dense@100": 0.0}
    search_ms = []
    for q, exact in zip(questions, top, strict=True):
        result = retriever.retrieve(q.question, k=100, mode="dense")
        got = [h.chunk_id for h in result.hits]
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
    lines = [
        f"== quantized vectors: {data.folder}{beside}, {result['chunks']:,} chunks, "
        f"{result['questions']:,} {data.label} (Qdrant Edge, all-MiniLM-L6-v2) =="
    ]
    peer = result["none"]
    for setting in SETTINGS:
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
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--constants-out",
        type=Path,
        help="add this run's dense recall of the exact top 10/100 to a plan constants file "
        "(`recall`, which `rag-retriever plan` prints beside its figures; the file's other "
        "constants are kept)",
    )
    args = parser.parse_args(argv)
    if args.questions < 1 or args.distractors < 0:
        parser.error("--questions must be at least 1 and --distractors at least 0")
    if args.constants_out is not None and not args.constants_out.is_file():
        # checked before the run (an hour at 300,000 distractors), not after it
        parser.error(
            f"--constants-out {args.constants_out}: no such file (a plan constants "
            f"file, written by bench_engine --constants-out)"
        )
    result = run(
        args.questions,
        args.distractors,
        args.dataset,
        args.shard_points,
        args.ef_per_result,
        args.oversampling,
    )
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
    product's breadth and oversampling, and the command that measured it."""
    import datetime
    import sys

    args = [a for a in (sys.argv[1:] if argv is None else argv)]
    for flag in ("--constants-out", "--json"):  # the command, not where it wrote
        if flag in args:
            at = args.index(flag)
            del args[at : at + 2]
    scored = [s for s in SETTINGS if s in result]
    return {
        "chunks": result["chunks"],
        "dense_at10_of_exact": {s: round(result[s]["dense@10"], 4) for s in scored},
        "dense_at100_of_exact": {s: round(result[s]["dense@100"], 4) for s in scored},
        # how the product's pass searched each setting (the plan says when today's differs)
        "searched": {s: search_asked(s) for s in scored},
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m bench.bench_quantization", *args]),
    }


if __name__ == "__main__":
    raise SystemExit(main())
