"""The HTTP service: search, batch search, collections, health and readiness over FastAPI.

Example:
    >>> app = create_app(Retriever.from_settings(settings), settings)       # doctest: +SKIP
    >>> serve(settings, host="127.0.0.1", port=8000)                         # doctest: +SKIP

    $ curl -s localhost:8000/v1/search -d '{"query": "who founded Normandy?", "k": 3}' \\
        -H 'content-type: application/json'

Endpoints: `POST /v1/search`, `POST /v1/search/batch`, `GET /v1/collections`, `GET /healthz`
(the process answers), `GET /readyz` (the default collection opens with the loaded encoder),
OpenAPI docs at `/docs`; with `RAG_WRITE_API_KEY` set, the document write endpoints of
writes.py too (`PUT /v1/collections/{alias}/documents`, `POST .../documents:delete`,
`GET /v1/changes/{id}`), behind that key. Every error is JSON `{"error": code, "detail": message}`; a `RagError`
keeps its own status and message, an unexpected exception is logged here and answered with a
generic 500. Limits come from Settings: query length, k, batch size, body size (the body is
counted as it streams in, so a missing or false Content-Length cannot get past the limit).
With `RAG_API_KEY` or `RAG_KEYS_FILE` set, everything except the two probes needs
`Authorization: Bearer <key>` or `X-API-Key: <key>`; a key's scope (service/keys.py,
rag_retriever/access.py) bounds what each request reads and writes.

Models are loaded once by the caller and shared by all requests: FastAPI runs the sync
endpoints on a thread pool, and the encoder and the collection versions are read-only at query
time. Embedded Qdrant (Edge) versions are opened read-only by any number of processes, so other
servers, `search`, the eval and `ingest` can use the same data dir at once; with a Qdrant server
(RAG_QDRANT_URL) a replica keeps nothing on its local disk. This
module does not do TLS or rate limiting: put a reverse proxy in front.

Why one module: it is the app, the one place that maps every error to its status and JSON body
and every route to its schema (search, collections, probes, feedback, metrics); the write
routes, keys and metrics are service/writes.py, auth.py and metrics.py.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rag_retriever.access import serving
from rag_retriever.errors import (
    ConfigError,
    Forbidden,
    InvalidRequest,
    QueryNotLogged,
    RagError,
)
from rag_retriever.query.context import EXPAND_KINDS, ExpandKind
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import (
    ALIAS_SCHEMA_PATTERN,
    BLANK_CHARS,
    MAX_EXACT_INT,
    TENANT_SCHEMA_PATTERN,
    Mode,
    SearchFilter,
    SearchResult,
    check_collection,
    check_tenant,
)
from rag_retriever.service.auth import header
from rag_retriever.service.keys import KeyCheck, Keys, access_of, offered_keys
from rag_retriever.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rag_retriever.service.metrics import Metrics
from rag_retriever.service.writes import add_write_routes, writes_in_a_process
from rag_retriever.settings import EXPAND_TOKENS_MAX, Settings
from rag_retriever.store import parse_collection_name
from rag_retriever.store.catalog import describe_collections

log = logging.getLogger(__name__)

# The probes stay open without a key: orchestrators call them and they reveal nothing private.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
# A refused body is still read (and dropped) up to this size so the client gets the 413 rather
# than a reset connection; beyond it the connection is closed at once.
DRAIN_LIMIT_BYTES = 16 * 1024 * 1024
# How long `serve_in_thread` waits for uvicorn to bind before giving up.
STARTUP_TIMEOUT_S = 30.0


# -- request bodies -----------------------------------------------------------------------------


class _Options(BaseModel):
    # strict: "5" is not a k; forbid: a misspelt field ("top_k") is an error, not silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")

    k: int | None = Field(default=None, description="hits per query (default RAG_DEFAULT_K)")
    mode: Mode | None = Field(
        default=None, description="dense, bm25, hybrid or rerank (default: rerank if available)"
    )
    filter: dict[str, Any] | None = Field(
        default=None,
        description='{"doc_ids": ["a.md"], "equals": {"lang": "en"}, "where": {"any": [{"field": '
        '"team", "in": ["a", "b"]}, {"not": {"field": "year", "range": {"lt": 2020}}}]}}; applied '
        "to every branch; `where` takes equals, in, range, all, any and not (docs/querying.md); "
        "a field no document of the version has is a 422 that lists the fields",
        examples=[{"equals": {"lang": "en"}}, {"where": {"field": "year", "range": {"gte": 2020}}}],
    )
    collection: str | None = Field(
        default=None, description="alias or collection (default RAG_COLLECTION)"
    )
    diversity: float | None = Field(
        default=None,
        description="0 (the ranked order) to 1: reorder the top RAG_DIVERSITY_CANDIDATES hits "
        "by maximal marginal relevance, so near-duplicate chunks do not fill the top k",
        examples=[0.3],
    )
    expand: ExpandKind | None = Field(
        default=None,
        description="return each hit's context: 'neighbours' (the chunks around it) or "
        "'section' (those under the same heading), merged, as hit.context",
    )
    expand_tokens: int | None = Field(
        default=None,
        description="tokens of context per hit with expand (default RAG_EXPAND_TOKENS)",
    )
    min_score: float | None = Field(
        default=None,
        description="leave out hits scoring below it, on the mode's scale: dense cosine (-1 to "
        "1), bm25 (0 and up), hybrid the fusion's score, rerank the final score (by default, "
        "RAG_RERANK_FUSION=rrf, the RRF of the cross-encoder's and the hybrid order, at most "
        "~0.033; the cross-encoder's logit with RAG_RERANK_FUSION=none); in rerank mode only "
        "reranked chunks are returned then",
        examples=[0.5],
    )
    tenant: str | None = Field(
        default=None,
        description="search this tenant's documents only (default: every tenant the key "
        "reads); a tenant outside the key's scope is a 403",
        json_schema_extra={"pattern": TENANT_SCHEMA_PATTERN, "maxLength": 64},
    )

    @field_validator("k", "expand_tokens", mode="before")
    @classmethod
    def _integral_float(cls, value: Any) -> Any:
        # JSON Schema's integer includes 4.0; strict parsing still refuses "4" and 4.5.
        return int(value) if isinstance(value, float) and value.is_integer() else value

    @field_validator("collection", mode="after")
    @classmethod
    def _collection_name(cls, value: str | None) -> str | None:
        # A malformed name is a bad request (422), not an unknown collection, and "" is not a
        # way to say "the default" (leave the field out).
        return None if value is None else check_collection(value)

    @field_validator("tenant", mode="after")
    @classmethod
    def _tenant_name(cls, value: str | None) -> str | None:
        return None if value is None else check_tenant(value)


class SearchBody(_Options):
    query: str = Field(description="the question", examples=["who founded Normandy?"])


class BatchBody(_Options):
    queries: list[str] = Field(description="questions, answered in order")


# JSON Schema (ECMA regex) for "at least one character that is not white space", with the
# white space of records.BLANK, so the schema and the server agree on what an empty query is.
_NOT_BLANK = f"[^{BLANK_CHARS}]"
# Integers a filter can match (records.MAX_EXACT_INT).
_INT64 = {"type": "integer", "minimum": -MAX_EXACT_INT, "maximum": MAX_EXACT_INT}
# The names records.check_collection accepts, as JSON Schema can say it without look-arounds: an
# alias (no "__"), or a version name (stated a little narrower: no "_" in its alias part).
_COLLECTION = [
    {"type": "string", "pattern": ALIAS_SCHEMA_PATTERN, "maxLength": 64},
    {
        "type": "string",
        "pattern": "^[A-Za-z0-9][A-Za-z0-9.-]{0,63}__[A-Za-z0-9.-]+__v[0-9]+$",
        "maxLength": 200,
    },
]


def _documented(settings: Settings, retriever: Retriever) -> tuple[type, type]:
    """The request bodies with a schema that states the limits the server enforces (k, query
    length and content, batch size, the modes this server runs, the filter's shape); the checks
    themselves stay in one place (the retriever, with its config's limits; SearchFilter; the
    batch size in search_batch)."""
    limits = retriever.config
    modes = retriever.modes
    query = {"type": "string", "pattern": _NOT_BLANK, "maxLength": limits.max_query_chars}
    common = {
        "k": {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": limits.max_k},
                {"type": "null"},
            ]
        },
        "mode": {"anyOf": [{"enum": list(modes)}, {"type": "null"}]},
        "collection": {"anyOf": [*_COLLECTION, {"type": "null"}]},
        "diversity": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
        # its range depends on the mode (the retriever checks it); any finite number here
        "min_score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "expand": {"anyOf": [{"enum": list(EXPAND_KINDS)}, {"type": "null"}]},
        "expand_tokens": {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": EXPAND_TOKENS_MAX},
                {"type": "null"},
            ]
        },
        "filter": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "doc_ids": {"type": "array", "items": {"type": "string"}},
                        "equals": {
                            "type": "object",
                            "propertyNames": {"pattern": '^[^"\\\\]+$'},
                            "additionalProperties": {
                                "anyOf": [{"type": "string"}, _INT64, {"type": "boolean"}]
                            },
                        },
                        # a condition tree (rag_retriever/conditions.py: its shape is checked
                        # there, each problem a 422 naming the path)
                        "where": {"type": "object"},
                    },
                    "additionalProperties": False,
                },
                {"type": "null"},
            ]
        },
    }

    def schema_of(model: type[BaseModel], extra: dict[str, Any]) -> type:
        def patch(schema: dict[str, Any]) -> None:
            for name, sub in {**common, **extra}.items():
                schema["properties"][name] = {**schema["properties"][name], **sub}
                schema["properties"][name].pop("type", None) if "anyOf" in sub else None

        return type(model.__name__, (model,), {"model_config": ConfigDict(json_schema_extra=patch)})

    search = schema_of(SearchBody, {"query": query})
    batch = schema_of(
        BatchBody,
        {"queries": {"type": "array", "items": query, "maxItems": settings.max_batch_size}},
    )
    return search, batch


class ErrorBody(BaseModel):
    """Every error the service sends: a stable code and a sentence that says the fix."""

    error: str = Field(description="a stable code, e.g. invalid_request, collection_not_found")
    detail: str = Field(description="what was wrong, what was expected, and the fix")


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI description of the error answers a route can send."""
    meaning = {
        400: "malformed body: not valid JSON (or not UTF-8 text)",
        401: "missing or wrong API key (when RAG_API_KEY or RAG_KEYS_FILE is set)",
        403: "the key's scope does not allow it (another tenant or collection, a filter that "
        "reaches outside the scope); the detail names what the key lacks",
        404: "unknown collection or route",
        409: "the collection was embedded with another model, or written under another scheme",
        413: "body over RAG_MAX_BODY_BYTES",
        415: "the body was not sent as JSON (Content-Type: application/json)",
        422: "invalid request: names the field, the value and the fix",
        429: "busy: the feedback's query is being looked up for another request; nothing was "
        "done, send it again in a second",
        500: "an unexpected error (details only in the server log)",
        503: "Qdrant is unreachable",
    }
    return {s: {"model": ErrorBody, "description": meaning[s]} for s in statuses}


_SEARCH_ERRORS = _errors(400, 401, 403, 404, 409, 413, 415, 422, 500, 503)


# -- the app -----------------------------------------------------------------------------------


def create_app(retriever: Retriever, settings: Settings) -> FastAPI:
    """A FastAPI app answering with `retriever` (already loaded) under the limits of `settings`.

    Built in named steps: the search routes, the collections listing, the probes, the error
    handlers, then the middleware (auth, body limit, error boundary).
    """
    app = FastAPI(
        title="rag-retriever",
        version=_version(),
        description="Hybrid dense + BM25 retrieval with per-stage ranks, over versioned "
        "Qdrant collections.",
    )
    # The settings' query limits apply to this app; the retriever checks them, as it does for
    # Python callers (one check of k and of the query, one message).
    retriever = retriever.with_config(
        default_k=settings.default_k, max_k=settings.max_k, max_query_chars=settings.max_query_chars
    )
    app.state.retriever = retriever
    app.state.settings = settings
    app.state.metrics = Metrics(retriever)
    _add_search_routes(app, retriever, settings)
    _add_feedback_and_metrics(app, retriever)
    _add_collections_route(app, retriever)
    _add_probes(app, retriever, settings)
    keys = Keys(
        read_key=settings.api_key, write_key=settings.write_api_key, keys_file=settings.keys_file
    )
    app.state.keys = keys
    if keys.may_write:  # absent from the app (and its schema) when no key can write
        add_write_routes(app, retriever, settings)
    _add_error_handlers(app)
    _add_middleware(app, settings, keys)
    return app


def _add_search_routes(app: FastAPI, retriever: Retriever, settings: Settings) -> None:
    """`POST /v1/search` and `POST /v1/search/batch`, their bodies documented with the limits
    the server enforces (see `_documented`)."""
    search_body, batch_body = _documented(settings, retriever)

    def answer(queries: list[str], body: _Options, request: Request) -> list[SearchResult]:
        """The results of `queries` under `body`'s options, within the key's scope (the
        filter narrowed to it; Forbidden when the request reaches outside it)."""
        access = access_of(request)
        alias = body.collection or retriever.default_collection
        access.check_collection(parsed[0] if (parsed := parse_collection_name(alias)) else alias)
        if parsed and body.collection and not access.unrestricted:
            # an older version may hold documents deleted since, or moved out of the key's
            # groups: a limited key reads what its alias serves now
            raise Forbidden(
                f"key {access.name!r} searches what an alias serves: name {parsed[0]!r}, not "
                f"one of its versions"
            )
        flt = access.narrow(_filter(body.filter), body.tenant)
        with serving(access, body.tenant):
            results = retriever.retrieve_batch(
                queries,
                k=body.k,
                mode=body.mode,
                filter=flt,
                collection=body.collection,
                diversity=body.diversity,
                expand=body.expand,
                expand_tokens=body.expand_tokens,
                min_score=body.min_score,
            )
        app.state.metrics.observe(results, access, body.tenant)
        return results

    def search(body: SearchBody, request: Request) -> JSONResponse:
        return JSONResponse(answer([body.query], body, request)[0].to_dict())

    def search_batch(body: BatchBody, request: Request) -> JSONResponse:
        if len(body.queries) > settings.max_batch_size:
            raise InvalidRequest(
                f"the batch has {len(body.queries)} queries; the limit is "
                f"{settings.max_batch_size} (RAG_MAX_BATCH_SIZE); split it"
            )
        results = answer(body.queries, body, request)
        return JSONResponse({"results": [r.to_dict() for r in results]})

    search.__annotations__["body"] = search_body
    search_batch.__annotations__["body"] = batch_body
    app.add_api_route(
        "/v1/search", search, methods=["POST"], summary="Search one query", responses=_SEARCH_ERRORS
    )
    app.add_api_route(
        "/v1/search/batch",
        search_batch,
        methods=["POST"],
        summary="Search many queries (encoded in one batch)",
        responses=_SEARCH_ERRORS,
    )


class FeedbackBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    query_id: str = Field(description="the query_id of a search result")
    chunk_id: str | None = Field(default=None, description="a returned chunk (or give doc_id)")
    doc_id: str | None = Field(default=None, description="a returned document (or chunk_id)")
    relevant: bool = Field(description="whether it answered the question")


def _add_feedback_and_metrics(app: FastAPI, retriever: Retriever) -> None:
    """`POST /v1/feedback` (with the query log) and `GET /metrics`, behind the read key."""

    @app.post(
        "/v1/feedback",
        summary="Judge a returned chunk or document of a logged query (needs RAG_QUERY_LOG)",
        responses=_errors(400, 401, 403, 404, 413, 415, 422, 429, 500),
    )
    def feedback(body: FeedbackBody, request: Request) -> JSONResponse:
        if retriever.query_log is None:
            raise QueryNotLogged(
                "feedback is recorded next to the query log, which is off: set RAG_QUERY_LOG to a "
                "directory and restart the service"
            )
        with serving(access_of(request)):  # a key judges only the queries it made
            entry = retriever.query_log.feedback(
                body.query_id, relevant=body.relevant, chunk_id=body.chunk_id, doc_id=body.doc_id
            )
        # on disk when the answer comes, with every query line before it: `questions --from-log`
        # run next, or another replica asked about it, reads them (feedback is rare: the wait is
        # one turn of the log's thread)
        retriever.query_log.flush()
        return JSONResponse({"status": "recorded", **entry})

    @app.get(
        "/metrics",
        summary="Prometheus metrics (text format)",
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "the Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            # errors are JSON, not the route's text/plain
            **{
                status: {
                    **error,
                    "content": {"application/json": {"schema": ErrorBody.model_json_schema()}},
                }
                for status, error in _errors(401, 403).items()
            },
        },
    )
    def metrics(request: Request) -> Response:
        access = access_of(request)
        if not access.unrestricted or access.collections is not None:
            # the counts cover every tenant and collection: for keys that see them all
            raise Forbidden(f"key {access.name!r} cannot read the metrics of the whole service")
        return Response(app.state.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)


