"""OpenTelemetry spans for a search, an ingest, an update and a compaction; off and free by default.

Example:
    >>> configure("off")
    >>> with span("rag.search", query_id="q1", mode="hybrid", k=10):
    ...     with span("rag.search.encode"):
    ...         pass
    ...     set_attributes(hits=3)
    >>> current_trace_id() is None
    True

With `configure("on")` (the host application's OpenTelemetry setup), "console" (stderr) or
"otlp" (an OTLP/HTTP collector) the same block opens two spans, "rag.search.encode" a child of
"rag.search", with the attributes `rag.query_id`, `rag.mode`, `rag.k` and `rag.hits`; an
exception that leaves a block is recorded on its span, which gets error status, and re-raised.
Attributes that are None are left out. Off, `span` returns one shared no-op context manager after a
single check of a module global: 0.3-0.7 µs a `with` block, 2.5 µs for a search's six spans
(docs/operating.md "Traces").

The API (opentelemetry-api) is all that "on" needs; "console" and "otlp" need the SDK and the
exporter, the optional extra `pip install -e '.[tracing]'` (from the project's checkout). Their provider is this
module's own: the global one stays the host's to set (it can be set only once per process), so
`configure` may be called again. A collector that cannot be reached costs no query: exports run
in the SDK's background thread, failures are counted (`failed_exports`), warned about once per
outage through the logger "rag_retriever.tracing", and for RETRY_AFTER_S batches are dropped
without an attempt.

Does not do: metrics or logs through OpenTelemetry (/metrics and the query log stay as they are),
propagation of a trace context across HTTP (the host's instrumentation does that), sampling of
its own (the SDK's default, or the host's), or automatic instrumentation of libraries.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from rag_retriever.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from rag_retriever.settings import Settings

__all__ = [
    "MODES",
    "TracingMode",
    "child_environment",
    "configure",
    "configure_from",
    "current_trace_id",
    "failed_exports",
    "flush",
    "set_attributes",
    "shutdown",
    "span",
]

log = logging.getLogger("rag_retriever.tracing")

# The modes, as RAG_TRACING accepts them (settings.py takes its type from here).
TracingMode = Literal["off", "on", "console", "otlp"]
MODES: tuple[TracingMode, ...] = get_args(TracingMode)

# What an attribute may hold: OpenTelemetry's types (it drops anything else with a warning).
AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]

# Our attributes' namespace, so that they never collide with OpenTelemetry's semantic
# conventions (db.*, http.*, exception.*).
ATTRIBUTE_PREFIX = "rag."
# The instrumentation scope: where the spans came from, as a backend shows it.
TRACER_NAME = "rag_retriever"
# service.name of the spans of "console" and "otlp" when OTEL_SERVICE_NAME is unset.
SERVICE_NAME = "rag-retriever"
# The collector's path for traces under its base URL (OTLP/HTTP specification).
OTLP_TRACES_PATH = "/v1/traces"
# After a failed export, batches are dropped for this long instead of each waiting out the
# exporter's retries (up to OTEL_EXPORTER_OTLP_TIMEOUT, 10 s by default): a dead collector costs
# the background thread one attempt per 30 s, and a command's exit at most one attempt.
RETRY_AFTER_S = 30.0

# The SDK's BatchSpanProcessor does not bound a flush by it yet (opentelemetry-python #4568): the
# exporter's own timeout (OTEL_EXPORTER_OTLP_TIMEOUT) and RETRY_AFTER_S do.
FLUSH_TIMEOUT_S = 30.0

EXTRA_HINT = "pip install -e '.[tracing]' in rag-retriever's checkout"

# The one no-op context manager `span` returns while tracing is off (nullcontext keeps no state).
_OFF: AbstractContextManager[None] = nullcontext()


@dataclass(frozen=True)
class _Active:
    """Where spans go while tracing is on."""

    mode: TracingMode
    tracer: Tracer
    get_current_span: Callable[[], Span]
    # The SDK provider of "console" and "otlp" (this module's to flush and shut down); None for
    # "on", whose provider is the host's.
    owned: Any = None
    exporter: _ReportedExporter | None = None


# None = off. Read once by `span` without a lock; replaced whole by `configure` under _lock.
_active: _Active | None = None
_lock = threading.Lock()
# What `configure` was last given, as the variables a child process reads (None: never called).
_given: dict[str, str] | None = None


def span(name: str, **attributes: AttributeValue | None) -> AbstractContextManager[None]:
    """A span named `name` (e.g. "rag.search.encode") around a `with` block, a child of the span
    open around it, with `attributes` as `rag.<key>` (None values left out). An exception leaving
    the block is recorded, the span gets error status, and the exception propagates unchanged.
    Off: the shared no-op."""
    active = _active
    if active is None:
        return _OFF
    return _opened(active.tracer, name, attributes)


@contextmanager
def _opened(tracer: Tracer, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
    # start_as_current_span records an exception that leaves the block, sets error status and
    # re-raises it (record_exception, set_status_on_exception: both on by default).
    with tracer.start_as_current_span(name, attributes=_named(attributes)):
        yield


def finished_span(name: str, seconds: float, **attributes: AttributeValue | None) -> None:
    """A child span of the innermost open one for a step that just ended after `seconds`: for
    code that already times its steps one after the other (the writer's laps), so each step
    needs no `with` block of its own. Off: nothing."""
    active = _active
    if active is None:
        return
    end = time.time_ns()
    step = active.tracer.start_span(
        name, start_time=end - int(seconds * 1e9), attributes=_named(attributes)
    )
    step.end(end_time=end)


def set_attributes(**attributes: AttributeValue | None) -> None:
    """Add `attributes` (as `rag.<key>`, None values left out) to the innermost open span: what
    is known only after the work, e.g. `set_attributes(hits=len(hits))`. Off: nothing."""
    active = _active
    if active is None:
        return
    active.get_current_span().set_attributes(_named(attributes))


def current_trace_id() -> str | None:
    """The trace id of the innermost open span as 32 hex digits (as a tracing backend shows it),
    for the query log line; None when tracing is off, outside any span, or when the span is not
    sampled (no backend would have it)."""
    active = _active
    if active is None:
        return None
    context = active.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return format(context.trace_id, "032x")


def configure(
    mode: str,
    *,
    endpoint: str | None = None,
    service_name: str | None = None,
    provider: TracerProvider | None = None,
) -> None:
    """Turn tracing off, or send spans to `mode`'s destination; replaces (and flushes) the
    previous configuration.

    - "off": no spans, no OpenTelemetry import.
    - "on": the TracerProvider `provider`, by default the global one the host application set up
      (spans are dropped until it does).
    - "console": each span as JSON on stderr when it ends (the SDK's ConsoleSpanExporter).
    - "otlp": batches to an OTLP/HTTP collector: `endpoint` is its base URL (http://host:4318;
      /v1/traces is added), else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
      OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318.

    `service_name` (console, otlp): OTEL_SERVICE_NAME, else "rag-retriever". ConfigError for an
    unknown mode, for `provider` with another mode than "on", and for a mode whose packages are
    not installed (naming the pip command).
    """
    if mode not in _MODE_STARTS:
        raise ConfigError(
            f"tracing mode {mode!r} is not one of {', '.join(MODES)} (RAG_TRACING, --tracing)"
        )
    if provider is not None and mode != "on":
        raise ConfigError(f"a provider is used by tracing mode 'on' only, not {mode!r}")
    options = _Options(endpoint=endpoint, service_name=service_name, provider=provider)
    new = _MODE_STARTS[mode](options)  # before the old one stops: a ConfigError changes nothing
    given = {"RAG_TRACING": mode, "RAG_OTLP_ENDPOINT": endpoint or ""}  # "": unset
    if service_name:
        given["OTEL_SERVICE_NAME"] = service_name
    global _active, _given
    with _lock:
        old, _active = _active, new
        _given = None if mode == "on" else given
    _stop(old)


def child_environment() -> dict[str, str]:
    """The variables that make a child process of ours (a background compaction) trace as this
    one was configured to: RAG_TRACING and RAG_OTLP_ENDPOINT as `configure` was last given them,
    so that flags (`--tracing`) reach it too. Empty when `configure` was never called here, or
    was called with "on" (the host's provider does not cross a process): the child then reads
    the environment it inherits."""
    given = _given
    return {} if given is None else dict(given)


def configure_from(settings: Settings) -> None:
    """`configure` with RAG_TRACING and RAG_OTLP_ENDPOINT (what `serve` and the CLI call)."""
    configure(settings.tracing, endpoint=settings.otlp_endpoint)


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Export the spans that have ended and wait for it (console, otlp); True when done, or when
    there is nothing of ours to flush. A failed export is not an error here: it is counted and
    warned about like any other."""
    active = _active
    if active is None or active.owned is None:
        return True
    return bool(active.owned.force_flush(int(timeout_s * 1000)))


def shutdown() -> None:
    """Flush and stop the provider of "console" or "otlp" and turn tracing off. The SDK also does
    it at exit, so a command does not need to call it."""
    global _active, _given
    with _lock:
        old, _active, _given = _active, None, None
    _stop(old)


def failed_exports() -> int:
    """Batches of spans that the current "console" or "otlp" configuration failed to export or
    dropped while the collector was unreachable; 0 for the other modes."""
    active = _active
    return 0 if active is None or active.exporter is None else active.exporter.failed


def _named(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {ATTRIBUTE_PREFIX + key: value for key, value in attributes.items() if value is not None}


def _stop(active: _Active | None) -> None:
    if active is not None and active.owned is not None:
        active.owned.shutdown()  # flushes what it holds; unregisters its atexit hook


# --- the modes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    endpoint: str | None
    service_name: str | None
    provider: TracerProvider | None


def _start_off(options: _Options) -> None:
    return None


def _start_on(options: _Options) -> _Active:
    try:
        from opentelemetry import trace
    except ImportError:
        raise ConfigError(
            "RAG_TRACING=on needs opentelemetry-api, a dependency of rag-retriever that is not "
            "importable here; reinstall it (pip install opentelemetry-api) or set RAG_TRACING=off"
        ) from None
    provider = options.provider or trace.get_tracer_provider()
    return _Active("on", provider.get_tracer(TRACER_NAME), trace.get_current_span)


def _start_console(options: _Options) -> _Active:
    sdk = _sdk("console")
    exporter = _ReportedExporter(
        sdk.ConsoleSpanExporter(out=sys.stderr), "stderr", fix="is stderr closed?"
    )
    # Each span is written as it ends: the mode is for watching a command or a test run.
    return _sdk_active("console", sdk, sdk.SimpleSpanProcessor(exporter), exporter, options)


def _start_otlp(options: _Options) -> _Active:
    sdk = _sdk("otlp")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise _missing("otlp", "opentelemetry-exporter-otlp-proto-http") from None
    url = None
    if options.endpoint is not None:
        url = options.endpoint.rstrip("/").removesuffix(OTLP_TRACES_PATH) + OTLP_TRACES_PATH
    inner = OTLPSpanExporter(endpoint=url)  # url None: the OTEL_EXPORTER_OTLP_* variables
    # The URL it resolved, for the warning (a private attribute: a fallback if it moves).
    destination = str(getattr(inner, "_endpoint", url or "the OTLP collector"))
    fix = "check RAG_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_ENDPOINT) and that the collector runs"
    exporter = _ReportedExporter(inner, destination, fix=fix, mute=type(inner).__module__)
    # Batches leave from the SDK's background thread: a query never waits for the network.
    return _sdk_active("otlp", sdk, sdk.BatchSpanProcessor(exporter), exporter, options)


_MODE_STARTS: dict[str, Callable[[_Options], _Active | None]] = {
    "off": _start_off,
    "on": _start_on,
    "console": _start_console,
    "otlp": _start_otlp,
}


@dataclass(frozen=True)
class _Sdk:
    """The SDK's pieces, imported when a mode needs them."""

    TracerProvider: Any
    Resource: Any
    SimpleSpanProcessor: Any
    BatchSpanProcessor: Any
    ConsoleSpanExporter: Any
    SUCCESS: Any


def _sdk(mode: str) -> _Sdk:
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
            SpanExportResult,
        )
    except ImportError:
        raise _missing(mode, "opentelemetry-sdk") from None
    del trace  # imported to fail here, not later, when the API itself is missing
    return _Sdk(
        TracerProvider,
        Resource,
        SimpleSpanProcessor,
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExportResult.SUCCESS,
    )


def _missing(mode: str, package: str) -> ConfigError:
    return ConfigError(
        f"RAG_TRACING={mode} needs {package}, which is not installed; {EXTRA_HINT}, "
        "or set RAG_TRACING=on to use the host application's OpenTelemetry setup"
    )


def _sdk_active(
    mode: TracingMode, sdk: _Sdk, processor: Any, exporter: _ReportedExporter, options: _Options
) -> _Active:
    from opentelemetry import trace

    name = options.service_name or os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME
    provider = sdk.TracerProvider(resource=sdk.Resource.create({"service.name": name}))
    provider.add_span_processor(processor)
    return _Active(
        mode, provider.get_tracer(TRACER_NAME), trace.get_current_span, provider, exporter
    )


class _ReportedExporter:
    """A span exporter whose failures never leave it: each failed or skipped batch is counted, the
    first of an outage is warned about once through our logger, and for RETRY_AFTER_S after a
    failure batches are dropped without an attempt. `mute` names the wrapped exporter's logger,
    whose retry warnings and errors (several a batch) go to our debug log instead."""

    def __init__(
        self, inner: SpanExporter, destination: str, *, fix: str, mute: str | None = None
    ) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._inner = inner
        self._destination = destination
        self._fix = fix
        self._result = SpanExportResult
        self._lock = threading.Lock()
        self._retry_at = 0.0  # monotonic time of the next attempt after a failure
        self._warned = False
        self._said: list[str] = []  # what the exporter logged during the current batch
        self.failed = 0
        self._muted: logging.Logger | None = None
        if mute is not None:
            self._muted = logging.getLogger(mute)
            self._muted.addFilter(self._capture)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if time.monotonic() < self._retry_at:
            return self._failed(None)
        self._said = []
        try:
            result = self._inner.export(spans)
        # The boundary of the background thread: nothing from an exporter may reach the SDK's
        # worker (it would log a traceback a batch) or a query (SimpleSpanProcessor).
        except Exception as exc:
            return self._failed(f"{type(exc).__name__}: {exc}")
        if result is not self._result.SUCCESS:
            return self._failed(self._said[0] if self._said else "the exporter reported a failure")
        with self._lock:
            if self._warned:
                log.info("traces: export to %s works again", self._destination)
            self._warned, self._retry_at = False, 0.0
        return result

    def _failed(self, reason: str | None) -> SpanExportResult:
        """Count a batch not exported; `reason` None: skipped while waiting to retry."""
        with self._lock:
            self.failed += 1
            if reason is not None:
                self._retry_at = time.monotonic() + RETRY_AFTER_S
            warn, self._warned = not self._warned, True
        if warn:
            log.warning(
                "traces cannot be exported to %s (%s); queries are unaffected, spans are dropped "
                "and counted until it works again (next try in %.0f s); %s",
                self._destination,
                reason,
                RETRY_AFTER_S,
                self._fix,
            )
        return self._result.FAILURE

    def _capture(self, record: logging.LogRecord) -> bool:
        self._said.append(record.getMessage())
        log.debug("exporter: %s", record.getMessage())
        return False  # not logged by the exporter's own logger

    def shutdown(self) -> None:
        try:
            self._inner.shutdown()
        finally:
            if self._muted is not None:
                self._muted.removeFilter(self._capture)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))
