"""The HTTP clients: error paths against httpx.MockTransport, the happy path against a real
uvicorn server on loopback, compared with the in-process Retriever."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rag_retriever.client import (
    AsyncRetrieverClient,
    ClientClosed,
    ClientError,
    Conflict,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    RetrieverClient,
    RetrieverHTTPError,
    RetrieverUnavailable,
    ServerError,
    Unauthorized,
    UnexpectedResponse,
    UnprocessableRequest,
)
from rag_retriever.errors import RagError
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document, SearchFilter, SearchResult
from rag_retriever.settings import Settings
from tests.test_server import build_retriever, live_server

KEY = "client-test-key"


def result_json(query: str = "q") -> dict[str, Any]:
    hit = {
        "chunk_id": "c1",
        "doc_id": "d1",
        "title": "T",
        "text": "body",
        "start": 0,
        "end": 4,
        "chunk_index": 0,
        "rank": 1,
        "score": 0.5,
        "dense": {"rank": 1, "score": 0.5},
        "bm25": None,
        "fused": None,
        "rerank": None,
        "matched_terms": [],
        "metadata": {"lang": "en"},
    }
    return {
        "query": query,
        "mode": "dense",
        "collection": "kb__m__v1",
        "hits": [hit],
        "timings_ms": {"total": 1.0},
        "query_truncated": False,
        "notices": [],
    }


class Recorder:
    """A MockTransport handler that answers from a script and records every request."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def error(status: int, code: str, detail: str) -> httpx.Response:
    return httpx.Response(status, json={"error": code, "detail": detail})


def client_for(recorder: Recorder, **kwargs: Any) -> RetrieverClient:
    kwargs.setdefault("backoff", 0.0)
    return RetrieverClient("http://rag.test", transport=httpx.MockTransport(recorder), **kwargs)


def async_client_for(recorder: Recorder, **kwargs: Any) -> AsyncRetrieverClient:
    kwargs.setdefault("backoff", 0.0)
    return AsyncRetrieverClient(
        "http://rag.test", transport=httpx.MockTransport(recorder), **kwargs
    )


# -- requests -----------------------------------------------------------------------------------


def test_search_sends_only_the_options_given_and_the_key() -> None:
    recorder = Recorder(httpx.Response(200, json=result_json("who?")))
    with client_for(recorder, api_key="k1") as client:
        hits = client.search(
            "who?", k=3, mode="dense", filter=SearchFilter(doc_ids=("d1",), equals={"lang": "en"})
        )
        client.search("who?")
    first, second = recorder.requests
    assert first.method == "POST" and first.url == "http://rag.test/v1/search"
    assert first.headers["authorization"] == "Bearer k1"
    assert json.loads(first.content) == {
        "query": "who?",
        "k": 3,
        "mode": "dense",
        "filter": {"doc_ids": ["d1"], "equals": {"lang": "en"}},
    }
    assert json.loads(second.content) == {"query": "who?"}
    [hit] = hits
    assert (hit.chunk_id, hit.doc_id, hit.metadata) == ("c1", "d1", {"lang": "en"})
    assert hit.dense is not None and hit.dense.rank == 1 and hit.bm25 is None


def test_batch_and_collections_parse_the_server_shapes() -> None:
    recorder = Recorder(
        httpx.Response(200, json={"results": [result_json("a"), result_json("b")]}),
        httpx.Response(200, json={"default_collection": "kb", "collections": {}}),
    )
    with client_for(recorder) as client:
        batches = client.search_batch(["a", "b"], k=2)
        collections = client.collections()
    assert json.loads(recorder.requests[0].content) == {"queries": ["a", "b"], "k": 2}
    assert [len(b) for b in batches] == [1, 1]
    assert collections == {"default_collection": "kb", "collections": {}}
    assert "authorization" not in recorder.requests[0].headers


