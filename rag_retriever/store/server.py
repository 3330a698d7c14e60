"""A Qdrant server or cluster through qdrant-client (`RAG_QDRANT_URL`): one collection a version.

Example:
    >>> store = ServerStore(QdrantClient(url="http://qdrant:6333"))     # doctest: +SKIP

Aliases move with one `update_collection_aliases` call (atomic on the server). Nothing is kept on
the local disk: a version's record and document frequencies live in the collection's metadata.
A version made from another (`derive`) is a new collection that receives the base's points
(vectors and payloads copied through the API, nothing re-encoded) minus the dropped ids, then
the delta; so on a server a delta costs a copy of the corpus's points but never its encoding or
tokenising. A real cluster would rather snapshot the base and recover it under the new name
(`create_snapshot` / `recover_snapshot`, no point transfer through the client); that path needs
a server's snapshot storage and was never run here (qdrant-client's in-process implementation of
the server API, which the tests use, has no snapshots).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rag_retriever import conditions
from rag_retriever.errors import CollectionNotFound, StoreUnavailable
from rag_retriever.models.bm25 import SparseVector
from rag_retriever.records import TENANT_FIELD, Quantization, SearchFilter
from rag_retriever.store.base import (
    DENSE,
    HNSW_EF_PER_RESULT,
    QUANTIZATION_OVERSAMPLING,
    SPARSE,
    IndexKind,
    Record,
    StageQuery,
    Store,
    best_first,
    check_lengths,
    make_record,
    metadata_path,
)
from rag_retriever.store.record import VersionRecord

META_KEY = "rag_retriever"
DOC_FREQS_KEY = "rag_retriever_doc_freqs"
# Points per call when a version's points are copied into a derived one.
COPY_BATCH = 512


class ServerStore(Store):
    """Collections on a Qdrant server or cluster; stateless on the local machine."""

    def __init__(
        self,
        client: Any,
        *,
        shard_number: int | None = None,
        replication_factor: int | None = None,
        write_consistency_factor: int | None = None,
        where: str | None = None,
    ) -> None:
        from qdrant_client.local.qdrant_local import QdrantLocal

        self.client = client
        self.embedded = isinstance(client._client, QdrantLocal)
        # how errors name it (open_store: the URL and RAG_QDRANT_URL)
        self._where = where or (
            "qdrant-client's in-process store" if self.embedded else "the Qdrant server"
        )
        self.shard_number = shard_number
        self.replication_factor = replication_factor
        self.write_consistency_factor = write_consistency_factor
        # qdrant-client's in-process implementation is not thread-safe; a server is.
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self.embedded else contextlib.nullcontext()
        )

    @property
    def where(self) -> str:
        return self._where

    @contextlib.contextmanager
    def _call(self, name: str | None = None) -> Iterator[None]:
        """One engine call: serialised on the in-process engine; a missing collection becomes
        CollectionNotFound and any other engine failure StoreUnavailable."""
        from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

        with self._lock:
            try:
                yield
            except UnexpectedResponse as exc:
                if exc.status_code == 404 and name is not None:
                    raise CollectionNotFound(f"collection {name!r} no longer exists") from None
                raise StoreUnavailable(
                    f"Qdrant answered {exc.status_code} {exc.reason_phrase}; check RAG_QDRANT_URL, "
                    f"RAG_QDRANT_API_KEY and the Qdrant server log"
                ) from exc
            except ValueError as exc:  # qdrant-client's local mode
                if "not found" in str(exc) and name is not None:
                    raise CollectionNotFound(f"collection {name!r} no longer exists") from None
                raise StoreUnavailable(f"the Qdrant engine refused the call: {exc}") from exc
            except ResponseHandlingException as exc:
                # `source` is the transport error, e.g. "[Errno 111] Connection refused".
                raise StoreUnavailable(
                    f"Qdrant is unreachable: {exc.source or type(exc.source).__name__}; check "
                    f"that the Qdrant server at RAG_QDRANT_URL is running"
                ) from exc

    def collection_names(self) -> list[str]:
        with self._call():
            return sorted(c.name for c in self.client.get_collections().collections)

    def exists(self, name: str) -> bool:
        with self._call():
            return bool(self.client.collection_exists(name))

    def aliases(self) -> dict[str, str]:
        with self._call():
            return {a.alias_name: a.collection_name for a in self.client.get_aliases().aliases}

    def _metadata(self, name: str) -> Mapping[str, Any]:
        with self._call(name):
            config = self.client.get_collection(name).config
        return getattr(config, "metadata", None) or {}

    def read_meta(self, name: str) -> dict[str, Any]:
        meta = self._metadata(name).get(META_KEY)
        return dict(meta) if isinstance(meta, Mapping) else {}

    def write_meta(self, name: str, meta: Mapping[str, Any]) -> None:
        with self._call(name):
            self.client.update_collection(name, metadata={META_KEY: dict(meta)})

    def doc_freqs(self, name: str) -> dict[str, int]:
        return dict(self._metadata(name).get(DOC_FREQS_KEY) or {})

    def put_doc_freqs(self, name: str, doc_freqs: Mapping[str, int]) -> None:
        with self._call(name):
            self.client.update_collection(name, metadata={DOC_FREQS_KEY: dict(doc_freqs.items())})

    def create(self, name: str, dim: int, record: VersionRecord) -> None:
        from qdrant_client import models as qm

        with self._call():
            self.client.create_collection(
                name,
                vectors_config={
                    DENSE: qm.VectorParams(
                        size=dim,
                        distance=qm.Distance.COSINE,
                        on_disk=True if record.quantization != "none" else None,
                    )
                },
                sparse_vectors_config={SPARSE: qm.SparseVectorParams()},
                quantization_config=_server_quantization(record.quantization),
                shard_number=self.shard_number,
                replication_factor=self.replication_factor,
                write_consistency_factor=self.write_consistency_factor,
                metadata={META_KEY: record.to_json()},
            )

    def derive(self, name: str, base: str, record: VersionRecord, drop: Iterable[str]) -> None:
        """A new collection with `base`'s points minus `drop`, copied in batches (see the module
        docstring for what a cluster would do instead)."""
        drop = set(drop)
        self.create(name, record.fingerprint.dim, record)
        offset: Any = None
        while True:
            with self._call(base):
                points, offset = self.client.scroll(
                    base, limit=COPY_BATCH, offset=offset, with_payload=True, with_vectors=True
                )
            kept = [p for p in points if str(p.id) not in drop]
            if kept:
                records = [
                    make_record(p.id, p.payload, p.vector, dense=True, sparse=True) for p in kept
                ]
                self.upsert(
                    name,
                    [r.id for r in records],
                    np.stack([r.dense for r in records if r.dense is not None]),
                    [r.sparse for r in records if r.sparse is not None],
                    [r.payload for r in records],
                )
            if offset is None:
                return

    def upsert(
        self,
        name: str,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None:
        from qdrant_client import models as qm

        check_lengths(ids, dense, sparse, payloads)
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
        with self._call(name):
            self.client.upsert(name, points=points, wait=True)

    def seal(self, name: str, indexes: Mapping[str, IndexKind], *, merge_base: bool = True) -> None:
        from qdrant_client import models as qm

        kinds = {
            "keyword": qm.PayloadSchemaType.KEYWORD,
            "integer": qm.PayloadSchemaType.INTEGER,
            "bool": qm.PayloadSchemaType.BOOL,
        }
        if self.embedded:  # qdrant-client's local mode has no payload indexes (it warns)
            return
        for path, kind in indexes.items():
            schema: Any = kinds[kind]
            if path == metadata_path(TENANT_FIELD) and kind == "keyword":
                # Qdrant's tenant index: points of one tenant stored together, so a tenant's
                # search reads its own points (docs/tenants.md)
                schema = qm.KeywordIndexParams(type=qm.KeywordIndexType.KEYWORD, is_tenant=True)
            with self._call(name):
                self.client.create_payload_index(name, path, schema, wait=True)

    def delete(self, name: str) -> None:
        with self._call():
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
        with self._call(name):
            self.client.update_collection_aliases(change_aliases_operations=ops)

    def count(self, name: str) -> int:
        with self._call(name):
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
                    params=qm.SearchParams(
                        hnsw_ef=HNSW_EF_PER_RESULT * q.limit,
                        quantization=qm.QuantizationSearchParams(
                            rescore=True, oversampling=QUANTIZATION_OVERSAMPLING
                        ),
                    )
                    if q.using == DENSE and not self.embedded
                    else None,
                    with_payload=False,
                    with_vector=False,
                )
            )
        if not requests:
            return []
        with self._call(name):
            responses = self.client.query_batch_points(name, requests=requests)
        return [best_first((str(p.id), float(p.score)) for p in r.points) for r in responses]

    def retrieve(
        self,
        name: str,
        ids: Sequence[str],
        *,
        with_dense: bool = False,
        with_sparse: bool = False,
        with_payload: bool = True,
    ) -> list[Record]:
        if not ids:
            return []
        vectors = [v for v, wanted in ((DENSE, with_dense), (SPARSE, with_sparse)) if wanted]
        with self._call(name):
            records = self.client.retrieve(
                name, ids=list(ids), with_payload=with_payload, with_vectors=vectors or False
            )
        return [
            make_record(r.id, r.payload, r.vector, dense=with_dense, sparse=with_sparse)
            for r in records
        ]

    def scroll(self, name: str, *, flt: SearchFilter | None = None) -> Iterator[Record]:
        offset: Any = None
        while True:
            with self._call(name):
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
        if flt.where is not None:
            must.append(_server_condition(flt.where))
        return qm.Filter(must=must)

    def close(self) -> None:
        self.client.close()


def _server_condition(condition: conditions.Condition) -> Any:
    """A metadata condition as qdrant-client's filter model (rag_retriever/conditions.py)."""
    from qdrant_client import models as qm

    if isinstance(condition, conditions.Match):
        key = metadata_path(condition.field)
        if len(condition.values) == 1:
            return qm.FieldCondition(key=key, match=qm.MatchValue(value=condition.values[0]))
        if isinstance(condition.values[0], bool):  # MatchAny takes strings or integers
            return qm.Filter(
                should=[
                    qm.FieldCondition(key=key, match=qm.MatchValue(value=v))
                    for v in condition.values
                ]
            )
        values: Any = list(condition.values)  # one kind: strings or integers
        return qm.FieldCondition(key=key, match=qm.MatchAny(any=values))
    if isinstance(condition, conditions.Range):
        bounds = {b: getattr(condition, b) for b in conditions.BOUNDS}
        return qm.FieldCondition(key=metadata_path(condition.field), range=qm.Range(**bounds))
    if isinstance(condition, conditions.Not):
        return qm.Filter(must_not=[_server_condition(condition.condition)])
    parts = [_server_condition(c) for c in condition.conditions]
    if isinstance(condition, conditions.All):
        return qm.Filter(must=parts)
    return qm.Filter(should=parts)


def _server_quantization(quantization: Quantization) -> Any:
    """The Qdrant server's quantization config of a version's dense vectors (None: float32)."""
    from qdrant_client import models as qm

    if quantization == "int8":
        return qm.ScalarQuantization(
            scalar=qm.ScalarQuantizationConfig(type=qm.ScalarType.INT8, always_ram=True)
        )
    if quantization == "binary":
        return qm.BinaryQuantization(binary=qm.BinaryQuantizationConfig(always_ram=True))
    return None
