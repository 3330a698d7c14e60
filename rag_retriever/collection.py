"""Write a collection from Python: upsert, delete and ingest, as `rag-retriever update` and `ingest`.

Example:
    >>> from rag_retriever import Collection
    >>> kb = Collection.open("kb")                                          # doctest: +SKIP
    >>> kb.upsert([{"id": "returns", "title": "Returns", "text": "30 days.", "team": "support"}])
    ...                                                                     # doctest: +SKIP
    >>> kb.upsert("kb/policies", root="kb")      # a folder: ids relative to root  # doctest: +SKIP
    >>> kb.delete(["old-faq"]).version                                      # doctest: +SKIP
    >>> kb.search("how long do I have to return an item?", k=3)             # doctest: +SKIP

Every write goes the CLI's way (rag_retriever/ingest/writer.py): the documents are checked by the
same rules (DocumentError lists every problem, nothing written), the change becomes a new
version made from the live one (a delta), the alias moves when it is complete, and the
`IngestReport` says what happened. `upsert` and `delete` wait for another write of the same
collection (RAG_LOCK_WAIT_S); `ingest` replaces the whole collection (documents missing from it
are removed) and refuses to wait. The embedding model is loaded only when a write has text to
embed: a delete, or an upsert of documents exactly as they are, loads none.

Records are shaped as .jsonl lines: `{"id", "text", "title"?, ...}`, the other fields are the
document's metadata (docs/formats.md); `Document` objects are taken as they are.

Does not do: writes over HTTP (rag_retriever.client does, against a running service), or
`improve`/gated promotion (the CLI's `ingest --gate`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rag_retriever.errors import DocumentError
from rag_retriever.ingest.loaders import (
    LoadedCorpus,
    documents_from_records,
    empty_upserts,
    load_documents,
)
from rag_retriever.ingest.options import IngestReport, PassageEncoder, WriteOptions
from rag_retriever.ingest.path_ids import refuse_second_copies
from rag_retriever.ingest.validation import raise_if_problems
from rag_retriever.ingest.writer import ingest_documents, update_documents
from rag_retriever.query.options import serving_record
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import DocKey, Document, check_alias, check_tenant
from rag_retriever.settings import Settings

__all__ = ["Collection"]

# What a write takes: records or Documents, or a path (.jsonl file or folder).
Source = Iterable[Mapping[str, Any] | Document] | str | Path


class Collection:
    """One collection (alias): its writes, and searches of it. Build with `Collection.open`."""

    def __init__(self, name: str, *, retriever: Retriever, settings: Settings) -> None:
        self.name = check_alias(name)
        self.retriever = retriever
        self.settings = settings
        self._encoder: PassageEncoder | None = None
        self._encoder_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        name: str | None = None,
        *,
        settings: Settings | None = None,
        retriever: Retriever | None = None,
    ) -> Collection:
        """The collection `name` (default RAG_COLLECTION) of the data dir or Qdrant server the
        settings (default: RAG_* from the environment) name. Given a `retriever`, its store and
        models are shared (a service's warm encoder); otherwise one is opened that loads no
        model until a search or a write needs it (and no reranker)."""
        settings = settings or Settings.from_env()
        name = name or settings.collection
        try:
            check_alias(name)
        except ValueError as exc:
            raise DocumentError(f"{exc}; a collection is written through its alias") from None
        if retriever is None:
            here = settings.model_copy(update={"collection": name})
            retriever = Retriever.from_settings(here, mode="bm25")
        return cls(name, retriever=retriever, settings=settings)

    # -- writes -------------------------------------------------------------------------------

    def upsert(
        self, documents: Source, *, root: str | Path | None = None, promote: bool = True
    ) -> IngestReport:
        """Add these documents or replace those with the same ids (the others stay): records,
        Documents, or a path (a .jsonl file or a folder, whose ids are its files' paths relative
        to `root`, default the folder itself). A folder whose ids would make second documents
        of files the collection holds under other ids (the wrong root) is refused."""
        corpus, folder = self._corpus(documents, root=root)
        if problems := empty_upserts(corpus):
            raise_if_problems(problems, corpus.source)
        docs = list(corpus.documents)
        if folder is not None and serving_record(self.retriever.store, self.name) is not None:
            refuse_second_copies(self.retriever.store, self.name, {folder: [d.id for d in docs]})
        return self._update(docs, [], source=corpus.source, promote=promote)

    def delete(
        self, ids: Iterable[str] | str, *, tenant: str = "", promote: bool = True
    ) -> IngestReport:
        """Delete these document ids, of `tenant` when given (ids the collection does not hold
        are counted in the report's `not_found`). Loads no model."""
        wanted = [ids] if isinstance(ids, str) else list(ids)
        if not wanted:
            raise DocumentError("delete: no ids given; nothing was written")
        if not isinstance(tenant, str):
            raise DocumentError(f"delete: tenant is a name (a string), got {tenant!r}")
        if tenant:
            try:
                check_tenant(tenant)
            except ValueError as exc:
                raise DocumentError(f"delete: {exc}; nothing was written") from None
        keys = [(tenant, i) for i in wanted]
        return self._update([], keys, source="delete", promote=promote)

    def ingest(
        self,
        documents: Source,
        *,
        root: str | Path | None = None,
        full: bool = False,
        promote: bool = True,
        progress: bool = False,
    ) -> IngestReport:
        """Make these documents the whole collection (those not among them are removed): a delta
        from the live version when the model and chunking are unchanged, else (or `full`) a
        full build. The first ingest creates the collection."""
        corpus, _ = self._corpus(documents, root=root)
        return ingest_documents(
            corpus,
            alias=self.name,
            load_encoder=self._load_encoder,
            store=self.retriever.store,
            full=full,
            options=self._options(promote=promote, progress=progress, lock_wait_s=0),
        )

    # -- reads --------------------------------------------------------------------------------

    def search(self, query: str, **options: Any) -> Any:
        """`Retriever.search` on this collection (its hits, a list with `.query_id`)."""
        return self.retriever.search(query, collection=self.name, **options)

    # -- the pieces ---------------------------------------------------------------------------

    def _update(
        self, upsert: list[Document], delete: list[DocKey], *, source: str, promote: bool
    ) -> IngestReport:
        return update_documents(
            upsert,
            delete,
            alias=self.name,
            load_encoder=self._load_encoder,
            store=self.retriever.store,
            source=source,
            options=self._options(promote=promote, progress=False),
        )

    def _options(self, **overrides: Any) -> WriteOptions:
        return WriteOptions.from_settings(self.settings, **overrides)

    def _load_encoder(self) -> PassageEncoder:
        """The model of the collection's live version (its retriever's when that collection is
        the retriever's default: the same weights, loaded once)."""
        with self._encoder_lock:
            if self._encoder is None:
                if self.name == self.retriever.default_collection:
                    self._encoder = self.retriever.encoder
                else:
                    from rag_retriever.models.encoder import load_encoder

                    live = serving_record(self.retriever.store, self.name)
                    self._encoder = load_encoder(self.settings, live)
            return self._encoder

    def _corpus(
        self, source: Source, *, root: str | Path | None
    ) -> tuple[LoadedCorpus, Path | None]:
        """The documents of `source`, checked (empty texts counted, not kept); and the folder
        their ids are relative to, when they came from a folder."""
        max_chars = self.settings.max_document_chars
        if isinstance(source, (str, Path)):
            path = Path(source)
            base = Path(root) if root is not None else None
            corpus = load_documents(path, max_chars=max_chars, root=base)
            return corpus, (base or path) if path.is_dir() else None
        if isinstance(source, Mapping):
            raise DocumentError(
                "documents: expected a list of records (or a path), got one record; wrap it in "
                "a list"
            )
        docs = documents_from_records(list(source), "documents", max_chars=max_chars)
        kept = tuple(d for d in docs if d.text.strip())
        empty = tuple(
            f"documents[{i}] ({d.id!r})" for i, d in enumerate(docs) if not d.text.strip()
        )
        return LoadedCorpus(kept, len(empty), "Python", empty=empty), None
