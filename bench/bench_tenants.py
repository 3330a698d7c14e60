"""Tenants: nothing crosses (a leakage run over the HTTP service), what per-tenant BM25 statistics
would change for small tenants, and what a tenant's scope costs a query at scale.

Usage:
    python -m bench.bench_tenants [--requests 10000] [--tenants 50] [--cost-sizes 100000]
        [--only leakage quality cost]

1. **Leakage.** `--tenants` tenants of random sizes (1 to 40 SQuAD paragraphs each, random
   `groups`), ingested with the default model into Qdrant Edge; per tenant a writer key (read
   and write) and a reader key limited to one group; an admin key. Then `--requests` random
   requests through the real app (in process): searches in every mode with and without
   `diversity` and `expand`, repeated questions (the semantic cache is on), a tenant named or
   not (its own or another's), filters that try to widen the scope, upserts and deletes (of its
   own tenant, or naming another), feedback (on its own queries or another key's). The oracle is a
   model of every document, kept from the writes the service accepted: each hit must be a
   document the key may read, each request must get the status its scope implies (200, 403, 404),
   and at the end the collection must hold exactly the model's documents (0 writes applied
   outside a scope). The peer is the same searches with no scope (the admin key), to show the
   scoped searches were not vacuous: how many of their hits the scope removed.
2. **Quality.** SQuAD's 48 articles as one large tenant (40 articles) and 8 tenants of one dev
   article each. For the small tenants' dev questions: recall@1/@5 of the gold chunk with the
   product's BM25 (one table of document frequencies for the version, searched with the tenant
   filter) against rank-bm25 built on the tenant's own chunks (per-tenant statistics), same
   chunks, same analyzer, same run.
3. **Cost.** `--cost-sizes` chunks in 1,000 tenants (Zipf sizes), random unit vectors and real
   text for BM25 (as bench_engine), on Qdrant Edge with the tenant payload index: hybrid p50/p95
   of a query scoped to a random tenant, and to the largest, against the same query unscoped,
   interleaved and rotated, engine only (no encoding).
Run it alone: its timings are the machine's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from rank_bm25 import BM25Okapi

from bench import bench_engine
from bench.bench_common import percentile, read_jsonl, shared_path
from rag_retriever import Settings, conditions
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.versions import documents_of
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.bm25 import BM25Model, Tokenizer
from rag_retriever.models.encoder import load_encoder
from rag_retriever.query.cache import SemanticCache
from rag_retriever.query.querylog import QueryLog
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Chunk, Document, SearchFilter
from rag_retriever.service.server import create_app
from rag_retriever.store import DENSE, SPARSE, EdgeStore, StageQuery

GROUPS = ("staff", "public", "partners")
MODES = ("bm25", "dense", "hybrid")


# -- 1. leakage ---------------------------------------------------------------------------------


@dataclass
class _Key:
    name: str
    secret: str
    tenant: str | None  # None: every tenant (admin)
    write: bool
    group: str | None = None  # the access filter: groups contains it

    def line(self) -> str:
        fields: dict[str, Any] = {
            "name": self.name,
            "sha256": hashlib.sha256(self.secret.encode()).hexdigest(),
            "access": ["read", "write"] if self.write else ["read"],
        }
        if self.tenant is not None:
            fields["tenants"] = [self.tenant]
        if self.group is not None:
            fields["where"] = {"field": "groups", "equals": self.group}
        return json.dumps(fields)

    def may_read(self, meta: dict[str, Any]) -> bool:
        if self.tenant is not None and meta.get("tenant") != self.tenant:
            return False
        return self.group is None or self.group in meta.get("groups", [])


@dataclass
class _Tally:
    requests: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    hits: int = 0
    leaked: int = 0
    wrong_status: list[str] = field(default_factory=list)
    removed_by_scope: int = 0
    unscoped_hits: int = 0

    def count(self, kind: str, status: int) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1


def leakage(
    n_requests: int, n_tenants: int, seed: int = 0, *, encoder: Any = None
) -> dict[str, Any]:
    """The leakage run (the module docstring); `encoder`: the model (default: RAG_EMBED_MODEL's,
    all-MiniLM-L6-v2)."""
    rng = random.Random(seed)
    paragraphs = [
        (doc["title"], p)
        for doc in read_jsonl(shared_path("squad_v11_dev", "docs.jsonl"))
        for p in doc["text"].split("\n\n")
        if p.strip()
    ]
    rng.shuffle(paragraphs)
    tenants = [f"t{i:02d}" for i in range(n_tenants)]
    model: dict[tuple[str, str], dict[str, Any]] = {}  # (tenant, id) -> metadata
    docs = []
    at = 0
    for tenant in tenants:
        for j in range(rng.randint(1, 40)):
            title, text = paragraphs[at % len(paragraphs)]
            at += 1
            meta = {"tenant": tenant, "groups": rng.sample(GROUPS, rng.randint(0, 2))}
            # ids repeat across tenants: p0, p1, ... in each
            docs.append(Document(f"p{j}", title, text, meta))
            model[(tenant, f"p{j}")] = meta
    questions = [
        r["question"] for r in read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), 300)
    ]
    keys = [_Key("admin", "secret-admin", None, True)]
    for tenant in tenants:
        keys.append(_Key(f"{tenant}-app", f"secret-{tenant}-app", tenant, True))
        group = rng.choice(GROUPS)
        keys.append(_Key(f"{tenant}-{group}", f"secret-{tenant}-{group}", tenant, False, group))
    tally = _Tally()
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        root = Path(tmp)
        (root / "keys.jsonl").write_text("\n".join(k.line() for k in keys) + "\n")
        settings = Settings(
            data_dir=root / "data", keys_file=root / "keys.jsonl", write_window_ms=10
        )
        encoder = encoder or load_encoder(settings)
        store = EdgeStore(root / "data")
        t0 = time.perf_counter()
        ingest_documents(
            LoadedCorpus(tuple(docs), 0, "bench"),
            alias="kb",
            encoder=encoder,
            store=store,
            lock_dir=root,
            rebase_drift=1.0,
        )
        ingest_s = time.perf_counter() - t0
        retriever = Retriever(encoder=encoder, store=store, collection="kb")
        retriever.cache = SemanticCache(size=1000, threshold=0.99)
        retriever.query_log = QueryLog(root / "log")
        app = create_app(retriever, settings)
        t0 = time.perf_counter()
        with TestClient(app) as http:
            _drive(http, rng, keys, tenants, questions, model, tally, n_requests)
        drive_s = time.perf_counter() - t0
        held = {d.key: dict(d.metadata) for d in documents_of(store, store.resolve("kb")).documents}
        outside = sorted(set(held) ^ set(model)) + [
            k for k in held if k in model and held[k] != model[k]
        ]
        store.close()
    return {
        "tenants": n_tenants,
        "documents": len(docs),
        "keys": len(keys),
        "ingest_s": ingest_s,
        "requests": tally.requests,
        "statuses": tally.statuses,
        "hits_checked": tally.hits,
        "hits_outside_scope": tally.leaked,
        "unexpected_statuses": len(tally.wrong_status),
        "unexpected_examples": tally.wrong_status[:10],
        "documents_differing_from_model": len(outside),
        "unscoped_hits_of_the_same_searches": tally.unscoped_hits,
        "of_which_the_scope_removed": tally.removed_by_scope,
        "seconds": drive_s,
    }


def _drive(
    http: TestClient,
    rng: random.Random,
    keys: list[_Key],
    tenants: list[str],
    questions: list[str],
    model: dict[tuple[str, str], dict[str, Any]],
    tally: _Tally,
    n: int,
) -> None:
    logged: list[tuple[str, str, str]] = []  # (key name, query id, chunk id)
    admin = keys[0]
    for i in range(n):
        key = rng.choice(keys[1:]) if rng.random() < 0.95 else admin
        auth = {"Authorization": f"Bearer {key.secret}"}
        roll = rng.random()
        if roll < 0.80:
            _search(http, rng, key, admin, tenants, questions, model, tally, logged, auth)
        elif roll < 0.86:
            _upsert(http, rng, key, tenants, model, tally, auth, i)
        elif roll < 0.90:
            _delete(http, rng, key, tenants, model, tally, auth)
        elif logged:
            _feedback(http, rng, key, logged, tally, auth)


def _search(
    http: TestClient,
    rng: random.Random,
    key: _Key,
    admin: _Key,
    tenants: list[str],
    questions: list[str],
    model: dict[tuple[str, str], dict[str, Any]],
    tally: _Tally,
    logged: list[tuple[str, str, str]],
    auth: dict[str, str],
) -> None:
    body: dict[str, Any] = {
        "query": rng.choice(questions[:60] if rng.random() < 0.5 else questions),  # repeats: cache
        "k": 10,
        "mode": rng.choice(MODES),
    }
    if rng.random() < 0.3:
        body["diversity"] = 0.5
    if rng.random() < 0.3:
        body["expand"] = "neighbours"
    expected = 200
    roll = rng.random()
    if roll < 0.2:  # a tenant named: its own, or another
        body["tenant"] = key.tenant if key.tenant and rng.random() < 0.5 else rng.choice(tenants)
        if key.tenant is not None and body["tenant"] != key.tenant:
            expected = 403
    elif roll < 0.3:  # a filter reaching for another tenant
        other = rng.choice(tenants)
        body["filter"] = {"where": {"field": "tenant", "in": sorted({other, key.tenant or other})}}
        if key.tenant is not None and other != key.tenant:
            expected = 403
    elif roll < 0.4 and key.group is not None:  # another group: narrows (groups is a list)
        wanted = rng.choice(GROUPS)
        body["filter"] = {"where": {"field": "groups", "equals": wanted}}
    r = http.post("/v1/search", json=body, headers=auth)
    tally.count("search", r.status_code)
    if r.status_code != expected:
        tally.wrong_status.append(f"search {key.name} {body} -> {r.status_code} {r.text[:200]}")
        return
    if r.status_code != 200:
        return
    result = r.json()
    for hit in result["hits"]:
        tally.hits += 1
        meta = model.get((hit["metadata"].get("tenant", ""), hit["doc_id"]))
        if meta is None or not key.may_read(meta):
            tally.leaked += 1
    if result["hits"] and result.get("query_id"):
        logged.append((key.name, result["query_id"], result["hits"][0]["chunk_id"]))
    if key is not admin and rng.random() < 0.1:  # the peer: the same search with no scope
        free = {k: v for k, v in body.items() if k not in ("tenant", "filter")}
        everyone = http.post(
            "/v1/search", json=free, headers={"Authorization": f"Bearer {admin.secret}"}
        ).json()["hits"]
        tally.unscoped_hits += len(everyone)
        tally.removed_by_scope += sum(
            1
            for h in everyone
            if not key.may_read(model.get((h["metadata"].get("tenant", ""), h["doc_id"]), {}))
        )


def _upsert(
    http: TestClient,
    rng: random.Random,
    key: _Key,
    tenants: list[str],
    model: dict[tuple[str, str], dict[str, Any]],
    tally: _Tally,
    auth: dict[str, str],
    i: int,
) -> None:
    target = key.tenant if key.tenant and rng.random() < 0.7 else rng.choice(tenants)
    groups = rng.sample(GROUPS, rng.randint(0, 2))
    doc_id = f"p{rng.randint(0, 45)}"
    metadata: dict[str, Any] = {"groups": groups}
    if target != key.tenant or rng.random() < 0.5:
        metadata["tenant"] = target
    body = {
        "documents": [
            {
                "id": doc_id,
                "title": "edit",
                "text": f"edited text {i} of {target}",
                "metadata": metadata,
            }
        ]
    }
    allowed = key.write and (key.tenant is None or key.tenant == target)
    if key.tenant is None and "tenant" not in metadata:
        target = ""  # the admin writing with no tenant: a document of no tenant
    r = http.put("/v1/collections/kb/documents", json=body, headers=auth)
    tally.count("upsert", r.status_code)
    if r.status_code != (200 if allowed else 403):
        tally.wrong_status.append(f"upsert {key.name} -> {target}: {r.status_code} {r.text[:200]}")
    if r.status_code == 200:
        model[(target, doc_id)] = {**metadata, **({"tenant": target} if target else {})}


def _delete(
    http: TestClient,
    rng: random.Random,
    key: _Key,
    tenants: list[str],
    model: dict[tuple[str, str], dict[str, Any]],
    tally: _Tally,
    auth: dict[str, str],
) -> None:
    target = key.tenant if key.tenant and rng.random() < 0.7 else rng.choice(tenants)
    doc_id = f"p{rng.randint(0, 45)}"
    body: dict[str, Any] = {"ids": [doc_id]}
    if target != key.tenant or rng.random() < 0.5:
        body["tenant"] = target
    allowed = key.write and (key.tenant is None or key.tenant == target)
    r = http.post("/v1/collections/kb/documents:delete", json=body, headers=auth)
    tally.count("delete", r.status_code)
    if r.status_code != (200 if allowed else 403):
        tally.wrong_status.append(f"delete {key.name} -> {target}: {r.status_code} {r.text[:200]}")
    if r.status_code == 200:
        model.pop((target, doc_id), None)


def _feedback(
    http: TestClient,
    rng: random.Random,
    key: _Key,
    logged: list[tuple[str, str, str]],
    tally: _Tally,
    auth: dict[str, str],
) -> None:
    owner, query_id, chunk_id = rng.choice(logged)
    body = {"query_id": query_id, "chunk_id": chunk_id, "relevant": True}
    r = http.post("/v1/feedback", json=body, headers=auth)
    tally.count("feedback", r.status_code)
    if r.status_code != (200 if owner == key.name else 404):
        tally.wrong_status.append(f"feedback {key.name} on {owner}'s: {r.status_code}")


# -- 2. quality: one BM25 table vs per-tenant tables -------------------------------------------


def quality(small_tenants: int = 8, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    articles = read_jsonl(shared_path("squad_v11_dev", "docs.jsonl"))
    dev = read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"))
    dev_articles = sorted({q["gold_doc_ids"][0] for q in dev})
    small = set(rng.sample(dev_articles, small_tenants))
    docs = [
        Document(
            a["id"],
            a["title"],
            a["text"],
            {"tenant": f"s-{i:02d}" if a["id"] in small else "big"},
        )
        for i, a in enumerate(articles)
    ]
    tenant_of_doc = {d.id: str(d.metadata["tenant"]) for d in docs}
    with tempfile.TemporaryDirectory(prefix="bench-tenants-q-") as tmp:
        root = Path(tmp)
        settings = Settings(data_dir=root / "data")
        encoder = load_encoder(settings)
        store = EdgeStore(root / "data")
        ingest_documents(
            LoadedCorpus(tuple(docs), 0, "squad"),
            alias="kb",
            encoder=encoder,
            store=store,
            lock_dir=root,
        )
        retriever = Retriever(encoder=encoder, store=store, collection="kb")
        chunks = [Chunk.from_payload(r.payload) for r in store.scroll(store.resolve("kb"))]
        tok = Tokenizer()
        own: dict[str, tuple[BM25Okapi, list[Chunk]]] = {}
        for tenant in {tenant_of_doc[d] for d in small}:
            mine = [c for c in chunks if c.metadata.get("tenant") == tenant]
            own[tenant] = (BM25Okapi([tok.tokenize(c.embed_text) for c in mine]), mine)
        questions = [q for q in dev if q["gold_doc_ids"][0] in small]
        found: dict[str, list[int | None]] = {"global": [], "per_tenant": []}  # gold ranks
        for q in questions:
            tenant = tenant_of_doc[q["gold_doc_ids"][0]]
            span = q["gold_spans"][0]
            hits = retriever.retrieve(q["question"], k=5, mode="bm25", tenant=tenant).hits
            found["global"].append(_gold_rank([(h.doc_id, h.start, h.end) for h in hits], span))
            index, mine = own[tenant]
            scores = index.get_scores(tok.tokenize(q["question"]))
            top = np.argsort(-scores, kind="stable")[:5]
            ranked = [(mine[i].doc_id, mine[i].start, mine[i].end) for i in top if scores[i] > 0]
            found["per_tenant"].append(_gold_rank(ranked, span))
        store.close()
    out: dict[str, Any] = {
        "small_tenants": small_tenants,
        "questions": len(questions),
        "big_tenant_articles": len(articles) - small_tenants,
    }
    for name, ranks in found.items():
        out[f"{name}_recall@1"] = sum(r == 1 for r in ranks) / len(ranks)
        out[f"{name}_recall@5"] = sum(r is not None for r in ranks) / len(ranks)
    return out


def _gold_rank(hits: list[tuple[str, int, int]], span: dict[str, Any]) -> int | None:
    for rank, (doc_id, start, end) in enumerate(hits, 1):
        if doc_id == span["doc_id"] and start <= span["start"] and span["end"] <= end:
            return rank
    return None


# -- 3. cost: a tenant's scope on a query at scale ---------------------------------------------

COST_NAME = bench_engine.NAME


def cost(n: int, n_tenants: int = 1000, n_queries: int = 300, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    weights = 1 / np.arange(1, n_tenants + 1)  # Zipf sizes: a few large tenants, many small
    tenant_of_point = rng.choice(n_tenants, size=n, p=weights / weights.sum())
    tok = Tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-tenants-cost-") as tmp:
        built = bench_engine.build(
            "edge",
            Path(tmp),
            n,
            seed,
            metadata=lambda i: {"tenant": f"t{tenant_of_point[i]:04d}"},
            indexes={"doc_id": "keyword", "metadata.tenant": "keyword"},
        )
        store = EdgeStore(Path(tmp))
        bm25 = BM25Model(store.record(COST_NAME).bm25, store.doc_freqs(COST_NAME))
        questions = read_jsonl(shared_path("squad_v11_dev", "questions_dev.jsonl"), n_queries)
        sizes = np.bincount(tenant_of_point, minlength=n_tenants)
        largest = SearchFilter(where=conditions.Match("tenant", (f"t{int(sizes.argmax()):04d}",)))
        timings: dict[str, list[float]] = {"unscoped": [], "scoped": [], "largest": []}
        for i, q in enumerate(questions):
            vector = rng.standard_normal(384).astype(np.float32)
            vector /= np.linalg.norm(vector)
            sparse = bm25.query_vector(tok.tokenize(q["question"]))
            tenant = int(rng.integers(n_tenants))
            flt = SearchFilter(where=conditions.Match("tenant", (f"t{tenant:04d}",)))
            plans = {
                "unscoped": [StageQuery(DENSE, vector, 100), StageQuery(SPARSE, sparse, 100)],
                "scoped": [
                    StageQuery(DENSE, vector, 100, flt),
                    StageQuery(SPARSE, sparse, 100, flt),
                ],
                "largest": [
                    StageQuery(DENSE, vector, 100, largest),
                    StageQuery(SPARSE, sparse, 100, largest),
                ],
            }
            order = list(plans)[i % 3 :] + list(plans)[: i % 3]  # interleaved, rotated
            for variant in order:
                t0 = time.perf_counter()
                store.search(COST_NAME, plans[variant])
                timings[variant].append((time.perf_counter() - t0) * 1000)
        store.close()
    out: dict[str, Any] = {
        "chunks": n,
        "tenants": n_tenants,
        "largest_tenant": int(sizes.max()),
        "median_tenant": float(statistics.median(sizes)),
        "build_s": built["write_s"] + built["seal_s"],
    }
    for variant, values in timings.items():
        values = values[10:]  # warm-up
        out[f"{variant}_p50_ms"] = percentile(values, 50)
        out[f"{variant}_p95_ms"] = percentile(values, 95)
    return out


# -- the whole benchmark ------------------------------------------------------------------------


def run(
    n_requests: int = 10_000,
    n_tenants: int = 50,
    cost_sizes: tuple[int, ...] = (100_000,),
    only: tuple[str, ...] = ("leakage", "quality", "cost"),
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "leakage" in only:
        out["leakage"] = leakage(n_requests, n_tenants)
    if "quality" in only:
        out["quality"] = quality()
    if "cost" in only:
        out["cost"] = [cost(n) for n in cost_sizes]
    return out


def report(result: dict[str, Any]) -> list[str]:
    lines = []
    if "leakage" in result:
        r = result["leakage"]
        lines += [
            f"== tenants: leakage ({r['tenants']} tenants, {r['documents']} documents, "
            f"{r['keys']} keys, {sum(r['requests'].values()):,} requests in {r['seconds']:.0f} s) ==",
            f"requests {r['requests']}, statuses {r['statuses']}",
            f"hits outside the caller's scope: {r['hits_outside_scope']} of {r['hits_checked']:,} "
            f"checked; writes applied outside a scope: {r['documents_differing_from_model']}; "
            f"answers other than the scope implies: {r['unexpected_statuses']}",
            f"peer (the same searches with no scope): {r['unscoped_hits_of_the_same_searches']:,} "
            f"hits, of which the scope removed {r['of_which_the_scope_removed']:,}",
        ]
        lines += [f"  unexpected: {e}" for e in r["unexpected_examples"]]
    if "quality" in result:
        q = result["quality"]
        lines += [
            f"== tenants: BM25 statistics for {q['small_tenants']} one-article tenants beside one "
            f"of {q['big_tenant_articles']} (SQuAD dev, {q['questions']} questions) ==",
            f"one table (ours): recall@1 {q['global_recall@1']:.3f}, @5 {q['global_recall@5']:.3f}"
            f" vs per-tenant tables (rank-bm25 on the tenant's chunks): recall@1 "
            f"{q['per_tenant_recall@1']:.3f}, @5 {q['per_tenant_recall@5']:.3f}",
        ]
    for c in result.get("cost", []):
        lines += [
            f"== tenants: a scoped hybrid query at {c['chunks']:,} chunks in {c['tenants']:,} "
            f"tenants (largest {c['largest_tenant']:,}, median {c['median_tenant']:.0f} chunks; "
            f"engine only) ==",
            f"scoped p50 {c['scoped_p50_ms']:.2f} ms (p95 {c['scoped_p95_ms']:.2f}) vs unscoped "
            f"p50 {c['unscoped_p50_ms']:.2f} ms (p95 {c['unscoped_p95_ms']:.2f}) -> "
            f"{c['unscoped_p50_ms'] / c['scoped_p50_ms']:.2f}x; the largest tenant alone p50 "
            f"{c['largest_p50_ms']:.2f} ms (p95 {c['largest_p95_ms']:.2f})",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_tenants", description=__doc__)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--cost-sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("leakage", "quality", "cost"),
        default=["leakage", "quality", "cost"],
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    result = run(args.requests, args.tenants, tuple(args.cost_sizes), tuple(args.only))
    for text in report(result):
        print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
