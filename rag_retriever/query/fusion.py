"""Rank fusion as pure functions: reciprocal rank fusion (Cormack, Clarke & Buettcher, SIGIR
2009), distribution-based score fusion, convex combinations of min-max or z-normalised scores
(Bruch, Gai & Ingber, TOIS 2023), a query-adaptive combination, and `Fusion`, the choice a
collection version makes.

Example:
    >>> [(i, round(s, 5)) for i, s in rrf([["a", "b"], ["b", "c"]], k=60)]
    [('b', 0.03252), ('a', 0.01639), ('c', 0.01613)]

score(d) = sum over lists L containing d of weight_L / (k + rank_L(d)), rank 1-based. RRF needs
no calibration between cosine and BM25 scores, only ranks. A list that repeats an id counts only
its first (best) position. Equal scores are ordered by the best rank the id reached in any list,
then by the order the lists are given in, then by first appearance, so the output is
deterministic.

The score-based fusions (dbsf, minmax, zscore, adaptive) map each list's scores to a
non-negative scale on which the list's lowest score is 0 (DBSF: its mean - 3 std), so an id a
list did not return contributes 0 from it: it is treated as scoring no better than the list's
last entry. Not handled: more than the lists given (no learned weights here; see
training/fusion.py), and scores that are not finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rag_retriever.errors import InvalidRequest
from rag_retriever.records import FusionMethod

K_DEFAULT = 60  # the constant of the original paper; robust across collections there

Id = TypeVar("Id", bound=Hashable)


def _checked_weights(weights: Sequence[float] | None, n_lists: int) -> Sequence[float]:
    """One weight per list (1.0 each by default), none negative."""
    if weights is None:
        return [1.0] * n_lists
    if len(weights) != n_lists:
        raise ValueError(f"got {len(weights)} weights for {n_lists} lists")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative, got {list(weights)}")
    return weights


def rrf(
    lists: Sequence[Sequence[Id]],
    *,
    k: int = K_DEFAULT,
    weights: Sequence[float] | None = None,
) -> list[tuple[Id, float]]:
    """Fuse ranked lists of ids into one list of (id, RRF score), best first."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    weights = _checked_weights(weights, len(lists))
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


def dbsf(
    lists: Sequence[Sequence[tuple[Id, float]]],
    *,
    weights: Sequence[float] | None = None,
) -> list[tuple[Id, float]]:
    """Distribution-based score fusion (as Qdrant's DBSF): each list's scores are mapped to [0, 1]
    by its own mean ± 3 standard deviations (clipped), then summed with the list's weight.

    >>> [(i, round(s, 3)) for i, s in dbsf([[("a", 0.9), ("b", 0.5)], [("b", 12.0), ("c", 3.0)]])]
    [('b', 1.0), ('a', 0.667), ('c', 0.333)]

    A list whose scores are all equal maps them to 0.5. Equal fused scores keep the order of
    first appearance (lists in the order given), so the output is deterministic.
    """
    weights = _checked_weights(weights, len(lists))
    scores: dict[Id, float] = {}
    for scored, weight in zip(lists, weights, strict=True):
        seen: set[Id] = set()
        values = [s for _, s in scored]
        if not values:
            continue
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        low, span = mean - 3 * std, 6 * std
        for item, score in scored:
            if item in seen:
                continue
            seen.add(item)
            normalised = 0.5 if span == 0 else min(1.0, max(0.0, (score - low) / span))
            scores[item] = scores.get(item, 0.0) + weight * normalised
    return _best_first(scores)


def _scored_fusion(
    lists: Sequence[Sequence[tuple[Id, float]]],
    weights: Sequence[float] | None,
    normalise: Callable[[Sequence[float]], list[float]],
    confidence: Callable[[Sequence[float]], float] | None = None,
) -> list[tuple[Id, float]]:
    """sum over lists of weight_L x confidence_L x normalise_L(score), an absent id adding 0;
    equal fused scores keep the order of first appearance (lists in the order given)."""
    weights = _checked_weights(weights, len(lists))
    scores: dict[Id, float] = {}
    for scored, weight in zip(lists, weights, strict=True):
        first = _first_scores(scored)  # a repeated id counts at its first (best) position
        if not first:
            continue
        values = list(first.values())
        factor = weight * (1.0 if confidence is None else confidence(values))
        for item, normalised in zip(first, normalise(values), strict=True):
            scores[item] = scores.get(item, 0.0) + factor * normalised
    return _best_first(scores)


