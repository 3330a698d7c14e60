"""The one judge of "is the new one better" (rag_retriever/eval/judge.py), on hand-computed cases.

It decides the ingest gate, each `improve` step and its promotion, the fusion tuner's choice and
the training commands' verdict; those callers are tested for their own behaviour elsewhere.
"""

from __future__ import annotations

import pytest

from rag_retriever.eval.judge import judge

M, T, G = "mrr@10", "recall@1", "recall@10"


@pytest.mark.parametrize(
    ("new", "old", "better", "worse"),
    [
        ({M: 0.6, T: 0.1}, {M: 0.5, T: 0.9}, True, False),  # the metric decides first
        ({M: 0.5, T: 0.9}, {M: 0.6, T: 0.1}, False, True),
        ({M: 0.5, T: 0.5}, {M: 0.5, T: 0.25}, True, False),  # a tie: the tie-break decides
        ({M: 0.5, T: 0.25}, {M: 0.5, T: 0.5}, False, True),
        ({M: 0.5, T: 0.5}, {M: 0.5, T: 0.5}, False, False),  # equal on both: neither
    ],
)
def test_metric_then_tie_break(
    new: dict[str, float], old: dict[str, float], better: bool, worse: bool
) -> None:
    verdict = judge(new, old, metric=M, tie_break=T)
    assert (verdict.better, verdict.worse) == (better, worse)
    assert verdict.change == new[M] - old[M]


def test_without_a_tie_break_equal_is_no_change() -> None:
    verdict = judge({M: 0.5, T: 0.75}, {M: 0.5, T: 0.25}, metric=M)
    assert (verdict.better, verdict.worse, verdict.change) == (False, False, 0.0)


@pytest.mark.parametrize(
    ("new", "old", "allowed", "regressed"),
    [
        (0.75, 1.0, 0.25, False),  # fell by exactly the allowed amount: accepted
        (0.5, 1.0, 0.25, True),  # fell by more
        (0.75, 1.0, 0.0, True),
        (1.0, 1.0, 0.0, False),  # no change never regresses
        (1.0, 0.5, 0.0, False),
    ],
)
def test_allowed_regression(new: float, old: float, allowed: float, regressed: bool) -> None:
    assert judge({G: new}, {G: old}, metric=G, max_regression=allowed).regressed is regressed


def test_the_guard_metric_is_checked_separately_from_the_metric() -> None:
    """improve's gate: better on MRR@10, but recall@10 fell by more than allowed."""
    new = {M: 0.75, T: 0.5, G: 0.5}
    old = {M: 0.5, T: 0.5, G: 1.0}
    verdict = judge(new, old, metric=M, tie_break=T, guard=G, max_regression=0.25)
    assert verdict.better and verdict.regressed
    assert not judge(new, old, metric=M, guard=G, max_regression=0.5).regressed
