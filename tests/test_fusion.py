"""Reciprocal rank fusion against a brute-force version and hand-computed cases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rag_retriever.fusion import Fusion, dbsf, rrf


def brute_force(lists: list[list[str]], k: int, weights: list[float]) -> dict[str, float]:
    ids = set(itertools.chain.from_iterable(lists))
    scores = {}
    for item in ids:
        total = 0.0
        for ranked, w in zip(lists, weights, strict=True):
            if item in ranked:
                total += w / (k + ranked.index(item) + 1)
        scores[item] = total
    return scores


@given(
    st.lists(st.lists(st.sampled_from("abcdefghij"), max_size=12), min_size=1, max_size=4),
    st.integers(1, 100),
    st.data(),
)
def test_matches_brute_force(lists: list[list[str]], k: int, data: st.DataObject) -> None:
    weights = data.draw(st.lists(st.floats(0, 3), min_size=len(lists), max_size=len(lists)))
    fused = rrf(lists, k=k, weights=weights)
    expected = brute_force(lists, k, weights)
    assert {i for i, _ in fused} == set(expected)
    for item, score in fused:
        assert score == pytest.approx(expected[item], rel=1e-12)
    values = [s for _, s in fused]
    assert values == sorted(values, reverse=True)


def test_hand_computed() -> None:
    fused = rrf([["a", "b", "c"], ["c", "a"]], k=60)
    assert [i for i, _ in fused] == ["a", "c", "b"]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 62)
    assert fused[1][1] == pytest.approx(1 / 63 + 1 / 61)


def test_ties_break_by_best_rank_then_list_order() -> None:
    # a and x both score 1/61 + 0: the tie keeps the first list's item first
    assert [i for i, _ in rrf([["a"], ["x"]], k=60)] == ["a", "x"]
    # b (ranks 2 and 3) vs c (ranks 3 and 2) tie exactly; best rank equal -> first list first
    fused = rrf([["a", "b", "c"], ["a", "c", "b"]], k=60)
    assert [i for i, _ in fused] == ["a", "b", "c"]


def test_one_empty_list_keeps_the_other_order() -> None:
    assert [i for i, _ in rrf([[], ["c", "b", "a"]])] == ["c", "b", "a"]
    assert rrf([[], []]) == []


def test_disjoint_lists_interleave() -> None:
    assert [i for i, _ in rrf([["a", "b"], ["x", "y"]])] == ["a", "x", "b", "y"]


def test_duplicates_within_a_list_count_once() -> None:
    fused = dict(rrf([["a", "a", "b"]], k=60))
    assert fused["a"] == pytest.approx(1 / 61)
    assert fused["b"] == pytest.approx(1 / 63)


def test_weights() -> None:
    fused = rrf([["a"], ["b"]], k=60, weights=[1.0, 2.0])
    assert [i for i, _ in fused] == ["b", "a"]
    with pytest.raises(ValueError):
        rrf([["a"]], weights=[1.0, 1.0])
    with pytest.raises(ValueError):
        rrf([["a"]], k=0)


def test_dbsf_hand_computed() -> None:
    # list 1: mean .7, std .2 -> [.1, 1.3]; list 2: mean 7.5, std 4.5 -> [-6, 21]
    fused = dict(dbsf([[("a", 0.9), ("b", 0.5)], [("b", 12.0), ("c", 3.0)]], weights=[1, 2]))
    assert fused["a"] == pytest.approx(0.8 / 1.2)
    assert fused["b"] == pytest.approx(0.4 / 1.2 + 2 * 18 / 27)
    assert fused["c"] == pytest.approx(2 * 9 / 27)
    assert dbsf([[("x", 3.0), ("y", 3.0)]]) == [("x", 0.5), ("y", 0.5)]  # no spread: 0.5


@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from("abcdefgh"), st.floats(-50, 50)), max_size=10),
        min_size=1,
        max_size=3,
    )
)
def test_dbsf_scores_are_bounded_by_the_weights(lists: list[list[tuple[str, float]]]) -> None:
    fused = dbsf(lists)
    assert all(0.0 <= s <= len(lists) + 1e-9 for _, s in fused)
    assert [s for _, s in fused] == sorted((s for _, s in fused), reverse=True)
    assert {i for i, _ in fused} == {i for ranked in lists for i, _ in ranked}


def test_fusion_cuts_each_list_at_its_depth_and_round_trips() -> None:
    dense = [("a", 0.9), ("b", 0.8), ("c", 0.7)]
    bm25 = [("c", 9.0), ("d", 5.0), ("e", 1.0)]
    fusion = Fusion("rrf", k=10, weights=(1.0, 2.0), depths=(1, 2))
    assert fusion.fuse(dense, bm25) == rrf([["a"], ["c", "d"]], k=10, weights=[1.0, 2.0])
    assert Fusion.from_json(fusion.to_json()) == fusion
    assert fusion.describe() == "rrf k=10 weights(dense,bm25)=1,2 depths=1,2"
    for bad in ({"method": "max"}, {"k": 0}, {"weights": (0.0, 0.0)}, {"depths": (0, 5)}):
        with pytest.raises(ValueError):
            Fusion(**bad)
