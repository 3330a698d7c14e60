"""Retrieval metrics and the failure classifier: pure functions over ranked lists and gold items.

Example:
    >>> ranking = ["c1", "c7", "c3"]
    >>> items = [{"c3", "c4"}]           # one gold item, satisfied by c3 or c4
    >>> first_gold_rank(ranking, items), recall_at_k(ranking, items, 2), mrr_at_k(ranking, items, 10)
    (3, 0.0, 0.3333333333333333)

A *gold item* is a set of keys (chunk rows, or document ids at document level) any one of which
answers it: the chunks that contain one gold span, or the chunks (documents) of one gold
document. A question may have several items. Repeated keys in a ranking count once, at their
first position; a key that satisfies an item already satisfied earlier gains nothing.

- recall@k: the fraction of a question's items satisfied within the first k positions (BEIR's
  recall when items are documents; hit@k when there is one item).
- MRR@k: 1 / rank of the first position that satisfies any item, 0 beyond k.
- nDCG@k: binary gains; position i gains the number of items it newly satisfies, discounted by
  log2(i + 1); divided by the DCG of the best ranking of the gold keys (greedy maximum coverage,
  exact when each key satisfies at most one item), capped at 1.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence, Set
from typing import Literal, get_args

Key = Hashable
FailureClass = Literal[
    "retrieved",
    "dense_miss",
    "bm25_miss",
    "both_miss",
    "rerank_miss",
    "fusion_miss",
    "chunking_miss",
]
FAILURE_CLASSES: tuple[FailureClass, ...] = get_args(FailureClass)


def _dedupe(ranking: Sequence[Key]) -> list[Key]:
    return list(dict.fromkeys(ranking))


def item_ranks(ranking: Sequence[Key], items: Sequence[Set[Key]]) -> list[int | None]:
    """For each item, the 1-based rank of the first key that satisfies it (None: never)."""
    position: dict[Key, int] = {}
    for rank, key in enumerate(_dedupe(ranking), start=1):
        position[key] = rank
    out: list[int | None] = []
    for item in items:
        ranks = [position[k] for k in item if k in position]
        out.append(min(ranks) if ranks else None)
    return out


def first_gold_rank(ranking: Sequence[Key], items: Sequence[Set[Key]]) -> int | None:
    """1-based rank of the first key that satisfies any item; None if none does."""
    ranks = [r for r in item_ranks(ranking, items) if r is not None]
    return min(ranks) if ranks else None


def recall_from_ranks(ranks: Sequence[int | None], k: int) -> float:
    """recall@k from `item_ranks` (lets a curve over many k reuse one pass)."""
    if not ranks:
        return 0.0
    return sum(1 for r in ranks if r is not None and r <= k) / len(ranks)


def recall_at_k(ranking: Sequence[Key], items: Sequence[Set[Key]], k: int) -> float:
    return recall_from_ranks(item_ranks(ranking, items), k)


def mrr_at_k(ranking: Sequence[Key], items: Sequence[Set[Key]], k: int) -> float:
    rank = first_gold_rank(ranking, items)
    return 0.0 if rank is None or rank > k else 1.0 / rank


def _gains(ranking: Sequence[Key], items: Sequence[Set[Key]], k: int) -> list[int]:
    satisfied = [False] * len(items)
    gains = []
    for key in _dedupe(ranking)[:k]:
        gain = 0
        for i, item in enumerate(items):
            if not satisfied[i] and key in item:
                satisfied[i] = True
                gain += 1
        gains.append(gain)
    return gains


def _dcg(gains: Sequence[int]) -> float:
    return sum(g / math.log2(i + 2) for i, g in enumerate(gains))


def ndcg_at_k(ranking: Sequence[Key], items: Sequence[Set[Key]], k: int) -> float:
    if not items:
        return 0.0
    # The ideal ranking: repeatedly take the key that satisfies the most unsatisfied items.
    remaining = [set(item) for item in items]
    ideal: list[int] = []
    while len(ideal) < k and any(remaining):
        candidates = set().union(*remaining)
        best = max(sorted(candidates, key=repr), key=lambda c: sum(c in r for r in remaining))
        ideal.append(sum(best in r for r in remaining))
        remaining = [r if best not in r else set() for r in remaining]
    idcg = _dcg(ideal)
    return 0.0 if idcg == 0 else min(1.0, _dcg(_gains(ranking, items, k)) / idcg)


def classify_failure(
    *,
    has_gold: bool,
    final_rank: int | None,
    k: int,
    in_dense: bool | None,
    in_bm25: bool | None,
    in_candidates: bool,
    reranked: bool,
) -> FailureClass:
    """Which stage lost the gold chunk of one question (evaluated at rank k of the final mode).

    `in_dense` / `in_bm25`: whether the gold was in that stage's top-N (None: stage not run).
    `in_candidates`: whether it was among the top-M fused candidates (the set a reranker sees).

    - `chunking_miss`: no chunk contains the gold span, so no retriever could find it.
    - `retrieved`: the final rank is within k.
    - `rerank_miss` / `fusion_miss`: among the candidates, but the reranker (or, without one,
      the fusion) ranked it below k; also used when both lists found it but fusion put it
      below the candidates.
    - `dense_miss` / `bm25_miss`: not among the candidates, and that list did not find it
      while the other did.
    - `both_miss`: neither list found it.
    A single-list evaluation (dense or BM25 only) can only say that list missed.
    """
    if not has_gold:
        return "chunking_miss"
    if final_rank is not None and final_rank <= k:
        return "retrieved"
    if in_bm25 is None:
        return "dense_miss"
    if in_dense is None:
        return "bm25_miss"
    if in_candidates:
        return "rerank_miss" if reranked else "fusion_miss"
    if in_dense is False and in_bm25 is False:
        return "both_miss"
    if in_dense is False:
        return "dense_miss"
    if in_bm25 is False:
        return "bm25_miss"
    # Both lists found it, but not within the fused candidates the final stage looked at.
    return "rerank_miss" if reranked else "fusion_miss"


def paired_bootstrap_ci(
    new: Sequence[float], old: Sequence[float], *, iterations: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% interval of mean(new - old) over the same questions (paired bootstrap, seeded).

    >>> paired_bootstrap_ci([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    (1.0, 1.0)
    """
    import numpy as np

    if len(new) != len(old) or not new:
        raise ValueError("paired_bootstrap_ci needs two equally long, non-empty lists")
    diff = np.asarray(new, dtype=np.float64) - np.asarray(old, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(iterations, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)
