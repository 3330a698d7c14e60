"""The document write API: PUT/POST behind the write key, group commit, both clients.

Runs the real app on qdrant-client's in-process server API (and Qdrant Edge for the live-server
client test) with the tiny encoder; answers are checked against what the store then serves.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from qdrant_client import QdrantClient

from rag_retriever.client import AsyncRetrieverClient, RetrieverClient, Unauthorized
from rag_retriever.errors import CollectionNotFound, ConfigError, UpdateRefused
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents, update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document, SearchFilter
from rag_retriever.service import writes
from rag_retriever.service.server import create_app, serve_in_thread
from rag_retriever.service.writes import (
    MAX_WAIT_S,
    Change,
    GroupCommitter,
    WriteMetrics,
    merge,
    writes_in_a_process,
)
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, ServerStore, Store

DOCS = tuple(
    Document(f"d{i}", f"doc {i}", f"alpha bravo {w} river city king queen {w}")
    for i, w in enumerate(["apple", "pear", "wine", "rollo", "paris", "london"])
)
READ, WRITE = "read-key", "write-key"


def make_app(tmp_path: Path, encoder: Encoder, **settings: object) -> tuple[TestClient, Store]:
    store = ServerStore(QdrantClient(":memory:"))
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=encoder, store=store, lock_dir=tmp_path
    )
    retriever = Retriever(encoder=encoder, store=store, collection="kb")
    values = {
        "data_dir": tmp_path,
        "api_key": READ,
        "write_api_key": WRITE,
        "write_window_ms": 50,
        "write_interval_ms": 0,
        "bm25_rebase_drift": 1.0,
        **settings,
    }
    return TestClient(create_app(retriever, Settings(**values))), store


@pytest.fixture
def app(tmp_path: Path, tiny_encoder: Encoder) -> Iterator[tuple[TestClient, Store]]:
    client, store = make_app(tmp_path, tiny_encoder)
    with client:
        yield client, store


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def served_docs(store: Store) -> dict[str, str]:
    return {
        str(r.payload["doc_id"]): str(r.payload["text"])
        for r in store.scroll(store.aliases()["kb"])
    }


def test_upsert_and_delete_answer_with_the_version_that_serves_them(
    app: tuple[TestClient, Store],
) -> None:
    http, store = app
    before = store.aliases()["kb"]
    doc = {"id": "d1", "title": "pear", "text": "qdrant vector search", "metadata": {"lang": "en"}}
    r = http.put("/v1/collections/kb/documents", json={"documents": [doc]}, headers=auth(WRITE))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "committed" and body["kind"] == "delta"
    assert body["collection"] == store.aliases()["kb"] != before
    assert body["report"]["upserted"] == 1 and body["report"]["base"] == before
    assert served_docs(store)["d1"] == "qdrant vector search"
    hits = http.post(
        "/v1/search", json={"query": "qdrant vector", "mode": "bm25"}, headers=auth(READ)
    )
    assert hits.json()["hits"][0]["doc_id"] == "d1"
    r = http.post(
        "/v1/collections/kb/documents:delete", json={"ids": ["d2", "nope"]}, headers=auth(WRITE)
    )
    assert r.status_code == 200, r.text
    assert (r.json()["report"]["deleted"], r.json()["report"]["not_found"]) == (1, 1)
    assert "d2" not in served_docs(store)
    # the change can be looked up afterwards
    again = http.get(f"/v1/changes/{r.json()['change_id']}", headers=auth(WRITE))
    assert again.status_code == 200 and again.json()["collection"] == r.json()["collection"]


def test_a_replacement_over_http_keeps_the_path_ingest_gave_the_document(
    app: tuple[TestClient, Store],
) -> None:
    http, store = app
    put = "/v1/collections/kb/documents"
    first = {"id": "faq.md", "text": "opening hours", "metadata": {"path": "faq.md"}}
    assert http.put(put, json={"documents": [first]}, headers=auth(WRITE)).status_code == 200
    again = {"id": "faq.md", "text": "opening hours nine to five", "metadata": {"lang": "en"}}
    assert http.put(put, json={"documents": [again]}, headers=auth(WRITE)).status_code == 200
    (point,) = store.scroll(store.aliases()["kb"], flt=SearchFilter(doc_ids=("faq.md",)))
    assert point.payload["metadata"] == {"lang": "en", "path": "faq.md"}


def test_a_delete_over_http_loads_no_model(tmp_path: Path, tiny_encoder: Encoder) -> None:
    store = ServerStore(QdrantClient(":memory:"))
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=tiny_encoder, store=store, lock_dir=tmp_path
    )
    loads: list[int] = []

    def load() -> Encoder:
        loads.append(1)
        return tiny_encoder

    # a BM25-only service: the model would load on the first request that needs it
    retriever = Retriever(load_encoder=load, store=store, collection="kb")
    settings = Settings(
        data_dir=tmp_path, write_api_key=WRITE, write_window_ms=10, write_interval_ms=0
    )
    with TestClient(create_app(retriever, settings)) as http:
        r = http.post(
            "/v1/collections/kb/documents:delete", json={"ids": ["d1"]}, headers=auth(WRITE)
        )
        assert r.status_code == 200 and r.json()["report"]["deleted"] == 1, r.text
        assert loads == []
        doc = {"id": "d9", "title": "new", "text": "a new text to embed"}
        r = http.put("/v1/collections/kb/documents", json={"documents": [doc]}, headers=auth(WRITE))
        assert r.status_code == 200 and loads == [1], r.text


def test_the_write_key_is_required_and_the_read_key_does_not_write(
    app: tuple[TestClient, Store],
) -> None:
    http, store = app
    body = {"documents": [{"id": "x", "text": "apple"}]}
    for headers in ({}, auth(READ), auth("wrong")):
        r = http.put("/v1/collections/kb/documents", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", headers
        assert "RAG_WRITE_API_KEY" in r.json()["detail"]
    # and the write key does not read
    assert http.post("/v1/search", json={"query": "apple"}, headers=auth(WRITE)).status_code == 401
    assert len(store.versions("kb")) == 1


@pytest.mark.parametrize("tail", ["%0A", "%0D", "%0a%0A", "%00", "%09"])
def test_a_control_character_after_the_path_does_not_make_a_write_a_read(
    app: tuple[TestClient, Store], tail: str
) -> None:
    """A route's `$` also matches before a final newline, and the server decodes `%0A` into the
    path: `/documents%0A` once reached the write route as a read, past the write key (found
    by a review). Neither no key nor the read key may write through any such path."""
    http, store = app
    body = {"documents": [{"id": "x", "text": "apple"}]}
    for headers in ({}, auth(READ)):
        for method, path, payload in (
            ("PUT", f"/v1/collections/kb/documents{tail}", body),
            ("POST", f"/v1/collections/kb/documents:delete{tail}", {"ids": ["d1"]}),
        ):
            r = http.request(method, path, json=payload, headers=headers)
            assert r.status_code in (401, 403, 404), (method, path, headers, r.text)
    assert len(store.versions("kb")) == 1
    assert writes_module_is_write_path("/v1/collections/kb/documents\n")
    assert not writes_module_is_write_path("/v1/collections/kb/documents/x")


def writes_module_is_write_path(path: str) -> bool:
    from rag_retriever.service.keys import is_write_path

    return is_write_path(path)


def test_write_endpoints_are_absent_without_a_write_key(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    client, _ = make_app(tmp_path, tiny_encoder, write_api_key=None, api_key=None)
    with client as http:
        r = http.put("/v1/collections/kb/documents", json={"documents": [{"id": "x", "text": "a"}]})
        assert r.status_code == 404
        assert "/v1/collections/{alias}/documents" not in http.get("/openapi.json").json()["paths"]


def test_the_schema_documents_the_write_endpoints(app: tuple[TestClient, Store]) -> None:
    http, _ = app
    paths = http.get("/openapi.json", headers=auth(READ)).json()["paths"]
    put = paths["/v1/collections/{alias}/documents"]["put"]
    assert {"200", "202", "401", "409", "413", "422"} <= set(put["responses"])
    assert "post" in paths["/v1/collections/{alias}/documents:delete"]


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"documents": []}, "documents"),
        ({"documents": [{"id": "", "text": "x"}]}, "documents.0.id"),
        ({"documents": [{"id": "a"}]}, "documents.0.text"),
        ({"documents": [{"id": "a", "text": "x", "extra": 1}]}, "documents.0.extra"),
        ({"documents": [{"id": "a", "text": "   "}]}, "no text"),
        ({"documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}, "duplicate id 'a'"),
        ({"documents": [{"id": "a", "text": "x"}], "wait": 1000}, "wait"),
    ],
)
def test_bad_documents_are_422_and_nothing_is_written(
    app: tuple[TestClient, Store], body: dict, where: str
) -> None:
    http, store = app
    r = http.put("/v1/collections/kb/documents", json=body, headers=auth(WRITE))
    assert r.status_code == 422, r.text
    assert where in r.json()["detail"]
    assert len(store.versions("kb")) == 1


def test_a_write_to_an_alias_without_a_version_is_409_with_the_fix(
    app: tuple[TestClient, Store],
) -> None:
    http, _ = app
    r = http.put(
        "/v1/collections/other/documents",
        json={"documents": [{"id": "a", "text": "x"}]},
        headers=auth(WRITE),
    )
    assert r.status_code == 409 and "rag-retriever ingest" in r.json()["detail"]
    bad = http.put(
        "/v1/collections/_bad/documents",
        json={"documents": [{"id": "a", "text": "x"}]},
        headers=auth(WRITE),
    )
    assert bad.status_code == 422


def test_the_body_limit_applies_to_writes(tmp_path: Path, tiny_encoder: Encoder) -> None:
    client, _ = make_app(tmp_path, tiny_encoder, max_body_bytes=2000)
    with client as http:
        big = {"documents": [{"id": "a", "text": "apple " * 1000}]}
        r = http.put("/v1/collections/kb/documents", json=big, headers=auth(WRITE))
        assert r.status_code == 413


def test_writes_within_the_window_are_one_version(tmp_path: Path, tiny_encoder: Encoder) -> None:
    # a window far longer than the four requests need to arrive, even on a loaded CI machine
    # (400 ms was once too short there); the barrier sends them together
    client, store = make_app(tmp_path, tiny_encoder, write_window_ms=3000)
    together = threading.Barrier(4)
    with client as http:
        answers: list[dict] = []

        def send(i: int) -> None:
            doc = {"id": f"new{i}", "text": f"golf hotel india {i}"}
            together.wait()
            r = http.put(
                "/v1/collections/kb/documents", json={"documents": [doc]}, headers=auth(WRITE)
            )
            answers.append(r.json())

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert {a["collection"] for a in answers} == {store.aliases()["kb"]}
    assert all(a["grouped_requests"] == 4 for a in answers)
    assert len(store.versions("kb")) == 2  # the first ingest and one grouped delta
    assert {f"new{i}" for i in range(4)} <= set(served_docs(store))


def test_a_write_that_outlasts_its_wait_is_202_then_committed(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    client, store = make_app(tmp_path, tiny_encoder, write_window_ms=300)
    with client as http:
        r = http.put(
            "/v1/collections/kb/documents",
            json={"documents": [{"id": "late", "text": "kilo lima"}], "wait": 0},
            headers=auth(WRITE),
        )
        assert r.status_code == 202 and r.json()["status"] == "pending"
        done = http.get(f"{r.json()['poll']}?wait=30", headers=auth(WRITE))
        assert done.status_code == 200 and done.json()["status"] == "committed"
        assert http.get("/v1/changes/unknown", headers=auth(WRITE)).status_code == 404
        # a wait that is not a number of seconds within the bound is refused, not waited on
        # (nan waited forever on the event loop)
        for bad in ("nan", "inf", "-1", "301"):
            refused = http.get(f"{r.json()['poll']}?wait={bad}", headers=auth(WRITE))
            assert refused.status_code == 422, (bad, refused.text)
    assert "late" in served_docs(store)


def test_merge_keeps_the_last_word_on_each_id() -> None:
    a, b = Document("x", "x", "one"), Document("x", "x", "two")
    other = Document("x", "x", "acme's", {"tenant": "acme"})  # the same id, another document
    group = [
        Change("1", "kb", (a, other), ()),
        Change("2", "kb", (), (("", "x"), ("", "y"))),
        Change("3", "kb", (b,), ()),
    ]
    upserts, deletes = merge(group)
    assert upserts == {("", "x"): b, ("acme", "x"): other} and deletes == {("", "y")}


def edge_app(tmp_path: Path, encoder: Encoder, **settings: object) -> tuple[Any, EdgeStore]:
    """The app over Qdrant Edge holding DOCS, its writes grouped within 10 ms."""
    store = EdgeStore(tmp_path / "edge")
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=encoder, store=store, lock_dir=tmp_path
    )
    retriever = Retriever(encoder=encoder, store=store, collection="kb")
    values = {
        "data_dir": tmp_path,
        "write_api_key": WRITE,
        "write_window_ms": 10,
        "write_interval_ms": 0,
        "bm25_rebase_drift": 1.0,
        **settings,
    }
    return create_app(retriever, Settings(**values)), store


def test_both_clients_write_with_the_write_key(tmp_path: Path, tiny_encoder: Encoder) -> None:
    app, store = edge_app(tmp_path, tiny_encoder, api_key=READ, compaction="inline")
    with serve_in_thread(app) as url:
        with RetrieverClient(url, api_key=READ, write_api_key=WRITE) as client:
            status = client.upsert_documents(
                [Document("c1", "c", "mike november")], collection="kb"
            )
            assert status.status == "committed" and status.kind == "delta"
            assert client.search("mike november", mode="bm25", k=1)[0].doc_id == "c1"
            gone = client.delete_documents(["c1"], collection="kb")
            assert gone.report is not None and gone.report["deleted"] == 1
            assert client.change(gone.change_id).collection == gone.collection
        with RetrieverClient(url, api_key=READ) as reader, pytest.raises(Unauthorized):
            reader.upsert_documents([Document("c2", "c", "x")], collection="kb")

        async def run() -> str:
            async with AsyncRetrieverClient(url, api_key=READ, write_api_key=WRITE) as client:
                status = await client.upsert_documents(
                    [Document("a1", "a", "oscar papa")], collection="kb"
                )
                return status.status

        assert asyncio.run(run()) == "committed"
    assert {"a1"} <= set(served_docs(store)) and "c1" not in served_docs(store)
    store.close()


def test_the_service_compacts_outgrown_deltas_in_the_background(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    from rag_retriever.ingest.compaction import wait_for_compactions

    app, store = edge_app(tmp_path, tiny_encoder, compaction="background")
    expected = {d.id: d.text for d in DOCS}
    with TestClient(app) as http:
        for i in range(4):  # each replaces a document: the deltas outgrow the 6-point base
            doc = {"id": f"d{i}", "text": f"golf hotel {i}"}
            r = http.put(
                "/v1/collections/kb/documents", json={"documents": [doc]}, headers=auth(WRITE)
            )
            assert r.status_code == 200, r.text
            expected[doc["id"]] = doc["text"]
        assert wait_for_compactions(120)
        name = store.aliases()["kb"]
        assert store.record(name).lineage.compacted
        assert served_docs(store) == expected
        hits = http.post("/v1/search", json={"query": "golf hotel", "k": 10, "mode": "bm25"})
        assert hits.status_code == 200 and len(hits.json()["hits"]) == 4
    store.close()


def test_client_errors_are_the_in_process_errors_of_their_code() -> None:
    """Code written against the in-process retriever catches the same exceptions over HTTP."""
    import httpx

    from rag_retriever.client import NotFound, http_error
    from rag_retriever.errors import CollectionNotFound, UpdateRefused, VersionIncompatible

    def answer(status: int, code: str) -> Exception:
        return http_error(httpx.Response(status, json={"error": code, "detail": "why"}))

    missing = answer(404, "collection_not_found")
    assert isinstance(missing, NotFound) and isinstance(missing, CollectionNotFound)
    assert isinstance(answer(409, "version_incompatible"), VersionIncompatible)
    assert isinstance(answer(409, "update_refused"), UpdateRefused)
    assert not isinstance(answer(404, "not_found"), CollectionNotFound)  # a wrong URL
    assert type(answer(404, "collection_not_found")) is type(missing)  # one class per pair


# -- issue 39: bad input is a 422 at the edge, never an engine failure at seal -----------------


def nested(levels: int, inner: object = "x", *, array: bool = False) -> object:
    """`inner` inside `levels` objects (or arrays)."""
    for _ in range(levels):
        inner = [inner] if array else {"a": inner}
    return inner


def data_dir_state(store: EdgeStore, root: Path) -> tuple[object, ...]:
    """What a failed write must leave as it was: the alias, every version, every file."""
    files = sorted((p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*"))
    return store.aliases(), store.versions("kb"), files


def send(http: TestClient, path: str, body: dict[str, Any]) -> Any:
    """`body` as Python's json writes it: NaN and Infinity as such, a lone surrogate as its
    \\ud800 escape (what a hostile client can send; httpx's json= refuses both)."""
    raw = json.dumps(body).encode()
    headers = {**auth(WRITE), "content-type": "application/json"}
    if path.endswith(":delete"):
        return http.post(path, content=raw, headers=headers)
    return http.put(path, content=raw, headers=headers)


UPSERT = "/v1/collections/kb/documents"
FINDINGS = [
    # (what, path, body, what the 422 names)
    (
        "200 levels of objects",
        UPSERT,
        {"documents": [{"id": "n", "text": "apple", "metadata": {"k": nested(200)}}]},
        "metadata['k']['a']",
    ),
    (
        "200 levels of arrays",
        UPSERT,
        {"documents": [{"id": "n", "text": "apple", "metadata": {"k": nested(200, array=True)}}]},
        "metadata['k'][0]",
    ),
    (
        "a lone surrogate in a metadata value",
        UPSERT,
        {"documents": [{"id": "n", "text": "apple", "metadata": {"k": "\ud800"}}]},
        "metadata['k'] is not valid Unicode",
    ),
    (
        "a lone surrogate in a nested metadata key",
        UPSERT,
        {"documents": [{"id": "n", "text": "apple", "metadata": {"k": [{"\udfff": 1}]}}]},
        "metadata['k'][0] has the key '\\udfff'",
    ),
    (
        "a lone surrogate in an id to delete",
        "/v1/collections/kb/documents:delete",
        {"ids": ["d1", "\ud800"]},
        "ids.1",
    ),
    (
        "NaN",
        UPSERT,
        {"documents": [{"id": "n", "text": "apple", "metadata": {"k": float("nan")}}]},
        "metadata['k'] is nan",
    ),
    (
        "Infinity, nested",
        UPSERT,
        {"documents": [{"id": "n", "text": "apple", "metadata": {"k": {"x": [float("inf")]}}}]},
        "metadata['k']['x'][0] is inf",
    ),
    (
        "an integer no client keeps exact",
        UPSERT,
        {"documents": [{"id": "n", "text": "apple", "metadata": {"k": 10**20}}]},
        "metadata['k'] is 100000000000000000000",
    ),
]


@pytest.mark.parametrize(("what", "path", "body", "named"), FINDINGS, ids=[f[0] for f in FINDINGS])
def test_each_finding_is_a_422_naming_the_field_and_writes_nothing(
    tmp_path: Path, tiny_encoder: Encoder, what: str, path: str, body: dict, named: str
) -> None:
    """Each input once reached the engine: a 503 at seal (nesting), a 500 (the others)."""
    app, store = edge_app(tmp_path, tiny_encoder, compaction="inline")
    before = data_dir_state(store, tmp_path / "edge")
    with TestClient(app) as http:
        r = send(http, path, body)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert named in detail, detail
        if path == UPSERT:  # the document, by position and id
            assert "documents[0] (id 'n')" in detail and r.json()["error"] == "invalid_documents"
        assert data_dir_state(store, tmp_path / "edge") == before
        # the same body, made valid, is written: the refusal was about that field alone
        fine = send(http, UPSERT, {"documents": [{"id": "n", "text": "apple", "metadata": {}}]})
        assert fine.status_code == 200, fine.text
    store.close()


def test_the_metadata_bounds_are_inclusive_and_named(tmp_path: Path, tiny_encoder: Encoder) -> None:
    from rag_retriever.ingest.validation import MAX_METADATA_BYTES, MAX_METADATA_DEPTH

    app, store = edge_app(tmp_path, tiny_encoder, compaction="inline")
    deepest = {"k": nested(MAX_METADATA_DEPTH - 2, {"leaf": 1})}  # the object itself is level 1
    # {"k":"<pad>"} is 8 bytes of compact JSON around the pad
    largest = {"k": "x" * (MAX_METADATA_BYTES - 8)}
    with TestClient(app) as http:
        for metadata in (deepest, largest):
            doc = {"id": "edge", "text": "apple", "metadata": metadata}
            r = send(http, UPSERT, {"documents": [doc]})
            assert r.status_code == 200, r.text[:300]
        served = {
            str(p.payload["doc_id"]): p.payload["metadata"]
            for p in store.scroll(store.aliases()["kb"])
        }
        assert served["edge"] == largest
        too_deep = {"k": nested(MAX_METADATA_DEPTH - 1, {"leaf": 1})}
        too_big = {"k": "x" * (MAX_METADATA_BYTES - 7)}
        for metadata, named in ((too_deep, "MAX_METADATA_DEPTH"), (too_big, "MAX_METADATA_BYTES")):
            r = send(http, UPSERT, {"documents": [{"id": "e", "text": "a", "metadata": metadata}]})
            assert r.status_code == 422 and named in r.json()["detail"], r.text[:300]
    assert len(store.versions("kb")) == 3
    store.close()


def test_a_body_nested_past_the_json_parser_is_a_400(app: tuple[TestClient, Store]) -> None:
    http, store = app
    raw = '{"documents": [{"id": "n", "text": "a", "metadata": {"k": ' + "[" * 100_000
    raw += "]" * 100_000 + "}}]}"
    r = http.put(
        UPSERT,
        content=raw.encode(),
        headers={**auth(WRITE), "content-type": "application/json"},
    )
    assert r.status_code == 400 and "nests too deeply" in r.json()["detail"]
    assert len(store.versions("kb")) == 1


def test_the_schema_states_the_write_rules(app: tuple[TestClient, Store]) -> None:
    from rag_retriever.ingest.validation import MAX_METADATA_BYTES, MAX_METADATA_DEPTH

    http, _ = app
    schema = http.get("/openapi.json", headers=auth(READ)).json()
    document = schema["components"]["schemas"]["DocumentIn"]["properties"]
    described = document["metadata"]["description"]
    assert f"{MAX_METADATA_DEPTH} levels" in described
    assert str(MAX_METADATA_BYTES) in described and "finite" in described
    assert "pattern" in document["text"] and "pattern" in document["id"]
    put = schema["paths"]["/v1/collections/{alias}/documents"]["put"]
    alias = next(p for p in put["parameters"] if p["name"] == "alias")
    assert alias["schema"]["maxLength"] == 64
    assert {"400", "415", "500"} <= set(put["responses"])


def test_the_python_writes_refuse_the_same_inputs(tmp_path: Path, tiny_encoder: Encoder) -> None:
    from rag_retriever.errors import DocumentError
    from rag_retriever.ingest.writer import update_documents

    store = EdgeStore(tmp_path / "edge")
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=tiny_encoder, store=store, lock_dir=tmp_path
    )
    before = data_dir_state(store, tmp_path / "edge")
    bad = Document("x", "x", "apple", {"k": nested(200, array=True)})
    with pytest.raises(DocumentError, match=r"t\[6\] \(id 'x'\): metadata\['k'\]"):
        ingest_documents(
            LoadedCorpus((*DOCS, bad), 0, "t"),
            alias="kb",
            encoder=tiny_encoder,
            store=store,
            lock_dir=tmp_path,
        )
    common: dict[str, Any] = {
        "alias": "kb",
        "encoder": tiny_encoder,
        "store": store,
        "lock_dir": tmp_path,
    }
    with pytest.raises(DocumentError, match="metadata numbers must be finite"):
        update_documents([Document("y", "y", "pear", {"k": float("inf")})], **common)
    with pytest.raises(DocumentError, match=r"update\[0\]: id '\\ud800' is not valid Unicode"):
        update_documents([], ["\ud800"], **common)
    assert data_dir_state(store, tmp_path / "edge") == before
    store.close()


