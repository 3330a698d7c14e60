"""Metric functions and the failure classifier against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from rag_retriever.eval.metrics import (
    classify_failure,
    first_gold_rank,
    item_ranks,
    mrr_at_k,
    ndcg_at_k,
    paired_bootstrap_ci,
    recall_at_k,
)

LOG2 = math.log2


def test_single_item_recall_is_hit_at_k() -> None:
    ranking = ["a", "b", "g", "c"]
    items = [{"g", "h"}]
    assert first_gold_rank(ranking, items) == 3
    assert [recall_at_k(ranking, items, k) for k in (1, 2, 3, 10)] == [0.0, 0.0, 1.0, 1.0]
    assert mrr_at_k(ranking, items, 10) == pytest.approx(1 / 3)
    assert mrr_at_k(ranking, items, 2) == 0.0


def test_several_items_count_separately() -> None:
    ranking = ["x", "a1", "y", "b1", "a2"]
    items = [{"a1", "a2"}, {"b1"}, {"c1"}]
    assert item_ranks(ranking, items) == [2, 4, None]
    assert recall_at_k(ranking, items, 2) == pytest.approx(1 / 3)
    assert recall_at_k(ranking, items, 5) == pytest.approx(2 / 3)
    # gains at ranks 2 and 4; a2 at rank 5 satisfies an already satisfied item: no gain
    dcg = 1 / LOG2(3) + 1 / LOG2(5)
    idcg = 1 + 1 / LOG2(3) + 1 / LOG2(4)
    assert ndcg_at_k(ranking, items, 10) == pytest.approx(dcg / idcg)


def test_duplicates_and_ties_in_the_ranking_count_once() -> None:
    # Two chunks of the same item (overlapping chunks both containing the span) at ranks 1-2:
    # the second gains nothing, and a repeated key keeps its first position.
    ranking = ["g1", "g2", "g1", "z"]
    items = [{"g1", "g2"}]
    assert ndcg_at_k(ranking, items, 10) == pytest.approx(1.0)
    assert first_gold_rank(["z", "z", "g1"], items) == 2  # "z" repeated counts once


def test_ndcg_perfect_and_empty() -> None:
    items = [{"a"}, {"b"}]
    assert ndcg_at_k(["a", "b", "c"], items, 10) == pytest.approx(1.0)
    assert ndcg_at_k(["b", "a"], items, 10) == pytest.approx(1.0)
    assert ndcg_at_k(["c", "a"], items, 10) == pytest.approx((1 / LOG2(3)) / (1 + 1 / LOG2(3)))
    assert ndcg_at_k(["c"], items, 10) == 0.0
    assert ndcg_at_k(["a"], [], 10) == 0.0
    assert recall_at_k(["a"], [], 10) == 0.0


def test_ndcg_cutoff() -> None:
    items = [{"a"}]
    assert ndcg_at_k(["x", "y", "a"], items, 2) == 0.0
    assert ndcg_at_k(["x", "y", "a"], items, 3) == pytest.approx(1 / LOG2(4))


def test_one_key_satisfying_two_items() -> None:
    # One chunk holds both gold spans: the best ranking puts it first (gain 2 at rank 1).
    items = [{"c"}, {"c", "d"}]
    assert ndcg_at_k(["c"], items, 10) == pytest.approx(1.0)
    assert ndcg_at_k(["d", "c"], items, 10) == pytest.approx((1 + 1 / LOG2(3)) / 2)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"has_gold": False, "final_rank": None}, "chunking_miss"),
        ({"final_rank": 3}, "retrieved"),
        ({"final_rank": 30, "in_candidates": True, "reranked": True}, "rerank_miss"),
        ({"final_rank": 30, "in_candidates": True, "reranked": False}, "fusion_miss"),
        ({"final_rank": None, "in_dense": False, "in_bm25": False}, "both_miss"),
        ({"final_rank": 120, "in_dense": False, "in_bm25": True}, "dense_miss"),
        ({"final_rank": 120, "in_dense": True, "in_bm25": False}, "bm25_miss"),
        ({"final_rank": 120, "in_dense": True, "in_bm25": True}, "fusion_miss"),
        ({"final_rank": 40, "in_dense": True, "in_bm25": None}, "dense_miss"),
        ({"final_rank": None, "in_dense": None, "in_bm25": False}, "bm25_miss"),
    ],
)
def test_failure_classes(kwargs: dict, expected: str) -> None:
    base = {
        "has_gold": True,
        "final_rank": None,
        "k": 10,
        "in_dense": True,
        "in_bm25": True,
        "in_candidates": False,
        "reranked": False,
    }
    assert classify_failure(**{**base, **kwargs}) == expected


def test_paired_bootstrap_interval_brackets_the_mean_gain() -> None:
    new = [1.0, 0.5, 1.0, 0.0, 1.0, 0.25, 1.0, 1.0]
    old = [0.5, 0.5, 1.0, 0.0, 0.0, 0.25, 1.0, 0.5]
    low, high = paired_bootstrap_ci(new, old)
    mean = sum(n - o for n, o in zip(new, old, strict=True)) / len(new)
    assert low <= mean <= high and low < high
    assert paired_bootstrap_ci(new, old) == (low, high)  # seeded
    assert paired_bootstrap_ci([0.5] * 4, [0.5] * 4) == (0.0, 0.0)
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0], [])
