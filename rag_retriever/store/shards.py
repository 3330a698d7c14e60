"""The shards of an embedded version, as data: the manifest a version reads, the merge policy
that keeps the shard count and the tombstones bounded, and the helpers that merge the shards'
ranked lists. Pure: no engine, no files (store/edge.py reads and writes them).

Example:
    >>> base, d1, d2, d3 = (Segment("b", 1000), Segment("x", 40), Segment("y", 20), Segment("z", 10))
    >>> merge_from([d1, d2, d3])          # the newest run to merge into one delta shard
    0
    >>> merge_due([base, d1])
    False
    >>> merge_due([base, Segment("b2", 1000), d1], bases=2)   # a base of two shards
    False

Does not decide when a compaction runs (ingest/compaction.py) or write a shard (edge.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rag_retriever.settings import default_of
from rag_retriever.store.base import StageQuery

# Delta shards are merged like a binary counter: the newest two whenever the older one holds at
# most MERGE_RATIO times the newer one's points. For equal deltas that keeps at most ~5 delta
# shards and copies each delta point ~6 times over 100 deltas (simulated), so merges stay small.
MERGE_RATIO = 2
# And no more than this many delta shards (more are merged inside the update in inline mode, and
# make a compaction due otherwise): each costs one engine call per query (0.3-2 ms at
# 100k points; with 4, hybrid p50 after 100 1% deltas was 2.0-2.4x a fresh build). With 2, the
# deltas copy ~19% more points in merges (simulated over 100 1% deltas at 100k) and a version
# reads at most 3 shards once its merges are done (2.6 on average, was 3.0).
MAX_DELTA_SHARDS = 2
# When the delta shards' points (live or tombstoned in the base) exceed this share of the base's,
# everything is merged into a new base (a full HNSW build), so over-fetching past tombstones and
# the shard count stay bounded.
BASE_MERGE_FRACTION = 0.5
# A base holds at most this many points a shard (RAG_BASE_SHARD_POINTS' default, settings.py):
# a full build (or a base merge) past it writes several base shards, each sealed on its own, so
# a build's memory is one shard's. Each base shard costs one engine call per query.
BASE_SHARD_POINTS: int = default_of("base_shard_points")


@dataclass(frozen=True)
class Segment:
    """One shard as a version reads it: its id, its points, and the ids it no longer serves."""

    id: str
    points: int
    deleted: frozenset[str] = frozenset()

    @property
    def live(self) -> int:
        return self.points - len(self.deleted)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "points": self.points, "deleted": sorted(self.deleted)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Segment:
        return cls(str(data["id"]), int(data["points"]), frozenset(data.get("deleted") or ()))


@dataclass(frozen=True)
class Manifest:
    """The shards of a version, oldest first: the first `bases` are the base (one, or several
    of at most BASE_SHARD_POINTS points each), the rest delta shards; `own` is the one this
    version writes."""

    segments: tuple[Segment, ...] = ()
    own: str | None = None
    merges: tuple[str, ...] = field(default=(), compare=False)
    bases: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "segments": [s.to_json() for s in self.segments],
            "own": self.own,
            "bases": self.bases,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        # manifests written before a base could be several shards have no "bases": one
        return cls(
            tuple(Segment.from_json(s) for s in data["segments"]),
            data.get("own"),
            bases=int(data.get("bases", 1)),
        )


@dataclass(frozen=True)
class Compaction:
    """A running compaction of `alias`: `shards` receive the live points of `segments`, a run
    of consecutive shards of version `source` when it started: all of them (`kind` "base": a
    new base, of one shard or of BASE_SHARD_POINTS-sized shards), or its newest delta shards
    ("deltas": one delta shard in their place). The marker file (`fd`) stays locked by this
    process until `end_compaction`; a process that dies lets go of it, so a marker nobody holds
    is stale and names nothing. Once built: `counts`, the points of each new shard."""

    alias: str
    source: str
    segments: tuple[Segment, ...]
    shards: tuple[str, ...]
    fd: int = field(compare=False, repr=False)
    points: int = 0
    kind: str = "base"
    counts: tuple[int, ...] = ()


def outgrown(segments: Sequence[Segment], bases: int = 1) -> bool:
    """Whether the delta shards (and the base's tombstones) exceed BASE_MERGE_FRACTION of the
    base (its first `bases` shards): past it, the shards are worth merging into a new base."""
    base, deltas = segments[:bases], segments[bases:]
    if not deltas:
        return False
    held = sum(s.points for s in base)
    return sum(s.points for s in deltas) + sum(len(s.deleted) for s in base) > (
        BASE_MERGE_FRACTION * held
    )


def merge_from(deltas: Sequence[Segment], cap: float = math.inf) -> int:
    """Where the newest delta shards to merge into one begin (`len(deltas)`: none). Like a binary
    counter: the run grows backwards while the next older shard holds at most MERGE_RATIO times
    the run's live points, and (`cap`) while the merge holds at most `cap` points. Without a cap,
    all of them when more than MAX_DELTA_SHARDS would be left; with one, that merge is a
    compaction's (`merge_due`)."""
    if len(deltas) < 2:
        return len(deltas)
    start, points = len(deltas) - 1, deltas[-1].live
    while (
        start > 0
        and deltas[start - 1].live <= MERGE_RATIO * points
        and points + deltas[start - 1].live <= cap
    ):
        start -= 1
        points += deltas[start].live
    if start == len(deltas) - 1:  # the newest shard merges with none
        start = len(deltas)
    if cap == math.inf and min(start + 1, len(deltas)) > MAX_DELTA_SHARDS:
        return 0
    return start


def too_many_deltas(segments: Sequence[Segment], bases: int = 1) -> bool:
    return len(segments) - bases > MAX_DELTA_SHARDS


def merge_due(segments: Sequence[Segment], bases: int = 1) -> bool:
    """Whether a compaction is due: the deltas outgrew the base, or an update left more than
    MAX_DELTA_SHARDS delta shards (their merge was too big for it, INLINE_MERGE_POINTS)."""
    return outgrown(segments, bases) or too_many_deltas(segments, bases)


def base_shards(points: int, cap: int = BASE_SHARD_POINTS) -> int:
    """How many shards a base of `points` points is written as (at least one)."""
    return max(1, math.ceil(points / cap))


def limited(queries: Sequence[StageQuery], limits: Sequence[int]) -> list[StageQuery]:
    return [
        q if q.limit == n else replace(q, limit=n) for q, n in zip(queries, limits, strict=True)
    ]


@dataclass
class Head:
    """A shard's score-ordered points up to its `limit`-th live one: every id read (`names`,
    by position), the live ones with their scores, and the last one's score (`floor`; None
    when the list holds fewer live points)."""

    names: list[str]
    live: list[tuple[str, float]]
    floor: float | None


def live_head(points: Sequence[Any], limit: int, deleted: frozenset[str]) -> Head:
    names: list[str] = []
    live: list[tuple[str, float]] = []
    for point in points:
        pid = str(point.id)
        names.append(pid)
        if pid not in deleted:
            live.append((pid, float(point.score)))
            if len(live) == limit:
                return Head(names, live, live[-1][1])
    return Head(names, live, None)


def ranked(shard: int, points: Sequence[Any]) -> Iterator[tuple[float, int, int]]:
    """(-score, shard, position) of a shard's score-ordered points, for `heapq.merge`."""
    for at, point in enumerate(points):
        yield -point.score, shard, at
