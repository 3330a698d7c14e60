"""The store interface: versioned collections, their records, the serving alias.

Example:
    >>> store = EdgeStore(Path("rag-data/edge"))                 # doctest: +SKIP
    >>> store.resolve("docs")                                    # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v3'

A collection version is named `<alias>__<model-slug>-<dim>__v<N>` and holds two named vectors
per chunk: `dense` (cosine) and `bm25` (sparse: saturated term frequencies, see bm25.py), with the
chunk record as payload, and beside them its typed record (`VersionRecord`) and its BM25 document
frequencies. Queries go through the alias. A version is made either whole (`create`) or from
another version (`derive`: its points minus some ids, plus what is upserted after), and is never
written again once sealed and complete. Two engines implement this contract (edge.py, server.py)
and run the same tests.

Errors: a missing collection is `CollectionNotFound`; an engine failure is `StoreUnavailable`;
nothing of qdrant's own exception types leaves the store.

This module knows nothing of chunking, models or how BM25 weights are computed.
"""

from __future__ import annotations

import contextlib
import logging
import re
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal

import numpy as np

from rag_retriever.errors import (
    CollectionNotFound,
    InvalidRequest,
    RagError,
    StoreUnavailable,
    VersionIncompatible,
)
from rag_retriever.models.bm25 import SparseVector
from rag_retriever.records import SearchFilter
from rag_retriever.settings import default_of
from rag_retriever.store.record import STATUS_COMPLETE, VersionRecord

log = logging.getLogger(__name__)

# The status the catalog shows for a version written under another record schema.
INCOMPATIBLE: Final = "incompatible"
DENSE: Final = "dense"
SPARSE: Final = "bm25"
# ALIAS__SLUG__vN. A slug (models.profiles.model_slug) holds no "_", so an alias that ends in
# "_" parses whole: kb___m-384__v1 is kb_'s, not kb's (a lazy alias once made it kb's, so kb_'s
# versions were invisible to it and its second write reused the served version's name).
_VERSIONED = re.compile(r"^(?P<alias>.+?)__(?P<slug>[^_]+)__v(?P<version>\d+)$")
# A metadata key that Qdrant's JSON path reads without quotes.
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")

# HNSW search breadth: ef = this many times the number of neighbours asked for. With Qdrant's
# default ef, 100 neighbours lost 0.0074 of SciFact's dense recall@100 (12,382 chunks) against
# an exact search; with 4x it equals the exact search's 0.9153. On real MiniLM vectors at 315k
# chunks 4x found only 0.943-0.958 of an exact search's top 10 (float32, int8) and 8x 0.960-0.972,
# which also raised the gold chunk's dense recall@10 by 0.014-0.017, for 1.08x (int8) to 1.64x
# (float32) the engine's time of a dense query (docs/benchmarks.md, "ef 8x and oversampling at
# 315k chunks").
HNSW_EF_PER_RESULT = 8
# How wide a new shard's HNSW graph is built by default (RAG_HNSW_EF_CONSTRUCT): Qdrant's own
# ef_construct. At 315k real MiniLM chunks 200 held 0.996 of an exact search's top 10 where 100
# held 0.963-0.974, for 2.1-2.2x the graph's build time and 1.2x a dense search's
# (docs/benchmarks.md, "How wide the graph is built").
HNSW_EF_CONSTRUCT: int = default_of("hnsw_ef_construct")
# Qdrant's own graph defaults: a shard built at this width asks for no graph config; another
# width names the m and full-scan threshold (KB) a graph config must name, Qdrant's.
QDRANT_EF_CONSTRUCT = 100
HNSW_M = 16
HNSW_FULL_SCAN_KB = 10_000
# A quantized version's dense search scores this many times the candidates asked for with the
# quantized vectors, then rescores them with the float32 originals (docs/versions.md). Binary's
# one bit a dimension ranks its candidates coarser than int8's eight: on real MiniLM vectors at
# 105k chunks oversampling 4 raised its dense recall@10 of an exact search from 0.975 to 0.986
# for at most 1.12x the engine's time (at 1M binary chunks: hybrid p95 1.13x), where int8 gained
# nothing from it (docs/benchmarks.md, "Real embeddings at 315k chunks"). binary2 (two bits a
# dimension, asked with 8-bit queries) at 4 found 0.98 of the exact top 10 at 315k chunks, where
# binary found 0.94 (docs/benchmarks.md, "Two-bit binary at 315k chunks").
QUANTIZATION_OVERSAMPLING: Mapping[str, float] = MappingProxyType(
    {"int8": 2.0, "binary": 4.0, "binary2": 4.0}
)

