"""The LangChain adapter through `.invoke()` / `.ainvoke()`, in-process and against a real server;
documents checked against the hits the in-process Retriever returns."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rag_retriever.client import AsyncRetrieverClient, RetrieverClient
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Context, Hit, SearchFilter, StageScore
from rag_retriever.settings import Settings
from tests.test_server import build_retriever, live_server

pytest.importorskip("langchain_core")

from langchain_core.documents import Document

from rag_retriever.langchain import RagRetrieverLangChain, hit_to_document

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local(tiny_encoder: Encoder, tmp_path_factory: pytest.TempPathFactory) -> Retriever:
    retriever, _ = build_retriever(tiny_encoder, tmp_path_factory.mktemp("lc-idx"))
    return retriever


@pytest.fixture(scope="module")
def url(local: Retriever) -> Iterator[str]:
    with live_server(local, Settings()) as base:
        yield base


def check_documents(
    docs: list[Document], retriever: Retriever, query: str, **options: object
) -> None:
    expected = retriever.retrieve(query, **options)  # type: ignore[arg-type]
    assert [d.metadata["chunk_id"] for d in docs] == [h.chunk_id for h in expected.hits]
    for doc, hit in zip(docs, expected.hits, strict=True):
        assert doc.page_content == hit.text
        meta = doc.metadata
        assert (meta["doc_id"], meta["title"], meta["start"], meta["end"]) == (
            hit.doc_id,
            hit.title,
            hit.start,
            hit.end,
        )
        assert (meta["chunk_index"], meta["rank"]) == (hit.chunk_index, hit.rank)
        assert meta["score"] == pytest.approx(hit.score, rel=1e-5)
        assert meta["collection"] == expected.collection
        assert {k: meta[k] for k in hit.metadata} == dict(hit.metadata)  # flat
        assert "metadata" not in meta
        assert meta["source"] == hit.metadata.get("path", hit.doc_id)
        assert meta["matched_terms"] == list(hit.matched_terms)
        for stage in ("dense", "bm25", "fused", "rerank"):
            s = getattr(hit, stage)
            assert meta[f"{stage}_rank"] == (None if s is None else s.rank)
            if s is None:
                assert meta[f"{stage}_score"] is None
            else:
                assert meta[f"{stage}_score"] == pytest.approx(s.score, rel=1e-5)


def test_hit_to_document_maps_every_field() -> None:
    hit = Hit(
        chunk_id="c",
        doc_id="d",
        title="T",
        text="body text",
        start=10,
        end=19,
        chunk_index=2,
        rank=1,
        score=0.03,
        dense=StageScore(2, 0.8),
        bm25=None,
        fused=StageScore(1, 0.03),
        matched_terms=("body",),
        metadata={"lang": "en"},
    )
    doc = hit_to_document(hit, collection="kb__m__v1", query_id="q1")
    assert doc.page_content == "body text" and doc.id == "c"
    assert doc.metadata == {
        "lang": "en",
        "source": "d",
        "chunk_id": "c",
        "doc_id": "d",
        "title": "T",
        "start": 10,
        "end": 19,
        "chunk_index": 2,
        "rank": 1,
        "score": 0.03,
        "dense_rank": 2,
        "dense_score": 0.8,
        "bm25_rank": None,
        "bm25_score": None,
        "fused_rank": 1,
        "fused_score": 0.03,
        "rerank_rank": None,
        "rerank_score": None,
        "mmr_rank": None,
        "mmr_score": None,
        "matched_terms": ["body"],
        "collection": "kb__m__v1",
        "query_id": "q1",
        "section": "",
        "context": None,
    }


@pytest.mark.parametrize(
    ("own", "source"),
    [
        ({}, "d"),  # a jsonl document: its id
        ({"path": "kb/returns.md"}, "kb/returns.md"),  # folder ingest: its path
        ({"path": "kb/returns.md", "source": "https://x/returns"}, "https://x/returns"),
    ],
)
def test_source_is_the_document_s_own_source_else_its_path_else_its_id(
    own: dict[str, str], source: str
) -> None:
    hit = Hit("c", "d", "T", "body", 0, 4, 0, rank=1, score=0.5, metadata=own)
    meta = hit_to_document(hit).metadata
    assert meta["source"] == source
    assert {k: meta[k] for k in own} == own


def test_a_document_field_named_like_a_retrieval_key_is_kept_under_a_prefix() -> None:
    hit = Hit("c", "d", "T", "body", 0, 4, 0, rank=1, score=0.5, metadata={"rank": "gold"})
    meta = hit_to_document(hit).metadata
    assert meta["rank"] == 1 and meta["metadata.rank"] == "gold"


def test_an_expanded_hit_s_document_is_its_context() -> None:
    context = Context(text="before. body text after.", start=2, end=26, first_chunk=1, last_chunk=3)
    hit = Hit("c", "d", "T", "body text", 10, 19, 2, rank=1, score=0.5, context=context)
    doc = hit_to_document(hit)
    assert doc.page_content == context.text
    assert doc.metadata["text"] == "body text"
    assert doc.metadata["context"] == {"start": 2, "end": 26, "first_chunk": 1, "last_chunk": 3}


def test_invoke_in_process(local: Retriever) -> None:
    lc = RagRetrieverLangChain(backend=local, k=4, mode="hybrid")
    check_documents(
        lc.invoke("the king and the queen"), local, "the king and the queen", k=4, mode="hybrid"
    )
    flt = SearchFilter(equals={"lang": "fr"})
    filtered = RagRetrieverLangChain(backend=local, k=3, mode="bm25", filter=flt).invoke(
        "wine king"
    )
    assert filtered and all(d.metadata["lang"] == "fr" for d in filtered)
    check_documents(filtered, local, "wine king", k=3, mode="bm25", filter=flt)
    # the dict form, as invoke(filter=...) and the clients take it (was refused here)
    as_dict = RagRetrieverLangChain(
        backend=local, k=3, mode="bm25", filter={"equals": {"lang": "fr"}}
    )
    assert as_dict.filter == flt
    with pytest.raises(ValueError, match="filter must be a SearchFilter or its dict form"):
        RagRetrieverLangChain(backend=local, filter=["lang"])  # type: ignore[arg-type]


def test_invoke_options_apply_to_that_call_only(local: Retriever, url: str) -> None:
    lc = RagRetrieverLangChain(backend=local, k=4, mode="hybrid")
    check_documents(lc.invoke("the king", k=1), local, "the king", k=1, mode="hybrid")
    check_documents(lc.invoke("the king", mode="bm25"), local, "the king", k=4, mode="bm25")
    check_documents(lc.invoke("the king"), local, "the king", k=4, mode="hybrid")  # unchanged
    # None clears the retriever's own option for the call: the backend's default k here
    default_k = local.config.default_k
    cleared = lc.invoke("the king", k=None)
    check_documents(cleared, local, "the king", k=default_k, mode="hybrid")
    docs = asyncio.run(lc.ainvoke("the king", k=2))
    check_documents(docs, local, "the king", k=2, mode="hybrid")
    with pytest.raises(TypeError, match="a call may set k, mode, filter"):
        lc.invoke("the king", top_k=1)
    with RetrieverClient(url) as client:
        remote = RagRetrieverLangChain(backend=client, k=5, mode="hybrid")
        check_documents(remote.invoke("river", k=2), local, "river", k=2, mode="hybrid")

    async def run() -> list[Document]:
        async with AsyncRetrieverClient(url) as aclient:
            return await RagRetrieverLangChain(backend=aclient, k=5).ainvoke("city", k=1)

    check_documents(asyncio.run(run()), local, "city", k=1)


def test_min_score_and_where_reach_the_search_in_process_and_remote(
    local: Retriever, url: str
) -> None:
    query = "the wine of the king"
    full = local.search(query, k=8, mode="bm25")
    threshold = (full[0].score + full[-1].score) / 2
    expected = [h.chunk_id for h in full if h.score >= threshold]
    assert 0 < len(expected) < len(full)
    flt = SearchFilter(where={"field": "lang", "in": ["en", "fr"]})  # type: ignore[arg-type]
    with RetrieverClient(url) as client:
        for backend in (local, client):
            lc = RagRetrieverLangChain(backend=backend, k=8, mode="bm25", min_score=threshold)
            assert [d.metadata["chunk_id"] for d in lc.invoke(query)] == expected
            loose = lc.invoke(query, min_score=0.0)  # per call, as any option
            assert len(loose) == len(full)
            filtered = lc.invoke(query, filter=flt, min_score=0.0)
            assert filtered and all(d.metadata["lang"] in ("en", "fr") for d in filtered)


def test_ainvoke_in_process_runs_off_the_event_loop(local: Retriever) -> None:
    lc = RagRetrieverLangChain(backend=local, k=3, mode="dense")
    docs = asyncio.run(lc.ainvoke("apples and pears"))
    check_documents(docs, local, "apples and pears", k=3, mode="dense")


def test_invoke_and_ainvoke_remote(local: Retriever, url: str) -> None:
    with RetrieverClient(url) as client:
        lc = RagRetrieverLangChain(backend=client, k=5, mode="hybrid")
        check_documents(lc.invoke("river mountain"), local, "river mountain", k=5, mode="hybrid")
        # A blocking client under ainvoke runs in a worker thread.
        docs = asyncio.run(lc.ainvoke("peace and war"))
        check_documents(docs, local, "peace and war", k=5, mode="hybrid")

    async def run() -> list[Document]:
        async with AsyncRetrieverClient(url) as aclient:
            return await RagRetrieverLangChain(backend=aclient, k=2, mode="bm25").ainvoke("city")

    check_documents(asyncio.run(run()), local, "city", k=2, mode="bm25")


def test_sync_invoke_with_an_async_client_says_what_to_do(url: str) -> None:
    client = AsyncRetrieverClient(url)
    lc = RagRetrieverLangChain(backend=client)
    with pytest.raises(TypeError, match="call `ainvoke`, or pass a RetrieverClient"):
        lc.invoke("king")
    asyncio.run(client.aclose())


def test_backend_must_be_one_of_the_three() -> None:
    with pytest.raises(ValueError, match="backend"):
        RagRetrieverLangChain(backend="http://127.0.0.1:8000")  # type: ignore[arg-type]


def test_missing_langchain_core_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        m for m in sys.modules if m == "langchain_core" or m.startswith("langchain_core.")
    ]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "langchain_core", None)
    monkeypatch.delitem(sys.modules, "rag_retriever.langchain")
    with pytest.raises(
        ImportError, match=r"pip install -e '\.\[langchain\]' in rag-retriever's checkout"
    ):
        importlib.import_module("rag_retriever.langchain")


def test_the_package_does_not_import_langchain() -> None:
    code = (
        "import sys, rag_retriever, rag_retriever.service.server, rag_retriever.client, rag_retriever.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('langchain')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
