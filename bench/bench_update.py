"""Incremental versions: a delta against a full rebuild of the same corpus, in one run.

Part 1, the engine with pre-computed vectors (`run`): documents of 5 paragraphs of real SciFact
and SQuAD sentences, chunked by the real chunker (whitespace tokens), 384-d bag-of-words vectors
standing in for the encoder (the engine's cost does not depend on the model; texts that share
words are close, so HNSW recall means something). Through the
real writer (`ingest_documents`, `update_documents`) on Qdrant Edge, from the command to the alias
serving the new version:
- a full build of N chunks (the peer: what every change cost before incremental versions);
- a 10-document delta, and a 1% delta (half of the touched documents changed, a quarter new, a
  quarter deleted);
- then `--deltas` successive 1% deltas: hybrid p50 (dense + BM25 in one batched call, real query
  terms and their bag-of-words vectors) and dense recall@100 against an exact search, before and after,
  with the shards a version reads, its disk use and this process's RSS; with `--rebuild`, the
  same two figures for the corpus the deltas led to, built from scratch.

Part 2, end to end with real text and the real model (`run_e2e`): SQuAD dev + SciFact ingested
with all-MiniLM-L6-v2, then 1% of the documents changed (one sentence appended) through
`update_documents`: time to served, next to the full ingest, encoding included.

Part 3 (`run_delta_recall`): SQuAD dev and SciFact recall of a version made through the delta
path against a full build of the same documents, in one run.

Part 4 (`run_vocabulary`): the BM25 statistics step of a 10-document delta at vocabularies of
54k to 2M terms (a real corpus of a million chunks has millions; part 1's hardly grows): the
version's frequencies read, the delta applied, the new version's written, through Edge's table
and changes (rag_retriever/store/terms.py) against the peer, one JSON file of the whole
vocabulary read and written (how versions kept them before; the server store still does). Then
the last version opened for a query (its terms' IDF read term by term) against every term's IDF
computed at open, as versions were opened before.

Usage: python -m bench.bench_update [--sizes 100000] [--deltas 100] [--rebuild] [--cold-reopen]
[--server 100000] [--e2e] [--delta-recall] [--vocabulary 54000 500000 2000000]
[--server-vocabulary 54000 500000]   (`--sizes` with
no number skips part 1; `--cold-reopen` drops the page cache before a second reopen: root only)
python -m bench.bench_update --edit-constants rag_retriever/ops/capacity.json   (only the edit
figures `rag-retriever plan` reads, replaced in that file)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_common import percentile, read_jsonl, real_sentences, shared_path
from rag_retriever.ingest.compaction import wait_for_compactions
from rag_retriever.ingest.loaders import LoadedCorpus, load_documents
from rag_retriever.ingest.writer import WriteOptions, ingest_documents, update_documents
from rag_retriever.models.bm25 import Tokenizer
from rag_retriever.models.encoder import Encoded
from rag_retriever.models.profiles import Fingerprint
from rag_retriever.records import Document
from rag_retriever.store import DENSE, SPARSE, EdgeStore, StageQuery

DIM = 384
PARAGRAPHS_PER_DOC = 5
# Half SciFact, half SQuAD questions; all of them for recall (with 50, as before, recall moved by
# about +-0.005 from run to run, more than the +-0.002 the target allows).
N_QUERIES = 400


class RandomEncoder:
    """Pre-computed vectors: a text's vector is the normalised sum of a fixed random vector per
    word (a bag-of-words embedding: texts that share words are close, as in a real model, so an
    HNSW recall figure means something; independent random vectors would not), and whitespace
    tokens for the chunker. Everything but the model is the product's."""

    fingerprint = Fingerprint("bag-of-words", "0", "mean", "", "", DIM, 256)
    max_seq_length = 256
    special_tokens = 2

    def __init__(self) -> None:
        self._words: dict[str, np.ndarray] = {}

    def count_tokens(self, texts: Any) -> list[int]:
        return [len(t.split()) for t in texts]

    def vector(self, text: str) -> np.ndarray:
        total = np.zeros(DIM, dtype=np.float32)
        for word in text.lower().split():
            v = self._words.get(word)
            if v is None:
                v = self._words[word] = _word_vector(word)
            total += v
        norm = float(np.linalg.norm(total))
        return total / norm if norm else _word_vector(text)

    def encode_passages(self, passages: Any, *, progress: bool = False) -> Encoded:
        rows = [self.vector(p) for p in passages]
        vectors = np.stack(rows) if rows else np.empty((0, DIM), np.float32)
        return Encoded(vectors, 0, sum(self.count_tokens(passages)))


# Word vectors live near a 24-d subspace (plus a little noise), so texts' vectors have the low
# intrinsic dimension of real embeddings; fully random 384-d vectors, even summed over words,
# are nearly equidistant and no HNSW index finds their neighbours (recall@100 0.37-0.51).
_BASIS = np.random.default_rng(7).standard_normal((DIM, 24)).astype(np.float32)


