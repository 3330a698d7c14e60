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

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    "Chunk": "records",
    "CollectionNotFound": "errors",
    "ConfigError": "errors",
    "CrossEncoderReranker": "reranker",
    "Document": "records",
    "DocumentError": "errors",
    "Encoder": "encoder",
    "Fingerprint": "encoder",
    "FingerprintMismatch": "errors",
    "GateRejected": "errors",
    "Hit": "records",
    "IngestLocked": "errors",
    "InvalidRequest": "errors",
    "ModelLoadError": "errors",
    "RagError": "errors",
    "RetrievalConfig": "retriever",
    "Retriever": "retriever",
    "Scorer": "reranker",
    "SearchFilter": "records",
    "SearchResult": "records",
    "Settings": "settings",
    "StageScore": "records",
    "load_encoder": "encoder",
}

__all__ = [
    "Chunk",
    "CollectionNotFound",
    "ConfigError",
    "CrossEncoderReranker",
    "Document",
    "DocumentError",
    "Encoder",
    "Fingerprint",
    "FingerprintMismatch",
    "GateRejected",
    "Hit",
    "IngestLocked",
    "InvalidRequest",
    "ModelLoadError",
    "RagError",
    "RetrievalConfig",
    "Retriever",
    "Scorer",
    "SearchFilter",
    "SearchResult",
    "Settings",
    "StageScore",
    "load_encoder",
]

if TYPE_CHECKING:
    from rag_retriever.encoder import Encoder, Fingerprint, load_encoder
    from rag_retriever.errors import (
        CollectionNotFound,
        ConfigError,
        DocumentError,
        FingerprintMismatch,
        GateRejected,
        IngestLocked,
        InvalidRequest,
        ModelLoadError,
        RagError,
    )
    from rag_retriever.records import Chunk, Document, Hit, SearchFilter, SearchResult, StageScore
    from rag_retriever.reranker import CrossEncoderReranker, Scorer
    from rag_retriever.retriever import RetrievalConfig, Retriever
    from rag_retriever.settings import Settings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rag_retriever' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rag_retriever.{module}"), name)
    globals()[name] = value
    return value