def test_rag_max_document_chars_is_the_limit_of_every_write_path(
    tmp_path: Path, tiny_encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lowered, it refuses a longer text over HTTP, from Python and from the CLI; and the writer
    checks the limit it is given (it used to re-check the default, so a raised limit let a text
    through the route that the writer then refused)."""
    from rag_retriever import Collection, DocumentError
    from rag_retriever.cli import main

    client, _ = make_app(tmp_path, tiny_encoder, max_document_chars=40)
    long_doc = {"id": "long", "title": "long", "text": "river city " * 10}  # 110 characters
    with client as http:
        r = http.put(
            "/v1/collections/kb/documents", json={"documents": [long_doc]}, headers=auth(WRITE)
        )
        assert r.status_code == 422 and "over the limit of 40 (RAG_MAX_DOCUMENT_CHARS)" in r.text

    monkeypatch.setenv("RAG_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RAG_EMBED_MODEL", str(tiny_encoder.source))
    monkeypatch.setenv("RAG_MAX_DOCUMENT_CHARS", "40")
    kb = Collection.open("kb")
    try:
        with pytest.raises(DocumentError, match="over the limit of 40"):
            kb.ingest([long_doc])
        path = tmp_path / "long.jsonl"
        path.write_text(json.dumps(long_doc) + "\n")
        assert main(["ingest", str(path), "--collection", "kb", "--no-progress"]) == 2

        doc = Document("long", "long", long_doc["text"])
        store = kb.retriever.store
        with pytest.raises(DocumentError, match="over the limit of 100"):
            ingest_documents(
                LoadedCorpus((doc,), 0, "t"),
                alias="other",
                encoder=tiny_encoder,
                store=store,
                max_document_chars=100,
            )
        report = ingest_documents(
            LoadedCorpus((doc,), 0, "t"),
            alias="other",
            encoder=tiny_encoder,
            store=store,
            max_document_chars=200,
        )
        assert report.documents == 1
        with pytest.raises(DocumentError, match="over the limit of 100"):
            update_documents(
                [doc], alias="other", encoder=tiny_encoder, store=store, max_document_chars=100
            )
    finally:
        kb.retriever.store.close()


def test_writes_commit_in_the_writer_process(
    tmp_path: Path, tiny_encoder: Encoder, tiny_encoder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RAG_WRITE_PROCESS: the same answers and versions, committed by another process (the
    service's own `update_documents` refuses to run), a RagError keeping its status."""
    settings = Settings(
        data_dir=tmp_path,
        api_key=READ,
        write_api_key=WRITE,
        write_window_ms=10,
        write_interval_ms=0,
        embed_model=str(tiny_encoder_dir),
        write_process="true",
        collection="kb",
        bm25_rebase_drift=1.0,  # a delta, not a re-based build, for these few documents
    )
    store = EdgeStore(settings.edge_dir)
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=tiny_encoder, store=store, lock_dir=tmp_path
    )

    def not_here(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("committed in the serving process")

    monkeypatch.setattr("rag_retriever.service.writes.update_documents", not_here)
    app = create_app(Retriever(encoder=tiny_encoder, store=store, collection="kb"), settings)
    with TestClient(app) as http:
        doc = {"id": "d1", "title": "pear", "text": "qdrant vector search"}
        r = http.put("/v1/collections/kb/documents", json={"documents": [doc]}, headers=auth(WRITE))
        r = settled(http, r)
        assert r.status_code == 200, r.text
        assert r.json()["kind"] == "delta", json.dumps(r.json()["report"])
        assert r.json()["report"]["upserted"] == 1
        assert r.json()["collection"] == store.aliases()["kb"]
        assert served_docs(store)["d1"] == "qdrant vector search"
        hits = http.post(
            "/v1/search", json={"query": "qdrant vector", "mode": "hybrid"}, headers=auth(READ)
        )
        assert hits.json()["hits"][0]["doc_id"] == "d1"
        r = http.post(
            "/v1/collections/nope/documents:delete", json={"ids": ["d2"]}, headers=auth(WRITE)
        )
        r = settled(http, r)
        # UpdateRefused, raised in the writer process: its type and status come through
        assert r.status_code == 409, r.text
        assert r.json()["error"] == "update_refused" and "'nope' has no live version" in r.text
        helper = app.state.write_process
        assert helper._process.is_alive() and helper.pid != os.getpid()
        scraped = samples(http.get("/metrics", headers=auth(READ)).text)
        assert scraped[("rag_write_process_up", ())] == 1
        assert scraped[("rag_write_commits_total", (("outcome", "committed"),))] == 1
        assert scraped[("rag_write_commits_total", (("outcome", "failed"),))] == 1  # the 409
        # it runs only on CPU nothing else wants (the policy its later threads inherit)
        assert os.sched_getscheduler(helper.pid) == os.SCHED_IDLE
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{helper.pid}/task")} == {
            os.SCHED_IDLE
        }
        # the writer process dies: writes say so (503), queries go on
        os.kill(helper._process.pid, signal.SIGKILL)
        helper._process.join(10)
        r = http.put("/v1/collections/kb/documents", json={"documents": [doc]}, headers=auth(WRITE))
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "writer_unavailable"
        assert "writer process exited (code -9)" in r.text and "Restart the service" in r.text
        assert (
            samples(http.get("/metrics", headers=auth(READ)).text)[("rag_write_process_up", ())]
            == 0
        )
        hits = http.post("/v1/search", json={"query": "qdrant", "mode": "bm25"}, headers=auth(READ))
        assert hits.status_code == 200
    helper.close()
    assert not helper._process.is_alive()


