"""Where every chunk of one collection version is, for offline jobs (evaluation, training); and
a bounded cache of chunk records read from the engine.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rag_retriever.errors import CollectionNotFound
from rag_retriever.records import Chunk
from rag_retriever.store import Store

# Chunk records kept in memory per process (most recently used); a bound, not a table.
CHUNK_CACHE_SIZE = 20_000


class ChunkCache:
    """The most recently read chunk records of each version, bounded; thread-safe."""

    def __init__(self, store: Store, size: int = CHUNK_CACHE_SIZE) -> None:
        self.store = store
        self.size = size
        self._items: OrderedDict[tuple[str, str], Chunk] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str, ids: Sequence[str]) -> dict[str, Chunk]:
        """The chunks with these ids; CollectionNotFound when one is missing (the version
        changed under the caller)."""
        out = self.find(name, ids)
        if len(out) != len(set(ids)):
            raise CollectionNotFound(f"collection {name!r} changed while it was read")
        return out

    def find(self, name: str, ids: Sequence[str]) -> dict[str, Chunk]:
        """The chunks with these ids that the version holds (the others are left out)."""
        out: dict[str, Chunk] = {}
        with self._lock:
            for cid in ids:
                chunk = self._items.get((name, cid))
                if chunk is not None:
                    self._items.move_to_end((name, cid))
                    out[cid] = chunk
        missing = [cid for cid in dict.fromkeys(ids) if cid not in out]
        if missing:
            fetched = {
                r.id: Chunk.from_payload(r.payload) for r in self.store.retrieve(name, missing)
            }
            out.update(fetched)
            with self._lock:
                for cid, chunk in fetched.items():
                    self._items[(name, cid)] = chunk
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        return out


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
