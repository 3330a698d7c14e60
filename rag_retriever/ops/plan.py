"""`rag-retriever plan`: memory, disk, build time, latency and edit cost of a corpus size and a
load, per quantization setting, from constants a benchmark measured.

Example:
    >>> plan = make_plan(Brief(chunks=20_000_000, qps=50, p95_ms=150, edits_per_day=20_000),
    ...                  load_constants())                             # doctest: +SKIP

The constants (capacity.json beside this module, or `--constants FILE`) are what
`python -m bench.bench_engine --sizes ... --quantization none int8 binary binary2 --constants-out FILE`
measured on one machine: per setting and size, build (write + seal) time, disk, the serving
process's memory (what it needs resident: its RSS less a quantized version's float32 originals
read to rescore, which the kernel drops and reads again; its peak RSS in constants without
that figure), and single-client engine latency; plus the query encoding time and the cost
of an edit. Each figure is fitted as a power of the chunk count through the measured sizes
(y = c * n^e; e is printed), so a size between them is interpolated and one past the largest is
extrapolated, and the plan says by how far. Past the base shard size (RAG_BASE_SHARD_POINTS,
the setting the deployment will build with) a version is several base shards of n/k chunks
each: its latency, build time and disk are k times one shard's fitted figure (a query asks the
shards in turn), its build's peak one shard's (they are sealed one at a time); the fits go
through the sizes measured as one shard, and a shard bigger than any of them is extrapolated
(said too). The largest version measured as several shards checks that model: where it took
more (10M binary chunks as 10 shards: a build's private peak 1.17x the model's; 3M float32:
p50 1.30x, p95 2.96x), latency and a build's private
peak from its size on are scaled up by the ratio (`_Checked`), and past the largest size
measured memory grows at least in proportion to the corpus (`_AtLeastLinear`).
Fewer, bigger shards cost a query less (HNSW grows slowly with a shard's size, k shards cost k
searches) and a build more memory. What the fit cannot know is said beside it: latency
under load is a queueing estimate (a query holds one core for its service time), not a
measurement; a cluster's per-node figures are the corpus divided by its nodes, its network and
fan-out are not measured.

Nothing here reads a collection or loads a model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rag_retriever.errors import ConfigError
from rag_retriever.records import QUANTIZATIONS
from rag_retriever.settings import Settings
from rag_retriever.store.base import (
    HNSW_EF_CONSTRUCT,
    HNSW_EF_PER_RESULT,
    QDRANT_EF_CONSTRUCT,
    QUANTIZATION_OVERSAMPLING,
)
from rag_retriever.store.shards import BASE_SHARD_POINTS, base_shards

CONSTANTS: Final = Path(__file__).with_name("capacity.json")
# The utilisation a machine is planned at: queues stay short below it.
TARGET_UTILISATION: Final = 0.7
# The least use of each machine the plan adds machines for, to bring the p95 under its target.
MIN_UTILISATION: Final = 0.25
# The share of a machine's memory the index may use (the rest: models, the OS, the page cache).
MEMORY_SHARE: Final = 0.8
SECONDS_A_DAY: Final = 86_400
# What must stay in memory a point, besides its payload: the vectors HNSW reads (bytes a
# dimension as held) and its level-0 links (Qdrant's default m=16: 2m links of 4 bytes).
BYTES_PER_DIMENSION: Final = {"none": 4.0, "int8": 1.0, "binary": 1 / 8, "binary2": 2 / 8}
HNSW_LINK_BYTES: Final = 128


@dataclass(frozen=True)
class Brief:
    """What a deployment must take: corpus size, load and edits, and its machines."""

    chunks: int
    qps: float = 50.0
    p95_ms: float = 150.0
    edits_per_day: int = 20_000
    chunks_per_edit: float = 4.0
    nodes: int = 3
    memory_gb: float = 24.0
    cores: int = 2
    dim: int = 384  # the model's (all-MiniLM-L6-v2's)
    # the share of an exact search's top 10 a dense search must find, where the constants
    # measured it on real embeddings (their `recall`); a setting below it is not recommended
    recall_at10: float = 0.95

    def check(self) -> None:
        for name in (
            "chunks",
            "qps",
            "p95_ms",
            "chunks_per_edit",
            "nodes",
            "memory_gb",
            "cores",
            "dim",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # NaN passed `<= 0`
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number > 0")
        if not (math.isfinite(self.edits_per_day) and self.edits_per_day >= 0):
            raise ConfigError("--edits-per-day must be a finite number >= 0")
        if not 0 < self.recall_at10 <= 1:
            raise ConfigError(f"--recall-at10 must be in (0, 1]; got {self.recall_at10:g}")


@dataclass(frozen=True)
class Fit:
    """y = c * n^e through measured (n, y) points."""

    c: float
    e: float
    sizes: tuple[int, ...]

    @classmethod
    def through(cls, points: list[tuple[int, float]], *, single_exponent: float) -> Fit:
        """Least squares in log-log space; one point gets `single_exponent` (1: grows with the
        corpus; 0: constant)."""
        points = [(n, y) for n, y in points if n > 0 and y > 0]
        if not points:
            raise ConfigError("the plan constants hold no positive figure to fit")
        sizes = tuple(n for n, _ in points)
        if len({n for n, _ in points}) == 1:
            n, y = points[0]
            return cls(y / n**single_exponent, single_exponent, sizes)
        xs = [math.log(n) for n, _ in points]
        ys = [math.log(y) for _, y in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        e = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        return cls(math.exp(my - e * mx), e, sizes)

    def at(self, n: float) -> float:
        return self.c * n**self.e


@dataclass(frozen=True)
class SettingPlan:
    """One quantization setting's figures for the brief, one machine and a cluster."""

    quantization: str
    memory_gb: float  # the larger of the fitted serving memory and the resident floor
    resident_floor_gb: float
    disk_gb: float
    build_h: float
    p50_ms: float
    p95_ms: float
    p95_at_load_ms: float | None  # one machine taking the whole load (None: overloaded)
    p95_replicated_ms: float  # the load spread over `machines_for_qps` replicas
    machine_qps: float
    fits_one_machine: bool
    machines_for_qps: int
    node_memory_gb: float
    node_disk_gb: float
    node_p95_ms: float
    exponents: dict[str, float]
    # the build's peak RSS (write and seal, in the building process); None: not in the constants
    build_memory_gb: float | None = None
    node_build_memory_gb: float | None = None
    # of it, the private memory (the rest is mapped shard files); None: not in the constants
    build_private_gb: float | None = None
    node_build_private_gb: float | None = None
    # base shards a version of the brief's size is (and a node's share), of RAG_BASE_SHARD_POINTS
    shards: int = 1
    node_shards: int = 1
    # one shard's chunks / the largest size this setting was measured at as one shard (> 1:
    # its per-shard figures are extrapolated)
    shard_extrapolated_by: float = 0.0
    largest_one_shard: int = 0
    # (chunks, shards) of the largest version measured as several shards, and by how much each
    # figure was scaled up where it measured more than the shard model said (`_Checked`)
    checked_at: tuple[int, int] | None = None
    checked: dict[str, float] = field(default_factory=dict)
    # past this size (chunks, MB measured there) memory grows at least in proportion
    memory_linear_from: tuple[int, float] = (0, 0.0)
    # the largest size this setting was measured at (any shards)
    largest_measured: int = 0
    meets: dict[str, bool] = field(default_factory=dict)
    # (chunks, how its searches were asked, whether no wider than today's) of the points
    # measured with other search parameters than the product asks today
    other_search: list[tuple[int, str, bool]] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    brief: Brief
    measured: dict[str, Any]
    largest_measured: int
    extrapolated_by: float  # the brief's chunks / the largest measured size (<= 1: within)
    settings: list[SettingPlan]
    edits: dict[str, float]
    recommended: str | None
    served: dict[str, Any] = field(default_factory=dict)  # the HTTP service measured at load
    overhead_ms: float = 0.0  # a query's cost through the service beyond encoding and engine
    shard_points: int = BASE_SHARD_POINTS  # the base shard size the figures are computed for
    # dense recall of an exact search's top 10 on real embeddings, each setting, at the largest
    # size measured (bench_quantization); not in the figures, said beside them
    recall: dict[str, Any] = field(default_factory=dict)
    # how wide the deployment builds its graphs (RAG_HNSW_EF_CONSTRUCT), and how wide the
    # constants' builds were (`measured_width`)
    ef_construct: int = HNSW_EF_CONSTRUCT
    measured_ef_construct: int = QDRANT_EF_CONSTRUCT

    def to_dict(self) -> dict[str, Any]:
        return {
            "brief": self.brief.__dict__,
            "measured": self.measured,
            "largest_measured_chunks": self.largest_measured,
            "extrapolated_by": self.extrapolated_by,
            "settings": [s.__dict__ for s in self.settings],
            "edits": self.edits,
            "recommended": self.recommended,
            "served": self.served,
            "overhead_ms": self.overhead_ms,
            "shard_points": self.shard_points,
            "recall": self.recall,
            "ef_construct": self.ef_construct,
            "measured_ef_construct": self.measured_ef_construct,
        }