def test_both_clients_search_returns_the_query_id_with_the_hits() -> None:
    """Every search result carries its query id, as in-process: `search` and each list of
    `search_batch`; an answer without one (a server older than query ids) gives None."""
    from rag_retriever.query.hits import SearchHits

    def answers() -> Recorder:
        batch = [{**result_json("b"), "query_id": "id-b"}, {**result_json("c"), "query_id": "id-c"}]
        return Recorder(
            httpx.Response(200, json={**result_json("a"), "query_id": "id-a"}),
            httpx.Response(200, json={"results": batch}),
            httpx.Response(200, json=result_json("old")),  # no query_id field at all
        )

    with client_for(answers()) as client:
        hits, batches, old = client.search("a"), client.search_batch(["b", "c"]), client.search("x")

    async def run() -> tuple[SearchHits, list[SearchHits], SearchHits]:
        async with async_client_for(answers()) as client:
            return (
                await client.search("a"),
                await client.search_batch(["b", "c"]),
                await client.search("x"),
            )

    for got in ((hits, batches, old), asyncio.run(run())):
        one, many, older = got
        assert isinstance(one, SearchHits) and one.query_id == "id-a"
        assert [h.chunk_id for h in one] == ["c1"]
        assert [(type(b), b.query_id) for b in many] == [(SearchHits, "id-b"), (SearchHits, "id-c")]
        assert older.query_id is None and len(older) == 1


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (401, Unauthorized),
        (404, NotFound),
        (409, Conflict),
        (413, PayloadTooLarge),
        (422, UnprocessableRequest),
        (400, RetrieverHTTPError),
        (500, ServerError),
    ],
)
def test_error_statuses_raise_typed_errors_and_are_not_retried(
    status: int, cls: type[RetrieverHTTPError]
) -> None:
    recorder = Recorder(error(status, "some_code", "what went wrong, and the fix"))
    with client_for(recorder, retries=3) as client, pytest.raises(cls) as info:
        client.search("q")
    assert type(info.value) is cls
    assert (info.value.status, info.value.error) == (status, "some_code")
    assert info.value.detail == "what went wrong, and the fix"
    assert "what went wrong, and the fix" in str(info.value)
    assert isinstance(info.value, ClientError) and isinstance(info.value, RagError)
    assert info.value.http_status == status and info.value.code == "some_code"
    assert len(recorder.requests) == 1


def test_a_filter_in_its_dict_form_is_sent_as_the_same_filter() -> None:
    recorder = Recorder(httpx.Response(200, json=result_json()))
    as_dict = {"doc_ids": ["d1"], "equals": {"lang": "en"}}
    with client_for(recorder) as client:
        client.search("q", filter=as_dict)
        client.search("q", filter=SearchFilter(doc_ids=("d1",), equals={"lang": "en"}))
    first, second = (json.loads(r.content)["filter"] for r in recorder.requests)
    assert first == second == as_dict


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.search_batch("oil"), "not one string"),  # would be "o", "i", "l"
        (lambda c: c.search("q", filter=["d1"]), "filter must be a SearchFilter or its dict"),
        (lambda c: c.search("q", filter={"doc_id": ["d1"]}), "unknown filter keys"),
    ],
)
def test_a_call_the_client_cannot_mean_is_refused_before_it_is_sent(
    call: Any, message: str
) -> None:
    recorder = Recorder(httpx.Response(200, json=result_json()))
    with client_for(recorder) as client, pytest.raises(InvalidArgument, match=message):
        call(client)
    assert recorder.requests == []


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, text="<html>Welcome to the proxy</html>"),  # not JSON
        httpx.Response(200, json={"something": "else"}),  # JSON of another shape
    ],
)
def test_a_2xx_that_is_not_the_apis_answer_is_an_unexpected_response(
    answer: httpx.Response,
) -> None:
    with client_for(Recorder(answer)) as client:
        with pytest.raises(UnexpectedResponse, match="is not a rag-retriever answer"):
            client.search("q")
        with pytest.raises(UnexpectedResponse, match="is the base URL a rag-retriever service"):
            client.search_batch(["q"])


