"""The HTTP service on a real in-memory Qdrant with the tiny encoder; answers checked against the
in-process Retriever, limits and errors against their documented status codes and messages."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from qdrant_client import QdrantClient

from rag_retriever import cli
from rag_retriever.client import PayloadTooLarge, RetrieverClient
from rag_retriever.errors import ConfigError, ModelLoadError
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import SearchFilter
from rag_retriever.service import server
from rag_retriever.service.server import create_app, serve_in_thread
from rag_retriever.settings import Settings
from rag_retriever.store import ServerStore, StageQuery
from rag_retriever.store.base import QDRANT_EF_CONSTRUCT
from tests.test_retriever import DOCS

QUERIES = ["the king and the queen", "wine of the city", "apples", "river mountain war", "peace"]


@dataclass
class Served:
    retriever: Retriever
    settings: Settings
    collection: str


def build_retriever(encoder: Encoder, root: Path, *, alias: str = "kb") -> tuple[Retriever, str]:
    """DOCS ingested as `alias` into a fresh in-memory Qdrant; returns the retriever and version."""
    store = ServerStore(QdrantClient(":memory:"))
    report = ingest_documents(LoadedCorpus(DOCS, 0, "t"), alias=alias, encoder=encoder, store=store)
    return Retriever(encoder=encoder, store=store, collection=alias), (report.collection)


@contextmanager
def live_server(retriever: Retriever, settings: Settings) -> Iterator[str]:
    with serve_in_thread(create_app(retriever, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def served(tiny_encoder: Encoder, tmp_path_factory: pytest.TempPathFactory) -> Served:
    retriever, name = build_retriever(tiny_encoder, tmp_path_factory.mktemp("idx"))
    settings = Settings(max_k=8, default_k=5, max_query_chars=300, max_batch_size=3)
    return Served(retriever, settings, name)


@pytest.fixture
def http(served: Served) -> Iterator[TestClient]:
    with TestClient(create_app(served.retriever, served.settings)) as client:
        yield client


def without_timings(result: dict[str, Any]) -> dict[str, Any]:
    """What two answers to the same query share: all but the timings and the query's own id."""
    assert len(result["query_id"]) == 32  # every answer names its query
    return {k: v for k, v in result.items() if k not in ("timings_ms", "query_id")}


