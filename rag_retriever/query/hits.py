"""What `search()` returns: the hits of one search, a plain list, plus the `query_id` that names
the search in the query log and in feedback.

Example:
    >>> hits = SearchHits([], query_id="9f3c")
    >>> hits == [], hits.query_id
    (True, '9f3c')

The in-process `Retriever.search` and both HTTP clients' `search` return this type (and
`search_batch` one per query), so a chat app sends feedback without switching to `retrieve()`:
`log.feedback(hits.query_id, chunk_id=hits[0].chunk_id, relevant=True)` in-process,
`client.feedback(hits.query_id, ...)` over HTTP.

Does not do: carry the rest of a `SearchResult` (timings, notices, fusion: use `retrieve()`), or
keep `query_id` through list operations that make a new list (a slice, `+`, `sorted`): those
give a plain list, as for any list subclass.
"""

from __future__ import annotations

from collections.abc import Iterable

from rag_retriever.records import Hit, SearchResult


class SearchHits(list[Hit]):
    """A list of `Hit`s in rank order with the search's `query_id` (None only from a server too
    old to send one). It compares equal to a list of the same hits, whatever the query id."""

    def __init__(self, hits: Iterable[Hit] = (), *, query_id: str | None = None) -> None:
        super().__init__(hits)
        self.query_id = query_id

    @classmethod
    def of(cls, result: SearchResult) -> SearchHits:
        """The hits of `result`, named by its query id."""
        return cls(result.hits, query_id=result.query_id)

    def __repr__(self) -> str:
        return f"SearchHits({list.__repr__(self)}, query_id={self.query_id!r})"
