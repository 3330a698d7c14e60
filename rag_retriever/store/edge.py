"""Qdrant Edge, the embedded default: a version is an immutable manifest of shards.

Example:
    >>> store = EdgeStore(Path("rag-data/edge"))                        # doctest: +SKIP
    >>> store.derive("docs__m-384__v4", "docs__m-384__v3", record, drop=changed_ids)  # doctest: +SKIP

Edge has no collections or aliases. Layout under `root`:

    collections/<name>/meta.json       the version record (status building -> complete)
    collections/<name>/manifest.json   the shards it reads, each with the ids it no longer serves
    collections/<name>/terms.sqlite    its BM25 document frequencies: a full build's table,
                                       hard-linked into the versions made from it by deltas
    collections/<name>/term_changes.json  the frequencies changed since that table (terms.py)
    segments/<alias>--<id>/            one Edge shard (no WAL): written by one version, then
                                       read-only, shared by every version whose manifest names it
    aliases/<alias>.json               {"collection": <name>}, replaced atomically
    compactions/<alias>.json           a running compaction's marker (flock-held by its process)

LSM-style versions. A full build writes one shard, or past `shard_points` (RAG_BASE_SHARD_POINTS)
several base shards, each flushed and closed when full and sealed alone (by a process of its
own: edge_writer.seal_apart), so a build holds one shard's memory at a time (the manifest's
`bases` counts them; the merge policy reads them as one base, and a query asks each in turn).
A delta (`derive`) writes a manifest that names
the base version's shards, adds the ids it replaces or deletes to their tombstones, and one new
shard for what it adds; the base's shards and their HNSW graphs are never rewritten, so a small
delta costs what it changes, whatever the corpus size. A query runs one batched call per shard
(over-fetching past the shard's tombstones) and merges the lists best score first, dropping
tombstoned ids: dense scores are cosines and BM25's IDF is on the query side, so scores from
different shards compare. The first shard is asked for the whole limit; once it has filled it,
each other shard is asked only for its share of the answer with room to spare (SHARE_OVERASK)
and above the first shard's last score, and a shard whose share ran short is asked again in full
(`_merge_lists`), so the answer is the one whole asks would give. Delta
shards are merged like a binary counter (MERGE_RATIO, at most MAX_DELTA_SHARDS; cost: the deltas'
points); when the deltas hold more than BASE_MERGE_FRACTION of the base, everything is merged
into a new base (a full HNSW build, vectors copied, nothing re-encoded). Either merge runs
inside the write (`seal(merge_base=True)`), or, off the write path, the write does only merges
of at most INLINE_MERGE_POINTS and leaves the rest to a compaction (`begin_compaction` ->
`build_compaction` without a lock -> `adopt_compaction` onto whatever version serves by then;
driven by rag_retriever/ingest/compaction.py), which merges all shards into a new base or the
newest delta shards into one. A running compaction holds a lock on its marker
(compactions/<alias>.json, naming the shards it merges and the shard it writes): retention keeps
that shard, and writes leave those shards and the ones before them unmerged, until the marker
is let go.

Readers: any number of processes open sealed shards at once; shards are opened on first use and
kept open (a serving process keeps the base shard open across deltas). Retention deletes a
version's directory (renamed out of sight first), then every shard of that alias that no kept
manifest names. A process killed at any step leaves a `building` version and maybe an unnamed
shard: the next write of the alias removes both.

Does not do: replication, or writes from two processes to one version (the writer holds the
alias's lock).

Why one module: `EdgeStore` is the `Store` contract on one engine, and every method reads or
writes the one layout above (version directories, manifests, shard directories, the alias and
marker files) through one cache of open shards; split, each part would need the others'
private file and shard handling. What is pure moved out: the manifest, its merge policy and the
ranked-list merging are store/shards.py, the BM25 table store/terms.py, atomic files
store/files.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import heapq
import json
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from rag_retriever import conditions
from rag_retriever.errors import CollectionNotFound, ConfigError, InvalidRequest
from rag_retriever.models.bm25 import DocFreqs, SparseVector
from rag_retriever.records import ALIAS_PATTERN, Quantization, SearchFilter, check_alias
from rag_retriever.store.base import (
    DENSE,
    HNSW_EF_CONSTRUCT,
    HNSW_EF_PER_RESULT,
    HNSW_FULL_SCAN_KB,
    HNSW_M,
    QDRANT_EF_CONSTRUCT,
    QUANTIZATION_OVERSAMPLING,
    SPARSE,
    IndexKind,
    Record,
    StageQuery,
    Store,
    best_first,
    check_lengths,
    engine_errors,
    make_record,
    metadata_path,
    parse_collection_name,
)
from rag_retriever.store.edge_writer import ShardWriter, engine_points, seal_apart
from rag_retriever.store.files import read_json, write_atomic
from rag_retriever.store.record import VersionRecord
from rag_retriever.store.shards import (
    BASE_SHARD_POINTS,
    Compaction,
    Manifest,
    Segment,
    base_shards,
    limited,
    live_head,
    merge_due,
    merge_from,
    outgrown,
    ranked,
    too_many_deltas,
)
from rag_retriever.store.terms import read_doc_freqs, write_doc_freqs

log = logging.getLogger(__name__)

# What a version's directory or a shard may be called: a plain file name that cannot leave the
# store.
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# With compaction off the write path (`seal(merge_base=False)`), an update merges delta shards
# itself only while the merge holds at most this many points (a copy and an HNSW build of ~1-2 s
# on 2 cores); a bigger merge of delta shards, like a base merge, is left to a compaction, so no
# update waits on one. Measured at 100k chunks with every delta merge inside the update: 100
# successive 1% deltas p50 1.68 s, max 36.3 s (the updates that merged piled-up delta shards).
INLINE_MERGE_POINTS = 4_000
# Where a shard keeps its sparse (BM25) index and payload indexes: memory-mapped and paged in on
# use (Qdrant's Memory.Cold) instead of read into RAM when the shard is opened. Measured at 100k
# points on copies of one sealed shard: opening took ~0.2 s instead of ~0.5 s (the keyword index
# of doc_id was the largest part), hybrid p50 unchanged (3.51 vs 3.51 ms, queries interleaved).
# The dense vectors stay read into RAM: memory-mapped too, opening took ~0.08 s but hybrid p50
# rose 12-17%.
OPENED_MEMORY = "Cold"
# How far below a floor score a shard is still asked for points (relative; the engine scores in
# float32, whose relative precision is ~6e-8), so that a point tying with the floor is not lost.
FLOOR_MARGIN = 1e-6
# A shard after the first is asked for SHARE_OVERASK times its share of the limit (its live
# points' share of the version's) plus SHARE_SLACK, not the whole limit: its HNSW breadth and the
# candidates a quantized version rescores follow what it is asked for. Evenly spread points put
# about its share of the answer in each shard; a shard that holds more (a topic written into one
# shard) comes back full and is asked again for the whole limit when the merge reaches its end.
SHARE_OVERASK = 4
SHARE_SLACK = 20
# Points per scroll and write call when shards are merged.
MERGE_BATCH = 512
# How often, and how far apart, a compaction tries to lock its marker before it concludes that
# another compaction holds it (a probe holds it for microseconds).
_MARKER_TRIES = 10
_MARKER_RETRY_S = 0.01
# A shard with fewer points gets no payload index: a filter reads their payloads, which costs
# less than building the indexes did (10-30 ms each, holding the GIL: the bindings keep it in
# their calls, and a serving process's queries wait), and an edit's delta shard holds a few
# points. Merged shards and full builds past it are indexed as before.
INDEXED_SHARD_POINTS = 1_000
# The file in which Qdrant Edge keeps a shard's config (its graph width included).
EDGE_CONFIG_FILE = "edge_config.json"
# The payload index kinds a shard reports (ShardInfo.payload_schema), as the store names them.
_INDEX_KINDS: dict[str, IndexKind] = {"Keyword": "keyword", "Integer": "integer", "Bool": "bool"}


def _match(value: Any) -> Any:
    """A filter value as the engine's binding reads it. qdrant-edge-py 0.9 turns a Python bool
    into the integer 1 or 0 (bool is an int), which matches no boolean payload, so a filter on a
    boolean field found nothing; numpy's bool is not an int and reaches the engine as a bool."""
    return np.bool_(value) if isinstance(value, bool) else value


