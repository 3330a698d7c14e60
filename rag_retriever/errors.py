"""Errors raised by rag-retriever. Each message says what was wrong, what was expected, the fix.

The HTTP service maps them to status codes (`http_status`), so a client sees the same message a
Python caller would.
"""

from __future__ import annotations


class RagError(Exception):
    """Base class of every error rag-retriever raises on purpose."""

    http_status = 500
    code = "internal_error"


class ConfigError(RagError, ValueError):
    """A setting, flag or environment variable has an invalid value."""

    http_status = 500
    code = "config_error"


class InvalidRequest(RagError, ValueError):
    """A query, k, mode or filter is not acceptable."""

    http_status = 422
    code = "invalid_request"


class DocumentError(RagError, ValueError):
    """Input documents are malformed; names the file and line."""

    http_status = 422
    code = "invalid_documents"


class Forbidden(RagError, PermissionError):
    """The API key is known but its scope does not allow this (docs/tenants.md)."""

    http_status = 403
    code = "forbidden"


class CollectionNotFound(RagError, LookupError):
    http_status = 404
    code = "collection_not_found"


class QueryNotLogged(RagError, LookupError):
    """Feedback names a query this process did not log, or a chunk or document that query did
    not return, or the query log is off."""

    http_status = 404
    code = "query_not_logged"


class FingerprintMismatch(RagError):
    """The collection was embedded with another model than the loaded encoder."""

    http_status = 409
    code = "fingerprint_mismatch"


class ModelLoadError(RagError):
    """A model directory or id cannot be loaded as the kind of model that was asked for."""

    http_status = 500
    code = "model_load_error"


class IngestLocked(RagError):
    """Another ingest of the same alias is running."""

    http_status = 409
    code = "ingest_locked"


class GateRejected(RagError):
    """The promotion gate refused to move the alias to the new version.

    `report` is the ingest report of the version that was built and kept unpromoted.
    """

    code = "gate_rejected"

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class VersionIncompatible(RagError):
    """A collection version was written under another record schema, tokenizer, term-hash or
    BM25 weighting scheme than this rag-retriever reads; the fix is to re-ingest it."""

    http_status = 409
    code = "version_incompatible"


class UpdateRefused(RagError, ValueError):
    """A document update cannot be applied as a delta (no live version, or the model or chunking
    changed); the message says which command to run instead."""

    http_status = 409
    code = "update_refused"


class Busy(RagError):
    """The work a request needs is running for another request (a scan of the query log for
    feedback on an older query): retry in a moment."""

    http_status = 429
    code = "busy"


class StoreUnavailable(RagError):
    """The Qdrant engine failed or cannot be reached; nothing of the engine's own error types
    leaves the store."""

    http_status = 503
    code = "vector_store_unavailable"


class NoTempSpace(RagError, OSError):
    """The temp dir (TMPDIR) cannot hold what a full build keeps there: the chunks waiting for
    the encoder (rag_retriever/ingest/spill.py). `errno` is the system's."""

    http_status = 507
    code = "insufficient_storage"