def _min_max(values: Sequence[float]) -> list[float]:
    """(v - min) / (max - min): the list's best is 1, its last 0; all equal -> 1 each."""
    low, high = min(values), max(values)
    return [1.0 if high == low else (v - low) / (high - low) for v in values]


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


def _z_above_min(values: Sequence[float]) -> list[float]:
    """(v - mean) / std shifted so the list's lowest is 0, i.e. (v - min) / std; a list of equal
    scores (std 0) -> 1 each. The same order as the z-score, with an absent id at the list's
    lowest z."""
    low, std = min(values), _std(values)
    return [1.0 if std == 0 else (v - low) / std for v in values]


def _top_z(values: Sequence[float]) -> float:
    """How far a list's best score stands out of its list: (max - mean) / std (0 when all are
    equal). A lexical list with one passage that matches the rare words of the question has a
    high one; a flat list of near-equal cosines a low one."""
    std = _std(values)
    return 0.0 if std == 0 else (max(values) - sum(values) / len(values)) / std


def minmax(
    lists: Sequence[Sequence[tuple[Id, float]]], *, weights: Sequence[float] | None = None
) -> list[tuple[Id, float]]:
    """Convex combination of min-max normalised scores: sum of weight_L x (s - min_L) / (max_L -
    min_L) over the lists (weights (1-a, a) give the convex combination; only their ratio counts).

    >>> [(i, round(s, 3)) for i, s in minmax([[("a", 0.9), ("b", 0.5)], [("b", 12.0), ("c", 3.0)]])]
    [('a', 1.0), ('b', 1.0), ('c', 0.0)]
    """
    return _scored_fusion(lists, weights, _min_max)


def zscore(
    lists: Sequence[Sequence[tuple[Id, float]]], *, weights: Sequence[float] | None = None
) -> list[tuple[Id, float]]:
    """Convex combination of z-normalised scores, (s - mean_L) / std_L per list, an id absent from
    a list counted at that list's lowest z (so the sum is of (s - min_L) / std_L).

    >>> [(i, round(s, 3)) for i, s in zscore([[("a", 3.0), ("b", 1.0)], [("b", 2.0), ("c", 0.0)]])]
    [('a', 2.0), ('b', 2.0), ('c', 0.0)]
    """
    return _scored_fusion(lists, weights, _z_above_min)


def adaptive(
    lists: Sequence[Sequence[tuple[Id, float]]],
    *,
    weights: Sequence[float] | None = None,
    complete: Sequence[bool] | None = None,
) -> list[tuple[Id, float]]:
    """Query-adaptive: `zscore` with each list's weight multiplied, per query, by its confidence,
    how far its best score stands out, (max_L - mean_L) / std_L. No parameter beyond the weights.

    A list whose scores are all equal (one entry, or ties) has no spread to measure. When it is
    `complete` (it holds every match there is, as BM25's does when it returns fewer than asked:
    every other chunk scores 0), its entries stand out as far as any can: each counts as much as
    the best entry of the other lists (a question naming a rare word that one chunk holds ranks
    that chunk beside the embedding's best, as RRF would). A flat list that is not complete adds
    0. `complete`: one flag per list (default: none is).

    >>> [(i, round(s, 3)) for i, s in adaptive([[("a", 3.0), ("b", 1.0)], [("b", 9.0), ("c", 0.0), ("d", 0.0)]])]
    [('b', 3.0), ('a', 2.0), ('c', 0.0), ('d', 0.0)]
    >>> [i for i, _ in adaptive([[("a", .6), ("b", .5), ("c", .1)], [("x", 14.2)]], complete=[False, True])]
    ['a', 'x', 'b', 'c']
    """
    weights = _checked_weights(weights, len(lists))
    flags = [False] * len(lists) if complete is None else list(complete)
    if len(flags) != len(lists):
        raise ValueError(f"got {len(flags)} complete flags for {len(lists)} lists")
    firsts = [_first_scores(scored) for scored in lists]
    # no spread: all scores equal (compared exactly: a std of equal floats can be ~1e-16)
    spread = [len(f) > 0 and max(f.values()) > min(f.values()) for f in firsts]
    # what the best entry of a list with a spread adds, before its weight
    best = [
        _top_z(values) * max(_z_above_min(values))
        for f, has in zip(firsts, spread, strict=True)
        if has and (values := list(f.values()))
    ]
    lone = max(best, default=1.0)
    scores: dict[Id, float] = {}
    for first, weight, has, whole in zip(firsts, weights, spread, flags, strict=True):
        if not first:
            continue
        values = list(first.values())
        if has:
            factor, normalised = weight * _top_z(values), _z_above_min(values)
        else:  # no spread: all its entries alike, at the best's strength or at none
            factor, normalised = (weight * lone if whole else 0.0), [1.0] * len(values)
        for item, z in zip(first, normalised, strict=True):
            scores[item] = scores.get(item, 0.0) + factor * z
    return _best_first(scores)