def _add_collections_route(app: FastAPI, retriever: Retriever) -> None:
    """`GET /v1/collections`: the aliases, the version each serves, every version."""

    @app.get(
        "/v1/collections",
        summary="Aliases, the collection each serves, all versions",
        responses=_errors(401, 403, 500, 503),
    )
    def collections(request: Request) -> JSONResponse:
        access = access_of(request)
        described = describe_collections(retriever.store)
        if access.collections is not None:  # a key lists the collections it opens
            described = {a: c for a, c in described.items() if a in access.collections}
        if not access.unrestricted:
            # the version it searches, without what tells of every tenant's documents (counts)
            # or of their writes (each HTTP write is a version: when, how many since a build)
            for listing in described.values():
                listing["versions"] = [
                    {k: v for k, v in version.items() if k not in TENANTS_OWN}
                    for version in listing["versions"]
                    if version["serving"]
                ]
        return JSONResponse(
            {"default_collection": retriever.default_collection, "collections": described}
        )


# What a version listing holds that tells of every tenant's documents or writes: dropped for a
# key limited to tenants or groups (with every version but the one served, whose name every
# search answer carries).
TENANTS_OWN = frozenset({"points", "documents", "created_at", "lineage"})


def _add_probes(app: FastAPI, retriever: Retriever, settings: Settings) -> None:
    """`/healthz` (the process answers) and `/readyz` (the default collection opens), on GET
    and HEAD; open without the key, but /readyz gives its reasons only to key holders."""

    @app.get("/healthz", summary="Liveness: the process answers")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        summary="Readiness: the default collection opens with this encoder",
        responses={503: {"description": "not ready; the reason only with the API key"}},
    )
    def readyz(request: Request) -> JSONResponse:
        ready, report = check_ready(retriever)
        if app.state.keys.enabled:
            found = app.state.keys.lookup(offered_keys(request.scope))
            if not found:  # open to orchestrators, but what it serves is for key holders only
                report = {"status": report["status"]}
            elif not found.unrestricted:  # every tenant's chunks, counted
                report.pop("chunks", None)
        return JSONResponse(report, status_code=200 if ready else 503)

    # HEAD on the probes (load balancers use it); kept out of the schema, which lists GET.
    app.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers as JSON `{"error", "detail"}` (see the handlers under "errors")."""
    app.add_exception_handler(RagError, _rag_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


def _add_middleware(app: FastAPI, settings: Settings, keys: Keys) -> None:
    """The ASGI middleware; added last = runs first: the request count (refusals included),
    the key check, then the body limit, then the error boundary."""
    app.add_middleware(_ErrorBoundary)
    app.add_middleware(_BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(KeyCheck, keys=keys, public=PUBLIC_PATHS)
    app.add_middleware(_Counted)


def check_ready(retriever: Retriever) -> tuple[bool, dict[str, Any]]:
    """Open the default collection (alias, record, fingerprint, BM25) and say whether it worked.

    The first successful check also opens the served version, so later searches do not pay for it.
    """
    alias = retriever.default_collection
    base: dict[str, Any] = {
        "collection": alias,
        "model": retriever.encoder.fingerprint.describe(),
        "reranker": retriever.reranker is not None,
    }
    try:
        opened = retriever.open_collection(alias, retriever.default_mode)
    except RagError as exc:
        return False, {"status": "not_ready", "error": exc.code, "detail": str(exc), **base}
    except Exception:
        # A probe must answer, whatever broke; the traceback stays in the server log.
        log.exception("readiness check failed")
        return False, {
            "status": "not_ready",
            "error": "internal_error",
            "detail": "the readiness check failed unexpectedly; see the server log",
            **base,
        }
    chunks = opened.record.chunks
    return True, {"status": "ready", "serving": opened.name, "chunks": chunks, **base}


def _filter(data: dict[str, Any] | None) -> SearchFilter | None:
    if data is None:
        return None
    equals = data.get("equals")
    if isinstance(equals, dict):
        # JSON Schema's integer includes 3.0; such a value matches as the integer 3.
        integral = {k: int(v) for k, v in equals.items() if isinstance(v, float) and v.is_integer()}
        data = {**data, "equals": {**equals, **integral}}
    try:
        return SearchFilter.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid filter: {exc}") from None


def _version() -> str:
    try:
        return importlib.metadata.version("rag-retriever")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


# -- errors ------------------------------------------------------------------------------------


def _error(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> Any:
    # A message that quotes the client's text may hold a lone surrogate, which UTF-8 cannot
    # carry: escaped here, so an answer about bad input is never a failure to answer.
    detail = detail.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


async def _rag_error(request: Request, exc: Exception) -> Any:
    assert isinstance(exc, RagError)
    if exc.http_status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc)
    return _error(exc.http_status, exc.code, str(exc))


async def _validation_error(request: Request, exc: Exception) -> Any:
    assert isinstance(exc, RequestValidationError)
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        # FastAPI does not parse such a body at all; say so instead of "not a dictionary".
        return _error(
            415,
            "unsupported_media_type",
            f"the body was sent as Content-Type {content_type!r}; send JSON with "
            f"Content-Type: application/json",
        )
    problems = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            problem = f"{e.get('ctx', {}).get('error', 'malformed')} at character {e['loc'][-1]}"
            return _error(400, "bad_request", f"{_NOT_JSON}: {problem}")
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        message = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "string_unicode":  # pydantic's words for a lone surrogate
            message = "not valid Unicode (a lone surrogate); send UTF-8 text"
        problems.append(f"{where}: {message}")
    return _error(422, "invalid_request", "; ".join(problems))


_NOT_JSON = "the body is not valid JSON"


def _is_json(content_type: str) -> bool:
    """application/json or application/<anything>+json, as FastAPI parses bodies."""
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


async def _http_error(request: Request, exc: Exception) -> Any:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        # FastAPI's "There was an error parsing the body": the same 400 as malformed JSON.
        at = exc.__cause__.start
        return _error(400, "bad_request", f"{_NOT_JSON}: it is not UTF-8 text (byte {at})")
    if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
        # Python's JSON parser stops near 1,000 levels; metadata may nest MAX_METADATA_DEPTH.
        return _error(
            400, "bad_request", f"{_NOT_JSON}: it nests too deeply to parse; flatten the body"
        )
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error(exc.status_code, code, str(exc.detail), dict(exc.headers or {}) or None)


# -- ASGI middleware (plain ASGI: they see the raw byte stream, unlike BaseHTTPMiddleware) -----


async def _send_json(send: Send, status: int, body: dict[str, str], **headers: str) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


class _ErrorBoundary:
    """Answers an unexpected exception with a generic JSON 500 and logs its traceback here."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:  # too late for a clean answer; let the server drop the connection
                raise
            await _send_json(
                send,
                500,
                {"error": "internal_error", "detail": "internal server error; see the server log"},
            )


