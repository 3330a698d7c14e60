"""rag-retriever: a retrieval backend for RAG.

Example:
    >>> from rag_retriever import Retriever, Settings
    >>> retriever = Retriever.from_settings(Settings.from_env())   # doctest: +SKIP
    >>> retriever.search("who founded Normandy?", k=5)              # doctest: +SKIP

The names below are imported on first use, so `import rag_retriever.client` (or the CLI's
`--help`) does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.4.0"

# public name -> module that defines it
_EXPORTS = {
    "Chunk": "records",
    "Collection": "collection",
    "CollectionNotFound": "errors",
    "ConfigError": "errors",
    "Context": "records",
    "CrossEncoderReranker": "reranker",
    "Document": "records",
    "DocumentError": "errors",
    "Encoder": "encoder",
    "Fingerprint": "encoder",
    "FingerprintMismatch": "errors",
    "GateRejected": "errors",
    "Hit": "records",
    "IngestLocked": "errors",
    "IngestReport": "ingest.options",
    "InvalidRequest": "errors",
    "ModelLoadError": "errors",
    "RagError": "errors",
    "RetrievalConfig": "retriever",
    "Retriever": "retriever",
    "Scorer": "reranker",
    "SearchFilter": "records",
    "SearchHits": "query.hits",
    "SearchResult": "records",
    "Settings": "settings",
    "StageScore": "records",
    "load_encoder": "encoder",
}

# The public names are _EXPORTS; the imports below only tell type checkers (a test checks
# that they name the same).
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from rag_retriever.collection import (
        Collection as Collection,
    )
    from rag_retriever.errors import (
        CollectionNotFound as CollectionNotFound,
    )
    from rag_retriever.errors import (
        ConfigError as ConfigError,
    )
    from rag_retriever.errors import (
        DocumentError as DocumentError,
    )
    from rag_retriever.errors import (
        FingerprintMismatch as FingerprintMismatch,
    )
    from rag_retriever.errors import (
        GateRejected as GateRejected,
    )
    from rag_retriever.errors import (
        IngestLocked as IngestLocked,
    )
    from rag_retriever.errors import (
        InvalidRequest as InvalidRequest,
    )
    from rag_retriever.errors import (
        ModelLoadError as ModelLoadError,
    )
    from rag_retriever.errors import (
        RagError as RagError,
    )
    from rag_retriever.ingest.options import (
        IngestReport as IngestReport,
    )
    from rag_retriever.models.encoder import (
        Encoder as Encoder,
    )
    from rag_retriever.models.encoder import (
        Fingerprint as Fingerprint,
    )
    from rag_retriever.models.encoder import (
        load_encoder as load_encoder,
    )
    from rag_retriever.models.reranker import (
        CrossEncoderReranker as CrossEncoderReranker,
    )
    from rag_retriever.models.reranker import (
        Scorer as Scorer,
    )
    from rag_retriever.query.hits import (
        SearchHits as SearchHits,
    )
    from rag_retriever.query.retriever import (
        RetrievalConfig as RetrievalConfig,
    )
    from rag_retriever.query.retriever import (
        Retriever as Retriever,
    )
    from rag_retriever.records import (
        Chunk as Chunk,
    )
    from rag_retriever.records import (
        Context as Context,
    )
    from rag_retriever.records import (
        Document as Document,
    )
    from rag_retriever.records import (
        Hit as Hit,
    )
    from rag_retriever.records import (
        SearchFilter as SearchFilter,
    )
    from rag_retriever.records import (
        SearchResult as SearchResult,
    )
    from rag_retriever.records import (
        StageScore as StageScore,
    )
    from rag_retriever.settings import (
        Settings as Settings,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rag_retriever' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rag_retriever.{module}"), name)
    globals()[name] = value
    return value
