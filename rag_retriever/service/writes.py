"""Document writes over HTTP: upsert and delete by id, grouped into versions (group commit).

Example:
    $ curl -s -X PUT localhost:8000/v1/collections/docs/documents \\
        -H "Authorization: Bearer $RAG_WRITE_API_KEY" -H 'content-type: application/json' \\
        -d '{"documents": [{"id": "faq-7", "title": "Refunds", "text": "..."}]}'
    {"change_id": "...", "status": "committed", "collection": "docs__...__v8", "kind": "delta", ...}

Only present when a key can write (`RAG_WRITE_API_KEY`, or `RAG_KEYS_FILE`: then each key writes
only its own tenants, docs/tenants.md; the read key does not allow writes). Each request
is validated on its own (a bad one fails alone, 422, nothing written); valid requests that arrive
within `RAG_WRITE_WINDOW_MS` of the first pending one are merged in arrival order (a later upsert
or delete of the same id wins) and committed as one new version of the alias by
`update_documents`, so a burst of single-document edits costs one version. A request waits up to
`wait` seconds for its version: 200 with the version that now serves the change, else 202 with
the change id to poll (`GET /v1/changes/{id}?wait=S`). A failed commit fails every request of
its group with the writer's error (status and message). One committer thread per alias; the
alias's write lock also serialises writes from other processes (`update`, `ingest`).

Does not do: durability of a change before its version is committed (a pending change is lost if
the process dies; the client sees no 200 for it and can send it again: upserts and deletes are
idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParameter
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from rag_retriever import tracing
from rag_retriever.access import Scope
from rag_retriever.errors import (
    CollectionNotFound,
    ConfigError,
    Forbidden,
    InvalidRequest,
    RagError,
)
from rag_retriever.ingest.validation import (
    MAX_DOCUMENT_CHARS,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    METADATA_TYPES,
    NOT_BLANK_PATTERN,
    validate_delete_ids,
    validate_documents,
)
from rag_retriever.ingest.writer import IngestReport, WriteOptions, update_documents
from rag_retriever.processes import CallProcess, HelperFailed
from rag_retriever.query.options import serving_record
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import (
    ALIAS_SCHEMA_PATTERN,
    MAX_EXACT_INT,
    TENANT_FIELD,
    TENANT_SCHEMA_PATTERN,
    DocKey,
    Document,
    check_alias,
    check_tenant,
    doc_key,
)
from rag_retriever.service.keys import access_of
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, Store, open_store

log = logging.getLogger(__name__)

# Committed or failed changes remembered for polling.
KEEP_CHANGES = 1000
# The writer process's niceness where the OS has no SCHED_IDLE (RAG_WRITE_PROCESS).
WRITER_NICE = 19

# (alias, documents to upsert, documents to delete) -> the report of the version that holds them
Commit = Callable[[str, Sequence[Document], Sequence[DocKey]], IngestReport]


@dataclass
class Change:
    """One write request: pending until its group is committed (`report`) or failed (`error`)."""

    id: str
    alias: str
    upserts: tuple[Document, ...]
    deletes: tuple[DocKey, ...]
    scope: str = ""  # the name of the key that sent it (only it polls the change)
    received: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    report: IngestReport | None = None
    error: RagError | None = None
    grouped: int = 0

    def to_dict(self, *, whole: bool = True) -> dict[str, Any]:
        """The change's state; `whole` False (a key limited to some tenants or by a filter):
        without the version's report and the count of requests grouped with this one, whose
        figures cover every tenant's documents and the other requests' changes."""
        out: dict[str, Any] = {"change_id": self.id, "alias": self.alias}
        if not self.done.is_set():
            return {**out, "status": "pending", "poll": f"/v1/changes/{self.id}"}
        if self.error is not None:
            return {**out, "status": "failed", "error": self.error.code, "detail": str(self.error)}
        assert self.report is not None
        report = self.report
        out |= {
            "status": "committed",
            "collection": report.collection,
            "version": report.version,
            "kind": report.kind,
            "serving": report.promoted or report.kind == "unchanged",
        }
        if not whole:  # what this request sent, not what the version holds
            return out | {"upserts": len(self.upserts), "deletes": len(self.deletes)}
        # requests committed together in this version (group commit)
        return out | {"grouped_requests": self.grouped, "report": report.to_dict()}


class GroupCommitter:
    """Gathers changes per alias for `window_s`, then commits them as one version; a version
    starts at least `interval_s` after the alias's previous one started (a lone write after a
    quiet spell waits only the window)."""

    def __init__(
        self,
        commit: Commit,
        *,
        window_s: float,
        interval_s: float = 0.0,
        max_document_chars: int = MAX_DOCUMENT_CHARS,
    ) -> None:
        self._commit = commit
        self.window_s = window_s
        self.interval_s = interval_s
        self.max_document_chars = max_document_chars
        self._pending: dict[str, list[Change]] = {}
        self._workers: dict[str, threading.Thread] = {}
        self._changes: OrderedDict[str, Change] = OrderedDict()
        # every change not yet committed or failed, oldest first (`_changes` keeps only the
        # last KEEP_CHANGES for status lookups; a backlog can be longer)
        self._open: dict[str, Change] = {}
        self._cond = threading.Condition()
        # groups committed and failed, and their seconds (read by WriteMetrics at scrape time)
        self.commits = {"committed": 0, "failed": 0}
        self.commit_seconds = 0.0

    def totals(self) -> tuple[dict[str, int], float]:
        """Groups committed and failed so far, and the seconds their commits took."""
        with self._cond:
            return dict(self.commits), self.commit_seconds

    def waiting(self) -> tuple[int, float]:
        """Changes not yet committed or failed, and the seconds the oldest of them has waited."""
        with self._cond:
            oldest = next(iter(self._open.values()), None)
            return len(self._open), time.time() - oldest.received if oldest else 0.0

    def submit(
        self,
        alias: str,
        upserts: Sequence[Document],
        deletes: Sequence[str | DocKey],
        *,
        scope: str = "",
    ) -> Change:
        """Queue one request's change (validated here, by the rules `ingest` applies to a file,
        before anything is chunked or written: a bad request fails alone, 422). A delete names
        an id, or (tenant, id) for a tenant's document."""
        validate_documents(upserts, source="documents", max_chars=self.max_document_chars)
        keys = tuple(doc_key(ref) for ref in deletes)
        validate_delete_ids([i for _, i in keys], source="ids")
        change = Change(uuid.uuid4().hex, alias, tuple(upserts), keys, scope)
        with self._cond:
            self._pending.setdefault(alias, []).append(change)
            self._changes[change.id] = change
            self._open[change.id] = change
            while len(self._changes) > KEEP_CHANGES:
                self._changes.popitem(last=False)
            if alias not in self._workers:
                worker = threading.Thread(
                    target=self._run, args=(alias,), name=f"commit-{alias}", daemon=True
                )
                self._workers[alias] = worker
                worker.start()
            self._cond.notify_all()
        return change

    def get(self, change_id: str, *, scope: str = "") -> Change:
        with self._cond:
            change = self._changes.get(change_id)
        if change is None or change.scope != scope:
            raise CollectionNotFound(
                f"no change {change_id!r} is known here (the last {KEEP_CHANGES} are kept, per "
                f"serving process)"
            )
        return change

    def _run(self, alias: str) -> None:
        last_start = -math.inf
        while True:
            with self._cond:
                while not self._pending.get(alias):
                    self._cond.wait()
            time.sleep(self.delay_s(time.monotonic() - last_start))
            with self._cond:
                group = self._pending.pop(alias, [])
            if group:
                last_start = time.monotonic()
                self._commit_group(alias, group)

    def delay_s(self, since_last_start: float) -> float:
        """How long pending changes wait for the rest of their burst, `since_last_start` seconds
        after the alias's previous version started: the window, or what keeps versions
        `interval_s` apart (each costs every serving process a shard load, settings.py's
        RAG_WRITE_INTERVAL_MS says why)."""
        return max(self.window_s, self.interval_s - since_last_start)

    def _commit_group(self, alias: str, group: list[Change]) -> None:
        upserts, deletes = merge(group)
        started = time.perf_counter()
        try:
            report = self._commit(alias, list(upserts.values()), sorted(deletes))
        except RagError as exc:
            for change in group:
                change.error = exc
        except Exception as exc:
            log.exception("committing %d change(s) to %s failed", len(group), alias)
            error = RagError(
                f"the write failed unexpectedly ({type(exc).__name__}); see the server log"
            )
            for change in group:
                change.error = error
        else:
            log.info(
                "committed %d change(s) to %s as %s (%s)",
                len(group),
                alias,
                report.collection,
                report.kind,
            )
            for change in group:
                change.report = report
        with self._cond:
            self.commits["failed" if group[0].error else "committed"] += 1
            self.commit_seconds += time.perf_counter() - started
            for change in group:
                del self._open[change.id]
        for change in group:
            change.grouped = len(group)
            change.done.set()


