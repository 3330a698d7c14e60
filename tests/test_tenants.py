"""Tenants and scoped keys: a document id is unique within its tenant, a key reads and writes
only its scope in every branch of a search, and nothing crosses (docs/tenants.md).

Oracles: the documents each version holds (listed from the store), hand-written scopes with the
documents each may see, and for the property test a brute-force evaluation of each scope over
the documents as ingested. Real Qdrant Edge and qdrant-client's in-process server API, the tiny
encoder, real BM25.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rag_retriever import Collection, DocumentError, conditions
from rag_retriever.access import Scope
from rag_retriever.errors import ConfigError
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.versions import documents_of
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.cache import SemanticCache
from rag_retriever.query.querylog import QueryLog, questions_from_log
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document, Mode, tenant_of
from rag_retriever.service import keys as keys_module
from rag_retriever.service.keys import KeyRing, Keys
from rag_retriever.service.metrics import BoundedLabels
from rag_retriever.service.server import create_app
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, Store

WORDS = ["alpha", "refunds", "policy", "notes"]
DOCS = (
    Document(
        "faq", "FAQ", "alpha refunds within thirty days", {"tenant": "acme", "groups": ["staff"]}
    ),
    Document("faq", "FAQ", "alpha refunds within ninety days", {"tenant": "globex"}),
    Document(
        "pub", "Public", "alpha policy notes for everyone", {"tenant": "acme", "groups": ["public"]}
    ),
    Document("shared", "Shared", "alpha shared notes of no tenant"),
)
KEYS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (key, the line's fields)
    "acme-app": ("k-acme", {"tenants": ["acme"], "access": ["read", "write"]}),
    "acme-public": (
        "k-acme-public",
        {"tenants": ["acme"], "where": {"field": "groups", "equals": "public"}},
    ),
    "globex": ("k-globex", {"tenants": ["globex"]}),
    "admin": ("k-admin", {"access": ["read", "write"]}),
    "other-only": ("k-other", {"collections": ["other"]}),
    # an access filter on a field no document of the version has (yet)
    "legal": ("k-legal", {"where": {"field": "department", "equals": "legal"}}),
}


def key_line(name: str, key: str, **fields: Any) -> str:
    return json.dumps({"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(), **fields})


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name][0]}"}


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.jsonl"
    path.write_text("\n".join(key_line(n, k, **f) for n, (k, f) in KEYS.items()) + "\n")
    return path


@pytest.fixture
def edge(tmp_path: Path) -> Iterator[Store]:
    store = EdgeStore(tmp_path / "edge")
    yield store
    store.close()


def build(
    store: Store, encoder: Encoder, tmp_path: Path, docs: tuple[Document, ...] = DOCS
) -> Retriever:
    ingest_documents(
        LoadedCorpus(docs, 0, "t"), alias="kb", encoder=encoder, store=store, lock_dir=tmp_path
    )
    return Retriever(encoder=encoder, store=store, collection="kb")


@pytest.fixture
def http(
    tmp_path: Path, tiny_encoder: Encoder, edge: Store, keys_file: Path
) -> Iterator[TestClient]:
    retriever = build(edge, tiny_encoder, tmp_path)
    retriever.query_log = QueryLog(tmp_path / "log")
    retriever.cache = SemanticCache(size=100, threshold=0.99)
    values = {
        "data_dir": tmp_path,
        "keys_file": keys_file,
        "write_window_ms": 10,
        "write_interval_ms": 0,
        "bm25_rebase_drift": 1.0,
    }
    with TestClient(create_app(retriever, Settings(**values))) as client:
        yield client


def seen(response: Any) -> set[tuple[str, str]]:
    assert response.status_code == 200, response.text
    return {(h["metadata"].get("tenant", ""), h["doc_id"]) for h in response.json()["hits"]}


def held(store: Store) -> dict[tuple[str, str], str]:
    """The live version's documents by (tenant, id), with their text."""
    corpus = documents_of(store, store.resolve("kb"))
    return {d.key: d.text for d in corpus.documents}


# -- identity --------------------------------------------------------------------------------