def test_a_closed_client_says_so() -> None:
    recorder = Recorder(httpx.Response(200, json=result_json()))
    client = client_for(recorder)
    client.close()
    with pytest.raises(ClientClosed, match="this client is closed"):
        client.search("q")
    with pytest.raises(ClientClosed):
        client.health()

    async def run() -> None:
        aclient = async_client_for(recorder)
        await aclient.aclose()
        with pytest.raises(ClientClosed, match="this client is closed"):
            await aclient.search("q")

    asyncio.run(run())
    assert recorder.requests == [] and issubclass(ClientClosed, ClientError)


def test_a_non_json_error_body_still_gives_a_typed_error() -> None:
    recorder = Recorder(httpx.Response(502, text="<html>Bad Gateway</html>"))
    with client_for(recorder, retries=2) as client, pytest.raises(ServerError) as info:
        client.collections()
    assert info.value.error == "http_502" and "Bad Gateway" in info.value.detail
    assert len(recorder.requests) == 3  # 502 is retried: a proxy may have restarted


@pytest.mark.parametrize(
    "failure",
    [
        httpx.ConnectError("connection refused"),
        httpx.ReadError("connection reset by peer"),
        httpx.ReadTimeout("timed out"),
        httpx.RemoteProtocolError("server disconnected"),
    ],
)
def test_transport_errors_are_retried_then_succeed(failure: Exception) -> None:
    recorder = Recorder(failure, failure, httpx.Response(200, json=result_json()))
    with client_for(recorder, retries=3) as client:
        hits = client.search("q")
    assert [h.chunk_id for h in hits] == ["c1"]
    assert len(recorder.requests) == 3
    assert all(r.method == "POST" for r in recorder.requests)  # searches are idempotent


def test_503_is_retried_then_succeeds() -> None:
    recorder = Recorder(
        error(503, "vector_store_unavailable", "Qdrant is unreachable"),
        httpx.Response(200, json=result_json()),
    )
    with client_for(recorder) as client:
        assert len(client.search("q")) == 1
    assert len(recorder.requests) == 2


def test_retries_exhausted_raise_unavailable_with_the_cause() -> None:
    recorder = Recorder(httpx.ConnectError("connection refused"))
    with client_for(recorder, retries=2) as client, pytest.raises(RetrieverUnavailable) as info:
        client.search("q")
    assert info.value.attempts == 3 and len(recorder.requests) == 3
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert "http://rag.test/v1/search" in str(info.value)
    assert "after 3 attempt(s)" in str(info.value) and "connection refused" in str(info.value)


def test_retries_zero_means_one_attempt() -> None:
    recorder = Recorder(httpx.ConnectError("refused"))
    with client_for(recorder, retries=0) as client, pytest.raises(RetrieverUnavailable):
        client.search("q")
    assert len(recorder.requests) == 1


def test_backoff_doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("rag_retriever.client.time.sleep", slept.append)
    recorder = Recorder(httpx.ConnectError("refused"))
    with (
        client_for(recorder, retries=3, backoff=0.5) as client,
        pytest.raises(RetrieverUnavailable),
    ):
        client.search("q")
    assert slept == [0.5, 1.0, 2.0]  # none after the last attempt


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"retries": -1}, "retries"), ({"backoff": -1}, "backoff")]
)
def test_bad_retry_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetrieverClient("http://rag.test", **kwargs)


def test_probes() -> None:
    with client_for(Recorder(httpx.Response(200, json={"status": "ok"}))) as client:
        assert client.health() is True
    with client_for(Recorder(error(503, "collection_not_found", "..."))) as client:
        assert client.ready() is False
    with client_for(Recorder(httpx.ConnectError("refused"))) as client:
        assert client.health() is False and client.ready() is False
    with (
        client_for(Recorder(error(404, "not_found", "Not Found"))) as client,
        pytest.raises(NotFound),
    ):
        client.health()  # a wrong base URL is an error, not "unhealthy"


