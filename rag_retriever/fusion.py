"""Rank fusion as pure functions: reciprocal rank fusion (Cormack, Clarke & Buettcher, SIGIR
2009), distribution-based score fusion, and `Fusion`, the choice a collection version makes.

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

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

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
    order = {item: i for i, item in enumerate(scores)}
    return sorted(scores.items(), key=lambda kv: (-kv[1], order[kv[0]]))


class _Fuse(Protocol):
    """A fusion method over scored lists: (id, score) pairs best first, one weight per list."""

    def __call__(
        self, lists: Sequence[Sequence[tuple[Id, float]]], *, k: int, weights: Sequence[float]
    ) -> list[tuple[Id, float]]: ...


def _by_rank(
    lists: Sequence[Sequence[tuple[Id, float]]], *, k: int, weights: Sequence[float]
) -> list[tuple[Id, float]]:
    return rrf([[i for i, _ in ranked] for ranked in lists], k=k, weights=weights)


def _by_score(
    lists: Sequence[Sequence[tuple[Id, float]]], *, k: int, weights: Sequence[float]
) -> list[tuple[Id, float]]:
    return dbsf(lists, weights=weights)  # no constant: the scores are normalised instead


@dataclass(frozen=True)
class _Method:
    fuse: _Fuse
    uses_k: bool  # whether the RRF constant k means anything to it (tuning varies it if so)


FusionMethod = Literal["rrf", "dbsf"]
# The fusion methods, by name: what each does with the two lists. A new method is one entry here
# (and its name in FusionMethod); the tuner's grid and the validation derive from it.
METHODS: dict[FusionMethod, _Method] = {
    "rrf": _Method(_by_rank, uses_k=True),
    "dbsf": _Method(_by_score, uses_k=False),
}
FUSION_METHODS: tuple[FusionMethod, ...] = tuple(METHODS)


@dataclass(frozen=True)
class Fusion:
    """How a version merges its dense and BM25 lists; stored in the version's metadata when it
    was tuned on the user's questions (`rag-retriever tune-fusion`), else the settings' RRF."""

    method: FusionMethod = "rrf"
    k: int = K_DEFAULT  # RRF's constant; unused by dbsf
    weights: tuple[float, float] = (1.0, 1.0)  # (dense, bm25)
    depths: tuple[int, int] = (100, 100)  # how many of each list take part

    def __post_init__(self) -> None:
        if self.method not in FUSION_METHODS:
            raise ValueError(f"fusion method must be one of {FUSION_METHODS}, got {self.method!r}")
        if self.k < 1 or min(self.depths) < 1 or len(self.depths) != 2:
            raise ValueError(f"fusion k and depths must be positive, got {self.k}, {self.depths}")
        if len(self.weights) != 2 or min(self.weights) < 0 or not any(self.weights):
            raise ValueError(f"fusion weights must be two non-negative numbers, {self.weights}")

    def fuse(
        self, dense: Sequence[tuple[Id, float]], bm25: Sequence[tuple[Id, float]]
    ) -> list[tuple[Id, float]]:
        """The fused list of (id, score), best first."""
        lists = [dense[: self.depths[0]], bm25[: self.depths[1]]]
        return METHODS[self.method].fuse(lists, k=self.k, weights=self.weights)

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