class WriteMetrics(Collector):
    """The writes' metrics, read at scrape time: what waits, what was committed or failed and in
    how long, and whether the writer process (RAG_WRITE_PROCESS) is alive."""

    def __init__(self, committer: GroupCommitter, helper: CallProcess[Any, Any] | None) -> None:
        self.committer = committer
        self.helper = helper

    def collect(self) -> Iterator[Any]:
        waiting, oldest = self.committer.waiting()
        yield GaugeMetricFamily(
            "rag_writes_pending", "write requests not yet committed or failed", value=waiting
        )
        yield GaugeMetricFamily(
            "rag_writes_oldest_pending_seconds",
            "seconds the oldest write request not yet committed has waited (0: none waits)",
            value=oldest,
        )
        commits, seconds = self.committer.totals()
        groups = CounterMetricFamily(
            "rag_write_commits",
            "groups of writes committed as a version, or failed",
            labels=["outcome"],
        )
        for outcome, n in commits.items():
            groups.add_metric([outcome], n)
        yield groups
        yield CounterMetricFamily(
            "rag_write_commit_seconds", "seconds spent committing groups of writes", value=seconds
        )
        if self.helper is not None:
            yield GaugeMetricFamily(
                "rag_write_process_up",
                "1 while the writer process (RAG_WRITE_PROCESS) is alive; 0: writes answer 503",
                value=1.0 if self.helper.alive else 0.0,
            )


