"""The version record: everything a collection version says about itself, as one typed value.

Example:
    >>> record = store.record("docs__all-minilm-l6-v2-384__v3")        # doctest: +SKIP
    >>> record.lineage.base, record.lineage.deltas                      # doctest: +SKIP
    ('docs__all-minilm-l6-v2-384__v2', 1)

A version is written once (status `building` -> `complete`); afterwards only its serving state
(`retired_at`, `rolled_back_at`) and what is tuned for it (`fusion`, `reranker`) change, each a `replace` of the
record. The record is stored as JSON beside the version (`to_json`, with `schema`); a record of
another schema, or BM25 statistics of another tokenizer, hash or weighting scheme, is refused
with `VersionIncompatible` and a message that says to re-ingest. The version's document
frequencies are not part of the record (they grow with the vocabulary): the store keeps them
beside it (`Store.doc_freqs`).

This module does not decide anything: the writer, the catalog and the query path do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

from rag_retriever.errors import VersionIncompatible
from rag_retriever.models.bm25 import BM25Stats
from rag_retriever.models.profiles import Fingerprint
from rag_retriever.records import QUANTIZATIONS, UNQUANTIZED, Quantization

# 1: the untyped metadata dict of rag-retriever 0.2 (IDF on the document side); 2: this record.
SCHEMA_VERSION = 2

Status = Literal["building", "complete"]
STATUS_BUILDING: Status = "building"
STATUS_COMPLETE: Status = "complete"


# A delta records the ids it changed up to this many (about 0.4 MB in its record): enough for
# the edits a serving process sees one at a time (a few documents); a larger delta records none,
# and its readers start their caches afresh.
CHANGED_IDS_KEPT = 10_000


@dataclass(frozen=True)
class Lineage:
    """Where a version comes from. A full build has no base; a delta names the version it was
    made from, and counts the deltas since the last full build (whose BM25 average length the
    whole lineage is normalised with). A compaction (`compacted`) names the version whose points
    it holds in fewer shards: same points, same BM25 statistics, same delta count."""

    base: str | None = None
    full_build: str | None = None
    deltas: int = 0
    compacted: bool = False
    # The chunk ids whose records this version does not share with `base` (a delta's written
    # and removed ones; none for a compaction): a serving process keeps what it read of the
    # base for every other id. None: not recorded (a full build, a delta of more than
    # CHANGED_IDS_KEPT ids, a version written before it was).
    changed: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "base": self.base,
            "full_build": self.full_build,
            "deltas": self.deltas,
            "compacted": self.compacted,
        }
        if self.changed is not None:
            out["changed"] = list(self.changed)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Lineage:
        changed = data.get("changed")
        return cls(
            base=data.get("base"),
            full_build=data.get("full_build"),
            deltas=int(data["deltas"]),
            compacted=bool(data.get("compacted", False)),
            changed=None if changed is None else tuple(str(c) for c in changed),
        )


@dataclass(frozen=True)
class VersionRecord:
    alias: str
    version: int
    status: Status
    fingerprint: Fingerprint
    # ingest.chunking.ChunkingConfig as a dict (a version is only extended with equal chunking)
    chunking: Mapping[str, Any]
    bm25: BM25Stats
    lineage: Lineage = field(default_factory=Lineage)
    documents: int = 0
    chunks: int = 0
    source: str = ""
    # Where the embedder was loaded from (a directory or model id): what serves this version.
    model_source: str | None = None
    created_at: str = ""
    completed_at: str | None = None
    retired_at: float | None = None
    # When `rollback` moved the alias off this version (None: it never did, or it was served
    # again since): a later rollback does not return to it.
    rolled_back_at: float | None = None
    # Tuned for this version (`tune-fusion`, `improve`); None: the settings' defaults.
    fusion: Mapping[str, Any] | None = None
    reranker: Mapping[str, Any] | None = None
    # The documents' metadata fields and the kind of their values (field_kinds): what a filter
    # may name. None: not recorded (a version written before 0.3), filters are not checked.
    fields: Mapping[str, str] | None = None
    # How the dense vectors are held (records.Quantization); a version written before 0.3: none.
    quantization: Quantization = UNQUANTIZED
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "alias": self.alias,
            "version": self.version,
            "status": self.status,
            "fingerprint": self.fingerprint.to_json(),
            "chunking": dict(self.chunking),
            "bm25": self.bm25.to_json(),
            "lineage": self.lineage.to_json(),
            "documents": self.documents,
            "chunks": self.chunks,
            "source": self.source,
            "model_source": self.model_source,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "retired_at": self.retired_at,
            "rolled_back_at": self.rolled_back_at,
            "fusion": dict(self.fusion) if self.fusion is not None else None,
            "reranker": dict(self.reranker) if self.reranker is not None else None,
            "fields": dict(self.fields) if self.fields is not None else None,
            "quantization": self.quantization,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, name: str) -> VersionRecord:
        """The record of version `name`; VersionIncompatible when it was written under another
        schema or BM25 scheme (the message names the fix)."""
        schema = data.get("schema", 1)
        if schema != SCHEMA_VERSION:
            raise VersionIncompatible(
                f"{name} was written by another rag-retriever (version record schema {schema}, "
                f"this one reads {SCHEMA_VERSION}); re-ingest it: rag-retriever ingest PATH "
                f"--collection {data.get('alias') or 'ALIAS'} --full"
            )
        try:
            status = str(data["status"])
            if status not in (STATUS_BUILDING, STATUS_COMPLETE):
                raise ValueError(f"unknown status {status!r}")
            quantization = data.get("quantization") or UNQUANTIZED
            if quantization not in QUANTIZATIONS:
                raise ValueError(
                    f"unknown quantization {quantization!r} (this one knows {QUANTIZATIONS})"
                )
            return cls(
                alias=str(data["alias"]),
                version=int(data["version"]),
                status=STATUS_COMPLETE if status == STATUS_COMPLETE else STATUS_BUILDING,
                fingerprint=Fingerprint.from_json(dict(data["fingerprint"])),
                chunking=dict(data["chunking"]),
                bm25=BM25Stats.from_json(data["bm25"]),
                lineage=Lineage.from_json(data["lineage"]),
                documents=int(data["documents"]),
                chunks=int(data["chunks"]),
                source=str(data["source"]),
                model_source=data.get("model_source"),
                created_at=str(data["created_at"]),
                completed_at=data.get("completed_at"),
                retired_at=data.get("retired_at"),
                rolled_back_at=data.get("rolled_back_at"),
                fusion=data.get("fusion"),
                reranker=data.get("reranker"),
                fields=data.get("fields"),
                quantization=quantization,
            )
        except VersionIncompatible:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise VersionIncompatible(
                f"{name}'s version record is damaged ({type(exc).__name__}: {exc}); re-ingest "
                f"it: rag-retriever ingest PATH --collection {data.get('alias') or 'ALIAS'} --full"
            ) from None

    def completed(
        self,
        *,
        documents: int,
        chunks: int,
        at: str,
        fields: Mapping[str, str] | Literal["kept"] | None = "kept",
    ) -> VersionRecord:
        done = replace(
            self, status=STATUS_COMPLETE, documents=documents, chunks=chunks, completed_at=at
        )
        return done if fields == "kept" else replace(done, fields=fields)


# The kinds field_kinds gives a metadata field.
FIELD_KINDS = ("keyword", "integer", "float", "bool", "other", "mixed")


def field_kinds(metadatas: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Each metadata field and the kind of its values (a list's by its elements): keyword,
    integer, float (numbers not all integers), bool, other (objects, nulls) or mixed."""
    seen: dict[str, set[str]] = {}
    for metadata in metadatas:
        for key, value in metadata.items():
            kinds = seen.setdefault(key, set())
            for item in value if isinstance(value, list) else [value]:
                kinds.add(value_kind(item))
    return {key: merge_kinds(kinds) for key, kinds in sorted(seen.items())}