def _word_vector(word: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    v = _BASIS @ rng.standard_normal(24).astype(np.float32)
    v += 0.1 * np.linalg.norm(v) / np.sqrt(DIM) * rng.standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class Corpus:
    """Synthetic documents of real sentences; `change` draws a 1%-style delta."""

    def __init__(self, n_chunks: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.sentences = real_sentences()
        self.next_id = 0
        self.docs = {
            d.id: d for d in (self.new_doc() for _ in range(n_chunks // PARAGRAPHS_PER_DOC))
        }

    def new_doc(self) -> Document:
        paragraphs = []
        for _ in range(PARAGRAPHS_PER_DOC):
            start = self.rng.randrange(len(self.sentences) - 6)
            paragraphs.append(" ".join(self.sentences[start : start + self.rng.randint(3, 6)]))
        self.next_id += 1
        return Document(f"doc{self.next_id}", f"Document {self.next_id}", "\n\n".join(paragraphs))

    def build(self, store: Any, encoder: Any, opts: WriteOptions) -> Any:
        """A full build of the documents as they are now, as alias "bench" (its report)."""
        return ingest_documents(
            LoadedCorpus(tuple(self.docs.values()), 0, "bench"),
            alias="bench",
            encoder=encoder,
            store=store,
            full=True,
            options=opts,
        )

    def edit(self, n_docs: int, store: Any, encoder: Any, opts: WriteOptions) -> tuple[float, Any]:
        """`change(n_docs)` written as an update of "bench": (seconds, its report)."""
        upserts, deleted = self.change(n_docs)
        t0 = time.perf_counter()
        report = update_documents(
            upserts, deleted, alias="bench", encoder=encoder, store=store, options=opts
        )
        return time.perf_counter() - t0, report

    def change(self, n_docs: int) -> tuple[list[Document], list[str]]:
        """n_docs touched: half edited, a quarter new, a quarter deleted; applied to self.docs."""
        ids = self.rng.sample(sorted(self.docs), n_docs - n_docs // 4)
        edited = [replace(self.docs[i], text=self.new_doc().text) for i in ids[: n_docs // 2]]
        deleted = ids[n_docs // 2 :]
        upserts = edited + [self.new_doc() for _ in range(n_docs // 4)]
        for d in upserts:
            self.docs[d.id] = d
        for i in deleted:
            del self.docs[i]
        return upserts, deleted


def _queries() -> list[list[str]]:
    tok = Tokenizer()
    rows = read_jsonl(shared_path("scifact", "questions_train.jsonl"), N_QUERIES // 2)
    rows += read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), N_QUERIES // 2)
    return [tok.tokenize(r["question"]) for r in rows]


def _hybrid_p50(stores: list[EdgeStore], queries: list[list[str]]) -> list[float]:
    """Hybrid p50 (one batched dense + BM25 call) of each store's served version, the queries
    interleaved across the stores so that the machine's load falls on all of them alike."""
    from rag_retriever.models.bm25 import BM25Model

    encoder = RandomEncoder()
    vectors = np.stack([encoder.vector(" ".join(terms)) for terms in queries])
    names = [store.resolve("bench") for store in stores]
    models = [
        BM25Model(store.record(name).bm25, store.doc_freqs(name))
        for store, name in zip(stores, names, strict=True)
    ]
    times: list[list[float]] = [[] for _ in stores]
    for terms, v in zip(queries, vectors, strict=True):
        for store, name, model, spent in zip(stores, names, models, times, strict=True):
            t0 = time.perf_counter()
            store.search(
                name,
                [StageQuery(DENSE, v, 100), StageQuery(SPARSE, model.query_vector(terms), 100)],
            )
            spent.append((time.perf_counter() - t0) * 1000)
    return [percentile(spent[5:], 50) for spent in times]


def reopen_probe(root: Path) -> dict[str, float]:
    """Run in a fresh process (what a new serving replica pays): open the store, follow the
    alias, read the version record and BM25 document frequencies, answer one hybrid query.
    Seconds to that first answer, and the process's memory (bench_engine's reading)."""
    from bench.bench_engine import _memory
    from rag_retriever.models.bm25 import BM25Model

    terms = _queries()[0]
    t0 = time.perf_counter()
    store = EdgeStore(root)
    name = store.resolve("bench")
    model = BM25Model(store.record(name).bm25, store.doc_freqs(name))
    vector = RandomEncoder().vector(" ".join(terms))
    store.search(
        name, [StageQuery(DENSE, vector, 10), StageQuery(SPARSE, model.query_vector(terms), 10)]
    )
    out = {"reopen_s": time.perf_counter() - t0, "shards": len(store.manifest(name).segments)}
    out.update(_memory())
    store.close()
    return out


def _reopen_in_subprocess(root: Path) -> dict[str, Any]:
    code = (
        "import json, sys; from pathlib import Path; from bench.bench_update import reopen_probe; "
        "print(json.dumps(reopen_probe(Path(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _cold_reopen(root: Path) -> dict[str, Any]:
    """The reopen with nothing of the shards in the page cache (a replica started on a machine
    that never read them): the kernel's caches dropped first, which needs root."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return {"skipped": f"the page cache could not be dropped ({exc}); run as root"}
    return _reopen_in_subprocess(root)


def _latency_and_recall(store: EdgeStore, queries: list[list[str]]) -> dict[str, float]:
    """Hybrid p50 (one batched dense + BM25 call) and dense recall@100 against exact search."""
    name = store.resolve("bench")
    vectors = np.stack([RandomEncoder().vector(" ".join(terms)) for terms in queries])
    (p50,) = _hybrid_p50([store], queries)
    ids = [r.id for r in store.scroll(name)]
    matrix = np.empty((len(ids), DIM), dtype=np.float32)
    for at in range(0, len(ids), 2048):
        part = {r.id: r.dense for r in store.retrieve(name, ids[at : at + 2048], with_dense=True)}
        for j, pid in enumerate(ids[at : at + 2048]):
            matrix[at + j] = part[pid]
    recall = []
    for v in vectors:
        exact = {ids[i] for i in np.argpartition(-(matrix @ v), 100)[:100]}
        found = {pid for pid, _ in store.search(name, [StageQuery(DENSE, v, 100)])[0]}
        recall.append(len(found & exact) / 100)
    return {
        "hybrid_p50_ms": p50,
        "dense_recall_at_100": float(np.mean(recall)),
        "shards": len(store.manifest(name).segments),
        "points": len(ids),
    }


def run(
    sizes: tuple[int, ...] = (100_000,),
    deltas: int = 100,
    *,
    rebuild: bool = False,
    compaction: str = "background",
    cold_reopen: bool = False,
) -> dict[str, Any]:
    queries = _queries()
    return {str(n): _run_size(n, deltas, queries, rebuild, compaction, cold_reopen) for n in sizes}


def _run_size(
    n: int,
    deltas: int,
    queries: list[list[str]],
    rebuild: bool,
    compaction: str,
    cold_reopen: bool = False,
) -> dict[str, Any]:
    corpus = Corpus(n)
    encoder = RandomEncoder()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = EdgeStore(root / "edge")
        # deltas only (no re-base), versions deleted as soon as they stop serving; the base
        # merge in a background thread (as the HTTP service does) or inside the update
        opts = WriteOptions(
            lock_dir=root,
            retention_grace_s=0,
            keep_versions=2,
            rebase_drift=1.0,
            compaction=compaction,  # type: ignore[arg-type]
            lock_wait_s=600,  # an update waits while a compaction holds the lock a moment
        )

        def apply(n_docs: int) -> tuple[float, Any]:
            return corpus.edit(n_docs, store, encoder, opts)

        t0 = time.perf_counter()
        full = corpus.build(store, encoder, opts)
        row: dict[str, Any] = {
            "chunks": full.chunks,
            "full_s": time.perf_counter() - t0,
            "full_stages_s": full.timings_s,
        }
        row["fresh"] = _latency_and_recall(store, queries)
        row["reopen"] = _reopen_in_subprocess(root / "edge")
        one_pct = max(4, len(corpus.docs) // 100)
        for label, n_docs in (("delta_10_docs", 10), ("delta_1pct", one_pct)):
            seconds, report = apply(n_docs)
            row[label] = {
                "docs": n_docs,
                "s": seconds,
                "kind": report.kind,
                "stages_s": report.timings_s,
            }
        many = [apply(one_pct) for _ in range(deltas)]
        if deltas:
            waited = time.perf_counter()
            wait_for_compactions()
            slowest = max(range(len(many)), key=lambda i: many[i][0])
            versions = [store.record(i.name) for i in store.versions("bench")]
            row["after_deltas"] = {
                "deltas": deltas,
                "compaction": compaction,
                "delta_s_p50": percentile([s for s, _ in many], 50),
                "delta_s_max": max(s for s, _ in many),
                "delta_s_p90": percentile([s for s, _ in many], 90),
                # where the slowest delta's time went (a lock wait shows as the gap to the stages)
                "slowest_delta": {
                    "at": slowest,
                    "s": many[slowest][0],
                    "stages_s": many[slowest][1].timings_s,
                },
                "compactions_started": sum(r.compaction == "started" for _, r in many),
                "waited_for_compaction_s": time.perf_counter() - waited,
                "served_compacted": bool(store.record(store.resolve("bench")).lineage.compacted),
                "kept_versions": len(versions),
                **_latency_and_recall(store, queries),
            }
        row["disk_mb"] = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20
        row["rss_mb"] = _rss_mb()
        if cold_reopen:  # last of this store's figures: the dropped cache slows what follows
            row["reopen_cold"] = _cold_reopen(root / "edge")
        if deltas and rebuild:
            # the same corpus built from scratch: after 100 deltas ~63% of the documents differ
            # from the first build's, which moves recall by itself
            again = EdgeStore(root / "rebuilt")
            corpus.build(again, encoder, opts)
            row["rebuilt"] = _latency_and_recall(again, queries)
            # side by side: the version the deltas led to and the rebuilt corpus, interleaved
            after, fresh = _hybrid_p50([store, again], queries + queries)
            row["side_by_side"] = {"after_deltas_ms": after, "rebuilt_ms": fresh}
            again.close()
        store.close()
    return row


def run_server(n: int = 100_000, repeats: int = 3) -> dict[str, Any]:
    """The server code path on qdrant-client's in-process implementation of the server API: a
    10-document edit (versions as filters over one physical collection, store/server.py) against
    the peer, what an edit cost before: a new collection receiving a copy of every point of the
    live version through the client (`copy_version`), measured side by side on the same store.
    Each edit's points written are counted by a spy on the client."""
    from qdrant_client import QdrantClient

    from rag_retriever.store import ServerStore

    corpus = Corpus(n, seed=1)
    encoder = RandomEncoder()
    store = ServerStore(QdrantClient(":memory:"))
    written = _count_writes(store.client)
    with tempfile.TemporaryDirectory() as tmp:
        opts = WriteOptions(lock_dir=Path(tmp), retention_grace_s=0, rebase_drift=1.0)
        t0 = time.perf_counter()
        full = corpus.build(store, encoder, opts)
        full_s = time.perf_counter() - t0
        edits: list[dict[str, Any]] = []
        copies: list[dict[str, Any]] = []
        for _ in range(repeats):  # interleaved: an edit, then the peer's copy
            written["points"] = 0
            seconds, report = corpus.edit(10, store, encoder, opts)
            edits.append(
                {
                    "s": seconds,
                    "chunks": report.encoded,
                    "points_written": written["points"],
                }
            )
            written["points"] = 0
            t0 = time.perf_counter()
            copy_version(store, report.collection, "bench_copy")
            copies.append({"s": time.perf_counter() - t0, "points_written": written["points"]})
            store.client.delete_collection("bench_copy")
    store.close()
    edit_s = statistics.median(e["s"] for e in edits)
    copy_s = statistics.median(c["s"] for c in copies)
    return {
        "chunks": full.chunks,
        "full_s": full_s,
        "edits": edits,
        "copies": copies,
        "edit_s": edit_s,
        "copy_s": copy_s,
        "ratio": edit_s / copy_s,
    }


def edit_constants(n: int = 20_000, repeats: int = 3) -> dict[str, Any]:
    """What `rag-retriever plan` needs of an edit: the median seconds of a 10-document delta on
    Edge (from the command to the alias serving it; a delta's cost follows the change, not the
    corpus, so a small corpus stands for a large one), and the points the server path writes per
    changed chunk (`run_server`)."""
    corpus = Corpus(n, seed=2)
    encoder = RandomEncoder()
    with tempfile.TemporaryDirectory() as tmp:
        store = EdgeStore(Path(tmp) / "edge")
        opts = WriteOptions(lock_dir=Path(tmp), retention_grace_s=0, rebase_drift=1.0)
        corpus.build(store, encoder, opts)
        seconds = [corpus.edit(10, store, encoder, opts)[0] for _ in range(repeats)]
        store.close()
    server = run_server(n // 4, repeats=repeats)
    written = sum(e["points_written"] for e in server["edits"])
    changed = sum(e["chunks"] for e in server["edits"])
    return {
        "edge_edit_s": statistics.median(seconds),
        "server_points_per_changed_chunk": written / changed,
        "measured_at_chunks": n,
    }


def copy_version(store: Any, name: str, target: str, batch: int = 512) -> None:
    """The peer: what a server-path delta did before (rag-retriever 0.3's `derive`), a new
    collection filled with every point of the base collection, vectors and payloads, read with
    `scroll` and written with `upsert` through the client in batches of 512, with no filter
    (0.3 kept one collection a version). Here the base is the physical collection of `name`
    (its points, and the few an edit marked removed); the delta's own points would come after
    and are left out."""
    from qdrant_client import models as qm

    store.client.create_collection(
        target,
        vectors_config={"dense": qm.VectorParams(size=DIM, distance=qm.Distance.COSINE)},
        sparse_vectors_config={"bm25": qm.SparseVectorParams()},
    )
    physical = store._entry(name).physical  # where the version's points are
    offset: Any = None
    while True:
        points, offset = store.client.scroll(
            physical, limit=batch, offset=offset, with_payload=True, with_vectors=True
        )
        store.client.upsert(
            target,
            points=[qm.PointStruct(id=p.id, vector=p.vector, payload=p.payload) for p in points],
            wait=True,
        )
        if offset is None:
            return


def _count_writes(client: Any) -> dict[str, int]:
    """A spy on the client's point writes: {"points": points upserted, or their payload set,
    outside the catalog}; set it to 0 between the things measured."""
    from rag_retriever.store.server import CATALOG

    written = {"points": 0}
    for method in ("upsert", "set_payload"):
        real = getattr(client, method)

        def spy(collection: str, *args: Any, _real: Any = real, **kw: Any) -> Any:
            if collection != CATALOG:
                written["points"] += len(kw["points"])
            return _real(collection, *args, **kw)

        setattr(client, method, spy)
    return written


def run_e2e() -> dict[str, Any]:
    """SQuAD dev + SciFact with the real model: a full ingest, then a 1% change of documents."""
    from rag_retriever.models.encoder import Encoder

    docs: list[Document] = []
    for name in ("squad_v11_dev", "scifact"):
        docs.extend(load_documents(shared_path(name, "docs.jsonl")).documents)
    encoder = Encoder.load("all-MiniLM-L6-v2")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = EdgeStore(Path(tmp) / "edge")
        opts = WriteOptions(lock_dir=Path(tmp))
        t0 = time.perf_counter()
        full = ingest_documents(
            LoadedCorpus(tuple(docs), 0, "e2e"),
            alias="e2e",
            encoder=encoder,
            store=store,
            full=True,
            options=opts,
        )
        full_s = time.perf_counter() - t0
        changed = [
            replace(d, text=d.text + " This document was revised for the benchmark.")
            for d in rng.sample(docs, max(1, len(docs) // 100))
        ]
        t0 = time.perf_counter()
        delta = update_documents(
            changed, [], alias="e2e", encoder=encoder, store=store, options=opts
        )
        delta_s = time.perf_counter() - t0
        store.close()
    return {
        "documents": len(docs),
        "chunks": full.chunks,
        "full_s": full_s,
        "changed_documents": len(changed),
        "delta_s": delta_s,
        "delta_kind": delta.kind,
        "full_reason": delta.full_reason,
        "encoded": delta.encoded,
        "speedup": full_s / delta_s,
        "delta_stages_s": delta.timings_s,
    }


# (set, questions file, level) for the recall-through-the-delta-path run
RECALL_SETS = (
    ("squad_v11_dev", "questions_dev.jsonl", "chunk"),
    ("scifact", "questions_train.jsonl", "doc"),
)
RECALL_METRICS = ("recall@1", "recall@5", "recall@10", "recall@100", "mrr@10", "ndcg@10")


def run_delta_recall(sets: tuple[tuple[str, str, str], ...] = RECALL_SETS) -> dict[str, Any]:
    """Recall of a version made through the delta path against a full build of the same corpus,
    in one run: the first version lacks 1% of the documents (at least 2) and has another 1%
    changed (a sentence appended); `ingest` of the real corpus then takes the delta path (those
    documents added back and restored). Both versions are scored with the README's eval on the
    set's labelled questions (real model, default settings)."""
    from rag_retriever.eval.evaluation import evaluate
    from rag_retriever.eval.questions import load_questions
    from rag_retriever.models.encoder import Encoder
    from rag_retriever.query.retriever import RetrievalConfig, Retriever

    encoder = Encoder.load("all-MiniLM-L6-v2")
    out: dict[str, Any] = {}
    for data, questions_file, level in sets:
        corpus = load_documents(shared_path(data, "docs.jsonl"))
        docs = corpus.documents
        questions, _ = load_questions(shared_path(data, questions_file))
        n = max(2, len(docs) // 100)
        picked = random.Random(7).sample(range(len(docs)), 2 * n)
        dropped, altered = set(picked[:n]), set(picked[n:])
        first = [
            replace(d, text=d.text + "\n\nA sentence appended before the update.")
            if i in altered
            else d
            for i, d in enumerate(docs)
            if i not in dropped
        ]
        row: dict[str, Any] = {"documents": len(docs), "dropped": n, "altered": n}
        with tempfile.TemporaryDirectory() as tmp:
            for way in ("delta", "full"):
                store = EdgeStore(Path(tmp) / way / "edge")
                opts = WriteOptions(lock_dir=Path(tmp) / way)
                if way == "delta":
                    ingest_documents(
                        LoadedCorpus(tuple(first), 0, data),
                        alias="kb",
                        encoder=encoder,
                        store=store,
                        full=True,
                        options=opts,
                    )
                report = ingest_documents(
                    corpus,
                    alias="kb",
                    encoder=encoder,
                    store=store,
                    full=way == "full",
                    options=opts,
                )
                retriever = Retriever(
                    encoder=encoder, store=store, config=RetrievalConfig(), collection="kb"
                )
                run = evaluate(retriever, questions, collection="kb", level=level)  # type: ignore[arg-type]
                row[way] = {
                    "kind": report.kind,
                    "encoded": report.encoded,
                    "modes": {
                        mode: {m: run.summary["modes"][mode][m] for m in RECALL_METRICS}
                        for mode in ("dense", "bm25", "hybrid")
                    },
                }
                store.close()
        out[data] = row
    return out


def _vocabulary(rng: random.Random, n: int, rounds: int) -> tuple[list[str], list[list[str]], Any]:
    """`n` made-up words, the documents the deltas of `rounds` add and remove (60 of those
    words each), and the BM25 model of the words (50 a document) and those documents."""
    from rag_retriever.models.bm25 import BM25Model

    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(4, 12))) + str(i) for i in range(n)]
    docs = [[rng.choice(words) for _ in range(60)] for _ in range(20 + 10 * rounds)]
    model = BM25Model.build([words[i : i + 50] for i in range(0, n, 50)] + docs)
    return words, docs, model


def run_vocabulary(
    sizes: tuple[int, ...] = (54_000, 500_000, 2_000_000), rounds: int = 5
) -> dict[str, Any]:
    """Part 4: seconds of a 10-document delta's BM25 statistics step (read, apply, write) at
    each vocabulary size, the table and changes against one JSON file, in one run."""
    from rag_retriever.models.bm25 import BM25Model
    from rag_retriever.store.terms import read_doc_freqs, write_doc_freqs

    rng = random.Random(0)
    out: dict[str, Any] = {}
    for n in sizes:
        words, docs, model = _vocabulary(rng, n, rounds)

        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            t0 = time.perf_counter()
            (root / "v0").mkdir()
            write_doc_freqs(root / "v0", model.doc_freqs)
            table_write = time.perf_counter() - t0
            whole = root / "whole.json"
            whole.write_text(json.dumps(dict(model.doc_freqs.items())))
            ours, peer = [], []
            current = model
            for k in range(rounds):
                # 10 documents added (and 30 terms new to the vocabulary), 10 removed at first
                added = [*docs[20 + 10 * k : 30 + 10 * k], [f"new{k}x{i}" for i in range(30)]]
                removed = docs[10 * k : 10 * k + 10] if k < 2 else []
                t0 = time.perf_counter()
                read = BM25Model(current.stats, read_doc_freqs(root / f"v{k}"))
                new = read.with_delta(added=added, removed=removed)
                (root / f"v{k + 1}").mkdir()
                write_doc_freqs(root / f"v{k + 1}", new.doc_freqs)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                loaded = BM25Model(current.stats, json.loads(whole.read_text()))
                again = loaded.with_delta(added=added, removed=removed)
                whole.write_text(json.dumps(dict(again.doc_freqs.items())))
                peer.append(time.perf_counter() - t0)
                assert dict(new.doc_freqs.items()) == dict(again.doc_freqs.items())
                current = new
            # A serving process opens the last version and embeds a query: its terms' IDF read
            # term by term, against every term's IDF computed first (how a version was opened
            # before); the same query vector both ways.
            query = [rng.choice(words) for _ in range(6)] + [added[0][0], "new0x1"]
            lazy, whole_idf = [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                opened = BM25Model(current.stats, read_doc_freqs(root / f"v{rounds}"))
                vector = opened.query_vector(query)
                lazy.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                eager = BM25Model(current.stats, read_doc_freqs(root / f"v{rounds}"))
                idf = eager.idf
                weights = {eager.index_of(t): 0.0 for t in query if t in idf}
                for t in query:
                    if t in idf:
                        weights[eager.index_of(t)] += idf[t]
                whole_idf.append(time.perf_counter() - t0)
                got = dict(zip(vector.indices, vector.values, strict=True))
                assert got.keys() == weights.keys()
                assert np.allclose([got[i] for i in weights], list(weights.values()), rtol=1e-12)
        out[str(n)] = {
            "terms": n,
            "table_write_s": table_write,
            "delta_s_median": float(np.median(ours)),
            "delta_s_max": max(ours),
            "peer_s_median": float(np.median(peer)),
            "open_query_s_median": float(np.median(lazy)),
            "open_every_idf_s_median": float(np.median(whole_idf)),
        }
    return out


def run_server_vocabulary(
    sizes: tuple[int, ...] = (54_000, 500_000), rounds: int = 5
) -> dict[str, Any]:
    """Part 4 on the server path (qdrant-client's in-process implementation of the server
    API): a 10-document delta's BM25 statistics step (the parent's frequencies read, the delta
    applied, the new version's written) through ServerStore, a table and changes (0.5) against
    the peer, the same store with the physical collection marked as made before tables (0.4:
    the whole vocabulary in each version's catalog entry), in one run."""
    from qdrant_client import QdrantClient

    from rag_retriever.models.bm25 import BM25Model
    from rag_retriever.store import ServerStore
    from rag_retriever.store.record import bare_record

    rng = random.Random(0)
    out: dict[str, Any] = {}
    for n in sizes:
        _, docs, model = _vocabulary(rng, n, rounds)
        seconds: dict[str, list[float]] = {"tables": [], "whole": []}
        finals = {}
        for arm, alias in (("tables", "ours"), ("whole", "peer")):
            store = ServerStore(QdrantClient(":memory:"))
            first = f"{alias}__random-{DIM}__v1"
            store.create(first, DIM, bare_record(first, dim=DIM, bm25=model.stats))
            if arm == "whole":  # as 0.4 made it: every version keeps the whole vocabulary
                store._catalog_set(first, {"located": False})
                store._entries.clear()
            store.put_doc_freqs(first, model.doc_freqs)
            current, name = model, first
            for k in range(rounds):
                added = [*docs[20 + 10 * k : 30 + 10 * k], [f"new{k}x{i}" for i in range(30)]]
                removed = docs[10 * k : 10 * k + 10] if k < 2 else []
                child = f"{alias}__random-{DIM}__v{k + 2}"
                store.derive(child, name, bare_record(child, dim=DIM, bm25=model.stats), [])
                t0 = time.perf_counter()
                new = BM25Model(current.stats, store.doc_freqs(name)).with_delta(
                    added=added, removed=removed
                )
                store.put_doc_freqs(child, new.doc_freqs)
                seconds[arm].append(time.perf_counter() - t0)
                current, name = new, child
            finals[arm] = dict(store.doc_freqs(name).items())
            store.close()
        assert finals["tables"] == finals["whole"]
        out[str(n)] = {
            "terms": n,
            "delta_s_median": float(np.median(seconds["tables"])),
            "peer_s_median": float(np.median(seconds["whole"])),
        }
    return out


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def report(
    results: dict[str, Any],
    e2e: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    delta_recall: dict[str, Any] | None = None,
    vocabulary: dict[str, Any] | None = None,
    server_vocabulary: dict[str, Any] | None = None,
) -> list[str]:
    lines = []
    for n, r in results.items():
        lines.append(
            f"incremental versions at {int(n):,} chunks (Qdrant Edge, pre-computed vectors):"
        )
        lines.append(f"  full rebuild (the peer)        {r['full_s']:8.1f} s")
        for key in ("delta_10_docs", "delta_1pct"):
            d = r[key]
            lines.append(
                f"  {key:<30} {d['s']:8.2f} s  ({d['docs']} documents, {d['kind']}) -> "
                f"{r['full_s'] / d['s']:.0f}x faster than the full rebuild"
            )
            stages = ", ".join(f"{k} {v:.2f}" for k, v in d.get("stages_s", {}).items())
            lines.append(f"    stages (s): {stages}")
        fresh, after = r["fresh"], r.get("after_deltas")
        lines.append(
            f"  fresh: hybrid p50 {fresh['hybrid_p50_ms']:.2f} ms, dense recall@100 vs exact "
            f"{fresh['dense_recall_at_100']:.4f}, {fresh['shards']} shard(s)"
        )
        if after:
            lines.append(
                f"  compaction {after.get('compaction', 'inline')}: "
                f"{after.get('compactions_started', 0)} started during the deltas; waited "
                f"{after.get('waited_for_compaction_s', 0.0):.1f} s for the last after them; "
                f"served version compacted: {after.get('served_compacted')}"
            )
            lines.append(
                f"  after {after['deltas']} successive 1% deltas (p50 {after['delta_s_p50']:.2f} s, "
                f"max {after['delta_s_max']:.1f} s each): hybrid p50 {after['hybrid_p50_ms']:.2f} ms "
                f"({after['hybrid_p50_ms'] / fresh['hybrid_p50_ms']:.2f}x fresh), dense recall@100 "
                f"{after['dense_recall_at_100']:.4f} ({after['dense_recall_at_100'] - fresh['dense_recall_at_100']:+.4f}), "
                f"{after['shards']} shard(s)"
            )
            slow = after.get("slowest_delta")
            if slow:
                stages = ", ".join(f"{k} {v:.2f}" for k, v in slow["stages_s"].items())
                lines.append(
                    f"    p90 {after.get('delta_s_p90', 0.0):.2f} s; the slowest (delta "
                    f"#{slow['at'] + 1}, {slow['s']:.1f} s), stages (s): {stages}"
                )
        again = r.get("rebuilt")
        if after and again:
            lines.append(
                f"  the same corpus rebuilt from scratch: hybrid p50 {again['hybrid_p50_ms']:.2f} ms "
                f"(after the deltas: {after['hybrid_p50_ms'] / again['hybrid_p50_ms']:.2f}x), dense "
                f"recall@100 {again['dense_recall_at_100']:.4f} (after the deltas: "
                f"{after['dense_recall_at_100'] - again['dense_recall_at_100']:+.4f})"
            )
        side = r.get("side_by_side")
        if side:
            lines.append(
                f"  side by side (queries interleaved): hybrid p50 after the deltas "
                f"{side['after_deltas_ms']:.2f} ms vs rebuilt {side['rebuilt_ms']:.2f} ms -> "
                f"{side['after_deltas_ms'] / side['rebuilt_ms']:.2f}x"
            )
        for key, label in (
            ("reopen", ""),
            ("reopen_cold", " after the deltas, page cache dropped first"),
        ):
            reopen = r.get(key)
            if reopen and "skipped" in reopen:
                lines.append(f"  reopen{label}: not measured: {reopen['skipped']}")
            elif reopen:
                lines.append(
                    f"  reopen in a fresh process{label} (open, alias, record, BM25 statistics, "
                    f"one hybrid query): {reopen['reopen_s']:.2f} s, peak RSS "
                    f"{reopen['rss_mb']:,.0f} MB ({reopen.get('rss_anon_mb', 0):,.0f} MB private, "
                    f"{reopen.get('rss_file_mb', 0):,.0f} MB mapped shard files)"
                )
        lines.append(
            f"  disk {r['disk_mb']:,.0f} MB (two kept versions), RSS {r['rss_mb']:,.0f} MB"
        )
    if server:
        edits, copies = server["edits"], server["copies"]
        lines.append(
            f"server code path (qdrant-client in-process, {server['chunks']:,} chunks, full build "
            f"{server['full_s']:.1f} s): a 10-document edit {server['edit_s']:.2f} s median "
            f"({', '.join(str(e['points_written']) for e in edits)} points written for "
            f"{', '.join(str(e['chunks']) for e in edits)} chunks) vs peer, a copy of the "
            f"version's points as deltas were made before, {server['copy_s']:.2f} s "
            f"({copies[0]['points_written']:,} points written) -> {server['ratio']:.4f}x"
        )
    for data, row in (delta_recall or {}).items():
        delta, full = row["delta"], row["full"]
        lines.append(
            f"recall through the delta path, {data} ({row['documents']:,} documents; the first "
            f"version without {row['dropped']} and with {row['altered']} changed, then the "
            f"whole set ingested: {delta['kind']}, {delta['encoded']} chunks encoded), against "
            "a full build of the same documents:"
        )
        for mode, figures in delta["modes"].items():
            cells = ", ".join(
                f"{m} {v:.4f} ({v - full['modes'][mode][m]:+.4f})" for m, v in figures.items()
            )
            lines.append(f"  {mode:<7} {cells}")
    for row in (vocabulary or {}).values():
        lines.append(
            f"BM25 statistics of a 10-document delta, {row['terms']:,} terms: table + changes "
            f"{row['delta_s_median'] * 1000:.0f} ms (median; max {row['delta_s_max'] * 1000:.0f}) "
            f"vs one JSON of the vocabulary {row['peer_s_median']:.2f} s -> "
            f"{row['peer_s_median'] / row['delta_s_median']:.0f}x; the full build's table "
            f"written in {row['table_write_s']:.1f} s; opening its last version for a query "
            f"{row['open_query_s_median'] * 1000:.1f} ms vs every term's IDF computed at open "
            f"{row['open_every_idf_s_median']:.2f} s -> "
            f"{row['open_every_idf_s_median'] / row['open_query_s_median']:.0f}x"
        )
    for row in (server_vocabulary or {}).values():
        lines.append(
            f"server path (qdrant-client in-process), BM25 statistics of a 10-document delta, "
            f"{row['terms']:,} terms: table + changes {row['delta_s_median'] * 1000:.0f} ms "
            f"(median) vs the whole vocabulary in each version's catalog entry (0.4) "
            f"{row['peer_s_median']:.2f} s -> {row['peer_s_median'] / row['delta_s_median']:.0f}x"
        )
    if e2e:
        lines.append(
            f"end to end, SQuAD dev + SciFact ({e2e['documents']:,} documents, {e2e['chunks']:,} "
            f"chunks, all-MiniLM-L6-v2): full ingest {e2e['full_s']:.1f} s; "
            f"{e2e['changed_documents']} documents changed ({e2e['encoded']} chunks encoded) "
            f"served in {e2e['delta_s']:.2f} s ({e2e['delta_kind']}) -> {e2e['speedup']:.0f}x faster"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="*", default=[100_000])
    parser.add_argument("--deltas", type=int, default=100)
    parser.add_argument("--e2e", action="store_true", help="also the real-text, real-model run")
    parser.add_argument("--server", type=int, default=0, help="also the server path at N chunks")
    parser.add_argument(
        "--delta-recall",
        action="store_true",
        help="also SQuAD dev and SciFact recall through the delta path vs a full build (real model)",
    )
    parser.add_argument(
        "--vocabulary",
        type=int,
        nargs="*",
        help="also the BM25 statistics step of a delta at these vocabulary sizes",
    )
    parser.add_argument(
        "--server-vocabulary",
        type=int,
        nargs="*",
        help="also the BM25 statistics step of a server-path delta at these vocabulary sizes",
    )
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="after the deltas, also build the same corpus from scratch (its p50 and recall)",
    )
    parser.add_argument(
        "--compaction",
        choices=["background", "inline"],
        default="background",
        help="merge outgrown deltas in a background thread (the service's way) or in the update",
    )
    parser.add_argument(
        "--cold-reopen",
        action="store_true",
        help="also reopen with the page cache dropped first (needs root)",
    )
    parser.add_argument(
        "--edit-constants",
        type=Path,
        metavar="FILE",
        help="only measure what `rag-retriever plan` needs of an edit (`edit_constants`) and "
        'replace the "edits" entry of this constants file (bench_engine --constants-out)',
    )
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.server_vocabulary or ()):
        parser.error(f"--server-vocabulary sizes must be at least 1, got {args.server_vocabulary}")
    if args.edit_constants:
        try:
            made = json.loads(args.edit_constants.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--edit-constants {args.edit_constants}: not a constants file ({exc})")
        if not isinstance(made, dict):
            parser.error(f"--edit-constants {args.edit_constants}: not a constants file")
        made["edits"] = edit_constants()
        args.edit_constants.write_text(json.dumps(made, indent=1) + "\n")
        print(f"edits: {made['edits']} -> {args.edit_constants}", flush=True)
        return 0
    results = run(
        tuple(args.sizes),
        args.deltas,
        rebuild=args.rebuild,
        compaction=args.compaction,
        cold_reopen=args.cold_reopen,
    )
    server = run_server(args.server) if args.server else None
    e2e = run_e2e() if args.e2e else None
    recall = run_delta_recall() if args.delta_recall else None
    vocabulary = run_vocabulary(tuple(args.vocabulary)) if args.vocabulary else None
    server_vocabulary = (
        run_server_vocabulary(tuple(args.server_vocabulary)) if args.server_vocabulary else None
    )
    for text in report(results, e2e, server, recall, vocabulary, server_vocabulary):
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
