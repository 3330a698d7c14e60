"""Reciprocal rank fusion (Cormack, Clarke & Buettcher, SIGIR 2009), a pure function.

Example:
    >>> [(i, round(s, 5)) for i, s in rrf([["a", "b"], ["b", "c"]], k=60)]
    [('b', 0.03252), ('a', 0.01639), ('c', 0.01613)]

score(d) = sum over lists L containing d of weight_L / (k + rank_L(d)), rank 1-based. RRF needs
no calibration between cosine and BM25 scores, only ranks. A list that repeats an id counts only
its first (best) position. Equal scores are ordered by the best rank the id reached in any list,
then by the order the lists are given in, then by first appearance, so the output is
deterministic.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

K_DEFAULT = 60  # the constant of the original paper; robust across collections there

Id = TypeVar("Id", bound=Hashable)


def rrf(
    lists: Sequence[Sequence[Id]],
    *,
    k: int = K_DEFAULT,
    weights: Sequence[float] | None = None,
) -> list[tuple[Id, float]]:
    """Fuse ranked lists of ids into one list of (id, RRF score), best first."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if weights is None:
        weights = [1.0] * len(lists)
    if len(weights) != len(lists):
        raise ValueError(f"got {len(weights)} weights for {len(lists)} lists")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative, got {list(weights)}")
    scores: dict[Id, float] = {}
    # (best rank, index of the list it was seen in first, order of first appearance)
    tiebreak: dict[Id, tuple[int, int, int]] = {}
    for list_index, (ranked, weight) in enumerate(zip(lists, weights, strict=True)):
        seen: set[Id] = set()
        for rank, item in enumerate(ranked, start=1):
            if item in seen:
                continue
            seen.add(item)
            scores[item] = scores.get(item, 0.0) + weight / (k + rank)
            previous = tiebreak.get(item)
            if previous is None:
                tiebreak[item] = (rank, list_index, len(tiebreak))
            elif rank < previous[0]:
                tiebreak[item] = (rank, previous[1], previous[2])
    return sorted(scores.items(), key=lambda kv: (-kv[1], tiebreak[kv[0]]))