def assert_close(got: Any, expected: Any, path: str = "") -> None:
    """Equal, except floats within 1e-5: a query encoded on another thread can differ in the
    last bits of fp32 (a different CPU kernel split), never in ids, ranks or text."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), path
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), path
        for key in expected:
            assert_close(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_close(g, e, f"{path}[{i}]")
    else:
        assert got == expected, path


# -- answers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_search_answers_what_the_retriever_answers(
    http: TestClient, served: Served, mode: str
) -> None:
    response = http.post(
        "/v1/search", json={"query": "the king and the queen", "k": 4, "mode": mode}
    )
    assert response.status_code == 200
    body = response.json()
    expected = served.retriever.retrieve("the king and the queen", k=4, mode=mode)  # type: ignore[arg-type]
    assert_close(without_timings(body), without_timings(expected.to_dict()))
    assert set(body["timings_ms"]) == set(expected.timings_ms)
    assert [h["rank"] for h in body["hits"]] == [1, 2, 3, 4]
    if mode == "hybrid":  # per-stage ranks and scores travel with each hit
        assert all(h["fused"]["rank"] == h["rank"] for h in body["hits"])
        assert any(h["dense"] is not None and h["bm25"] is not None for h in body["hits"])


def test_defaults_filter_and_notices(http: TestClient, served: Served) -> None:
    body = http.post(
        "/v1/search", json={"query": "the wine of the king", "filter": {"equals": {"lang": "fr"}}}
    ).json()
    assert len(body["hits"]) == 5  # the settings' default_k, not the retriever config's 10
    assert body["mode"] == "hybrid" and body["collection"] == served.collection
    assert all(h["metadata"]["lang"] == "fr" for h in body["hits"])
    assert any("reranking is off" in n for n in body["notices"])
    expected = served.retriever.retrieve(
        "the wine of the king", k=5, filter=SearchFilter(equals={"lang": "fr"})
    )
    assert [h["chunk_id"] for h in body["hits"]] == [h.chunk_id for h in expected.hits]


def test_batch_equals_one_search_per_query(http: TestClient, served: Served) -> None:
    response = http.post("/v1/search/batch", json={"queries": QUERIES[:3], "k": 3, "mode": "dense"})
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["query"] for r in results] == QUERIES[:3]
    for query, result in zip(QUERIES[:3], results, strict=True):
        single = served.retriever.retrieve(query, k=3, mode="dense")
        assert [h["chunk_id"] for h in result["hits"]] == [h.chunk_id for h in single.hits]
    assert http.post("/v1/search/batch", json={"queries": []}).json() == {"results": []}


def test_collections_lists_aliases_versions_and_fingerprints(
    http: TestClient, served: Served
) -> None:
    body = http.get("/v1/collections").json()
    assert body["default_collection"] == "kb"
    kb = body["collections"]["kb"]
    assert kb["serving"] == served.collection
    [version] = kb["versions"]
    store = served.retriever.store
    assert version["collection"] == served.collection and version["serving"] is True
    assert version["status"] == "complete" and version["version"] == 1
    assert version["points"] == store.count(served.collection)
    assert version["fingerprint"] == served.retriever.encoder.fingerprint.id
    assert version["quantization"] == "none"  # how it holds its vectors (RAG_QUANTIZATION)
    assert version["graph_widths"] == [QDRANT_EF_CONSTRUCT]  # its graphs' (RAG_HNSW_EF_CONSTRUCT)


def test_probes_and_docs(http: TestClient, served: Served) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready" and ready.json()["serving"] == served.collection
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/search", "/v1/search/batch", "/v1/collections", "/healthz", "/readyz"} <= set(
        paths
    )


def test_not_ready_when_the_default_collection_is_missing(
    served: Served, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    retriever = Retriever(encoder=tiny_encoder, store=served.retriever.store, collection="nope")
    with TestClient(create_app(retriever, served.settings)) as client:
        assert client.get("/healthz").status_code == 200  # alive, just not ready
        response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not_ready" and body["error"] == "collection_not_found"
    assert "'nope' does not exist in " in body["detail"] and "existing: kb" in body["detail"]


# -- limits -------------------------------------------------------------------------------------


class AnyResponse(Protocol):
    """An httpx response, or the one Starlette's TestClient returns (another httpx package)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def json(self) -> Any: ...


