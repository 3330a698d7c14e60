"""The engine at scale: Qdrant Edge (the embedded default) vs qdrant-client's local mode, same
schema (dense + BM25 sparse vectors, payloads), same points, same queries, in one run.

The chunks are 2-4 real sentences from SciFact and SQuAD (bench_bm25.iter_synthetic_chunks:
the same length at every size), so the BM25 statistics are those of real text; the dense
vectors are random unit vectors (384-d), since the engine's timing does not depend on what the
vectors mean. Queries are real SciFact claims and SQuAD questions (their BM25 terms) with random
unit query vectors. A build of 10,000 points or more writes as the ingest does, from a writer
process per base shard (Store.bulk_write); its memory is summed over the processes.

The dense list's recall@10 and @100 against a brute-force search of the same vectors is
reported too. Random vectors in 384 dimensions have no structure for an index to use, the hard
case for HNSW and worse still for binary codes: read these as a comparison of settings on one
corpus, not as the recall of real embeddings (bench_quantization measures that on SQuAD).

Per engine: write throughput, seal time (payload indexes, flush, optimize), and, in a fresh
process (what a serving replica pays): reopen time, p50/p95 per query for dense, bm25, hybrid
(both lists in one batched call) and hybrid filtered on a keyword field (10% selectivity), each
query a new one, and a new dense query right after a repeated one; the process's peak RSS, its
resident memory split by what each page holds (`rss_parts_mb`) and what it needs resident
(`resident_mb`); and the size on disk. Engine only: no query encoding. The build runs in a
fresh process too: its peak RSS is the build's (write and seal).

With `--quantization none int8 binary binary2`, each size is also built with int8 (on Edge:
TurboQuant's 8 bits), binary and binary2 vectors (float32 originals on disk, rescored), beside
float32;
`--constants-out FILE` writes every Edge run's figures per size as the constants
`rag-retriever plan` reads (rag_retriever/ops/capacity.json holds this machine's).
`--shard-points N` writes builds in base shards of up to N chunks (RAG_BASE_SHARD_POINTS), so a
size past the default shard can be measured as one shard.

`--ef-construct W [W ...]` builds each Edge setting's HNSW graph at each width in turn
(RAG_HNSW_EF_CONSTRUCT; default the product's), each width after the first reported beside the
first: what a wider graph costs to build and to search, and the recall it buys, side by side.
The constants are written from a run at one width, which they record (the plan says when a
deployment builds at another); a file of another width is replaced, not merged.

`--cap-fraction F` serves each Edge build once more in a process whose memory is capped (a
cgroup, as a container's limit) at F times float32's serving RSS at that size: the latency a
replica given that much memory would see, with the kernel dropping and re-reading shard pages.

Usage: python -m bench.bench_engine [--sizes 100000 1000000] [--peer-max 100000]
    [--quantization none int8 binary binary2] [--cap-fraction 0.4] [--shard-points 2000000]
    [--ef-construct 100 200] [--constants-out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_bm25 import iter_synthetic_chunks
from bench.bench_common import (
    child_json,
    graph_width,
    percentile,
    positive_count,
    read_jsonl,
    real_sentences,
    shared_path,
)
from bench.peak_memory import PeakSampler, status_mb
from rag_retriever.ingest.writer import WRITE_PROCESS_MIN_CHUNKS
from rag_retriever.models.bm25 import BM25Model, Tokenizer
from rag_retriever.ops.plan import measured_width
from rag_retriever.records import QUANTIZATIONS, UNQUANTIZED, Quantization, SearchFilter
from rag_retriever.settings import Settings, env_name
from rag_retriever.store import (
    DENSE,
    SPARSE,
    EdgeStore,
    IndexKind,
    ServerStore,
    StageQuery,
    Store,
)
from rag_retriever.store.base import (
    HNSW_EF_CONSTRUCT,
    HNSW_EF_PER_RESULT,
    QUANTIZATION_OVERSAMPLING,
)
from rag_retriever.store.record import bare_record
from rag_retriever.store.shards import BASE_SHARD_POINTS

DIM = 384
BATCH = 512
# qdrant-client local mode scores sparse vectors and filters in Python (seconds per query at
# 100k points), so it gets fewer queries; percentiles of 40 are still stable to ~10%.
N_QUERIES = {"edge": 200, "local": 40}
NAME = "bench__random-384__v1"

# The setting a build's base shard size is read from (`shard_points`), as the product's ingest.
SHARD_POINTS_ENV = env_name("base_shard_points")
# The setting a build's HNSW graph width is read from (`--ef-construct`), as the product's.
EF_CONSTRUCT_ENV = env_name("hnsw_ef_construct")


def _queries(n: int) -> list[list[str]]:
    tok = Tokenizer()
    rows = read_jsonl(shared_path("scifact", "questions_train.jsonl"), n // 2)
    rows += read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), n - len(rows))
    return [tok.tokenize(r["question"]) for r in rows]


def shard_points() -> int:
    """The base shard size builds are written in: RAG_BASE_SHARD_POINTS as `--shard-points` sets
    it for this process and the processes it starts, else the product's default."""
    return Settings.from_env().base_shard_points