# The payload index type of each kind of filterable value (Qdrant's exact match takes these).
IndexKind = Literal["keyword", "integer", "bool"]


def collection_name(alias: str, slug: str, version: int) -> str:
    return f"{alias}__{slug}__v{version}"


def parse_collection_name(name: str) -> tuple[str, str, int] | None:
    match = _VERSIONED.match(name)
    if not match:
        return None
    return match["alias"], match["slug"], int(match["version"])


def metadata_path(key: str) -> str:
    """The payload path of a document metadata field, quoted when it is not a plain name.

    >>> metadata_path("lang"), metadata_path("page number")
    ('metadata.lang', 'metadata."page number"')
    """
    if _PLAIN_KEY.match(key):
        return f"metadata.{key}"
    if '"' in key or "\\" in key:
        raise InvalidRequest(
            f"metadata field {key!r} cannot be filtered on: field names must not contain "
            f"double quotes or backslashes"
        )
    return f'metadata."{key}"'


def index_kind(values: Sequence[Any]) -> IndexKind | None:
    """The payload index that serves exact matches on these values (lists count by element);
    None when they mix kinds that one index cannot serve."""
    kinds: set[IndexKind | None] = set()
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, bool):
                kinds.add("bool")
            elif isinstance(item, int):
                kinds.add("integer")
            elif isinstance(item, str):
                kinds.add("keyword")
            else:
                kinds.add(None)
    return kinds.pop() if len(kinds) == 1 else None


@dataclass(frozen=True)
class StageQuery:
    """One ranked list to fetch: the `dense` or the `bm25` vector, best `limit` points."""

    using: Literal["dense", "bm25"]
    vector: np.ndarray | SparseVector
    limit: int
    flt: SearchFilter | None = None


@dataclass(frozen=True)
class Record:
    """A point: its id, payload and (when asked for) its vectors."""

    id: str
    payload: Mapping[str, Any]
    dense: np.ndarray | None = None
    sparse: SparseVector | None = None


@dataclass(frozen=True)
class CollectionInfo:
    """A version as the catalog lists it: its record, or why it cannot be read (`problem`)."""

    name: str
    alias: str
    version: int
    status: str
    points: int
    record: VersionRecord | None
    problem: str | None = None


