"""Ingest speed: the whole SQuAD corpus end to end, a re-ingest after 1% of paragraphs changed,
encoder throughput against sentence-transformers on the same passages, and the whole SciFact
corpus end to end against sentence-transformers on 1,500 of its chunks.

Peers: `SentenceTransformer(<the same model dir>).encode` (fp32, its own batching) for the
encoder and for each whole ingest (chunks a second of an ingest, chunking, BM25, writing and
sealing included, against chunks a second of that peer encoding a sample of the same chunks,
in the same run); a full ingest of the same corpus for the re-ingest. Both encoders encode 64
chunks before any figure is timed (until 2026-12-07 the SQuAD ingest ran cold, the first pass
of the process, against a warmed peer).
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.bench_common import on_compute_thread, shared_path
from rag_retriever.ingest.chunking import Chunker
from rag_retriever.ingest.loaders import LoadedCorpus, load_documents
from rag_retriever.ingest.options import WriteOptions
from rag_retriever.ingest.writer import chunking_config_for, ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.store import EdgeStore

CHANGED_FRACTION = 0.01
N_PEER_CHUNKS = 1500  # the peer encodes a sample: all of SciFact at its speed is ~5 minutes


def change_paragraphs(
    corpus: LoadedCorpus, fraction: float, seed: int = 0
) -> tuple[LoadedCorpus, int]:
    """A copy of the corpus with `fraction` of all paragraphs edited (one sentence appended)."""
    rng = random.Random(seed)
    places = [
        (d, p) for d, doc in enumerate(corpus.documents) for p in range(len(doc.text.split("\n\n")))
    ]
    chosen = set(rng.sample(places, max(1, round(len(places) * fraction))))
    docs = []
    for d, doc in enumerate(corpus.documents):
        paragraphs = doc.text.split("\n\n")
        for p in range(len(paragraphs)):
            if (d, p) in chosen:
                paragraphs[p] += " This paragraph was revised for the benchmark."
        docs.append(replace(doc, text="\n\n".join(paragraphs)))
    return LoadedCorpus(tuple(docs), corpus.skipped_empty, corpus.source), len(chosen)


def run(n_encode: int = 1000) -> dict[str, Any]:
    corpus = load_documents(shared_path("squad_v11_dev", "docs.jsonl"))
    encoder = Encoder.load("all-MiniLM-L6-v2")
    out: dict[str, Any] = {"precision": encoder.precision.describe()}
    texts = _sample_texts(corpus, encoder, n_encode)
    # warmed as the peer is before its figure: the first pass of a process pays one-time costs
    # (oneDNN's kernels, the thread pools) that neither side's steady rate includes
    encoder.encode_passages(texts[:64])

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = EdgeStore(root / "edge")
        t0 = time.perf_counter()
        full = ingest_documents(corpus, alias="squad", encoder=encoder, store=store)
        full_s = time.perf_counter() - t0
        changed, n_changed = change_paragraphs(corpus, CHANGED_FRACTION)
        t0 = time.perf_counter()
        again = ingest_documents(changed, alias="squad", encoder=encoder, store=store)
        again_s = time.perf_counter() - t0
        store.close()
    out["ingest"] = {
        "documents": full.documents,
        "chunks": full.chunks,
        "seconds": full_s,
        "chunks_per_s": full.chunks / full_s,
        "stages_s": full.timings_s,
    }
    out["reingest"] = {
        "paragraphs_changed": n_changed,
        "reused": again.reused,
        "encoded": again.encoded,
        "removed": again.removed,
        "seconds": again_s,
        "full_seconds": full_s,
        "speedup": full_s / again_s,
        "stages_s": again.timings_s,
    }

    from sentence_transformers import SentenceTransformer

    # the peer's passes on the thread ours run on (on_compute_thread says why)
    peer = on_compute_thread(lambda: SentenceTransformer(str(encoder.source), device="cpu"))
    on_compute_thread(lambda: peer.encode(texts[:64]))  # warm-up, as ours above
    t0 = time.perf_counter()
    encoder.encode_passages(texts)
    ours_s = time.perf_counter() - t0
    peer_per_s = _peer_per_s(peer, texts)
    out["encoder"] = {
        "passages": len(texts),
        "ours_per_s": len(texts) / ours_s,
        "sentence_transformers_per_s": peer_per_s,
        "speedup": len(texts) / ours_s / peer_per_s,
        "ours_precision": encoder.precision.describe(),
    }
    out["ingest"]["speedup"] = out["ingest"]["chunks_per_s"] / peer_per_s
    out["scifact"] = _whole_ingest_vs_peer("scifact", encoder, peer)
    return out


def _sample_texts(corpus: LoadedCorpus, encoder: Encoder, n: int) -> list[str]:
    """`n` of the chunks an ingest with the default chunking cuts from `corpus`, as embedded."""
    options = WriteOptions()
    config = chunking_config_for(encoder, options.chunk_tokens, options.overlap_tokens)
    chunks = Chunker(encoder.count_tokens, config).chunk_all(corpus.documents)
    return [c.embed_text for c in random.Random(1).sample(chunks, min(n, len(chunks)))]


def _peer_per_s(peer: Any, texts: list[str]) -> float:
    t0 = time.perf_counter()
    on_compute_thread(lambda: peer.encode(texts, batch_size=32, normalize_embeddings=True))
    return len(texts) / (time.perf_counter() - t0)


def _whole_ingest_vs_peer(
    name: str, encoder: Encoder, peer: Any, n_peer: int = N_PEER_CHUNKS
) -> dict[str, Any]:
    """One corpus ingested whole into a fresh embedded store, against the peer on `n_peer` of
    the same chunks."""
    corpus = load_documents(shared_path(name, "docs.jsonl"))
    with tempfile.TemporaryDirectory() as tmp:
        store = EdgeStore(Path(tmp) / "edge")
        t0 = time.perf_counter()
        done = ingest_documents(corpus, alias=name, encoder=encoder, store=store)
        seconds = time.perf_counter() - t0
        store.close()
    sample = _sample_texts(corpus, encoder, n_peer)
    peer_per_s = _peer_per_s(peer, sample)
    per_s = done.chunks / seconds
    return {
        "documents": done.documents,
        "chunks": done.chunks,
        "seconds": seconds,
        "chunks_per_s": per_s,
        "sentence_transformers_per_s": peer_per_s,
        "peer_chunks": len(sample),
        "speedup": per_s / peer_per_s,
    }


def report(r: dict[str, Any]) -> list[str]:
    i, g, e, f = r["ingest"], r["reingest"], r["encoder"], r["scifact"]
    return [
        f"ingest SQuAD ({i['documents']} docs, {i['chunks']} chunks): {i['seconds']:.1f}s = {i['chunks_per_s']:.0f} chunks/s ({r['precision']}) "
        f"vs SentenceTransformer.encode {e['sentence_transformers_per_s']:.0f}/s on {e['passages']} of them -> "
        f"{i['speedup']:.2f}x",
        f"re-ingest after {g['paragraphs_changed']} paragraphs changed (1%): {g['seconds']:.1f}s vs full ingest "
        f"{g['full_seconds']:.1f}s -> {g['speedup']:.1f}x ({g['reused']} vectors reused, {g['encoded']} encoded, {g['removed']} removed)",
        f"encoder on {e['passages']} SQuAD chunks: ours {e['ours_per_s']:.0f}/s ({e['ours_precision']}) vs "
        f"SentenceTransformer.encode {e['sentence_transformers_per_s']:.0f}/s (fp32) -> {e['speedup']:.2f}x",
        f"ingest SciFact ({f['documents']} docs, {f['chunks']} chunks): {f['seconds']:.1f}s = {f['chunks_per_s']:.0f} chunks/s "
        f"vs SentenceTransformer.encode {f['sentence_transformers_per_s']:.0f}/s on {f['peer_chunks']} of them -> {f['speedup']:.2f}x",
    ]