def _open(engine: str, root: Path) -> Store:
    if engine == "edge":
        settings = Settings.from_env()
        return EdgeStore(
            root, shard_points=settings.base_shard_points, ef_construct=settings.hnsw_ef_construct
        )
    from qdrant_client import QdrantClient

    return ServerStore(QdrantClient(path=str(root)))


def build(
    engine: str,
    root: Path,
    n: int,
    seed: int = 0,
    *,
    metadata: Callable[[int], dict[str, Any]] = lambda i: {"group": i % 10},
    indexes: Mapping[str, IndexKind] | None = None,
    quantization: Quantization = "none",
) -> dict[str, Any]:
    """Version NAME of `n` chunks under `root`, its dense vectors held as `quantization`;
    `metadata(i)` is the i-th chunk's, `indexes` the payload indexes of the seal (default:
    doc_id and metadata.group)."""
    tok = Tokenizer()
    sentences = real_sentences()
    # the chunks are made twice (statistics, then writing), never held: the ingest holds none
    t0 = time.perf_counter()
    model = BM25Model.build(tok.tokenize(t) for t in iter_synthetic_chunks(n, sentences))
    stats_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    store = _open(engine, root)
    record = dataclasses.replace(
        bare_record(NAME, dim=DIM, bm25=model.stats), quantization=quantization
    )
    store.create(NAME, DIM, record)
    store.put_doc_freqs(NAME, model.doc_freqs)
    t0 = time.perf_counter()
    # as the ingest writes a full build: from a process of its own (Edge), one per base shard
    with store.bulk_write(NAME) if n >= WRITE_PROCESS_MIN_CHUNKS else contextlib.nullcontext():
        texts = iter_synthetic_chunks(n, sentences)
        for start in range(0, n, BATCH):
            part = list(itertools.islice(texts, BATCH))
            vectors = _unit_vectors(rng, len(part))
            store.upsert(
                NAME,
                [f"00000000-0000-0000-0000-{start + i:012d}" for i in range(len(part))],
                vectors,
                [model.document_vector(tok.tokenize(t)) for t in part],
                [
                    {
                        "doc_id": f"d{(start + i) // 5}",
                        "text": t,
                        "metadata": metadata(start + i),
                    }
                    for i, t in enumerate(part)
                ],
            )
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.seal(NAME, indexes or {"doc_id": "keyword", "metadata.group": "integer"})
    seal_s = time.perf_counter() - t0
    # base shards of at most RAG_BASE_SHARD_POINTS (EdgeStore's default); one server collection
    shards = store.manifest(NAME).bases if isinstance(store, EdgeStore) else 1
    store.close()
    return {
        "points": n,
        "shards": shards,
        "bm25_stats_s": stats_s,
        "write_s": write_s,
        "points_per_s": n / write_s,
        "seal_s": seal_s,
        "disk_mb": sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20,
    }