def test_the_same_id_in_two_tenants_is_two_documents(
    tmp_path: Path, tiny_encoder: Encoder, edge: Store
) -> None:
    build(edge, tiny_encoder, tmp_path)
    assert set(held(edge)) == {("acme", "faq"), ("globex", "faq"), ("acme", "pub"), ("", "shared")}
    kb = Collection.open(
        "kb", retriever=Retriever(encoder=tiny_encoder, store=edge, collection="kb")
    )
    kb.upsert([{"id": "faq", "text": "alpha refunds within sixty days", "tenant": "acme"}])
    assert held(edge)[("acme", "faq")] == "alpha refunds within sixty days"
    assert held(edge)[("globex", "faq")] == "alpha refunds within ninety days"  # untouched
    report = kb.delete(["faq"], tenant="acme")
    assert (report.deleted, report.not_found) == (1, 0)
    assert ("acme", "faq") not in held(edge) and ("globex", "faq") in held(edge)
    assert kb.delete(["faq"]).not_found == 1  # no document "faq" of no tenant


@pytest.mark.parametrize(
    "name",
    ["", "../etc", "a/b", "Acme", "\u0430cme", "x" * 65, " acme", "acme\n", "-acme", 7],
    ids=[
        "empty",
        "dotdot",
        "slash",
        "upper",
        "cyrillic-a",
        "long",
        "space",
        "newline",
        "dash",
        "int",
    ],
)
def test_a_tenant_that_is_not_a_name_is_refused_and_nothing_written(
    tmp_path: Path, tiny_encoder: Encoder, edge: Store, name: object
) -> None:
    build(edge, tiny_encoder, tmp_path)
    before = edge.resolve("kb")
    kb = Collection.open(
        "kb", retriever=Retriever(encoder=tiny_encoder, store=edge, collection="kb")
    )
    with pytest.raises(DocumentError, match="tenant"):
        kb.upsert([{"id": "x", "text": "alpha", "tenant": name}])
    assert edge.resolve("kb") == before


def test_groups_must_be_a_list_of_names(tmp_path: Path, tiny_encoder: Encoder, edge: Store) -> None:
    build(edge, tiny_encoder, tmp_path)
    kb = Collection.open(
        "kb", retriever=Retriever(encoder=tiny_encoder, store=edge, collection="kb")
    )
    for groups in ("staff", ["staff", ""], ["a\x00b"], [3]):
        with pytest.raises(DocumentError, match="groups"):
            kb.upsert([{"id": "x", "text": "alpha", "groups": groups}])


# -- the keys file ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("not json", "not JSON"),
        ('{"name": "a"}', "sha256"),
        (key_line("a", "k", tenants=["../x"]), "not a tenant name"),
        (key_line("a", "k", access=["admin"]), "'access'"),
        (key_line("a", "k", colour="red"), "unknown field"),
        (key_line("a", "k", where={"field": "g", "equals": "s"}, access=["write"]), "cannot write"),
        (key_line("a", "k", where={"field": "g"}), "operator"),
        (key_line("admin", "other"), "used twice"),
    ],
)
def test_a_malformed_keys_file_names_the_line_and_the_reason(line: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=f"keys line 3: .*{reason}"):
        KeyRing.from_lines(["# a comment", key_line("admin", "k0"), line], "keys")


def test_the_service_refuses_to_start_on_a_malformed_keys_file(
    tmp_path: Path, tiny_encoder: Encoder, edge: Store
) -> None:
    bad = tmp_path / "keys.jsonl"
    bad.write_text(key_line("a", "k") + "\n{oops\n")
    retriever = build(edge, tiny_encoder, tmp_path)
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        create_app(retriever, Settings(data_dir=tmp_path, keys_file=bad))


