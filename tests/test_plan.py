"""`rag-retriever plan`: fitted growth from measured constants, checked against hand-computed
cases; the shipped constants are the benchmark's own output format."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.bench_engine import CONSTANT_FIGURES, constants, merged_constants
from rag_retriever.cli import main
from rag_retriever.errors import ConfigError
from rag_retriever.ops.plan import (
    CONSTANTS,
    Brief,
    Fit,
    load_constants,
    make_plan,
)
from rag_retriever.ops.plan_text import describe


def figures(n: int, rss_mb: float, p50: float, p95: float) -> dict[str, float]:
    """A run's figures at n chunks: memory and disk proportional, build n^1.2, latency given."""
    return {
        "chunks": n,
        "write_s": n / 10_000,
        "seal_s": (n / 10_000) ** 1.2,
        "reopen_s": 0.1,
        "disk_mb": 2 * rss_mb,
        "rss_mb": rss_mb,
        "rss_anon_mb": rss_mb / 2,
        "dense_p50_ms": p50,
        "dense_p95_ms": p95,
        "hybrid_p50_ms": p50,
        "hybrid_p95_ms": p95,
        "hybrid_filtered_p50_ms": p50,
        "hybrid_filtered_p95_ms": p95,
    }


CASE: dict[str, Any] = {
    "measured": {
        "date": "2026-12-03",
        "command": "hand-made",
        "cores": 2,
        "memory_gb": 24,
        # one base shard at every size asked here: these cases check the fits
        "base_shard_points": 10**9,
    },
    "query_encode_ms": 10.0,
    "edits": {"edge_edit_s": 0.1, "server_points_per_changed_chunk": 2.0},
    "settings": {
        # float32: 1 KB a chunk; latency 2 ms at 100k, 4 ms at 1M (n^0.301)
        "none": [figures(100_000, 100.0, 2.0, 4.0), figures(1_000_000, 1000.0, 4.0, 8.0)],
        # binary: a quarter of the memory, the same latency
        "binary": [figures(100_000, 25.0, 2.0, 4.0), figures(1_000_000, 250.0, 4.0, 8.0)],
    },
}


def test_a_power_fit_goes_through_its_points_and_one_point_takes_the_given_exponent() -> None:
    fit = Fit.through([(100, 10.0), (10_000, 1000.0)], single_exponent=0)
    assert fit.e == pytest.approx(1.0) and fit.at(1_000) == pytest.approx(100.0)
    assert Fit.through([(100, 3.0)], single_exponent=1).at(1_000) == pytest.approx(30.0)
    assert Fit.through([(100, 3.0)], single_exponent=0).at(1_000) == pytest.approx(3.0)


def test_past_the_base_shard_size_a_version_costs_its_shards_one_shard_s_figures() -> None:
    """With base shards of at most 1M chunks (the constants' base_shard_points), 20M chunks are
    20 shards of 1M: latency, build time and disk 20x one 1M shard's (measured here), a build's
    peak one shard's; memory is fitted through the corpus as before. A point measured as
    several shards is left out of the fits (its figures here, as the model says for its 4
    shards but its disk, would bend them)."""
    several = dict(figures(4_000_000, 1.0, 16.0, 32.0), shards=4, build_private_mb=1.0)
    points = [
        figures(100_000, 25.0, 2.0, 4.0) | {"build_private_mb": 50.0},
        figures(1_000_000, 250.0, 4.0, 8.0) | {"build_private_mb": 500.0},
        several,
    ]
    constants = dict(
        CASE,
        measured=CASE["measured"] | {"base_shard_points": 1_000_000},
        settings={"binary": points},
    )
    brief = Brief(chunks=20_000_000, nodes=4, dim=8)
    plan = make_plan(brief, constants)
    (binary,) = plan.settings
    assert (binary.shards, binary.node_shards) == (20, 5)
    assert binary.p50_ms == pytest.approx(20 * 4.0 + 10.0)  # plus the query's encoding
    assert binary.p95_ms == pytest.approx(20 * 8.0 + 10.0)
    assert binary.node_p95_ms == pytest.approx(5 * 8.0 + 10.0)
    assert binary.disk_gb == pytest.approx(20 * 500 / 1024)
    assert binary.build_h == pytest.approx(20 * (100 + 100**1.2) / 3600)
    assert binary.build_private_gb == pytest.approx(500 / 1024)  # one shard's, sealed alone
    assert binary.memory_gb == pytest.approx(20 * 250 / 1024)  # the corpus's fit
    assert plan.shard_points == 1_000_000
    assert any("20 base shards of ~1,000,000" in line for line in describe(plan))
    # 2.5M chunks: 3 shards of ~833k each
    plan = make_plan(Brief(chunks=2_500_000, dim=8), constants)
    assert plan.settings[0].shards == 3
    assert plan.settings[0].p50_ms == pytest.approx(
        3 * 4.0 * (2_500_000 / 3 / 1e6) ** math.log10(2) + 10
    )