def _edge_condition(edge: Any, condition: conditions.Condition) -> Any:
    """A metadata condition as the engine's filter (rag_retriever/conditions.py)."""
    if isinstance(condition, conditions.Match):
        key = metadata_path(condition.field)
        values = condition.values
        if len(values) == 1 or isinstance(values[0], bool):  # MatchAny would take bools as ints
            matches = [
                edge.FieldCondition(key=key, match=edge.MatchValue(_match(v))) for v in values
            ]
            return matches[0] if len(matches) == 1 else edge.Filter(should=matches)
        return edge.FieldCondition(key=key, match=edge.MatchAny(list(values)))
    if isinstance(condition, conditions.Range):
        bounds = {b: getattr(condition, b) for b in conditions.BOUNDS}
        return edge.FieldCondition(
            key=metadata_path(condition.field), range=edge.RangeFloat(**bounds)
        )
    if isinstance(condition, conditions.Not):
        return edge.Filter(must_not=[_edge_condition(edge, condition.condition)])
    parts = [_edge_condition(edge, c) for c in condition.conditions]
    return (
        edge.Filter(must=parts)
        if isinstance(condition, conditions.All)
        else edge.Filter(should=parts)
    )


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; False where there
    is none). The engine allocates through glibc, whose arenas keep freed memory: a shard this
    process wrote (a base merge's, a build without a writer process) and then closed leaves its
    pages there; they go back before the shard's seal starts in a process of its own."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not Linux, or not glibc
        return False


def seal_shard(shard: Any, indexes: Mapping[str, IndexKind]) -> int:
    """Seal an open shard: payload indexes `indexes` (path -> kind; on a shard of at least
    INDEXED_SHARD_POINTS), flush, optimize, flush; returns its point count. In the store's
    process, or in a sealer process of its own (edge_writer.seal_apart)."""
    import qdrant_edge as edge

    cold = getattr(edge.Memory, OPENED_MEMORY)
    kinds: dict[str, Any] = {
        "keyword": edge.KeywordIndexParams(memory=cold),
        "integer": edge.IntegerIndexParams(lookup=True, range=True, memory=cold),
        "bool": edge.BoolIndexParams(memory=cold),
    }
    points = int(shard.count(edge.CountRequest(exact=True)))
    if points >= INDEXED_SHARD_POINTS:
        for path, kind in indexes.items():
            shard.update(edge.UpdateOperation.create_field_index(path, kinds[kind]))
    shard.flush()
    shard.optimize()
    shard.flush()
    return points


class EdgeStore(Store):
    """Versions as manifests of Qdrant Edge shards under `root` (see the module docstring)."""

    embedded = True

    def __init__(
        self,
        root: Path,
        *,
        where: str | None = None,
        shard_points: int = BASE_SHARD_POINTS,
        ef_construct: int = HNSW_EF_CONSTRUCT,
    ) -> None:
        """Opening creates nothing: the folders under `root` are made by the first write, so a
        read (search, collections, eval) of a data dir that does not exist leaves none behind.
        `where` names the place in errors (open_store: the data dir and RAG_DATA_DIR);
        `shard_points` caps a base shard (a bigger full build or base merge writes several);
        `ef_construct` is how wide each shard it creates builds its HNSW graph."""
        import qdrant_edge

        if shard_points < 1:
            raise ConfigError(f"a base shard must hold at least 1 point (got {shard_points})")
        self.shard_points = shard_points
        self.ef_construct = ef_construct

        self._edge = qdrant_edge
        self.root = root
        self._where = where or f"the Qdrant Edge store at {root.resolve()}"
        self._collections = root / "collections"
        self._segments = root / "segments"
        self._aliases = root / "aliases"
        self._compactions = root / "compactions"
        self._check_folders(create=False)
        self._shards: dict[str, Any] = {}
        self._manifests: dict[str, Manifest] = {}
        # (version, shard) -> its tombstone condition, built once: a query reuses it
        self._excluded: dict[tuple[str, str], Any] = {}
        self._dims: dict[str, int] = {}
        # version -> how its dense vectors are held (read once from its record)
        self._quantization: dict[str, Quantization] = {}
        self._widths: dict[str, int] = {}  # each shard's graph width (a shard never changes it)
        # shard -> the process writing it (bulk_write)
        self._writers: dict[str, ShardWriter] = {}
        # version -> its full build's base shards being written (rolled at shard_points)
        self._builds: dict[str, _Build] = {}
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        if self.root.is_dir():
            return self._where
        return (
            f"{self._where}; nothing was ingested there yet ({self.root.resolve()} does not exist)"
        )

    def _check_folders(self, *, create: bool) -> None:
        for folder in (self._collections, self._segments, self._aliases, self._compactions):
            if create:
                folder.mkdir(parents=True, exist_ok=True)
            # Everything the store writes stays under its root: a link that leads out is refused.
            if folder.exists() and not folder.resolve().is_relative_to(self.root.resolve()):
                raise ConfigError(
                    f"{folder} leads outside the data dir (to {folder.resolve()}); the store "
                    f"writes only under {self.root}: remove the link"
                )

    # -- names, records, manifests ------------------------------------------------------------

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
        if not self._collections.is_dir():  # nothing was written here yet
            return []
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
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                out[path.stem] = str(read_json(path)["collection"])
        return out

    def resolve(self, alias_or_name: str) -> str:
        # One small read per query: a serving process follows a moved alias at once.
        if ALIAS_PATTERN.fullmatch(alias_or_name):
            path = self._aliases / f"{alias_or_name}.json"
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError, OSError):
                return str(read_json(path)["collection"])
        return super().resolve(alias_or_name)

    def _read(self, name: str, file: str) -> Any:
        try:
            return read_json(self._dir(name) / file)
        except FileNotFoundError:
            raise CollectionNotFound(f"collection {name!r} does not exist") from None

    def _write(self, name: str, file: str, data: Any) -> None:
        if not self._dir(name).is_dir():
            raise CollectionNotFound(f"collection {name!r} does not exist")
        write_atomic(self._dir(name) / file, json.dumps(data).encode())

    def read_meta(self, name: str) -> dict[str, Any]:
        return dict(self._read(name, "meta.json"))

    def write_meta(self, name: str, meta: Mapping[str, Any]) -> None:
        self._write(name, "meta.json", dict(meta))
        self._quantization.pop(name, None)  # a name made again (another process deleted it)

    def doc_freqs(self, name: str) -> DocFreqs:
        try:
            return read_doc_freqs(self._dir(name))
        except FileNotFoundError:
            raise CollectionNotFound(f"collection {name!r} does not exist") from None

    def put_doc_freqs(self, name: str, doc_freqs: Mapping[str, int]) -> None:
        if not self._dir(name).is_dir():
            raise CollectionNotFound(f"collection {name!r} does not exist")
        write_doc_freqs(self._dir(name), doc_freqs)

    def manifest(self, name: str) -> Manifest:
        manifest = self._manifests.get(name)
        if manifest is None:
            try:
                manifest = Manifest.from_json(self._read(name, "manifest.json"))
            except CollectionNotFound:
                if self.exists(name):  # killed between its record and its manifest
                    return Manifest()
                raise
            self._manifests[name] = manifest
        return manifest

    def graph_widths(self, name: str) -> tuple[int, ...] | None:
        """Read from each of its shards' engine config, as the shard was created (one given no
        graph config holds the engine's default width)."""
        widths = set()
        for seg in self.manifest(name).segments:
            width = self._widths.get(seg.id)
            if width is None:
                try:
                    config = read_json(self._segment_dir(seg.id) / EDGE_CONFIG_FILE)
                    dense = config.get("vectors", {}).get(DENSE, {})
                    graph = dense.get("hnsw_config") or config.get("hnsw_config") or {}
                    width = self._widths[seg.id] = int(
                        graph.get("ef_construct", QDRANT_EF_CONSTRUCT)
                    )
                except (OSError, ValueError, AttributeError, TypeError):
                    return None  # a shard removed meanwhile, or another engine version's config
            widths.add(width)
        return tuple(sorted(widths)) or None

    def _put_manifest(self, name: str, manifest: Manifest) -> None:
        self._write(name, "manifest.json", manifest.to_json())
        self._manifests[name] = manifest
        self._excluded = {k: v for k, v in self._excluded.items() if k[0] != name}

    def _tombstones(self, name: str, seg: Segment) -> Any:
        """The `must_not has_id` condition of a shard's tombstones in version `name` (or None)."""
        if not seg.deleted:
            return None
        key = (name, seg.id)
        condition = self._excluded.get(key)
        if condition is None:
            condition = self._excluded[key] = self._edge.HasIdCondition(set(seg.deleted))
        return condition

    # -- writing ------------------------------------------------------------------------------

    def _new_dir(self, name: str) -> None:
        """Create a version's directory. One left without a record by a writer killed right
        after creating it is invisible to `next_version`, so it is cleared and reused rather
        than blocking every later write of that name."""
        directory = self._dir(name)
        self._check_folders(create=True)  # the store's first write makes its folders
        if directory.is_dir() and not (directory / "meta.json").exists():
            log.warning("removing %s, left without a record by an interrupted write", directory)
            shutil.rmtree(directory)
        directory.mkdir(parents=True)

    def create(self, name: str, dim: int, record: VersionRecord) -> None:
        self._new_dir(name)
        self.put_record(name, record)
        self._builds[name] = _Build()
        self._start_own(name, dim, Manifest(bases=0), record.quantization, base=True)

    def derive(self, name: str, base: str, record: VersionRecord, drop: Iterable[str]) -> None:
        self._builds.pop(name, None)  # a delta: its upserts go to its own shard
        old = self.manifest(base)
        drop = set(drop)
        segments = []
        for seg in old.segments:
            # Tombstones name only ids the shard holds, so counts stay exact.
            held = {r.id for r in self._retrieve_segment(seg.id, sorted(drop - seg.deleted))}
            segments.append(Segment(seg.id, seg.points, seg.deleted | held))
        self._new_dir(name)
        self.put_record(name, record)
        self._start_own(
            name,
            record.fingerprint.dim,
            Manifest(tuple(segments), bases=old.bases),
            record.quantization,
            base=False,
        )

    def _start_own(
        self, name: str, dim: int, manifest: Manifest, quantization: Quantization, *, base: bool
    ) -> str:
        """Name a new shard in the manifest first (so that cleaning up never misses it), then
        create it; `base`: one more shard of the base (a full build's), else a delta shard."""
        own = self._new_shard_id(name)
        self._put_manifest(
            name,
            Manifest((*manifest.segments, Segment(own, 0)), own, bases=manifest.bases + int(base)),
        )
        self._dims[name] = dim
        self._create_shard(own, dim, quantization)
        return own

    @staticmethod
    def _new_shard_id(name: str) -> str:
        return f"{_alias_of(name)}--{uuid.uuid4().hex[:12]}"

    def _create_shard(self, segment: str, dim: int, quantization: Quantization) -> None:
        edge = self._edge
        cold = getattr(edge.Memory, OPENED_MEMORY)
        quantized = _edge_quantization(edge, quantization)
        config = edge.EdgeConfig(
            vectors={
                DENSE: edge.EdgeVectorParams(
                    size=dim,
                    distance=edge.Distance.Cosine,
                    # quantized: the float32 originals stay on disk, read to rescore
                    on_disk=True if quantized is not None else None,
                    quantization_config=quantized,
                    # the engine's own default unless another width is asked for
                    hnsw_config=None
                    if self.ef_construct == QDRANT_EF_CONSTRUCT
                    else edge.HnswIndexConfig(
                        m=HNSW_M,
                        ef_construct=self.ef_construct,
                        full_scan_threshold=HNSW_FULL_SCAN_KB,
                    ),
                )
            },
            sparse_vectors={SPARSE: edge.EdgeSparseVectorParams(memory=cold)},
            # No WAL: a shard is written once by one process, and durable once flushed; a
            # shard without WAL can be opened by any number of processes at once.
            wal_enabled=False,
        )
        directory = self._segment_dir(segment)
        with self._lock, engine_errors(f"creating shard {segment}"):
            self._shards[segment] = edge.EdgeShard.create(str(directory), config)

    def _own(self, name: str) -> str:
        own = self.manifest(name).own
        if own is None:
            raise InvalidRequest(f"{name} is not being written; a sealed version is read-only")
        return own

    def upsert(
        self,
        name: str,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None:
        check_lengths(ids, dense, sparse, payloads)
        build = self._builds.get(name)
        if build is None:  # a delta's shard (or a build this store object did not create)
            self._upsert_segment(self._own(name), ids, dense, sparse, payloads)
            return
        start = 0
        while start < len(ids):  # a full build: the base shard in turn, rolled at shard_points
            if build.filled >= self.shard_points:
                self._roll(name, build)
            end = min(len(ids), start + self.shard_points - build.filled)
            part = slice(start, end)
            ids_part = list(ids[part])
            hashes = _id_hashes(ids_part)
            if build.earlier.size:
                again = np.flatnonzero(build.wrote_before(hashes))
                if again.size:  # written again: the earlier base shards no longer serve them
                    self._tombstone_earlier(name, [ids_part[i] for i in again])
            build.current.append(hashes)
            build.filled += len(ids_part)
            self._upsert_segment(
                self._own(name), ids_part, dense[part], sparse[part], payloads[part]
            )
            start = end

    def _roll(self, name: str, build: _Build) -> None:
        """End a full build's base shard (flushed and closed, to be sealed by `seal`) and start
        the next; a shard written by a process of its own hands the next one to another."""
        own = self._own(name)
        writer = self._writers.pop(own, None)
        if writer is not None:
            writer.close()
        else:
            self._close_shard(own, flush=True)
        build.roll()
        log.info("%s: base shard %s holds %d points; starting the next", name, own, build.last)
        new = self._start_own(
            name,
            self._dim_of(name, ()),
            self.manifest(name),
            self.record(name).quantization,
            base=True,
        )
        if writer is not None:
            self._hand_to_writer(new)

    def _tombstone_earlier(self, name: str, ids: Sequence[str]) -> None:
        """Ids a full build writes again after its shard rolled: tombstoned in the earlier base
        shards that hold them (upsert replaces; rare: an ingest writes each chunk once)."""
        manifest = self.manifest(name)
        asked = sorted(set(ids))
        segments = []
        for seg in manifest.segments:
            if seg.id != manifest.own:
                held = {r.id for r in self._retrieve_segment(seg.id, asked)}
                seg = Segment(seg.id, seg.points, seg.deleted | held)
            segments.append(seg)
        self._put_manifest(name, replace(manifest, segments=tuple(segments)))

    def _upsert_segment(
        self,
        segment: str,
        ids: Sequence[str],
        dense: np.ndarray,
        sparse: Sequence[SparseVector],
        payloads: Sequence[Mapping[str, Any]],
    ) -> None:
        writer = self._writers.get(segment)
        if writer is not None:
            writer.upsert(ids, dense, sparse, payloads)
            return
        sparse_pairs = [(s.indices, s.values) for s in sparse]
        self._write_points(segment, engine_points(self._edge, ids, dense, sparse_pairs, payloads))

    @contextlib.contextmanager
    def bulk_write(self, name: str) -> Iterator[None]:
        """The upserts into `name`'s own shard go to a process of its own (edge_writer.py): the
        shard is closed here, written there, flushed and closed there on a normal exit (then
        opened here again on first use, by the seal); on an exception the process is killed
        unflushed and the exception raised again, for the caller to delete the version."""
        self._hand_to_writer(self._own(name))
        try:
            yield
        except BaseException:
            writer = self._writers.pop(self._own(name), None)
            if writer is not None:
                writer.kill()
            raise
        writer = self._writers.pop(self._own(name), None)
        if writer is not None:
            log.debug("%s: %d batches written by a process of their own", name, writer.batches)
            writer.close()

    def _hand_to_writer(self, segment: str) -> None:
        """Close a created shard here and start the process that writes it."""
        self._close_shard(segment)
        self._writers[segment] = ShardWriter(str(self._segment_dir(segment)))

    def _write_points(self, segment: str, points: Sequence[Any]) -> None:
        """Upsert the engine's `Point`s into a shard being written."""
        with engine_errors(f"writing to shard {segment}"):
            self._shard(segment).update(self._edge.UpdateOperation.upsert_points(list(points)))

    def seal(self, name: str, indexes: Mapping[str, IndexKind], *, merge_base: bool = True) -> None:
        own = self._own(name)
        manifest = self.manifest(name)
        self._builds.pop(name, None)
        # A full build seals each of its base shards in turn, one in memory at a time.
        full = manifest.bases == len(manifest.segments)
        sealing = [s.id for s in manifest.segments] if full else [own]
        seal_one = self._seal_apart if len(sealing) > 1 else self._seal_segment
        counts = {segment: seal_one(segment, indexes) for segment in sealing}
        segments = tuple(
            Segment(s.id, counts[s.id], s.deleted) if s.id in counts else s
            for s in manifest.segments
        )
        compacted, bases = self._compact(
            name, segments, manifest.bases, indexes, merge_base=merge_base
        )
        self._put_manifest(name, Manifest(compacted, None, bases=bases))
        if compacted != segments:  # this version's own shard may be merged away: not kept
            self.collect_garbage(_alias_of(name))

    def _close_shard(self, segment: str, *, flush: bool = False) -> None:
        """Close an open shard (its memory goes; `flush`: written to disk first); it opens
        again on first use."""
        with self._lock:
            shard = self._shards.pop(segment, None)
        if shard is None:
            return
        if flush:
            with engine_errors(f"flushing shard {segment}"):
                shard.flush()
        shard.close()

    def _seal_apart(self, segment: str, indexes: Mapping[str, IndexKind]) -> int:
        """Seal one of several shards sealed in turn (a full build's, a base merge's) in a process
        of its own (`seal_apart`: a stop need not wait minutes for the engine's optimize); here
        the shard is flushed and closed first, and what its writes held is given back. Returns
        the shard's point count; the shard opens again on first use."""
        self._close_shard(segment, flush=True)
        trim_heap()
        started = time.monotonic()
        points = seal_apart(
            str(self._segment_dir(segment)), partial(seal_shard, indexes=dict(indexes))
        )
        log.info(
            "shard %s sealed: %d points in %.0f s", segment, points, time.monotonic() - started
        )
        return points

    def _seal_segment(self, segment: str, indexes: Mapping[str, IndexKind]) -> int:
        """Seal a shard here (seal_shard); returns its point count."""
        shard = self._shard(segment)
        with engine_errors(f"sealing shard {segment}"):
            return seal_shard(shard, indexes)

    def _compact(
        self,
        name: str,
        segments: tuple[Segment, ...],
        bases: int,
        indexes: Mapping[str, IndexKind],
        *,
        merge_base: bool,
    ) -> tuple[tuple[Segment, ...], int]:
        """Merge the newest delta shards while the older is not much bigger (MERGE_RATIO), all of
        them past MAX_DELTA_SHARDS, or everything when the deltas outgrow the base (its first
        `bases` shards). With `merge_base` False (compaction off the write path) only merges of
        at most INLINE_MERGE_POINTS points run here; the rest are a compaction's
        (`compaction_due`). Shards that a running compaction is merging, and older ones, are
        left as they are. Returns the shards and how many of them are the base."""
        if len(segments) <= bases:
            return segments, bases
        running = self.running_compaction(_alias_of(name))
        frozen = set(running.get("segments", ())) if running is not None else set()
        if merge_base and running is None and outgrown(segments, bases):
            log.info(
                "%s: the deltas outgrew the base; merging %d shards into a new base",
                name,
                len(segments),
            )
            merged = self._merge(name, segments, indexes, base=True)
            return merged, len(merged)
        fixed = max([bases] + [at + 1 for at, s in enumerate(segments) if s.id in frozen])
        deltas = segments[fixed:]
        start = merge_from(deltas, math.inf if merge_base else INLINE_MERGE_POINTS)
        if start < len(deltas):
            log.info("%s: merging %d delta shards into one", name, len(deltas) - start)
            deltas = (*deltas[:start], *self._merge(name, deltas[start:], indexes, base=False))
        return (*segments[:fixed], *deltas), bases

    def _merge(
        self,
        name: str,
        segments: Sequence[Segment],
        indexes: Mapping[str, IndexKind],
        *,
        base: bool,
    ) -> tuple[Segment, ...]:
        """New shards holding the live points of `segments` (vectors copied as they are): one
        delta shard, or (`base`) a base of as many shards as shard_points asks for."""
        live = sum(s.live for s in segments)
        targets = [
            self._new_shard_id(name)
            for _ in range(base_shards(live, self.shard_points) if base else 1)
        ]
        manifest = self.manifest(name)
        # Named first, so that a kill during the merge leaves nothing unnamed behind.
        named = (*manifest.segments, *(Segment(t, 0) for t in targets))
        self._put_manifest(name, replace(manifest, segments=named))
        counts = self._fill(targets, name, segments, indexes)
        return tuple(Segment(t, n) for t, n in zip(targets, counts, strict=True))

    def _fill(
        self,
        targets: Sequence[str],
        name: str,
        segments: Sequence[Segment],
        indexes: Mapping[str, IndexKind],
    ) -> list[int]:
        """Create shards `targets` with the live points of `segments` (as version `name` reads
        them), in that order and as many in each (give or take one), indexed for `indexes` and
        every payload index the segments have; each sealed before the next is written (several:
        each in a process of its own, `_seal_apart`). Their point counts."""
        dim, quantization = self._dim_of(name, segments), self.record(name).quantization
        kinds = {**self._index_kinds(segments), **indexes}
        each = math.ceil(sum(s.live for s in segments) / len(targets))
        counts: list[int] = []
        filled = 0
        self._create_shard(targets[0], dim, quantization)

        def next_target() -> None:
            nonlocal filled
            counts.append(self._seal_apart(targets[len(counts)], kinds))
            self._create_shard(targets[len(counts)], dim, quantization)
            filled = 0

        for seg in segments:
            excluded = self._filter(None, self._tombstones(name, seg))
            for page in self._scroll_pages(seg.id, excluded, MERGE_BATCH, with_vector=True):
                while page:
                    last = len(counts) == len(targets) - 1
                    if filled >= each and not last:
                        next_target()
                        continue
                    room = len(page) if last else each - filled
                    self._copy(targets[len(counts)], page[:room])
                    filled += len(page[:room])
                    page = page[room:]
        while len(counts) < len(targets) - 1:  # fewer points than counted: none is left unmade
            next_target()
        seal_last = self._seal_apart if len(targets) > 1 else self._seal_segment
        counts.append(seal_last(targets[-1], kinds))
        return counts

    def _index_kinds(self, segments: Sequence[Segment]) -> dict[str, IndexKind]:
        """The payload indexes the shards have (path -> kind)."""
        kinds: dict[str, IndexKind] = {}
        for seg in segments:
            with engine_errors(f"reading shard {seg.id}"):
                schema = self._shard(seg.id).info().payload_schema
            for path, info in schema.items():
                kind = _INDEX_KINDS.get(str(info.data_type).rsplit(".", 1)[-1])
                if kind is not None:
                    kinds[str(path)] = kind
        return kinds

    # -- compaction (a base merge off the write path; see rag_retriever/ingest/compaction.py) ---

    def _marker(self, alias: str) -> Path:
        try:
            return self._compactions / f"{check_alias(alias)}.json"
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def compaction_due(self, name: str) -> bool:
        manifest = self.manifest(name)
        return merge_due(manifest.segments, manifest.bases)

    def running_compaction(self, alias: str) -> dict[str, Any] | None:
        """What a compaction of `alias` running now (in any process) merges: its marker,
        {"source", "segments", "shards", "pid"} ({} while it is being written); None when none
        runs (a marker whose process died is stale and ignored)."""
        path = self._marker(alias)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: running
                try:
                    return dict(json.loads(os.pread(fd, 1 << 20, 0) or b"{}"))
                except ValueError:
                    return {}
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def begin_compaction(self, alias: str, *, force: bool = False) -> Compaction | None:
        """Start compacting the version `alias` serves: every shard into a new base when the
        deltas outgrew it (or `force`), else its newest delta shards into one when there are
        more than MAX_DELTA_SHARDS (the binary counter's run, `merge_from`). None when another
        compaction runs or there is nothing worth merging. The marker names the shards and the
        new shard before it is created, so that retention never deletes it while it is built."""
        source = self.aliases().get(alias)
        if source is None:
            raise CollectionNotFound(f"alias {alias!r} does not exist; nothing to compact")
        manifest = self.manifest(source)
        segments, bases = manifest.segments, manifest.bases
        if force or outgrown(segments, bases):
            if not (len(segments) > bases or any(s.deleted for s in segments)):
                return None
            kind, run = "base", segments
            made = base_shards(sum(s.live for s in run), self.shard_points)
        elif too_many_deltas(segments, bases):
            kind, run = "deltas", segments[bases + merge_from(segments[bases:]) :]
            made = 1
        else:
            return None
        fd = self._lock_marker(alias)
        if fd is None:
            return None
        shards = tuple(self._new_shard_id(source) for _ in range(made))
        marker = {
            "source": source,
            "kind": kind,
            "segments": [s.id for s in run],
            "shards": list(shards),
            "pid": os.getpid(),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(marker).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)  # lets go of the marker: a half-written one names nothing
            raise
        return Compaction(alias, source, run, shards, fd, kind=kind)

    def _lock_marker(self, alias: str) -> int | None:
        """The marker's descriptor, locked by this process; None when another compaction holds
        it. Retried for a moment: `running_compaction`'s probe holds a shared lock for
        microseconds, and a marker being unlinked by the compaction that ends is not the file
        the next one must lock (the lock would be on a name nobody finds)."""
        path = self._marker(alias)
        for _ in range(_MARKER_TRIES):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                time.sleep(_MARKER_RETRY_S)
                continue
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # locked a marker that was unlinked meanwhile: take the new one
        return None

    def build_compaction(self, compaction: Compaction) -> Compaction:
        """Write the new shard: the live points of the compacted shards, vectors copied as they
        are (nothing is embedded again), a fresh HNSW graph. The slow step; no lock is held."""
        c = compaction
        counts = self._fill(c.shards, c.source, c.segments, {})
        return replace(c, points=sum(counts), counts=tuple(counts))

    def adopt_compaction(
        self, compaction: Compaction, name: str, record: VersionRecord, *, onto: str
    ) -> bool:
        """Make version `name` (status as `record` says): the new shard in place of the
        compacted shards of `onto`, the version the alias serves now, with the shards before
        them and the delta shards `onto` added since. The ids `onto` tombstoned in the compacted
        shards since are tombstoned in the new shard. False (nothing written) when `onto` no
        longer reads the compacted shards in a row, e.g. a full build replaced them. Call with
        the alias's write lock held."""
        c = compaction
        current = self.manifest(onto)
        now = current.segments
        ids = [s.id for s in now]
        held = len(c.segments)
        at = ids.index(c.segments[0].id) if c.segments[0].id in ids else -1
        if at < 0 or ids[at : at + held] != [s.id for s in c.segments]:
            log.warning(
                "%s: %s no longer reads the shards compacted from %s; the compaction is dropped",
                c.alias,
                onto,
                c.source,
            )
            return False
        run = now[at : at + held]
        gone = frozenset().union(
            *(s.deleted - was.deleted for s, was in zip(run, c.segments, strict=True))
        )
        merged: tuple[Segment, ...]
        if len(c.shards) == 1:
            merged = (Segment(c.shards[0], c.counts[0], gone),)
        else:  # each id tombstoned since lives in one of the new shards: find which
            merged = tuple(
                Segment(
                    shard, n, frozenset(r.id for r in self._retrieve_segment(shard, sorted(gone)))
                )
                for shard, n in zip(c.shards, c.counts, strict=True)
            )
        self._new_dir(name)
        self.put_record(name, record)
        bases = len(merged) if c.kind == "base" else current.bases
        self._put_manifest(name, Manifest((*now[:at], *merged, *now[at + held :]), bases=bases))
        self.put_doc_freqs(name, self.doc_freqs(onto))
        return True

    def end_compaction(self, compaction: Compaction) -> None:
        """Remove the marker and let go of it; its new base, if no version adopted it, is
        deleted. Only that shard: this may run without the write lock, when a writer may have
        named a new shard it has not created yet (its whole-alias cleanup runs under the lock)."""
        named: set[str] = set()
        for version in self.collection_names():
            with contextlib.suppress(CollectionNotFound):
                manifest = Manifest.from_json(self._read(version, "manifest.json"))
                named.update(s.id for s in manifest.segments)
        with contextlib.suppress(FileNotFoundError):
            self._marker(compaction.alias).unlink()
        os.close(compaction.fd)
        for shard in compaction.shards:
            if shard not in named:
                self._remove_shard(shard)

    def _dim_of(self, name: str, segments: Sequence[Segment]) -> int:
        if name in self._dims:
            return self._dims[name]
        return self.record(name).fingerprint.dim

    def _copy(self, target: str, points: Sequence[Any]) -> None:
        """Write the engine's points into shard `target` as they come from a scroll, vectors and
        payload unconverted. A merge of 84,668 points (before/after alternating in one process,
        best of 2): 53.9 s when ids were scrolled, the points read by id and their vectors turned
        into arrays and back; 43.6 s so, ~30 s of it the HNSW build. Most of the copying left is
        the payloads' conversion (~50 us a point, each way)."""
        edge = self._edge
        self._write_points(target, [edge.Point(p.id, p.vector, p.payload or {}) for p in points])

    def delete(self, name: str) -> None:
        """Remove a version (renamed out of sight first, so no reader sees half of it), then the
        shards of its alias that no remaining version names."""
        directory = self._dir(name)
        self._manifests.pop(name, None)
        self._quantization.pop(name, None)
        # a failed full build's state: the next version may take its number (and name)
        self._builds.pop(name, None)
        trash = self._collections / f".deleted-{name}-{uuid.uuid4().hex[:8]}"
        try:
            directory.rename(trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
        self.collect_garbage(_alias_of(name))

    def collect_garbage(self, alias: str) -> list[str]:
        """Delete the shards of `alias` that no version's manifest names (and what deletes
        killed midway left in the trash); returns their ids."""
        self._sweep_trash()
        named: set[str] = set()
        for version in self.collection_names():
            with contextlib.suppress(CollectionNotFound):
                manifest = Manifest.from_json(self._read(version, "manifest.json"))
                named.update(s.id for s in manifest.segments)
        running = self.running_compaction(alias)
        if running is not None:
            if "shards" not in running:  # its marker is being written: nothing is safe to delete
                return []
            named.update(str(shard) for shard in running["shards"])
        removed = []
        for directory in self._segments.glob(f"{alias}--*"):
            # shard ids are <alias>--<hex>: "kb--*" also matches the shards of aliases "kb-"
            # or "kb--x", which are not this alias's to delete
            if directory.name in named or directory.name.rpartition("--")[0] != alias:
                continue
            if self._remove_shard(directory.name):
                removed.append(directory.name)
        return removed

    def _sweep_trash(self) -> None:
        """Remove the `.deleted-*` folders a delete renamed and did not finish removing (killed
        during its rmtree: GBs of shards that nothing else would ever remove). Another process
        removing one at the same time is harmless: both ignore what the other removed."""
        for folder in (self._collections, self._segments):
            for trash in folder.glob(".deleted-*"):
                shutil.rmtree(trash, ignore_errors=True)

    def _remove_shard(self, segment: str) -> bool:
        """Close and delete a shard (renamed out of sight first); False when it is not there."""
        self._close_shard(segment)
        # a unique name: one left by a delete killed midway would refuse the rename (not empty)
        trash = self._segments / f".deleted-{segment}-{uuid.uuid4().hex[:8]}"
        try:
            self._segment_dir(segment).rename(trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def point_alias(self, alias: str, name: str) -> None:
        if not self.exists(name):
            raise CollectionNotFound(f"collection {name!r} does not exist")
        write_atomic(self._alias_file(alias), json.dumps({"collection": name}).encode())

    def remove_alias(self, alias: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._alias_file(alias).unlink()

    # -- reading ------------------------------------------------------------------------------

    def _segment_dir(self, segment: str) -> Path:
        if not _SAFE_NAME.fullmatch(segment):
            raise CollectionNotFound(f"{segment!r} is not a shard of this store")
        return self._segments / segment

    def _shard(self, segment: str) -> Any:
        directory = self._segment_dir(segment)
        shard = self._shards.get(segment)
        if shard is not None:
            if not directory.is_dir():  # removed by another process
                with self._lock:
                    self._shards.pop(segment, None)
                raise CollectionNotFound(f"shard {segment!r} no longer exists")
            return shard
        with self._lock:
            shard = self._shards.get(segment)
            if shard is None:
                if not directory.is_dir():
                    raise CollectionNotFound(f"shard {segment!r} does not exist")
                self._forget_removed()
                try:
                    shard = self._edge.EdgeShard.load(str(directory))
                except Exception as exc:
                    if not directory.is_dir():
                        raise CollectionNotFound(f"shard {segment!r} no longer exists") from None
                    raise ConfigError(
                        f"cannot open the Qdrant Edge shard {directory}: {exc}"
                    ) from exc
                self._shards[segment] = shard
            return shard

    def _forget_removed(self) -> None:
        """Drop what this process holds of shards and versions that another process removed
        (retention, a compaction): a serving process opens a new version's shards and never asks
        for the old ones again, so without this it kept them mapped (their disk space was not
        freed) and their manifests for as long as it ran. Called under _lock when a shard is
        opened. A search still using a dropped shard keeps its own reference; the engine
        releases the shard when the last one goes."""
        for segment in [s for s in list(self._shards) if not self._segment_dir(s).is_dir()]:
            self._shards.pop(segment, None)
            self._widths.pop(segment, None)
        # other threads add manifests and tombstones without the lock: iterate over copies
        gone = {n for n in list(self._manifests) if not self._dir(n).is_dir()}
        for name in gone:
            self._manifests.pop(name, None)
        if gone:
            self._excluded = {k: v for k, v in list(self._excluded.items()) if k[0] not in gone}

    def count(self, name: str) -> int:
        edge = self._edge
        total = 0
        for seg in self.manifest(name).segments:
            with engine_errors(f"counting {name}"):
                total += int(
                    self._shard(seg.id).count(
                        edge.CountRequest(
                            exact=True, filter=self._filter(None, self._tombstones(name, seg))
                        )
                    )
                )
        return total

    def search(self, name: str, queries: Sequence[StageQuery]) -> list[list[tuple[str, float]]]:
        if not queries:
            return []
        segments = self.manifest(name).segments
        over = self._oversampling(name)
        if len(segments) == 1 and not segments[0].deleted:
            return [best_first(found) for found in self._query(segments[0].id, queries, None, over)]
        breadth = [q.limit for q in queries]
        first = [self._fetch_limit(segments[0], q) for q in queries]
        base = self._points(segments[0].id, limited(queries, first), None, over, ef_of=breadth)
        # The base's live top `limit` of each query, ids read once here and reused by the merge.
        # No point that scores below its last one can make the answer, so the other shards are
        # asked only for points above it (fewer points handed back and walked).
        heads = [
            live_head(found, q.limit, segments[0].deleted)
            for found, q in zip(base, queries, strict=True)
        ]
        floors = [head.floor for head in heads]
        # Another shard's HNSW breadth follows the share of the live points it holds: it is
        # expected to hold that share of any answer (the first keeps the full breadth). Where
        # the first shard filled the limit it is asked for about that share too (SHARE_OVERASK);
        # where it did not (a filter that few of its points pass), for the whole limit.
        live = sum(seg.live for seg in segments) or 1
        shares = [seg.live / live for seg in segments[1:]]
        asked = [first] + [
            [
                self._fetch_limit(seg, q, 1.0 if floor is None else share)
                for q, floor in zip(queries, floors, strict=True)
            ]
            for seg, share in zip(segments[1:], shares, strict=True)
        ]
        fetched = [base] + [
            self._points(
                seg.id,
                limited(queries, limits),
                None,
                over,
                ef_of=[math.ceil(q.limit * share) for q in queries],
                floors=floors,
            )
            for seg, share, limits in zip(segments[1:], shares, asked[1:], strict=True)
        ]
        out = []
        for i, q in enumerate(queries):
            lists = [f[i] for f in fetched]
            if floors[i] is not None and all(
                len(found) < limits[i] for found, limits in zip(lists[1:], asked[1:], strict=True)
            ):
                # The common case: the base's live top `limit` and every delta point above it
                # (each delta list came back short of what was asked, so it is complete above
                # the floor) hold the answer; no merge walk needed.
                out.append(self._with_deltas(heads[i].live, segments, lists, q.limit))
                continue
            out.append(
                self._merge_lists(
                    name,
                    segments,
                    q,
                    lists,
                    [a[i] for a in asked],
                    [heads[i].names] + [[] for _ in segments[1:]],
                )
            )
        return out

    @staticmethod
    def _with_deltas(
        head: list[tuple[str, float]],
        segments: Sequence[Segment],
        lists: list[list[Any]],
        limit: int,
    ) -> list[tuple[str, float]]:
        """The best `limit` of the base's live head and the delta shards' live points."""
        found = list(head)
        for seg, points in zip(segments[1:], lists[1:], strict=True):
            for point in points:
                pid = str(point.id)
                if pid not in seg.deleted:
                    found.append((pid, float(point.score)))
        return best_first(found, limit)

    @staticmethod
    def _fetch_limit(seg: Segment, q: StageQuery, share: float = 1.0) -> int:
        """How many points to ask a shard for: the limit (or, `share` < 1, its share of it with
        room to spare: SHARE_OVERASK), plus room for its tombstones (a `must_not has_id` filter
        of thousands of ids made a filtered HNSW search ~7x slower, measured at 100k points, so
        tombstoned points are fetched and dropped instead)."""
        wanted = q.limit
        if share < 1:
            wanted = min(q.limit, math.ceil(SHARE_OVERASK * q.limit * share) + SHARE_SLACK)
        if not seg.deleted:
            return wanted
        gone = len(seg.deleted) / max(seg.points, 1)
        return min(seg.points, wanted + math.ceil(wanted * 2 * gone) + 10)

    def _merge_lists(
        self,
        name: str,
        segments: Sequence[Segment],
        q: StageQuery,
        lists: list[list[Any]],
        asked: list[int],
        names: list[list[str]],
    ) -> list[tuple[str, float]]:
        """The best `q.limit` live points of the shards' score-ordered lists. Walked best score
        first, so an id is read (~1.7 us each: the engine hands out `uuid.UUID`s) only for the
        points that reach the answer or are tombstones above it, not for every fetched point of
        every shard. Exact: when the walk passes the end of a list that may have more (it came
        back as long as asked), that shard is asked again with its tombstones as a filter."""
        while True:
            out: list[tuple[str, float]] = []
            walk = heapq.merge(*(ranked(j, found) for j, found in enumerate(lists)))
            ended: int | None = None  # a shard whose list ran out but may hold more
            short: int | None = None
            for neg, j, k in walk:
                score = -neg
                if len(out) >= q.limit and score != out[-1][1]:
                    break  # the limit and its ties are in
                if ended is not None:
                    short = ended  # the next point may be outranked by one that shard did not send
                    break
                pid = names[j][k] if k < len(names[j]) else str(lists[j][k].id)
                if pid not in segments[j].deleted:
                    out.append((pid, score))
                if k == len(lists[j]) - 1 and len(lists[j]) == asked[j] < segments[j].points:
                    ended = j
            else:
                if ended is not None and len(out) < q.limit:
                    short = ended
            if short is None:
                return best_first(out, q.limit)
            # rare: the over-fetch left a shard short; ask it for its exact live top `limit`
            seg = segments[short]
            tombstones = self._tombstones(name, seg)
            lists[short] = self._points(seg.id, [q], tombstones, self._oversampling(name))[0]
            names[short] = []
            asked[short] = seg.points  # that list is now complete for this query

    def _query(
        self,
        segment: str,
        queries: Sequence[StageQuery],
        excluded: Any,
        over: float | None,
    ) -> list[list[tuple[str, float]]]:
        return [
            [(str(p.id), float(p.score)) for p in points]
            for points in self._points(segment, queries, excluded, over)
        ]

    def _oversampling(self, name: str) -> float | None:
        """The oversampling of a version's quantized dense search (None: float32 vectors).
        Its quantization is read from its record once: a version never changes it."""
        quantization = self._quantization.get(name)
        if quantization is None:
            quantization = self._quantization[name] = self.record(name).quantization
        return QUANTIZATION_OVERSAMPLING.get(quantization)

    def _points(
        self,
        segment: str,
        queries: Sequence[StageQuery],
        excluded: Any,
        over: float | None,
        ef_of: Sequence[int] | None = None,
        floors: Sequence[float | None] | None = None,
    ) -> list[list[Any]]:
        """One batched engine call, its scored points as the engine returns them (best first);
        `over` = the version's quantized oversampling (None: float32 vectors); `ef_of` = the
        limit each query's HNSW breadth is sized for (default its own limit); `floors` = the
        score each query's points must reach (None: any)."""
        bases = ef_of or [q.limit for q in queries]
        lows = floors or [None] * len(queries)
        with engine_errors(f"searching shard {segment}"):
            results = self._shard(segment).query_batch(
                self._edge.QueryBatchRequest(
                    [
                        self._request(q, excluded, over, b, low)
                        for q, b, low in zip(queries, bases, lows, strict=True)
                    ]
                )
            )
        return list(results)

    def _request(
        self,
        q: StageQuery,
        excluded: Any,
        over: float | None,
        ef_base: int,
        floor: float | None = None,
    ) -> Any:
        edge = self._edge
        if isinstance(q.vector, SparseVector):
            vector: Any = edge.SparseVector(list(q.vector.indices), list(q.vector.values))
        else:
            vector = q.vector.tolist()
        return edge.QueryRequest(
            limit=q.limit,
            query=edge.Query.Nearest(vector, using=q.using),
            filter=self._filter(q.flt, excluded),
            params=edge.SearchParams(
                hnsw_ef=max(HNSW_EF_PER_RESULT * ef_base, q.limit),
                # a quantized version rescores its best candidates with the originals
                quantization=None
                if over is None
                else edge.QuantizationSearchParams(rescore=True, oversampling=over),
            )
            if q.using == DENSE
            else None,
            with_payload=False,
            with_vector=False,
            # a hair below the floor: a point that ties with it still comes back
            score_threshold=None if floor is None else floor - FLOOR_MARGIN * max(1.0, abs(floor)),
        )

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
        out: list[Record] = []
        for seg in self.manifest(name).segments:
            found = self._retrieve_segment(
                seg.id, ids, dense=with_dense, sparse=with_sparse, payload=with_payload
            )
            out.extend(r for r in found if r.id not in seg.deleted)
        return out

    def _retrieve_segment(
        self,
        segment: str,
        ids: Sequence[str],
        *,
        dense: bool = False,
        sparse: bool = False,
        payload: bool = True,
    ) -> list[Record]:
        if not ids:
            return []
        vectors = [v for v, wanted in ((DENSE, dense), (SPARSE, sparse)) if wanted]
        with engine_errors(f"reading shard {segment}"):
            records = self._shard(segment).retrieve(
                list(ids), with_payload=payload, with_vector=vectors or False
            )
        return [make_record(r.id, r.payload, r.vector, dense=dense, sparse=sparse) for r in records]

    def scroll(self, name: str, *, flt: SearchFilter | None = None) -> Iterator[Record]:
        for seg in self.manifest(name).segments:
            yield from self._scroll_segment(seg, flt, self._tombstones(name, seg))

    def _scroll_segment(
        self, seg: Segment, flt: SearchFilter | None, excluded: Any = None
    ) -> Iterator[Record]:
        for points in self._scroll_pages(seg.id, self._filter(flt, excluded), 1024):
            for r in points:
                yield Record(str(r.id), dict(r.payload or {}))

    def _scroll_pages(
        self, segment: str, flt: Any, limit: int, *, with_vector: bool = False
    ) -> Iterator[list[Any]]:
        """A shard's points that pass the engine filter `flt`, `limit` at a time, with their
        payloads (and vectors), as the engine hands them out."""
        offset: Any = None
        while True:
            with engine_errors(f"reading shard {segment}"):
                points, offset = self._shard(segment).scroll(
                    self._edge.ScrollRequest(
                        offset=offset,
                        limit=limit,
                        filter=flt,
                        with_payload=True,
                        with_vector=with_vector,
                    )
                )
            if points:
                yield points
            if offset is None:
                return

    def _filter(self, flt: SearchFilter | None, excluded: Any = None) -> Any:
        edge = self._edge
        must: list[Any] = []
        if flt is not None and not flt.is_empty:
            if flt.doc_ids is not None:
                must.append(
                    edge.FieldCondition(key="doc_id", match=edge.MatchAny(list(flt.doc_ids)))
                )
            for key, value in flt.equals.items():
                must.append(
                    edge.FieldCondition(
                        key=metadata_path(key), match=edge.MatchValue(_match(value))
                    )
                )
            if flt.where is not None:
                must.append(_edge_condition(edge, flt.where))
        must_not = [excluded] if excluded is not None else None
        if not must and not must_not:
            return None
        return edge.Filter(must=must or None, must_not=must_not)

    def close(self) -> None:
        with self._lock:
            shards, self._shards = self._shards, {}
        for shard in shards.values():
            shard.close()


def _alias_of(name: str) -> str:
    """The alias a version name belongs to (the name itself when it is not a version's): what
    its shards are named after and collected by (kb_'s versions are kb___SLUG__vN)."""
    parsed = parse_collection_name(name)
    return parsed[0] if parsed else name


def _edge_quantization(edge: Any, quantization: Quantization) -> Any:
    """Qdrant Edge's quantization config of a version's dense vectors (None: float32 only); the
    quantized vectors stay in RAM, the originals on disk."""
    if quantization == "int8":
        # 8 bits a dimension as TurboQuant (rotated, then quantized): qdrant-edge 0.9 accepts a
        # ScalarQuantizationConfig and builds nothing from it (measured: no quantized files and
        # the scores of an exact search without rescoring, at 30,000 points), while this one
        # writes quantized vectors whose scores differ from exact ones until rescored.
        return edge.TurboQuantQuantizationConfig(bits=edge.TurboQuantBitSize.Bits8, always_ram=True)
    if quantization == "binary":
        return edge.BinaryQuantizationConfig(always_ram=True)
    if quantization == "binary2":
        # 2 bits a dimension, each query asked at 8 bits (asymmetric): Qdrant's remedy for 1 bit
        # on small embeddings (384 dimensions), measured in docs/benchmarks.md
        return edge.BinaryQuantizationConfig(
            always_ram=True,
            encoding=edge.BinaryQuantizationEncoding.TwoBits,
            query_encoding=edge.BinaryQuantizationQueryEncoding.Scalar8Bits,
        )
    return None


class _Build:
    """A full build being written by this store object: points in its current base shard, and
    the hashes of the ids it wrote, to find an id written again after its shard rolled."""

    def __init__(self) -> None:
        self.filled = 0
        self.last = 0
        self.current: list[np.ndarray] = []
        self.earlier = np.empty(0, dtype=np.uint64)

    def roll(self) -> None:
        self.earlier = np.union1d(self.earlier, np.concatenate([self.earlier[:0], *self.current]))
        self.current, self.last, self.filled = [], self.filled, 0

    def wrote_before(self, hashes: np.ndarray) -> np.ndarray:
        """Which of `hashes` an earlier base shard holds: a binary search of the sorted hashes
        (np.isin sorts its second argument on every call: ~0.5 s a batch at 1M ids)."""
        at = np.searchsorted(self.earlier, hashes)
        at[at == self.earlier.size] = 0
        return (self.earlier[at] == hashes) if self.earlier.size else np.zeros(len(hashes), bool)


def _id_hashes(ids: Sequence[str]) -> np.ndarray:
    """64-bit hashes of point ids (a false match costs one read by id, never a wrong answer)."""
    return np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "little")
            for i in ids
        ),
        dtype=np.uint64,
        count=len(ids),
    )