def test_a_changed_keys_file_is_reloaded_and_a_bad_one_keeps_the_old_keys(
    keys_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(keys_module, "RELOAD_CHECK_S", 0.0)
    keys = Keys(keys_file=keys_file)
    assert keys.lookup(["k-acme"]).name == "acme-app"  # type: ignore[union-attr]
    keys_file.write_text(key_line("rotated", "k-new") + "\n")
    assert keys.lookup(["k-acme"]) is None and keys.lookup(["k-new"]).name == "rotated"  # type: ignore[union-attr]
    with caplog.at_level(logging.ERROR):
        keys_file.write_text(key_line("broken", "k-x", tenants="acme") + "\n")
        assert keys.lookup(["k-new"]).name == "rotated"  # type: ignore[union-attr]
    assert "previous keys stay in force" in caplog.text and "line 1" in caplog.text
    assert "k-new" not in caplog.text and keys.failed_reloads == 1


# -- the HTTP service ---------------------------------------------------------------------------

VISIBLE = {
    "acme-app": {("acme", "faq"), ("acme", "pub")},
    "acme-public": {("acme", "pub")},
    "globex": {("globex", "faq")},
    "admin": {("acme", "faq"), ("globex", "faq"), ("acme", "pub"), ("", "shared")},
}


@pytest.mark.parametrize("mode", ["bm25", "dense", "hybrid"])
@pytest.mark.parametrize(
    "extra", [{}, {"diversity": 0.5}, {"expand": "neighbours"}], ids=["plain", "mmr", "expand"]
)
def test_a_key_reads_its_scope_in_every_branch(
    http: TestClient, mode: str, extra: dict[str, Any]
) -> None:
    for _ in range(2):  # the second time from the cache, keyed by the effective scope
        for name, visible in VISIBLE.items():
            body = {"query": "alpha refunds notes", "k": 10, "mode": mode, **extra}
            assert seen(http.post("/v1/search", json=body, headers=auth(name))) == visible, name
    batch = {"queries": ["alpha", "refunds"], "k": 10, "mode": mode}
    r = http.post("/v1/search/batch", json=batch, headers=auth("globex"))
    assert all(
        h["metadata"]["tenant"] == "globex" for res in r.json()["results"] for h in res["hits"]
    )


def test_a_request_narrows_its_scope_and_cannot_widen_it(http: TestClient) -> None:
    def search(name: str, **body: Any) -> Any:
        return http.post(
            "/v1/search",
            json={"query": "alpha", "k": 10, "mode": "bm25", **body},
            headers=auth(name),
        )

    assert seen(search("admin", tenant="globex")) == {("globex", "faq")}
    assert seen(search("acme-app", filter={"equals": {"groups": "public"}})) == {("acme", "pub")}
    refusals: list[tuple[str, dict[str, Any], str]] = [
        ("acme-app", {"tenant": "globex"}, "tenant 'globex'"),
        ("acme-app", {"tenant": "initech"}, "tenant 'initech'"),
        (
            "acme-app",
            {"filter": {"where": {"field": "tenant", "in": ["acme", "globex"]}}},
            "'globex'",
        ),
        ("acme-app", {"filter": {"equals": {"tenant": "globex"}}}, "'globex'"),
        # `not not` asks for what it negates twice (it passed the check: an empty answer)
        (
            "acme-app",
            {"filter": {"where": {"not": {"not": {"field": "tenant", "equals": "globex"}}}}},
            "'globex'",
        ),
        ("other-only", {}, "collection 'kb'"),
    ]
    for name, body, lacks in refusals:
        r = search(name, **body)
        assert r.status_code == 403 and r.json()["error"] == "forbidden", (name, r.text)
        assert lacks in r.json()["detail"]
        # it says what the key lacks, never which other tenants exist
        assert "globex" not in r.json()["detail"] or "globex" in json.dumps(body)
    # groups is a list: a `public` key may ask for the `staff` ones among its documents (those
    # of both groups) without a 403; the scope is ANDed in, so it reads no other
    narrowed = search("acme-public", filter={"where": {"field": "groups", "equals": "staff"}})
    assert narrowed.status_code == 200 and seen(narrowed) == set()
    assert search("acme-app", tenant="../x").status_code == 422
    r = http.post("/v1/search", json={"query": "alpha"}, headers={"X-API-Key": "no-such-key"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


def test_a_limited_key_reads_what_its_alias_serves_not_an_older_version(
    http: TestClient, edge: Store
) -> None:
    """An older version may still hold a document deleted since, or one moved out of the key's
    groups: a key limited to tenants or by a filter names the alias; a key that sees everything
    may name a version (the gate's and the eval's way)."""
    version = edge.resolve("kb")
    body = {"query": "alpha", "k": 10, "mode": "bm25", "collection": version}
    for name in ("acme-app", "acme-public", "globex"):
        r = http.post("/v1/search", json=body, headers=auth(name))
        assert r.status_code == 403 and "name 'kb', not one of its versions" in r.text, name
    assert http.post("/v1/search", json=body, headers=auth("admin")).status_code == 200


def test_a_key_whose_filter_names_a_field_the_version_lacks_gets_no_hits_not_an_error(
    http: TestClient,
) -> None:
    """The key's access filter is not the request's: checked as one, a version without its field
    answered every search of the key with a 422 naming the hidden condition (found by a
    review). Now no document matches, and nothing is said of the filter. Nor is a limited key's
    own filter checked against the version's fields: they are every tenant's, and a 422 listed
    them (or told a field only another tenant holds from one no document holds); an
    unrestricted key still gets the 422 that names the mistake."""
    for mode in ("bm25", "hybrid"):
        r = http.post("/v1/search", json={"query": "alpha", "mode": mode}, headers=auth("legal"))
        assert r.status_code == 200 and r.json()["hits"] == [], r.text
        assert "department" not in r.text
    asked = {"query": "alpha", "filter": {"equals": {"color": "red"}}}
    for name in ("legal", "acme-app", "globex"):
        r = http.post("/v1/search", json=asked, headers=auth(name))
        assert r.status_code == 200 and r.json()["hits"] == [], (name, r.text)
    r = http.post("/v1/search", json=asked, headers=auth("admin"))
    assert r.status_code == 422 and "'color'" in r.json()["detail"]


def test_a_tenant_key_writes_only_its_tenant(http: TestClient, edge: Store) -> None:
    put = "/v1/collections/kb/documents"
    doc = {"id": "faq", "text": "alpha refunds within a week"}
    r = http.put(put, json={"documents": [doc]}, headers=auth("acme-app"))
    assert r.status_code == 200, r.text
    assert held(edge)[("acme", "faq")] == doc["text"]  # the key's tenant, without naming it
    assert held(edge)[("globex", "faq")] == "alpha refunds within ninety days"
    before = edge.resolve("kb")
    for headers, body, status in [
        (auth("acme-app"), {"documents": [{**doc, "metadata": {"tenant": "globex"}}]}, 403),
        (auth("globex"), {"documents": [doc]}, 403),  # a read-only key
        (auth("acme-public"), {"documents": [doc]}, 403),
        (auth("acme-app"), {"documents": [{**doc, "metadata": {"tenant": "Globex"}}]}, 422),
    ]:
        r = http.put(put, json=body, headers=headers)
        assert r.status_code == status, r.text
    assert edge.resolve("kb") == before  # nothing written
    r = http.post(
        "/v1/collections/kb/documents:delete",
        json={"ids": ["faq"], "tenant": "globex"},
        headers=auth("acme-app"),
    )
    assert r.status_code == 403
    r = http.post(
        "/v1/collections/kb/documents:delete", json={"ids": ["faq"]}, headers=auth("acme-app")
    )
    assert r.status_code == 200 and r.json()["deletes"] == 1
    # the version's report counts every tenant's documents (and requests grouped with this
    # one): a tenant's key gets what it sent, and the version that now serves it
    assert "report" not in r.json() and "grouped_requests" not in r.json()
    assert r.json()["serving"] is True and r.json()["collection"] == edge.resolve("kb")
    assert ("acme", "faq") not in held(edge) and ("globex", "faq") in held(edge)
    # a change is polled by the key that made it; to another it is unknown
    change = r.json()["change_id"]
    assert http.get(f"/v1/changes/{change}", headers=auth("acme-app")).status_code == 200
    assert http.get(f"/v1/changes/{change}", headers=auth("admin")).status_code == 404


def test_feedback_log_metrics_and_listing_keep_to_the_scope(
    http: TestClient, tmp_path: Path
) -> None:
    r = http.post("/v1/search", json={"query": "alpha", "mode": "bm25"}, headers=auth("acme-app"))
    query_id, hit = r.json()["query_id"], r.json()["hits"][0]
    judged = {"query_id": query_id, "chunk_id": hit["chunk_id"], "relevant": True}
    assert http.post("/v1/feedback", json=judged, headers=auth("globex")).status_code == 404
    assert http.post("/v1/feedback", json=judged, headers=auth("acme-app")).status_code == 200
    assert http.get("/metrics", headers=auth("acme-app")).status_code == 403
    metrics = http.get("/metrics", headers=auth("admin")).text
    assert 'rag_scoped_queries_total{key="acme-app",tenant="acme"} 1.0' in metrics
    assert "k-acme" not in metrics
    listed = http.get("/v1/collections", headers=auth("other-only")).json()["collections"]
    assert listed == {}
    # counts of every tenant's documents, and the chunk ids a delta changed, are for keys that
    # see every tenant (a tenant could test a guessed id of another's against those ids)
    # (nor when the other tenants wrote: each HTTP write is a version, so a limited key sees
    # the version it searches, without its time or lineage)
    for name, whole in (("acme-app", False), ("admin", True)):
        listing = http.get("/v1/collections", headers=auth(name)).json()["collections"]["kb"]
        for version in listing["versions"]:
            for field in ("points", "documents", "created_at", "lineage"):
                assert (field in version) is whole, (name, field)
            assert "changed" not in (version.get("lineage") or {})
        served = [v["collection"] for v in listing["versions"] if v["serving"]]
        assert served == [listing["serving"]], name
        assert len(listing["versions"]) == 1 or whole, name
        ready = http.get("/readyz", headers=auth(name)).json()
        assert ready["status"] == "ready" and ("chunks" in ready) is whole, name
    http.app.state.retriever.query_log.flush()  # type: ignore[attr-defined]
    lines = [
        json.loads(x)
        for p in (tmp_path / "log").rglob("*.jsonl")
        for x in p.read_text().splitlines()
    ]
    scopes = [line["scope"] for line in lines if "scope" in line]
    assert {"key": "acme-app", "tenants": ["acme"], "filtered": False} in scopes
    assert "k-acme" not in json.dumps(lines)  # the key itself never
    assert [line["tenant"] for line in lines if "scope" in line and "hits" in line] == ["acme"]
    # labelled questions of one tenant: the queries that searched it alone
    for tenant, questions in (("acme", 1), ("globex", 0)):
        rows, _ = questions_from_log([tmp_path / "log"], tenant=tenant)
        assert len(rows) == questions
    # the same question asked by two tenants, each judging its own hit: two questions, each
    # with its tenant's gold only (merged by text, one row named both tenants' documents)
    r = http.post("/v1/search", json={"query": "alpha", "mode": "bm25"}, headers=auth("globex"))
    theirs = {"query_id": r.json()["query_id"], "relevant": True}
    theirs["chunk_id"] = r.json()["hits"][0]["chunk_id"]
    assert http.post("/v1/feedback", json=theirs, headers=auth("globex")).status_code == 200
    http.app.state.retriever.query_log.flush()  # type: ignore[attr-defined]
    rows, report = questions_from_log([tmp_path / "log"])
    assert report.tenants == 2
    assert sorted((row["tenant"], row["question"]) for row in rows) == [
        ("acme", "alpha"),
        ("globex", "alpha"),
    ]
    assert {row["tenant"]: row["gold_doc_ids"] for row in rows} == {
        "acme": [hit["doc_id"]],
        "globex": [r.json()["hits"][0]["doc_id"]],
    }


def test_a_metric_label_holds_a_bounded_number_of_values() -> None:
    labels = BoundedLabels(2)
    assert [labels.of(v) for v in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


# -- the property: nothing outside the scope, in any branch -----------------------------------

TENANTS = ("t0", "t1", "t2", "t3")
GROUPS = ("g0", "g1", "g2")


def allowed(scope: Scope, doc_metadata: dict[str, Any]) -> bool:
    """Brute force: may `scope` read a document with this metadata?"""
    if scope.tenants is not None and tenant_of(doc_metadata) not in scope.tenants:
        return False
    if scope.where is None:
        return True
    assert isinstance(scope.where, conditions.Match)
    return bool(set(doc_metadata.get("groups", ())) & set(scope.where.values))


@pytest.fixture(scope="module")
def population(
    tmp_path_factory: pytest.TempPathFactory, tiny_encoder: Encoder
) -> Iterator[tuple[Retriever, dict[str, dict[str, Any]]]]:
    """40 documents in 4 tenants (and none), random groups, on Qdrant Edge."""
    import random

    rng = random.Random(7)
    docs = []
    for i in range(40):
        meta: dict[str, Any] = {}
        if i % 5:
            meta["tenant"] = rng.choice(TENANTS)
        if rng.random() < 0.8:
            meta["groups"] = rng.sample(GROUPS, rng.randint(1, 2))
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        docs.append(Document(f"d{i % 30}", f"doc {i}", text, meta))  # ids repeat across tenants
    docs = list({d.key: d for d in docs}.values())
    tmp = tmp_path_factory.mktemp("tenants")
    store = EdgeStore(tmp / "edge")
    retriever = build(store, tiny_encoder, tmp, tuple(docs))
    retriever.cache = None
    yield retriever, {f"{d.key}": dict(d.metadata) for d in docs}
    store.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tenants=st.none() | st.frozensets(st.sampled_from(TENANTS), min_size=1),
    groups=st.none() | st.lists(st.sampled_from(GROUPS), min_size=1, max_size=2, unique=True),
    mode=st.sampled_from(["bm25", "dense", "hybrid"]),
    diversity=st.sampled_from([None, 0.5]),
    expand=st.sampled_from([None, "neighbours"]),
    asked=st.none() | st.sampled_from(TENANTS),
    query=st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(" ".join),
)
def test_no_search_returns_a_document_outside_its_scope(
    population: tuple[Retriever, dict[str, dict[str, Any]]],
    tenants: frozenset[str] | None,
    groups: list[str] | None,
    mode: Mode,
    diversity: float | None,
    expand: str | None,
    asked: str | None,
    query: str,
) -> None:
    retriever, metadata = population
    where = None if groups is None else conditions.Match("groups", tuple(groups))
    scope = Scope("prop", tenants=tenants, where=where)
    if asked is not None and tenants is not None and asked not in tenants:
        return  # refused (403): the HTTP tests above
    flt = scope.narrow(None, asked)
    result = retriever.retrieve(
        query,
        k=100,
        mode=mode,
        filter=flt,
        diversity=diversity,
        expand=expand,  # type: ignore[arg-type]
    )
    expected = {
        key
        for key, meta in metadata.items()
        if allowed(scope, meta) and (asked is None or tenant_of(meta) == asked)
    }
    got = {f"{(tenant_of(h.metadata), h.doc_id)}" for h in result.hits}
    assert got <= expected
    # and nothing inside it is lost: the unscoped search's hits that the scope may read (k
    # covers the whole population, so the filter only removes)
    everyone = retriever.retrieve(query, k=100, mode=mode)
    assert len(everyone.hits) < 100  # the whole population fits in k
    assert got == {f"{(tenant_of(h.metadata), h.doc_id)}" for h in everyone.hits} & expected
    for h in result.hits:
        if h.context is not None:  # the context of an expanded hit: its own document's chunks
            assert h.context.start <= h.start and h.end <= h.context.end


def test_the_cli_writes_and_searches_one_tenant(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rag_retriever.cli import main

    rows = [{"id": d.id, "title": d.title, "text": d.text, **d.metadata} for d in DOCS]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    change = tmp_path / "change.jsonl"
    change.write_text(json.dumps({"id": "faq", "text": "alpha refunds within a day"}) + "\n")
    args = ["update", "--upsert", str(change), "--collection", "kb", "--no-progress"]
    assert main([*args, "--tenant", "globex", "--json"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "search",
                "alpha refunds",
                "--mode",
                "bm25",
                "--tenant",
                "globex",
                "--json",
                "--collection",
                "kb",
            ]
        )
        == 0
    )
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert {(h["metadata"]["tenant"], h["doc_id"], h["text"]) for h in hits} == {
        ("globex", "faq", "alpha refunds within a day")
    }
    assert main([*args, "--tenant", "../globex"]) == 2
    out = tmp_path / "q.jsonl"
    assert main(["questions", "--from-log", str(tmp_path), "--out", str(out), "--tenant", "A"]) == 2
    assert "--tenant: tenant 'A' is not a tenant name" in capsys.readouterr().err
    assert not out.exists()
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "text": "alpha", "tenant": "acme"}) + "\n")
    assert main(["update", "--upsert", str(other), "--collection", "kb", "--tenant", "globex"]) == 2
    assert "name another tenant" in capsys.readouterr().err
    delete = ["update", "--delete", "faq", "--tenant", "acme", "--collection", "kb", "--json"]
    assert main(delete) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 1
    assert (
        main(["search", "alpha", "--mode", "bm25", "--tenant", "Acme", "--collection", "kb"]) == 2
    )


