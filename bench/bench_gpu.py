"""GPU benchmark: the encoder, the whole ingest, the reranker and a training step on CUDA, each
against its peer in the same run, plus chunking on the machine's cores. One command, sized to
finish within 8 minutes on an H200 (`--budget-s` skips what would not fit, and says so).

Without CUDA only the chunking lines run (on the CPU: chunks/s of 1-8 processes, counting tokens
by pieces against tokenising each text whole as before, in the same run).

Usage:
    python -m bench --only gpu
    python -m bench.bench_gpu [--model DIR] [--data DIR] [--out FILE] [--device cpu --small]

Peers: `SentenceTransformer(<the same model dir>).encode` for the encoder (its defaults: fp32,
batch 32; and in fp16 with our batch size), `CrossEncoder(<the same dir>).predict` for 100
(question, chunk) pairs. No trained cross-encoder is available here: the reranker is MiniLM with
a fresh one-logit head, which times like a trained one.

What else it prints: where the encoder's time goes (the host's tokenising and padding alone, the
device's forward passes alone on batches already there), the FLOP/s the encoder reaches against
a bf16 matrix product measured in the same run (the chip's usable peak), the whole ingest
(`ingest_documents` of SciFact, copied 4 times, into Qdrant Edge) with each pipeline stage's
busy share, and parity with the CPU path: the smallest cosine between CPU fp32 and device
vectors, and how many of 200 SQuAD dev questions get the same top 10 chunks (exact search) from
both. `--device cpu --small` runs every step on a few texts, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from bench.bench_common import percentile, read_jsonl, shared_path
from rag_retriever.ingest.chunking import Chunker, ChunkingConfig
from rag_retriever.ingest.loaders import LoadedCorpus, load_documents
from rag_retriever.ingest.parallel_chunking import chunk_documents, cores
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.device import inference
from rag_retriever.models.encoder import Encoder, embed_batch, embed_tokens
from rag_retriever.models.profiles import resolve_model
from rag_retriever.models.quiet import quiet_transformers
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.models.token_counter import TokenizerCounter
from rag_retriever.store import EdgeStore
from rag_retriever.training.common import OptimizerStep, training_precision, warmup_linear

log = logging.getLogger(__name__)

PAIRS = 100  # the reranking request: 100 (question, chunk) pairs
REPEATS = 30
INGEST_COPIES = 4  # SciFact (12k chunks) this many times: ~50k chunks, seconds of encoding
PARITY_QUESTIONS = 200


def run(
    model_dir: Path | None = None,
    data_dir: Path | None = None,
    *,
    device: str = "cuda",
    small: bool = False,
    budget_s: float = 420.0,
    out_path: Path | None = None,
) -> dict[str, Any]:
    """Every section in turn; one that fails records its error and the rest still run; one
    that would start after `budget_s` is skipped. Results are written to `out_path` after each
    section, so a run cut short keeps what it measured."""
    began = time.perf_counter()
    model = str(model_dir or resolve_model("all-MiniLM-L6-v2").source)
    scifact = _docs(data_dir, "scifact", 300 if small else None)
    out: dict[str, Any] = {"torch": torch.__version__, "cores": cores()}
    if device == "cuda" and not torch.cuda.is_available():
        out["chunking"] = _chunking(model, scifact)
        return {**out, "skipped": "no CUDA device"}
    out["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    texts = _chunk_texts(model, scifact, 200 if small else 10_000)
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("peak", partial(_peak, device, small)),
        ("encoder", partial(_encoder, model, texts, device, repeats=1 if small else 3)),
        ("ingest", partial(_ingest, model, scifact, device, copies=1 if small else INGEST_COPIES)),
        ("parity", partial(_parity, model, data_dir, device, small)),
        ("reranker", partial(_reranker, model, texts, device, repeats=3 if small else REPEATS)),
        ("training", partial(_training, model, texts, device, steps=2 if small else 10)),
        ("chunking", partial(_chunking, model, scifact, repeats=1)),
        ("compiled", partial(_compiled, model, texts, device, repeats=1 if small else 3)),
    ]
    for name, section in sections:
        spent = time.perf_counter() - began
        if spent > budget_s:
            out[name] = {"skipped": f"over the time budget ({spent:.0f} s of {budget_s:.0f})"}
            continue
        log.warning("bench_gpu: %s (%.0f s in)", name, spent)
        try:
            out[name] = section()
        except Exception as exc:  # one section's failure is a result, not the end
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        if out_path is not None:
            out_path.write_text(json.dumps(out, indent=2), encoding="utf-8")
    out["seconds"] = time.perf_counter() - began
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


def _peak(device: str, small: bool) -> dict[str, Any]:
    """bf16 matrix product TFLOP/s (mean of 10 after 3 warm-ups): the chip's usable peak."""
    n = 1024 if small or device != "cuda" else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - began) / 10
    return {"n": n, "bf16_matmul_tflops": 2 * n**3 / seconds / 1e12}