def _best_first(scores: dict[Id, float]) -> list[tuple[Id, float]]:
    """The fused (id, score) pairs, highest first; equal scores in order of first appearance."""
    order = {item: i for i, item in enumerate(scores)}
    return sorted(scores.items(), key=lambda kv: (-kv[1], order[kv[0]]))


def _first_scores(scored: Sequence[tuple[Id, float]]) -> dict[Id, float]:
    """Each id's score at its first (best) position in the list."""
    first: dict[Id, float] = {}
    for item, value in scored:
        first.setdefault(item, value)
    return first


class _Fuse(Protocol):
    """A fusion method over scored lists: (id, score) pairs best first, one weight per list;
    `complete`, per list, whether it holds every match there is (fewer than its depth)."""

    def __call__(
        self,
        lists: Sequence[Sequence[tuple[Id, float]]],
        *,
        k: int,
        weights: Sequence[float],
        complete: Sequence[bool] | None = None,
    ) -> list[tuple[Id, float]]: ...


def _by_rank(
    lists: Sequence[Sequence[tuple[Id, float]]],
    *,
    k: int,
    weights: Sequence[float],
    complete: Sequence[bool] | None = None,
) -> list[tuple[Id, float]]:
    return rrf([[i for i, _ in ranked] for ranked in lists], k=k, weights=weights)


def _by_score(
    lists: Sequence[Sequence[tuple[Id, float]]],
    *,
    k: int,
    weights: Sequence[float],
    complete: Sequence[bool] | None = None,
) -> list[tuple[Id, float]]:
    return dbsf(lists, weights=weights)  # no constant: the scores are normalised instead


def _by_minmax(
    lists: Sequence[Sequence[tuple[Id, float]]],
    *,
    k: int,
    weights: Sequence[float],
    complete: Sequence[bool] | None = None,
) -> list[tuple[Id, float]]:
    return minmax(lists, weights=weights)


def _by_zscore(
    lists: Sequence[Sequence[tuple[Id, float]]],
    *,
    k: int,
    weights: Sequence[float],
    complete: Sequence[bool] | None = None,
) -> list[tuple[Id, float]]:
    return zscore(lists, weights=weights)


def _by_adaptive(
    lists: Sequence[Sequence[tuple[Id, float]]],
    *,
    k: int,
    weights: Sequence[float],
    complete: Sequence[bool] | None = None,
) -> list[tuple[Id, float]]:
    return adaptive(lists, weights=weights, complete=complete)


@dataclass(frozen=True)
class _Method:
    fuse: _Fuse
    uses_k: bool  # whether the RRF constant k means anything to it (tuning varies it if so)


