"""The store layer: Qdrant behind one small interface, the version record and the catalog.

Example:
    >>> store = open_store(settings)                               # doctest: +SKIP
    >>> store.resolve("docs")                                      # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v3'
    >>> store.record("docs__all-minilm-l6-v2-384__v3").lineage     # doctest: +SKIP

- `base`: the `Store` interface every engine implements (one contract, one test suite), naming,
  filters and what a search asks for; it imports neither engine.
- `open`: `open_store(settings)`, the one place that picks an engine; `files`: atomic writes.
- `edge`: Qdrant Edge, the embedded default (a version = an immutable manifest of shards).
- `server`: a Qdrant server or cluster through qdrant-client.
- `record`: the typed version record (`VersionRecord`).
- `catalog`: versions of an alias: promote, roll back, retention, orphans, describe.

Nothing above this package reads a version's metadata by string keys or sees a qdrant type.
"""

from __future__ import annotations

from rag_retriever.store.base import (
    DENSE,
    HNSW_EF_PER_RESULT,
    SPARSE,
    CollectionInfo,
    IndexKind,
    Record,
    StageQuery,
    Store,
    collection_name,
    index_kind,
    metadata_path,
    parse_collection_name,
)
from rag_retriever.store.edge import EdgeStore
from rag_retriever.store.files import write_atomic
from rag_retriever.store.open import check_data_dir, open_store
from rag_retriever.store.record import (
    SCHEMA_VERSION,
    STATUS_BUILDING,
    STATUS_COMPLETE,
    Lineage,
    VersionRecord,
)
from rag_retriever.store.server import ServerStore

__all__ = [
    "DENSE",
    "HNSW_EF_PER_RESULT",
    "SCHEMA_VERSION",
    "SPARSE",
    "STATUS_BUILDING",
    "STATUS_COMPLETE",
    "CollectionInfo",
    "EdgeStore",
    "IndexKind",
    "Lineage",
    "Record",
    "ServerStore",
    "StageQuery",
    "Store",
    "VersionRecord",
    "check_data_dir",
    "collection_name",
    "index_kind",
    "metadata_path",
    "open_store",
    "parse_collection_name",
    "write_atomic",
]