def settled(http: TestClient, r: Any, polls: int = 4) -> Any:
    """The write's answer once it is committed or failed: a 202 (still pending after the
    request's wait) is polled, each poll waiting up to the service's longest. The writer process
    runs only on CPU nothing else wants (SCHED_IDLE): beside other CPU-heavy work it can wait
    minutes for its turn, which makes a slow test, not a failed one."""
    for _ in range(polls):
        if r.status_code != 202:
            return r
        r = http.get(f"{r.json()['poll']}?wait={MAX_WAIT_S:g}", headers=auth(WRITE))
    return r


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_write_metrics_show_what_waits_and_what_was_committed_or_failed() -> None:
    """A commit held back: one request pending, waiting since it came; released: committed and
    counted with its time; a refused commit counts as failed. No writer process: no up gauge."""
    release = threading.Event()
    outcomes = iter([None, UpdateRefused("no live version")])

    def commit(alias: str, upserts: Any, deletes: Any) -> Any:
        release.wait(30)
        refused = next(outcomes)
        if refused is not None:
            raise refused
        # the committer logs the report's version and kind and hands it to its requests
        return SimpleNamespace(collection="kb__v2", kind="delta")

    committer = GroupCommitter(commit, window_s=0.0)
    metrics = WriteMetrics(committer, None)

    def scrape() -> dict[str, float]:
        return {
            f"{m.name}{''.join(s.labels.values())}": s.value
            for m in metrics.collect()
            for s in m.samples
        }

    change = committer.submit("kb", [Document("d1", "t", "text")], [])
    assert scrape()["rag_writes_pending"] == 1
    assert scrape()["rag_writes_oldest_pending_seconds"] >= 0
    release.set()
    assert change.done.wait(30) and change.error is None
    after = scrape()
    assert after["rag_writes_pending"] == 0 and after["rag_writes_oldest_pending_seconds"] == 0
    assert after["rag_write_commitscommitted"] == 1 and after["rag_write_commitsfailed"] == 0
    assert after["rag_write_commit_seconds"] > 0
    assert "rag_write_process_up" not in after
    refused = committer.submit("kb", [], ["d1"])
    assert refused.done.wait(30) and isinstance(refused.error, UpdateRefused)
    assert scrape()["rag_write_commitsfailed"] == 1


