"""bench_quantization's own mechanics: the versions it builds again from one float32 version, the
folders it keeps and takes again, and its report over several builds. The benchmark runs the
real model for an hour; these run the tiny one (its figures are in docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import bench_quantization
from bench.bench_quantization import (
    KEPT,
    _copies,
    _dense,
    _workdir,
    builds_report,
    main,
    sweep,
    walked_with_originals,
)
from rag_retriever.models.encoder import Encoder
from rag_retriever.records import Document
from rag_retriever.store import EdgeStore
from rag_retriever.store.base import HNSW_EF_CONSTRUCT
from tests.conftest import collection_retriever, shared_data

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def test_each_setting_is_built_again_from_the_float32_versions_points(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    docs = [
        Document(f"d{i}", f"Title {i}", " ".join(WORDS[(i + j) % len(WORDS)] for j in range(9)))
        for i in range(40)
    ]
    base = EdgeStore(tmp_path / "none")
    collection_retriever(docs, base, tiny_encoder)
    name = base.resolve("kb")
    matrix, ids = _dense(base, name)
    assert len(ids) == len(set(ids)) == base.record(name).chunks == 40
    points = {p.id: p for p in base.retrieve(name, ids, with_sparse=True)}
    for _ in range(2):  # the second time over the folders the first left
        copies = _copies(base, name, tiny_encoder.dim, ("none", "int8"), tmp_path, ".build2")
        for label, copy in copies.items():
            assert (tmp_path / f"{label}.build2").is_dir()
            assert copy.resolve("kb") == name
            assert copy.record(name).quantization == label
            assert copy.doc_freqs(name) == base.doc_freqs(name)
            got, got_ids = _dense(copy, name)
            assert sorted(got_ids) == sorted(ids)
            # the same float32 vectors (int8 keeps its originals, to rescore), weights, payloads
            row = {i: n for n, i in enumerate(got_ids)}
            np.testing.assert_array_equal(got[[row[i] for i in ids]], matrix)
            for p in copy.retrieve(name, ids, with_sparse=True):
                assert p.sparse == points[p.id].sparse and p.payload == points[p.id].payload
            copy.close()
    base.close()


def test_the_report_over_builds_gives_each_settings_spread_and_its_gap_build_by_build() -> None:
    def figures(at10: float, gold: float) -> dict[str, float]:
        return {
            "dense@10": at10,
            "dense@100": 0.9,
            "dense_recall@10": gold,
            "hybrid_recall@10": 0.8,
        }

    builds = {
        "none": [figures(0.95, 0.82), figures(0.97, 0.84)],
        "int8": [figures(0.96, 0.80), figures(0.94, 0.83)],
    }
    head, none, int8 = builds_report(builds)
    assert head == "-- each setting built 2 times from the same points (the product's search) --"
    assert none.startswith("none: dense@10 0.9600 (0.9500-0.9700), dense@100 0.9000")
    assert "vs none" not in none
    # gaps build by build: dense@10 +0.01 and -0.03, the gold -0.02 and -0.01
    assert "dense@10 0.9500 (0.9400-0.9600)" in int8
    assert "vs none, build by build: dense@10 -0.0100 (-0.0300 to +0.0100)" in int8
    assert "dense_recall@10 -0.0150 (-0.0200 to -0.0100)" in int8
    assert builds_report(None) == builds_report({}) == []


def test_a_sweep_over_some_settings_scores_only_those() -> None:
    assert sweep([4], [], ("none", "int8")) == [(4, None, [("none", None), ("int8", 2.0)])]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--builds", "0"], "argument --builds: takes a positive count (got 0)"),
        (["--settings", "none"], "argument --settings: invalid choice: 'none'"),
        (["--keep", "a", "--reuse", "b"], "argument --reuse: not allowed with argument --keep"),
        (  # any one width is taken: the recall entry records it
            ["--ef-construct", "200", "--constants-out", "missing.json"],
            "--constants-out missing.json: no such file",
        ),
        (
            ["--settings", "int8", "--constants-out", "capacity.json"],
            "--constants-out takes a run of every setting (leave --settings out)",
        ),
    ],
)
def test_bad_arguments_exit_2_with_the_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kept", "argv", "message"),
    [
        (None, [], "not a folder a finished --keep run left"),
        ("[1]", [], "kept.json holds [1]"),
        (
            '{"dataset": "squad", "distractors": 300000, "shard_points": null}',
            ["--distractors", "1000"],
            "built from {'dataset': 'squad', 'distractors': 300000, 'shard_points': None}, "
            "this run asks for {'dataset': 'squad', 'distractors': 1000, 'shard_points': None}",
        ),
    ],
)
def test_a_folder_is_reused_only_as_a_finished_keep_run_of_the_same_corpus_left_it(
    tmp_path: Path,
    kept: str | None,
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shared_data("squad_v11_dev")
    if kept is not None:
        (tmp_path / KEPT).write_text(kept)
    with pytest.raises(SystemExit) as exit_:
        main(["--reuse", str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert f"--reuse {tmp_path}: " in (err := capsys.readouterr().err) and message in err


def test_a_kept_folder_must_start_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared_data("squad_v11_dev")
    (tmp_path / "something").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["--keep", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--keep {tmp_path}: not empty" in capsys.readouterr().err
    assert (tmp_path / "something").exists()  # what was there is left alone


def test_a_kept_folder_records_its_corpus_only_when_the_run_finished(tmp_path: Path) -> None:
    corpus = {"dataset": "squad", "distractors": 10, "shard_points": None}
    with pytest.raises(RuntimeError), _workdir(tmp_path / "cut", None, corpus) as root:
        (root / "none").mkdir()
        raise RuntimeError("the run stopped half-way")
    assert not (tmp_path / "cut" / KEPT).exists()  # nothing to reuse
    with _workdir(tmp_path / "whole", None, corpus) as root:
        (root / "none").mkdir()
    assert json.loads((root / KEPT).read_text()) == corpus
    with _workdir(None, root, corpus) as again:  # taken as it is
        assert again == root and (again / "none").is_dir()


def spy(request: Any, asked: list[Any]) -> Any:
    """EdgeStore._request, recording each dense request's quantization parameters."""

    def recorded(self: EdgeStore, *args: Any, **kwargs: Any) -> Any:
        made = request(self, *args, **kwargs)
        if made.params is not None:
            asked.append(made.params.quantization)
        return made

    return recorded


