"""Reciprocal rank fusion against a brute-force version and hand-computed cases."""

from __future__ import annotations

import itertools
from typing import Any, get_args

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rag_retriever.errors import InvalidRequest
from rag_retriever.query.fusion import METHODS, Fusion, adaptive, dbsf, minmax, rrf, zscore
from rag_retriever.records import FusionMethod


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


def test_fusion_weighs_each_list_to_its_depth_keeps_the_rest_and_round_trips() -> None:
    dense = [("a", 0.9), ("b", 0.8), ("c", 0.7)]
    bm25 = [("c", 9.0), ("d", 5.0), ("e", 1.0)]
    fusion = Fusion("rrf", k=10, weights=(1.0, 2.0), depths=(1, 2))
    head = rrf([["a"], ["c", "d"]], k=10, weights=[1.0, 2.0])
    # b (dense rank 2) and e (BM25 rank 3) were cut from the fusion, not from the list
    assert fusion.fuse(dense, bm25) == [*head, ("b", 0.0), ("e", 0.0)]
    assert Fusion.from_json(fusion.to_json()) == fusion
    assert fusion.describe() == "rrf k=10 weights(dense,bm25)=1,2 depths=1,2"
    bad_values: list[dict[str, Any]] = [
        {"method": "max"},
        {"k": 0},
        {"weights": (0.0, 0.0)},
        {"weights": (1.0, float("nan"))},
        {"weights": (-1.0, 1.0)},
        {"depths": (0, 5)},
    ]
    for bad in bad_values:
        with pytest.raises(InvalidRequest):
            Fusion(**bad)
    with pytest.raises(InvalidRequest, match="rrf, dbsf, minmax, zscore, adaptive"):
        Fusion.from_json({"method": "max", "k": 60, "weights": [1, 1], "depths": [100, 100]})


def test_every_method_has_a_name_and_the_names_a_method() -> None:
    assert tuple(METHODS) == get_args(FusionMethod)


# -- the score fusions against a brute-force version of their definitions ----------------------


def _oracle(
    lists: list[list[tuple[str, float]]], weights: list[float], method: str
) -> dict[str, float]:
    """The definitions written out: each list's first score per id, normalised over the list's
    distinct ids (the z-score shifted so the list's lowest is 0; a list of equal scores gives 1
    each), an absent id 0 (below the list's last entry), times weight x confidence."""
    ids = {i for ranked in lists for i, _ in ranked}
    total = dict.fromkeys(ids, 0.0)
    for ranked, w in zip(lists, weights, strict=True):
        first: dict[str, float] = {}
        for i, v in ranked:
            first.setdefault(i, v)
        if not first:
            continue
        values = np.array(list(first.values()), dtype=np.float64)
        if method == "minmax":
            spread = values.max() - values.min()
            norm = np.ones_like(values) if spread == 0 else (values - values.min()) / spread
            confidence = 1.0
        else:
            std = values.std()
            z = np.zeros_like(values) if std == 0 else (values - values.mean()) / std
            norm = z - z.min() if std else np.ones_like(values)
            confidence = float(z.max()) if method == "adaptive" else 1.0
        by_id = dict(zip(first, norm, strict=True))
        for i in ids:
            total[i] += w * confidence * (float(by_id[i]) if i in by_id else 0.0)
    return total