class _BodyLimit:
    """413 when the body is over `max_bytes`: by Content-Length, and by counting what arrives."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_json(
                    send, 400, {"error": "bad_request", "detail": "invalid Content-Length header"}
                )
                return
            if int(declared) > self.max_bytes:
                if int(declared) <= DRAIN_LIMIT_BYTES:
                    await _drain(receive, 0)
                await self._too_large(send)
                return
        # Read the whole body before the app sees any of it (it is at most max_bytes), so a
        # body that is longer than it claims, or has no length at all, is still stopped here.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, size)
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for the disconnect, as usual
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await _send_json(
            send,
            413,
            {
                "error": "payload_too_large",
                "detail": f"the request body is over {self.max_bytes} bytes "
                f"(RAG_MAX_BODY_BYTES); send fewer or shorter queries",
            },
            connection="close",
        )


async def _drain(receive: Receive, seen: int) -> None:
    """Read and drop the rest of a refused body, up to DRAIN_LIMIT_BYTES in all.

    A server that answers and closes while the client is still sending resets the connection,
    and the client sees "connection reset" instead of the 413 and its message.
    """
    while seen <= DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class _Counted:
    """Counts every request by route template, method and status (rag_requests_total)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = scope["app"].state.metrics
        status = 500  # unless a response starts
        start = time.perf_counter()

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            # the route template FastAPI matched (bounded), never the raw path
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            metrics.count_request(route, scope["method"], status, time.perf_counter() - start)


