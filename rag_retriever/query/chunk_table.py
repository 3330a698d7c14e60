"""Where every chunk of one collection version is, for offline jobs (evaluation, training); and
bounded caches of chunk records and vectors read from the engine.

Example:
    >>> table = ChunkTable.load(store, "docs__all-minilm-l6-v2-384__v2")   # doctest: +SKIP
    >>> table.chunks[table.row_of[hit.chunk_id]].doc_id                    # doctest: +SKIP
    >>> table.embed_texts([0, 1])                                           # doctest: +SKIP

Rows are ordered by (doc id, chunk index), so a table read twice numbers rows the same way. A
loaded table holds each chunk's position (id, document, index, offsets, title, metadata) but not
its text: texts are read from the engine when a job needs them (`embed_texts`, cached and
bounded), so training and evaluation do not hold the corpus in memory. The query path never
builds a table: it reads chunks as it needs them (ChunkCache).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from rag_retriever.errors import CollectionNotFound
from rag_retriever.records import Chunk
from rag_retriever.store import Store

# Chunk records kept in memory per process (most recently used); a bound, not a table.
CHUNK_CACHE_SIZE = 20_000
# Dense vectors kept per process for MMR (most recently used): 20,000 of MiniLM's 384 floats
# are 31 MB. Reading 50 candidates' vectors from the engine is most of a diverse search's extra
# cost (the bindings hand each back as a list of floats; README, "Diverse hits").
VECTOR_CACHE_SIZE = 20_000

# Versions whose bases the caches remember (a process serves one or a few at a time).
LINKS_KEPT = 64

T = TypeVar("T")


class BoundedReads(Generic[T]):
    """The most recently read items of each version, by id, bounded; thread-safe. Versions are
    immutable, so an item read once stays right for as long as its version's name exists.

    A version made from another one (a delta, a compaction) shares its base's item for every id
    it did not change (`link`): a miss looks in the base's items (and its base's) before it reads
    the engine, so the cache is not cold after each edit."""

    def __init__(self, read: Callable[[str, list[str]], dict[str, T]], size: int) -> None:
        self._read = read
        self.size = size
        self._items: OrderedDict[tuple[str, str], T] = OrderedDict()
        self._links: OrderedDict[str, tuple[str, frozenset[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._links.clear()

    def link(self, name: str, base: str, changed: Collection[str]) -> None:
        """`name` holds `base`'s item for every id but the `changed` ones."""
        with self._lock:
            self._links[name] = (base, frozenset(changed))
            while len(self._links) > LINKS_KEPT:
                self._links.popitem(last=False)

    def _inherited(self, name: str, cid: str) -> T | None:
        """An item of `name` read through one of its bases (under the lock)."""
        while (link := self._links.get(name)) is not None:
            name, changed = link
            if cid in changed:
                return None
            item = self._items.get((name, cid))
            if item is not None:
                return item
        return None

    def get(self, name: str, ids: Sequence[str]) -> dict[str, T]:
        """The items with these ids; CollectionNotFound when one is missing (the version
        changed under the caller)."""
        out = self.find(name, ids)
        if len(out) != len(set(ids)):
            raise CollectionNotFound(f"collection {name!r} changed while it was read")
        return out

    def find(self, name: str, ids: Sequence[str]) -> dict[str, T]:
        """The items with these ids that the version holds (the others are left out)."""
        out: dict[str, T] = {}
        with self._lock:
            for cid in ids:
                item = self._items.get((name, cid))
                if item is None and (item := self._inherited(name, cid)) is not None:
                    self._items[(name, cid)] = item
                if item is not None:
                    self._items.move_to_end((name, cid))
                    out[cid] = item
        missing = [cid for cid in dict.fromkeys(ids) if cid not in out]
        if missing:
            fetched = self._read(name, missing)
            out.update(fetched)
            with self._lock:
                for cid, item in fetched.items():
                    self._items[(name, cid)] = item
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        return out


class ChunkCache(BoundedReads[Chunk]):
    """The most recently read chunk records of each version."""

    def __init__(self, store: Store, size: int = CHUNK_CACHE_SIZE) -> None:
        def read(name: str, ids: list[str]) -> dict[str, Chunk]:
            return {r.id: Chunk.from_payload(r.payload) for r in store.retrieve(name, ids)}

        super().__init__(read, size)


class VectorCache(BoundedReads[np.ndarray]):
    """The most recently read dense vectors of each version (read without their payloads)."""

    def __init__(self, store: Store, size: int = VECTOR_CACHE_SIZE) -> None:
        def read(name: str, ids: list[str]) -> dict[str, np.ndarray]:
            records = store.retrieve(name, ids, with_dense=True, with_payload=False)
            return {r.id: r.dense for r in records if r.dense is not None}

        super().__init__(read, size)


@dataclass(frozen=True)
class ChunkPosition:
    """Where a chunk is: what evaluation and mining need of every chunk (not its text)."""

    id: str
    doc_id: str
    chunk_index: int
    start: int
    end: int

    @classmethod
    def of(cls, chunk: Chunk) -> ChunkPosition:
        return cls(chunk.id, chunk.doc_id, chunk.chunk_index, chunk.start, chunk.end)


class ChunkTable:
    def __init__(self, collection: str, chunks: Iterable[Chunk]) -> None:
        """A table of `chunks`, whose texts it keeps (for tests and small jobs)."""
        chunks = list(chunks)
        self._own_texts: dict[str, str] | None = {c.id: c.embed_text for c in chunks}
        self._texts: ChunkCache | None = None
        self._index(collection, (ChunkPosition.of(c) for c in chunks))

    @classmethod
    def load(cls, store: Store, name: str) -> ChunkTable:
        """The table of version `name`: positions read now, texts read when asked for."""
        table = cls.__new__(cls)
        table._own_texts, table._texts = None, ChunkCache(store)
        positions = (ChunkPosition.of(Chunk.from_payload(r.payload)) for r in store.scroll(name))
        table._index(name, positions)
        return table

    def _index(self, collection: str, positions: Iterable[ChunkPosition]) -> None:
        self.collection = collection
        self.chunks = sorted(positions, key=lambda c: (c.doc_id, c.chunk_index))
        self.row_of = {c.id: i for i, c in enumerate(self.chunks)}
        self.rows_of_doc: dict[str, list[int]] = {}
        for i, c in enumerate(self.chunks):
            self.rows_of_doc.setdefault(c.doc_id, []).append(i)

    def __len__(self) -> int:
        return len(self.chunks)

    def embed_texts(self, rows: Sequence[int]) -> list[str]:
        """The embedded text (title + body) of each row's chunk."""
        ids = [self.chunks[r].id for r in rows]
        if self._own_texts is not None:
            return [self._own_texts[i] for i in ids]
        assert self._texts is not None
        found = self._texts.get(self.collection, ids)
        return [found[i].embed_text for i in ids]

    def rows(self, ids: Sequence[str]) -> list[int]:
        return [self.row_of[i] for i in ids]