def test_the_clients_and_langchain_pass_the_key_and_the_tenant(
    tmp_path: Path, tiny_encoder: Encoder, edge: Store, keys_file: Path
) -> None:
    from rag_retriever.client import Forbidden, RetrieverClient
    from rag_retriever.langchain import RagRetrieverLangChain
    from rag_retriever.service.server import serve_in_thread

    retriever = build(edge, tiny_encoder, tmp_path)
    settings = Settings(
        data_dir=tmp_path, keys_file=keys_file, write_window_ms=10, write_interval_ms=0
    )
    with serve_in_thread(create_app(retriever, settings)) as url:
        with RetrieverClient(url, api_key="k-admin", write_api_key="k-admin") as admin:
            hits = admin.search("alpha refunds", mode="bm25", k=10, tenant="globex")
            assert {(h.metadata["tenant"], h.doc_id) for h in hits} == {("globex", "faq")}
            gone = admin.delete_documents(["faq"], collection="kb", tenant="globex")
            assert gone.report is not None and gone.report["deleted"] == 1
        with RetrieverClient(url, write_api_key="k-acme") as tenant_writer:
            sent = tenant_writer.delete_documents(["faq"], collection="kb")  # acme's
            assert (sent.status, sent.deletes, sent.upserts, sent.report) == (
                "committed",
                1,
                0,
                None,
            )
        with RetrieverClient(url, api_key="k-acme-public") as reader:
            lc = RagRetrieverLangChain(backend=reader, mode="bm25", k=10)
            assert {d.metadata["doc_id"] for d in lc.invoke("alpha notes")} == {"pub"}
            with pytest.raises(Forbidden, match="tenant 'globex'"):
                lc.invoke("alpha", tenant="globex")


@pytest.mark.data
def test_random_requests_of_scoped_keys_read_and_write_nothing_outside_their_scope(
    tiny_encoder: Encoder,
) -> None:
    """bench/bench_tenants.py's leakage run, small: 8 tenants of SQuAD paragraphs, 17 keys, 400
    random requests (searches in every mode, with diversity, expansion and the cache; upserts,
    deletes, feedback), each answer checked against a model of every document the service
    accepted."""
    from bench.bench_tenants import leakage
    from tests.conftest import shared_data

    shared_data("squad_v11_dev", "docs.jsonl")
    result = leakage(400, 8, seed=3, encoder=tiny_encoder)
    assert result["hits_checked"] > 300 and result["hits_outside_scope"] == 0
    assert result["unexpected_statuses"] == 0, result["unexpected_examples"]
    assert result["documents_differing_from_model"] == 0
    assert {"search", "upsert", "delete", "feedback"} <= set(result["requests"])
    assert {"200", "403", "404"} <= set(result["statuses"])
    assert result["of_which_the_scope_removed"] > 0  # the scopes were not vacuous