# The fusion methods, by name: what each does with the two lists. A new method is one entry here
# (and its name in records.FusionMethod); the tuner's grid and the validation derive from it.
METHODS: dict[FusionMethod, _Method] = {
    "rrf": _Method(_by_rank, uses_k=True),
    "dbsf": _Method(_by_score, uses_k=False),
    "minmax": _Method(_by_minmax, uses_k=False),
    "zscore": _Method(_by_zscore, uses_k=False),
    "adaptive": _Method(_by_adaptive, uses_k=False),
}
FUSION_METHODS: tuple[FusionMethod, ...] = tuple(METHODS)


@dataclass(frozen=True)
class Fusion:
    """How a version merges its dense and BM25 lists; stored in the version's metadata when it
    was tuned on the user's questions (`rag-retriever tune-fusion`), else the settings' fusion
    (RAG_FUSION, adaptive by default)."""

    method: FusionMethod = "rrf"
    k: int = K_DEFAULT  # RRF's constant; unused by dbsf
    weights: tuple[float, float] = (1.0, 1.0)  # (dense, bm25)
    depths: tuple[int, int] = (100, 100)  # how many of each list take part

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequest(
                f"fusion method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if len(self.depths) != 2 or self.k < 1 or min(self.depths) < 1:
            raise InvalidRequest(
                f"fusion k and both depths must be at least 1, got k={self.k}, depths={self.depths}"
            )
        if (
            len(self.weights) != 2
            or not all(math.isfinite(w) and w >= 0 for w in self.weights)
            or not any(self.weights)
        ):
            raise InvalidRequest(
                f"fusion weights must be two finite non-negative numbers, not both 0 "
                f"(dense,bm25), got {self.weights}"
            )

    def fuse(
        self,
        dense: Sequence[tuple[Id, float]],
        bm25: Sequence[tuple[Id, float]],
        asked: tuple[int, int] | None = None,
    ) -> list[tuple[Id, float]]:
        """The fused list of (id, score), best first: the fusion of each list's first `depths`
        entries, then every other id of the two lists, with score 0, by the best rank it reached
        (ties: the dense list first). So depths change how the lists are weighed, never how deep
        the fused list is: it holds every id either list returned, and a tuned depth of 20
        cannot shrink the reranker's candidates or recall at 50 or 100 to 40 ids.

        >>> [i for i, _ in Fusion(depths=(1, 1)).fuse([("a", .9), ("b", .8)], [("c", 7.), ("b", 5.)])]
        ['a', 'c', 'b']

        `asked`: how many entries each list was asked of the engine (default: its depth). A list
        shorter than both holds every match the engine has (`complete`): one shorter only than
        a tuned depth larger than the fetch was cut by the fetch, not complete.
        """
        cut = (
            self.depths
            if asked is None
            else (min(self.depths[0], asked[0]), min(self.depths[1], asked[1]))
        )
        head = METHODS[self.method].fuse(
            [dense[: self.depths[0]], bm25[: self.depths[1]]],
            k=self.k,
            weights=self.weights,
            complete=(len(dense) < cut[0], len(bm25) < cut[1]),
        )
        if len(dense) <= self.depths[0] and len(bm25) <= self.depths[1]:
            return head
        fused = {item for item, _ in head}
        tail: dict[Id, tuple[int, int]] = {}  # id -> (best rank, list index)
        for list_index, ranked in enumerate((dense, bm25)):
            for rank, (item, _) in enumerate(ranked, start=1):
                if item not in fused and (item not in tail or rank < tail[item][0]):
                    tail[item] = (rank, list_index)
        order = sorted(tail, key=lambda item: tail[item])
        return head + [(item, 0.0) for item in order]

    def describe(self) -> str:
        weights = ",".join(f"{w:g}" for w in self.weights)
        k = f" k={self.k}" if METHODS[self.method].uses_k else ""
        return f"{self.method}{k} weights(dense,bm25)={weights} depths={self.depths[0]},{self.depths[1]}"

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "k": self.k,
            "weights": list(self.weights),
            "depths": list(self.depths),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fusion:
        weights = tuple(float(w) for w in data["weights"])
        depths = tuple(int(d) for d in data["depths"])
        return cls(
            method=data["method"],
            k=int(data["k"]),
            weights=(weights[0], weights[1]),
            depths=(depths[0], depths[1]),
        )
