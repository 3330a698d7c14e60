"""A Qdrant server or cluster through qdrant-client (`RAG_QDRANT_URL`): versions as filters over
one physical collection, so an edit writes only the points it changes.

Example:
    >>> store = ServerStore(QdrantClient(url="http://qdrant:6333"))     # doctest: +SKIP

Layout on the server:

    rag_retriever_catalog              one point a version (its record, its BM25 table
                                       and the changes since it, physical collection and
                                       visible versions),
                                       one an alias (the version it serves), one an alias's
                                       counter (the highest version number ever given)
    <alias>__<slug>__v<N>__points      the points of version N, a full build, and of every
                                       version derived from it (the same model, chunking and
                                       quantization)
    <alias>__<slug>__v<N>__points__terms   BM25 document frequency tables (server_terms.py)
    <alias>__<slug>__v<N>__points__where   per logical id a derived version wrote, the numbers
                                       of the versions that wrote it: a lookup by logical id
                                       reads points by their physical ids, never a scan

Each point carries the logical id the writer gave it (`_rag_pid`), the version that added it
(`_rag_added`) and the versions that removed it (`_rag_removed`); its physical id is made of
both, so two versions can hold different texts of one chunk id. A version sees the points that
one of its ancestors (itself included) added and none of them removed: its ancestry is a few
runs of version numbers (one run while each version derives from the one before; a new run after
a rollback or a failed build), so the visibility filter is a few integer ranges however many
deltas there were. A delta (`derive`) writes its catalog point, marks the points it drops as
removed by it (their payload only), notes its number on the "where" points of the ids it
writes and adds its own points: a 10-document edit writes about three times its chunks, never
the corpus (bench/bench_update.py, docs/versions.md). Marking and reading by logical id looks
up the candidates (the full build's point and those of the versions on the id's "where" point)
by physical id and keeps the ones the version sees. A sealed version stores its point count
(a derived one's kept from its writes), so counting it reads one catalog point. Readers of other
versions are not affected: the new version's number is outside their ancestry.

Serving an alias is one catalog point replaced in one call, so a reader sees the old or the new
version; a rollback moves it back. Deleting a version (retention, orphans) deletes its catalog
point, then every point no remaining version sees (one delete by filter on the server, which
leaves the points of versions numbered past the ones it listed: a writer in another process
may be filling one); the physical collection goes with its last version. A process killed
mid-write leaves a `building` version whose points the next write's orphan removal deletes the
same way.

On a real cluster (never run here; the tests use qdrant-client's in-process implementation of
the server API, which has no payload indexes, replication or quantization): the visibility
fields are integer and keyword payload indexes; a write waits for `write_consistency_factor`
replicas; a catalog point is read on every query after ENTRY_TTL_S, so a deleted version stops
answering within that time (retention's grace period is far longer). docs/versions.md says
what would differ with shard keys and replication.

Why one module: `ServerStore` is the `Store` contract on one engine, and every method reads or
writes the one layout above (the catalog, a physical collection and its "where" collection)
through the same calls, errors and caches; split, each part would need the others' catalog and
lookup helpers. What is pure moved out: the visibility fields, ancestry and filters are
store/visibility.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rag_retriever import conditions
from rag_retriever.errors import CollectionNotFound, StoreUnavailable
from rag_retriever.models.bm25 import DocFreqs, SparseVector
from rag_retriever.records import TENANT_FIELD, UNQUANTIZED, Quantization, SearchFilter
from rag_retriever.store.base import (
    DENSE,
    HNSW_EF_CONSTRUCT,
    HNSW_EF_PER_RESULT,
    QDRANT_EF_CONSTRUCT,
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
from rag_retriever.store.server_terms import TABLE, TERMS_SUFFIX, ServerTermTable, write_table
from rag_retriever.store.terms import REBASE_FRACTION
from rag_retriever.store.visibility import (
    ADDED,
    NAMESPACE,
    PID,
    REMOVED,
    Runs,
    ancestry,
    gaps,
    point_id,
    sees,
    visible,
    where_id,
    within,
)

CATALOG: Final = "rag_retriever_catalog"
_VISIBILITY_INDEXES: Final[dict[str, IndexKind]] = {
    PID: "keyword",
    ADDED: "integer",
    REMOVED: "integer",
}
# How long a process trusts what it read of a version's catalog point before reading it again.
ENTRY_TTL_S: Final = 1.0
# Ids per call when points are looked up or marked by logical id.
ID_BATCH: Final = 1024
# Beside each physical collection (made with it): per logical id written by a derived version,
# the numbers of the versions that wrote it (its "where" point), so a lookup by logical id is a
# lookup of physical ids, never a filtered scan of the collection.
WHERE_SUFFIX: Final = "__where"
WRITERS: Final = "n"


@dataclass(frozen=True)
class _Version:
    """What a query needs of a version: where its points are and which versions it sees."""

    name: str
    alias: str
    physical: str
    number: int
    runs: Runs
    # whether the physical collection has its "where" collection (made since 0.5; older ones
    # are read with filters)
    located: bool = False
    # how its dense vectors are held (the record's; a quantized search oversamples by it)
    quantization: Quantization = UNQUANTIZED
    # the width its physical collection's graph was built at (None: not recorded)
    ef_construct: int | None = None

    @property
    def base(self) -> int:
        """The number of the full build that made the physical collection."""
        return self.runs[0][0]


def _catalog_id(kind: str, name: str) -> str:
    return str(uuid.uuid5(NAMESPACE, f"{kind}:{name}"))


def _strip(payload: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (payload or {}).items() if k not in _VISIBILITY_INDEXES}


class ServerStore(Store):
    """Versions on a Qdrant server or cluster; stateless on the local machine."""

    def __init__(
        self,
        client: Any,
        *,
        shard_number: int | None = None,
        replication_factor: int | None = None,
        write_consistency_factor: int | None = None,
        ef_construct: int = HNSW_EF_CONSTRUCT,
        where: str | None = None,
        catalog: str = CATALOG,
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
        self.ef_construct = ef_construct  # how wide a new version's HNSW graph is built
        self.catalog = catalog
        # qdrant-client's in-process implementation is not thread-safe; a server is.
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self.embedded else contextlib.nullcontext()
        )
        self._entries: dict[str, tuple[float, _Version]] = {}
        # Per derived version being written through this store: the points it sees, kept from
        # the engine's answers (its parent's count, less the points it marked, plus the points
        # it added), stored with it at seal so that counting it never scans the collection.
        self._seen: dict[str, int] = {}
        # BM25 tables read (collection, table) -> table: a table never changes, so what it
        # read is kept for every version that shares it
        self._tables: dict[tuple[str, str], ServerTermTable] = {}
        self._catalog_seen = False

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

    # -- the catalog --------------------------------------------------------------------------

    def _has_catalog(self) -> bool:
        """Whether the catalog exists; once seen, it is taken to stay (one request less on
        every query's alias lookup)."""
        if not self._catalog_seen:
            with self._call():
                self._catalog_seen = bool(self.client.collection_exists(self.catalog))
        return self._catalog_seen

    def _ensure_catalog(self) -> None:
        if self._has_catalog():
            return
        from qdrant_client import models as qm

        try:
            with self._call():
                self.client.create_collection(
                    self.catalog,
                    vectors_config={},
                    replication_factor=self.replication_factor,
                    write_consistency_factor=self.write_consistency_factor,
                )
        except StoreUnavailable:
            with self._call():  # another writer made it first
                if not self.client.collection_exists(self.catalog):
                    raise
        self._catalog_seen = True
        if not self.embedded:
            for key in ("kind", "alias", "physical"):
                with self._call():
                    self.client.create_payload_index(
                        self.catalog, key, qm.PayloadSchemaType.KEYWORD, wait=True
                    )

    def _catalog_scroll(self, kind: str, fields: Sequence[str], **match: str) -> Iterator[Any]:
        from qdrant_client import models as qm

        if not self._has_catalog():
            return
        must: list[Any] = [
            qm.FieldCondition(key=k, match=qm.MatchValue(value=v))
            for k, v in {"kind": kind, **match}.items()
        ]
        offset: Any = None
        while True:
            with self._call():
                points, offset = self.client.scroll(
                    self.catalog,
                    scroll_filter=qm.Filter(must=must),
                    limit=1024,
                    offset=offset,
                    with_payload=list(fields),
                )
            yield from (p.payload or {} for p in points)
            if offset is None:
                return

    def _catalog_get(self, kind: str, name: str, fields: Sequence[str]) -> dict[str, Any] | None:
        if not self._has_catalog():
            return None
        with self._call():
            found = self.client.retrieve(
                self.catalog, ids=[_catalog_id(kind, name)], with_payload=list(fields)
            )
        return dict(found[0].payload or {}) if found else None

    def _catalog_put(self, kind: str, name: str, payload: Mapping[str, Any]) -> None:
        """Replace one catalog point: one call, so a reader sees it whole or not at all."""
        from qdrant_client import models as qm

        self._ensure_catalog()
        with self._call():
            self.client.upsert(
                self.catalog,
                points=[
                    qm.PointStruct(
                        id=_catalog_id(kind, name), vector={}, payload={"kind": kind, **payload}
                    )
                ],
                wait=True,
            )

    def _catalog_set(self, name: str, payload: Mapping[str, Any]) -> None:
        """Set some keys of a version's catalog point (the others are kept)."""
        self._entry(name, fresh=True)  # CollectionNotFound when it is gone
        with self._call(name):
            self.client.set_payload(
                self.catalog,
                payload=dict(payload),
                points=[_catalog_id("version", name)],
                wait=True,
            )

    def _entry(self, name: str, *, fresh: bool = False) -> _Version:
        cached = self._entries.get(name)
        if cached is not None and not fresh and time.monotonic() - cached[0] < ENTRY_TTL_S:
            return cached[1]
        found = self._catalog_get(
            # the record's one key: its whole (up to 10,000 changed ids) is not read each second
            "version",
            name,
            ("alias", "physical", "number", "runs", "located", "meta.quantization", "ef_construct"),
        )
        if found is None:
            self._entries.pop(name, None)
            raise CollectionNotFound(f"collection {name!r} no longer exists")
        entry = _Version(
            name,
            found["alias"],
            found["physical"],
            int(found["number"]),
            tuple((int(lo), int(hi)) for lo, hi in found["runs"]),
            bool(found.get("located")),
            (found.get("meta") or {}).get("quantization") or UNQUANTIZED,
            None if found.get("ef_construct") is None else int(found["ef_construct"]),
        )
        self._entries[name] = (time.monotonic(), entry)
        return entry

    def _new_version(
        self,
        name: str,
        record: VersionRecord,
        physical: str,
        runs: Runs,
        *,
        located: bool,
        ef_construct: int | None,
    ) -> None:
        counter = self._catalog_get("counter", record.alias, ("number",)) or {}
        self._catalog_put(
            "counter", record.alias, {"number": max(record.version, int(counter.get("number", 0)))}
        )
        self._catalog_put(
            "version",
            name,
            {
                "name": name,
                "alias": record.alias,
                "physical": physical,
                "number": record.version,
                "runs": [list(r) for r in runs],
                "located": located,
                # the width its physical collection's graph was built at (None: made by an
                # earlier rag-retriever, which did not record it)
                "ef_construct": ef_construct,
                "meta": record.to_json(),
                "doc_freqs": {},
            },
        )
        self._entries.pop(name, None)

    # -- the Store contract -------------------------------------------------------------------

    def collection_names(self) -> list[str]:
        return sorted(p["name"] for p in self._catalog_scroll("version", ("name",)))

    def exists(self, name: str) -> bool:
        return self._catalog_get("version", name, ("name",)) is not None

    def aliases(self) -> dict[str, str]:
        return {p["alias"]: p["name"] for p in self._catalog_scroll("alias", ("alias", "name"))}

    def graph_widths(self, name: str) -> tuple[int, ...] | None:
        """As the catalog recorded it when the physical collection was made (qdrant-client's
        in-process server reports every collection at the default width, so it is not asked)."""
        width = self._entry(name).ef_construct
        return None if width is None else (width,)

    def resolve(self, alias_or_name: str) -> str:
        """One catalog point read by id for an alias (a query's lookup), else the contract's."""
        found = self._catalog_get("alias", alias_or_name, ("name",))
        return str(found["name"]) if found is not None else super().resolve(alias_or_name)

    def next_version(self, alias: str) -> int:
        """Past every number ever given: a deleted version's removal marks stay on points, so
        its number is never given again."""
        counter = self._catalog_get("counter", alias, ("number",)) or {}
        return max(super().next_version(alias), int(counter.get("number", 0)) + 1)

    def read_meta(self, name: str) -> dict[str, Any]:
        found = self._catalog_get("version", name, ("meta",))
        if found is None:
            raise CollectionNotFound(f"collection {name!r} no longer exists")
        return dict(found.get("meta") or {})

    def write_meta(self, name: str, meta: Mapping[str, Any]) -> None:
        self._catalog_set(name, {"meta": dict(meta)})

    def doc_freqs(self, name: str) -> Mapping[str, int]:
        """A table the version shares with others and its changes since it (server_terms.py),
        or (a version made before tables, 0.4) one dict kept whole in its catalog entry."""
        found = self._catalog_get("version", name, ("doc_freqs", "terms", "physical"))
        if found is None:
            raise CollectionNotFound(f"collection {name!r} no longer exists")
        terms = found.get("terms")
        if not terms:
            return dict(found.get("doc_freqs") or {})
        key = (str(found["physical"]) + TERMS_SUFFIX, str(terms["table"]))
        table = self._tables.get(key)
        if table is None:
            table = ServerTermTable(
                self.client, lambda: self._call(name), *key, int(terms["table_size"])
            )
            self._tables[key] = table
        return DocFreqs(
            table,
            {str(t): int(n) for t, n in terms["changes"].items()},
            int(terms["size"]),
            {int(df): int(n) for df, n in terms["histogram"]},
        )

    def put_doc_freqs(self, name: str, doc_freqs: Mapping[str, int]) -> None:
        """The changes since the table the frequencies are layered on, or (a full build's,
        changes past REBASE_FRACTION of the table, a version made before tables) a new table."""
        entry = self._entry(name)
        if not entry.located:  # a physical collection made before tables (0.4)
            self._catalog_set(name, {"doc_freqs": dict(doc_freqs.items())})
            return
        collection = entry.physical + TERMS_SUFFIX
        base = doc_freqs.base if isinstance(doc_freqs, DocFreqs) else None
        if (
            isinstance(doc_freqs, DocFreqs)
            and isinstance(base, ServerTermTable)
            and base.collection == collection
            and len(doc_freqs.changes) <= REBASE_FRACTION * max(len(base), 1)
        ):
            table, table_size, size = base.table, len(base), len(doc_freqs)
            changes, histogram = dict(doc_freqs.changes), doc_freqs.histogram
        else:
            table = name
            table_size, histogram = write_table(
                self.client, lambda: self._call(name), collection, table, doc_freqs.items()
            )
            changes, size = {}, table_size
        terms = {
            "table": table,
            "table_size": table_size,
            "changes": changes,
            "size": size,
            "histogram": sorted(histogram.items()),
        }
        self._catalog_set(name, {"terms": terms, "terms_table": table, "doc_freqs": {}})

    def create(self, name: str, dim: int, record: VersionRecord) -> None:
        """A full build: a new physical collection, which the versions derived from it share.
        The catalog point comes first, so a build killed at any step is an orphan to remove."""
        from qdrant_client import models as qm

        physical = f"{name}__points"
        self._new_version(
            name,
            record,
            physical,
            ((record.version, record.version),),
            located=True,
            ef_construct=self.ef_construct,
        )
        with self._call():
            self.client.create_collection(
                physical,
                vectors_config={
                    DENSE: qm.VectorParams(
                        size=dim,
                        distance=qm.Distance.COSINE,
                        on_disk=True if record.quantization != "none" else None,
                    )
                },
                sparse_vectors_config={SPARSE: qm.SparseVectorParams()},
                quantization_config=_server_quantization(record.quantization),
                # the server's own default unless another width is asked for
                hnsw_config=None
                if self.ef_construct == QDRANT_EF_CONSTRUCT
                else qm.HnswConfigDiff(ef_construct=self.ef_construct),
                shard_number=self.shard_number,
                replication_factor=self.replication_factor,
                write_consistency_factor=self.write_consistency_factor,
            )
            for beside in (WHERE_SUFFIX, TERMS_SUFFIX):
                self.client.create_collection(
                    physical + beside,
                    vectors_config={},
                    shard_number=self.shard_number,
                    replication_factor=self.replication_factor,
                    write_consistency_factor=self.write_consistency_factor,
                )
        self._index(physical, _VISIBILITY_INDEXES)
        self._index(physical + TERMS_SUFFIX, {TABLE: "keyword"})

    def derive(self, name: str, base: str, record: VersionRecord, drop: Iterable[str]) -> None:
        """A version over `base`'s physical collection: its catalog point, then a removal mark
        on the points it drops. Nothing of the base is copied."""
        parent = self._entry(base, fresh=True)
        runs = ancestry(parent.runs, parent.number, record.version)
        seen = self.count(base) if parent.located else None
        self._new_version(
            name,
            record,
            parent.physical,
            runs,
            located=parent.located,
            ef_construct=parent.ef_construct,
        )
        marked = self._mark_removed(parent, record.version, sorted(set(drop)))
        if seen is not None:
            self._seen[name] = seen - marked

    def _writers(self, entry: _Version, pids: Sequence[str]) -> dict[str, list[int]]:
        """The numbers of the derived versions that wrote each of these logical ids (its "where"
        point; a full build's writes are implied by the physical collection)."""
        by_id: dict[str, list[int]] = {}
        for start in range(0, len(pids), ID_BATCH):
            with self._call(entry.name):
                found = self.client.retrieve(
                    entry.physical + WHERE_SUFFIX,
                    ids=[where_id(pid) for pid in pids[start : start + ID_BATCH]],
                    with_payload=[WRITERS],
                )
            by_id.update(
                (str(p.id), [int(n) for n in (p.payload or {}).get(WRITERS) or ()]) for p in found
            )
        return {pid: by_id.get(where_id(pid), []) for pid in pids}

    def _located(
        self,
        entry: _Version,
        pids: Sequence[str],
        *,
        payload: Any,
        vectors: Any = False,
        writers: Mapping[str, Sequence[int]] | None = None,
    ) -> list[Any]:
        """The points `entry` sees of these logical ids, read by physical id: each one's
        candidates are the full build's point and those of the versions that wrote it since
        (`writers`, read here when not given)."""
        if writers is None:
            writers = self._writers(entry, pids)
        ids = [
            point_id(pid, n)
            for pid in pids
            for n in sorted({entry.base, *writers[pid]})
            if within(entry.runs, n)
        ]
        points: list[Any] = []
        for start in range(0, len(ids), ID_BATCH):
            with self._call(entry.name):
                points += self.client.retrieve(
                    entry.physical,
                    ids=ids[start : start + ID_BATCH],
                    with_payload=payload,
                    with_vectors=vectors,
                )
        return [p for p in points if sees(entry.runs, p.payload or {})]

    def _note_writer(self, entry: _Version, writers: Mapping[str, Sequence[int]]) -> None:
        """Add `entry`'s number to these logical ids' "where" points (`writers`, as read), before
        their points are written: a "where" point lists every version that may hold one, and
        maybe more."""
        from qdrant_client import models as qm

        points = [
            qm.PointStruct(
                id=where_id(pid), vector={}, payload={WRITERS: sorted({*found, entry.number})}
            )
            for pid, found in writers.items()
            if entry.number not in found
        ]
        if points:
            with self._call(entry.name):
                self.client.upsert(entry.physical + WHERE_SUFFIX, points=points, wait=True)

    def _mark_removed(
        self, entry: _Version, number: int, pids: Sequence[str], *, skip_own: bool = False
    ) -> int:
        """Mark the points with these logical ids that `entry` sees as removed by `number`;
        how many there were."""
        if not entry.located:
            return self._mark_removed_by_filter(
                entry.physical, entry.runs, number, pids, skip_own=skip_own
            )
        found = self._located(entry, pids, payload=[ADDED, REMOVED])
        return self._set_removed(
            entry.physical,
            number,
            [p for p in found if not (skip_own and (p.payload or {})[ADDED] == number)],
        )

    def _set_removed(self, physical: str, number: int, points: Sequence[Any]) -> int:
        """Add `number` to these points' removal marks (one call per set of earlier marks);
        how many points."""
        marks: dict[tuple[int, ...], list[str]] = {}
        for p in points:
            removed = tuple((p.payload or {}).get(REMOVED) or ())
            marks.setdefault(removed, []).append(str(p.id))
        for removed, ids in marks.items():
            with self._call(physical):
                self.client.set_payload(
                    physical, payload={REMOVED: [*removed, number]}, points=ids, wait=True
                )
        return len(points)

    def _mark_removed_by_filter(
        self, physical: str, runs: Runs, number: int, pids: Sequence[str], *, skip_own: bool
    ) -> int:
        """`_mark_removed` on a physical collection made before "where" points (0.4)."""
        from qdrant_client import models as qm

        marked = 0
        found: list[Any]
        for start in range(0, len(pids), ID_BATCH):
            # the selective condition first: an engine without indexes checks it first
            must = [
                qm.FieldCondition(
                    key=PID, match=qm.MatchAny(any=list(pids[start : start + ID_BATCH]))
                ),
                visible(runs),
            ]
            must_not: list[Any] = (
                [qm.FieldCondition(key=ADDED, match=qm.MatchValue(value=number))]
                if skip_own
                else []
            )
            found = []
            offset: Any = None
            while True:
                with self._call(physical):
                    points, offset = self.client.scroll(
                        physical,
                        scroll_filter=qm.Filter(must=must, must_not=must_not),
                        limit=ID_BATCH,
                        offset=offset,
                        with_payload=[REMOVED],
                    )
                found += points
                if offset is None:
                    break
            marked += self._set_removed(physical, number, found)
        return marked

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
        entry = self._entry(name)
        if entry.runs != ((entry.number, entry.number),) and not entry.located:
            self._mark_removed(entry, entry.number, list(ids), skip_own=True)
        elif entry.runs != ((entry.number, entry.number),):
            # a derived version replaces what its ancestors hold under these ids; what it holds
            # of them already (a write tried again) is among the candidates and stays
            writers = self._writers(entry, ids)
            self._note_writer(entry, writers)
            found = self._located(entry, ids, payload=[ADDED, REMOVED], writers=writers)
            theirs = [p for p in found if (p.payload or {})[ADDED] != entry.number]
            marked = self._set_removed(entry.physical, entry.number, theirs)
            if name in self._seen:  # the points it adds, less those it marks
                self._seen[name] += len(set(ids)) - (len(found) - len(theirs)) - marked
        points = [
            qm.PointStruct(
                id=point_id(pid, entry.number),
                vector={
                    DENSE: vec.tolist(),
                    SPARSE: qm.SparseVector(indices=list(sp.indices), values=list(sp.values)),
                },
                payload={**payload, PID: pid, ADDED: entry.number, REMOVED: []},
            )
            for pid, vec, sp, payload in zip(ids, dense, sparse, payloads, strict=True)
        ]
        with self._call(name):
            self.client.upsert(entry.physical, points=points, wait=True)

    def seal(self, name: str, indexes: Mapping[str, IndexKind], *, merge_base: bool = True) -> None:
        """Payload indexes, then the count of points the version sees, stored with it: a
        derived version's kept from its writes, a full build's counted once here."""
        entry = self._entry(name)
        self._index(entry.physical, indexes)
        seen = self._seen.pop(name, None)
        if seen is None and entry.located and entry.runs == ((entry.number, entry.number),):
            seen = self._count(entry)
        if seen is not None:
            self._catalog_set(name, {"points": seen})

    def _index(self, physical: str, indexes: Mapping[str, IndexKind]) -> None:
        """Payload indexes (path -> kind) the physical collection does not have yet."""
        from qdrant_client import models as qm

        if self.embedded:  # qdrant-client's local mode has no payload indexes (it warns)
            return
        kinds = {
            "keyword": qm.PayloadSchemaType.KEYWORD,
            "integer": qm.PayloadSchemaType.INTEGER,
            "bool": qm.PayloadSchemaType.BOOL,
        }
        with self._call(physical):
            have = set(self.client.get_collection(physical).payload_schema or {})
        for path, kind in indexes.items():
            if path in have:
                continue
            schema: Any = kinds[kind]
            if path == metadata_path(TENANT_FIELD) and kind == "keyword":
                # Qdrant's tenant index: points of one tenant stored together, so a tenant's
                # search reads its own points (docs/tenants.md)
                schema = qm.KeywordIndexParams(type=qm.KeywordIndexType.KEYWORD, is_tenant=True)
            with self._call(physical):
                self.client.create_payload_index(physical, path, schema, wait=True)

    def delete(self, name: str) -> None:
        """The version's catalog point, then the points no remaining version sees."""
        try:
            entry = self._entry(name, fresh=True)
        except CollectionNotFound:
            return
        table = (self._catalog_get("version", name, ("terms_table",)) or {}).get("terms_table")
        with self._call():
            self.client.delete(
                self.catalog, points_selector=[_catalog_id("version", name)], wait=True
            )
        self._entries.pop(name, None)
        if self._sweep(entry.physical) and entry.located:  # (0.4 made no tables)
            # the table it named, or (killed before naming one) the one it may have been
            # writing: a table is named after the version that writes it
            self._drop_table(entry.physical, str(table or name))

    def _drop_table(self, physical: str, table: str) -> None:
        """The points of a BM25 table no remaining version names."""
        from qdrant_client import models as qm

        named = {
            p.get("terms_table")
            for p in self._catalog_scroll("version", ("terms_table",), physical=physical)
        }
        if table in named:
            return
        self._tables.pop((physical + TERMS_SUFFIX, table), None)
        with self._call():
            self.client.delete(
                physical + TERMS_SUFFIX,
                points_selector=qm.FilterSelector(
                    filter=qm.Filter(
                        must=[qm.FieldCondition(key=TABLE, match=qm.MatchValue(value=table))]
                    )
                ),
                wait=True,
            )

    def _sweep(self, physical: str) -> bool:
        """Delete the points no remaining version of `physical` sees; whether any remains (if
        none, the physical collection and those beside it go)."""
        from qdrant_client import models as qm

        kept = [
            (int(p["number"]), tuple((int(lo), int(hi)) for lo, hi in p["runs"]))
            for p in self._catalog_scroll("version", ("number", "runs"), physical=physical)
        ]
        if not kept:
            with self._call():
                for beside in ("", WHERE_SUFFIX, TERMS_SUFFIX):
                    self.client.delete_collection(physical + beside)
            return False
        # Points of versions numbered past these (a writer filling one now) are left alone.
        newest = max(number for number, _ in kept)
        # A point no kept version sees was marked removed, or added by a version none of them
        # descends from: the `should` a server answers from its indexes, not by a scan.
        candidates: list[Any] = [qm.FieldCondition(key=REMOVED, range=qm.Range(gte=0))] + [
            qm.FieldCondition(key=ADDED, range=qm.Range(gte=lo, lte=hi))
            for lo, hi in gaps([r for _, runs in kept for r in runs], newest)
        ]
        unseen = qm.Filter(
            must=[
                qm.FieldCondition(key=ADDED, range=qm.Range(lte=newest)),
                qm.Filter(should=candidates),
            ],
            must_not=[visible(runs) for _, runs in kept],
        )
        with self._call(physical):
            self.client.delete(
                physical, points_selector=qm.FilterSelector(filter=unseen), wait=True
            )
        return True

    def point_alias(self, alias: str, name: str) -> None:
        """One catalog point replaced in one call: a reader sees the old or the new target."""
        self._entry(name, fresh=True)
        self._catalog_put("alias", alias, {"alias": alias, "name": name})

    def count(self, name: str) -> int:
        """A sealed version's stored count, else the points its visibility filter matches."""
        found = self._catalog_get("version", name, ("points",))
        if found is None:
            raise CollectionNotFound(f"collection {name!r} no longer exists")
        if found.get("points") is not None:
            return int(found["points"])
        return self._count(self._entry(name))

    def _count(self, entry: _Version) -> int:
        with self._call(entry.name):
            return int(
                self.client.count(
                    entry.physical, count_filter=visible(entry.runs), exact=True
                ).count
            )

    def search(self, name: str, queries: Sequence[StageQuery]) -> list[list[tuple[str, float]]]:
        from qdrant_client import models as qm

        entry = self._entry(name)
        over = QUANTIZATION_OVERSAMPLING.get(entry.quantization)
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
                    filter=self._scope(entry, q.flt),
                    # local mode searches exactly (and warns about HNSW parameters)
                    params=qm.SearchParams(
                        hnsw_ef=HNSW_EF_PER_RESULT * q.limit,
                        quantization=None
                        if over is None
                        else qm.QuantizationSearchParams(rescore=True, oversampling=over),
                    )
                    if q.using == DENSE and not self.embedded
                    else None,
                    with_payload=[PID],
                    with_vector=False,
                )
            )
        if not requests:
            return []
        with self._call(name):
            responses = self.client.query_batch_points(entry.physical, requests=requests)
        return [
            best_first((str((p.payload or {})[PID]), float(p.score)) for p in r.points)
            for r in responses
        ]

    def retrieve(
        self,
        name: str,
        ids: Sequence[str],
        *,
        with_dense: bool = False,
        with_sparse: bool = False,
        with_payload: bool = True,
    ) -> list[Record]:
        wanted = sorted(set(ids))
        if not wanted:
            return []
        entry = self._entry(name)
        vectors = [v for v, asked in ((DENSE, with_dense), (SPARSE, with_sparse)) if asked]
        out: list[Record] = []
        for start in range(0, len(wanted), ID_BATCH):
            batch = wanted[start : start + ID_BATCH]
            if entry.located:
                points = self._located(
                    entry,
                    batch,
                    payload=True if with_payload else [PID, ADDED, REMOVED],
                    vectors=vectors or False,
                )
            else:
                points = self._retrieve_by_filter(entry, batch, with_payload, vectors)
            for p in points:
                payload = p.payload or {}
                out.append(
                    make_record(
                        payload[PID],
                        _strip(payload) if with_payload else {},
                        p.vector,
                        dense=with_dense,
                        sparse=with_sparse,
                    )
                )
        return out

    def _retrieve_by_filter(
        self, entry: _Version, batch: list[str], with_payload: bool, vectors: list[str]
    ) -> list[Any]:
        """`retrieve` on a physical collection made before "where" points (0.4)."""
        from qdrant_client import models as qm

        with self._call(entry.name):
            points, _ = self.client.scroll(
                entry.physical,
                scroll_filter=qm.Filter(
                    must=[
                        qm.FieldCondition(key=PID, match=qm.MatchAny(any=batch)),
                        visible(entry.runs),
                    ]
                ),
                limit=len(batch),
                with_payload=True if with_payload else [PID],
                with_vectors=vectors or False,
            )
        return list(points)

    def scroll(self, name: str, *, flt: SearchFilter | None = None) -> Iterator[Record]:
        entry = self._entry(name)
        offset: Any = None
        while True:
            with self._call(name):
                records, offset = self.client.scroll(
                    entry.physical,
                    limit=1024,
                    offset=offset,
                    scroll_filter=self._scope(entry, flt),
                    with_payload=True,
                    with_vectors=False,
                )
            for r in records:
                payload = r.payload or {}
                yield Record(str(payload[PID]), _strip(payload))
            if offset is None:
                return

    def _scope(self, entry: _Version, flt: SearchFilter | None) -> Any:
        """The version's visibility AND the request's filter."""
        from qdrant_client import models as qm

        asked = self._filter(flt)
        return qm.Filter(must=([asked] if asked is not None else []) + [visible(entry.runs)])

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
    if quantization == "binary2":
        return qm.BinaryQuantization(
            binary=qm.BinaryQuantizationConfig(
                always_ram=True,
                encoding=qm.BinaryQuantizationEncoding.TWO_BITS,
                query_encoding=qm.BinaryQuantizationQueryEncoding.SCALAR8BITS,
            )
        )
    return None
