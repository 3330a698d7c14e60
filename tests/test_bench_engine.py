"""The engine benchmark's own parts that its figures rest on: the synthetic chunks (the same
length at every corpus size), the brute-force search its recall is measured against, and the
split of a serving process's resident memory. Oracles: the windows written out by hand, a full
cosine ranking of the vectors held, and an smaps text summed by hand."""

from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from bench import bench_engine
from bench.bench_bm25 import iter_synthetic_chunks
from bench.bench_engine import (
    BATCH,
    _unit_vectors,
    exact_top,
    resident_mb,
    rss_parts_mb,
)
from rag_retriever.store import EdgeStore
from rag_retriever.store.base import QDRANT_EF_CONSTRUCT
from rag_retriever.store.shards import BASE_SHARD_POINTS
from tests.conftest import graph_configs, shared_data

SENTENCES = [f"s{i}" for i in range(10)]
CAP = "--cap-fraction takes a fraction in (0, 1]"
SIZES = "--questions must be at least 1 and --distractors at least 0"


def test_synthetic_chunks_stay_two_to_four_sentences_and_distinct_past_the_windows() -> None:
    chunks = list(iter_synthetic_chunks(200, SENTENCES))
    assert len(chunks) == 200
    # first the windows of 2, 3 and 4 consecutive sentences (8, 7 and 6 of them)
    assert chunks[:3] == ["s0 s1", "s1 s2", "s2 s3"]
    assert chunks[8] == "s0 s1 s2" and chunks[15] == "s0 s1 s2 s3"
    # past them, a sentence and the ones after a gap, wrapping round
    assert chunks[21:23] == ["s0 s2", "s1 s3"] and chunks[30] == "s9 s1"
    assert all(2 <= len(c.split()) <= 4 for c in chunks)
    assert len(set(chunks)) == len(chunks)


def test_exact_top_is_a_full_cosine_ranking_of_the_build_vectors() -> None:
    n = 3 * BATCH + 17  # a short last batch, as a build's
    rng = np.random.default_rng(0)
    held = np.concatenate([_unit_vectors(rng, min(BATCH, n - s)) for s in range(0, n, BATCH)])
    queries = _unit_vectors(np.random.default_rng(7), 5)
    want = np.argsort(-(queries @ held.T), axis=1, kind="stable")[:, :100]
    assert (exact_top(queries, n, k=100) == want).all()


SEG = "/data/segments/kb--1/segments/9f2c"
SMAPS = f"""\
55d0a000-55d0b000 r--p 00000000 fd:01 10 /usr/bin/python3.11
Rss:                 512 kB
Pss:                 512 kB
55d0c000-55d0f000 rw-p 00000000 00:00 0 [heap]
Rss:                2048 kB
7f0000000000-7f0010000000 r--s 00000000 fd:01 20 {SEG}/vector_storage-dense/matrix.dat
Rss:              307200 kB
VmFlags: rd sh mr mw me ms sd
7f0010000000-7f0011000000 r--s 00000000 fd:01 21 {SEG}/vector_storage-dense/quantized.data
Rss:               10240 kB
7f0011000000-7f0012000000 r--s 00000000 fd:01 22 {SEG}/vector_index-dense/links_compressed.bin
Rss:               40960 kB
7f0012000000-7f0013000000 r--s 00000000 fd:01 23 {SEG}/vector_index-bm25/inverted_index.dat
Rss:                8192 kB
7f0013000000-7f0014000000 r--s 00000000 fd:01 24 {SEG}/payload_index/x-doc_id-map/data.bin
Rss:                1024 kB
7f0014000000-7f0015000000 rw-p 00000000 00:00 0
Rss:                4096 kB
7f0015000000-7f0016000000 r--s 00000000 fd:01 25 {SEG}/id_tracker.mappings
Rss:                1024 kB
"""


def test_resident_memory_is_split_by_the_shard_file_each_page_maps() -> None:
    parts = rss_parts_mb(SMAPS)
    assert parts == {
        "quantized vectors": 10.0,
        "dense vectors": 300.0,
        "HNSW graph": 40.0,
        "BM25": 8.0,
        "payloads and their indexes": 1.0,
        "point ids": 1.0,
        "other files": 0.5,
        "private": 6.0,  # the heap and the anonymous mapping
    }
    # every Rss line counted once
    assert (
        sum(parts.values())
        == (512 + 2048 + 307200 + 10240 + 40960 + 8192 + 1024 + 4096 + 1024) / 1024
    )