def test_async_client_error_paths() -> None:
    async def run() -> None:
        recorder = Recorder(error(422, "invalid_request", "k must be an integer from 1 to 100"))
        async with async_client_for(recorder) as client:
            with pytest.raises(UnprocessableRequest, match="k must be an integer"):
                await client.search("q", k=1000)
        assert len(recorder.requests) == 1

        flaky = Recorder(
            httpx.ConnectError("refused"),
            httpx.ReadError("reset"),
            httpx.Response(200, json={"results": [result_json("a")]}),
        )
        async with async_client_for(flaky, api_key="k2") as client:
            [[hit]] = await client.search_batch(["a"])
            assert hit.chunk_id == "c1"
            assert await client.ready() is True  # the scripted 200 repeats
        assert len(flaky.requests) == 4
        assert flaky.requests[0].headers["authorization"] == "Bearer k2"

        down = Recorder(httpx.ConnectError("refused"))
        async with async_client_for(down, retries=1) as client:
            with pytest.raises(RetrieverUnavailable) as info:
                await client.collections()
            assert await client.health() is False
        assert info.value.attempts == 2

    asyncio.run(run())


# -- against a real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def remote(
    tiny_encoder: Encoder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Retriever, str]]:
    retriever, _ = build_retriever(tiny_encoder, tmp_path_factory.mktemp("client-idx"))
    settings = Settings(api_key=KEY, max_k=20)
    with live_server(retriever, settings) as url:
        yield retriever, url


def same_hits(got: SearchResult, expected: SearchResult) -> None:
    """Same chunks, ranks and stages; scores equal up to fp32 noise from another thread."""
    assert [(h.chunk_id, h.rank) for h in got.hits] == [(h.chunk_id, h.rank) for h in expected.hits]
    for g, e in zip(got.hits, expected.hits, strict=True):
        assert g.score == pytest.approx(e.score, rel=1e-5)
        for stage in ("dense", "bm25", "fused"):
            gs, es = getattr(g, stage), getattr(e, stage)
            assert (gs is None) == (es is None)
            if gs is not None:
                assert gs.rank == es.rank and gs.score == pytest.approx(es.score, rel=1e-5)
        assert (g.text, g.start, g.end, g.metadata) == (e.text, e.start, e.end, e.metadata)


def test_sync_client_against_a_real_server(remote: tuple[Retriever, str]) -> None:
    retriever, url = remote
    with RetrieverClient(url, api_key=KEY) as client:
        assert client.health() and client.ready()
        for mode in ("dense", "bm25", "hybrid"):
            got = client.retrieve("the wine of the king", k=6, mode=mode)
            same_hits(got, retriever.retrieve("the wine of the king", k=6, mode=mode))
        flt = SearchFilter(equals={"lang": "fr"})
        hits = client.search("king queen", k=4, filter=flt)
        assert hits and all(h.metadata["lang"] == "fr" for h in hits)
        # the same shape as in-process: a list of hits with the search's query id
        local = retriever.search("king queen", k=4, filter=flt)
        assert type(hits) is type(local) and hits.query_id and local.query_id
        assert hits.query_id != local.query_id  # each search has its own
        batches = client.search_batch(["apples", "river"], k=3, mode="bm25")
        assert len({b.query_id for b in batches if b.query_id}) == 2
        assert [[h.chunk_id for h in b] for b in batches] == [
            [h.chunk_id for h in retriever.search(q, k=3, mode="bm25")] for q in ("apples", "river")
        ]
        served = client.collections()["collections"]["kb"]["serving"]
        assert served == retriever.store.resolve("kb")
        with pytest.raises(NotFound, match="existing: kb"):
            client.search("x", collection="nope")
        with pytest.raises(UnprocessableRequest, match=r"from 1 to 20 \(RAG_MAX_K\)"):
            client.search("x", k=21)


def test_wrong_key_against_a_real_server(remote: tuple[Retriever, str]) -> None:
    _, url = remote
    with RetrieverClient(url, api_key="nope") as client:
        assert client.health()  # probes are open
        with pytest.raises(Unauthorized, match="RAG_API_KEY"):
            client.search("king")