def test_the_shard_size_asked_for_sets_how_many_shards_a_query_asks_and_past_the_largest_one_shard_point_says_so() -> (
    None
):
    """The deployment's RAG_BASE_SHARD_POINTS, not the constants', decides the shards: 20M
    chunks in shards of 2M are 10 shards, each costing the fit at 2M (4 ms at 1M, n^log10(2)
    through the points: 4 * 2^0.301), which no one-shard point measured, so the plan says the
    shard is 2.0x the largest measured as one shard; in shards of 1M nothing is said."""
    constants = dict(CASE, settings={"binary": CASE["settings"]["binary"]})
    brief = Brief(chunks=20_000_000, dim=8)
    plan = make_plan(brief, constants, shard_points=2_000_000)
    (binary,) = plan.settings
    assert plan.shard_points == 2_000_000 and binary.shards == 10
    assert binary.p50_ms == pytest.approx(10 * 4.0 * 2 ** math.log10(2) + 10.0)
    assert binary.shard_extrapolated_by == pytest.approx(2.0)
    assert binary.largest_one_shard == 1_000_000
    text = "\n".join(describe(plan))
    assert "10 base shards of ~2,000,000 (RAG_BASE_SHARD_POINTS 2,000,000)" in text
    assert (
        "EXTRAPOLATED: binary: a shard of ~2,000,000 chunks is 2.0x the largest measured as one "
        "shard (1,000,000)" in text
    )
    fewer = make_plan(brief, constants, shard_points=1_000_000)
    assert fewer.settings[0].shards == 20 and fewer.settings[0].shard_extrapolated_by == 1.0
    assert "largest measured as one shard" not in "\n".join(describe(fewer))
    # more, smaller shards cost a query more here: 20 x 4 ms against 10 x 4.9 ms
    assert fewer.settings[0].p50_ms > binary.p50_ms
    with pytest.raises(ConfigError, match="at least 1 chunk"):
        make_plan(brief, constants, shard_points=0)