def assert_error(response: AnyResponse, status: int, code: str, *fragments: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error", "detail"} and body["error"] == code
    for fragment in fragments:
        assert fragment in body["detail"]


def test_limits_come_from_the_settings(http: TestClient) -> None:
    # The retriever would allow k up to 100 and queries of 2000 characters; the server does not.
    assert http.post("/v1/search", json={"query": "king", "k": 8}).status_code == 200
    assert_error(
        http.post("/v1/search", json={"query": "king", "k": 9}),
        422,
        "invalid_request",
        "from 1 to 8 (RAG_MAX_K), got 9",
    )
    assert_error(
        http.post("/v1/search", json={"query": "king", "k": 0}), 422, "invalid_request", "got 0"
    )
    assert http.post("/v1/search", json={"query": "k" * 300}).status_code == 200
    assert_error(
        http.post("/v1/search", json={"query": "k" * 301}),
        422,
        "invalid_request",
        "301 characters long; the limit is 300 (RAG_MAX_QUERY_CHARS)",
    )
    assert_error(
        http.post("/v1/search/batch", json={"queries": ["a", "k" * 301]}),
        422,
        "invalid_request",
        "queries[1]: the query is 301 characters",
    )
    assert http.post("/v1/search/batch", json={"queries": ["a", "b", "c"]}).status_code == 200
    assert_error(
        http.post("/v1/search/batch", json={"queries": ["a", "b", "c", "d"]}),
        422,
        "invalid_request",
        "4 queries; the limit is 3 (RAG_MAX_BATCH_SIZE)",
    )


@pytest.fixture
def small_body_app(served: Served) -> Iterator[TestClient]:
    settings = served.settings.replace(max_body_bytes=200)
    with TestClient(create_app(served.retriever, settings)) as client:
        yield client


def test_body_limit_by_content_length(small_body_app: TestClient) -> None:
    fits = json.dumps({"query": "king " * 20})  # 111 bytes
    assert small_body_app.post("/v1/search", content=fits, headers=JSON).status_code == 200
    too_big = json.dumps({"query": "king " * 60})
    assert_error(
        small_body_app.post("/v1/search", content=too_big, headers=JSON),
        413,
        "payload_too_large",
        "over 200 bytes (RAG_MAX_BODY_BYTES)",
    )


JSON = {"content-type": "application/json"}


def test_body_limit_cannot_be_bypassed_by_a_false_content_length(
    small_body_app: TestClient,
) -> None:
    too_big = json.dumps({"query": "king " * 60}).encode()
    headers = {**JSON, "content-length": "20"}  # claims 20 bytes, sends 313
    response = small_body_app.post("/v1/search", content=too_big, headers=headers)
    assert_error(response, 413, "payload_too_large")


def test_body_limit_counts_a_streamed_body_without_content_length(served: Served) -> None:
    settings = served.settings.replace(max_body_bytes=200)

    def chunks(n: int) -> Iterator[bytes]:
        yield b'{"query": "'
        for _ in range(n):
            yield b"king "
        yield b'"}'

    with live_server(served.retriever, settings) as url, httpx.Client(base_url=url) as client:
        ok = client.post("/v1/search", content=chunks(20), headers=JSON)
        big = client.post("/v1/search", content=chunks(400), headers=JSON)
        # No retries: a reset connection would surface as RetrieverUnavailable, not a 413.
        with (
            RetrieverClient(url, retries=0) as rc,
            pytest.raises(PayloadTooLarge, match="RAG_MAX_BODY_BYTES"),
        ):
            rc.search("king " * 20_000)  # 100 kB, with a Content-Length
    assert "content-length" not in ok.request.headers  # sent chunked
    assert ok.status_code == 200
    assert_error(big, 413, "payload_too_large")


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "query: Field required"),
        ({"query": "x", "k": "5"}, "k: Input should be a valid integer"),
        ({"query": "x", "k": 2.5}, "k: Input should be a valid integer"),
        ({"query": "x", "top_k": 5}, "top_k: Extra inputs are not permitted"),
        ({"query": "x", "mode": "sparse"}, "mode: Input should be 'dense', 'bm25'"),
        ({"query": 5}, "query: Input should be a valid string"),
        ({"queries": "abc"}, "Field required"),
    ],
)
def test_request_validation_errors_are_422_json(
    http: TestClient, body: dict[str, Any], fragment: str
) -> None:
    assert_error(http.post("/v1/search", json=body), 422, "invalid_request", fragment)