def test_the_pending_gauge_counts_a_backlog_longer_than_the_changes_kept_for_lookups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the last KEEP_CHANGES changes are kept for status lookups; the pending gauge still
    counts every change not yet committed, and the oldest one's wait."""
    monkeypatch.setattr(writes, "KEEP_CHANGES", 2)
    release = threading.Event()

    def commit(alias: str, upserts: Any, deletes: Any) -> Any:
        release.wait(30)
        return SimpleNamespace(collection="kb__v2", kind="delta")

    committer = GroupCommitter(commit, window_s=0.0)
    first = committer.submit("kb", [Document("d0", "t", "text")], [])
    time.sleep(0.01)  # the later changes are received later
    changes = [committer.submit("kb", [Document(f"d{i}", "t", "text")], []) for i in range(1, 5)]
    with pytest.raises(CollectionNotFound):
        committer.get(first.id)  # forgotten for lookups, still pending
    before = time.time()
    pending, oldest = committer.waiting()
    assert pending == 5
    assert before - first.received <= oldest <= time.time() - first.received  # the first's wait
    release.set()
    assert all(c.done.wait(30) for c in [first, *changes])
    assert committer.waiting() == (0, 0.0)


def test_versions_start_at_least_the_interval_apart() -> None:
    """Changes that arrive while a version commits join the next, which starts no sooner than
    `interval_s` after it; a lone change after a quiet spell waits only the window."""
    starts: list[float] = []
    groups: list[int] = []
    first_started = threading.Event()
    release = threading.Event()

    def commit(alias: str, upserts: Any, deletes: Any) -> Any:
        starts.append(time.monotonic())
        groups.append(len(upserts))
        first_started.set()
        release.wait(30)
        return SimpleNamespace(collection="kb__v2", kind="delta")

    committer = GroupCommitter(commit, window_s=0.0, interval_s=0.3)
    first = committer.submit("kb", [Document("d0", "t", "text")], [])
    assert first_started.wait(30)
    later = [committer.submit("kb", [Document(f"d{i}", "t", "text")], []) for i in (1, 2)]
    release.set()
    assert all(c.done.wait(30) and c.error is None for c in [first, *later])
    assert groups == [1, 2]
    assert starts[1] - starts[0] >= 0.3
    assert [c.grouped for c in later] == [2, 2]
    # the wait, by how long ago the previous version started
    assert committer.delay_s(math.inf) == 0.0
    assert committer.delay_s(0.1) == pytest.approx(0.2)
    assert committer.delay_s(0.5) == 0.0
    windowed = GroupCommitter(commit, window_s=0.2, interval_s=1.0)
    assert windowed.delay_s(math.inf) == 0.2  # quiet: the window alone
    assert windowed.delay_s(0.9) == 0.2
    assert windowed.delay_s(0.25) == pytest.approx(0.75)


