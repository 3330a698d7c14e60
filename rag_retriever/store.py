"""Qdrant behind one small interface: versioned collections, their metadata, the serving alias.

Example:
    >>> store = EdgeStore(Path("rag-data/edge"))                 # doctest: +SKIP
    >>> store.resolve("docs")                                    # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v3'

A collection version is named `<alias>__<model-slug>-<dim>__v<N>` and holds two named vectors
per chunk: `dense` (cosine) and `bm25` (sparse Okapi weights, see bm25.py), with the chunk record
as payload. Its state (alias, version, fingerprint, status, BM25 statistics, counts) is kept as
metadata beside the vectors. Queries go through the alias. Two engines:

- `EdgeStore` (the embedded default): Qdrant Edge, the Qdrant engine in-process. Edge has no
  collections or aliases, so each version is one shard directory with `meta.json` beside it,
  and an alias is a small file replaced atomically. A version is built with the WAL off, then
  flushed, optimized, payload-indexed and marked complete; from then on it is never written
  again, and any number of processes open it at once while `ingest` builds the next one.
- `ServerStore`: a Qdrant server or cluster through qdrant-client (`RAG_QDRANT_URL`); aliases
  move with one `update_collection_aliases` call. Nothing is kept on the local disk. Tests run it
  on qdrant-client's own in-process implementation of the server API (`QdrantClient(":memory:")`).

This module knows nothing of chunking, models or how BM25 weights are computed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np

from rag_retriever.bm25 import SparseVector
from rag_retriever.errors import CollectionNotFound, ConfigError, InvalidRequest
from rag_retriever.records import ALIAS_PATTERN, SearchFilter, check_alias
from rag_retriever.settings import Settings

log = logging.getLogger(__name__)

STATUS_BUILDING = "building"
STATUS_COMPLETE = "complete"
DENSE: Final = "dense"
SPARSE: Final = "bm25"
_VERSIONED = re.compile(r"^(?P<alias>.+?)__(?P<slug>.+)__v(?P<version>\d+)$")
# What a version's directory may be called: a plain file name that cannot leave the store.
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# A metadata key that Qdrant's JSON path reads without quotes.
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")

# HNSW search breadth: ef = this many times the number of neighbours asked for. With Qdrant's
# default ef, 100 neighbours lost 0.0074 of SciFact's dense recall@100 (12,382 chunks) against
# an exact search; with 4x it equals the exact search's 0.9153, for ~1.7 ms more at 100k points.
HNSW_EF_PER_RESULT = 4

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
    id: str
    payload: Mapping[str, Any]
    dense: np.ndarray | None = None


@dataclass(frozen=True)
class CollectionInfo:
    name: str
    alias: str
    version: int
    status: str
    points: int
    meta: Mapping[str, Any]

    @property
    def fingerprint(self) -> Mapping[str, Any] | None:
        value = self.meta.get("fingerprint")
        return value if isinstance(value, Mapping) else None


class Store(ABC):
    """Versioned collections and aliases on one engine. Subclasses supply the primitives."""

    embedded: bool

    # -- primitives ---------------------------------------------------------------------------

    @abstractmethod
    def collection_names(self) -> list[str]: ...

    @abstractmethod
    def aliases(self) -> dict[str, str]: ...

    @abstractmethod
    def metadata(self, name: str) -> dict[str, Any]: ...

    @abstractmethod
    def update_metadata(self, name: str, meta: Mapping[str, Any]) -> None:
        """Replace the rag_retriever metadata of a collection."""

    @abstractmethod
    def create(self, name: str, dim: int, meta: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def upsert(
        self,
        name: str,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None: ...

    @abstractmethod
    def seal(self, name: str, indexes: Mapping[str, IndexKind]) -> None:
        """Make a fully written collection fast and durable: payload indexes (path -> kind),
        flush, optimize. Nothing is written to it afterwards."""

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
    def retrieve(self, name: str, ids: Sequence[str], *, with_dense: bool = False) -> list[Record]:
        """The points with these ids (missing ids are left out), in no particular order."""

    @abstractmethod
    def scroll(self, name: str, *, flt: SearchFilter | None = None) -> Iterator[Record]:
        """Every point's payload (of those the filter keeps), in no particular order."""

    def close(self) -> None:  # noqa: B027 - optional for subclasses
        """Release what the store holds open."""

    # -- derived ------------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return name in self.collection_names()

    def resolve(self, alias_or_name: str) -> str:
        """The collection an alias points to (or the name itself if it is a collection)."""
        aliases = self.aliases()
        if alias_or_name in aliases:
            return aliases[alias_or_name]
        if self.exists(alias_or_name):
            return alias_or_name
        known = sorted(aliases) or self.collection_names()
        raise CollectionNotFound(
            f"collection {alias_or_name!r} does not exist; existing: "
            f"{', '.join(known) if known else 'none'} (ingest one with "
            f"`rag-retriever ingest PATH --collection {alias_or_name}`)"
        )

    def info(self, name: str) -> CollectionInfo:
        parsed = parse_collection_name(name)
        meta = self.metadata(name)
        return CollectionInfo(
            name=name,
            alias=str(meta.get("alias") or (parsed[0] if parsed else name)),
            version=int(meta.get("version") or (parsed[2] if parsed else 0)),
            status=str(meta.get("status", "unknown")),
            points=self._points(name, meta),
            meta=meta,
        )

    def _points(self, name: str, meta: Mapping[str, Any]) -> int:
        if "chunks" in meta:
            return int(meta["chunks"])
        if self.embedded and meta.get("status") != STATUS_COMPLETE:
            return 0  # an embedded shard another process is still writing is not opened
        return self.count(name)

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


