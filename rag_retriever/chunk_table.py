"""Every chunk of one collection version, in memory: for offline jobs (evaluation, training).

Example:
    >>> table = ChunkTable.load(store, "docs__all-minilm-l6-v2-384__v2")   # doctest: +SKIP
    >>> table.chunks[table.row_of[hit.chunk_id]].doc_id                    # doctest: +SKIP

Rows are ordered by (doc id, chunk index), so a table read twice numbers rows the same way. The
query path never builds one: a serving process reads chunks from the engine as it needs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rag_retriever.records import Chunk
from rag_retriever.store import Store


class ChunkTable:
    def __init__(self, collection: str, chunks: Iterable[Chunk]) -> None:
        self.collection = collection
        self.chunks = sorted(chunks, key=lambda c: (c.doc_id, c.chunk_index))
        self.row_of = {c.id: i for i, c in enumerate(self.chunks)}
        self.rows_of_doc: dict[str, list[int]] = {}
        for i, c in enumerate(self.chunks):
            self.rows_of_doc.setdefault(c.doc_id, []).append(i)

    def __len__(self) -> int:
        return len(self.chunks)

    @classmethod
    def load(cls, store: Store, name: str) -> ChunkTable:
        return cls(name, (Chunk.from_payload(r.payload) for r in store.scroll(name)))

    def rows(self, ids: Sequence[str]) -> list[int]:
        return [self.row_of[i] for i in ids]