def merge(group: Sequence[Change]) -> tuple[dict[DocKey, Document], set[DocKey]]:
    """The changes of a group in arrival order: a later upsert or delete of a document wins."""
    upserts: dict[DocKey, Document] = {}
    deletes: set[DocKey] = set()
    for change in group:
        for doc in change.upserts:
            deletes.discard(doc.key)
            upserts[doc.key] = doc
        for key in change.deletes:
            upserts.pop(key, None)
            deletes.add(key)
    return upserts, deletes


# -- the HTTP routes ----------------------------------------------------------------------------

# How long a write request waits for its version by default, and at most.
DEFAULT_WAIT_S = 30.0
MAX_WAIT_S = 300.0
# How often a waiting write route looks at its change (a write takes seconds).
WAIT_POLL_S = 0.02


# The alias of a write's path, documented as the names check_alias accepts; checked there (one
# check, one message).
AliasParameter = Annotated[
    str,
    PathParameter(
        description="the alias to change (a version name is not accepted)",
        json_schema_extra={"pattern": ALIAS_SCHEMA_PATTERN, "maxLength": 64},
    ),
]


class DocumentIn(BaseModel):
    """One document, as a line of an ingested .jsonl (metadata explicit here)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: str = Field(
        min_length=1,
        description="the document id (a later upsert replaces it; unique within a request)",
        json_schema_extra={"pattern": NOT_BLANK_PATTERN},
    )
    title: str | None = Field(default=None, description="default: the id")
    text: str = Field(
        description="the document's text (chunked like ingest's; not blank: to remove a "
        "document, delete it)",
        json_schema_extra={"pattern": NOT_BLANK_PATTERN},
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description=f"filterable fields: each value a {METADATA_TYPES} (numbers finite, "
        f"integers within ±{MAX_EXACT_INT}, text valid Unicode), nested at most "
        f"{MAX_METADATA_DEPTH} levels (this object is level 1), at most {MAX_METADATA_BYTES} "
        f"bytes as compact JSON; top-level names not empty, without '\"' or '\\'",
        json_schema_extra={"propertyNames": {"minLength": 1, "pattern": '^[^"\\\\]+$'}},
    )


class UpsertBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    documents: list[DocumentIn] = Field(
        min_length=1,
        description="documents to add or replace, each id once; checked by the rules ingest "
        "applies to a file (a problem anywhere refuses the whole request, 422, nothing written)",
    )
    wait: float = Field(
        default=DEFAULT_WAIT_S,
        ge=0,
        le=MAX_WAIT_S,
        description="seconds to wait for the version that serves the change (else 202)",
    )


class DeleteBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    ids: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, description="document ids to delete (absent ones are counted)"
    )
    tenant: str | None = Field(
        default=None,
        description="the tenant of these documents (default: the key's, when it has one "
        "tenant; else documents of no tenant)",
        json_schema_extra={"pattern": TENANT_SCHEMA_PATTERN, "maxLength": 64},
    )
    wait: float = Field(default=DEFAULT_WAIT_S, ge=0, le=MAX_WAIT_S)


_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": meaning}
    for status, meaning in {
        202: "accepted, not yet committed: poll /v1/changes/{change_id}",
        400: "malformed body: not valid JSON (or not UTF-8 text)",
        401: "missing or wrong write key (RAG_WRITE_API_KEY; the read key does not allow writes)",
        403: "a key that cannot write, or not this alias, or a document of a tenant outside its "
        "scope: nothing of the request is written",
        404: "unknown alias",
        409: "the alias cannot take a delta (no live version, another model): run ingest",
        413: "body over RAG_MAX_BODY_BYTES",
        415: "the body was not sent as JSON (Content-Type: application/json)",
        422: "invalid documents or ids: every problem, with the document's position and id and "
        "the field",
        500: "an unexpected error (details only in the server log)",
        503: "Qdrant is unreachable",
    }.items()
}


def add_write_routes(app: FastAPI, retriever: Retriever, settings: Settings) -> GroupCommitter:
    """`PUT /v1/collections/{alias}/documents`, `POST /v1/collections/{alias}/documents:delete`,
    `GET /v1/changes/{change_id}`; behind the write key (checked here, see server._ApiKey)."""

    def commit(alias: str, upserts: Sequence[Document], deletes: Sequence[DocKey]) -> IngestReport:
        # the model only when there is text to embed: a delete loads none
        return http_commit(
            retriever.store, lambda: retriever.encoder, settings, alias, upserts, deletes
        )

    helper: CallProcess[tuple[str, list[Document], list[DocKey]], IngestReport] | None = None
    if settings.write_process == "true":
        if not isinstance(retriever.store, EdgeStore):
            raise ConfigError(
                "RAG_WRITE_PROCESS needs the embedded store (Qdrant Edge): a Qdrant server's "
                "writes run in the server already; unset RAG_WRITE_PROCESS or RAG_QDRANT_URL"
            )
        # `writer`: the same process under a name the closure below sees as never None
        helper = writer = CallProcess(ProcessCommit(settings), "writer")
        app.state.write_process = writer
        log.info("writes commit in a writer process of their own (pid %d)", writer.pid)

        def commit(
            alias: str, upserts: Sequence[Document], deletes: Sequence[DocKey]
        ) -> IngestReport:
            try:
                return writer((alias, list(upserts), list(deletes)))
            except HelperFailed as exc:
                log.error("%s", exc)
                raise WriterUnavailable(
                    f"{exc}; nothing of this write was served. Restart the service to write "
                    "again (queries go on)"
                ) from None

    committer = GroupCommitter(
        commit,
        window_s=settings.write_window_ms / 1000,
        interval_s=settings.write_interval_ms / 1000,
        max_document_chars=settings.max_document_chars,
    )
    app.state.committer = committer
    app.state.metrics.registry.register(WriteMetrics(committer, helper))

    def scoped(request: Request, alias: str) -> Scope:
        """The key's scope, once it is known to write and to open `alias` (server.KeyCheck
        checked the first already; checked again here, where the write happens)."""
        access = access_of(request)
        if not access.write:
            raise Forbidden(f"key {access.name!r} cannot write")
        access.check_collection(alias)
        return access

    async def answer(change: Change, wait: float, access: Scope) -> JSONResponse:
        await until_set(change.done, wait)
        if change.done.is_set() and change.error is not None:
            raise change.error
        return JSONResponse(
            change.to_dict(whole=access.unrestricted),
            status_code=200 if change.done.is_set() else 202,
        )

    def alias_of(alias: str) -> str:
        try:
            return check_alias(alias)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    @app.put(
        "/v1/collections/{alias}/documents",
        summary="Upsert documents (a new version made from the live one plus the change)",
        responses=_WRITE_ERRORS,
    )
    async def upsert(alias: AliasParameter, body: UpsertBody, request: Request) -> JSONResponse:
        name = alias_of(alias)
        access = scoped(request, name)
        docs = [in_scope(d, access) for d in body.documents]
        # validated in a worker thread (a large body), waited for on the event loop
        found = await run_in_threadpool(committer.submit, name, docs, (), scope=access.name)
        return await answer(found, body.wait, access)

    @app.post(
        "/v1/collections/{alias}/documents:delete",
        summary="Delete documents by id (a new version without them)",
        responses=_WRITE_ERRORS,
    )
    async def delete(alias: AliasParameter, body: DeleteBody, request: Request) -> JSONResponse:
        name = alias_of(alias)
        access = scoped(request, name)
        tenant = access.write_tenant(tenant_name(body.tenant))
        keys = [(tenant, i) for i in body.ids]
        found = await run_in_threadpool(committer.submit, name, (), keys, scope=access.name)
        return await answer(found, body.wait, access)

    @app.get(
        "/v1/changes/{change_id}",
        summary="A write's state: committed (its version), pending, or failed",
        responses=_WRITE_ERRORS,
    )
    async def change(
        change_id: str,
        request: Request,
        wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0,
    ) -> JSONResponse:
        # a key sees its own changes only (another key's is "not known here")
        access = access_of(request)
        if not access.write:
            raise Forbidden(f"key {access.name!r} cannot write")
        found = committer.get(change_id, scope=access.name)
        return await answer(found, wait, access)

    return committer


async def until_set(event: threading.Event, timeout: float) -> None:
    """Wait up to `timeout` for `event` on the event loop, polled: a write route that waited in
    a worker thread held one of the pool that searches and the probes share (40 waiting writes
    stopped every tenant's searches and /healthz for up to MAX_WAIT_S)."""
    if not timeout > 0:  # NaN included: `left <= 0` is never true of it
        return
    deadline = time.monotonic() + timeout
    while not event.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(WAIT_POLL_S, left))