def encoder_flops(config: Any, lengths: list[int]) -> float:
    """Forward FLOPs of a BERT-shaped encoder over sequences of these (real) lengths: per layer,
    the Q/K/V/output projections (4 h^2) and the feed-forward (2 h f) as multiply-adds per token,
    and attention's two products (2 n^2 h multiply-adds) per sequence."""
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = 2 * (4 * h * h + 2 * h * f)
    return float(layers * sum(per_token * n + 4 * n * n * h for n in lengths))


def _encoder(model: str, texts: list[str], device: str, repeats: int) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    ours = Encoder.load(model, device=device)
    out: dict[str, Any] = {"texts": len(texts), "ours_precision": ours.precision.describe()}
    out["ours_batch"] = ours.batch_size
    ours.encode_passages(texts[:512])  # warm-up: kernels, allocator
    out["ours_per_s"] = len(texts) / _best(lambda: ours.encode_passages(texts), repeats, device)
    tokens = ours.prepare_passages(texts)
    out["tokens_real"] = tokens.n_tokens
    out["flops_per_text"] = encoder_flops(
        ours.model.config, [min(n, tokens.max_length) for n in tokens.lengths]
    ) / len(texts)
    # Where the time goes: the host alone (tokenise; pad and pin) and the device alone.
    out["host_tokenize_per_s"] = len(texts) / _best(
        lambda: ours.prepare_passages(texts), repeats, "cpu"
    )
    pin = device == "cuda"
    out["host_pad_per_s"] = len(texts) / _best(
        lambda: list(tokens.batches(ours.batch_size, pin=pin)), repeats, "cpu"
    )
    on_device = _on_device(ours, tokens)
    out["tokens_padded"] = sum(int(b["attention_mask"].numel()) for b in on_device)
    forward_only = partial(_forward_only, ours, ours.model, on_device)
    forward_only()
    out["device_forward_per_s"] = len(texts) / _best(forward_only, repeats, device)
    out["prepared_per_s"] = len(texts) / _best(
        lambda: ours.encode_prepared(tokens), repeats, device
    )
    for size in (128, 512):
        other = Encoder.load(model, device=device, batch_size=size)
        other.encode_passages(texts[:512])
        out[f"ours_batch_{size}_per_s"] = len(texts) / _best(
            partial(other.encode_passages, texts), repeats, device
        )
    if device == "cuda":
        bf16 = Encoder.load(model, device=device, dtype="bf16")
        bf16.encode_passages(texts[:512])
        out["ours_bf16_per_s"] = len(texts) / _best(
            lambda: bf16.encode_passages(texts), repeats, device
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


def _on_device(encoder: Encoder, tokens: Any) -> list[dict[str, torch.Tensor]]:
    """The encoder's padded batches of `tokens`, copied to its device beforehand."""
    pin = encoder.precision.device.type == "cuda"
    return [b.to(encoder.precision.device) for b in tokens.batches(encoder.batch_size, pin=pin)]


def _forward_only(encoder: Encoder, module: Any, batches: list[dict[str, torch.Tensor]]) -> None:
    """`module`'s forward passes (the encoder's model, or a compiled copy) over batches already
    on the device, in this thread, as the encoder runs them."""
    with inference(encoder.precision, encoder.model):
        for batch in batches:
            embed_tokens(module, batch, encoder.profile.pooling)


def _compiled(model: str, texts: list[str], device: str, repeats: int) -> dict[str, Any]:
    """The encoder's forward passes alone, eager against `torch.compile(dynamic=True)`, on the
    same batches already on the device (an experiment: the product does not compile)."""
    ours = Encoder.load(model, device=device)
    on_device = _on_device(ours, ours.prepare_passages(texts))
    compiled = torch.compile(ours.model, dynamic=True)
    out: dict[str, Any] = {}
    for name, module in (("eager", ours.model), ("compiled", compiled)):
        forward = partial(_forward_only, ours, module, on_device)
        began = time.perf_counter()
        forward()
        _sync(device)
        out[f"{name}_first_s"] = time.perf_counter() - began
        out[f"{name}_forward_per_s"] = len(texts) / _best(forward, repeats, device)
    return out


def _ingest(model: str, docs: list[Any], device: str, copies: int) -> dict[str, Any]:
    """The product's whole ingest (chunk -> tokenise -> encode -> write, BM25, seal, verify,
    promote) of `copies` copies of the corpus (distinct ids) into a new Qdrant Edge store."""
    corpus = [
        dataclasses.replace(d, id=f"{d.id}_{k}") if k else d for k in range(copies) for d in docs
    ]
    encoder = Encoder.load(model, device=device)
    encoder.encode_passages([d.text[:500] for d in docs[:256]])  # warm-up, as a service's is
    with tempfile.TemporaryDirectory() as tmp:
        store = EdgeStore(Path(tmp) / "edge")
        began = time.perf_counter()
        report = ingest_documents(
            LoadedCorpus(tuple(corpus), 0, "scifact"), alias="bench", encoder=encoder, store=store
        )
        seconds = time.perf_counter() - began
        store.close()
    timings = report.timings_s
    wall = timings.get("pipeline") or seconds
    return {
        "documents": report.documents,
        "chunks": report.chunks,
        "seconds": seconds,
        "chunks_per_s": report.chunks / seconds,
        "pipeline_chunks_per_s": report.chunks / wall,
        "timings_s": timings,
        "busy_share": {
            stage: timings.get(stage, 0.0) / wall
            for stage in ("chunk", "tokenize", "encode", "write")
        },
    }


def _parity(model: str, data_dir: Path | None, device: str, small: bool) -> dict[str, Any]:
    """CPU fp32 against the device's default precision on SQuAD: chunk vectors' cosines, and
    for each dev question whether exact search over all chunks gives the same top 10."""
    docs = _docs(data_dir, "squad_v11_dev", 20 if small else None)
    counter, config = _counter_and_config(model)
    chunks = [c.embed_text for cs in chunk_documents(docs, counter, config) for c in cs]
    path = (
        data_dir / "squad_v11_dev" / "questions_dev.jsonl"
        if data_dir
        else shared_path("squad_v11_dev", "questions_dev.jsonl")
    )
    questions = [row["question"] for row in read_jsonl(path, 20 if small else PARITY_QUESTIONS)]
    top: dict[str, np.ndarray] = {}
    vectors: dict[str, np.ndarray] = {}
    for name, where in (("cpu", "cpu"), ("device", device)):
        encoder = Encoder.load(model, device=where, dtype="fp32" if name == "cpu" else "auto")
        vectors[name] = encoder.encode_passages(chunks).vectors
        scores = encoder.encode_queries(questions).vectors @ vectors[name].T
        top[name] = np.argsort(-scores, axis=1)[:, :10]
    same_sets = sum(set(a) == set(b) for a, b in zip(top["cpu"], top["device"], strict=True))
    same_order = int((top["cpu"] == top["device"]).all(axis=1).sum())
    cosines = np.sum(vectors["cpu"] * vectors["device"], axis=1)
    return {
        "chunks": len(chunks),
        "questions": len(questions),
        "min_cosine": float(cosines.min()),
        "same_top10_set": int(same_sets),
        "same_top10_order": same_order,
    }


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
    lines = [
        "",
        "## GPU: encoder, ingest, reranker, training step; chunking on the machine's cores",
    ]
    if "skipped" in r:
        return [*lines, *_chunking_lines(r["chunking"], r["cores"]), f"GPU skipped: {r['skipped']}"]
    lines.append(f"{r['device']} (torch {r['torch']}), {r['seconds']:.0f} s in all")
    for name, section in r.items():
        if isinstance(section, dict) and ("error" in section or "skipped" in section):
            lines.append(f"{name}: {section.get('error') or section.get('skipped')}")
    peak = r["peak"].get("bf16_matmul_tflops")
    if peak:
        lines.append(f"bf16 matrix product ({r['peak']['n']}^3): {peak:,.0f} TFLOP/s")
    if "ours_per_s" in r["encoder"]:
        lines += _encoder_lines(r["encoder"], peak)
    if "chunks_per_s" in r["ingest"]:
        lines += _ingest_lines(r["ingest"], r["encoder"])
    if "min_cosine" in r["parity"]:
        q = r["parity"]
        lines.append(
            f"parity, CPU fp32 vs {r['encoder'].get('ours_precision', 'device')} on SQuAD "
            f"({q['chunks']} chunks): min cosine {q['min_cosine']:.6f}; same top 10 for "
            f"{q['same_top10_set']} of {q['questions']} dev questions ({q['same_top10_order']} "
            "in the same order)"
        )
    if "pairs" in r["reranker"]:
        lines += _reranker_lines(r["reranker"])
    t = r["training"]
    if "precision" in t:
        lines.append(
            f"training step ({t['precision']}): embedder (32 questions + 64 passages) "
            f"{t['embedder_step_ms']:.1f} ms, reranker (32 pairs) {t['reranker_step_ms']:.1f} ms"
        )
    if "chunks" in r["chunking"]:
        lines += _chunking_lines(r["chunking"], r["cores"])
    c = r.get("compiled", {})
    if "compiled_forward_per_s" in c:
        lines.append(
            f"forward passes alone, torch.compile(dynamic=True) {c['compiled_forward_per_s']:,.0f}"
            f"/s vs eager {c['eager_forward_per_s']:,.0f}/s -> "
            f"{c['compiled_forward_per_s'] / c['eager_forward_per_s']:.2f}x (first pass "
            f"{c['compiled_first_s']:.0f} s, compiling)"
        )
    return lines


def _encoder_lines(e: dict[str, Any], peak: float | None) -> list[str]:
    lines = [
        f"encoder on {e['texts']} chunks: ours {e['ours_per_s']:,.0f}/s ({e['ours_precision']}, "
        f"batch {e['ours_batch']}) vs SentenceTransformer.encode {e['st_fp32_b32_per_s']:,.0f}/s "
        f"(fp32, batch 32) -> {e['ours_per_s'] / e['st_fp32_b32_per_s']:.2f}x"
    ]
    if "st_fp16_b256_per_s" in e:
        lines.append(
            f"  vs SentenceTransformer fp16 batch 256: {e['st_fp16_b256_per_s']:,.0f}/s -> "
            f"{e['ours_per_s'] / e['st_fp16_b256_per_s']:.2f}x"
        )
    sizes = ", ".join(f"{n}: {e[f'ours_batch_{n}_per_s']:,.0f}/s" for n in (128, 512))
    lines.append(
        f"  ours by batch size: {sizes}"
        + (f"; bf16 weights {e['ours_bf16_per_s']:,.0f}/s" if "ours_bf16_per_s" in e else "")
    )
    lines.append(
        f"  where the time goes: host tokenising alone {e['host_tokenize_per_s']:,.0f}/s, padding "
        f"and pinning alone {e['host_pad_per_s']:,.0f}/s, the device's forward passes alone "
        f"{e['device_forward_per_s']:,.0f}/s; tokenised beforehand (as the ingest's pipeline "
        f"gives them) {e['prepared_per_s']:,.0f}/s"
    )
    padded = e["tokens_padded"] / e["tokens_real"]
    tflops = e["flops_per_text"] * e["ours_per_s"] / 1e12
    forward = e["flops_per_text"] * e["device_forward_per_s"] / 1e12
    share = f" = {tflops / peak:.1%} of the measured bf16 peak" if peak else ""
    lines.append(
        f"  {e['flops_per_text'] / 1e9:.2f} GFLOP a chunk ({e['tokens_real'] / e['texts']:.0f} "
        f"tokens; padding adds {padded - 1:.1%}): {tflops:,.1f} TFLOP/s whole{share}; forward "
        f"passes alone {forward:,.1f} TFLOP/s" + (f" ({forward / peak:.1%})" if peak else "")
    )
    lines.append(f"  min cosine, CPU fp32 vs device vectors: {e['min_cosine_vs_cpu_fp32']:.6f}")
    return lines


def _ingest_lines(i: dict[str, Any], e: dict[str, Any]) -> list[str]:
    busy = ", ".join(f"{k} {v:.0%}" for k, v in i["busy_share"].items())
    lines = [
        f"whole ingest to Qdrant Edge, {i['documents']:,} docs, {i['chunks']:,} chunks: "
        f"{i['chunks_per_s']:,.0f} chunks/s end to end ({i['seconds']:.1f} s; the pipeline "
        f"alone {i['pipeline_chunks_per_s']:,.0f}/s); stages busy: {busy}",
        "  steps (s): " + ", ".join(f"{k} {v:.2f}" for k, v in i["timings_s"].items()),
    ]
    if "st_fp32_b32_per_s" in e:
        lines.append(
            f"  vs SentenceTransformer.encode alone (fp32, batch 32) "
            f"{e['st_fp32_b32_per_s']:,.0f}/s -> {i['chunks_per_s'] / e['st_fp32_b32_per_s']:.2f}x; "
            f"vs our encoder alone {e['ours_per_s']:,.0f}/s -> "
            f"{i['chunks_per_s'] / e['ours_per_s']:.2f}x"
        )
    return lines


def _reranker_lines(k: dict[str, Any]) -> list[str]:
    ours32, ours_all, peer = k["ours_b32"], k[f"ours_b{PAIRS}"], k["st_fp32_b32"]
    lines = [
        f"rerank {k['pairs']} pairs: ours p50 {ours_all['p50_ms']:.1f} ms / p95 "
        f"{ours_all['p95_ms']:.1f} ms (one batch, {k['ours_precision']}; in batches of 32: "
        f"{ours32['p50_ms']:.1f} / {ours32['p95_ms']:.1f}) vs CrossEncoder.predict p50 "
        f"{peer['p50_ms']:.1f} / p95 {peer['p95_ms']:.1f} (fp32, batch 32) -> "
        f"{peer['p50_ms'] / ours_all['p50_ms']:.2f}x"
    ]
    if "st_fp16_b32" in k:
        lines.append(
            f"  vs CrossEncoder fp16: p50 {k['st_fp16_b32']['p50_ms']:.1f} / p95 "
            f"{k['st_fp16_b32']['p95_ms']:.1f} ms"
        )
    lines.append(f"  max |logit| difference vs CPU fp32: {k['max_abs_logit_diff_vs_cpu_fp32']:.4f}")
    return lines


def _chunking_lines(c: dict[str, Any], n_cores: int) -> list[str]:
    lines = [
        f"chunking SciFact ({c['documents']} docs, {c['chunks']} chunks, {n_cores} cores), "
        "token counts by pieces (now) vs each text tokenised whole (before), same run:"
    ]
    for key in c:
        if key.startswith("after_workers_"):
            workers = key.removeprefix("after_workers_").removesuffix("_per_s")
            before = c[f"before_workers_{workers}_per_s"]
            lines.append(
                f"  {workers} process(es): {c[key]:,.0f} chunks/s vs {before:,.0f}/s before -> "
                f"{c[key] / before:.2f}x"
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
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip the sections that would start after this many seconds (default: 420)",
    )
    args = parser.parse_args(argv)
    if args.chunking_only:
        docs = _docs(args.data, "scifact", 300 if args.small else None)
        model = str(args.model or resolve_model("all-MiniLM-L6-v2").source)
        print(json.dumps(_chunking(model, docs)))
        return 0
    results = run(
        args.model,
        args.data,
        device=args.device,
        small=args.small,
        budget_s=args.budget_s,
        out_path=args.out,
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2), encoding="utf-8")
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