def test_the_writer_process_needs_the_embedded_store(tmp_path: Path, tiny_encoder: Encoder) -> None:
    with pytest.raises(ConfigError, match="RAG_WRITE_PROCESS needs the embedded store"):
        make_app(tmp_path, tiny_encoder, write_process="true")


def test_auto_starts_the_writer_process_in_serve_on_edge_only(tmp_path: Path) -> None:
    """RAG_WRITE_PROCESS=auto (the default): `serve` on the embedded store commits in a writer
    process; on a Qdrant server (whose writes run in the server), or when set, as set."""
    edge = EdgeStore(tmp_path / "edge")
    server = ServerStore(QdrantClient(":memory:"))
    auto = Settings(data_dir=tmp_path)
    assert auto.write_process == "auto"
    assert writes_in_a_process(auto, edge).write_process == "true"
    assert writes_in_a_process(auto, server).write_process == "false"
    off = Settings(data_dir=tmp_path, write_process="false")
    assert writes_in_a_process(off, edge).write_process == "false"
    edge.close()


def test_an_app_made_with_create_app_commits_in_its_own_process_under_auto(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    """auto in create_app: the app's Retriever holds its models, so its writes stay with it."""
    store = EdgeStore(tmp_path / "edge")
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=tiny_encoder, store=store, lock_dir=tmp_path
    )
    settings = Settings(data_dir=tmp_path, write_api_key=WRITE, bm25_rebase_drift=1.0)
    app = create_app(Retriever(encoder=tiny_encoder, store=store, collection="kb"), settings)
    assert not hasattr(app.state, "write_process")
    with TestClient(app) as http:
        doc = {"id": "d1", "title": "pear", "text": "qdrant vector search"}
        r = http.put("/v1/collections/kb/documents", json={"documents": [doc]}, headers=auth(WRITE))
        assert r.status_code == 200, r.text
    assert served_docs(store)["d1"] == "qdrant vector search"
    store.close()