class Store(ABC):
    """Versioned collections and aliases on one engine. Subclasses supply the primitives."""

    embedded: bool

    @property
    def where(self) -> str:
        """Where this store keeps its collections, as errors name it ("the data dir ...",
        "the Qdrant server at ...")."""
        return f"this {type(self).__name__}"

    # -- primitives ---------------------------------------------------------------------------

    @abstractmethod
    def collection_names(self) -> list[str]: ...

    @abstractmethod
    def aliases(self) -> dict[str, str]: ...

    @abstractmethod
    def read_meta(self, name: str) -> dict[str, Any]:
        """The stored JSON of a version's record (use `record`)."""

    @abstractmethod
    def write_meta(self, name: str, meta: Mapping[str, Any]) -> None:
        """Replace the stored JSON of a version's record (use `put_record`)."""

    @abstractmethod
    def doc_freqs(self, name: str) -> Mapping[str, int]:
        """The version's BM25 document frequencies (term -> number of chunks holding it). Edge:
        a `DocFreqs` read term by term from a table a delta shares; the server: one dict."""

    @abstractmethod
    def put_doc_freqs(self, name: str, doc_freqs: Mapping[str, int]) -> None: ...

    @abstractmethod
    def create(self, name: str, dim: int, record: VersionRecord) -> None:
        """A new, empty version marked as `record` says (building)."""

    @abstractmethod
    def derive(self, name: str, base: str, record: VersionRecord, drop: Iterable[str]) -> None:
        """A new version holding `base`'s points except the ids in `drop`; what is upserted into
        it afterwards is added. `base` is not changed, and a reader of it never sees the new
        version's points. The cost follows the change, not the corpus, where the engine allows
        (see each engine)."""

    @abstractmethod
    def upsert(
        self,
        name: str,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None: ...

    @contextlib.contextmanager
    def bulk_write(self, name: str) -> Iterator[None]:
        """Around the upserts of a large build into `name` (created, not yet sealed): an engine
        may write them from a process of its own (Edge). Leaving it normally, the points are all
        written; leaving it by an exception, they may not be, and the caller deletes `name`."""
        yield

    @abstractmethod
    def seal(self, name: str, indexes: Mapping[str, IndexKind], *, merge_base: bool = True) -> None:
        """Make a fully written collection fast and durable: payload indexes (path -> kind),
        flush, optimize. Nothing is written to it afterwards. `merge_base=False`: an engine
        that keeps a version as shards leaves a base merge, and any merge too big to wait on, to
        a compaction (`compaction_due`)."""

    def compaction_due(self, name: str) -> bool:
        """Whether version `name` holds enough delta shards to be worth compacting: into one
        base, or its newest delta shards into one (engines that keep versions as shards; see
        edge.py)."""
        return False

    def running_compaction(self, alias: str) -> dict[str, Any] | None:
        """What a compaction of `alias` running now merges, or None when none runs (an engine
        without shards never compacts)."""
        return None

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def point_alias(self, alias: str, name: str) -> None:
        """Point `alias` at `name` atomically: a reader sees the old or the new target."""

    @abstractmethod
    def count(self, name: str) -> int: ...

    @abstractmethod
    def search(self, name: str, queries: Sequence[StageQuery]) -> list[list[tuple[str, float]]]:
        """(point id, score) of each query's best points, best first, in one engine call.

        Equal scores come in point id order: the engines order ties by internal offsets that
        change from run to run, and a ranking (and what is mined from it) must not."""

    @abstractmethod
    def retrieve(
        self,
        name: str,
        ids: Sequence[str],
        *,
        with_dense: bool = False,
        with_sparse: bool = False,
        with_payload: bool = True,
    ) -> list[Record]:
        """The points with these ids (missing ids are left out), in no particular order; without
        `with_payload` their payloads are empty (reading only vectors is cheaper)."""

    @abstractmethod
    def scroll(self, name: str, *, flt: SearchFilter | None = None) -> Iterator[Record]:
        """Every point's payload (of those the filter keeps), in no particular order."""

    def close(self) -> None:  # noqa: B027 - optional for subclasses
        """Release what the store holds open."""

    # -- derived ------------------------------------------------------------------------------

    def record(self, name: str) -> VersionRecord:
        """The version's typed record; VersionIncompatible when it was written under another
        schema (the message says to re-ingest)."""
        return VersionRecord.from_json(self.read_meta(name), name=name)

    def put_record(self, name: str, record: VersionRecord) -> None:
        self.write_meta(name, record.to_json())

    def exists(self, name: str) -> bool:
        return name in self.collection_names()

    def graph_widths(self, name: str) -> tuple[int, ...] | None:
        """The widths (ef_construct) version `name`'s HNSW graphs were built at, distinct and
        ascending: several where its shards were built under different RAG_HNSW_EF_CONSTRUCT (a
        delta takes the width of its day, its base keeps its own). None: not known."""
        return None

    def resolve(self, alias_or_name: str) -> str:
        """The collection an alias points to (or the name itself if it is a collection)."""
        aliases = self.aliases()
        if alias_or_name in aliases:
            return aliases[alias_or_name]
        if self.exists(alias_or_name):
            return alias_or_name
        known = sorted(aliases) or self.collection_names()
        raise CollectionNotFound(
            f"collection {alias_or_name!r} does not exist in {self.where}; existing: "
            f"{', '.join(known) if known else 'none'} (ingest one with "
            f"`rag-retriever ingest PATH --collection {alias_or_name}`, or point RAG_DATA_DIR "
            f"or RAG_QDRANT_URL where it was ingested)"
        )

    def info(self, name: str) -> CollectionInfo:
        parsed = parse_collection_name(name)
        alias, version = (parsed[0], parsed[2]) if parsed else (name, 0)
        try:
            record = self.record(name)
        except VersionIncompatible as exc:
            meta = self.read_meta(name)
            status = INCOMPATIBLE if meta.get("status") == STATUS_COMPLETE else "building"
            return CollectionInfo(name, alias, version, status, 0, None, str(exc))
        points = record.chunks if record.status == STATUS_COMPLETE else 0
        return CollectionInfo(name, record.alias, record.version, record.status, points, record)

    def versions(self, alias: str) -> list[CollectionInfo]:
        """Every collection written for `alias`, oldest version first."""
        names = [
            n for n in self.collection_names() if (p := parse_collection_name(n)) and p[0] == alias
        ]
        infos = []
        for n in names:
            with contextlib.suppress(CollectionNotFound):  # deleted while we listed
                infos.append(self.info(n))
        return sorted(infos, key=lambda i: i.version)

    def next_version(self, alias: str) -> int:
        return max((i.version for i in self.versions(alias)), default=0) + 1


@contextlib.contextmanager
def engine_errors(what: str) -> Iterator[None]:
    """Our own errors pass; anything else the engine raises becomes StoreUnavailable."""
    try:
        yield
    except (RagError, KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as exc:
        raise StoreUnavailable(
            f"the Qdrant engine failed while {what}: {type(exc).__name__}: {exc}"
        ) from exc


def check_lengths(*columns: Sequence[Any] | np.ndarray) -> None:
    if len({len(c) for c in columns}) != 1:
        raise ValueError("ids, vectors, sparse vectors and payloads must have the same length")


def best_first(
    points: Iterable[tuple[str, float]], limit: int | None = None
) -> list[tuple[str, float]]:
    """(id, score) pairs best first, equal scores in id order (see Store.search)."""
    ranked = sorted(points, key=lambda p: (-p[1], p[0]))
    return ranked if limit is None else ranked[:limit]


def float32_array(values: Any) -> np.ndarray:
    """An engine's vector (a list of Python floats, from the bindings) as a float32 array.

    Packing the floats with `struct` takes 4 us for 384 of them against 10 us for
    `np.asarray(values, dtype=np.float32)` (the numbers are float32 already, so both are exact):
    MMR reads 50 candidates' vectors in every diverse search (README, "Diverse hits")."""
    if isinstance(values, np.ndarray) or values is None:
        return np.asarray(values, dtype=np.float32)
    try:
        return np.frombuffer(struct.pack(f"{len(values)}f", *values), dtype=np.float32)
    except (struct.error, OverflowError, TypeError):  # out of float32's range, or not floats
        return np.asarray(values, dtype=np.float32)


def make_record(pid: Any, payload: Any, vector: Any, *, dense: bool, sparse: bool) -> Record:
    """A Record from an engine's point: `vector` maps vector names to values."""
    values = vector if isinstance(vector, Mapping) else {DENSE: vector}
    out_dense = float32_array(values.get(DENSE)) if dense else None
    out_sparse = None
    if sparse:
        sp = values.get(SPARSE)
        if sp is None:
            raise ValueError(f"point {pid} has no {SPARSE} vector")
        out_sparse = SparseVector(
            tuple(int(i) for i in sp.indices), tuple(float(v) for v in sp.values)
        )
    return Record(str(pid), dict(payload or {}), out_dense, out_sparse)


def retired_for(record: VersionRecord, now: float | None = None) -> float | None:
    """Seconds since a version stopped being served (None if it never was, or still is)."""
    retired = record.retired_at
    return None if retired is None else (now or time.time()) - float(retired)
