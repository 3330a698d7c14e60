"""A version's BM25 document frequencies on a Qdrant server: a table a full build writes once,
and the changes since it, as on Edge (store/terms.py), so an edit reads and writes the terms it
touches, not the vocabulary.

The table lives in the physical collection's `__terms` collection (no vectors): one point per
term hash (`term_index`, the term's sparse index) of the table, holding the terms with that hash
and their frequencies, so a lookup of terms and of the terms holding some indices (`holders`,
what a delta needs for the terms entering the vocabulary) are reads by point id. A version's
catalog entry names its table and carries the changes since it (term -> frequency now, 0 = in
no document any more), its size and the frequencies' histogram (rank-bm25's IDF floor). When
the changes pass REBASE_FRACTION of the table the next version writes a new table. A table's
points go when no version names it any more (ServerStore.delete).

Example:
    >>> table_point_id("kb__m__v1", 7) == table_point_id("kb__m__v1", 7)
    True
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Final

from rag_retriever.models.bm25 import term_index
from rag_retriever.store.visibility import NAMESPACE

TERMS_SUFFIX: Final = "__terms"
TABLE: Final = "table"
TERMS: Final = "terms"
# Points per call when a table is written or read.
BATCH: Final = 1024
# Points per page when a whole table is read.
ITEMS_PAGE: Final = 8192
# Terms a table remembers of its lookups (a table never changes: a query's terms are read once).
CACHE_TERMS: Final = 1 << 20

Call = Callable[[], AbstractContextManager[Any]]


def table_point_id(table: str, index: int) -> str:
    """The id of the point of `table` holding the terms whose `term_index` is `index`."""
    return str(uuid.uuid5(NAMESPACE, f"terms:{table}:{index}"))


class ServerTermTable:
    """A `TermTable` (models/bm25.py) in a `__terms` collection, read by point id."""

    def __init__(self, client: Any, call: Call, collection: str, table: str, size: int) -> None:
        self.client = client
        self.call = call
        self.collection = collection
        self.table = table
        self.size = size
        self._known: dict[str, int] = {}  # term -> frequency, 0 = not in the table

    def __len__(self) -> int:
        return self.size

    def _read(self, indices: Collection[int]) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        wanted = sorted(set(indices))
        for start in range(0, len(wanted), BATCH):
            part = wanted[start : start + BATCH]
            with self.call():
                points = self.client.retrieve(
                    self.collection,
                    ids=[table_point_id(self.table, i) for i in part],
                    with_payload=[TERMS, "index"],
                )
            for p in points:
                payload = p.payload or {}
                out[int(payload["index"])] = {t: int(n) for t, n in payload[TERMS].items()}
        return out

    def lookup(self, terms: Collection[str]) -> dict[str, int]:
        missing = [t for t in terms if t not in self._known]
        if missing:
            if len(self._known) > CACHE_TERMS:
                self._known.clear()
            found = self._read({term_index(t) for t in missing})
            for term in missing:
                self._known[term] = found.get(term_index(term), {}).get(term, 0)
        return {t: n for t in terms if (n := self._known.get(t, 0))}

    def holders(self, hashes: Collection[int]) -> dict[int, list[str]]:
        return {i: sorted(terms) for i, terms in self._read(hashes).items() if terms}

    def items(self) -> Iterator[tuple[str, int]]:
        """Every term of the table (a new table's input: a rebase, a full rebuild). The
        collection holds this table and at most a few others still named by some version, so
        it is read whole, without a filter (the in-process implementation scans every point
        for each filtered page)."""
        offset: Any = None
        while True:
            with self.call():
                points, offset = self.client.scroll(
                    self.collection, limit=ITEMS_PAGE, offset=offset, with_payload=[TABLE, TERMS]
                )
            for p in points:
                payload = p.payload or {}
                if payload.get(TABLE) == self.table:
                    yield from ((t, int(n)) for t, n in payload[TERMS].items())
            if offset is None:
                return

    def histogram(self) -> dict[int, int]:
        return dict(Counter(n for _, n in self.items()))


def write_table(
    client: Any, call: Call, collection: str, table: str, items: Iterable[tuple[str, int]]
) -> tuple[int, dict[int, int]]:
    """Write a new table of these frequencies (terms of none left out): its size and histogram."""
    from qdrant_client import models as qm

    buckets: dict[int, dict[str, int]] = {}
    for term, n in items:
        if n > 0:
            buckets.setdefault(term_index(term), {})[term] = int(n)
    indices = sorted(buckets)
    for start in range(0, len(indices), BATCH):
        points = [
            qm.PointStruct(
                id=table_point_id(table, i),
                vector={},
                payload={TABLE: table, "index": i, TERMS: buckets[i]},
            )
            for i in indices[start : start + BATCH]
        ]
        with call():
            client.upsert(collection, points=points, wait=True)
    frequencies = Counter(n for terms in buckets.values() for n in terms.values())
    return sum(len(terms) for terms in buckets.values()), dict(frequencies)
