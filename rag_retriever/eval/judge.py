"""The one judge of "is the new one better": two sets of figures compared on a metric, a
tie-break and an allowed regression.

Example:
    >>> v = judge({"mrr@10": 0.80, "recall@1": 0.70}, {"mrr@10": 0.80, "recall@1": 0.68},
    ...           metric="mrr@10", tie_break="recall@1")
    >>> v.better, v.worse, v.regressed
    (True, False, False)

`better` / `worse`: the new figures beat / lose to the old on (metric, tie-break), compared in
that order; equal on both is neither. `regressed`: the `guard` metric (the metric itself unless
named) fell by more than `max_regression` (an absolute difference: 0.01 = one point). Each
caller picks what it needs: the ingest gate refuses a version that regressed, a training step
is kept when it is better, `improve` promotes when the new version is better and did not
regress on recall@10. Not handled: significance (the caller may report an interval).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    better: bool
    worse: bool
    regressed: bool
    change: float  # new minus old on the metric


def judge(
    new: Mapping[str, float],
    old: Mapping[str, float],
    *,
    metric: str,
    tie_break: str | None = None,
    guard: str | None = None,
    max_regression: float = 0.0,
) -> Verdict:
    """New against old (see the module docstring); figures are looked up by name."""
    keys = (metric,) if tie_break is None else (metric, tie_break)
    ours, theirs = tuple(new[k] for k in keys), tuple(old[k] for k in keys)
    watched = guard or metric
    return Verdict(
        better=ours > theirs,
        worse=ours < theirs,
        regressed=old[watched] - new[watched] > max_regression,
        change=new[metric] - old[metric],
    )