def merge_kinds(kinds: Iterable[str]) -> str:
    """One kind for values of these kinds (integers with floats are floats)."""
    found = set(kinds)
    if found == {"integer", "float"}:
        return "float"
    return found.pop() if len(found) == 1 else "mixed"


def merged_fields(old: Mapping[str, str], new: Mapping[str, str]) -> dict[str, str]:
    """The fields of a version that adds documents with `new` fields to one with `old` ones."""
    out = dict(old)
    for key, kind in new.items():
        out[key] = merge_kinds({out[key], kind}) if key in out else kind
    return dict(sorted(out.items()))


def value_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    return "keyword" if isinstance(value, str) else "other"


def stamp() -> str:
    """Now, as a version record writes its `created_at` and `completed_at` (UTC, seconds)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def bare_record(name: str, *, dim: int, bm25: BM25Stats) -> VersionRecord:
    """The record of a version written by hand rather than by the writer (engine benchmarks and
    engine tests): `building`, a placeholder model of `dim` dimensions, no chunking."""
    alias, _, rest = name.partition("__")
    version = int(rest.rsplit("__v", 1)[-1]) if "__v" in rest else 1
    placeholder = Fingerprint(
        model="none",
        weights_sha256="",
        pooling="mean",
        query_prefix="",
        passage_prefix="",
        dim=dim,
        max_seq_length=0,
    )
    return VersionRecord(alias, version, STATUS_BUILDING, placeholder, {}, bm25)
