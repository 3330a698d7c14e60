"""Ingest end to end, stage by stage: this checkout against an earlier one, in the same run.

Usage:
    git worktree add --detach /tmp/rag-before a543cf9   # the sequential ingest (before issue 22's pipeline)
    python -m bench.bench_pipeline --before /tmp/rag-before [--rounds 1] [--out FILE]
    # on a CUDA machine, as in benchmarks.md's GPU ingest (model and data copied there):
    python -m bench.bench_pipeline --before DIR --device cuda --model DIR --data DIR \
        --corpora scifact --copies 4 --rounds 2

Each round runs, in turn, the earlier checkout and this one, each in a fresh subprocess (same
Python, same virtual environment, the checkout first on the path) that loads all-MiniLM-L6-v2
(on the CPU unless `--device`) and ingests SQuAD (dev articles) and then SciFact into a new
embedded store; `--copies N` ingests each corpus N times over (the copies' documents get ids of
their own), for a build of a size where the stages' overlap shows on a GPU. Stages,
measured the same way for both: chunk = chunking + BM25 terms and statistics; encode = time
inside `Encoder.encode_passages` and `Encoder.encode_prepared` (what a writer with a tokenise stage
calls); write = building sparse vectors and payloads and upserting
(the earlier writer's encode-and-upsert lap minus its encoding); seal = the store's seal; total
= the wall time of `ingest_documents`. In the pipelined checkout chunk, encode and write overlap,
so their sum exceeds the total. Ratios measured side by side are what to read on a shared
machine; the absolute times move with its load.

Not measured: deltas (bench/bench_update.py); the encoder and reranker alone on a GPU
(bench/bench_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.bench_common import child_json, shared_path

HERE = Path(__file__).resolve().parents[1]
CORPORA = ("squad_v11_dev", "scifact")

# Runs inside the subprocess, with the checkout to measure first on sys.path.
_CHILD = """
import json, sys, tempfile, time
from pathlib import Path
from rag_retriever.models.encoder import Encoder
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.store import EdgeStore
import rag_retriever.ingest.writer as writer

spent = {"encode": 0.0}
def timed(original):
    def run(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent["encode"] += time.perf_counter() - began
    return run
# the forward passes: encode_prepared where the writer tokenises in a stage of its own
Encoder.encode_passages = timed(Encoder.encode_passages)
if hasattr(Encoder, "encode_prepared"):
    Encoder.encode_prepared = timed(Encoder.encode_prepared)

import dataclasses
device, model, copies = sys.argv[1], sys.argv[2], int(sys.argv[3])
encoder = Encoder.load(model, device=device)
encoder.encode_passages(["warm up"] * 8)
out = {"writer": writer.__file__}
for name, path in zip(sys.argv[4::2], sys.argv[5::2]):
    loaded = load_documents(Path(path))
    docs = [dataclasses.replace(d, id=f"{d.id}_{k}") if k else d
            for k in range(copies) for d in loaded.documents]
    corpus = dataclasses.replace(loaded, documents=tuple(docs))
    with tempfile.TemporaryDirectory() as tmp:
        store = EdgeStore(Path(tmp) / "edge")
        spent["encode"] = 0.0
        began = time.perf_counter()
        report = ingest_documents(corpus, alias=name.replace("_", "-"), encoder=encoder,
                                  store=store, lock_dir=Path(tmp))
        total = time.perf_counter() - began
        store.close()
    t = report.timings_s
    encode = spent["encode"]
    chunk = t.get("chunk", 0.0) + t.get("bm25_stats", 0.0)
    write = t["write"] if "write" in t else t["embed_upsert"] - encode
    out[name] = {"documents": report.documents, "chunks": report.chunks, "chunk": chunk,
                 "encode": encode, "write": write, "seal": t.get("seal", 0.0), "total": total,
                 "timings_s": t}
print(json.dumps(out))
"""

STAGES = ("chunk", "encode", "write", "seal", "total")


@dataclass(frozen=True)
class Setup:
    device: str = "cpu"
    model: str = "all-MiniLM-L6-v2"
    data: Path | None = None  # the shared data dir (default: ../shared/data)
    corpora: tuple[str, ...] = CORPORA
    copies: int = 1


def ingest_with(checkout: Path, setup: Setup) -> dict[str, Any]:
    args = [setup.device, setup.model, str(setup.copies)]
    for name in setup.corpora:
        path = setup.data / name / "docs.jsonl" if setup.data else shared_path(name, "docs.jsonl")
        args += [name, str(path)]
    env = {**os.environ, "PYTHONPATH": str(checkout), "RAG_LOG_LEVEL": "WARNING"}
    result = child_json(_CHILD, args, env, f"ingest with {checkout}", cwd=tempfile.gettempdir())
    if not result["writer"].startswith(str(checkout)):
        raise RuntimeError(f"{checkout} was not the code measured: {result['writer']}")
    return result


def run(before: Path, rounds: int = 1, setup: Setup | None = None) -> dict[str, Any]:
    """The best (lowest) time of each stage over `rounds` alternating runs of each checkout."""
    setup = setup or Setup()
    out: dict[str, Any] = {
        "before": str(before),
        "after": str(HERE),
        "setup": {**asdict(setup), "data": str(setup.data) if setup.data else None},
        "rounds": [],
    }
    for _ in range(rounds):
        out["rounds"].append(
            {"before": ingest_with(before, setup), "after": ingest_with(HERE, setup)}
        )
    best: dict[str, Any] = {}
    for side in ("before", "after"):
        for name in setup.corpora:
            runs = [r[side][name] for r in out["rounds"]]
            best.setdefault(side, {})[name] = {
                **{s: min(r[s] for r in runs) for s in STAGES},
                "chunks": runs[0]["chunks"],
                "documents": runs[0]["documents"],
            }
    out["best"] = best
    return out


def report(r: dict[str, Any]) -> list[str]:
    best, corpora = r["best"], r["setup"]["corpora"]
    lines = [
        f"ingest end to end, before ({r['before']}) vs after (this checkout), same run, "
        f"{r['setup']['model']} on {r['setup']['device']}, best of {len(r['rounds'])} rounds:"
    ]
    for name in corpora:
        b, a = best["before"][name], best["after"][name]
        lines.append(
            f"{name} ({a['documents']} docs, {a['chunks']} chunks): before "
            f"{b['chunks'] / b['total']:,.0f} chunks/s, after {a['chunks'] / a['total']:,.0f}"
        )
        for stage in STAGES:
            lines.append(
                f"  {stage:<6} before {b[stage]:7.1f}s  after {a[stage]:7.1f}s  "
                f"-> {b[stage] / a[stage] if a[stage] else float('inf'):.2f}x"
            )
    b_total = sum(best["before"][n]["total"] for n in corpora)
    a_total = sum(best["after"][n]["total"] for n in corpora)
    lines.append(
        f"all corpora: before {b_total:.1f}s, after {a_total:.1f}s -> {b_total / a_total:.2f}x"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="checkout to compare with")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="model name or directory")
    parser.add_argument("--data", type=Path, help="the shared data dir (default ../shared/data)")
    parser.add_argument("--corpora", nargs="+", choices=CORPORA, default=list(CORPORA))
    parser.add_argument("--copies", type=int, default=1, help="each corpus this many times over")
    args = parser.parse_args(argv)
    if args.copies < 1 or args.rounds < 1:
        parser.error("--copies and --rounds must be at least 1")
    setup = Setup(args.device, args.model, args.data, tuple(args.corpora), args.copies)
    results = run(args.before.resolve(), args.rounds, setup)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2), encoding="utf-8")
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
