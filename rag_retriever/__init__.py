"""rag-retriever: a retrieval backend for RAG.

Example:
    >>> from rag_retriever import Retriever, Settings
    >>> retriever = Retriever.from_settings(Settings.from_env())   # doctest: +SKIP
    >>> retriever.search("who founded Normandy?", k=5)              # doctest: +SKIP
"""

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