def test_malformed_json_and_unknown_routes(http: TestClient) -> None:
    assert_error(
        http.post("/v1/search", content=b"{not json", headers=JSON),
        400,
        "bad_request",
        "the body is not valid JSON: Expecting property name",
    )
    assert_error(http.get("/v1/nothing"), 404, "not_found")
    assert_error(http.get("/v1/search"), 405, "method_not_allowed")


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{", "Expecting property name enclosed in double quotes at character 1"),
        (b'{"query": "k\xffng"}', "it is not UTF-8 text (byte 12)"),
    ],
)
def test_a_body_that_is_not_json_is_one_400_that_names_the_problem(
    http: TestClient, raw: bytes, fragment: str
) -> None:
    """Malformed JSON and bytes that are not UTF-8 are the same problem: one status, one code,
    the message the schema documents for 400."""
    response = http.post("/v1/search", content=raw, headers=JSON)
    assert_error(response, 400, "bad_request", "the body is not valid JSON: ", fragment)
    documented = http.get("/openapi.json").json()["paths"]["/v1/search"]["post"]["responses"]
    assert "not valid JSON" in documented["400"]["description"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_sent_as_another_content_type_is_named(http: TestClient, content_type: str) -> None:
    response = http.post(
        "/v1/search", content=b'{"query": "king"}', headers={"content-type": content_type}
    )
    assert_error(response, 415, "unsupported_media_type", repr(content_type), "application/json")
    assert "415" in http.get("/openapi.json").json()["paths"]["/v1/search"]["post"]["responses"]


@pytest.mark.parametrize(
    ("body", "status", "code", "fragment"),
    [
        ({"query": "x", "collection": "nope"}, 404, "collection_not_found", "existing: kb"),
        ({"query": "x", "collection": "../kb"}, 422, "invalid_request", "collection name"),
        ({"query": "x", "collection": "a__b"}, 422, "invalid_request", "collection name"),
        ({"query": "x", "collection": ""}, 422, "invalid_request", "collection name '' is not"),
        ({"query": "x", "mode": "rerank"}, 422, "invalid_request", "reranking is off"),
        ({"query": "   "}, 422, "invalid_request", "the query is empty"),
        (
            {"query": "x", "filter": {"range": {"a": 1}}},
            422,
            "invalid_request",
            "invalid filter: unknown filter keys ['range']",
        ),
        (
            {"query": "x", "filter": {"where": {"a": 1}}},
            422,
            "invalid_request",
            "invalid filter: where: unknown key(s) ['a']",
        ),
        (
            {"query": "x", "filter": {"equals": {"year": 2.5}}},
            422,
            "invalid_request",
            "must be a string, integer or boolean",
        ),
    ],
)
def test_rag_errors_keep_their_status_and_message(
    http: TestClient, body: dict[str, Any], status: int, code: str, fragment: str
) -> None:
    assert_error(http.post("/v1/search", json=body), status, code, fragment)


def test_fingerprint_mismatch_is_409(
    served: Served, tiny_encoder: Encoder, tmp_path: Path, tiny_encoder_dir: Path
) -> None:
    import shutil

    from rag_retriever.models.profiles import ModelProfile, write_profile_file

    other_dir = Path(shutil.copytree(tiny_encoder_dir, tmp_path / "other"))
    write_profile_file(other_dir, ModelProfile("other-bert", "q: ", "p: ", "mean", 64))
    other = Retriever(
        encoder=Encoder.load(str(other_dir), device="cpu"),
        store=served.retriever.store,
        collection="kb",
    )
    with TestClient(create_app(other, served.settings)) as client:
        assert_error(
            client.post("/v1/search", json={"query": "king"}),
            409,
            "fingerprint_mismatch",
            "embedded with tiny-bert@",
        )
        ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["error"] == "fingerprint_mismatch"


class BrokenStore(ServerStore):
    """A store whose search fails the way a bug would, with internals in the message."""

    def search(self, name: str, queries: Sequence[StageQuery]) -> list[list[tuple[str, float]]]:
        if any(q.using == "dense" for q in queries):
            raise RuntimeError("secret internal state at 0xdeadbeef")
        return super().search(name, queries)


def test_unexpected_errors_are_a_generic_500_and_logged(
    served: Served, tiny_encoder: Encoder, caplog: pytest.LogCaptureFixture
) -> None:
    broken = Retriever(
        encoder=tiny_encoder,
        store=BrokenStore(served.retriever.store.client),  # type: ignore[attr-defined]
        collection="kb",
    )
    with (
        caplog.at_level(logging.ERROR, logger="rag_retriever.service.server"),
        TestClient(create_app(broken, served.settings), raise_server_exceptions=False) as client,
    ):
        response = client.post("/v1/search", json={"query": "king", "mode": "dense"})
        bm25 = client.post("/v1/search", json={"query": "king", "mode": "bm25"})
    assert_error(response, 500, "internal_error", "see the server log")
    assert "secret" not in response.text and "Traceback" not in response.text
    assert "secret internal state" in caplog.text and "Traceback" in caplog.text
    assert bm25.status_code == 200  # the app keeps serving what does not touch the broken part


# -- API key ------------------------------------------------------------------------------------


@pytest.fixture
def keyed(served: Served) -> Iterator[TestClient]:
    settings = served.settings.replace(api_key="s3cret-key")
    with TestClient(create_app(served.retriever, settings)) as client:
        yield client


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret-key"},  # no scheme
        {"Authorization": "Basic s3cret-key"},
        {"X-API-Key": "s3cret-key-but-longer"},
        {"X-API-Key": ""},
    ],
)
def test_api_key_is_required_when_set(keyed: TestClient, headers: dict[str, str]) -> None:
    for response in (
        keyed.post("/v1/search", json={"query": "king"}, headers=headers),
        keyed.post("/v1/search/batch", json={"queries": ["king"]}, headers=headers),
        keyed.get("/v1/collections", headers=headers),
        keyed.get("/docs", headers=headers),
    ):
        assert_error(response, 401, "unauthorized", "RAG_API_KEY")
        assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer s3cret-key"},
        {"Authorization": "bearer s3cret-key"},
        {"X-API-Key": "s3cret-key"},
        {"X-API-Key": "s3cret-key", "Authorization": "Bearer wrong"},
    ],
)
def test_api_key_accepted(keyed: TestClient, headers: dict[str, str]) -> None:
    assert keyed.post("/v1/search", json={"query": "king"}, headers=headers).status_code == 200
    assert keyed.get("/v1/collections", headers=headers).status_code == 200