def measured_width(section: Mapping[str, Any]) -> int:
    """How wide the graphs were built that a constants section (`measured`, `recall`) was
    measured on: its `ef_construct`, else Qdrant's 100, at which every build before the width
    was recorded ran."""
    return int(section.get("ef_construct") or QDRANT_EF_CONSTRUCT)


def recall_credited(recall: Mapping[str, Any], ef_construct: int) -> bool:
    """Whether a recall entry holds for a deployment building graphs `ef_construct` wide: not
    when it was measured on wider graphs (a narrower graph holds less of the exact top 10); a
    narrower graph's recall is a lower bound for a wider one."""
    return measured_width(recall) <= ef_construct


def load_constants(path: Path | None = None) -> dict[str, Any]:
    """The constants file (default: this machine's, beside this module), checked."""
    path = path or CONSTANTS
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the plan constants {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise ConfigError(
            f"{path} holds no measured settings: write it with `python -m bench.bench_engine "
            f"--quantization {' '.join(QUANTIZATIONS)} --constants-out {path}`"
        )
    for name, points in data["settings"].items():
        if not isinstance(points, list) or not points:
            raise ConfigError(f"{path}: setting {name!r} has no measured size")
        # the memory fit reads resident_mb where every point has it, else rss_mb of every point
        everywhere = all(isinstance(p, dict) and "resident_mb" in p for p in points)
        for i, point in enumerate(points):
            _check_point(point, f"{path}: setting {name!r}, point {i + 1}")
            if not everywhere and "rss_mb" not in point:
                raise ConfigError(
                    f"{path}: setting {name!r}, point {i + 1} lacks rss_mb (the setting's other "
                    f"points lack resident_mb): re-measure with `python -m bench.bench_engine`"
                )
    served = data.get("served")
    if served and served.get("service_p50_ms") is None:
        _check_point(served, f"{path}: served", ("chunks", "single_p50_ms"))
    return data


# What a measured point must hold for the plan's fits (numbers, the chunks a positive count).
POINT_KEYS: Final = ("chunks", "disk_mb", "write_s", "seal_s", "hybrid_p50_ms", "hybrid_p95_ms")


def _check_point(point: Any, where: str, keys: Sequence[str] = POINT_KEYS) -> None:
    """ConfigError naming what a point of the constants lacks (a KeyError or ValueError deep
    in a fit before)."""
    if not isinstance(point, dict):
        raise ConfigError(f"{where}: a point is an object of measured figures")
    memory = () if keys is not POINT_KEYS or "resident_mb" in point else ("rss_mb",)
    missing = [k for k in (*keys, *memory) if k not in point]
    if missing:
        raise ConfigError(
            f"{where} lacks {', '.join(missing)}: re-measure with `python -m bench.bench_engine`"
        )
    for key in (*keys, *memory):
        value = point[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    if not point["chunks"] > 0:
        raise ConfigError(f"{where}: chunks must be > 0, got {point['chunks']!r}")


def make_plan(
    brief: Brief,
    constants: dict[str, Any],
    shard_points: int | None = None,
    ef_construct: int = HNSW_EF_CONSTRUCT,
) -> Plan:
    """The plan of `brief` from measured `constants`, its versions built in base shards of at
    most `shard_points` chunks (RAG_BASE_SHARD_POINTS; None: the size the constants were
    measured with) and graphs `ef_construct` wide (RAG_HNSW_EF_CONSTRUCT: said beside the
    figures where the constants were built otherwise, never scaled)."""
    brief.check()
    if shard_points is not None and shard_points < 1:
        raise ConfigError(f"a base shard must hold at least 1 chunk (got {shard_points})")
    Settings.check(hnsw_ef_construct=ef_construct)
    measured = dict(constants.get("measured") or {})
    measured_cores = int(measured.get("cores") or brief.cores)
    encode_ms = float(constants.get("query_encode_ms") or 0.0)
    served = constants.get("served") or {}
    # what a query costs through the HTTP service beyond its encoding and the engine: measured
    # alone at the served size, each answer less its own encoding and search (its timings_ms);
    # constants measured before those were recorded: less the float32 engine's fitted p50 there
    overhead_ms = 0.0
    if served.get("service_p50_ms") is not None and math.isfinite(served["service_p50_ms"]):
        overhead_ms = max(0.0, float(served["service_p50_ms"]))
    elif served and (none := constants["settings"].get("none")):
        engine = Fit.through(
            [(int(p["chunks"]), float(p["hybrid_p50_ms"])) for p in _one_shard(none)],
            single_exponent=0.0,
        )
        at = _rising(engine).at(float(served["chunks"]))
        overhead_ms = max(0.0, float(served["single_p50_ms"]) - encode_ms - at)
    largest = max(int(p["chunks"]) for pts in constants["settings"].values() for p in pts)
    cap = shard_points or int(measured.get("base_shard_points") or BASE_SHARD_POINTS)
    recall = dict(constants.get("recall") or {})
    found = recall.get("dense_at10_of_exact") or {}
    credited = recall_credited(recall, ef_construct)
    plans = []
    for name, points in constants["settings"].items():
        setting = _setting(brief, name, points, encode_ms + overhead_ms, measured_cores, cap)
        if name in found:
            setting.meets["recall"] = credited and float(found[name]) >= brief.recall_at10
        plans.append(setting)
    # the least memory that fits a machine and, replicated for the load, meets the p95 and
    # (where measured) the recall
    fitting = [
        p
        for p in plans
        if p.fits_one_machine and p.meets.get("p95", False) and p.meets.get("recall", True)
    ]
    recommended = min(fitting, key=lambda p: p.memory_gb).quantization if fitting else None
    return Plan(
        brief,
        measured,
        largest,
        brief.chunks / largest,
        plans,
        _edits(brief, constants.get("edits") or {}),
        recommended,
        dict(served),
        overhead_ms,
        cap,
        recall,
        ef_construct,
        measured_width(measured),
    )


def _one_shard(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points measured as one base shard (a point without "shards" was), which the fits go
    through (all of them where none was)."""
    return [p for p in points if int(p.get("shards", 1)) == 1] or points


def _setting(
    brief: Brief,
    name: str,
    points: list[dict[str, Any]],
    encode_ms: float,
    measured_cores: int,
    cap: int = BASE_SHARD_POINTS,
) -> SettingPlan:
    every = points
    points = _one_shard(points)
    largest_one_shard = max(int(p["chunks"]) for p in points)
    # the largest version measured as several shards checks the shard model (`_Checked`)
    several = max(
        (p for p in every if int(p.get("shards", 1)) > 1),
        key=lambda p: int(p["chunks"]),
        default=None,
    )

    def fit(key: str, single: float) -> Fit:
        return Fit.through(
            [(int(p["chunks"]), float(p[key])) for p in points], single_exponent=single
        )

    # a serving process's memory is fitted through the whole corpus (one process holds every
    # shard; the resident floor below bounds it from beneath): what it needs resident where the
    # constants have it (a quantized version's RSS also holds the float32 originals its
    # rescoring read, page cache that grows with the queries asked), else its peak RSS
    memory_key = "resident_mb" if all("resident_mb" in p for p in points) else "rss_mb"
    # ... and past the largest size measured (any shards: one process holds them all) it grows
    # at least as the corpus does from there: what a chunk holds does not shrink with size
    largest = max((p for p in every if memory_key in p), key=lambda p: int(p["chunks"]))
    memory = _AtLeastLinear(
        fit(memory_key, 1.0), int(largest["chunks"]), float(largest[memory_key])
    )
    disk = _Sharded(fit("disk_mb", 1.0), cap)
    build = _Sharded(
        Fit.through(
            [(int(p["chunks"]), float(p["write_s"]) + float(p["seal_s"])) for p in points],
            single_exponent=1.0,
        ),
        cap,
    )
    # latency is not taken to fall with size: a fitted negative exponent is noise
    p50, p95 = (
        _Checked.by(_Sharded(_rising(fit(key, 0.0)), cap), several, key, largest_one_shard)
        for key in ("hybrid_p50_ms", "hybrid_p95_ms")
    )
    # constants written before the build's peak was measured do not have it; a build's peak is
    # one shard's (sealed one at a time)
    build_memory = (
        _Sharded(fit("build_rss_mb", 1.0), cap, one=True)
        if all("build_rss_mb" in p for p in points)
        else None
    )
    build_private = (
        _Checked.by(
            _Sharded(fit("build_private_mb", 1.0), cap, one=True),
            several,
            "build_private_mb",
            largest_one_shard,
        )
        if all("build_private_mb" in p for p in points)
        else None
    )
    n = brief.chunks
    service_ms = p50.at(n) + encode_ms
    machine_qps = brief.cores * 1000.0 / service_ms
    load = brief.qps / machine_qps
    # M/M/1-style stretch of the single-client p95 at this utilisation; None: overloaded
    p95_at_load = (p95.at(n) + encode_ms) / (1 - load) if load < 1 else None
    replicas = math.ceil(brief.qps / (machine_qps * TARGET_UTILISATION))
    single_p95 = p95.at(n) + encode_ms
    if single_p95 < brief.p95_ms:
        # and as many more as the p95 needs (each takes less of the load): r >= load / (1 -
        # p95 / target) makes p95 / (1 - load / r) <= target; not more than a quarter of a
        # machine's load each (MIN_UTILISATION) or twice the load's count asks (a p95 just under
        # the target asked for hundreds of idle machines)
        needed = math.ceil(load / (1 - single_p95 / brief.p95_ms))
        if needed <= max(math.ceil(load / MIN_UTILISATION), 2 * replicas):
            replicas = max(replicas, needed)
    p95_replicated = single_p95 / (1 - load / replicas)
    node_chunks = n / brief.nodes

    def resident_gb(chunks: float) -> float:
        held = brief.dim * BYTES_PER_DIMENSION.get(name, 4.0) + HNSW_LINK_BYTES
        return chunks * held / 2**30

    # The peak RSS measured counts the pages 200 queries touched; what HNSW reads must all
    # stay resident for its latency to hold, whatever a short probe touched.
    memory_gb = max(memory.at(n) / 1024, resident_gb(n))
    plan = SettingPlan(
        quantization=name,
        memory_gb=memory_gb,
        resident_floor_gb=resident_gb(n),
        disk_gb=disk.at(n) / 1024,
        # the seal's HNSW build uses every core: scaled from the measuring machine's cores
        build_h=build.at(n) / 3600 * measured_cores / brief.cores,
        p50_ms=p50.at(n) + encode_ms,
        p95_ms=p95.at(n) + encode_ms,
        p95_at_load_ms=p95_at_load,
        p95_replicated_ms=p95_replicated,
        machine_qps=machine_qps,
        fits_one_machine=memory_gb <= brief.memory_gb * MEMORY_SHARE,
        machines_for_qps=replicas,
        node_memory_gb=max(memory.at(node_chunks) / 1024, resident_gb(node_chunks)),
        node_disk_gb=disk.at(node_chunks) / 1024,
        node_p95_ms=p95.at(node_chunks) + encode_ms,
        exponents={
            "memory": memory.e,
            "disk": disk.e,
            "build": build.e,
            "p50": p50.e,
            "p95": p95.e,
        }
        | ({"build memory": build_memory.e} if build_memory else {})
        | ({"build private memory": build_private.e} if build_private else {}),
        build_memory_gb=build_memory.at(n) / 1024 if build_memory else None,
        node_build_memory_gb=build_memory.at(node_chunks) / 1024 if build_memory else None,
        build_private_gb=build_private.at(n) / 1024 if build_private else None,
        node_build_private_gb=build_private.at(node_chunks) / 1024 if build_private else None,
        shards=base_shards(n, cap),
        node_shards=base_shards(math.ceil(node_chunks), cap),
        shard_extrapolated_by=n / base_shards(n, cap) / largest_one_shard,
        largest_one_shard=largest_one_shard,
        checked_at=(int(several["chunks"]), int(several["shards"])) if several else None,
        checked={
            name: c.factor
            for name, c in (("p50", p50), ("p95", p95), ("build private memory", build_private))
            if c is not None and c.factor != 1.0
        },
        memory_linear_from=(memory.n, memory.y),
        largest_measured=max(int(p["chunks"]) for p in every),
        other_search=_other_search(name, every),
    )
    plan.meets.update(
        memory=plan.fits_one_machine,
        p95=p95_replicated <= brief.p95_ms,
    )
    return plan


# What every point was searched with before the constants recorded it (the breadth has been 8x
# and binary's oversampling 4 since 2026-12-06).
EARLIER_EF_PER_RESULT: Final = 4
EARLIER_OVERSAMPLING: Final = 2.0


def _search_of(name: str, point: Mapping[str, Any] | None = None) -> tuple[float, float | None]:
    """(ef per result, oversampling; None: float32) a point of setting `name` was searched with;
    without a point, what the product asks today."""
    if point is None:
        return float(HNSW_EF_PER_RESULT), QUANTIZATION_OVERSAMPLING.get(name)
    ef = float(point.get("ef_per_result") or EARLIER_EF_PER_RESULT)
    if name not in QUANTIZATION_OVERSAMPLING:
        return ef, None
    return ef, float(point.get("oversampling") or EARLIER_OVERSAMPLING)


def search_asked(name: str, point: Mapping[str, Any] | None = None) -> str:
    """How a point of setting `name` was searched ("ef 8x, oversampling 4"); without a point,
    how the product searches that setting today."""
    return search_text(*_search_of(name, point))


def search_text(ef: float, over: float | None) -> str:
    """ "ef 8x, oversampling 4" (float32, `over` None: "ef 8x")."""
    return f"ef {ef:g}x" + ("" if over is None else f", oversampling {over:g}")


def _other_search(name: str, points: list[dict[str, Any]]) -> list[tuple[int, str, bool]]:
    """(chunks, how it was searched, whether no wider than today) of the points searched
    otherwise than `name` is today."""
    ef, over = _search_of(name)
    out = []
    for p in points:
        was_ef, was_over = _search_of(name, p)
        if (was_ef, was_over) != (ef, over):
            narrower = was_ef <= ef and (was_over or 0.0) <= (over or 0.0)
            out.append((int(p["chunks"]), search_asked(name, p), narrower))
    return out


@dataclass(frozen=True)
class _Sharded:
    """A figure of a version of several base shards of at most `cap` chunks: k shards of n/k
    each cost k times one's (`one`: one shard's, for a build's peak), from one shard's fit."""

    fit: Fit
    cap: int
    one: bool = False

    @property
    def e(self) -> float:
        return self.fit.e

    def at(self, n: float) -> float:
        return self.as_shards(n, base_shards(math.ceil(n), self.cap))

    def as_shards(self, n: float, k: int) -> float:
        """The figure of n chunks written as k shards."""
        return self.fit.at(n / k) * (1 if self.one else k)


@dataclass(frozen=True)
class _Checked:
    """A sharded figure checked against the largest version measured as several shards: where
    that version measured more than the model says for its own shards, sizes from it on are
    scaled up by the ratio (`factor`), and sizes between the largest one-shard point and it by a
    share of it growing with log n. A model that held (or overestimated) is left as it is."""

    model: _Sharded
    factor: float = 1.0
    start: int = 1  # the largest size measured as one shard: no correction up to it
    end: int = 1  # the version measured as several shards: the whole factor from it on

    @classmethod
    def by(
        cls, model: _Sharded, point: dict[str, Any] | None, key: str, largest_one_shard: int
    ) -> _Checked:
        if point is None or key not in point:
            return cls(model)
        n, k = int(point["chunks"]), int(point["shards"])
        ratio = float(point[key]) / model.as_shards(n, k)
        # a ratio within rounding of 1 is the model holding, not a correction
        return cls(model, ratio if ratio > 1 + 1e-9 else 1.0, largest_one_shard, n)

    @property
    def e(self) -> float:
        return self.model.e

    def at(self, n: float) -> float:
        share = 1.0
        if n < self.end and self.end > self.start:
            share = max(0.0, math.log(n / self.start) / math.log(self.end / self.start))
        return self.model.at(n) * (1 + (self.factor - 1) * share)


@dataclass(frozen=True)
class _AtLeastLinear:
    """A fit that, past the largest size measured (`n`, where `y` was measured), grows at least
    in proportion to the size from there."""

    fit: Fit
    n: int
    y: float

    @property
    def e(self) -> float:
        return self.fit.e

    def at(self, n: float) -> float:
        return max(self.fit.at(n), self.y * n / self.n) if n > self.n else self.fit.at(n)


def _rising(fit: Fit) -> Fit:
    return fit if fit.e >= 0 else Fit(fit.at(max(fit.sizes)), 0.0, fit.sizes)


def _edits(brief: Brief, edits: dict[str, Any]) -> dict[str, float]:
    """An edit's cost: Edge writes a delta (its measured seconds); the server path writes the
    changed chunks and marks the ones they replace (points written per changed chunk)."""
    chunks_a_day = brief.edits_per_day * brief.chunks_per_edit
    out: dict[str, float] = {"chunks_changed_per_day": chunks_a_day}
    if "edge_edit_s" in edits:
        busy = brief.edits_per_day * float(edits["edge_edit_s"])
        out["edge_edit_s"] = float(edits["edge_edit_s"])
        out["edge_writer_busy_share"] = busy / SECONDS_A_DAY
    if "server_points_per_changed_chunk" in edits:
        per_chunk = float(edits["server_points_per_changed_chunk"])
        out["server_points_written_per_day"] = chunks_a_day * per_chunk
    return out
