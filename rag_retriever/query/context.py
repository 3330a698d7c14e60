"""The context around a hit: its neighbouring chunks of the same document, merged into one span
with exact offsets (small-to-big retrieval), as pure functions over chunk records.

Example:
    >>> text = "One. Two. Three. Four."
    >>> parts = [(0, 9), (5, 16), (10, 22)]          # chunks overlap by a sentence and tile
    >>> chunks = {i: _chunk(text, i, s, e, n_tokens=2) for i, (s, e) in enumerate(parts)}
    >>> window(chunks, 1, budget=6, kind="neighbours")
    [0, 1, 2]
    >>> merge([chunks[i] for i in (0, 1, 2)]).text == text
    True

`window` grows the hit's span one chunk at a time, before then after, while the chunks' token
counts (each chunk counted whole, so the budget is never exceeded even though neighbours
overlap) fit the budget; a side stops at the document's edge, at a chunk that is not there, at
a gap, or (kind "section") where the heading path changes. The hit itself is always in its
window. `merge` joins overlapping chunks without repeating the overlap:
`document.text[context.start:context.end] == context.text`, because chunks tile their document
(rag_retriever/ingest/chunking.py).
Not handled: context across documents, and budgets counted in anything but the chunks' tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from rag_retriever.records import Chunk, Context, chunk_point_id, content_hash
from rag_retriever.settings import EXPAND_TOKENS_MAX

ExpandKind = Literal["neighbours", "section"]
EXPAND_KINDS: tuple[ExpandKind, ...] = ("neighbours", "section")


def check_expand(kind: object, tokens: object) -> tuple[ExpandKind | None, int]:
    """(kind, tokens) when both are valid (kind None: no expansion), else ValueError saying
    what is accepted."""
    if (
        isinstance(tokens, bool)
        or not isinstance(tokens, int)
        or not 1 <= tokens <= EXPAND_TOKENS_MAX
    ):
        raise ValueError(
            f"expand_tokens must be an integer from 1 to {EXPAND_TOKENS_MAX}, got {tokens!r}"
        )
    if kind is None or kind == "neighbours" or kind == "section":  # EXPAND_KINDS, for mypy
        return kind, tokens
    raise ValueError(f"expand must be one of {', '.join(EXPAND_KINDS)}, got {kind!r}")


def window(chunks: Mapping[int, Chunk], hit: int, *, budget: int, kind: ExpandKind) -> list[int]:
    """The chunk indices of the hit's context, in document order (see the module docstring)."""
    centre = chunks[hit]
    picked = [hit]
    used = centre.n_tokens
    edges = {-1: hit, 1: hit}  # the outermost index taken on each side
    open_sides = [-1, 1]
    while open_sides:
        for side in list(open_sides):
            nxt = edges[side] + side
            chunk = chunks.get(nxt)
            near = chunks[edges[side]]
            fits = chunk is not None and used + chunk.n_tokens <= budget
            if (
                not fits
                or not _adjacent(near, chunk, side)
                or (
                    kind == "section" and chunk.section != centre.section  # type: ignore[union-attr]
                )
            ):
                open_sides.remove(side)
                continue
            assert chunk is not None
            picked.append(nxt)
            used += chunk.n_tokens
            edges[side] = nxt
    return sorted(picked)


def _adjacent(near: Chunk, chunk: Chunk | None, side: int) -> bool:
    """Whether `chunk` touches or overlaps `near` on that side (no gap between them)."""
    if chunk is None:
        return False
    return chunk.start <= near.end if side > 0 else near.start <= chunk.end


def merge(chunks: Sequence[Chunk]) -> Context:
    """One span of consecutive, touching chunks of a document (in document order)."""
    first = chunks[0]
    text, end = first.text, first.end
    for chunk in chunks[1:]:
        if chunk.doc_id != first.doc_id or chunk.start > end:
            raise ValueError(
                f"chunk {chunk.chunk_index} of {chunk.doc_id!r} does not touch the span"
            )
        if chunk.end > end:
            text += chunk.text[end - chunk.start :]
            end = chunk.end
    return Context(
        text=text,
        start=first.start,
        end=end,
        first_chunk=first.chunk_index,
        last_chunk=chunks[-1].chunk_index,
    )


def neighbour_ids(doc_id: str, index: int, reach: int, tenant: str = "") -> dict[str, int]:
    """Point ids of the chunks within `reach` of chunk `index` of `doc_id` of `tenant` (itself
    left out)."""
    lo = max(0, index - reach)
    return {
        chunk_point_id(doc_id, i, tenant): i for i in range(lo, index + reach + 1) if i != index
    }


def _chunk(text: str, index: int, start: int, end: int, *, n_tokens: int) -> Chunk:
    """A chunk of `text` (for the examples and tests)."""
    body = text[start:end]
    return Chunk(
        id=chunk_point_id("d", index),
        doc_id="d",
        title="",
        chunk_index=index,
        start=start,
        end=end,
        text=body,
        n_tokens=n_tokens,
        content_hash=content_hash(body),
    )