# -- running it --------------------------------------------------------------------------------


def serve(settings: Settings, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Load the models once, then serve until interrupted (one worker: see the module docstring).

    The default host is the loopback interface; pass 0.0.0.0 to accept other machines (inside
    a container that is what you want; elsewhere set RAG_API_KEY first).
    """
    sock = _bind(host, port)  # a busy port is an error before minutes of model loading
    if settings.keys_file is not None:  # and so is a malformed keys file (line and reason)
        Keys(keys_file=settings.keys_file)
    retriever = Retriever.from_settings(settings)
    if not settings.api_key and not settings.keys_file and not _is_loopback(host):
        log.warning(
            "serving on %s without RAG_API_KEY: anyone who can reach port %d can search", host, port
        )
    ready, report = check_ready(retriever)
    if ready:
        log.info(
            "serving %s -> %s (%s chunks)",
            report["collection"],
            report["serving"],
            report["chunks"],
        )
    else:
        log.warning("not ready yet (/readyz answers 503): %s", report["detail"])
    app = create_app(retriever, writes_in_a_process(settings, retriever.store))
    if settings.metrics_port:
        from prometheus_client import start_http_server

        # for a scraper inside the network: the same registry, on a port of its own, no key
        start_http_server(settings.metrics_port, addr=host, registry=app.state.metrics.registry)
        log.info("metrics on http://%s:%d/metrics", host, settings.metrics_port)
    config = uvicorn.Config(
        app,
        workers=1,
        log_level=settings.log_level.lower(),
        timeout_keep_alive=settings.keep_alive_s,
    )
    uvicorn.Server(config).run(sockets=[sock])


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; another process may be "
            f"using the port: choose another with --port"
        ) from None
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def serve_in_thread(app: FastAPI, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn on a background thread; yields its base URL (port 0 = any free).

    For tests, notebooks and benchmarks: the server stops when the block exits.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="rag-retriever-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the HTTP server did not start on {host}:{bound_port}")
        time.sleep(0.01)
    try:
        url_host = f"[{host}]" if ":" in host else host
        yield f"http://{url_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_TIMEOUT_S)
        sock.close()
