"""GPU benchmark: the encoder, the reranker and a training step on CUDA, each against its peer in
the same run, plus chunking on the machine's cores. Without a CUDA device it says so and skips.

Without CUDA only the chunking lines run (on the CPU: chunks/s of 1-8 processes, counting tokens
by pieces against tokenising each text whole as before, in the same run).

Usage:
    python -m bench --only gpu
    python -m bench.bench_gpu [--model DIR] [--data DIR] [--device cpu --small]

Peers: `SentenceTransformer(<the same model dir>).encode` for the encoder (its defaults: fp32,
batch 32; and in fp16 with our batch size), `CrossEncoder(<the same dir>).predict` for 100
(question, chunk) pairs. No trained cross-encoder is available here: the reranker is MiniLM with
a fresh one-logit head, which times like a trained one. Parity: the minimum cosine between our
CPU fp32 vectors and the device's, and the largest |logit| difference of the reranker.

Not measured here: ingest end to end (the writer and the Qdrant store are being rebuilt) —
the encoder and chunking figures are its two compute stages. `--device cpu --small` runs every
step on a few texts, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from bench.bench_common import percentile, shared_path
from rag_retriever.ingest.chunking import Chunker, ChunkingConfig
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.parallel_chunking import chunk_documents, cores
from rag_retriever.models.encoder import Encoder, embed_batch
from rag_retriever.models.profiles import resolve_model
from rag_retriever.models.quiet import quiet_transformers
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.models.token_counter import TokenizerCounter
from rag_retriever.training.common import OptimizerStep, training_precision, warmup_linear

PAIRS = 100  # the reranking request: 100 (question, chunk) pairs
REPEATS = 30


def run(
    model_dir: Path | None = None,
    data_dir: Path | None = None,
    *,
    device: str = "cuda",
    small: bool = False,
) -> dict[str, Any]:
    model = str(model_dir or resolve_model("all-MiniLM-L6-v2").source)
    scifact = _docs(data_dir, "scifact", 300 if small else None)
    out: dict[str, Any] = {"torch": torch.__version__, "cores": cores()}
    out["chunking"] = _chunking(model, scifact)
    if device == "cuda" and not torch.cuda.is_available():
        return {**out, "skipped": "no CUDA device"}
    out["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    texts = _chunk_texts(model, scifact, 200 if small else 10_000)
    out["encoder"] = _encoder(model, texts, device, repeats=1 if small else 3)
    out["reranker"] = _reranker(model, texts, device, repeats=3 if small else REPEATS)
    out["training"] = _training(model, texts, device, steps=2 if small else 10)
    return out


def _docs(data_dir: Path | None, name: str, limit: int | None) -> list[Any]:
    path = data_dir / name / "docs.jsonl" if data_dir else shared_path(name, "docs.jsonl")
    docs = list(load_documents(path).documents)
    return docs[:limit] if limit else docs


def _counter_and_config(model: str) -> tuple[Any, ChunkingConfig]:
    encoder = Encoder.load(model, device="cpu", dtype="fp32")
    config = ChunkingConfig(chunk_tokens=200, overlap_tokens=48, max_seq_length=256)
    return encoder.token_counter, config


def _chunking(model: str, docs: list[Any], repeats: int = 2) -> dict[str, Any]:
    """Chunks/s of the token counter by pieces (now) against the same counter tokenising each
    text whole (main before it), in one process and in worker processes, measured in turns in
    the same run (best of `repeats`, each with a fresh counter: nothing remembered between
    runs); the chunks are asserted identical."""
    counter, config = _counter_and_config(model)
    counters = {
        "before": lambda: TokenizerCounter(counter.tokenizer, by_pieces=False),
        "after": lambda: TokenizerCounter(counter.tokenizer),
    }
    assert counters["after"]().by_pieces, "this tokenizer is not counted by pieces"
    expected = Chunker(counters["before"](), config).chunk_all(docs)
    out: dict[str, Any] = {"documents": len(docs), "chunks": len(expected)}
    for workers in sorted({1, 2, min(4, cores()), min(8, cores())}):
        for _ in range(repeats):
            for name, make in counters.items():
                began = time.perf_counter()
                chunks = chunk_documents(docs, make(), config, workers=workers)
                seconds = time.perf_counter() - began
                assert [c for cs in chunks for c in cs] == expected
                key = f"{name}_workers_{workers}_per_s"
                out[key] = max(out.get(key, 0.0), len(expected) / seconds)
    return out


def _chunk_texts(model: str, docs: list[Any], n: int) -> list[str]:
    counter, config = _counter_and_config(model)
    chunks = [c for cs in chunk_documents(docs, counter, config) for c in cs]
    return [c.embed_text for c in random.Random(1).sample(chunks, min(n, len(chunks)))]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _best(fn: Callable[[], Any], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - began)
    return min(times)


def _encoder(model: str, texts: list[str], device: str, repeats: int) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    ours = Encoder.load(model, device=device)
    out: dict[str, Any] = {"texts": len(texts), "ours_precision": ours.precision.describe()}
    out["ours_batch"] = ours.batch_size
    ours.encode_passages(texts[:512])  # warm-up: kernels, allocator
    out["ours_per_s"] = len(texts) / _best(lambda: ours.encode_passages(texts), repeats, device)
    for size in (64, 128, 512):
        other = Encoder.load(model, device=device, batch_size=size)
        other.encode_passages(texts[:512])
        out[f"ours_batch_{size}_per_s"] = len(texts) / _best(
            partial(other.encode_passages, texts), repeats, device
        )
    peer = SentenceTransformer(model, device=device)
    peer.encode(texts[:512])
    out["st_fp32_b32_per_s"] = len(texts) / _best(
        lambda: peer.encode(texts, batch_size=32, normalize_embeddings=True), repeats, device
    )
    if device == "cuda":
        peer.half()
        peer.encode(texts[:512])
        out["st_fp16_b256_per_s"] = len(texts) / _best(
            lambda: peer.encode(texts, batch_size=256, normalize_embeddings=True), repeats, device
        )
    sample = texts[:500]
    reference = Encoder.load(model, device="cpu", dtype="fp32").encode_passages(sample).vectors
    cosines = np.sum(reference * ours.encode_passages(sample).vectors, axis=1)
    out["min_cosine_vs_cpu_fp32"] = float(cosines.min())
    return out


def _cross_encoder_dir(model: str, into: Path) -> Path:
    """MiniLM with a fresh one-logit head (seeded), saved as a sequence classifier."""
    torch.manual_seed(0)
    with quiet_transformers(new_head_expected=True):
        classifier = transformers.AutoModelForSequenceClassification.from_pretrained(
            model, num_labels=1
        )
        classifier.save_pretrained(into)
        transformers.AutoTokenizer.from_pretrained(model).save_pretrained(into)
    return into


def _reranker(model: str, texts: list[str], device: str, repeats: int) -> dict[str, Any]:
    from sentence_transformers import CrossEncoder

    with tempfile.TemporaryDirectory() as tmp:
        directory = _cross_encoder_dir(model, Path(tmp))
        query = "Which protein regulates the cell cycle in cancer cells?"
        passages = texts[:PAIRS]
        out: dict[str, Any] = {"pairs": len(passages)}
        for batch in (32, PAIRS):
            ours = CrossEncoderReranker.load(directory, device=device, batch_size=batch)
            out[f"ours_b{batch}"] = _latencies(partial(ours.score, query, passages), repeats)
        out["ours_precision"] = ours.precision.describe()
        cpu = CrossEncoderReranker.load(directory, device="cpu", dtype="fp32")
        diff = np.abs(cpu.score(query, passages).scores - ours.score(query, passages).scores)
        out["max_abs_logit_diff_vs_cpu_fp32"] = float(diff.max())
        peer = CrossEncoder(str(directory), device=device)
        pairs = [(query, p) for p in passages]
        identity = torch.nn.Identity()
        out["st_fp32_b32"] = _latencies(
            lambda: peer.predict(pairs, batch_size=32, activation_fn=identity), repeats
        )
        if device == "cuda":
            peer.model.half()
            out["st_fp16_b32"] = _latencies(
                lambda: peer.predict(pairs, batch_size=32, activation_fn=identity), repeats
            )
    return out


def _latencies(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    for _ in range(3):
        fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()  # both return host arrays: the device is done when they return
        times.append((time.perf_counter() - began) * 1000)
    return {"p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95)}


def _training(model: str, texts: list[str], device: str, steps: int) -> dict[str, Any]:
    """One optimizer step of each trainer's shape, in training precision: the embedder on 32
    questions + 64 passages (InfoNCE over the batch), the reranker on 32 pairs (8 questions x
    4, listwise). Timed over `steps` steps with one wait for the device at the end."""
    precision = training_precision(device, "auto")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    out: dict[str, Any] = {"precision": precision.describe()}

    embedder = transformers.AutoModel.from_pretrained(model).to(precision.device).train()
    queries, passages = texts[:32], texts[32:96]

    def embed_loss() -> torch.Tensor:
        with precision.autocast():
            vectors = embed_batch(
                embedder,
                tokenizer,
                queries + passages,
                pooling="mean",
                max_length=256,
                device=precision.device,
            )
        logits = vectors[:32] @ vectors[32:].T / 0.05
        return torch.nn.functional.cross_entropy(logits, torch.arange(32, device=precision.device))

    out["embedder_step_ms"] = _step_ms(embedder, embed_loss, precision, steps, device)

    with tempfile.TemporaryDirectory() as tmp:
        directory = _cross_encoder_dir(model, Path(tmp))
        reranker = CrossEncoderReranker(
            transformers.AutoModelForSequenceClassification.from_pretrained(directory),
            tokenizer,
            name="bench",
            precision=precision,
        )
    reranker.model.train()
    pairs = [(texts[i], texts[100 + j]) for i in range(8) for j in range(4)]

    def rerank_loss() -> torch.Tensor:
        encoded = tokenizer(
            [q for q, _ in pairs],
            [p for _, p in pairs],
            padding=True,
            truncation="only_second",
            max_length=256,
            return_tensors="pt",
        ).to(precision.device)
        with precision.autocast():
            logits = reranker.logits(dict(encoded)).view(8, 4)
        return torch.nn.functional.cross_entropy(
            logits, torch.zeros(8, dtype=torch.long, device=precision.device)
        )

    out["reranker_step_ms"] = _step_ms(reranker.model, rerank_loss, precision, steps, device)
    return out


def _step_ms(
    model: torch.nn.Module,
    loss_of: Callable[[], torch.Tensor],
    precision: Any,
    steps: int,
    device: str,
) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = OptimizerStep(model, optimizer, warmup_linear(optimizer, steps + 2, 0.1), precision)
    for _ in range(2):
        step(loss_of())  # warm-up
    _sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        step(loss_of())
    _sync(device)
    return (time.perf_counter() - began) / steps * 1000


def report(r: dict[str, Any]) -> list[str]:
    lines = ["", "## GPU: encoder, reranker, training step; chunking on the machine's cores"]
    c = r["chunking"]
    lines.append(
        f"chunking SciFact ({c['documents']} docs, {c['chunks']} chunks, {r['cores']} cores), "
        "token counts by pieces (now) vs each text tokenised whole (before), same run:"
    )
    for key in c:
        if key.startswith("after_workers_"):
            workers = key.removeprefix("after_workers_").removesuffix("_per_s")
            before = c[f"before_workers_{workers}_per_s"]
            lines.append(
                f"  {workers} process(es): {c[key]:,.0f} chunks/s vs {before:,.0f}/s before -> "
                f"{c[key] / before:.2f}x"
            )
    if "skipped" in r:
        return [*lines, f"GPU skipped: {r['skipped']}"]
    e, k, t = r["encoder"], r["reranker"], r["training"]
    lines.append(f"{r['device']} (torch {r['torch']})")
    lines.append(
        f"encoder on {e['texts']} chunks: ours {e['ours_per_s']:,.0f}/s ({e['ours_precision']}, "
        f"batch {e['ours_batch']}) vs SentenceTransformer.encode {e['st_fp32_b32_per_s']:,.0f}/s "
        f"(fp32, batch 32) -> {e['ours_per_s'] / e['st_fp32_b32_per_s']:.2f}x"
    )
    if "st_fp16_b256_per_s" in e:
        lines.append(
            f"  vs SentenceTransformer fp16 batch 256: {e['st_fp16_b256_per_s']:,.0f}/s -> "
            f"{e['ours_per_s'] / e['st_fp16_b256_per_s']:.2f}x"
        )
    sizes = ", ".join(f"{n}: {e[f'ours_batch_{n}_per_s']:,.0f}/s" for n in (64, 128, 512))
    lines.append(f"  ours by batch size: {sizes}")
    lines.append(f"  min cosine, CPU fp32 vs device vectors: {e['min_cosine_vs_cpu_fp32']:.5f}")
    ours32, ours_all, peer = k["ours_b32"], k[f"ours_b{PAIRS}"], k["st_fp32_b32"]
    lines.append(
        f"rerank {k['pairs']} pairs: ours p50 {ours32['p50_ms']:.1f} ms / p95 "
        f"{ours32['p95_ms']:.1f} ms (batch 32, {k['ours_precision']}; one batch of {PAIRS}: "
        f"{ours_all['p50_ms']:.1f} / {ours_all['p95_ms']:.1f}) vs CrossEncoder.predict p50 "
        f"{peer['p50_ms']:.1f} / p95 {peer['p95_ms']:.1f} (fp32) -> "
        f"{peer['p50_ms'] / ours32['p50_ms']:.2f}x"
    )
    if "st_fp16_b32" in k:
        lines.append(
            f"  vs CrossEncoder fp16: p50 {k['st_fp16_b32']['p50_ms']:.1f} / p95 "
            f"{k['st_fp16_b32']['p95_ms']:.1f} ms"
        )
    lines.append(f"  max |logit| difference vs CPU fp32: {k['max_abs_logit_diff_vs_cpu_fp32']:.4f}")
    lines.append(
        f"training step ({t['precision']}): embedder (32 questions + 64 passages) "
        f"{t['embedder_step_ms']:.1f} ms, reranker (32 pairs) {t['reranker_step_ms']:.1f} ms"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="model dir (default: the packaged MiniLM)")
    parser.add_argument("--data", type=Path, help="data dir (default: ../shared/data)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="a few texts: check the script")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--chunking-only", action="store_true", help="chunking on the CPUs only")
    args = parser.parse_args(argv)
    if args.chunking_only:
        docs = _docs(args.data, "scifact", 300 if args.small else None)
        model = str(args.model or resolve_model("all-MiniLM-L6-v2").source)
        print(json.dumps(_chunking(model, docs)))
        return 0
    results = run(args.model, args.data, device=args.device, small=args.small)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2), encoding="utf-8")
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