def http_commit(
    store: Store,
    load_encoder: Callable[[], Any],
    settings: Settings,
    alias: str,
    upserts: Sequence[Document],
    deletes: Sequence[DocKey],
) -> IngestReport:
    """One group of HTTP writes as a new version (in the service's process or its writer's)."""
    return update_documents(
        upserts,
        deletes,
        alias=alias,
        load_encoder=load_encoder,
        store=store,
        source="HTTP",
        options=WriteOptions.from_settings(settings),
    )


class WriterUnavailable(RagError):
    """The writer process (RAG_WRITE_PROCESS) died: writes fail until the service restarts."""

    http_status = 503
    code = "writer_unavailable"


def writes_in_a_process(settings: Settings, store: Store) -> Settings:
    """`rag-retriever serve`'s settings with RAG_WRITE_PROCESS=auto made definite: on for the
    embedded store (its writes would run in the serving process), off for a Qdrant server (its
    writes run in the server). An app made with create_app keeps auto, which there means off."""
    if settings.write_process != "auto":
        return settings
    on = isinstance(store, EdgeStore)
    return settings.replace(write_process="true" if on else "false")


class ProcessCommit:
    """The service's commit in its writer process (RAG_WRITE_PROCESS): its own store handle and
    encoder (the one the service's default collection serves, as the service's own), loaded on
    the first write that embeds. The process runs with one PyTorch thread under the kernel's
    SCHED_IDLE policy (`idle_priority`): in the service's process an edit's Python shared the
    interpreter lock with the queries, and its passes the compute thread; at nice 10 its own
    passes still took time slices the queries wanted (docs/benchmarks.md, "The brief under
    load"); now it runs on CPU that nothing else wants. A write waits while the cores are busy:
    on a saturated machine edits become slow, never lost, and queries keep the cores."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._store: Store | None = None  # opened by the first call, in the writer process
        self._encoder: Any = None

    def __call__(self, call: tuple[str, list[Document], list[DocKey]]) -> IngestReport:
        store = self._store or self._start()
        alias, upserts, deletes = call
        return http_commit(store, self._load_encoder, self.settings, alias, upserts, deletes)

    def _start(self) -> Store:
        logging.basicConfig(
            level=self.settings.log_level, format="%(levelname)s %(name)s: %(message)s"
        )
        log.info("writer process %d: %s priority", os.getpid(), idle_priority())
        try:  # the service's RAG_TRACING: its writes' spans (a trace of their own, not the request's)
            tracing.configure_from(self.settings)
        except ConfigError as exc:
            log.warning("writer process: writes are not traced: %s", exc)
        import torch

        torch.set_num_threads(1)
        self._store = open_store(self.settings)
        return self._store

    def _load_encoder(self) -> Any:
        if self._encoder is None:
            from rag_retriever.models.encoder import load_encoder

            assert self._store is not None
            self._encoder = load_encoder(
                self.settings, serving_record(self._store, self.settings.collection)
            )
        return self._encoder


def idle_priority() -> str:
    """Run this process only on CPU time nothing else wants: Linux's SCHED_IDLE, else nice
    WRITER_NICE. Both are per thread: set on each thread running now (imports start some) and
    inherited by those started later. Returns which was set."""
    idle = getattr(os, "SCHED_IDLE", None)
    tasks = Path("/proc/self/task")
    threads = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for thread in threads:
        try:
            if idle is not None:
                os.sched_setscheduler(thread, idle, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, thread, WRITER_NICE)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:
            log.warning("writer process: its CPU priority stays as it was: %s", exc)
            return "the default"
    return "SCHED_IDLE" if idle is not None else f"nice {WRITER_NICE}"


def in_scope(doc: DocumentIn, access: Scope) -> Document:
    """The document a write with this key makes: in the tenant it names, or the key's own when
    the key has one tenant; Forbidden for a tenant outside the key's scope."""
    metadata = dict(doc.metadata)
    named = metadata.get(TENANT_FIELD)
    if named is None or isinstance(named, str):  # else validation names the bad value
        tenant = access.write_tenant(tenant_name(named or ""))
        if tenant:
            metadata[TENANT_FIELD] = tenant
    return Document(doc.id, doc.title or doc.id, doc.text, metadata)


def tenant_name(name: str | None) -> str:
    """A tenant a request names ("" for none); a malformed one is a 422, before any scope check
    (so a refusal never depends on which tenants exist)."""
    if not name:
        return ""
    try:
        return check_tenant(name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