def open_store(settings: Settings) -> Store:
    """A Qdrant server store when RAG_QDRANT_URL is set, else Qdrant Edge under data_dir."""
    if settings.qdrant_url:
        from qdrant_client import QdrantClient

        client = QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key, timeout=30)
        return ServerStore(
            client,
            shard_number=settings.qdrant_shards,
            replication_factor=settings.qdrant_replicas,
            write_consistency_factor=settings.qdrant_write_consistency,
        )
    check_data_dir(settings.data_dir)
    return EdgeStore(settings.edge_dir)


def check_data_dir(data_dir: Path) -> None:
    """Refuse a data dir written by rag-retriever 0.1, whose format this version cannot read."""
    old = [p for p in (data_dir / "qdrant", data_dir / "indexes") if p.is_dir()]
    if old:
        raise ConfigError(
            f"{data_dir} holds collections written by rag-retriever 0.1 "
            f"({', '.join(str(p) for p in old)}: qdrant-client local mode and a BM25 sidecar), "
            f"which this version does not read. Re-ingest your documents into a new data dir "
            f"(RAG_DATA_DIR=new-dir rag-retriever ingest PATH --collection NAME), or remove "
            f"those folders to re-ingest in place."
        )


# -- Qdrant Edge (embedded) ---------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a reader (or a crash) sees the old or the new file:
    write a temporary file, fsync it, rename it over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class EdgeStore(Store):
    """Collections as Qdrant Edge shards under `root`:

    root/collections/<name>/meta.json   the version's metadata (status building -> complete)
    root/collections/<name>/shard/      the Edge shard (no WAL)
    root/aliases/<alias>.json           {"collection": <name>}

    Shards are opened on first use and kept open; a shard whose directory was removed (by
    retention in another process) is dropped and reported as CollectionNotFound.
    """

    embedded = True

    def __init__(self, root: Path) -> None:
        import qdrant_edge

        self._edge = qdrant_edge
        self.root = root
        self._collections = root / "collections"
        self._aliases = root / "aliases"
        self._collections.mkdir(parents=True, exist_ok=True)
        self._aliases.mkdir(parents=True, exist_ok=True)
        for folder in (self._collections, self._aliases):
            # Everything the store writes stays under its root: a link that leads out is refused.
            if not folder.resolve().is_relative_to(root.resolve()):
                raise ConfigError(
                    f"{folder} leads outside the data dir (to {folder.resolve()}); the store "
                    f"writes only under {root}: remove the link"
                )
        self._shards: dict[str, Any] = {}
        self._lock = threading.Lock()

    # names and metadata

    def _dir(self, name: str) -> Path:
        """The directory of a version. A name that is not a plain file name (no '/', no leading
        '.', no '..') is refused before any path is built from it."""
        if not _SAFE_NAME.fullmatch(name):
            raise CollectionNotFound(f"{name!r} is not a collection name of this store")
        return self._collections / name

    def _alias_file(self, alias: str) -> Path:
        try:
            return self._aliases / f"{check_alias(alias)}.json"
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def collection_names(self) -> list[str]:
        return sorted(
            p.name
            for p in self._collections.iterdir()
            if not p.name.startswith(".") and (p / "meta.json").is_file()
        )

    def exists(self, name: str) -> bool:
        return (self._dir(name) / "meta.json").is_file()

    def aliases(self) -> dict[str, str]:
        out = {}
        for path in self._aliases.glob("*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                out[path.stem] = str(json.loads(path.read_text(encoding="utf-8"))["collection"])
        return out

    def resolve(self, alias_or_name: str) -> str:
        # One small read per query: a serving process follows a moved alias at once.
        if ALIAS_PATTERN.fullmatch(alias_or_name):
            path = self._aliases / f"{alias_or_name}.json"
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError, OSError):
                return str(json.loads(path.read_text(encoding="utf-8"))["collection"])
        return super().resolve(alias_or_name)

    def metadata(self, name: str) -> dict[str, Any]:
        try:
            data = json.loads((self._dir(name) / "meta.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CollectionNotFound(f"collection {name!r} does not exist") from None
        return dict(data)

    def update_metadata(self, name: str, meta: Mapping[str, Any]) -> None:
        if not self._dir(name).is_dir():
            raise CollectionNotFound(f"collection {name!r} does not exist")
        write_atomic(self._dir(name) / "meta.json", json.dumps(dict(meta)).encode())

    # writing

    def create(self, name: str, dim: int, meta: Mapping[str, Any]) -> None:
        edge = self._edge
        directory = self._dir(name)
        directory.mkdir(parents=True)
        self.update_metadata(name, meta)
        config = edge.EdgeConfig(
            vectors={DENSE: edge.EdgeVectorParams(size=dim, distance=edge.Distance.Cosine)},
            sparse_vectors={SPARSE: edge.EdgeSparseVectorParams()},
            # No WAL: a version is written once by one process, and durable once flushed; a
            # shard without WAL can be opened by any number of processes at once.
            wal_enabled=False,
        )
        with self._lock:
            self._shards[name] = edge.EdgeShard.create(str(directory / "shard"), config)

    def upsert(
        self,
        name: str,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None:
        _check_lengths(ids, dense, sparse, payloads)
        edge = self._edge
        points = [
            edge.Point(
                pid,
                {
                    DENSE: vec.tolist(),
                    SPARSE: edge.SparseVector(list(sp.indices), list(sp.values)),
                },
                dict(payload),
            )
            for pid, vec, sp, payload in zip(ids, dense, sparse, payloads, strict=True)
        ]
        self._shard(name).update(edge.UpdateOperation.upsert_points(points))

    def seal(self, name: str, indexes: Mapping[str, IndexKind]) -> None:
        edge = self._edge
        kinds = {
            "keyword": edge.PayloadSchemaType.Keyword,
            "integer": edge.PayloadSchemaType.Integer,
            "bool": edge.PayloadSchemaType.Bool,
        }
        shard = self._shard(name)
        for path, kind in indexes.items():
            shard.update(edge.UpdateOperation.create_field_index(path, kinds[kind]))
        shard.flush()
        shard.optimize()
        shard.flush()

    def delete(self, name: str) -> None:
        """Remove a version: renamed out of sight first, so no reader sees half of it."""
        directory = self._dir(name)
        with self._lock:
            shard = self._shards.pop(name, None)
        if shard is not None:
            shard.close()
        trash = self._collections / f".deleted-{name}-{uuid.uuid4().hex[:8]}"
        try:
            directory.rename(trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def point_alias(self, alias: str, name: str) -> None:
        if not self.exists(name):
            raise CollectionNotFound(f"collection {name!r} does not exist")
        write_atomic(self._alias_file(alias), json.dumps({"collection": name}).encode())

    def remove_alias(self, alias: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._alias_file(alias).unlink()

    # reading

    def _shard(self, name: str) -> Any:
        directory = self._dir(name)
        shard = self._shards.get(name)
        if shard is not None:
            if not directory.is_dir():  # removed by another process
                with self._lock:
                    self._shards.pop(name, None)
                raise CollectionNotFound(f"collection {name!r} no longer exists")
            return shard
        with self._lock:
            shard = self._shards.get(name)
            if shard is None:
                if not (directory / "shard").is_dir():
                    raise CollectionNotFound(f"collection {name!r} does not exist")
                try:
                    shard = self._edge.EdgeShard.load(str(directory / "shard"))
                except Exception as exc:
                    if not directory.is_dir():
                        raise CollectionNotFound(f"collection {name!r} no longer exists") from None
                    raise RuntimeError(f"cannot open {directory / 'shard'}: {exc}") from exc
                self._shards[name] = shard
            return shard

    def count(self, name: str) -> int:
        return int(self._shard(name).count(self._edge.CountRequest(exact=True)))

    def search(self, name: str, queries: Sequence[StageQuery]) -> list[list[tuple[str, float]]]:
        edge = self._edge
        requests = []
        for q in queries:
            if isinstance(q.vector, SparseVector):
                vector: Any = edge.SparseVector(list(q.vector.indices), list(q.vector.values))
            else:
                vector = q.vector.tolist()
            requests.append(
                edge.QueryRequest(
                    limit=q.limit,
                    query=edge.Query.Nearest(vector, using=q.using),
                    filter=self._filter(q.flt),
                    params=edge.SearchParams(hnsw_ef=HNSW_EF_PER_RESULT * q.limit)
                    if q.using == DENSE
                    else None,
                    with_payload=False,
                    with_vector=False,
                )
            )
        if not requests:
            return []
        results = self._shard(name).query_batch(edge.QueryBatchRequest(requests))
        return [_best_first(points) for points in results]

    def retrieve(self, name: str, ids: Sequence[str], *, with_dense: bool = False) -> list[Record]:
        if not ids:
            return []
        records = self._shard(name).retrieve(
            list(ids), with_payload=True, with_vector=[DENSE] if with_dense else False
        )
        return [_record(r.id, r.payload, r.vector, with_dense) for r in records]

    def scroll(self, name: str, *, flt: SearchFilter | None = None) -> Iterator[Record]:
        edge = self._edge
        offset: Any = None
        while True:
            records, offset = self._shard(name).scroll(
                edge.ScrollRequest(
                    offset=offset, limit=1024, filter=self._filter(flt), with_payload=True
                )
            )
            for r in records:
                yield Record(str(r.id), dict(r.payload or {}))
            if offset is None:
                return

    def _filter(self, flt: SearchFilter | None) -> Any:
        if flt is None or flt.is_empty:
            return None
        edge = self._edge
        must: list[Any] = []
        if flt.doc_ids is not None:
            must.append(edge.FieldCondition(key="doc_id", match=edge.MatchAny(list(flt.doc_ids))))
        for key, value in flt.equals.items():
            must.append(edge.FieldCondition(key=metadata_path(key), match=edge.MatchValue(value)))
        return edge.Filter(must=must)

    def close(self) -> None:
        with self._lock:
            shards, self._shards = self._shards, {}
        for shard in shards.values():
            shard.close()


# -- Qdrant server (qdrant-client) --------------------------------------------------------------

META_KEY = "rag_retriever"


class ServerStore(Store):
    """Collections on a Qdrant server or cluster; stateless on the local machine."""

    def __init__(
        self,
        client: Any,
        *,
        shard_number: int | None = None,
        replication_factor: int | None = None,
        write_consistency_factor: int | None = None,
    ) -> None:
        from qdrant_client.local.qdrant_local import QdrantLocal

        self.client = client
        self.embedded = isinstance(client._client, QdrantLocal)
        self.shard_number = shard_number
        self.replication_factor = replication_factor
        self.write_consistency_factor = write_consistency_factor
        # qdrant-client's in-process implementation is not thread-safe; a server is.
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self.embedded else contextlib.nullcontext()
        )

    def collection_names(self) -> list[str]:
        with self._lock:
            return sorted(c.name for c in self.client.get_collections().collections)

    def exists(self, name: str) -> bool:
        with self._lock:
            return bool(self.client.collection_exists(name))

    def aliases(self) -> dict[str, str]:
        with self._lock:
            return {a.alias_name: a.collection_name for a in self.client.get_aliases().aliases}

    def metadata(self, name: str) -> dict[str, Any]:
        with self._lock, _missing_as_not_found(name):
            config = self.client.get_collection(name).config
        meta = (getattr(config, "metadata", None) or {}).get(META_KEY)
        return dict(meta) if isinstance(meta, Mapping) else {}

    def update_metadata(self, name: str, meta: Mapping[str, Any]) -> None:
        with self._lock, _missing_as_not_found(name):
            self.client.update_collection(name, metadata={META_KEY: dict(meta)})

    def create(self, name: str, dim: int, meta: Mapping[str, Any]) -> None:
        from qdrant_client import models as qm

        with self._lock:
            self.client.create_collection(
                name,
                vectors_config={DENSE: qm.VectorParams(size=dim, distance=qm.Distance.COSINE)},
                sparse_vectors_config={SPARSE: qm.SparseVectorParams()},
                shard_number=self.shard_number,
                replication_factor=self.replication_factor,
                write_consistency_factor=self.write_consistency_factor,
                metadata={META_KEY: dict(meta)},
            )

    def upsert(
        self,
        name: str,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None:
        from qdrant_client import models as qm

        _check_lengths(ids, dense, sparse, payloads)
        points = [
            qm.PointStruct(
                id=pid,
                vector={
                    DENSE: vec.tolist(),
                    SPARSE: qm.SparseVector(indices=list(sp.indices), values=list(sp.values)),
                },
                payload=dict(payload),
            )
            for pid, vec, sp, payload in zip(ids, dense, sparse, payloads, strict=True)
        ]
        with self._lock:
            self.client.upsert(name, points=points, wait=True)

    def seal(self, name: str, indexes: Mapping[str, IndexKind]) -> None:
        from qdrant_client import models as qm

        kinds = {
            "keyword": qm.PayloadSchemaType.KEYWORD,
            "integer": qm.PayloadSchemaType.INTEGER,
            "bool": qm.PayloadSchemaType.BOOL,
        }
        if self.embedded:  # qdrant-client's local mode has no payload indexes (it warns)
            return
        for path, kind in indexes.items():
            self.client.create_payload_index(name, path, kinds[kind], wait=True)

    def delete(self, name: str) -> None:
        with self._lock:
            self.client.delete_collection(name)

    def point_alias(self, alias: str, name: str) -> None:
        """Delete + create in one request: atomic on the server."""
        from qdrant_client import models as qm

        ops: list[Any] = []
        if alias in self.aliases():
            ops.append(qm.DeleteAliasOperation(delete_alias=qm.DeleteAlias(alias_name=alias)))
        ops.append(
            qm.CreateAliasOperation(
                create_alias=qm.CreateAlias(collection_name=name, alias_name=alias)
            )
        )
        with self._lock:
            self.client.update_collection_aliases(change_aliases_operations=ops)

    def count(self, name: str) -> int:
        with self._lock, _missing_as_not_found(name):
            return int(self.client.count(name, exact=True).count)

    def search(self, name: str, queries: Sequence[StageQuery]) -> list[list[tuple[str, float]]]:
        from qdrant_client import models as qm

        requests = []
        for q in queries:
            if isinstance(q.vector, SparseVector):
                vector: Any = qm.SparseVector(
                    indices=list(q.vector.indices), values=list(q.vector.values)
                )
            else:
                vector = q.vector.tolist()
            requests.append(
                qm.QueryRequest(
                    query=vector,
                    using=q.using,
                    limit=q.limit,
                    filter=self._filter(q.flt),
                    # local mode searches exactly (and warns about HNSW parameters)
                    params=qm.SearchParams(hnsw_ef=HNSW_EF_PER_RESULT * q.limit)
                    if q.using == DENSE and not self.embedded
                    else None,
                    with_payload=False,
                    with_vector=False,
                )
            )
        if not requests:
            return []
        with self._lock, _missing_as_not_found(name):
            responses = self.client.query_batch_points(name, requests=requests)
        return [_best_first(r.points) for r in responses]

    def retrieve(self, name: str, ids: Sequence[str], *, with_dense: bool = False) -> list[Record]:
        if not ids:
            return []
        with self._lock, _missing_as_not_found(name):
            records = self.client.retrieve(
                name,
                ids=list(ids),
                with_payload=True,
                with_vectors=[DENSE] if with_dense else False,
            )
        return [_record(r.id, r.payload, r.vector, with_dense) for r in records]

    def scroll(self, name: str, *, flt: SearchFilter | None = None) -> Iterator[Record]:
        offset: Any = None
        while True:
            with self._lock, _missing_as_not_found(name):
                records, offset = self.client.scroll(
                    name,
                    limit=1024,
                    offset=offset,
                    scroll_filter=self._filter(flt),
                    with_payload=True,
                    with_vectors=False,
                )
            for r in records:
                yield Record(str(r.id), dict(r.payload or {}))
            if offset is None:
                return

    @staticmethod
    def _filter(flt: SearchFilter | None) -> Any:
        from qdrant_client import models as qm

        if flt is None or flt.is_empty:
            return None
        must: list[Any] = []
        if flt.doc_ids is not None:
            must.append(qm.FieldCondition(key="doc_id", match=qm.MatchAny(any=list(flt.doc_ids))))
        for key, value in flt.equals.items():
            must.append(qm.FieldCondition(key=metadata_path(key), match=qm.MatchValue(value=value)))
        return qm.Filter(must=must)

    def close(self) -> None:
        self.client.close()


@contextlib.contextmanager
def _missing_as_not_found(name: str) -> Iterator[None]:
    """A collection deleted under our feet (e.g. by retention) becomes CollectionNotFound."""
    from qdrant_client.http.exceptions import UnexpectedResponse

    try:
        yield
    except UnexpectedResponse as exc:
        if exc.status_code == 404:
            raise CollectionNotFound(f"collection {name!r} no longer exists") from None
        raise
    except ValueError as exc:  # qdrant-client's local mode
        if "not found" in str(exc):
            raise CollectionNotFound(f"collection {name!r} no longer exists") from None
        raise


def _check_lengths(*columns: Sequence[Any] | np.ndarray) -> None:
    if len({len(c) for c in columns}) != 1:
        raise ValueError("ids, vectors, sparse vectors and payloads must have the same length")


def _best_first(points: Iterable[Any]) -> list[tuple[str, float]]:
    """(id, score) pairs best first, equal scores in id order (see Store.search)."""
    return sorted(((str(p.id), float(p.score)) for p in points), key=lambda p: (-p[1], p[0]))


def _record(pid: Any, payload: Any, vector: Any, with_dense: bool) -> Record:
    dense = None
    if with_dense:
        value = vector.get(DENSE) if isinstance(vector, Mapping) else vector
        dense = np.asarray(value, dtype=np.float32)
    return Record(str(pid), dict(payload or {}), dense)


def retired_for(meta: Mapping[str, Any], now: float | None = None) -> float | None:
    """Seconds since a version stopped being served (None if it never was, or still is)."""
    retired = meta.get("retired_at")
    return None if retired is None else (now or time.time()) - float(retired)
