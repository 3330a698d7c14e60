"""Python clients of the HTTP service, returning the same records as the in-process API.

Example:
    >>> with RetrieverClient("http://127.0.0.1:8000", api_key="s3cret") as client:  # doctest: +SKIP
    ...     hits = client.search("who founded Normandy?", k=3)
    >>> hits[0].title, hits[0].dense, hits[0].bm25                                    # doctest: +SKIP
    ('Normans', StageScore(rank=1, score=0.71), StageScore(rank=2, score=14.2))

`search` returns a list of hits with the search's `query_id` (a `SearchHits`, as in-process), the
id `feedback(hits.query_id, chunk_id=..., relevant=True)` names; `retrieve` the whole
`SearchResult`.

`RetrieverClient` (sync) and `AsyncRetrieverClient` (asyncio) have the same methods. Searches
are read-only, so a read (POST /v1/search included) is retried after a transport error
(connection refused or reset, timeout) and after 502/503/504, with exponential backoff; a 4xx
or a 500 is never retried, a 429 (`busy`: nothing was done) always is. A call that must not
happen twice (a document write, feedback) is retried only when it cannot have reached the
server (no connection made); after a timeout or a 5xx it raises, saying the server may have
applied it. Errors carry the server's code and message:

    ClientError                     base of everything raised here (a RagError)
      RetrieverHTTPError            the server answered an error: .status, .error, .detail
        Unauthorized (401)  Forbidden (403)  NotFound (404)  Conflict (409)
        PayloadTooLarge (413)  UnprocessableRequest (422)  ServerError (5xx)
      RetrieverUnavailable          no answer after all retries: .attempts, .__cause__

An HTTP error is also an instance of the in-process error its code names (rag_retriever.errors):
a 404 `collection_not_found` is a NotFound and a CollectionNotFound, a 409 `version_incompatible`
a Conflict and a VersionIncompatible, so one `except` serves both the Python API and HTTP.

This module does not pool clients across threads or cache results.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypedDict, TypeVar, Unpack
from urllib.parse import quote

import httpx

from rag_retriever.errors import RagError
from rag_retriever.query.hits import SearchHits
from rag_retriever.records import Document, Mode, SearchFilter, SearchResult

T = TypeVar("T")
# Statuses that mean "a proxy or the server could not answer just now"; a retry may succeed.
RETRY_STATUSES = frozenset({502, 503, 504})
# Too many requests (`busy`): refused before anything was done, so every call is sent again.
BUSY = 429
# Transport errors after which the server cannot have seen the request (no connection made).
NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# The longest single wait between two attempts, whatever `backoff` and the attempt number.
MAX_BACKOFF_S = 10.0


class ClientError(RagError):
    """Base of every error the clients raise."""


class RetrieverHTTPError(ClientError):
    """The server answered with an error status; `error` and `detail` are its JSON body."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(f"HTTP {status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail
        # A proxy in front of several services can re-raise this with the same status and code.
        self.http_status = status
        self.code = error


class Unauthorized(RetrieverHTTPError):
    """401: no API key, or the wrong one."""


class Forbidden(RetrieverHTTPError):
    """403: the key is known, but its scope does not allow this (the detail says what)."""


class NotFound(RetrieverHTTPError):
    """404: an unknown collection, a wrong base URL, or a write endpoint of a server that runs
    with neither RAG_WRITE_API_KEY nor RAG_KEYS_FILE (the write endpoints are absent there)."""


class Conflict(RetrieverHTTPError):
    """409: e.g. the collection was embedded with another model than the server's encoder."""


class PayloadTooLarge(RetrieverHTTPError):
    """413: the request body is over the server's RAG_MAX_BODY_BYTES."""


class UnprocessableRequest(RetrieverHTTPError):
    """422: a query, k, mode, filter or batch size the server does not accept."""


class ServerError(RetrieverHTTPError):
    """5xx: the server failed; `detail` is what it chose to say."""


class InvalidArgument(ClientError, ValueError):
    """A call the client refuses before sending it: a string where a list of queries goes, a
    filter of neither accepted form."""


class ClientClosed(ClientError, RuntimeError):
    """A call on a client after `close()` (`aclose()`): open a new one."""


class UnexpectedResponse(ClientError):
    """A 2xx answer whose body is not the API's: a proxy's page, or another service at the base
    URL."""


class RetrieverUnavailable(ClientError):
    """No answer after every attempt; the last transport error is the `__cause__`."""

    http_status = 503
    code = "unavailable"

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


_BY_STATUS: dict[int, type[RetrieverHTTPError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: UnprocessableRequest,
}


def _errors_by_code() -> dict[str, type[RagError]]:
    """Every error class of rag_retriever.errors by its code (the `error` field of a response)."""
    out: dict[str, type[RagError]] = {}
    todo: list[type[RagError]] = [RagError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__ == "rag_retriever.errors":
            out.setdefault(cls.code, cls)
    return out


_REMOTE: dict[tuple[type[RetrieverHTTPError], type[RagError]], type[RetrieverHTTPError]] = {}


def _remote_class(by_status: type[RetrieverHTTPError], code: str) -> type[RetrieverHTTPError]:
    """The class raised for a response: its status's class, and also the in-process error of its
    code (e.g. NotFound and CollectionNotFound), so code written against the in-process retriever
    catches the same exceptions over HTTP."""
    local = _errors_by_code().get(code)
    if local is None or local is RagError:
        return by_status
    key = (by_status, local)
    if key not in _REMOTE:
        _REMOTE[key] = type(by_status.__name__, (by_status, local), {"__module__": __name__})
    return _REMOTE[key]


def http_error(response: httpx.Response) -> RetrieverHTTPError:
    """The typed error for an error response, with the server's `error` and `detail`: an instance
    of its status's class and of the in-process error its code names."""
    error, detail = f"http_{response.status_code}", response.text[:500]
    try:
        body = response.json()
    except ValueError:  # not JSON: a proxy's HTML page, say
        body = None
    if isinstance(body, Mapping):
        error = str(body.get("error", error))
        detail = str(body.get("detail", detail))
    status = response.status_code
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else RetrieverHTTPError)
    return _remote_class(cls, error)(status, error, detail)


class SearchOptions(TypedDict, total=False):
    """The options of every search method; those left out are the server's defaults
    (`diversity`, `expand`, `expand_tokens` and `min_score` as in Retriever.retrieve_batch)."""

    k: int | None
    mode: Mode | None
    filter: SearchFilter | Mapping[str, Any] | None  # the dict form as the HTTP API takes it
    collection: str | None
    diversity: float | None
    expand: Literal["neighbours", "section"] | None
    expand_tokens: int | None
    min_score: float | None
    tenant: str | None


def search_body(**fields: Any) -> dict[str, Any]:
    """The JSON body of a search (`query` or `queries` plus SearchOptions); options that are None
    are left out, so the server's defaults apply."""
    body = {key: value for key, value in fields.items() if value is not None}
    try:
        flt = SearchFilter.of(body.pop("filter", None))
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(str(exc)) from None
    if flt is not None and not flt.is_empty:
        body["filter"] = flt.to_dict()
    return body


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One API call, independent of sync or async: the request and how to read the answer."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    json: Any = None
    # the write key, for the document write calls (the read key is the client's default header)
    write: bool = False
    # seconds the server may hold the answer (a write waiting for its version): added to the
    # client's timeout for this call
    wait_s: float = 0.0
    # not safe to send twice (a write makes a version, feedback is a judgement): retried only
    # when the request cannot have reached the server
    once: bool = False


def _read(call: _Call[T], response: httpx.Response) -> T:
    """The call's answer read from a 2xx response; UnexpectedResponse where it is not the API's."""
    try:
        return call.read(response)
    except RagError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        kind = response.headers.get("content-type", "no content type")
        raise UnexpectedResponse(
            f"{call.method} {response.request.url}: HTTP {response.status_code} ({kind}) is not "
            f"a rag-retriever answer ({type(exc).__name__}: {exc}); is the base URL a "
            f"rag-retriever service? The body begins: {response.text[:200]!r}"
        ) from exc


# The API, written once; RetrieverClient and AsyncRetrieverClient send these calls.
def _retrieve(query: str, options: SearchOptions) -> _Call[SearchResult]:
    body = search_body(query=query, **options)
    return _Call("POST", "/v1/search", lambda r: SearchResult.from_dict(r.json()), body)


def _retrieve_batch(queries: Sequence[str], options: SearchOptions) -> _Call[list[SearchResult]]:
    if isinstance(queries, str):  # would be sent letter by letter
        raise InvalidArgument(
            "queries must be a list of questions, not one string; search(query) asks one"
        )
    body = search_body(queries=list(queries), **options)
    return _Call("POST", "/v1/search/batch", _results, body)


def _search(query: str, options: SearchOptions) -> _Call[SearchHits]:
    call = _retrieve(query, options)
    return _Call(call.method, call.path, lambda r: SearchHits.of(call.read(r)), call.json)


def _search_batch(queries: Sequence[str], options: SearchOptions) -> _Call[list[SearchHits]]:
    call = _retrieve_batch(queries, options)
    return _Call(
        call.method, call.path, lambda r: [SearchHits.of(x) for x in call.read(r)], call.json
    )


def _collections() -> _Call[dict[str, Any]]:
    return _Call("GET", "/v1/collections", lambda r: dict(r.json()))


@dataclass(frozen=True)
class ChangeStatus:
    """Where a document write stands: `committed` (the version that serves it), `pending` (poll
    with `change`), or `failed` (`detail` says why). A key limited to some tenants gets what it
    sent (`upserts`, `deletes`) in place of the version's `report` and `grouped_requests`, which
    count every tenant's documents."""

    change_id: str
    status: str
    collection: str | None = None
    version: int | None = None
    kind: str | None = None
    grouped_requests: int = 0
    report: Mapping[str, Any] | None = None
    detail: str | None = None
    upserts: int | None = None
    deletes: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChangeStatus:
        return cls(
            change_id=str(data["change_id"]),
            status=str(data["status"]),
            collection=data.get("collection"),
            version=data.get("version"),
            kind=data.get("kind"),
            grouped_requests=int(data.get("grouped_requests") or 0),
            report=data.get("report"),
            detail=data.get("detail"),
            upserts=data.get("upserts"),
            deletes=data.get("deletes"),
        )


def _change_status(response: httpx.Response) -> ChangeStatus:
    return ChangeStatus.from_dict(response.json())


def _documents_json(documents: Sequence[Document]) -> list[dict[str, Any]]:
    return [
        {"id": d.id, "title": d.title, "text": d.text, "metadata": dict(d.metadata)}
        for d in documents
    ]


def _upsert_documents(
    documents: Sequence[Document], collection: str, wait: float
) -> _Call[ChangeStatus]:
    body = {"documents": _documents_json(documents), "wait": wait}
    path = f"/v1/collections/{quote(collection, safe='')}/documents"
    return _Call("PUT", path, _change_status, body, write=True, wait_s=wait, once=True)


def _delete_documents(
    ids: Sequence[str], collection: str, wait: float, tenant: str | None = None
) -> _Call[ChangeStatus]:
    path = f"/v1/collections/{quote(collection, safe='')}/documents:delete"
    body: dict[str, Any] = {"ids": list(ids), "wait": wait}
    if tenant is not None:
        body["tenant"] = tenant
    return _Call("POST", path, _change_status, body, write=True, wait_s=wait, once=True)


def _feedback(
    query_id: str, relevant: bool, chunk_id: str | None, doc_id: str | None
) -> _Call[dict[str, Any]]:
    body = {"query_id": query_id, "relevant": relevant, "chunk_id": chunk_id, "doc_id": doc_id}
    body = {k: v for k, v in body.items() if v is not None}
    return _Call("POST", "/v1/feedback", lambda r: dict(r.json()), body, once=True)


def _change(change_id: str, wait: float) -> _Call[ChangeStatus]:
    path = f"/v1/changes/{quote(change_id, safe='')}?wait={wait:g}"
    return _Call("GET", path, _change_status, write=True, wait_s=wait)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _check_retry_settings(retries: int, backoff: float) -> None:
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    if backoff < 0:
        raise ValueError(f"backoff must be >= 0 seconds, got {backoff}")


def _delay(backoff: float, attempt: int) -> float:
    """Seconds to wait after failed attempt number `attempt` (0-based): backoff * 2**attempt."""
    return min(backoff * 2**attempt, MAX_BACKOFF_S)


def _unavailable(
    method: str, url: str, attempts: int, exc: Exception, *, once: bool = False
) -> RetrieverUnavailable:
    if once and not isinstance(exc, NOTHING_SENT):  # it reached the server: not sent again
        hint = (
            "the server may have applied it (not sent again: upserts and deletes by id are "
            "idempotent, so sending the write again is safe; feedback sent again counts twice)"
        )
    else:
        hint = "is the server running and the base URL right?"
    return RetrieverUnavailable(
        f"{method} {url} got no answer after {attempts} attempt(s): "
        f"{type(exc).__name__}: {exc}; {hint}",
        attempts,
    )


def _judge(
    attempt: int,
    retries: int,
    request: tuple[str, str],
    response: httpx.Response | None,
    error: httpx.TransportError | None,
    *,
    once: bool = False,
) -> httpx.Response | None:
    """The retry policy, shared by both clients: the response to return, or None to wait
    `_delay(backoff, attempt)` and try again; raises when the policy says stop. A call `once`
    (not safe to send twice) is retried only after an error that sent nothing."""
    if error is not None:
        if attempt == retries or (once and not isinstance(error, NOTHING_SENT)):
            raise _unavailable(request[0], request[1], attempt + 1, error, once=once) from error
        return None
    assert response is not None
    if response.is_success:
        return response
    if response.status_code == BUSY and attempt < retries:
        return None  # the server did nothing: safe to send again, a write or feedback too
    if response.status_code not in RETRY_STATUSES or attempt == retries or once:
        raise http_error(response)
    return None


def _probe_answer(response: httpx.Response) -> bool:
    if response.status_code in (200, 503):
        return response.status_code == 200
    raise http_error(response)  # 404 = wrong base URL: say so rather than "not ready"


def _results(response: httpx.Response) -> list[SearchResult]:
    return [SearchResult.from_dict(r) for r in response.json()["results"]]


class _Client:
    """What both clients hold: where the server is and how to retry."""

    def __init__(
        self, base_url: str, retries: int, backoff: float, write_api_key: str | None
    ) -> None:
        _check_retry_settings(retries, backoff)
        self.base_url = base_url
        self.retries = retries
        self.backoff = backoff
        self._write_headers = _headers(write_api_key)

    def _options(self, call: _Call[Any], timeout: float) -> dict[str, Any]:
        """Per-call request options: the write key for a write call (it replaces the read key's
        header), a timeout that covers the server's wait."""
        options: dict[str, Any] = {}
        if call.write and self._write_headers:
            options["headers"] = self._write_headers
        if call.wait_s:
            options["timeout"] = timeout + call.wait_s
        return options

    def _url(self, call: _Call[Any]) -> str:
        return f"{self.base_url.rstrip('/')}{call.path}"


def _check_open(http: httpx.Client | httpx.AsyncClient, method: str, path: str) -> None:
    """ClientClosed for a call after close() (httpx's own error would be a RuntimeError)."""
    if http.is_closed:
        raise ClientClosed(f"{method} {path}: this client is closed; open a new one")


class RetrieverClient(_Client):
    """A blocking client of `rag-retriever serve`. Use it as a context manager, or call close()."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        write_api_key: str | None = None,
        timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, retries, backoff, write_api_key)
        self._timeout = timeout
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport
        )

    def search(self, query: str, **options: Unpack[SearchOptions]) -> SearchHits:
        """The hits of `query` (POST /v1/search): a list with the search's `query_id`."""
        return self._send(_search(query, options))

    def retrieve(self, query: str, **options: Unpack[SearchOptions]) -> SearchResult:
        """The whole result of `query`: hits, timings, notices, fusion."""
        return self._send(_retrieve(query, options))

    def search_batch(
        self, queries: Sequence[str], **options: Unpack[SearchOptions]
    ) -> list[SearchHits]:
        """The hits of each query, each with its `query_id`, in one request
        (POST /v1/search/batch)."""
        return self._send(_search_batch(queries, options))

    def retrieve_batch(
        self, queries: Sequence[str], **options: Unpack[SearchOptions]
    ) -> list[SearchResult]:
        """The whole result of each query, in one request."""
        return self._send(_retrieve_batch(queries, options))

    def collections(self) -> dict[str, Any]:
        """{"default_collection": alias, "collections": {alias: {"serving", "versions"}}}."""
        return self._send(_collections())

    def upsert_documents(
        self, documents: Sequence[Document], *, collection: str, wait: float = 30.0
    ) -> ChangeStatus:
        """Add or replace documents of an alias (needs the write key); waits up to `wait`
        seconds for the version that serves them, else returns a `pending` status to poll."""
        return self._send(_upsert_documents(documents, collection, wait))

    def delete_documents(
        self, ids: Sequence[str], *, collection: str, wait: float = 30.0, tenant: str | None = None
    ) -> ChangeStatus:
        """Delete documents of an alias by id, of `tenant` when given (needs a key that can
        write); as upsert_documents."""
        return self._send(_delete_documents(ids, collection, wait, tenant))

    def change(self, change_id: str, *, wait: float = 0.0) -> ChangeStatus:
        """A write's state, waiting up to `wait` seconds for it to be committed."""
        return self._send(_change(change_id, wait))

    def feedback(
        self,
        query_id: str,
        *,
        relevant: bool,
        chunk_id: str | None = None,
        doc_id: str | None = None,
    ) -> dict[str, Any]:
        """Judge a returned chunk (or document) of a logged query (POST /v1/feedback)."""
        return self._send(_feedback(query_id, relevant, chunk_id, doc_id))

    def health(self) -> bool:
        """True when the process answers /healthz; False when nothing answers (no retries)."""
        return self._probe("/healthz")

    def ready(self) -> bool:
        """True when /readyz says the default collection is servable (no retries)."""
        return self._probe("/readyz")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _probe(self, path: str) -> bool:
        _check_open(self._http, "GET", path)
        try:
            return _probe_answer(self._http.get(path))
        except httpx.TransportError:
            return False

    def _send(self, call: _Call[T]) -> T:
        _check_open(self._http, call.method, call.path)
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = self._http.request(
                    call.method, call.path, json=call.json, **self._options(call, self._timeout)
                )
            except httpx.TransportError as exc:
                error = exc
            done = _judge(
                attempt,
                self.retries,
                (call.method, self._url(call)),
                response,
                error,
                once=call.once,
            )
            if done is not None:
                return _read(call, done)
            time.sleep(_delay(self.backoff, attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")


class AsyncRetrieverClient(_Client):
    """The asyncio twin of RetrieverClient: same arguments, same methods, awaited."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        write_api_key: str | None = None,
        timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, retries, backoff, write_api_key)
        self._timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport
        )

    async def search(self, query: str, **options: Unpack[SearchOptions]) -> SearchHits:
        return await self._send(_search(query, options))

    async def retrieve(self, query: str, **options: Unpack[SearchOptions]) -> SearchResult:
        return await self._send(_retrieve(query, options))

    async def search_batch(
        self, queries: Sequence[str], **options: Unpack[SearchOptions]
    ) -> list[SearchHits]:
        return await self._send(_search_batch(queries, options))

    async def retrieve_batch(
        self, queries: Sequence[str], **options: Unpack[SearchOptions]
    ) -> list[SearchResult]:
        return await self._send(_retrieve_batch(queries, options))

    async def collections(self) -> dict[str, Any]:
        return await self._send(_collections())

    async def upsert_documents(
        self, documents: Sequence[Document], *, collection: str, wait: float = 30.0
    ) -> ChangeStatus:
        return await self._send(_upsert_documents(documents, collection, wait))

    async def delete_documents(
        self, ids: Sequence[str], *, collection: str, wait: float = 30.0, tenant: str | None = None
    ) -> ChangeStatus:
        return await self._send(_delete_documents(ids, collection, wait, tenant))

    async def change(self, change_id: str, *, wait: float = 0.0) -> ChangeStatus:
        return await self._send(_change(change_id, wait))

    async def feedback(
        self,
        query_id: str,
        *,
        relevant: bool,
        chunk_id: str | None = None,
        doc_id: str | None = None,
    ) -> dict[str, Any]:
        return await self._send(_feedback(query_id, relevant, chunk_id, doc_id))

    async def health(self) -> bool:
        return await self._probe("/healthz")

    async def ready(self) -> bool:
        return await self._probe("/readyz")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _probe(self, path: str) -> bool:
        _check_open(self._http, "GET", path)
        try:
            return _probe_answer(await self._http.get(path))
        except httpx.TransportError:
            return False

    async def _send(self, call: _Call[T]) -> T:
        _check_open(self._http, call.method, call.path)
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = await self._http.request(
                    call.method, call.path, json=call.json, **self._options(call, self._timeout)
                )
            except httpx.TransportError as exc:
                error = exc
            done = _judge(
                attempt,
                self.retries,
                (call.method, self._url(call)),
                response,
                error,
                once=call.once,
            )
            if done is not None:
                return _read(call, done)
            await asyncio.sleep(_delay(self.backoff, attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")
