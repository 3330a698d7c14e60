"""A version's documents, put together again from its chunks (to rebuild it another way).

Example:
    >>> documents_of(store, "docs__all-minilm-l6-v2-384__v2").documents[0].id    # doctest: +SKIP
    'intro'

The version catalog (promote, rollback, retention) lives in `rag_retriever.store.catalog`.
"""

from __future__ import annotations

from rag_retriever.errors import InvalidRequest
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.records import Chunk, DocKey, Document, show_key
from rag_retriever.store import Store


def documents_of(store: Store, name: str) -> LoadedCorpus:
    """The documents version `name` was built from, put together again from its chunks (which
    tile each document: `doc.text[c.start:c.end] == c.text`), with their titles and metadata; a
    new version built from them (another model, a copy) holds the same text."""
    by_doc: dict[DocKey, list[Chunk]] = {}
    for record in store.scroll(name):
        chunk = Chunk.from_payload(record.payload)
        by_doc.setdefault(chunk.doc_key, []).append(chunk)
    documents = []
    for key in sorted(by_doc):
        chunks = sorted(by_doc[key], key=lambda c: c.chunk_index)
        doc_id = key[1]
        text = ""
        for chunk in chunks:
            if chunk.start > len(text):
                raise InvalidRequest(
                    f"{name}: the chunks of document {show_key(key)} leave a gap at character "
                    f"{len(text)}; re-ingest it from its source files"
                )
            text = text[: chunk.start] + chunk.text
        documents.append(Document(doc_id, chunks[0].title, text, chunks[0].metadata))
    return LoadedCorpus(tuple(documents), 0, f"{name} (its own chunks)")