def test_a_run_keeps_its_float32_version_and_a_second_builds_every_setting_again_from_it(
    tmp_path: Path, tiny_encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run with the tiny model in place of MiniLM and two of SQuAD's articles (the only
    things replaced), five questions."""
    shared_data("squad_v11_dev")
    monkeypatch.setattr(bench_quantization, "load_encoder", lambda settings: tiny_encoder)
    articles = bench_quantization._documents
    monkeypatch.setattr(bench_quantization, "_documents", lambda *a: articles(*a)[:2])
    kept = tmp_path / "kept"
    first = bench_quantization.run(5, quantized=("int8",), keep=kept)
    assert {"none", "int8"} <= first.keys() and "binary" not in first and "builds" not in first
    assert {p.name for p in kept.iterdir()} == {KEPT, "int8", "locks", "none"}
    base = EdgeStore(kept / "none")
    name, made = base.resolve("kb"), base.record(base.resolve("kb")).created_at
    assert first["chunks"] == base.record(name).chunks > 10
    base.close()

    asked: list[Any] = []
    monkeypatch.setattr(EdgeStore, "_request", spy(EdgeStore._request, asked))
    again = bench_quantization.run(5, quantized=("binary2",), builds=2, paired=True, reuse=kept)
    assert again["chunks"] == first["chunks"]
    # the paired pass: binary2's own version, its dense searches asked with the originals only
    paired = again["paired"]["binary2"]
    assert {"top10_differing", "dense_recall@10", "hybrid_recall@10"} <= paired.keys()
    ignored = [q for q in asked if q is not None and q.ignore]
    assert ignored and all(q.rescore is None and q.oversampling is None for q in ignored)
    assert any(q is not None and q.oversampling == 4.0 and not q.ignore for q in asked)
    assert "binary2 on the same graph walked with its float32 originals (ignore)" in "\n".join(
        bench_quantization.report(again)
    )
    assert [len(again["builds"][s]) for s in ("none", "binary2")] == [2, 2]
    assert again["builds"]["none"][0] is again["none"]  # the kept version is build 1
    # the float32 version is the one kept, untouched; each further build was removed
    base = EdgeStore(kept / "none")
    assert base.resolve("kb") == name and base.record(name).created_at == made
    base.close()
    assert {p.name for p in kept.iterdir()} == {KEPT, "binary2", "int8", "locks", "none"}
    recall = bench_quantization.recall_constants(again, ["--builds", "2", "--reuse", str(kept)])
    assert recall["builds"] == 2
    assert recall["command"] == "python -m bench.bench_quantization --builds 2"
    assert recall["dense_at10_of_exact"]["binary2"] == pytest.approx(
        sum(r["dense@10"] for r in again["builds"]["binary2"]) / 2, abs=1e-4
    )
    # another graph width: every scored version a copy built at it, float32's too
    wide = bench_quantization.run(5, quantized=("int8",), ef_construct=200, reuse=kept)
    assert wide["ef_construct"] == 200 and wide["chunks"] == first["chunks"]
    assert "every graph built at ef_construct 200" in bench_quantization.report(wide)[0]
    # its recall entry names the width its graphs were built at (the plan says so beside it)
    assert bench_quantization.recall_constants(wide, [])["ef_construct"] == 200
    assert recall["ef_construct"] == HNSW_EF_CONSTRUCT
    for folder in ("none.copy", "int8"):
        [config] = (kept / folder).rglob("edge_config.json")
        assert (
            json.loads(config.read_text())["vectors"]["dense"]["hnsw_config"]["ef_construct"] == 200
        )
    [config] = (kept / "none").rglob("edge_config.json")  # the kept source, as it was built
    assert json.loads(config.read_text())["vectors"]["dense"].get("hnsw_config") is None
    with pytest.raises(ValueError, match="always scored, as the peer"):
        bench_quantization.run(5, quantized=("none",))
    with pytest.raises(ValueError, match="holds the float32 version"):
        _copies(base, name, tiny_encoder.dim, ("none",), kept, "")


def test_the_originals_are_asked_for_only_within_and_the_engine_is_given_back(
    tmp_path: Path,
) -> None:
    store = EdgeStore(tmp_path / "edge")
    engine = store._edge
    asked = {"rescore": True, "oversampling": 2.0}
    assert not engine.QuantizationSearchParams(**asked).ignore
    with pytest.raises(RuntimeError), walked_with_originals(store):
        params = store._edge.QuantizationSearchParams(**asked)
        assert params.ignore and params.rescore is None and params.oversampling is None
        assert store._edge.SearchParams is engine.SearchParams  # the rest is the engine's
        raise RuntimeError("a search failed")
    assert store._edge is engine
    store.close()