def test_async_client_against_a_real_server(remote: tuple[Retriever, str]) -> None:
    retriever, url = remote

    async def run() -> tuple[list[SearchResult], list[list[str]], bool]:
        async with AsyncRetrieverClient(url, api_key=KEY) as client:
            results = await asyncio.gather(
                *(client.retrieve(q, k=5, mode="hybrid") for q in ("king", "wine", "apples"))
            )
            batches = await client.search_batch(["king", "wine"], k=5, mode="hybrid")
            return list(results), [[h.chunk_id for h in b] for b in batches], await client.ready()

    results, batch_ids, ready = asyncio.run(run())
    for query, result in zip(("king", "wine", "apples"), results, strict=True):
        same_hits(result, retriever.retrieve(query, k=5, mode="hybrid"))
    assert batch_ids == [[h.chunk_id for h in r.hits] for r in results[:2]]
    assert ready


def test_nothing_listening_is_unavailable() -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with RetrieverClient(url, retries=1, backoff=0.0) as client:
            assert client.health() is False
            with pytest.raises(RetrieverUnavailable, match="after 2 attempt"):
                client.search("king")
    finally:
        sock.close()


def test_the_two_clients_offer_the_same_methods_with_the_same_arguments() -> None:
    import inspect

    from rag_retriever.client import AsyncRetrieverClient

    renamed = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}
    for name, method in vars(RetrieverClient).items():
        if (name.startswith("_") and name not in renamed) or not callable(method):
            continue
        twin = getattr(AsyncRetrieverClient, renamed.get(name, name))
        assert inspect.iscoroutinefunction(twin), name
        assert inspect.signature(twin) == inspect.signature(method), name


def _change_json() -> dict[str, Any]:
    return {"change_id": "c1", "status": "committed", "collection": "kb", "version": 2}


@pytest.mark.parametrize(
    ("failure", "sent"),
    [
        (httpx.ReadTimeout("timed out"), 1),  # the server may have taken it: not sent again
        (httpx.ReadError("connection reset by peer"), 1),
        (error(503, "writer_unavailable", "restart the service to write"), 1),
        (error(502, "http_502", "bad gateway"), 1),
        (httpx.ConnectError("connection refused"), 3),  # nothing reached the server: retried
    ],
)
def test_writes_and_feedback_are_sent_twice_only_when_nothing_was_sent(
    failure: Exception, sent: int
) -> None:
    """A retried write after a timeout made a second change (a version), retried feedback a
    second judgement; a 503 writer_unavailable lasts until the service restarts."""
    calls: list[tuple[str, Any]] = [
        ("upsert", lambda c: c.upsert_documents([Document("d", "t", "x")], collection="kb")),
        ("delete", lambda c: c.delete_documents(["d"], collection="kb")),
        ("feedback", lambda c: c.feedback("q1", chunk_id="c1", relevant=True)),
    ]
    for name, call in calls:
        answer = {"ok": True} if name == "feedback" else _change_json()
        recorder = Recorder(failure, failure, httpx.Response(200, json=answer))
        with client_for(recorder, retries=2, write_api_key="w") as client:
            if sent == 3:
                call(client)  # the third attempt answers
            else:
                with pytest.raises((RetrieverUnavailable, RetrieverHTTPError)):
                    call(client)
        assert len(recorder.requests) == sent, name

    async def run() -> int:
        recorder = Recorder(httpx.ReadTimeout("timed out"), httpx.Response(200, json={}))
        async with async_client_for(recorder, retries=2) as aclient:
            with pytest.raises(RetrieverUnavailable):
                await aclient.feedback("q1", chunk_id="c1", relevant=True)
        return len(recorder.requests)

    assert asyncio.run(run()) == 1


def test_a_busy_answer_is_sent_again_and_a_timed_out_write_may_have_applied() -> None:
    """429 `busy` is a refusal before anything was done: safe to send again, feedback too."""
    recorder = Recorder(error(429, "busy", "retry in a second"), httpx.Response(200, json={}))
    with client_for(recorder, retries=2) as client:
        assert client.feedback("q1", chunk_id="c1", relevant=True) == {}
    assert len(recorder.requests) == 2
    timed_out = Recorder(httpx.ReadTimeout("timed out"))
    with (
        client_for(timed_out, retries=2, write_api_key="w") as client,
        pytest.raises(RetrieverUnavailable, match="the server may have applied it"),
    ):
        client.upsert_documents([Document("d", "t", "x")], collection="kb")