def test_probes_need_no_key_answer_head_and_reveal_nothing_without_it(keyed: TestClient) -> None:
    assert keyed.get("/healthz").status_code == 200
    assert keyed.head("/healthz").status_code == 200 and keyed.head("/readyz").status_code == 200
    anonymous = keyed.get("/readyz")
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ready"}
    full = keyed.get("/readyz", headers={"X-API-Key": "s3cret-key"}).json()
    assert full["status"] == "ready" and full["serving"] and full["model"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"query": "king \ud800"}, "not valid Unicode (a lone surrogate at character 5)"),
        ({"query": "king", "filter": {"equals": []}}, "'equals' must be an object"),
        # (no document can have it: writes refuse such names, docs/configuration.md)
        ({"query": "king", "filter": {"equals": {'a"b': "x"}}}, "has the field 'a\"b'"),
        ({"query": "king", "filter": {"doc_ids": ["\udc80"]}}, "filter doc id '\\udc80' is not"),
        ({"query": "king", "filter": {"equals": {"\udc80": "x"}}}, "filter field name '\\udc80'"),
        ({"query": "king", "filter": {"equals": {"a": "\udc80"}}}, "filter value for 'a' is not"),
    ],
)
def test_invalid_text_and_filters_are_422_not_500(
    http: TestClient, body: dict[str, Any], fragment: str
) -> None:
    raw = json.dumps(body)  # lone surrogates become \uXXXX escapes, as a client sends them
    response = http.post(
        "/v1/search", content=raw.encode(), headers={"content-type": "application/json"}
    )
    assert_error(response, 422, "invalid_request", fragment)


def test_one_bad_query_in_a_batch_is_named_by_its_index(http: TestClient) -> None:
    raw = '{"queries": ["king", "bad \\ud800"]}'
    response = http.post(
        "/v1/search/batch", content=raw.encode(), headers={"content-type": "application/json"}
    )
    assert_error(response, 422, "invalid_request", "queries[1]:", "not valid Unicode")


def test_the_schema_documents_every_error_answer(http: TestClient) -> None:
    schema = http.get("/openapi.json").json()
    search = schema["paths"]["/v1/search"]["post"]["responses"]
    assert {"200", "400", "401", "404", "409", "413", "422", "500", "503"} <= set(search)
    error = search["422"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("/ErrorBody")


def test_no_key_configured_means_open(http: TestClient) -> None:
    assert http.post("/v1/search", json={"query": "king"}).status_code == 200


# -- concurrency over a real socket -------------------------------------------------------------


def test_concurrent_requests_get_the_same_answers_as_sequential_ones(served: Served) -> None:
    jobs = [(q, mode) for q in QUERIES for mode in ("dense", "bm25", "hybrid")] * 4
    expected = {
        (q, mode): [h.chunk_id for h in served.retriever.search(q, k=5, mode=mode)]  # type: ignore[arg-type]
        for q, mode in set(jobs)
    }
    with live_server(served.retriever, served.settings) as url:

        def ask(job: tuple[str, str]) -> tuple[tuple[str, str], int, list[str]]:
            with httpx.Client(base_url=url, timeout=30) as client:
                response = client.post("/v1/search", json={"query": job[0], "k": 5, "mode": job[1]})
            ids = [h["chunk_id"] for h in response.json().get("hits", [])]
            return job, response.status_code, ids

        batch = {"queries": QUERIES[:3], "k": 5, "mode": "hybrid"}
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(ask, job) for job in jobs]
            batches = [
                pool.submit(httpx.post, f"{url}/v1/search/batch", json=batch, timeout=30)
                for _ in range(4)
            ]
            answers = [f.result() for f in futures]
            batch_answers = [f.result() for f in batches]
    assert len(answers) == len(jobs) == 60
    for job, status, ids in answers:
        assert status == 200 and ids == expected[job]
    for response in batch_answers:
        got = [[h["chunk_id"] for h in r["hits"]] for r in response.json()["results"]]
        assert got == [expected[(q, "hybrid")] for q in QUERIES[:3]]