def test_a_quantized_version_needs_resident_all_it_holds_but_the_originals_it_rescored() -> None:
    parts = rss_parts_mb(SMAPS)
    assert resident_mb(parts, "none") == pytest.approx(366.5)  # float32 searches its vectors
    assert resident_mb(parts, "binary") == pytest.approx(66.5)  # less the originals' 300 MB
    assert resident_mb(parts, "int8") == pytest.approx(66.5)


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        # no float32 to take the cap of
        ("bench_engine", ["--cap-fraction", "0.4", "--quantization", "binary"], CAP),
        ("bench_engine", ["--cap-fraction", "1.5", "--quantization", "none", "binary"], CAP),
        ("bench_engine", ["--cap-fraction", "0", "--quantization", "none"], CAP),
        (
            "bench_engine",
            ["--shard-points", "0"],
            "argument --shard-points: takes a positive count (got 0)",
        ),
        (
            "bench_engine",
            ["--shard-points", "1e6"],
            "argument --shard-points: takes a positive count (got '1e6')",
        ),
        (
            "bench_engine",
            ["--ef-construct", "3"],
            "argument --ef-construct: takes a graph width of 4-4096 (got '3')",
        ),
        (
            "bench_engine",
            ["--ef-construct", "0"],
            "argument --ef-construct: takes a graph width of 4-4096 (got '0')",
        ),
        (
            "bench_engine",
            ["--ef-construct", "wide"],
            "argument --ef-construct: takes a graph width of 4-4096 (got 'wide')",
        ),
        (
            "bench_engine",
            ["--ef-construct", "5000"],
            "argument --ef-construct: takes a graph width of 4-4096 (got '5000')",
        ),
        (
            "bench_engine",
            ["--ef-construct", "100", "200", "100"],
            "--ef-construct: each width once (100 is given twice)",
        ),
        (
            "bench_engine",
            ["--ef-construct", "100", "200", "--constants-out", "c.json"],
            "--constants-out takes a run of one --ef-construct",
        ),
        (
            "bench_quantization",
            ["--ef-construct", "5000"],
            "argument --ef-construct: takes a graph width of 4-4096 (got '5000')",
        ),
        ("bench_quantization", ["--distractors", "-1"], SIZES),
        ("bench_quantization", ["--questions", "0"], SIZES),
        ("bench_quantization", ["--dataset", "nope"], "argument --dataset: invalid choice"),
        (
            "bench_quantization",
            ["--shard-points", "0"],
            "argument --shard-points: takes a positive count (got 0)",
        ),
        (
            "bench_quantization",
            ["--ef-per-result", "0"],
            "argument --ef-per-result: takes a positive count (got 0)",
        ),
        (
            "bench_quantization",
            ["--oversampling", "0.5"],
            "argument --oversampling: takes a number of at least 1 (got 0.5)",
        ),
        (
            "bench_quantization",
            ["--oversampling", "nan"],
            "argument --oversampling: takes a number of at least 1 (got nan)",
        ),
        (
            "bench_quantization",
            ["--constants-out", "/nonexistent/capacity.json"],
            "--constants-out /nonexistent/capacity.json: no such file",
        ),
    ],
)
def test_the_benchmarks_refuse_bad_input_with_exit_2_and_the_message(
    module: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(f"bench.{module}").main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_build_is_written_in_the_shard_size_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(bench_engine.SHARD_POINTS_ENV, raising=False)
    assert bench_engine.shard_points() == BASE_SHARD_POINTS
    # what `--shard-points` sets, for this process and the build and probe processes it starts
    monkeypatch.setenv(bench_engine.SHARD_POINTS_ENV, "2000000")
    store = bench_engine._open("edge", tmp_path)
    assert isinstance(store, EdgeStore) and store.shard_points == 2_000_000
    store.close()


def test_a_build_is_made_at_each_width_asked_for_and_reported_beside_the_first(
    tmp_path: Path,
) -> None:
    """The width reaches the build's own process (and its writer's shards); the report sets a
    wider build beside the same setting's first width, and names a width not the product's."""
    shared_data("scifact"), shared_data("squad_v11_dev")  # the chunks' sentences
    for width in (QDRANT_EF_CONSTRUCT, 200):
        root = tmp_path / str(width)
        figures = bench_engine._build_in_subprocess("edge", root, 300, "int8", width)
        assert figures["ef_construct"] == width and figures["points"] == 300
        wanted = None if width == QDRANT_EF_CONSTRUCT else 200
        assert [c and c["ef_construct"] for c in graph_configs(root)] == [wanted]
    row: dict[str, float] = defaultdict(lambda: 1.0)  # every figure the report prints
    results = {
        "1000": {
            "edge-int8": row | {"ef_construct": 100},
            "edge-int8@200": row | {"ef_construct": 200, "seal_s": 2.0},
            "edge": row | {"ef_construct": 100},
        }
    }
    text = "\n".join(bench_engine.report(results))
    assert "int8 vectors, graph built at ef_construct 200 vs 100):" in text
    assert "Qdrant Edge        2.0   ef_construct 100        1.0   ratio 0.50" in text
    results["1000"] = {"edge": row | {"ef_construct": 300}}
    assert "text, graph built at ef_construct 300):" in bench_engine.report(results)[0]
    # the constants are of one width, which they record; two widths are refused
    assert bench_engine.constants(results, "c")["measured"]["ef_construct"] == 300
    results["1000"]["edge-int8"] = row | {"ef_construct": 100}
    with pytest.raises(ValueError, match=r"graph widths \[100, 300\]"):
        bench_engine.constants(results, "c")
    results["1000"] = {"edge": row, "edge@200": row | {"ef_construct": 200}}
    with pytest.raises(ValueError, match="edge@200: the constants are of one graph width"):
        bench_engine.constants(results, "c")


def test_the_quantization_sweep_scores_each_setting_once_at_each_point_beyond_the_products() -> (
    None
):
    """Hand-computed against the product's constants (ef 8x; int8 oversampled 2, binary and
    binary2 4): float32 once a breadth, each quantized setting at each asked oversampling, and
    no pass the product's own run already scored."""
    from bench.bench_quantization import sweep

    assert sweep([], []) == []
    assert sweep([4, 8], []) == [
        (4, None, [("none", None), ("int8", 2.0), ("binary", 4.0), ("binary2", 4.0)])
    ]
    assert sweep([], [2, 4]) == [(8, 2, [("binary", 2), ("binary2", 2)]), (8, 4, [("int8", 4)])]
    assert sweep([4], [4]) == [(4, 4, [("none", None), ("int8", 4), ("binary", 4), ("binary2", 4)])]
    # an oversampling asked twice scores float32 still once
    assert [p for *_, passes in sweep([4], [2, 2]) for p in passes].count(("none", None)) == 1
