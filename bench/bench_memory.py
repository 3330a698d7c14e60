"""Peak memory of a full build as its corpus grows: chunked blocks waiting for the encoder on disk
(the writer's default, rag_retriever/ingest/spill.py) against the same build holding them all in
RAM (the peer), each size in a fresh subprocess, in the same run.

Usage:
    python -m bench.bench_memory [--sizes 25000 100000] [--peer-up-to 100000] [--out FILE]

The corpus is SciFact's abstracts, copied until it holds about the asked number of chunks (each
copy's documents get their own ids and a title that names the copy, so no chunk repeats another's
id; the texts, and so BM25's vocabulary, do not grow with the copies). The encoder is a one-layer
BERT of hidden size 32 with all-MiniLM-L6-v2's tokenizer, vocabulary and 256-token limit, random
weights: the chunks are cut and counted exactly as with MiniLM, and the encoder is fast enough
for a 1M-chunk build to take minutes on 2 cores. What it does not measure is MiniLM's own 90 MB
and its activations (a fixed amount: a batch at a time). The store is Qdrant Edge, in a temp dir.

Each subprocess makes the corpus and loads the encoder, resets the kernel's peak (VmHWM, via
/proc/self/clear_refs), ingests, and reports its RSS before the build, the peak until the first
write (`stages_grew`: the chunk, tokenise and encode stages, which run ahead of the writes while
BM25's statistics wait for the last chunk: what the spill bounds) and the peak of the whole build
(`grew`: it adds the engine's own memory for the collection being written and its HNSW graph,
mapped segment files included, which grows with the corpus as serving it does; and, sampled by a
process beside it (bench/peak_memory.py) over the build's processes, the largest anonymous part
and the largest file-backed part, which the kernel can drop and read again).
The documents themselves are the loaded corpus (the input) and are in `before`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.bench_common import child_json, line, shared_path

HERE = Path(__file__).resolve().parents[1]
SCIFACT_CHUNKS_PER_DOC = 2.39  # 12,382 chunks of 5,183 abstracts with MiniLM's 256 tokens

_CHILD = """
import json, sys, tempfile, time
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from bench.peak_memory import PeakSampler
import rag_retriever.ingest.writer as writer
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.profiles import ModelProfile, resolve_model, write_profile_file
from rag_retriever.records import Document
from rag_retriever.store import EdgeStore

docs_path, n_docs, spill, work = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "spill", Path(sys.argv[4])
if not spill:
    writer.SPILL_AFTER = 10**9  # the peer: every block waits in RAM
minilm = resolve_model("all-MiniLM-L6-v2").source
model_dir = work / "tiny"
tokenizer = AutoTokenizer.from_pretrained(minilm)
torch.manual_seed(0)
config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
BertModel(config).save_pretrained(model_dir)
tokenizer.save_pretrained(model_dir)
write_profile_file(model_dir, ModelProfile("tiny-minilm-vocab", "", "", "mean", 256))
encoder = Encoder.load(str(model_dir), device="cpu", dtype="fp32")

base = [json.loads(l) for l in open(docs_path, encoding="utf-8")]
docs = []
for i in range(n_docs):
    d, copy = base[i % len(base)], i // len(base)
    docs.append(Document(f"{d['id']}-{copy}", f"{d.get('title', '')} (copy {copy})", d["text"], {}))
corpus = LoadedCorpus(tuple(docs), 0, "bench_memory")

def status(key):
    for row in open("/proc/self/status"):
        if row.startswith(key + ":"):
            return int(row.split()[1]) * 1024
    raise KeyError(key)

class Store(EdgeStore):
    def create(self, *args, **kwargs):
        # the first write: the stages before it (chunk, tokenise, encode) have run at full tilt
        peaks["stages"] = status("VmHWM")
        return super().create(*args, **kwargs)

peaks = {}
# the peak of each kind of resident page over the build's processes (its writer's included), read
# by a process of its own: a thread here does not run while the engine's seal holds the lock
sampler = PeakSampler("RssAnon", "RssFile")
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
began = time.perf_counter()
report = writer.ingest_documents(corpus, alias="mem", encoder=encoder, store=Store(work / "edge"))
wall = time.perf_counter() - began
tree = sampler.stop()
print(json.dumps({"chunks": report.chunks, "documents": len(docs), "before": before,
                  "stages_peak": peaks["stages"], "peak": status("VmHWM"), "wall_s": wall,
                  "anon_peak": tree["RssAnon"] * 2**20, "file_peak": tree["RssFile"] * 2**20}))
"""


def _one(n_chunks: int, spill: bool) -> dict[str, Any]:
    n_docs = math.ceil(n_chunks / SCIFACT_CHUNKS_PER_DOC)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as work:
        env = {**os.environ, "PYTHONPATH": str(HERE)}
        args = [str(shared_path("scifact", "docs.jsonl")), str(n_docs), "spill" if spill else "ram"]
        result = child_json(_CHILD, [*args, work], env, "bench_memory's build")
    result["grew"] = result["peak"] - result["before"]
    result["stages_grew"] = result["stages_peak"] - result["before"]
    return result


def run(sizes: tuple[int, ...] = (25_000, 100_000), peer_up_to: int = 100_000) -> dict[str, Any]:
    rows = []
    for size in sizes:
        row: dict[str, Any] = {"asked": size, "spill": _one(size, spill=True)}
        if size <= peer_up_to:
            row["ram"] = _one(size, spill=False)
        rows.append(row)
    return {"rows": rows}


def report(r: dict[str, Any]) -> list[str]:
    mib = 1024 * 1024
    out = ["== a full build's peak memory as the corpus grows (spill to disk vs all in RAM) =="]
    for row in r["rows"]:
        ours = row["spill"]
        head = f"{ours['chunks']:,} chunks"
        text = (
            f"  ours: the whole build grew {ours['grew'] / mib:,.0f} MiB (peak "
            f"{ours['peak'] / mib:,.0f}, before {ours['before'] / mib:,.0f}; at most "
            f"{ours['anon_peak'] / mib:,.0f} anonymous and {ours['file_peak'] / mib:,.0f} of "
            f"mapped files), {ours['chunks'] / ours['wall_s']:,.0f} chunks/s"
        )
        if "ram" in row:
            peer = row["ram"]
            out.append(
                line(
                    f"{head}, grown until the first write (chunk, tokenise, encode)",
                    ours["stages_grew"] / mib,
                    peer["stages_grew"] / mib,
                    "MiB",
                    "all in RAM",
                    higher_is_better=False,
                )
            )
            out.append(
                f"{text}; in RAM {peer['grew'] / mib:,.0f} MiB, "
                f"{peer['chunks'] / peer['wall_s']:,.0f} chunks/s"
            )
        else:
            out.append(
                f"{head}, grown until the first write: ours {ours['stages_grew'] / mib:,.0f} MiB "
                "(peer not run at this size)"
            )
            out.append(text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[25_000, 100_000])
    parser.add_argument(
        "--peer-up-to",
        type=int,
        default=100_000,
        help="run the all-in-RAM peer only up to this many chunks (it grows with them)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = run(tuple(args.sizes), args.peer_up_to)
    for text in report(result):
        print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
