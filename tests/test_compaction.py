"""Compaction off the write path: a version's shards merged into one new base while updates go
on, answers unchanged, nothing lost, and safe to kill at every step (rag_retriever/ingest/compaction.py)."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rag_retriever.ingest import compaction as compaction_module
from rag_retriever.ingest.compaction import compact, wait_for_compactions
from rag_retriever.models.bm25 import BM25Model, Tokenizer
from rag_retriever.models.encoder import Encoder
from rag_retriever.records import Document
from rag_retriever.store import DENSE, SPARSE, EdgeStore, StageQuery
from rag_retriever.store import edge as edge_module
from rag_retriever.store import shards as shards_module
from tests.test_update import (
    WORDS,
    _cli_env,
    _files,
    _write_corpus,
    doc,
    served_docs,
    update,
    write,
)


def _outgrow(
    store: EdgeStore,
    encoder: Encoder,
    tmp_path: Path,
    corpus: dict[str, Document],
    rng: random.Random,
    **kw: Any,
) -> Any:
    """Deferred updates of a few documents each until the served version's deltas outgrow its
    base (the update says a compaction is due); `corpus` follows the changes."""
    for _ in range(40):
        changed = [doc(rng.randrange(60), rng, rng.randint(3, 9)) for _ in range(4)]
        changed = list({d.id: d for d in changed}.values())
        gone = rng.sample(sorted(set(corpus) - {d.id for d in changed}), 1)
        report = update(store, encoder, tmp_path, changed, gone, compaction="deferred", **kw)
        corpus.update({d.id: d for d in changed})
        del corpus[gone[0]]
        if report.compaction == "due":
            return report
    raise AssertionError("the deltas never outgrew the base")


def _texts(store: EdgeStore, name: str) -> dict[str, str]:
    by_doc: dict[str, list[tuple[int, str]]] = {}
    for r in store.scroll(name):
        by_doc.setdefault(str(r.payload["doc_id"]), []).append(
            (int(r.payload["chunk_index"]), str(r.payload["text"]))
        )
    return {d: " ".join(t for _, t in sorted(chunks)) for d, chunks in by_doc.items()}


def _answers(store: EdgeStore, name: str, rng: random.Random) -> list[list[tuple[str, float]]]:
    """Dense and BM25 top-k lists for a few queries (k up to past the corpus)."""
    model = BM25Model(store.record(name).bm25, store.doc_freqs(name))
    live = sorted(r.id for r in store.scroll(name))  # the same choices in every version
    records = sorted(store.retrieve(name, live, with_dense=True), key=lambda r: r.id)
    queries = []
    for terms in (rng.sample(WORDS, 1), rng.sample(WORDS, 2), rng.sample(WORDS, 3)):
        sparse = model.query_vector(Tokenizer().tokenize(" ".join(terms)))
        dense = records[rng.randrange(len(records))].dense
        assert dense is not None
        for limit in (1, 5, 200):
            queries += [StageQuery(SPARSE, sparse, limit), StageQuery(DENSE, dense, limit)]
    return store.search(name, queries)


def _same_answers(a: list[list[tuple[str, float]]], b: list[list[tuple[str, float]]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose([s for _, s in x], [s for _, s in y], rtol=1e-5, atol=1e-6)
        # the same points, apart from the order of ties
        assert {p for p, s in x if s > x[-1][1] + 1e-5} == {p for p, s in y if s > y[-1][1] + 1e-5}


def test_a_compaction_serves_the_same_points_from_one_new_base(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(1)
    corpus = {f"d{i}": doc(i, rng, rng.randint(3, 9)) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    due = _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    before = store.manifest(due.collection).segments
    assert len(before) >= 2 and store.compaction_due(due.collection)  # the write left the merge
    shards = {s.id: _files(tmp_path / "edge" / "segments" / s.id) for s in before}
    answers = _answers(store, due.collection, random.Random(7))

    report = compact(store, "kb", lock_dir=tmp_path)

    assert report.outcome == "compacted" and report.source == due.collection
    name = store.aliases()["kb"]
    assert name == report.collection and report.shards_merged == len(before)
    (base,) = store.manifest(name).segments
    assert not base.deleted and base.points == report.points == store.count(name)
    record, was = store.record(name), store.record(due.collection)
    assert record.status == "complete" and record.lineage.compacted
    assert record.lineage.base == due.collection and record.lineage.deltas == was.lineage.deltas
    assert (record.chunks, record.documents, record.bm25) == (was.chunks, was.documents, was.bm25)
    assert store.doc_freqs(name) == store.doc_freqs(due.collection)
    assert _texts(store, name) == {d.id: d.text for d in corpus.values()}
    _same_answers(_answers(store, name, random.Random(7)), answers)
    # the version it replaces was not written to (still served by rollback)
    assert {s: _files(tmp_path / "edge" / "segments" / s) for s in shards} == shards
    assert not store.compaction_due(name)
    assert compact(store, "kb", lock_dir=tmp_path).outcome == "not_due"
    store.close()


def test_updates_during_a_compaction_are_in_the_version_it_makes(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the new base is built (no lock held) two updates land, retention runs with a grace
    of 0 and keeps one version: the compacted version holds their changes (their tombstones in
    the merged shards carried onto the new base), and its answers equal the last update's."""
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(2)
    corpus = {f"d{i}": doc(i, rng, rng.randint(3, 9)) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    build = EdgeStore.build_compaction
    during: dict[str, Any] = {}

    def build_then_update(self: EdgeStore, job: Any) -> Any:
        built = build(self, job)
        noted = [s.id for s in job.segments]
        assert self.running_compaction("kb")["segments"] == noted  # type: ignore[index]
        for changed, gone in (([doc(3, rng), doc(70, rng)], ["d5"]), ([doc(71, rng)], ["d3"])):
            report = update(
                store,
                tiny_encoder,
                tmp_path,
                changed,
                gone,
                compaction="inline",
                keep_versions=1,
                retention_grace_s=0,
            )
            corpus.update({d.id: d for d in changed})
            corpus.pop(gone[0])
            # the shards being compacted are neither merged nor deleted meanwhile
            assert [s.id for s in store.manifest(report.collection).segments][: len(noted)] == noted
            assert (tmp_path / "edge" / "segments" / job.shards[0]).is_dir()
        during["last"] = report.collection
        during["answers"] = _answers(store, report.collection, random.Random(9))
        return built

    monkeypatch.setattr(EdgeStore, "build_compaction", build_then_update)
    report = compact(store, "kb", lock_dir=tmp_path, keep_versions=1, retention_grace_s=0)

    assert report.outcome == "compacted"
    name = store.aliases()["kb"]
    assert store.record(name).lineage.base == during["last"]
    assert _texts(store, name) == {d.id: d.text for d in corpus.values()}
    assert store.count(name) == store.record(name).chunks
    _same_answers(_answers(store, name, random.Random(9)), during["answers"])
    segments = store.manifest(name).segments
    assert segments[0].deleted  # d3 and d5 were tombstoned in the merged shards meanwhile
    # retention kept one version: only the shards it names are left, the marker is gone
    assert {p.name for p in (tmp_path / "edge" / "segments").iterdir()} == {s.id for s in segments}
    assert store.running_compaction("kb") is None
    store.close()


def test_a_compaction_overtaken_by_a_full_build_is_dropped_and_its_shard_deleted(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(3)
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    build = EdgeStore.build_compaction

    def build_then_rebuild(self: EdgeStore, job: Any) -> Any:
        built = build(self, job)
        write(store, tiny_encoder, tmp_path, list(corpus.values()), full=True)
        return built

    monkeypatch.setattr(EdgeStore, "build_compaction", build_then_rebuild)
    report = compact(store, "kb", lock_dir=tmp_path)
    assert report.outcome == "dropped" and "no longer reads" in report.message
    name = store.aliases()["kb"]
    assert store.record(name).lineage.base is None  # the full build still serves
    named = {s.id for i in store.versions("kb") for s in store.manifest(i.name).segments}
    assert {p.name for p in (tmp_path / "edge" / "segments").iterdir()} == named
    store.close()


def test_one_compaction_at_a_time_and_a_dead_one_names_nothing(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(4)
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    job = store.begin_compaction("kb")
    assert job is not None
    assert store.begin_compaction("kb") is None
    assert compact(store, "kb", lock_dir=tmp_path).outcome == "running"
    # a second process sees it too (the marker's lock, not this process's memory)
    other = EdgeStore(tmp_path / "edge")
    assert other.running_compaction("kb") == {
        "source": job.source,
        "kind": job.kind,
        "segments": [s.id for s in job.segments],
        "shards": list(job.shards),
        "pid": job_pid(),
    }
    store.end_compaction(job)
    assert other.running_compaction("kb") is None
    # a marker left by a process that died (its lock let go) is stale: ignored
    (tmp_path / "edge" / "compactions" / "kb.json").write_text('{"shards": ["kb--stale"]}')
    assert other.running_compaction("kb") is None
    assert compact(other, "kb", lock_dir=tmp_path).outcome == "compacted"
    other.close()
    store.close()


def _piled_up(
    store: EdgeStore,
    encoder: Encoder,
    tmp_path: Path,
    corpus: dict[str, Document],
    rng: random.Random,
    sizes: tuple[int, ...],
) -> Any:
    """Deferred updates of `sizes` documents each (new ones, and one deleted each time), none of
    them merged by the update (INLINE_MERGE_POINTS is 0): one delta shard each."""
    report = None
    for n in sizes:
        changed = [doc(100 + len(corpus) + i, rng, rng.randint(3, 9)) for i in range(n)]
        gone = rng.sample(sorted(corpus), 1)
        report = update(store, encoder, tmp_path, changed, gone, compaction="deferred")
        corpus.update({d.id: d for d in changed})
        del corpus[gone[0]]
    return report


@pytest.fixture
def no_inline_merges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Updates merge no delta shards themselves, and the deltas never outgrow the base: every
    merge is a delta-shard compaction's."""
    monkeypatch.setattr(edge_module, "INLINE_MERGE_POINTS", 0)
    monkeypatch.setattr(shards_module, "BASE_MERGE_FRACTION", 100.0)


@pytest.mark.usefixtures("no_inline_merges")
def test_piled_up_delta_shards_are_merged_off_the_write_path_and_the_base_is_kept(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big delta, then two small ones: three delta shards, more than MAX_DELTA_SHARDS, so the
    update says a compaction is due. The compaction merges the binary counter's run (the two
    small ones, the big one is more than MERGE_RATIO times them) into one delta shard; the base
    and the big delta shard are the same shards, with the same tombstones. An update that merges
    inside the write while it runs leaves the shards before the run alone too."""
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(11)
    corpus = {f"d{i}": doc(i, rng, rng.randint(3, 9)) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    due = _piled_up(store, tiny_encoder, tmp_path, corpus, rng, (12, 1, 1))
    before = store.manifest(due.collection).segments
    assert len(before) == 4 and due.compaction == "due"
    shards = {s.id: _files(tmp_path / "edge" / "segments" / s.id) for s in before}
    build = EdgeStore.build_compaction
    during: dict[str, Any] = {}

    def build_then_update(self: EdgeStore, job: Any) -> Any:
        built = build(self, job)
        assert job.kind == "deltas" and job.segments == before[2:]
        added = doc(90, rng)
        report = update(store, tiny_encoder, tmp_path, [added], compaction="inline")
        corpus[added.id] = added
        during["answers"] = _answers(store, report.collection, random.Random(7))
        return built

    monkeypatch.setattr(EdgeStore, "build_compaction", build_then_update)
    report = compact(store, "kb", lock_dir=tmp_path)

    assert report.outcome == "compacted" and report.kind == "deltas"
    assert report.shards_merged == 2 and report.points == before[2].live + before[3].live
    name = store.aliases()["kb"]
    after = store.manifest(name).segments
    assert after[:2] == before[:2] and len(after) == 4  # the base and the big delta as they were
    assert after[2].id not in shards and not after[2].deleted and after[3].id not in shards
    assert store.count(name) == store.record(name).chunks
    assert store.record(name).lineage.compacted
    assert _texts(store, name) == {d.id: d.text for d in corpus.values()}
    _same_answers(_answers(store, name, random.Random(7)), during["answers"])
    assert {s: _files(tmp_path / "edge" / "segments" / s) for s in shards} == shards
    # the update added a third delta shard again: due, and the next run merges the newest two
    monkeypatch.setattr(EdgeStore, "build_compaction", build)
    assert store.compaction_due(name)
    again = compact(store, "kb", lock_dir=tmp_path)
    assert (again.outcome, again.kind, again.shards_merged) == ("compacted", "deltas", 2)
    assert again.collection is not None
    assert store.manifest(again.collection).segments[:2] == before[:2]
    assert not store.compaction_due(again.collection)
    assert compact(store, "kb", lock_dir=tmp_path).outcome == "not_due"
    store.close()


@pytest.mark.usefixtures("no_inline_merges")
def test_updates_during_a_delta_shard_compaction_are_in_the_version_it_makes(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the merged delta shard is built, updates tombstone points of the merged shards and
    of the base and add shards of their own; the version made keeps all of it, and, still
    due, a background run compacts again until it is not."""
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(12)
    corpus = {f"d{i}": doc(i, rng, rng.randint(3, 9)) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    due = _piled_up(store, tiny_encoder, tmp_path, corpus, rng, (2, 2, 2))
    base = store.manifest(due.collection).segments[0].id
    build = EdgeStore.build_compaction
    during: dict[str, Any] = {}

    def build_then_update(self: EdgeStore, job: Any) -> Any:
        built = build(self, job)
        if during:
            return built
        assert job.kind == "deltas" and len(job.segments) == 3  # every delta shard: 3 > 2
        # one document of the merged shards replaced and one of the base deleted; 2 new shards
        merged = min(int(d[1:]) for d in corpus if int(d[1:]) >= 100)
        based = min(d for d in corpus if int(d[1:]) < 100)
        edits: tuple[tuple[list[Document], list[str]], ...] = (
            ([doc(merged, rng)], [based]),
            ([doc(80, rng)], []),
            ([doc(81, rng)], []),
        )
        for changed, gone in edits:
            report = update(store, tiny_encoder, tmp_path, changed, gone, compaction="deferred")
            corpus.update({d.id: d for d in changed})
            for g in gone:
                corpus.pop(g)
        during["last"] = report.collection
        during["answers"] = _answers(store, report.collection, random.Random(9))
        return built

    monkeypatch.setattr(EdgeStore, "build_compaction", build_then_update)
    reports = compaction_module.compact_while_due(
        store, "kb", lock_dir=tmp_path, keep_versions=1, retention_grace_s=0
    )

    assert [r.outcome for r in reports] == ["compacted", "compacted"]
    assert [r.kind for r in reports] == ["deltas", "deltas"]
    assert not store.exists(str(reports[0].collection))  # retention kept one version
    name = store.aliases()["kb"]
    assert name == reports[1].collection
    assert _texts(store, name) == {d.id: d.text for d in corpus.values()}
    assert store.count(name) == store.record(name).chunks
    _same_answers(_answers(store, name, random.Random(9)), during["answers"])
    segments = store.manifest(name).segments
    assert segments[0].id == base
    assert len(segments) - 1 <= shards_module.MAX_DELTA_SHARDS and not store.compaction_due(name)
    assert {p.name for p in (tmp_path / "edge" / "segments").iterdir()} == {s.id for s in segments}
    assert store.running_compaction("kb") is None
    store.close()


@given(
    lives=st.lists(st.integers(0, 5_000), min_size=0, max_size=8),
    cap=st.sampled_from([math.inf, 0, 1_000, 4_000]),
)
def test_the_delta_merge_plan_is_the_pairwise_binary_counter(lives: list[int], cap: float) -> None:
    """Oracle: the binary counter as pairs (merge the newest two while the older holds at most
    MERGE_RATIO times the newer, then everything past MAX_DELTA_SHARDS), which the store ran
    before; with a cap, no merge of more than `cap` points and no MAX rule."""
    deltas = [shards_module.Segment(f"s{i}", n) for i, n in enumerate(lives)]
    shards = [[n] for n in lives]  # each shard as the lives it holds
    while (
        len(shards) >= 2
        and sum(shards[-2]) <= shards_module.MERGE_RATIO * sum(shards[-1])
        and sum(shards[-2]) + sum(shards[-1]) <= cap
    ):
        shards[-2:] = [shards[-2] + shards[-1]]
    if cap == math.inf and len(shards) > shards_module.MAX_DELTA_SHARDS:
        shards = [[n for s in shards for n in s]]
    expected = len(lives) - len(shards[-1]) if shards and len(shards[-1]) > 1 else len(lives)
    assert shards_module.merge_from(deltas, cap) == expected


def job_pid() -> int:
    import os

    return os.getpid()


def test_an_update_through_the_api_compacts_in_the_background(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(5)
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    due = _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    changed = doc(2, rng)
    report = update(store, tiny_encoder, tmp_path, [changed], compaction="background")
    corpus[changed.id] = changed
    assert report.compaction == "started" and report.collection != due.collection
    assert wait_for_compactions(120)
    name = store.aliases()["kb"]
    assert store.record(name).lineage.compacted and store.record(name).lineage.base == (
        report.collection
    )
    assert len(store.manifest(name).segments) == 1
    assert served_docs(store) == set(corpus)
    assert _texts(store, name) == {d.id: d.text for d in corpus.values()}
    store.close()


def test_a_failed_background_compaction_leaves_the_alias_and_says_so(
    tiny_encoder: Encoder, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The child process fails for real: its marker cannot be written (a directory in its place).
    It says so on the stderr it shares with this process, exits 1, and the alias is unchanged."""
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(6)
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    due = _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    marker = tmp_path / "edge" / "compactions" / "kb.json"
    marker.mkdir()

    child = compaction_module.compact_in_background(store, "kb", lock_dir=tmp_path)
    assert wait_for_compactions(60)
    assert child.returncode == 1
    assert store.aliases()["kb"] == due.collection
    assert "background compaction failed; the alias is unchanged" in capfd.readouterr().err
    assert store.running_compaction("kb") is None
    marker.rmdir()
    child = compaction_module.compact_in_background(store, "kb", lock_dir=tmp_path)
    assert wait_for_compactions(60) and child.returncode == 0
    assert store.aliases()["kb"] != due.collection
    assert _texts(store, store.aliases()["kb"]) == {d.id: d.text for d in corpus.values()}
    store.close()


def test_a_background_compaction_traces_as_its_parent_was_configured(
    tiny_encoder: Encoder,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve`'s writer process (and the Python API) start a compaction with
    `compact_in_background`; its child reads only the environment, so tracing set by
    `configure` (from `--tracing` flags) must be passed on, not the environment's "off". The
    child's console spans land on the stderr it shares with this process."""
    from rag_retriever import tracing

    monkeypatch.setenv("RAG_TRACING", "off")
    store = EdgeStore(tmp_path / "edge")
    write(store, tiny_encoder, tmp_path, [doc(i, random.Random(2)) for i in range(3)])
    tracing.configure("console", service_name="rag-compaction-child")
    try:
        assert tracing.child_environment()["RAG_TRACING"] == "console"
        child = compaction_module.compact_in_background(store, "kb", lock_dir=tmp_path)
        assert wait_for_compactions(60) and child.returncode == 0
    finally:
        tracing.shutdown()
    err = capfd.readouterr().err
    assert '"name": "rag.compaction"' in err and "rag-compaction-child" in err
    assert tracing.child_environment() == {}  # after shutdown: the environment as inherited
    tracing.configure("on")  # the host's provider does not cross a process
    assert tracing.child_environment() == {}
    tracing.shutdown()
    store.close()


def test_the_compaction_child_says_what_is_wrong_without_a_stack_trace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The child's own entry point: an alias that does not exist is a one-line error, exit 1;
    arguments it cannot parse exit 2 (argparse)."""
    root = tmp_path / "edge"
    args = ["--root", str(root), "--alias", "nope", "--lock-dir", str(tmp_path)]
    assert compaction_module.main(args) == 1
    failed = [r for r in caplog.records if "background compaction failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None
    assert "alias 'nope' does not exist" in failed[0].getMessage()
    with pytest.raises(SystemExit) as exc:
        compaction_module.main([*args, "--keep-versions", "many"])
    assert exc.value.code == 2


CLI = [sys.executable, "-m", "rag_retriever.cli"]


def _cli_store(
    tmp_path: Path, encoder: Encoder, encoder_dir: Path, rng: random.Random, compaction: str
) -> tuple[dict[str, str], dict[str, Document], EdgeStore]:
    """A CLI environment with RAG_COMPACTION=`compaction`, and its store holding 30 documents."""
    env = {**_cli_env(tmp_path, encoder_dir), "RAG_COMPACTION": compaction}
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    store = EdgeStore(tmp_path / "data" / "edge")
    write(store, encoder, tmp_path / "data", list(corpus.values()))
    return env, corpus, store


# (the EdgeStore call to kill `rag-retriever compact` after, which call, whether it moved the
# alias). write_meta: 1 the compacted version `building`, 2 `complete`.
COMPACT_KILL_POINTS = [
    ("begin_compaction", 1, False),  # marker written, nothing built
    ("_copy", 1, False),  # the new base half written
    ("build_compaction", 1, False),  # the new base built, named by no version
    ("adopt_compaction", 1, False),  # the version named, `building`
    ("write_meta", 2, False),  # complete, the alias not moved
    ("point_alias", 1, True),  # served
]


def _kill_at_each_step(
    store: EdgeStore,
    env: dict[str, str],
    corpus: dict[str, Document],
    make_due: Callable[[], object],
) -> list[list[str]]:
    """`rag-retriever compact` SIGKILLed after each of COMPACT_KILL_POINTS, `make_due()` first
    whenever the served version is not due: after every kill the alias serves a complete version
    with every document, and no compaction is left marked running. The shard ids the served
    version read before each kill."""
    from tests.test_reingest import kill_after

    root = store.root
    shards_before = []
    for method, nth, moved in COMPACT_KILL_POINTS:
        if not store.compaction_due(store.aliases()["kb"]):
            make_due()
        before = store.aliases()["kb"]
        shards_before.append([s.id for s in store.manifest(before).segments])
        kill_after(method, nth, ["compact", "--collection", "kb"], env)
        check = EdgeStore(root)
        name = check.aliases()["kb"]
        assert (name != before) == moved, method
        record = check.record(name)
        assert record.status == "complete" and check.count(name) == record.chunks, method
        assert _texts(check, name) == {d.id: d.text for d in corpus.values()}, method
        assert check.running_compaction("kb") is None, method  # died with its process
        check.close()
    return shards_before


@pytest.mark.slow
def test_sigkill_at_each_step_of_a_compaction_leaves_a_complete_version_served(
    tiny_encoder: Encoder, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(8)
    env, corpus, store = _cli_store(tmp_path, tiny_encoder, tiny_encoder_dir, rng, "deferred")
    root = tmp_path / "data" / "edge"
    cli = CLI
    _kill_at_each_step(
        store, env, corpus, lambda: _outgrow(store, tiny_encoder, tmp_path / "data", corpus, rng)
    )
    # the next write removes what the kills left; a compaction runs again
    change = _write_corpus(tmp_path / "change.jsonl", [doc(90, rng)])
    done = subprocess.run(
        [*cli, "update", "--collection", "kb", "--upsert", str(change), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    final = subprocess.run(
        [*cli, "compact", "--collection", "kb", "--force", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert final.returncode == 0, final.stderr
    assert '"outcome": "compacted"' in final.stdout
    check = EdgeStore(root)
    assert all(i.status == "complete" for i in check.versions("kb"))
    named = {s.id for i in check.versions("kb") for s in check.manifest(i.name).segments}
    assert {p.name for p in (root / "segments").iterdir()} == named
    assert "d90" in served_docs(check)
    check.close()
    store.close()


@pytest.mark.slow
@pytest.mark.usefixtures("no_inline_merges")
def test_sigkill_at_each_step_of_a_delta_shard_compaction_keeps_the_base(
    tiny_encoder: Encoder, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    """Three small delta shards on a base they have not outgrown: `compact` merges the delta
    shards only (the child process keeps the default thresholds, under which three shards of
    two documents on a base of 30 are a delta-shard compaction). Killed at every step, every
    version reads the same base shard with the same tombstones, and the last kill, after the
    alias moved, leaves it serving the base and one merged delta shard (the in-process updates
    merge nothing themselves: `no_inline_merges`)."""
    rng = random.Random(13)
    env, corpus, store = _cli_store(tmp_path, tiny_encoder, tiny_encoder_dir, rng, "deferred")

    def pile_up() -> None:
        _piled_up(store, tiny_encoder, tmp_path / "data", corpus, rng, (2, 2, 2))

    pile_up()
    base = store.manifest(store.aliases()["kb"]).segments[0]
    shards_before = _kill_at_each_step(store, env, corpus, pile_up)
    assert all(shards[0] == base.id for shards in shards_before)
    served = store.aliases()["kb"]
    after = store.manifest(served).segments
    # the base shard as it was, with its tombstones; one merged delta shard after it
    assert after[0] == base and len(after) == 2
    assert after[1].id not in shards_before[-1]
    assert store.record(served).source.endswith("(3 delta shards merged)")
    store.close()


@pytest.mark.slow
def test_the_update_command_starts_a_detached_compaction(
    tiny_encoder: Encoder, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    import time

    rng = random.Random(9)
    env, corpus, store = _cli_store(tmp_path, tiny_encoder, tiny_encoder_dir, rng, "background")
    root = tmp_path / "data" / "edge"
    _outgrow(store, tiny_encoder, tmp_path / "data", corpus, rng)
    change = _write_corpus(tmp_path / "change.jsonl", [doc(91, rng)])
    done = subprocess.run(
        [*CLI, "update", "--collection", "kb", "--upsert", str(change), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "compaction  started (pid" in done.stdout
    log_path = tmp_path / "data" / "logs" / "compact-kb.log"
    deadline = time.monotonic() + 600  # a hang guard: the child's speed is not under test
    # the child moves the alias, then says so: wait for both
    while time.monotonic() < deadline and not (
        store.record(store.aliases()["kb"]).lineage.compacted
        and "merged into one base" in log_path.read_text()
    ):
        time.sleep(0.2)
    name = store.aliases()["kb"]
    assert store.record(name).lineage.compacted, list((root.parent / "logs").iterdir())
    assert "d91" in served_docs(store)
    assert "merged into one base" in log_path.read_text()
    store.close()


def test_a_compaction_and_the_version_it_compacted_count_as_one_kept_version(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """keep_versions=2: after a compaction the version before the last update is still kept,
    and rollback goes back to it, not to the version the compaction holds the same points as."""
    from rag_retriever.store.catalog import rollback

    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(10)
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    due = _outgrow(store, tiny_encoder, tmp_path, corpus, rng, keep_versions=2, retention_grace_s=0)
    before = store.record(due.collection).lineage.base
    report = compact(store, "kb", lock_dir=tmp_path, keep_versions=2, retention_grace_s=0)
    assert report.outcome == "compacted"
    kept = {i.name for i in store.versions("kb")}
    # the compacted version went (grace 0): it holds what the compaction holds
    assert kept == {report.collection, before}
    assert rollback(store, "kb") == before
    store.close()


def test_a_version_directory_left_without_a_record_does_not_block_writes(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(11)
    first = write(store, tiny_encoder, tmp_path, [doc(i, rng) for i in range(5)])
    # a writer killed right after creating the next version's directory
    left = first.collection.replace("__v1", "__v2")
    (tmp_path / "edge" / "collections" / left).mkdir()
    report = update(store, tiny_encoder, tmp_path, [doc(9, rng)])
    assert report.collection == left and store.record(left).status == "complete"
    store.close()


def test_cleaning_an_alias_leaves_the_shards_of_aliases_that_share_its_prefix(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    from rag_retriever.ingest.loaders import LoadedCorpus
    from rag_retriever.ingest.writer import ingest_documents

    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(12)
    for alias in ("kb-", "kb--x"):
        ingest_documents(
            LoadedCorpus((doc(1, rng),), 0, "t"),
            alias=alias,
            encoder=tiny_encoder,
            store=store,
            lock_dir=tmp_path,
        )
    # a compaction of "kb--x" is building its shard: named by no manifest yet
    building = tmp_path / "edge" / "segments" / "kb--x--0123456789ab"
    building.mkdir()
    write(store, tiny_encoder, tmp_path, [doc(2, rng)])
    before = sorted(p.name for p in (tmp_path / "edge" / "segments").iterdir())
    assert store.collect_garbage("kb") == []
    assert sorted(p.name for p in (tmp_path / "edge" / "segments").iterdir()) == before
    assert building.is_dir()
    store.close()


def test_a_writer_that_would_not_wait_waits_for_a_compaction_s_moment(tmp_path: Path) -> None:
    import threading
    import time

    from rag_retriever.ingest.lock import COMPACTION, IngestLock

    held = threading.Event()
    letting_go = threading.Event()

    def compaction() -> None:
        with IngestLock(tmp_path, "kb", holder=COMPACTION):
            held.set()
            time.sleep(0.5)
            letting_go.set()

    thread = threading.Thread(target=compaction)
    thread.start()
    assert held.wait(60)
    with IngestLock(tmp_path, "kb", wait_s=0):  # an ingest: would fail at once on a writer
        # it got the lock only once the compaction let go of it, instead of failing
        assert letting_go.is_set()
    thread.join()


def test_the_compact_command_refuses_bad_input_with_exit_2(
    env: Path,
    tiny_encoder: Encoder,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rag_retriever.cli import main

    assert main(["compact", "--collection", "../kb"]) == 2
    assert "collection name '../kb' is not allowed" in capsys.readouterr().err
    assert main(["compact", "--collection", "nope"]) == 2
    assert "alias 'nope' does not exist" in capsys.readouterr().err
    monkeypatch.setenv("RAG_COMPACTION", "sometimes")
    assert main(["compact", "--collection", "kb"]) == 2
    assert "RAG_COMPACTION must be one of background, deferred, inline" in capsys.readouterr().err
    monkeypatch.setenv("RAG_COMPACTION", "inline")
    store = EdgeStore(env / "edge")
    write(store, tiny_encoder, env, [doc(i, random.Random(1)) for i in range(5)])
    store.close()
    # one shard, nothing to merge: said, exit 0, no new version
    assert main(["compact", "--collection", "kb", "--force"]) == 0
    assert "not due: nothing to compact" in capsys.readouterr().out
    assert main(["compact", "--collection", "kb", "--json"]) == 0
    assert '"outcome": "not_due"' in capsys.readouterr().out
    check = EdgeStore(env / "edge")
    assert len(check.versions("kb")) == 1
    check.close()


def test_a_background_compaction_is_given_the_settings_flags_gave_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child reads only its environment: what the parent was given as flags (tracing, a
    server's URL) must reach it there, or it traces nothing and compacts the wrong store. The
    spawn is replaced (the child itself runs in the tests above): only its environment is read."""
    import dataclasses

    from rag_retriever.cli import ingest as cli_ingest
    from rag_retriever.settings import Settings

    spawned: dict[str, str] = {}

    def spawn(alias: str, *, env: dict[str, str], log_path: Path) -> int:
        spawned.update(env)
        return 4242

    monkeypatch.setattr(compaction_module, "spawn_compaction", spawn)
    settings = Settings(
        data_dir=tmp_path,
        tracing="console",
        qdrant_url="http://qdrant.internal:6333",
        compaction="background",
    )

    @dataclasses.dataclass(frozen=True)
    class Report:
        alias: str = "kb"
        compaction: str = "due"

    report = cli_ingest._start_compaction(settings, Report())
    assert report.compaction.startswith("started (pid 4242")
    assert spawned["RAG_TRACING"] == "console"
    assert spawned["RAG_QDRANT_URL"] == "http://qdrant.internal:6333"
    assert spawned["RAG_DATA_DIR"] == str(tmp_path) and "RAG_OTLP_ENDPOINT" not in spawned


def test_a_server_version_is_not_compacted_and_says_why(server_store: Any) -> None:
    """On a Qdrant server a version is a filter over one physical collection: there are no
    shards to merge, and the report says so instead of merging anything."""
    report = compact(server_store, "kb", force=True)
    assert report.outcome == "not_sharded"
    assert report.message == (
        "a Qdrant server version is a filter over one physical collection: nothing to compact"
    )
