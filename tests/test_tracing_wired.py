"""The spans the product emits, on a real collection (tiny model, Qdrant Edge), against the
SDK's in-memory exporter: a search and each of its stages (the query id on its root span, the
trace id in its query log line), an ingest and an update with a span per step, a compaction;
with tracing off, none and no trace id."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rag_retriever import tracing
from rag_retriever.ingest.compaction import compact
from rag_retriever.ingest.writer import update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.querylog import QueryLog, read_lines
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.store import EdgeStore, Store
from tests.conftest import collection_retriever
from tests.test_retriever import DOCS


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> set[str]:
    assert parent.context is not None
    return {
        s.name
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }


@pytest.fixture
def logged(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> Retriever:
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.query_log = QueryLog(tmp_path / "log")
    return retriever


def test_a_search_is_one_trace_with_a_span_per_stage(
    logged: Retriever, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    spans.clear()
    result = logged.retrieve("the king and the queen", k=2, mode="hybrid", expand="neighbours")
    [root] = _named(spans, "rag.search")
    assert root.parent is None
    attributes = dict(root.attributes or {})
    assert attributes["rag.query_id"] == result.query_id
    assert attributes["rag.mode"] == "hybrid" and attributes["rag.k"] == 2
    assert attributes["rag.collection"] == result.collection
    assert attributes["rag.hits"] == len(result.hits)
    assert _children(spans, root) == {
        "rag.search.encode",
        "rag.search.retrieve",
        "rag.search.fuse",
        "rag.search.expand",
    }
    [retrieve] = _named(spans, "rag.search.retrieve")
    assert dict(retrieve.attributes or {})["rag.dense"] == 1
    assert logged.query_log is not None
    logged.query_log.flush()
    [line] = list(read_lines([tmp_path / "log"], "queries"))
    assert root.context is not None
    assert line["trace_id"] == format(root.context.trace_id, "032x")


def test_a_diverse_rerank_search_and_a_cached_one(
    store: Store,
    tiny_encoder: Encoder,
    tiny_reranker_dir: Path,
    spans: InMemorySpanExporter,
) -> None:
    from rag_retriever.models.reranker import CrossEncoderReranker

    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.reranker = CrossEncoderReranker.load(str(tiny_reranker_dir), device="cpu")
    spans.clear()
    retriever.retrieve("the king", k=2, mode="rerank", diversity=0.5)
    [root] = _named(spans, "rag.search")
    assert {"rag.search.rerank", "rag.search.diversity"} <= _children(spans, root)


def test_an_update_and_a_compaction_have_a_span_per_step(
    store: Store, tiny_encoder: Encoder, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    collection_retriever(DOCS, store, tiny_encoder)
    [ingest] = _named(spans, "rag.ingest")
    assert {"rag.ingest.pipeline", "rag.ingest.seal", "rag.ingest.promote"} <= _children(
        spans, ingest
    )
    assert dict(ingest.attributes or {})["rag.kind"] == "full"
    spans.clear()
    doc = Document(id="new", title="New", text="A river runs through the old town. " * 4)
    report = update_documents([doc], [], alias="kb", encoder=tiny_encoder, store=store)
    [update] = _named(spans, "rag.update")
    attributes = dict(update.attributes or {})
    assert attributes["rag.collection"] == report.collection
    assert attributes["rag.kind"] == report.kind  # a re-base on so small a corpus
    assert {"rag.ingest.read_live", "rag.ingest.seal", "rag.ingest.promote"} <= _children(
        spans, update
    )
    for step in _named(spans, "rag.ingest.seal"):
        assert step.start_time is not None and step.end_time is not None
        assert step.start_time <= step.end_time
    spans.clear()
    assert isinstance(store, EdgeStore)
    done = compact(store, "kb", force=True, lock_dir=tmp_path)
    [root] = _named(spans, "rag.compaction")
    assert dict(root.attributes or {})["rag.outcome"] == done.outcome


def test_off_no_span_and_no_trace_id(logged: Retriever, tmp_path: Path) -> None:
    tracing.configure("off")
    logged.retrieve("the king", k=1)
    assert logged.query_log is not None
    logged.query_log.flush()
    [line] = list(read_lines([tmp_path / "log"], "queries"))
    assert "trace_id" not in line


def test_random_searches_each_make_exactly_one_root(
    logged: Retriever, spans: InMemorySpanExporter
) -> None:
    rng = random.Random(3)
    spans.clear()
    for _ in range(5):
        mode = rng.choice(["dense", "bm25", "hybrid"])
        logged.retrieve(rng.choice(["king", "queen wine", "the city"]), k=2, mode=mode)  # type: ignore[arg-type]
    roots = [s for s in spans.get_finished_spans() if s.parent is None]
    assert len(roots) == 5 and {s.name for s in roots} == {"rag.search"}


def test_the_service_writer_process_traces_the_writes_it_commits(
    tmp_path: Path,
    tiny_encoder: Encoder,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`serve` commits HTTP writes in a writer process, which takes RAG_TRACING from the settings
    it is given. Its start-up runs here, in the test's process, with the two calls that would
    change this process for good (SCHED_IDLE, one PyTorch thread) replaced."""
    import torch

    from rag_retriever.service import writes
    from rag_retriever.settings import Settings

    store = EdgeStore(tmp_path / "data" / "edge")
    collection_retriever(DOCS, store, tiny_encoder)
    store.close()
    monkeypatch.setattr(writes, "idle_priority", lambda: "unchanged")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    env = {"RAG_DATA_DIR": str(tmp_path / "data"), "RAG_TRACING": "console"}
    commit = writes.ProcessCommit(Settings.from_env(env))
    monkeypatch.setattr(commit, "_load_encoder", lambda: tiny_encoder)
    capsys.readouterr()
    try:
        doc = Document(id="new", title="New", text="A river runs through the old town. " * 4)
        report = commit(("kb", [doc], []))
        tracing.flush()
    finally:
        tracing.shutdown()
        if commit._store is not None:
            commit._store.close()
    err = capsys.readouterr().err
    assert '"name": "rag.update"' in err and f'"rag.collection": "{report.collection}"' in err
