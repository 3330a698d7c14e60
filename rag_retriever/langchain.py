"""A LangChain retriever over rag-retriever: in-process, or remote through the HTTP clients.

Example:
    >>> from rag_retriever.langchain import RagRetrieverLangChain
    >>> lc = RagRetrieverLangChain(backend=RetrieverClient("http://127.0.0.1:8000"), k=4)  # doctest: +SKIP
    >>> docs = lc.invoke("who founded Normandy?", k=2)  # k for this call only       # doctest: +SKIP
    >>> docs[0].metadata["source"], docs[0].metadata["dense_rank"]                  # doctest: +SKIP
    ('history/normans.md', 1)

Each `Document` holds the chunk text; its metadata is flat: the document's own metadata fields
(`path`, `lang`, ... as ingested), `source` (the document's own `source` field if it has one,
else its `path` (folder ingest), else its id), the chunk's provenance (chunk_id, doc_id, title,
section, start, end, chunk_index), its final rank and score, every stage's rank and score
(`dense_rank`, `dense_score`, `bm25_rank`, ..., `rerank_score`; None for a stage that did not run
or did not return the chunk), the BM25 matched terms, the collection that answered and the
query id. A document field named like one of those keys is kept as `metadata.<name>` (the
retrieval's value keeps the plain name). With `expand`, the page content is the hit's merged
context; metadata["text"] is then the hit's own chunk and metadata["context"] the context's
offsets and chunk range.

`invoke(query, k=..., mode=..., filter=..., ...)` overrides this retriever's options for that
call only (the options of SearchOptions; any other keyword is a TypeError naming them).

langchain-core is optional (`pip install -e '.[langchain]'` in the checkout); nothing else in
rag_retriever imports this module. It does not build chains, prompts or vector stores.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, get_type_hints

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForRetrieverRun,
        CallbackManagerForRetrieverRun,
    )
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
except ImportError as exc:  # pragma: no cover - exercised by a test that hides langchain_core
    raise ImportError(
        "rag_retriever.langchain needs langchain-core, which is not installed: "
        "pip install -e '.[langchain]' in rag-retriever's checkout"
    ) from exc
from pydantic import ConfigDict, InstanceOf, field_validator

from rag_retriever.client import AsyncRetrieverClient, RetrieverClient, SearchOptions
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import HIT_STAGES, Hit, Mode, SearchFilter, SearchResult

STAGES = HIT_STAGES
# the options a call may override, from the one declaration every search method takes
CALL_OPTIONS: tuple[str, ...] = tuple(get_type_hints(SearchOptions))


def hit_to_document(
    hit: Hit, *, collection: str | None = None, query_id: str | None = None
) -> Document:
    """A LangChain Document for one hit (see the module docstring for the metadata keys): the
    document's own metadata and `source`, then the hit's JSON form without the text, each stage
    flattened to `<stage>_rank` / `<stage>_score`."""
    own = dict(hit.metadata)
    retrieval: dict[str, Any] = {}
    for key, value in hit.to_dict().items():
        if key == "metadata" or (key == "text" and hit.context is None):
            continue
        if key == "context" and value is not None:
            value = {k: v for k, v in value.items() if k != "text"}  # it is the page_content
        if key in HIT_STAGES:
            retrieval[f"{key}_rank"] = None if value is None else value["rank"]
            retrieval[f"{key}_score"] = None if value is None else value["score"]
        else:
            retrieval[key] = value
    retrieval["collection"] = collection
    # names the query for feedback (POST /v1/feedback, client.feedback) when a log is kept
    retrieval["query_id"] = query_id
    metadata = {k if k not in retrieval else f"metadata.{k}": v for k, v in own.items()}
    metadata["source"] = own.get("source", own.get("path", hit.doc_id))
    metadata.update(retrieval)
    content = hit.text if hit.context is None else hit.context.text
    return Document(page_content=content, metadata=metadata, id=hit.chunk_id)


def result_to_documents(result: SearchResult) -> list[Document]:
    return [
        hit_to_document(h, collection=result.collection, query_id=result.query_id)
        for h in result.hits
    ]


class RagRetrieverLangChain(BaseRetriever):
    """`backend` is a loaded Retriever, a RetrieverClient or an AsyncRetrieverClient.

    The other fields are the search options of every call; None leaves them to the backend's
    defaults (RAG_DEFAULT_K, rerank when a reranker is loaded, else hybrid; RAG_COLLECTION).
    `invoke(query, k=1)` (any of CALL_OPTIONS) overrides one for that call.
    With an AsyncRetrieverClient only `ainvoke` works (a sync call cannot drive its event loop).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    backend: InstanceOf[Retriever] | InstanceOf[RetrieverClient] | InstanceOf[AsyncRetrieverClient]
    k: int | None = None
    mode: Mode | None = None
    # a SearchFilter or its dict form, as `invoke(filter=...)` and the clients take it
    filter: InstanceOf[SearchFilter] | dict[str, Any] | None = None  # a dict: made a SearchFilter
    collection: str | None = None
    # 0-1: maximal marginal relevance over the ranked hits (near-duplicates do not fill the top k)
    diversity: float | None = None
    # "neighbours" or "section": each Document's page_content is the hit's merged context
    # (metadata keeps the hit's own text and offsets, and the context's)
    expand: Literal["neighbours", "section"] | None = None
    expand_tokens: int | None = None
    # hits scoring below it are left out (the mode's scale: Retriever.retrieve_batch)
    min_score: float | None = None
    # one tenant's documents only (docs/tenants.md); over HTTP the key's scope bounds it too
    tenant: str | None = None

    @field_validator("filter", mode="before")
    @classmethod
    def _filter_of(cls, value: Any) -> SearchFilter | None:
        return SearchFilter.of(value)  # ValueError (a ValidationError) for anything else

    # LangChain passes invoke's keyword arguments here because the signature takes more than
    # `query` and `run_manager`.
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **call: Any
    ) -> list[Document]:
        return result_to_documents(self._retrieve_sync(query, self._options(call)))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **call: Any
    ) -> list[Document]:
        options = self._options(call)
        if isinstance(self.backend, AsyncRetrieverClient):
            result = await self.backend.retrieve(query, **options)
        else:
            # The in-process model and the blocking client would stall the event loop.
            result = await asyncio.to_thread(self._retrieve_sync, query, options)
        return result_to_documents(result)

    def _retrieve_sync(self, query: str, options: SearchOptions) -> SearchResult:
        if isinstance(self.backend, AsyncRetrieverClient):
            raise TypeError(
                "this RagRetrieverLangChain wraps an AsyncRetrieverClient: call `ainvoke`, or "
                "pass a RetrieverClient (or an in-process Retriever) to use `invoke`"
            )
        return self.backend.retrieve(query, **options)

    def _options(self, call: dict[str, Any]) -> SearchOptions:
        """This retriever's options, with those `call` sets instead (None included: a call
        clears an option the retriever sets, back to the backend's default)."""
        unknown = sorted(set(call) - set(CALL_OPTIONS))
        if unknown:
            raise TypeError(
                f"invoke() got unknown option(s) {', '.join(map(repr, unknown))}; a call may "
                f"set {', '.join(CALL_OPTIONS)}"
            )
        options: dict[str, Any] = {name: getattr(self, name) for name in CALL_OPTIONS}
        options.update(call)
        return SearchOptions(**options)  # type: ignore[typeddict-item]
