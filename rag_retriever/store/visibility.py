"""Which points a version sees on the server path, as data: a point's visibility fields, its
physical id, a version's ancestry as runs of version numbers, and the filters and checks made
of them. Pure: no client calls (store/server.py makes them).

Example:
    >>> runs = ancestry(((3, 4),), 4, 5)                  # version 5, derived from 4
    >>> runs, sees(runs, {ADDED: 3, REMOVED: [5]}), sees(runs, {ADDED: 4, REMOVED: [6]})
    (((3, 5),), False, True)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Final

# The visibility fields of a point (never a chunk record's own: those have no leading "_").
PID: Final = "_rag_pid"
ADDED: Final = "_rag_added"
REMOVED: Final = "_rag_removed"
NAMESPACE: Final = uuid.UUID("6f1c2a52-3d0e-4f39-9a53-7c0de1b2e7a4")

Runs = tuple[tuple[int, int], ...]


def point_id(pid: str, number: int) -> str:
    """The physical id of logical point `pid` as version `number` wrote it."""
    return str(uuid.uuid5(NAMESPACE, f"{pid}@{number}"))


def ancestry(base: Runs, base_number: int, number: int) -> Runs:
    """The runs a version derived from `base` sees: the base's, and its own number.

    >>> ancestry(((3, 7),), 7, 8), ancestry(((3, 7),), 7, 10)
    (((3, 8),), ((3, 7), (10, 10)))
    """
    lo, hi = base[-1]
    if hi == base_number and number == base_number + 1:
        return (*base[:-1], (lo, number))
    return (*base, (number, number))


def within(runs: Runs, number: int) -> bool:
    return any(lo <= number <= hi for lo, hi in runs)


def sees(runs: Runs, payload: Mapping[str, Any]) -> bool:
    """Whether a version with these runs sees a point with this payload: `visible` in Python.

    >>> sees(((3, 5),), {ADDED: 3, REMOVED: [6]}), sees(((3, 5),), {ADDED: 3, REMOVED: [4]})
    (True, False)
    """
    return within(runs, int(payload[ADDED])) and not any(
        within(runs, int(n)) for n in payload.get(REMOVED) or ()
    )


def where_id(pid: str) -> str:
    """The id of logical point `pid`'s "where" point (the versions that wrote it)."""
    return str(uuid.uuid5(NAMESPACE, f"where:{pid}"))


def gaps(runs: Iterable[tuple[int, int]], newest: int) -> Runs:
    """The numbers from 0 to `newest` in none of these runs, as runs.

    >>> gaps([(3, 5), (8, 8), (4, 6)], 9)
    ((0, 2), (7, 7), (9, 9))
    """
    out: list[tuple[int, int]] = []
    at = 0
    for lo, hi in sorted(runs):
        if lo > at:
            out.append((at, min(lo - 1, newest)))
        at = max(at, hi + 1)
    if at <= newest:
        out.append((at, newest))
    return tuple((lo, hi) for lo, hi in out if lo <= hi)


def visible(runs: Runs) -> Any:
    """The points a version with these runs sees: added in one of them, removed in none."""
    from qdrant_client import models as qm

    def within(key: str) -> list[Any]:
        return [qm.FieldCondition(key=key, range=qm.Range(gte=lo, lte=hi)) for lo, hi in runs]

    return qm.Filter(should=within(ADDED), must_not=[qm.Filter(should=within(REMOVED))])