def _unit_vectors(rng: np.random.Generator, count: int) -> np.ndarray:
    vectors = rng.standard_normal((count, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def exact_top(queries: np.ndarray, n: int, k: int = 100, seed: int = 0) -> np.ndarray:
    """The indexes of each query's `k` nearest of the `n` points `build(seed=seed)` wrote, by
    brute-force cosine: the build's vectors made again batch by batch (the same generator,
    the same batches), so they are never all held."""
    rng = np.random.default_rng(seed)
    best_scores = np.full((len(queries), 0), -np.inf, dtype=np.float32)
    best = np.zeros((len(queries), 0), dtype=np.int64)
    for start in range(0, n, BATCH):
        vectors = _unit_vectors(rng, min(BATCH, n - start))
        scores = np.concatenate([best_scores, queries @ vectors.T], axis=1)
        index = np.concatenate(
            [
                best,
                np.broadcast_to(
                    np.arange(start, start + len(vectors)), (len(queries), len(vectors))
                ),
            ],
            axis=1,
        )
        keep = np.argpartition(-scores, min(k, scores.shape[1]) - 1, axis=1)[:, :k]
        best_scores = np.take_along_axis(scores, keep, axis=1)
        best = np.take_along_axis(index, keep, axis=1)
    order = np.argsort(-best_scores, axis=1, kind="stable")
    return np.take_along_axis(best, order, axis=1)


STAGES = ("dense", "bm25", "hybrid", "hybrid_filtered")
# How many times a new dense query is timed right after one repeated at once (`serve_probe`).
N_AFTER_REPEAT = 30
# The first queries of each stage warm caches: their times and disk reads are left out.
WARM_UP_QUERIES = 5


def serve_probe(engine: str, root: Path, n_queries: int = 0) -> dict[str, Any]:
    """Run in a fresh process: reopen, query, peak RSS. `n_queries` a stage (0: the engine's
    `N_QUERIES`, and the queries after a repeat timed too).

    Every stage's every query is a new one (its own question and query vector), as in traffic:
    when the stages shared a query, a quantized version's hybrid and filtered figures measured
    the same query asked again, and Qdrant Edge answers a rescored query asked again at once in
    less than half the time (300k binary: 1.4 vs 3.1 ms) and the next new one ~10-20 ms slower
    (`dense_after_repeat_p50_ms` measures that; docs/benchmarks.md)."""
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    store = _open(engine, root)
    record = store.record(NAME)
    model = BM25Model(record.bm25, store.doc_freqs(NAME))
    points = store.count(NAME)  # opens the shards (Edge) / loads the collection (local mode)
    reopen_s = time.perf_counter() - t0
    n = n_queries or N_QUERIES[engine]
    questions = iter(_queries(n * len(STAGES)))
    flt = SearchFilter(equals={"group": 3})
    timings: dict[str, list[float]] = {stage: [] for stage in STAGES}
    faults: dict[str, list[int]] = {stage: [] for stage in STAGES}
    vectors, dense_ids = [], []
    for _ in range(n):
        for stage in STAGES:
            vector = _unit_vectors(rng, 1)[0]
            sparse = model.query_vector(next(questions))
            scope = flt if stage == "hybrid_filtered" else None
            dense_q = StageQuery(DENSE, vector, 100, scope)
            sparse_q = StageQuery(SPARSE, sparse, 100, scope)
            requests = {"dense": [dense_q], "bm25": [sparse_q]}.get(stage, [dense_q, sparse_q])
            read0 = _major_faults()
            t0 = time.perf_counter()
            found = store.search(NAME, requests)
            timings[stage].append((time.perf_counter() - t0) * 1000)
            faults[stage].append(_major_faults() - read0)
            if stage == "dense":
                vectors.append(vector)
                dense_ids.append([int(i.rsplit("-", 1)[1]) for i, _ in found[0]])
    if not n_queries:
        timings["dense_after_repeat"] = _after_repeat(store, rng)
    out: dict[str, Any] = {"reopen_s": reopen_s}
    for stage, values in timings.items():
        values = values[WARM_UP_QUERIES:]
        out[f"{stage}_p50_ms"] = percentile(values, 50)
        out[f"{stage}_p95_ms"] = percentile(values, 95)
    for stage, counts in faults.items():
        out[f"{stage}_major_faults"] = float(np.mean(counts[WARM_UP_QUERIES:]))
    out.update(_memory())
    parts = out["rss_parts_mb"] = rss_parts_mb()
    out["resident_mb"] = resident_mb(parts, record.quantization)
    store.close()
    # what the engine's dense list (HNSW; quantized vectors rescored) finds of an exact search
    exact = exact_top(np.stack(vectors), points)
    for k in (10, 100):
        out[f"dense_recall_at_{k}"] = float(
            np.mean(
                [
                    len(set(got[:k]) & set(want[:k])) / k
                    for got, want in zip(dense_ids, exact, strict=True)
                ]
            )
        )
    return out


def _major_faults() -> int:
    """The process's major page faults so far (all its threads): pages of a mapped shard file
    read from disk because they were not in memory. Counted around each query, they tell a
    query that waited on the disk from one that only computed (`serve_probe`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _after_repeat(store: Store, rng: np.random.Generator) -> list[float]:
    """The time of a new dense query asked right after another was asked twice in a row."""
    out = []
    for _ in range(N_AFTER_REPEAT):
        again = [StageQuery(DENSE, _unit_vectors(rng, 1)[0], 100)]
        store.search(NAME, again)
        store.search(NAME, again)
        fresh = [StageQuery(DENSE, _unit_vectors(rng, 1)[0], 100)]
        t0 = time.perf_counter()
        store.search(NAME, fresh)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _memory() -> dict[str, float]:
    """The serving process's memory from /proc/self/status: peak RSS (VmHWM; not getrusage's
    ru_maxrss, which on Linux keeps the forking parent's peak across exec), and the RSS at the
    end split into private memory (RssAnon) and mapped shard files (RssFile: page cache the
    kernel can drop and re-read)."""
    fields = {"VmHWM": "rss_mb", "RssAnon": "rss_anon_mb", "RssFile": "rss_file_mb"}
    status = status_mb()
    return {name: status[key] for key, name in fields.items() if key in status}


# What a serving process's resident memory holds: the shard files it maps, by the part of a
# Qdrant Edge segment each file is (first match of its path), and its private memory.
RSS_PARTS = (
    ("quantized vectors", "vector_storage-dense/quantized"),
    ("dense vectors", "vector_storage-dense/"),
    ("HNSW graph", "vector_index-dense/"),
    ("BM25", "-bm25/"),
    ("payloads and their indexes", "payload"),
    ("point ids", "id_tracker"),
)


def rss_parts_mb(smaps: str | None = None) -> dict[str, float]:
    """This process's resident memory (MB) by `RSS_PARTS`, other mapped files (libraries) and
    private memory, from /proc/self/smaps (or its text). The dense vectors of a quantized
    version are the float32 originals read to rescore: page cache the kernel drops and reads
    again, which grows with the queries asked, not a part the version needs resident."""
    parts = dict.fromkeys([name for name, _ in RSS_PARTS] + ["other files", "private"], 0.0)
    text = Path("/proc/self/smaps").read_text() if smaps is None else smaps
    part = "private"
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping: address perms offset dev inode [path]
            path = fields[5] if len(fields) > 5 else ""
            part = next(
                (name for name, key in RSS_PARTS if key in path),
                "other files" if path.startswith("/") else "private",
            )
        elif fields[0] == "Rss:":
            parts[part] += int(fields[1]) / 1024
    return parts


def resident_mb(parts: Mapping[str, float], quantization: Quantization) -> float:
    """What a serving process needs resident to answer at full speed: all it holds, less, for a
    quantized version, the float32 originals its rescoring read (page cache: at 1M chunks
    capped at 0.4x float32's RSS, binary answered as fast as uncapped once they were dropped)."""
    dropped = parts.get("dense vectors", 0.0) if quantization != UNQUANTIZED else 0.0
    return sum(parts.values()) - dropped


def build_probe(engine: str, root: Path, n: int, quantization: Quantization) -> dict[str, Any]:
    """Run in a fresh process: `build`, and the build's peak RSS (the seal's optimize builds the
    sealed segment beside the appendable one, so this is where a build's memory peaks), of
    this process and the writer and sealer processes it starts, summed. Most of that RSS is
    mapped shard files, which the kernel can drop and read again; the private part (RssAnon,
    which it cannot) has no peak counter, so a process beside it samples both (a thread here
    would not run while the engine holds the interpreter lock: bench/peak_memory.py)."""
    sampler = PeakSampler("RssAnon", "VmRSS")
    try:
        figures = build(engine, root, n, quantization=quantization)
    finally:
        peaks = sampler.stop()
    return figures | {
        "build_rss_mb": max(_memory()["rss_mb"], peaks["VmRSS"]),
        "build_private_mb": peaks["RssAnon"],
    }


def _build_in_subprocess(
    engine: str, root: Path, n: int, quantization: Quantization, ef_construct: int | None
) -> dict[str, Any]:
    """`build_probe` in a fresh process whose shards build their graphs `ef_construct` wide
    (None: local mode, which builds no graph)."""
    if ef_construct is None:
        return _in_subprocess("build_probe", engine, str(root), str(n), quantization)
    env = {EF_CONSTRUCT_ENV: str(ef_construct)}
    figures = _in_subprocess("build_probe", engine, str(root), str(n), quantization, env=env)
    return figures | {"ef_construct": ef_construct}


def _probe_in_subprocess(engine: str, root: Path) -> dict[str, Any]:
    return _in_subprocess("serve_probe", engine, str(root))


def _in_subprocess(
    function: str, *args: str, cgroup: Path | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """`function(*args)` of this module in a fresh Python (its own peak RSS), in memory cgroup
    `cgroup` when given (it joins before importing anything), with this process's environment
    and `env`; its JSON result. Arguments that are digits are passed as ints, a path's as a
    Path."""
    join = (
        f"open({str(cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); " if cgroup else ""
    )
    code = (
        f"import os; {join}"
        "import json, sys; from pathlib import Path; import bench.bench_engine as b; "
        "args = [int(a) if a.isdigit() else a for a in sys.argv[2:]]; args[1] = Path(args[1]); "
        f"print(json.dumps(b.{function}(*args)))"
    )
    here = str(Path(__file__).resolve().parents[1])
    environ = dict(os.environ) | dict(env or {})
    return child_json(code, [function, *args], environ, f"bench_engine's {function}", here)


def run(
    sizes: tuple[int, ...] = (100_000,),
    peer_max: int = 100_000,
    quantizations: tuple[Quantization, ...] = ("none",),
    cap_fraction: float | None = None,
    widths: tuple[int, ...] = (HNSW_EF_CONSTRUCT,),
) -> dict[str, Any]:
    """{size: {engine: figures}}; a quantized Edge build is the engine "edge-<quantization>".
    Each Edge setting is built at each of `widths` (HNSW ef_construct), one after the other; a
    width after the first is "<label>@<width>" ("edge-int8@200"; local mode builds no graph).
    With `cap_fraction` (and float32 among the settings), each Edge build is probed again in a
    process whose memory (private and page cache, as a container's limit counts it) is capped at
    that fraction of float32's serving RSS at the same size."""
    results: dict[str, Any] = {}
    for n in sizes:
        row: dict[str, Any] = {}
        settings: list[tuple[str, Quantization]] = (
            [("edge", "none")] if "none" in quantizations else []
        )
        settings += [(f"edge-{q}", q) for q in quantizations if q != "none"]
        runs: list[tuple[str, Quantization, str, int | None]] = [
            (label if width == widths[0] else f"{label}@{width}", quantization, "edge", width)
            for label, quantization in settings
            for width in widths
        ]
        if n <= peer_max:
            runs.append(("local", "none", "local", None))
        for label, quantization, engine, width in runs:
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp) / engine
                row[label] = _build_in_subprocess(engine, root, n, quantization, width)
                row[label].update(_probe_in_subprocess(engine, root))
                if cap_fraction and engine == "edge" and "edge" in row:
                    row[label].update(capped_probe(root, cap_fraction * row["edge"]["rss_mb"]))
                shutil.rmtree(root, ignore_errors=True)
        results[str(n)] = row
    return results


# Where a process's memory can be capped: a cgroup v1 memory controller (this machine's; a
# container runtime caps a replica the same way). Making a group needs root.
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
# Queries a stage in a capped probe: a float32 version capped far below its vectors reads them
# from disk (20k points at 0.4x its RSS: 616 ms a dense query), so fewer than uncapped.
CAPPED_QUERIES = 50
# The figures of a capped probe (`capped_probe`), each kept as "capped_<figure>".
CAPPED_FIGURES = (
    "dense_p50_ms",
    "hybrid_p50_ms",
    "hybrid_p95_ms",
    "hybrid_filtered_p50_ms",
    "rss_mb",
    "rss_anon_mb",
)


def capped_probe(root: Path, cap_mb: float) -> dict[str, Any]:
    """`serve_probe` in a fresh process in a memory cgroup limited to `cap_mb` (the kernel then
    drops and reads again the shard files' pages to stay under it): {"cap_mb", "capped_*"},
    with "capped_error" when the process died under the cap (out of memory); {} where no
    group can be made here (no cgroup v1 memory controller, or not root)."""
    group = CGROUP_MEMORY / f"rag-bench-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        return {}
    try:
        (group / "memory.limit_in_bytes").write_text(str(int(cap_mb * 2**20)))
        out: dict[str, Any] = {"cap_mb": cap_mb}
        try:
            figures = _in_subprocess(
                "serve_probe", "edge", str(root), str(CAPPED_QUERIES), cgroup=group
            )
        except RuntimeError as exc:
            return out | {"capped_error": str(exc).splitlines()[-1][:200]}
        return out | {f"capped_{k}": figures[k] for k in CAPPED_FIGURES}
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


# The figures `rag-retriever plan` reads, per engine run and size (rag_retriever/ops/plan.py).
CONSTANT_FIGURES = (
    "write_s",
    "seal_s",
    "build_rss_mb",
    "reopen_s",
    "disk_mb",
    "rss_mb",
    "rss_anon_mb",
    "dense_p50_ms",
    "dense_p95_ms",
    "hybrid_p50_ms",
    "hybrid_p95_ms",
    "hybrid_filtered_p50_ms",
    "hybrid_filtered_p95_ms",
)
# figures a point may lack (constants written before they were measured); "shards": the base
# shards the version was (the plan fits through one-shard sizes); "resident_mb": `resident_mb`
OPTIONAL_FIGURES = ("build_private_mb", "shards", "resident_mb")


def constants(
    results: dict[str, Any],
    command: str,
    *,
    query_encode_ms: float | None = None,
    edits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan's constants from a run: each quantization's figures at each size measured, with
    where and how they were measured; the query encoding's p50 and an edit's cost when given."""
    settings: dict[str, list[dict[str, float]]] = {}
    widths = set()
    for n, row in sorted(results.items(), key=lambda item: int(item[0])):
        for label, figures in row.items():
            if not label.startswith("edge"):
                continue
            if "@" in label:  # a second width (main refuses it with --constants-out)
                raise ValueError(f"{label}: the constants are of one graph width")
            widths.add(int(figures.get("ef_construct", HNSW_EF_CONSTRUCT)))
            quantization = label.partition("-")[2] or "none"
            point = {"chunks": int(n)} | {
                k: float(figures[k]) for k in (*CONSTANT_FIGURES, *OPTIONAL_FIGURES) if k in figures
            }
            point["ef_per_result"] = HNSW_EF_PER_RESULT  # what its searches were asked
            if quantization in QUANTIZATION_OVERSAMPLING:
                point["oversampling"] = QUANTIZATION_OVERSAMPLING[quantization]
            settings.setdefault(quantization, []).append(point)
    if len(widths) > 1:
        raise ValueError(f"builds of graph widths {sorted(widths)}: the constants are of one")
    return {
        "measured": {
            "date": datetime.date.today().isoformat(),
            "command": command,
            "cores": os.cpu_count(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "engine": "Qdrant Edge (embedded), 384-d vectors, BM25 of real text, no encoder",
            "base_shard_points": shard_points(),
            "ef_construct": widths.pop() if widths else HNSW_EF_CONSTRUCT,  # every graph's
        },
        "settings": settings,
        "query_encode_ms": query_encode_ms,
        "edits": edits or {},
    }


def query_encode_ms(n: int = 200) -> float:
    """p50 of encoding one question with all-MiniLM-L6-v2 (the default model) on this machine."""
    from rag_retriever.models.encoder import Encoder

    encoder = Encoder.load("all-MiniLM-L6-v2", device="cpu")
    rows = read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), n)
    timings = []
    for row in rows:
        t0 = time.perf_counter()
        encoder.encode_queries([row["question"]])
        timings.append((time.perf_counter() - t0) * 1000)
    return percentile(timings[10:], 50)


def report(results: dict[str, Any]) -> list[str]:
    """Each Edge build's figures beside its peer's: a graph of a later width beside the same
    setting's first, a quantized setting beside float32, float32 beside qdrant-client local
    mode."""
    lines = []
    for n, row in results.items():
        for label, figures in row.items():
            setting, _, width = label.partition("@")
            held = setting.partition("-")[2] or "float32"
            if width:
                was = row[setting]["ef_construct"]
                what = f", {held} vectors, graph built at ef_construct {width} vs {was}"
                lines += _lines(n, figures, row[setting], what, f"ef_construct {was}")
            elif label.startswith("edge-"):
                what = f", {held} vectors{_width(figures)} vs float32"
                lines += _lines(n, figures, row.get("edge"), what)
        if "edge" in row:
            what = _width(row["edge"])
            lines += _lines(n, row["edge"], row.get("local"), what, "qdrant-client local mode")
    return lines


def _width(figures: dict[str, Any]) -> str:
    """How wide a build's graph was, where not the product's default."""
    width = figures.get("ef_construct", HNSW_EF_CONSTRUCT)
    return "" if width == HNSW_EF_CONSTRUCT else f", graph built at ef_construct {width}"


def _lines(
    n: str,
    edge: dict[str, Any],
    peer: dict[str, Any] | None,
    what: str,
    peer_name: str = "float32",
) -> list[str]:
    """One run's figures, beside its peer's (`peer_name`); `what` tells the run from others."""
    lines = []
    lines.append(f"engine at {int(n):,} chunks (384-d random vectors + BM25 of real text{what}):")
    for key, label, fmt in [
        ("points_per_s", "write points/s", "{:,.0f}"),
        ("seal_s", "seal (index+optimize) s", "{:.1f}"),
        ("shards", "base shards", "{:.0f}"),
        ("reopen_s", "reopen s", "{:.2f}"),
        ("dense_p50_ms", "dense p50 ms", "{:.2f}"),
        ("dense_after_repeat_p50_ms", "dense after a repeat p50", "{:.2f}"),
        ("dense_major_faults", "dense disk reads/query", "{:.1f}"),
        ("dense_recall_at_10", "dense recall@10 vs exact", "{:.3f}"),
        ("dense_recall_at_100", "dense recall@100 vs exact", "{:.3f}"),
        ("bm25_p50_ms", "bm25 p50 ms", "{:.2f}"),
        ("hybrid_p50_ms", "hybrid p50 ms", "{:.2f}"),
        ("hybrid_p95_ms", "hybrid p95 ms", "{:.2f}"),
        ("hybrid_filtered_p50_ms", "filtered hybrid p50 ms", "{:.2f}"),
        ("hybrid_major_faults", "hybrid disk reads/query", "{:.1f}"),
        ("build_rss_mb", "build peak RSS MB", "{:,.0f}"),
        ("build_private_mb", "  of which private MB", "{:,.0f}"),
        ("rss_mb", "serving peak RSS MB", "{:,.0f}"),
        ("rss_anon_mb", "  of which private MB", "{:,.0f}"),
        ("disk_mb", "disk MB", "{:,.0f}"),
    ]:
        text = f"  {label:<26} Qdrant Edge {fmt.format(edge[key]):>10}"
        if peer is not None:
            ratio = peer[key] / edge[key] if edge[key] else float("nan")
            text += f"   {peer_name} {fmt.format(peer[key]):>10}   ratio {ratio:.2f}"
        lines.append(text)
    if "capped_error" in edge:
        lines.append(f"  capped at {edge['cap_mb']:,.0f} MB: died ({edge['capped_error']})")
    elif "cap_mb" in edge:
        lines.append(
            f"  capped at {edge['cap_mb']:,.0f} MB: dense p50 {edge['capped_dense_p50_ms']:.2f} ms, "
            f"hybrid p50 / p95 {edge['capped_hybrid_p50_ms']:.2f} / "
            f"{edge['capped_hybrid_p95_ms']:.2f} ms, filtered hybrid p50 "
            f"{edge['capped_hybrid_filtered_p50_ms']:.2f} ms, peak RSS {edge['capped_rss_mb']:,.0f} MB"
        )
    if "rss_parts_mb" in edge:
        held = ", ".join(f"{k} {v:,.0f}" for k, v in edge["rss_parts_mb"].items() if v >= 1)
        lines.append(f"  resident after the queries (MB): {held}")
    return lines


def merged_constants(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`'s constants over an existing file's: what another benchmark added (bench_brief's
    `served`) stays, and so do the sizes this run did not measure (a 1M run added to the 100k
    and 300k points of an earlier one), each size's figures from its latest run; when earlier
    points stay, the command names both runs. A file measured on another machine (other cores,
    memory or engine) or with graphs of another width is replaced whole: a fit through both
    would describe neither (a file that names no width was built at Qdrant's 100); of a file
    of another width only the other benchmarks' parts stay (bench_quantization's `recall`,
    which names its own width, and bench_brief's `served`)."""
    was, now = old.get("measured") or {}, new["measured"]
    if any(was.get(k) != now[k] for k in ("cores", "memory_gb", "engine")):
        return new
    if measured_width(was) != measured_width(now):
        return new | {k: old[k] for k in ("recall", "served") if k in old}
    by_size: dict[str, dict[int, dict[str, float]]] = {
        name: {int(p["chunks"]): p for p in points}
        for name, points in (old.get("settings") or {}).items()
    }
    kept = any(
        n not in {int(p["chunks"]) for p in new["settings"].get(name, [])}
        for name, sizes in by_size.items()
        for n in sizes
    )
    for name, points in new["settings"].items():
        by_size.setdefault(name, {}).update({int(p["chunks"]): p for p in points})
    merged = old | new
    merged["settings"] = {
        name: [sizes[n] for n in sorted(sizes)] for name, sizes in by_size.items()
    }
    if kept and was.get("command"):
        merged["measured"] = now | {"command": f"{was['command']} && {now['command']}"}
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--peer-max", type=int, default=100_000)
    parser.add_argument(
        "--quantization",
        nargs="+",
        choices=QUANTIZATIONS,
        default=["none"],
        help="dense vectors held as each of these",
    )
    parser.add_argument(
        "--constants-out",
        type=Path,
        help="write the figures `rag-retriever plan --constants` reads to this JSON file",
    )
    parser.add_argument(
        "--cap-fraction",
        type=float,
        help="also serve each Edge build capped at this fraction of float32's serving RSS "
        "(needs none among --quantization, root and a cgroup v1 memory controller)",
    )
    parser.add_argument(
        "--shard-points",
        type=positive_count,
        help=f"most chunks in one base shard of a build (RAG_BASE_SHARD_POINTS; default "
        f"{BASE_SHARD_POINTS:,}): a bigger build is written and sealed as several shards",
    )
    parser.add_argument(
        "--ef-construct",
        type=graph_width,
        nargs="+",
        default=[HNSW_EF_CONSTRUCT],
        help="build each Edge setting's HNSW graph at each of these widths "
        f"(RAG_HNSW_EF_CONSTRUCT; default: the product's, {HNSW_EF_CONSTRUCT}), one after the "
        "other, and report each width after the first beside the first",
    )
    args = parser.parse_args(argv)
    if args.constants_out is not None and len(args.ef_construct) > 1:
        # the plan's figures are of one width: a fit through two describes neither
        parser.error("--constants-out takes a run of one --ef-construct")
    if repeated := sorted({w for w in args.ef_construct if args.ef_construct.count(w) > 1}):
        parser.error(f"--ef-construct: each width once ({repeated[0]} is given twice)")
    if args.shard_points is not None:
        os.environ[SHARD_POINTS_ENV] = str(args.shard_points)
    if args.cap_fraction is not None and not (
        0 < args.cap_fraction <= 1 and "none" in args.quantization
    ):
        parser.error("--cap-fraction takes a fraction in (0, 1] and needs none in --quantization")
    results = run(
        tuple(args.sizes),
        args.peer_max,
        tuple(args.quantization),
        args.cap_fraction,
        tuple(args.ef_construct),
    )
    for text in report(results):
        print(text, flush=True)
    if args.constants_out:
        from bench.bench_update import edit_constants

        command = "python -m bench.bench_engine " + " ".join(argv or sys.argv[1:])
        made = constants(
            results, command, query_encode_ms=query_encode_ms(), edits=edit_constants()
        )
        if args.constants_out.is_file():
            made = merged_constants(json.loads(args.constants_out.read_text()), made)
        args.constants_out.write_text(json.dumps(made, indent=1) + "\n")
        print(f"plan constants written to {args.constants_out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