SCORED = st.lists(
    st.lists(st.tuples(st.sampled_from("abcdefgh"), st.floats(-50, 50)), max_size=10),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("method", ["minmax", "zscore", "adaptive"])
@given(lists=SCORED, data=st.data())
def test_score_fusions_match_their_definitions(
    method: str, lists: list[list[tuple[str, float]]], data: st.DataObject
) -> None:
    weights = data.draw(st.lists(st.floats(0, 3), min_size=len(lists), max_size=len(lists)))
    fused = {"minmax": minmax, "zscore": zscore, "adaptive": adaptive}[method](
        lists, weights=weights
    )
    expected = _oracle(lists, weights, method)
    assert {i for i, _ in fused} == set(expected)
    for item, score in fused:
        assert score == pytest.approx(expected[item], rel=1e-9, abs=1e-9)
        assert score >= -1e-12  # an absent id adds 0: no score below an unseen one
    values = [s for _, s in fused]
    assert values == sorted(values, reverse=True)


def test_minmax_is_a_convex_combination() -> None:
    dense = [("a", 0.9), ("b", 0.7), ("c", 0.5)]
    bm25 = [("c", 20.0), ("b", 15.0), ("a", 10.0)]
    # dense normalised a 1, b .5, c 0; BM25 c 1, b .5, a 0
    fused = dict(minmax([dense, bm25], weights=[0.3, 0.7]))
    assert fused == pytest.approx({"a": 0.3, "b": 0.5, "c": 0.7})
    assert [i for i, _ in minmax([dense, bm25], weights=[1, 0])] == ["a", "b", "c"]
    assert [i for i, _ in minmax([dense, bm25], weights=[0, 1])] == ["c", "b", "a"]


def test_zscore_hand_computed() -> None:
    # list 1: mean 2, std 1 -> a z=+1, b z=-1; list 2: mean 1, std 1 -> b +1, c -1
    fused = dict(zscore([[("a", 3.0), ("b", 1.0)], [("b", 2.0), ("c", 0.0)]]))
    # shifted to each list's lowest z: a 2 + (absent) 0, b 0 + 2, c (absent) 0 + 0
    assert fused == pytest.approx({"a": 2.0, "b": 2.0, "c": 0.0})


def test_adaptive_trusts_the_list_whose_best_stands_out() -> None:
    # dense: a flat list (its best barely above the rest); BM25: one clear match
    dense = [("x", 0.52), ("y", 0.51), ("g", 0.50), ("z", 0.50)]
    bm25 = [("g", 30.0), ("x", 2.0), ("y", 1.5), ("z", 1.0)]
    assert adaptive([dense, bm25])[0][0] == "g"
    # plain z-scores blow the flat list's noise up to the scale of a clear match: x wins there
    assert zscore([dense, bm25])[0][0] == "x"
    # the same lists with the roles swapped: the dense list's clear match wins
    swapped = [("g", 0.95), ("x", 0.30), ("y", 0.29), ("z", 0.28)]
    flat = [("x", 5.2), ("y", 5.1), ("g", 5.0), ("z", 5.0)]
    assert adaptive([swapped, flat])[0][0] == "g"
    # confidence is per query: the weight of a list with no spread is 0
    assert adaptive([[("a", 1.0), ("b", 1.0)], [("b", 3.0), ("a", 1.0)]])[0][0] == "b"


def test_adaptive_ranks_the_one_chunk_bm25_matches_beside_the_embeddings_best() -> None:
    """A question naming an error code that one chunk holds: BM25 returns that chunk alone (a
    list with no spread). It used to add 0 and sort after every dense hit (rank 101 here, out of
    a reranker's candidates); a complete list's lone entry counts as much as the dense list's
    best (found by a review)."""
    dense = [(f"d{i}", 0.6 - 0.002 * i) for i in range(100)]
    fused = Fusion("adaptive").fuse(dense, [("X", 14.2)])
    assert [i for i, _ in fused[:2]] == ["d0", "X"]
    assert fused[1][1] == pytest.approx(fused[0][1])  # the dense best's strength; ties: dense first
    # ties in a short BM25 list (two copies of one passage) alike
    twins = Fusion("adaptive").fuse(dense, [("X", 9.0), ("Y", 9.0)])
    assert [i for i, _ in twins[:3]] == ["d0", "X", "Y"]
    # three equal floats have a std of ~1e-16, not 0: still no spread
    triplets = Fusion("adaptive").fuse(dense, [("X", 0.1), ("Y", 0.1), ("Z", 0.1)])
    assert [i for i, _ in triplets[:4]] == ["d0", "X", "Y", "Z"]
    # in the dense list too, a lone BM25 match adds to it: it comes first
    assert Fusion("adaptive").fuse(dense, [("d50", 3.0)])[0][0] == "d50"
    # a flat list as deep as asked (not every match) still adds nothing
    flat = [(f"b{i}", 2.0) for i in range(100)]
    assert [i for i, _ in Fusion("adaptive").fuse(dense, flat)[:100]] == [i for i, _ in dense]
    # lists that both have no spread: each lone entry at strength 1
    assert dict(adaptive([[("a", 0.5)], [("b", 3.0)]], complete=[True, True])) == {
        "a": 1.0,
        "b": 1.0,
    }
    # a tuned depth deeper than the fetch: a flat BM25 list of the 50 asked was cut by the
    # fetch, not complete, and adds nothing (it was read as every match, each at dense's best)
    deep = Fusion("adaptive", depths=(100, 200))
    flat50 = [(f"b{i}", 2.0) for i in range(50)]
    cut = deep.fuse(dense, flat50, asked=(100, 50))
    assert [i for i, _ in cut[:100]] == [i for i, _ in dense]
    assert [i for i, _ in deep.fuse(dense, flat50)[:2]] == ["d0", "b0"]  # not told: complete


@pytest.mark.parametrize("method", ["minmax", "zscore", "adaptive"])
def test_score_fusions_edge_cases(method: str) -> None:
    fuse = {"minmax": minmax, "zscore": zscore, "adaptive": adaptive}[method]
    assert fuse([[], []]) == []
    assert [i for i, _ in fuse([[("a", 2.0), ("b", 1.0)], []])] == ["a", "b"]
    assert [i for i, _ in fuse([[("a", 2.0), ("a", 9.0), ("b", 1.0)]])] == ["a", "b"]
    with pytest.raises(ValueError):
        fuse([[("a", 1.0)]], weights=[1.0, 1.0])


@pytest.mark.parametrize("method", list(METHODS))
@given(
    dense=st.lists(st.tuples(st.sampled_from("abcdefghij"), st.floats(0, 1)), max_size=10),
    bm25=st.lists(st.tuples(st.sampled_from("abcdefghij"), st.floats(0, 30)), max_size=10),
    depths=st.tuples(st.integers(1, 12), st.integers(1, 12)),
)
def test_a_fused_list_is_as_deep_as_both_lists_whatever_the_depths(
    method: FusionMethod,
    dense: list[tuple[str, float]],
    bm25: list[tuple[str, float]],
    depths: tuple[int, int],
) -> None:
    fused = Fusion(method, weights=(1.0, 2.0), depths=depths).fuse(dense, bm25)
    ids = [i for i, _ in fused]
    assert len(ids) == len(set(ids)) == len({i for i, _ in dense} | {i for i, _ in bm25})
    # what the depths choose comes first, untouched (a list cut by its depth is not complete)
    head = METHODS[method].fuse(
        [dense[: depths[0]], bm25[: depths[1]]],
        k=60,
        weights=(1.0, 2.0),
        complete=(len(dense) < depths[0], len(bm25) < depths[1]),
    )
    assert fused[: len(head)] == head
    assert all(s == 0.0 for _, s in fused[len(head) :])
