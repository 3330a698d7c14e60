"""Traces: spans, their nesting and attributes, against the SDK's in-memory exporter; off is one
shared no-op; an unreachable collector is one warning and no failed query; a missing package is a
ConfigError naming the pip command."""

from __future__ import annotations

import importlib.util
import logging
import socket
import sys
from collections.abc import Iterator
from contextlib import nullcontext

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from rag_retriever import tracing
from rag_retriever.errors import ConfigError
from rag_retriever.settings import Settings, choices_of
from rag_retriever.tracing import current_trace_id, set_attributes, span


@pytest.fixture(autouse=True)
def _off_afterwards() -> Iterator[None]:
    yield
    tracing.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on leaving: nothing listens there


def _search(query_id: str) -> str | None:
    """The shape of a traced search: a root span, stages inside it, hits added afterwards."""
    with span("rag.search", query_id=query_id, mode="hybrid", k=3, collection="docs"):
        with span("rag.search.encode", texts=1):
            pass
        with span("rag.search.dense", top_n=100, filter=None):
            set_attributes(hits=7)
        trace_id = current_trace_id()
        set_attributes(hits=3)
    return trace_id


def test_off_is_the_default_and_one_shared_no_op(spans: InMemorySpanExporter) -> None:
    assert Settings().tracing == "off" and tracing.failed_exports() == 0
    tracing.configure("off")
    first, second = span("rag.search", k=1), span("rag.ingest")
    assert first is second and isinstance(first, nullcontext)
    assert _search("q1") is None
    assert spans.get_finished_spans() == ()
    assert tracing.flush() is True