def test_the_plan_command_builds_in_the_shard_size_of_its_flag_or_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    case = tmp_path / "case.json"
    case.write_text(json.dumps(CASE))
    args = ["plan", "--chunks", "3000000", "--constants", str(case), "--json"]
    assert main([*args, "--base-shard-points", "1000000"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"][0]["shards"] == 3
    monkeypatch.setenv("RAG_BASE_SHARD_POINTS", "500000")
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["shard_points"] == 500_000
    assert main([*args, "--base-shard-points", "0"]) == 2
    assert "RAG_BASE_SHARD_POINTS='0' is invalid" in capsys.readouterr().err


def test_the_plan_of_a_brief_past_the_measured_sizes_says_how_far_it_extrapolates() -> None:
    # dim 8: a resident floor far below the fitted memory, so the fit decides here
    brief = Brief(chunks=20_000_000, qps=50, p95_ms=150, edits_per_day=20_000, nodes=4, dim=8)
    plan = make_plan(brief, CASE)
    assert plan.largest_measured == 1_000_000 and plan.extrapolated_by == 20
    none, binary = plan.settings
    # memory: 1 KB a chunk -> 20M chunks = 20,000 MB
    assert none.memory_gb == pytest.approx(20_000 / 1024) and none.exponents["memory"] == 1
    assert binary.memory_gb == pytest.approx(5_000 / 1024)
    assert none.node_memory_gb == pytest.approx(5_000 / 1024)  # a quarter on each of 4 nodes
    # latency doubles each 10x: 4 ms at 1M -> 8 ms at 10M -> 8 * 2^log10(2) at 20M
    p50 = 4.0 * 2 ** math.log10(20)
    assert none.p50_ms == pytest.approx(p50 + 10.0)  # plus the query's encoding
    # two cores, each query holds one: capacity 2000 / service ms
    assert none.machine_qps == pytest.approx(2000 / (p50 + 10))
    load = 50 / none.machine_qps
    assert none.p95_at_load_ms == pytest.approx((2 * p50 + 10) / (1 - load))
    assert none.machines_for_qps == math.ceil(50 / (none.machine_qps * 0.7))
    # 20,000 MB does not fit 80% of 24 GB; 5,000 MB does: binary is recommended
    assert not none.fits_one_machine and binary.fits_one_machine
    assert plan.recommended == "binary"
    # build: write n/10^4 s + seal (n/10^4)^1.2 s, fitted as one power through both sizes
    assert none.build_h > (2_000 + 2_000**1.2) / 3600 * 0.9
    assert plan.edits["server_points_written_per_day"] == 20_000 * 4 * 2
    assert plan.edits["edge_writer_busy_share"] == pytest.approx(20_000 * 0.1 / 86_400)


def test_memory_is_never_below_what_hnsw_must_keep_resident() -> None:
    """A short probe touches few pages: 1M float32 384-d vectors and their links are 1.55 GB
    however little RSS it measured; binary vectors hold 48 bytes a point instead of 1,536."""
    plan = make_plan(Brief(chunks=1_000_000, dim=384), CASE)
    none, binary = plan.settings
    assert none.resident_floor_gb == pytest.approx(1_000_000 * (1536 + 128) / 2**30)
    assert binary.resident_floor_gb == pytest.approx(1_000_000 * (48 + 128) / 2**30)
    assert none.memory_gb == pytest.approx(none.resident_floor_gb)  # above the fitted 1,000 MB
    assert binary.memory_gb == pytest.approx(250 / 1024)  # the fit, above its floor


def test_memory_follows_what_a_version_needs_resident_where_the_constants_have_it() -> None:
    """A quantized version's RSS also holds the float32 originals its rescoring read; where
    every point says what it needs resident without them, memory is fitted through that:
    binary 500 -> 5,000 MB of RSS but 200 -> 800 MB resident (n^0.602), so 500k chunks need
    200 * 5^0.602 = 527 MB, not the 2,500 MB its RSS fit says. Past the largest size measured
    memory grows at least in proportion from there (what a chunk holds does not shrink): 10M
    need 800 * 10 = 8,000 MB, not the fit's 800 * 10^0.602 = 3,200. A setting whose points lack
    the figure (float32 here, which has it at one size only) keeps its RSS fit."""
    case = json.loads(json.dumps(CASE))
    for point, rss, resident in zip(
        case["settings"]["binary"], (500.0, 5000.0), (200.0, 800.0), strict=True
    ):
        point |= {"rss_mb": rss, "resident_mb": resident}
    case["settings"]["none"][1]["resident_mb"] = 1.0
    none, binary = make_plan(Brief(chunks=500_000, dim=8), case).settings
    assert binary.memory_gb == pytest.approx(200 * 5 ** math.log10(4) / 1024)
    assert binary.exponents["memory"] == pytest.approx(math.log10(4))
    assert none.memory_gb == pytest.approx(500 / 1024)  # RSS: 1 KB a chunk
    plan = make_plan(Brief(chunks=10_000_000, dim=8), case)
    none, binary = plan.settings
    assert binary.memory_gb == pytest.approx(8000 / 1024)
    assert none.memory_gb == pytest.approx(10_000 / 1024)
    text = "\n".join(describe(plan))
    assert (
        "binary: memory past 1,000,000 chunks grows at least in proportion from the 800 MB" in text
    )


def test_a_version_measured_as_several_shards_scales_up_what_the_shard_model_said_too_low() -> None:
    """One shard: p50 2 ms at 100k, 4 ms at 1M. 4M chunks measured as 4 shards took 32 ms where
    the model says 4 x 4 = 16: from 4M on p50 is twice the model's (20M in shards of 1M: 2 x 20
    x 4 = 160 ms), at 2M half way in log n (1.5 x 2 x 4 = 12 ms), at 1M (the largest one-shard
    size) as the model says. Its p95 (4 x 8 = 32) and build peak (as one shard's, 500 MB) are
    what the model says and stay as they are; its memory, 16 GB at 4M (4 KB a chunk), sets
    memory from there on (20M: 80 GB, where the fit through 1 KB a chunk says 20 GB)."""
    several = dict(figures(4_000_000, 16_000.0, 32.0, 32.0), shards=4, build_private_mb=500.0)
    points = [
        figures(100_000, 100.0, 2.0, 4.0) | {"build_private_mb": 50.0},
        figures(1_000_000, 1000.0, 4.0, 8.0) | {"build_private_mb": 500.0},
        several,
    ]
    constants = dict(CASE, settings={"binary": points})
    [binary] = make_plan(
        Brief(chunks=20_000_000, dim=8), constants, shard_points=1_000_000
    ).settings
    assert binary.p50_ms == pytest.approx(2 * 20 * 4.0 + 10.0)
    assert binary.p95_ms == pytest.approx(20 * 8.0 + 10.0)
    assert binary.checked == {"p50": pytest.approx(2.0)} and binary.checked_at == (4_000_000, 4)
    assert binary.build_private_gb == pytest.approx(500 / 1024)
    assert binary.memory_gb == pytest.approx(80_000 / 1024)
    [half] = make_plan(Brief(chunks=2_000_000, dim=8), constants, shard_points=1_000_000).settings
    assert half.p50_ms == pytest.approx(1.5 * 2 * 4.0 + 10.0)
    [one] = make_plan(Brief(chunks=1_000_000, dim=8), constants, shard_points=1_000_000).settings
    assert one.p50_ms == pytest.approx(4.0 + 10.0)
    text = "\n".join(describe(make_plan(Brief(chunks=20_000_000, dim=8), constants, 1_000_000)))
    assert (
        "binary: 4,000,000 chunks measured as 4 shards took more than the shard model says, so "
        "from that size on p50 x2.00 (a share of it from 1,000,000)" in text
    )
    alone = dict(constants, settings={"binary": points[:2]})
    text = "\n".join(describe(make_plan(Brief(chunks=20_000_000, dim=8), alone, 1_000_000)))
    assert "binary: never measured as several shards: its latency is the shard model's" in text


def test_the_build_peak_is_fitted_and_checked_against_a_machine_and_a_node() -> None:
    """The build's peak RSS grows as n^1.5 here (4 GB at 100k -> 126.5 GB at 1M): at 2M chunks
    one machine's build needs 357.8 GB, a node's of 4 (500k chunks) 44.7 GB; constants from
    before it was measured say so instead of guessing."""
    measured = {
        name: [p | {"build_rss_mb": 4096 * (p["chunks"] / 100_000) ** 1.5} for p in points]
        for name, points in CASE["settings"].items()
    }
    plan = make_plan(Brief(chunks=2_000_000, nodes=4, memory_gb=64), dict(CASE, settings=measured))
    none = plan.settings[0]
    assert none.exponents["build memory"] == pytest.approx(1.5)
    assert none.build_memory_gb == pytest.approx(4 * 20**1.5)
    assert none.node_build_memory_gb == pytest.approx(4 * 5**1.5)
    text = "\n".join(describe(plan))
    assert "none: a build peaks at 357.8 GB on one machine (does NOT fit 64 GB)" in text
    assert "44.7 GB a node of 4 (fits)" in text
    old = make_plan(Brief(chunks=2_000_000), CASE)
    assert old.settings[0].build_memory_gb is None
    assert "none: build peak not in these constants" in "\n".join(describe(old))


def test_a_build_whose_private_memory_fits_runs_by_paging_its_shard_files() -> None:
    """RSS 4 GB at 100k growing as n^1.5, of which 1 GB private growing as n: at 2M chunks the
    build's RSS (357.8 GB) exceeds 64 GB but its private 20 GB fits, so it runs by paging the
    mapped shard files; a node's (500k) fits whole; at 10M the private 100 GB does not fit."""
    measured = {
        name: [
            p
            | {
                "build_rss_mb": 4096 * (p["chunks"] / 100_000) ** 1.5,
                "build_private_mb": 1024 * p["chunks"] / 100_000,
            }
            for p in points
        ]
        for name, points in CASE["settings"].items()
    }
    constants = dict(CASE, settings=measured)
    plan = make_plan(Brief(chunks=2_000_000, nodes=4, memory_gb=64), constants)
    none = plan.settings[0]
    assert none.exponents["build private memory"] == pytest.approx(1.0)
    assert none.build_private_gb == pytest.approx(20.0)
    assert none.node_build_private_gb == pytest.approx(5.0)
    text = "\n".join(describe(plan))
    assert (
        "none: a build peaks at 357.8 GB RSS on one machine, 20.0 GB of it private (fits 64 GB "
        "only by paging shard files from disk); 44.7 GB, 5.0 GB private, a node of 4 (fits)"
    ) in text
    assert "mapped shard files" in text
    big = "\n".join(describe(make_plan(Brief(chunks=10_000_000, memory_gb=64), constants)))
    assert "100.0 GB of it private (does NOT fit 64 GB)" in big


def test_latency_is_not_extrapolated_downwards() -> None:
    falling = dict(
        CASE,
        settings={
            "none": [figures(100_000, 100.0, 4.0, 8.0), figures(1_000_000, 1000.0, 3.0, 6.0)]
        },
    )
    [none] = make_plan(Brief(chunks=20_000_000), falling).settings
    assert none.p50_ms == pytest.approx(3.0 + 10.0) and none.exponents["p50"] == 0


def test_bad_briefs_and_constants_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--qps must be a finite number > 0"):
        make_plan(Brief(chunks=10, qps=0), CASE)
    for brief in (Brief(chunks=10, qps=math.nan), Brief(chunks=10, qps=math.inf)):
        with pytest.raises(ConfigError, match="--qps must be a finite number > 0"):
            make_plan(brief, CASE)  # a ValueError / OverflowError at math.ceil before
    with pytest.raises(ConfigError, match="--memory-gb must be a finite number"):
        make_plan(Brief(chunks=10, memory_gb=math.nan), CASE)
    bad = tmp_path / "c.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_constants(bad)
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="--constants-out"):
        load_constants(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_constants(tmp_path / "missing.json")
    point = figures(100_000, 100.0, 4.0, 8.0)
    for broken, message in (
        ({k: v for k, v in point.items() if k != "write_s"}, "point 1 lacks write_s"),
        ({k: v for k, v in point.items() if k != "rss_mb"}, "point 1 lacks rss_mb"),
        ({**point, "chunks": "many"}, "chunks must be a number"),
        ({**point, "disk_mb": None}, "disk_mb must be a number"),
        ({**point, "chunks": 0}, "chunks must be > 0"),
    ):
        bad.write_text(json.dumps({"settings": {"none": [broken]}}))
        with pytest.raises(ConfigError, match=message):
            load_constants(bad)  # a KeyError or ValueError deep in a fit before
    resident_only = {k: v for k, v in point.items() if k != "rss_mb"} | {"resident_mb": 50.0}
    bad.write_text(json.dumps({"settings": {"none": [resident_only, point]}}))
    with pytest.raises(ConfigError, match="point 1 lacks rss_mb"):
        load_constants(bad)  # the fit reads rss_mb of every point where one lacks resident_mb
    bad.write_text(json.dumps({"settings": {"none": [point]}, "served": {"chunks": 10}}))
    with pytest.raises(ConfigError, match="served lacks single_p50_ms"):
        load_constants(bad)


def test_the_benchmark_writes_what_the_plan_reads(tmp_path: Path) -> None:
    row = {k: 1.0 for k in CONSTANT_FIGURES}
    results = {"100000": {"edge": row, "edge-binary": row, "local": row}, "300000": {"edge": row}}
    made = constants(results, "python -m bench.bench_engine --sizes 100000 300000")
    assert [p["chunks"] for p in made["settings"]["none"]] == [100_000, 300_000]
    assert [p["chunks"] for p in made["settings"]["binary"]] == [100_000]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(made))
    assert load_constants(path)["settings"].keys() == {"none", "binary"}


def test_a_run_at_a_new_size_adds_its_points_to_the_constants_file() -> None:
    """A 1M run written over the 100k/300k file: each setting keeps the sizes it did not measure,
    a size measured again takes the new figures, another benchmark's part stays, and the command
    names both runs (so the file says how to measure all of it again); another machine's run
    replaces the file."""
    old_row = {k: 1.0 for k in CONSTANT_FIGURES}
    new_row = {k: 2.0 for k in CONSTANT_FIGURES}
    first = "python -m bench.bench_engine --sizes 100000 300000"
    old = constants({"100000": {"edge": old_row}, "300000": {"edge": old_row}}, first)
    old["served"] = {"chunks": 2468}
    second = "python -m bench.bench_engine --sizes 300000 1000000 --quantization binary"
    new = constants(
        {"300000": {"edge-binary": new_row}, "1000000": {"edge-binary": new_row}}, second
    )
    merged = merged_constants(old, new)
    assert [p["chunks"] for p in merged["settings"]["none"]] == [100_000, 300_000]
    assert [(p["chunks"], p["seal_s"]) for p in merged["settings"]["binary"]] == [
        (300_000, 2.0),
        (1_000_000, 2.0),
    ]
    assert merged["served"] == {"chunks": 2468}
    assert merged["measured"]["command"] == f"{first} && {second}"
    again = constants({"100000": {"edge": new_row}, "300000": {"edge": new_row}}, first)
    remeasured = merged_constants(old, again)  # every old point measured again: one command
    assert remeasured["measured"]["command"] == first
    assert [p["seal_s"] for p in remeasured["settings"]["none"]] == [2.0, 2.0]
    elsewhere = dict(new, measured=new["measured"] | {"cores": 64})
    assert merged_constants(old, elsewhere) == elsewhere  # another machine's: nothing of this one
    # graphs of another width: nothing of the old file's; a file naming none was built at 100
    wider = dict(new, measured=new["measured"] | {"ef_construct": 200})
    old["recall"] = {"chunks": 315_045, "ef_construct": 100}  # bench_quantization's, its width
    assert merged_constants(old, wider) == wider | {
        "served": {"chunks": 2468},
        "recall": {"chunks": 315_045, "ef_construct": 100},
    }
    unnamed = dict(old, measured={k: v for k, v in old["measured"].items() if k != "ef_construct"})
    assert merged_constants(unnamed, new)["settings"]["none"] == old["settings"]["none"]


def test_the_cli_plans_the_brief_from_the_shipped_constants(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    shipped = load_constants()
    assert shipped["measured"]["command"].startswith("python -m bench.bench_engine")
    args = ["plan", "--documents", "5000000", "--qps", "50", "--p95-ms", "150"]
    assert main([*args, "--edits-per-day", "20000", "--memory-gb", "24", "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert "brief: 20,000,000 chunks" in out and "EXTRAPOLATED" in out
    assert all(name in out for name in shipped["settings"])
    case = tmp_path / "case.json"
    case.write_text(json.dumps(CASE))
    assert main(["plan", "--chunks", "500000", "--constants", str(case), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["extrapolated_by"] == 0.5 and plan["brief"]["chunks"] == 500_000
    assert main(["plan", "--chunks", "10", "--constants", str(tmp_path / "none.json")]) == 2
    assert "cannot read the plan constants" in capsys.readouterr().err
    assert CONSTANTS.is_file()


def test_the_plan_says_when_the_deployment_builds_graphs_of_another_width(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The constants' graphs were built at one width (a file naming none: Qdrant's 100); a
    deployment building at another (the flag or RAG_HNSW_EF_CONSTRUCT) is told its figures are
    the constants' width's, not scaled; at the same width nothing is said."""
    case = tmp_path / "case.json"
    case.write_text(json.dumps(CASE))
    monkeypatch.delenv("RAG_HNSW_EF_CONSTRUCT", raising=False)
    plan = ["plan", "--chunks", "500000", "--constants", str(case)]
    assert main([*plan, "--hnsw-ef-construct", "100"]) == 0
    assert "NOT MEASURED AT THIS WIDTH" not in capsys.readouterr().out
    assert main([*plan, "--hnsw-ef-construct", "200"]) == 0
    out = capsys.readouterr().out
    assert (
        "graphs built at ef_construct 200 (RAG_HNSW_EF_CONSTRUCT or --hnsw-ef-construct), " in out
    )
    assert "the constants' at 100: the build times and latencies below are those of 100" in out
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(CASE | {"measured": CASE["measured"] | {"ef_construct": 200}}))
    monkeypatch.setenv("RAG_HNSW_EF_CONSTRUCT", "200")
    assert main(["plan", "--chunks", "500000", "--constants", str(wide), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert (made["ef_construct"], made["measured_ef_construct"]) == (200, 200)
    assert main([*plan, "--hnsw-ef-construct", "5000"]) == 2  # the setting's bounds


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--memory-gb", "0"], "--memory-gb must be a finite number > 0"),  # not this machine's
        (["--cores", "0"], "--cores must be a finite number > 0"),
        (["--qps", "nan"], "--qps must be a finite number > 0"),
        (["--documents", "-5"], "--documents must be > 0; got -5"),  # the flag given, named
        (["--recall-at10", "1.5"], "--recall-at10 must be in (0, 1]; got 1.5"),
        (["--recall-at10", "0"], "--recall-at10 must be in (0, 1]; got 0"),
        (["--recall-at10", "nan"], "--recall-at10 must be in (0, 1]; got nan"),
    ],
)
def test_a_brief_of_nothing_is_refused_naming_the_flag_given(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["plan", "--documents", "1000", *flags]) == 2
    assert message in capsys.readouterr().err


def served_figures(**figures: float | None) -> dict[str, Any]:
    """bench_brief's `served` constants: a load at 50 q/s and `figures`."""
    return {
        "command": "python -m bench.bench_brief",
        "qps": 50,
        "load_p50_ms": 200.0,
        "load_p95_ms": 500.0,
        "load_failed": 0,
        "load_sent": 900,
        **figures,
    }


def test_the_served_figures_add_the_http_services_own_cost_to_each_query() -> None:
    # engine 2 ms + encoding 10 ms at 100k: the service adds 28 ms
    served = served_figures(chunks=100_000, single_p50_ms=40.0)
    plan = make_plan(Brief(chunks=1_000_000), dict(CASE, served=served))
    assert plan.overhead_ms == pytest.approx(28.0)
    # a float32 version measured as several shards checks the shard model; the engine's cost at
    # the served size still comes from the fit through the one-shard points
    sharded = dict(figures(3_000_000, 3000.0, 30.0, 60.0), shards=3)
    settings = dict(CASE["settings"], none=[*CASE["settings"]["none"], sharded])
    several = make_plan(Brief(chunks=1_000_000), dict(CASE, served=served, settings=settings))
    assert several.overhead_ms == pytest.approx(28.0)
    none = plan.settings[0]
    assert none.p50_ms == pytest.approx(4.0 + 10.0 + 28.0)
    assert none.machine_qps == pytest.approx(2000 / 42.0)


def test_the_services_own_cost_is_read_from_the_answers_where_measured() -> None:
    """bench_brief now records each answer's own split (timings_ms): the service's cost is its
    median remainder, not the single query less an engine fitted far below its smallest point."""
    served = served_figures(
        chunks=2_469,
        single_p50_ms=40.0,
        single_encode_p50_ms=9.0,
        single_search_p50_ms=1.5,
        service_p50_ms=11.0,  # the median of the remainders: not 40 - 9 - 1.5
    )
    plan = make_plan(Brief(chunks=1_000_000), dict(CASE, served=served))
    assert plan.overhead_ms == pytest.approx(11.0)
    assert plan.settings[0].p50_ms == pytest.approx(4.0 + 10.0 + 11.0)
    # not measured (None: a phase with failures) or not a number: the fit, as before
    for missing in (None, math.nan):
        served = served_figures(chunks=100_000, single_p50_ms=40.0, service_p50_ms=missing)
        fallback = make_plan(Brief(chunks=1_000_000), dict(CASE, served=served))
        assert fallback.overhead_ms == pytest.approx(28.0)


def test_the_recall_measured_on_real_embeddings_is_said_beside_the_figures() -> None:
    """The plan's figures hold no recall; where the constants have it (bench_quantization
    --constants-out), the plan says what it was at the largest size measured and how far past
    it the brief is, and says nothing where they have none."""
    from bench.bench_quantization import recall_constants

    result = {
        "chunks": 315_045,
        **{
            s: {"dense@10": v, "dense@100": v - 0.2}
            for s, v in (("none", 0.9516), ("int8", 0.95249), ("binary", 0.89331))
        },
    }
    argv = ["--distractors", "300000", "--json", "r.json", "--constants-out", "capacity.json"]
    recall = recall_constants(result, argv)
    assert recall["command"] == "python -m bench.bench_quantization --distractors 300000"
    assert recall["dense_at10_of_exact"] == {"none": 0.9516, "int8": 0.9525, "binary": 0.8933}
    assert recall["searched"]["binary"] == "ef 8x, oversampling 4"
    constants = {**CASE, "recall": recall}
    text = "\n".join(describe(make_plan(Brief(chunks=20_000_000, dim=8), constants)))
    assert (
        "real embeddings at 315,045 chunks, the largest measured: none 0.952, int8 0.953, binary "
        "0.893"
        in text
        and "this brief is 63x past it" in text
    )
    assert "searched otherwise" not in text and "builds" not in text
    # over several builds of each graph (bench_quantization --builds): the means, said so
    built = {
        **result,
        "builds": {
            s: [result[s], {"dense@10": 0.0, "dense@100": 0.0}] for s in ("none", "int8", "binary")
        },
    }
    means = recall_constants(built, [*argv, "--builds", "2"])
    assert means["builds"] == 2 and means["dense_at10_of_exact"]["none"] == 0.4758
    text = "\n".join(
        describe(make_plan(Brief(chunks=20_000_000, dim=8), {**CASE, "recall": means}))
    )
    assert (
        "the largest measured: none 0.476, int8 0.476, binary 0.447, each the mean of 2 builds of "
        "its graph (`python -m bench.bench_quantization --distractors 300000 --builds 2`)" in text
    )
    assert "real embeddings" not in "\n".join(
        describe(make_plan(Brief(chunks=20_000_000, dim=8), CASE))
    )
    # binary fits and meets the p95 (the first case's pick) but holds 0.89 of the top 10 where
    # 0.95 is asked: nothing is recommended; asked for 0.85, binary is
    plan = make_plan(Brief(chunks=20_000_000, dim=8), constants)
    assert plan.recommended is None and plan.settings[1].meets["recall"] is False
    assert "so not recommended: binary" in "\n".join(describe(plan))
    lenient = make_plan(Brief(chunks=20_000_000, dim=8, recall_at10=0.85), constants)
    assert lenient.recommended == "binary" and "not recommended" not in "\n".join(describe(lenient))
    # a setting the recall run did not score is not held to it, and the plan says so
    partial = {**recall, "dense_at10_of_exact": {"none": 0.9516}}
    plan = make_plan(Brief(chunks=20_000_000, dim=8), {**CASE, "recall": partial})
    assert plan.recommended == "binary" and "recall" not in plan.settings[1].meets
    assert "recall not measured, so not held to --recall-at10: binary" in "\n".join(describe(plan))
    # a recall of wider graphs than the deployment builds credits no setting (a narrower graph
    # holds less); one of narrower graphs does (a wider graph holds no less)
    lenient_brief = Brief(chunks=20_000_000, dim=8, recall_at10=0.85)
    wide = {**CASE, "recall": recall | {"ef_construct": 200}}
    plan = make_plan(lenient_brief, wide)
    assert plan.recommended is None and plan.settings[1].meets["recall"] is False
    text = "\n".join(describe(plan))
    assert "built at ef_construct 200" in text and "not recommended" not in text
    assert (
        "NOT MEASURED AT THIS WIDTH: that recall is of graphs built at ef_construct 200, wider "
        "than this deployment's 100" in text
    )
    plan = make_plan(lenient_brief, wide, ef_construct=200)
    text = "\n".join(describe(plan))
    assert plan.recommended == "binary" and "NOT MEASURED AT THIS WIDTH: that" not in text
    plan = make_plan(Brief(chunks=20_000_000, dim=8), constants, ef_construct=200)
    text = "\n".join(describe(plan))
    assert plan.recommended is None and "so not recommended: binary" in text
    assert "built at ef_construct 100" in text and "NOT MEASURED AT THIS WIDTH: that" not in text
    # a recall that does not say how it searched was measured at ef 4x and oversampling 2
    older = {k: v for k, v in recall.items() if k != "searched"}
    text = "\n".join(describe(make_plan(Brief(chunks=20_000_000), {**CASE, "recall": older})))
    assert (
        "searched otherwise than today: none at ef 4x, int8 at ef 4x, oversampling 2, binary at "
        "ef 4x, oversampling 2" in text
    )


def test_points_searched_otherwise_than_today_are_named() -> None:
    """The benchmark records how each point's searches were asked (HNSW breadth; oversampling
    where quantized); a point without them was measured at ef 4x and oversampling 2 (before
    the night of 2026-12-06). The plan names the points a setting is no longer searched as."""
    row = {k: 1.0 for k in CONSTANT_FIGURES}
    made = constants({"100000": {"edge": row, "edge-binary": row, "edge-int8": row}}, "c")
    none, binary, int8 = (made["settings"][s][0] for s in ("none", "binary", "int8"))
    assert "oversampling" not in none and none["ef_per_result"] == 8
    assert binary["oversampling"] == 4.0 and int8["oversampling"] == 2.0
    today = dict(figures(1_000_000, 250.0, 4.0, 8.0), ef_per_result=8, oversampling=4.0)
    settings = {
        "none": [
            figures(100_000, 100.0, 2.0, 4.0),
            dict(figures(1_000_000, 1e3, 4.0, 8.0), ef_per_result=8),
        ],
        "binary": [figures(100_000, 25.0, 2.0, 4.0), today],
    }
    plan = make_plan(Brief(chunks=1_000_000), dict(CASE, settings=settings))
    assert [s.other_search for s in plan.settings] == [
        [(100_000, "ef 4x", True)],
        [(100_000, "ef 4x, oversampling 2", True)],
    ]
    text = "\n".join(describe(plan))
    assert (
        "binary: searched today at ef 8x, oversampling 4, measured otherwise at 100,000 (ef 4x, "
        "oversampling 2) chunks: its latency there is below today's" in text
    )
    # a wider search than today's is not called "below"; float32 has no oversampling to read
    wider = [figures(100_000, 25.0, 2.0, 4.0) | {"ef_per_result": 16, "oversampling": None}, today]
    plan = make_plan(Brief(chunks=1_000_000), dict(CASE, settings=dict(settings, binary=wider)))
    assert plan.settings[1].other_search == [(100_000, "ef 16x, oversampling 2", False)]
    assert "its latency there is not today's" in "\n".join(describe(plan))


def test_machines_are_added_until_the_p95_is_met_where_one_machine_alone_can_meet_it() -> None:
    """At 1M chunks a query takes 14 ms p50 and 18 ms p95 (with its 10 ms encoding): 1,000
    queries/s are a load of 7 machines, 10 at 70% use (p95 18 / (1 - 0.7) = 60 ms). A p95 of 25
    ms needs r >= 7 / (1 - 18/25) = 25 machines: 24 give 25.4 ms. The plan counted the 10 and
    said no setting met the p95."""
    none = make_plan(Brief(chunks=1_000_000, qps=1000, p95_ms=25), CASE).settings[0]
    assert none.machines_for_qps == 25 and none.meets["p95"]
    assert none.p95_replicated_ms == pytest.approx(18 / (1 - 7 / 25), rel=1e-6)
    assert 18 / (1 - 7 / 24) > 25
    # a target just above one query's own p95: 18 / 18.5 asks 7 / (1 - 0.973) = 260 machines,
    # each 3% used: not added, the p95 not met (the plan recommended hundreds of idle machines)
    near = make_plan(Brief(chunks=1_000_000, qps=1000, p95_ms=18.5), CASE).settings[0]
    assert near.machines_for_qps == math.ceil(1000 / (2000 / 14 * 0.7)) and not near.meets["p95"]
    # a small load: one machine at 22% use (p95 23.2 ms) gets a second for a 22 ms target
    small = make_plan(Brief(chunks=1_000_000, qps=32, p95_ms=22), CASE).settings[0]
    assert small.machines_for_qps == 2 and small.meets["p95"]
    # a target below one query's own p95: no number of machines meets it, none added
    tight = make_plan(Brief(chunks=1_000_000, qps=1000, p95_ms=15), CASE).settings[0]
    assert tight.machines_for_qps == math.ceil(1000 / (2000 / 14 * 0.7)) and not tight.meets["p95"]


def test_a_setting_measured_to_a_smaller_size_than_the_others_is_said_extrapolated() -> None:
    constants = dict(
        CASE,
        settings={
            "none": CASE["settings"]["none"],
            "binary": [figures(100_000, 25.0, 2.0, 4.0)],
        },
    )
    text = "\n".join(describe(make_plan(Brief(chunks=500_000), constants)))
    assert "within the measured sizes (largest 1,000,000 chunks)" in text
    assert "EXTRAPOLATED: binary was measured up to 100,000 chunks: 5.0x that" in text
    assert "EXTRAPOLATED: none" not in text