def test_serve_in_thread_stops_when_the_block_exits(served: Served) -> None:
    with live_server(served.retriever, served.settings) as url:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/healthz").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=2)


# -- server-mode Qdrant that is not there -------------------------------------------------------


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port that is bound but not listening: connecting to it is refused at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


def test_unreachable_qdrant_server_is_reported_not_a_stack_trace(
    closed_port: int, tiny_encoder: Encoder, tmp_path: Path, served: Served
) -> None:
    # check_compatibility=False: the version probe would only add a warning from its own thread.
    client = QdrantClient(
        url=f"http://127.0.0.1:{closed_port}", timeout=5, check_compatibility=False
    )
    store = ServerStore(client)
    assert store.embedded is False
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="kb")
    ready, report = server.check_ready(retriever)
    assert not ready and report["error"] == "vector_store_unavailable"
    with TestClient(create_app(retriever, served.settings), raise_server_exceptions=False) as http:
        probe = http.get("/readyz")
        search = http.post("/v1/search", json={"query": "king"})
        alive = http.get("/healthz")
    assert probe.status_code == 503
    assert probe.json()["detail"].startswith("Qdrant is unreachable:")
    assert "Connection refused" in probe.json()["detail"]
    assert_error(search, 503, "vector_store_unavailable", "RAG_QDRANT_URL")
    assert "Traceback" not in probe.text + search.text
    assert alive.status_code == 200
    client.close()


# -- the CLI command ----------------------------------------------------------------------------


def test_serve_command_parses_and_passes_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[Settings, str, int]] = []
    monkeypatch.setattr(
        server, "serve", lambda settings, *, host, port: calls.append((settings, host, port))
    )
    monkeypatch.delenv("RAG_COLLECTION", raising=False)
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.collection) == ("127.0.0.1", 8000, None)
    code = cli.main(["serve", "--port", "9001", "--collection", "kb", "--data-dir", str(tmp_path)])
    assert code == 0
    [(settings, host, port)] = calls
    assert (host, port, settings.collection, settings.data_dir) == (
        "127.0.0.1",
        9001,
        "kb",
        tmp_path,
    )


def test_loopback_detection() -> None:
    assert server._is_loopback("127.0.0.1") and server._is_loopback("::1")
    assert server._is_loopback("localhost")
    assert not server._is_loopback("0.0.0.0") and not server._is_loopback("example.com")


def test_hits_survive_json_exactly(http: TestClient, served: Served) -> None:
    """JSON keeps every float exactly: the HTTP answer rebuilds into the server's own records."""
    from rag_retriever.records import SearchResult

    body = http.post("/v1/search", json={"query": "apples wine", "k": 6, "mode": "bm25"}).json()
    remote = SearchResult.from_dict(body)
    local = served.retriever.retrieve("apples wine", k=6, mode="bm25")  # no fp32 encoder noise
    assert remote.hits == local.hits and len(remote.hits) >= 3
    assert np.isfinite([h.score for h in remote.hits]).all()


# -- the load benchmark (a smoke run: structure and error counting, no timing thresholds) ------