def test_the_module_imports_and_runs_off_without_opentelemetry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in sys.modules if n == "opentelemetry" or n.startswith("opentelemetry.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    spec = importlib.util.spec_from_file_location("tracing_without_otel", tracing.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fresh)  # dataclasses look it up
    spec.loader.exec_module(fresh)
    fresh.configure("off")
    with fresh.span("rag.search", k=1):
        fresh.set_attributes(hits=1)
        assert fresh.current_trace_id() is None
    with pytest.raises(ConfigError, match=r"needs opentelemetry-api.*RAG_TRACING=off"):
        fresh.configure("on")
    with pytest.raises(
        ConfigError, match=r"pip install -e '\.\[tracing\]' in rag-retriever's checkout"
    ):
        fresh.configure("otlp")


def test_nested_spans_have_their_names_parents_and_attributes(
    spans: InMemorySpanExporter,
) -> None:
    _search("q1")
    encode, dense, search = spans.get_finished_spans()
    assert [s.name for s in (search, encode, dense)] == [
        "rag.search",
        "rag.search.encode",
        "rag.search.dense",
    ]
    assert search.parent is None
    for child in (encode, dense):
        assert child.parent is not None and search.context is not None
        assert child.parent.span_id == search.context.span_id
        assert child.context is not None and child.context.trace_id == search.context.trace_id
    assert dict(search.attributes or {}) == {
        "rag.query_id": "q1",
        "rag.mode": "hybrid",
        "rag.k": 3,
        "rag.collection": "docs",
        "rag.hits": 3,
    }
    assert dict(encode.attributes or {}) == {"rag.texts": 1}
    assert dict(dense.attributes or {}) == {
        "rag.top_n": 100,
        "rag.hits": 7,
    }  # filter None: left out
    assert all(s.status.status_code is StatusCode.UNSET for s in (search, encode, dense))


def test_an_exception_is_recorded_with_error_status_and_re_raised(
    spans: InMemorySpanExporter,
) -> None:
    error = RuntimeError("qdrant went away")
    with pytest.raises(RuntimeError) as raised, span("rag.search", k=1), span("rag.search.dense"):
        raise error
    assert raised.value is error
    for ended in spans.get_finished_spans():  # the stage and the search it ended
        assert ended.status.status_code is StatusCode.ERROR
        assert "qdrant went away" in (ended.status.description or "")
        (event,) = ended.events
        assert event.name == "exception"
        assert (event.attributes or {})["exception.type"] == "RuntimeError"


def test_the_trace_id_is_the_open_span_s_and_none_outside(spans: InMemorySpanExporter) -> None:
    assert current_trace_id() is None
    trace_id = _search("q1")
    (*_, search) = spans.get_finished_spans()
    assert search.context is not None
    assert trace_id == format(search.context.trace_id, "032x") and len(trace_id) == 32
    assert current_trace_id() is None
    tracing.configure("off")
    with span("rag.search"):
        assert current_trace_id() is None


@pytest.mark.parametrize("retry_after_s", [0.0, tracing.RETRY_AFTER_S])
def test_an_unreachable_collector_is_one_warning_and_no_failed_query(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, retry_after_s: float
) -> None:
    # Refused at once; a short timeout leaves no room for the exporter's backoff (1 s, 2 s, ...).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.2")
    monkeypatch.setattr(tracing, "RETRY_AFTER_S", retry_after_s)  # 0: every batch really tries
    port = _closed_port()
    caplog.set_level(logging.DEBUG)
    tracing.configure("otlp", endpoint=f"http://127.0.0.1:{port}/")
    for i in range(4):
        assert _search(f"q{i}") is not None  # spans are made, with a trace id for the log
        assert tracing.flush() is True
    assert tracing.failed_exports() == 4
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["rag_retriever.tracing"]
    message = warnings[0].getMessage()
    assert f"http://127.0.0.1:{port}/v1/traces" in message
    assert "queries are unaffected" in message and "RAG_OTLP_ENDPOINT" in message
    tracing.shutdown()  # flushes nothing new, stops the worker, raises nothing
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == warnings


def test_console_writes_each_span_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    tracing.configure("console", service_name="rag-test")
    _search("q1")
    out, err = capsys.readouterr()
    assert out == ""
    assert '"name": "rag.search.encode"' in err and '"rag.query_id": "q1"' in err
    assert '"service.name": "rag-test"' in err


@pytest.mark.parametrize(
    ("missing", "mode", "package"),
    [
        ("opentelemetry.sdk", "console", "opentelemetry-sdk"),
        ("opentelemetry.sdk", "otlp", "opentelemetry-sdk"),
        (
            "opentelemetry.exporter.otlp.proto.http",
            "otlp",
            "opentelemetry-exporter-otlp-proto-http",
        ),
    ],
)
def test_a_missing_package_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
    spans: InMemorySpanExporter,
    missing: str,
    mode: str,
    package: str,
) -> None:
    for name in [n for n in sys.modules if n == missing or n.startswith(missing + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(ConfigError) as raised:
        tracing.configure(mode)
    assert str(raised.value) == (
        f"RAG_TRACING={mode} needs {package}, which is not installed; "
        "pip install -e '.[tracing]' in rag-retriever's checkout, or set RAG_TRACING=on to use the host "
        "application's OpenTelemetry setup"
    )
    _search("q1")  # the configuration before the error is kept
    assert len(spans.get_finished_spans()) == 3


def test_modes_are_one_table_and_bad_arguments_say_what_is_valid() -> None:
    assert tuple(tracing._MODE_STARTS) == tracing.MODES == choices_of("tracing")
    with pytest.raises(ConfigError, match="'yes' is not one of off, on, console, otlp"):
        tracing.configure("yes")
    with pytest.raises(ConfigError, match="used by tracing mode 'on' only, not 'otlp'"):
        tracing.configure("otlp", provider=TracerProvider(shutdown_on_exit=False))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RAG_TRACING": "yes"}, "RAG_TRACING must be one of off, on, console, otlp; got 'yes'"),
        ({"RAG_TRACING": "jaeger"}, "RAG_TRACING must be one of off, on, console, otlp"),
        ({"RAG_OTLP_ENDPOINT": "collector:4318"}, "RAG_OTLP_ENDPOINT='collector:4318' is invalid"),
    ],
)
def test_bad_tracing_settings_are_refused_at_start_up(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


def test_settings_configure_tracing(spans: InMemorySpanExporter) -> None:
    s = Settings.from_env({"RAG_TRACING": "otlp", "RAG_OTLP_ENDPOINT": "http://otel:4318"})
    assert (s.tracing, s.otlp_endpoint) == ("otlp", "http://otel:4318")
    tracing.configure_from(Settings())
    assert span("rag.search") is span("rag.update")
    assert current_trace_id() is None