def test_a_negative_write_interval_is_refused_at_start_up() -> None:
    from rag_retriever import cli

    with pytest.raises(ConfigError, match="RAG_WRITE_INTERVAL_MS"):
        Settings.from_env({"RAG_WRITE_INTERVAL_MS": "-1"})
    assert cli.main(["serve", "--port", "0", "--write-interval-ms", "-5"]) == 2


def test_waiting_writes_hold_no_worker_thread(tmp_path: Path, tiny_encoder: Encoder) -> None:
    """Writes that wait for their version wait on the event loop: with the worker threads cut to
    2, four waiting requests (the first a write, the others polls of it) leave /healthz and a
    search answering while they still wait. Waiting in a worker thread, they held the pool that
    every search and probe shares."""
    import anyio.to_thread

    client, _ = make_app(tmp_path, tiny_encoder, write_window_ms=8000)
    with client as http:

        async def two_threads() -> None:
            anyio.to_thread.current_default_thread_limiter().total_tokens = 2

        assert http.portal is not None
        http.portal.call(two_threads)
        first = http.put(
            "/v1/collections/kb/documents",
            json={"documents": [{"id": "late", "text": "kilo lima"}], "wait": 0},
            headers=auth(WRITE),
        )
        poll = first.json()["poll"]
        answers: list[int] = []

        def wait_for_it() -> None:
            answers.append(http.get(f"{poll}?wait=4", headers=auth(WRITE)).status_code)

        waiters = [threading.Thread(target=wait_for_it) for _ in range(4)]
        for t in waiters:
            t.start()
        time.sleep(0.5)  # the four are waiting
        assert http.get("/healthz").status_code == 200
        found = http.post("/v1/search", json={"query": "river"}, headers=auth(READ))
        assert found.status_code == 200
        assert any(t.is_alive() for t in waiters), "the probes answered only after the waits"
        for t in waiters:
            t.join()
        assert answers == [202] * 4


def test_until_set_returns_at_once_for_a_wait_that_is_no_positive_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without polling once (nan made `left <= 0` never true: it polled forever)."""

    async def no_poll(seconds: float) -> None:
        raise AssertionError(f"polled ({seconds} s)")

    monkeypatch.setattr(writes.asyncio, "sleep", no_poll)
    event = threading.Event()
    for timeout in (math.nan, 0.0, -1.0):
        asyncio.run(writes.until_set(event, timeout))
