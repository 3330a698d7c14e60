"""Qdrant behind one small interface: versioned collections, their metadata, the serving alias.

Example:
    >>> store = QdrantStore(QdrantClient(":memory:"))          # doctest: +SKIP
    >>> store.resolve("docs")                                  # doctest: +SKIP
    'docs__all-minilm-l6-v2-384__v3'

A collection is named `<alias>__<model-slug>-<dim>__v<N>` and carries its state in Qdrant's
collection metadata (`rag_retriever`: alias, version, fingerprint, status, counts), so the
state lives where the vectors live, in embedded and in server mode alike. Queries go through
the alias; the alias moves with one `update_collection_aliases` call, atomic on a server.

Embedded Qdrant (`QdrantClient(path=...)`) is single-process: one process holds the storage
lock, so ingest while serving must run in the serving process or against a Qdrant server.
This module knows nothing of chunking, models or BM25.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from qdrant_client import QdrantClient
from qdrant_client import models as qm
from qdrant_client.http.exceptions import UnexpectedResponse
from qdrant_client.local.qdrant_local import QdrantLocal
from threadpoolctl import ThreadpoolController

from rag_retriever.errors import CollectionNotFound, ConfigError
from rag_retriever.records import SearchFilter
from rag_retriever.settings import Settings

log = logging.getLogger(__name__)

META_KEY = "rag_retriever"
STATUS_BUILDING = "building"
STATUS_COMPLETE = "complete"
_VERSIONED = re.compile(r"^(?P<alias>.+?)__(?P<slug>.+)__v(?P<version>\d+)$")


def open_client(settings: Settings) -> QdrantClient:
    """A Qdrant server client when RAG_QDRANT_URL is set, else embedded Qdrant under data_dir."""
    if settings.qdrant_url:
        return QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key, timeout=30)
    settings.qdrant_path.mkdir(parents=True, exist_ok=True)
    try:
        # Searches run on the HTTP server's worker threads; QdrantStore serialises access.
        return QdrantClient(path=str(settings.qdrant_path), force_disable_check_same_thread=True)
    except RuntimeError as exc:
        if "already accessed" in str(exc):
            raise ConfigError(
                f"embedded Qdrant storage {settings.qdrant_path} is in use by another process "
                f"(a running `rag-retriever serve` or ingest). Embedded Qdrant is single-process: "
                f"stop that process, or run a Qdrant server and set RAG_QDRANT_URL."
            ) from None
        raise


def collection_name(alias: str, slug: str, version: int) -> str:
    return f"{alias}__{slug}__v{version}"


def parse_collection_name(name: str) -> tuple[str, str, int] | None:
    match = _VERSIONED.match(name)
    if not match:
        return None
    return match["alias"], match["slug"], int(match["version"])


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


def to_qdrant_filter(flt: SearchFilter | None) -> qm.Filter | None:
    if flt is None or flt.is_empty:
        return None
    must: list[qm.Condition] = []
    if flt.doc_ids is not None:
        must.append(qm.FieldCondition(key="doc_id", match=qm.MatchAny(any=list(flt.doc_ids))))
    for key, value in flt.equals.items():
        must.append(qm.FieldCondition(key=f"metadata.{key}", match=qm.MatchValue(value=value)))
    return qm.Filter(must=must)


_blas: ThreadpoolController | None = None


def _one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """Embedded Qdrant scores a query with a numpy matrix product over the whole collection.
    Run by a multi-threaded OpenBLAS, that product leaves BLAS worker threads spinning, and they
    starve the next torch forward pass (the next query's encoding): on 2 cores a dense query took
    110 ms at p50 instead of 15 ms. With one BLAS thread the product itself costs the same."""
    global _blas
    if _blas is None:
        _blas = ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas")


class QdrantStore:
    """Versioned collections and aliases on one QdrantClient (embedded or server)."""

    def __init__(self, client: QdrantClient) -> None:
        self.client = client
        # Embedded Qdrant is not safe for concurrent use; a server is, and needs no lock.
        self._lock: threading.RLock | None = threading.RLock() if self.embedded else None

    @property
    def embedded(self) -> bool:
        return isinstance(self.client._client, QdrantLocal)

    def _guard(self) -> threading.RLock | _NoLock:
        return self._lock if self._lock is not None else _NO_LOCK

    # -- names and metadata -----------------------------------------------------------------

    def aliases(self) -> dict[str, str]:
        with self._guard():
            return {a.alias_name: a.collection_name for a in self.client.get_aliases().aliases}

    def collection_names(self) -> list[str]:
        with self._guard():
            return sorted(c.name for c in self.client.get_collections().collections)

    def exists(self, name: str) -> bool:
        with self._guard():
            return bool(self.client.collection_exists(name))

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

    def metadata(self, name: str) -> dict[str, Any]:
        with self._guard(), _missing_as_not_found(name):
            config = self.client.get_collection(name).config
        meta = (getattr(config, "metadata", None) or {}).get(META_KEY)
        return dict(meta) if isinstance(meta, Mapping) else {}

    def info(self, name: str) -> CollectionInfo:
        parsed = parse_collection_name(name)
        meta = self.metadata(name)
        return CollectionInfo(
            name=name,
            alias=str(meta.get("alias") or (parsed[0] if parsed else name)),
            version=int(meta.get("version") or (parsed[2] if parsed else 0)),
            status=str(meta.get("status", "unknown")),
            points=self.count(name),
            meta=meta,
        )

    def versions(self, alias: str) -> list[CollectionInfo]:
        """Every collection written for `alias`, oldest version first."""
        names = [
            n for n in self.collection_names() if (p := parse_collection_name(n)) and p[0] == alias
        ]
        infos = [self.info(n) for n in names]
        return sorted(infos, key=lambda i: i.version)

    def next_version(self, alias: str) -> int:
        return max((i.version for i in self.versions(alias)), default=0) + 1

    # -- writing ----------------------------------------------------------------------------

    def create(self, name: str, dim: int, meta: Mapping[str, Any]) -> None:
        with self._guard():
            self.client.create_collection(
                name,
                vectors_config=qm.VectorParams(size=dim, distance=qm.Distance.COSINE),
                metadata={META_KEY: dict(meta)},
            )
            if self.embedded:
                self._fast_local_writes(name)

    def _fast_local_writes(self, name: str) -> None:
        """Embedded Qdrant commits every point to SQLite on its own; in the default rollback
        journal each commit waits for two fsyncs (~5 ms), which dominated the upserts. A
        write-ahead log with synchronous=NORMAL keeps every commit safe from a killed process
        (SIGKILL) and only syncs at checkpoints. Reaches into qdrant-client's local storage,
        so it is best effort: if that changes, writes are just slower."""
        try:
            local: Any = self.client._client
            connection = local.collections[name].storage.storage
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
        except (AttributeError, KeyError, sqlite3.Error) as exc:
            log.debug("could not tune embedded storage of %s: %s", name, exc)

    def update_metadata(self, name: str, meta: Mapping[str, Any]) -> None:
        """Replace the rag_retriever metadata of a collection."""
        with self._guard():
            self.client.update_collection(name, metadata={META_KEY: dict(meta)})

    def upsert(
        self,
        name: str,
        ids: Sequence[str],
        vectors: np.ndarray,
        payloads: Sequence[Mapping[str, Any]],
    ) -> None:
        if not (len(ids) == len(vectors) == len(payloads)):
            raise ValueError("ids, vectors and payloads must have the same length")
        points = [
            qm.PointStruct(id=pid, vector=vec.tolist(), payload=dict(payload))
            for pid, vec, payload in zip(ids, vectors, payloads, strict=True)
        ]
        with self._guard():
            self.client.upsert(name, points=points, wait=True)

    def delete(self, name: str) -> None:
        with self._guard():
            self.client.delete_collection(name)

    def point_alias(self, alias: str, name: str) -> None:
        """Point `alias` at `name` in one atomic call (delete + create in one request)."""
        ops: list[qm.AliasOperations] = []
        if alias in self.aliases():
            ops.append(qm.DeleteAliasOperation(delete_alias=qm.DeleteAlias(alias_name=alias)))
        ops.append(
            qm.CreateAliasOperation(
                create_alias=qm.CreateAlias(collection_name=name, alias_name=alias)
            )
        )
        with self._guard():
            self.client.update_collection_aliases(change_aliases_operations=ops)

    # -- reading ----------------------------------------------------------------------------

    def count(self, name: str) -> int:
        with self._guard():
            return int(self.client.count(name, exact=True).count)

    def search(
        self, name: str, vector: np.ndarray, limit: int, flt: SearchFilter | None = None
    ) -> list[tuple[str, float]]:
        """(point id, cosine) of the `limit` nearest points, best first."""
        blas = _one_blas_thread() if self.embedded else contextlib.nullcontext()
        with self._guard(), _missing_as_not_found(name), blas:
            response = self.client.query_points(
                name,
                query=vector.tolist(),
                limit=limit,
                query_filter=to_qdrant_filter(flt),
                with_payload=False,
                with_vectors=False,
            )
        return [(str(p.id), float(p.score)) for p in response.points]

    def vectors(self, name: str, ids: Sequence[str], batch: int = 512) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for start in range(0, len(ids), batch):
            with self._guard():
                records = self.client.retrieve(
                    name,
                    ids=list(ids[start : start + batch]),
                    with_vectors=True,
                    with_payload=False,
                )
            for r in records:
                assert isinstance(r.vector, list)
                out[str(r.id)] = np.asarray(r.vector, dtype=np.float32)
        return out

    def payloads(self, name: str, batch: int = 1024) -> Iterator[dict[str, Any]]:
        """Every point's payload, in no particular order (for rebuilding an index)."""
        offset: Any = None
        while True:
            with self._guard():
                records, offset = self.client.scroll(
                    name, limit=batch, offset=offset, with_payload=True, with_vectors=False
                )
            for r in records:
                yield dict(r.payload or {})
            if offset is None:
                return


@contextlib.contextmanager
def _missing_as_not_found(name: str) -> Iterator[None]:
    """A collection deleted under our feet (e.g. by retention) becomes CollectionNotFound."""
    try:
        yield
    except UnexpectedResponse as exc:
        if exc.status_code == 404:
            raise CollectionNotFound(f"collection {name!r} no longer exists") from None
        raise
    except ValueError as exc:  # embedded Qdrant
        if "not found" in str(exc):
            raise CollectionNotFound(f"collection {name!r} no longer exists") from None
        raise


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