def test_bench_load_runs_both_phases(served: Served, tmp_path: Path) -> None:
    from bench.bench_load import load_questions, report, run_benchmark

    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(json.dumps({"id": str(i), "question": q}) + "\n" for i, q in enumerate(QUERIES))
        + "\n",
        encoding="utf-8",
    )
    queries = load_questions(questions)
    assert queries == QUERIES
    results = run_benchmark(
        served.retriever,
        served.settings,
        collection="kb",
        questions=questions,
        clients=2,
        seconds=0.3,
        k=3,
    )
    assert results["config"]["collection"] == served.collection
    assert results["config"]["questions"] == len(QUERIES)
    for key in ("http", "in_process"):
        assert results[key]["requests"] > 0 and results[key]["errors"] == 0
        lat = results[key]["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
    ratio = results["http"]["requests_per_s"] / results["in_process"]["requests_per_s"]
    assert results["http_over_in_process_throughput"] == pytest.approx(ratio)
    assert any("HTTP throughput / in-process throughput" in line for line in report(results))
    json.dumps(results)  # the --out file is plain JSON


def test_bench_load_stops_when_the_server_refuses_the_queries(served: Served) -> None:
    from bench.bench_load import run_load
    from rag_retriever.client import UnprocessableRequest

    strict = served.settings.replace(max_query_chars=5)
    # The warm-up requests are not counted as errors: a misconfigured run fails loudly.
    with pytest.raises(UnprocessableRequest, match="the limit is 5"):
        run_load(served.retriever, strict, ["too long a query"], clients=1, seconds=0.1, k=3)


def test_bench_questions_must_have_a_question(tmp_path: Path) -> None:
    from bench.bench_load import load_questions

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{"query": "no"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no non-empty string field 'question'"):
        load_questions(bad)
    assert load_questions(bad, limit=1) == ["ok"]


def test_serve_on_a_busy_port_fails_before_loading_any_model(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        # the model does not exist: had serve loaded it first, this would be a ModelLoadError
        settings = Settings(data_dir=tmp_path, embed_model=str(tmp_path / "no-such-model"))
        with pytest.raises(ConfigError, match="choose another with --port"):
            server.serve(settings, port=busy.getsockname()[1])
    finally:
        busy.close()


def test_a_missing_reranker_directory_is_named() -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        CrossEncoderReranker.load("./models/not-there")


def test_an_error_quoting_a_lone_surrogate_is_still_answered(served: Served) -> None:
    """A message that quotes the client's text as it is can hold a lone surrogate, which UTF-8
    cannot carry: the boundary escapes it, so the answer is the error's own 4xx, not a 500."""
    from rag_retriever.errors import InvalidRequest

    app = create_app(served.retriever, served.settings)

    def refuse() -> None:
        raise InvalidRequest("the field 'a\ud800' is unknown")

    app.add_api_route("/refuse", refuse, methods=["GET"])
    with TestClient(app) as http:
        r = http.get("/refuse")
    assert r.status_code == 422 and r.json()["detail"] == "the field 'a\\ud800' is unknown"


def test_serve_keeps_an_idle_connection_open_longer_than_client_pools_do(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn's default keep-alive (5 s) equals httpx's pool expiry: the server closed pooled
    connections as clients sent on them (an httpx.ReadError under load). `serve` passes
    RAG_KEEP_ALIVE_S (--keep-alive-s) to uvicorn; the default outlasts httpx's pools. uvicorn's
    Server is replaced (it would serve until stopped); the app and its config are real."""
    configs: list[Any] = []

    class Captured:
        def __init__(self, config: Any) -> None:
            configs.append(config)

        def run(self, sockets: list[socket.socket]) -> None:
            for sock in sockets:
                sock.close()

    monkeypatch.setattr(server.uvicorn, "Server", Captured)
    monkeypatch.setattr(server.Retriever, "from_settings", lambda settings: served.retriever)
    assert cli.main(["serve", "--port", "0", "--write-process", "false"]) == 0
    assert (
        cli.main(["serve", "--port", "0", "--write-process", "false", "--keep-alive-s", "90"]) == 0
    )
    default, chosen = (c.timeout_keep_alive for c in configs)
    client_pool_s = httpx.Limits().keepalive_expiry
    assert client_pool_s is not None and default == Settings().keep_alive_s > client_pool_s
    assert chosen == 90
    assert cli.main(["serve", "--port", "0", "--keep-alive-s", "0"]) == 2  # refused at start-up
