"""What a write is asked and what it reports: the options of an ingest or update
(`WriteOptions`), what it needs of an encoder (`PassageEncoder`), the promotion gate's decision,
and the `IngestReport` every write returns (the CLI, the HTTP write API and the tests read it).

Example:
    >>> WriteOptions().full
    False

Values only: nothing here writes (ingest/writer.py does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rag_retriever.records import Quantization
from rag_retriever.settings import Compaction as CompactionMode
from rag_retriever.settings import Settings, default_of

if TYPE_CHECKING:
    # Types only: importing the encoder costs torch, which a report's reader never needs.
    from rag_retriever.models.encoder import Encoded, Fingerprint

Kind = Literal["full", "delta", "unchanged"]


class PassageEncoder(Protocol):
    """What the writer needs of an encoder (a real `Encoder`, or a wrapper in tests)."""

    fingerprint: Fingerprint
    max_seq_length: int

    @property
    def special_tokens(self) -> int: ...

    def count_tokens(self, texts: Sequence[str]) -> list[int]: ...

    def encode_passages(self, passages: Sequence[str], *, progress: bool = False) -> Encoded: ...


@runtime_checkable
class PreparingEncoder(Protocol):
    """An encoder whose tokenising can run apart from its forward passes (a real `Encoder`):
    the writer tokenises in its own pipeline stage. Others are called with the texts."""

    def prepare_passages(self, passages: Sequence[str]) -> Any: ...

    def encode_prepared(self, prepared: Any, *, progress: bool = False) -> Encoded: ...


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    summary: str  # printed whatever the decision
    details: dict[str, Any] = field(default_factory=dict)


# (new collection, live collection or None) -> decision
Gate = Callable[[str, str | None], GateDecision]


@dataclass(frozen=True)
class IngestReport:
    alias: str
    collection: str
    version: int
    fingerprint: str
    documents: int
    skipped_empty: int
    chunks: int
    tokens: int
    truncated: int
    reused: int
    encoded: int
    removed: int
    promoted: bool
    previous: str | None
    deleted_versions: tuple[str, ...]
    orphans_removed: tuple[str, ...]
    timings_s: dict[str, float]
    gate: GateDecision | None = None
    # Unchanged documents whose chunks were taken from the live version without re-chunking.
    reused_documents: int = 0
    # Files of an ingested folder that were skipped, by type.
    skipped_files: dict[str, int] = field(default_factory=dict)
    # full: every chunk written; delta: made from `base` plus the change; unchanged: no version.
    kind: Kind = "full"
    base: str | None = None
    # Documents upserted (new or changed), deleted, unchanged, and ids to delete that were absent.
    upserted: int = 0
    deleted: int = 0
    unchanged: int = 0
    not_found: int = 0
    # Why a full build was made where a delta was possible (a model change, BM25 re-base, ...).
    full_reason: str | None = None
    # The version's deltas outgrew its base, or left more delta shards than a version should
    # read (store/edge.py): "started" (a background compaction), "running"
    # (one was already), "due" (left to the caller: `rag-retriever compact`); None: not due.
    compaction: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "gate"}
        out["deleted_versions"] = list(self.deleted_versions)
        out["orphans_removed"] = list(self.orphans_removed)
        if self.gate is not None:
            out["gate"] = {
                "promote": self.gate.promote,
                "summary": self.gate.summary,
                **self.gate.details,
            }
        return out


# RAG_QUANTIZATION's default (a typed constant: a dataclass field may not call default_of).
DEFAULT_QUANTIZATION: Quantization = default_of("quantization")


@dataclass(frozen=True)
class WriteOptions:
    """How a write is made and kept; every default is the settings' (one declaration)."""

    chunk_tokens: int = default_of("chunk_tokens")
    overlap_tokens: int = default_of("chunk_overlap_tokens")
    keep_versions: int = default_of("keep_versions")
    retention_grace_s: float = default_of("retention_grace_s")
    rebase_drift: float = default_of("bm25_rebase_drift")
    lock_wait_s: float = 0.0
    promote: bool = True
    gate: Gate | None = None
    progress: bool = False
    lock_dir: Path | None = None
    # How a delta's merges too big to wait on are done (rag_retriever/ingest/compaction.py). A library
    # call merges inside the write unless asked ("background" leaves a child process running
    # after the call). The CLI and the HTTP service follow RAG_COMPACTION (`from_settings`).
    compaction: CompactionMode = "inline"
    # The longest document text a write takes (RAG_MAX_DOCUMENT_CHARS), checked with the rest of
    # validation.py's rules before anything is chunked.
    max_document_chars: int = default_of("max_document_chars")
    quantization: Quantization = DEFAULT_QUANTIZATION

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> WriteOptions:
        """The write settings (chunking, retention, re-base, lock wait, the data dir's locks)."""
        values: dict[str, Any] = {
            "chunk_tokens": settings.chunk_tokens,
            "overlap_tokens": settings.chunk_overlap_tokens,
            "keep_versions": settings.keep_versions,
            "retention_grace_s": settings.retention_grace_s,
            "rebase_drift": settings.bm25_rebase_drift,
            "lock_wait_s": settings.lock_wait_s,
            "lock_dir": settings.data_dir,
            "compaction": settings.compaction,
            "max_document_chars": settings.max_document_chars,
            "quantization": settings.quantization,
        }
        return cls(**{**values, **overrides})
