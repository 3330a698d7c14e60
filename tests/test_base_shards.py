"""A base of several shards (store/edge.py, BASE_SHARD_POINTS / RAG_BASE_SHARD_POINTS): a full
build past the cap is written and sealed as several shards, each alone, and answers as one
shard holding the same points would (the oracle: the same writes into a store whose base is
one shard); deltas leave the base shards alone, and a base merge writes a base of several
shards again."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rag_retriever.ingest.compaction import compact, merged_into
from rag_retriever.models.bm25 import SparseVector
from rag_retriever.models.encoder import Encoder
from rag_retriever.records import SearchFilter
from rag_retriever.store import DENSE, SPARSE, EdgeStore, StageQuery, edge
from rag_retriever.store.edge import trim_heap as edge_trim_heap
from rag_retriever.store.shards import Segment, base_shards, merge_due, outgrown
from tests.test_compaction import _answers, _outgrow, _same_answers, _texts
from tests.test_edge_writer import DIM, _create
from tests.test_update import doc, write

Batch = tuple[list[str], np.ndarray, list[SparseVector], list[dict]]


def _points(ids: list[int], seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    names = [f"00000000-0000-0000-0000-{i:012d}" for i in ids]
    dense = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    sparse = [
        SparseVector((i % 5, 5 + i % 7), (float(rng.random()), float(rng.random()))) for i in ids
    ]
    payloads = [{"doc_id": f"d{i}", "text": f"v{seed} {i}", "metadata": {"n": i % 3}} for i in ids]
    return names, dense, sparse, payloads


def _queries(seed: int) -> list[StageQuery]:
    rng = np.random.default_rng(seed)
    out = []
    for limit in (1, 5, 40):
        for flt in (None, SearchFilter(equals={"n": 1})):
            dense = rng.standard_normal(DIM).astype(np.float32)
            out.append(StageQuery(DENSE, dense, limit, flt))
            out.append(StageQuery(SPARSE, SparseVector((1, 6), (1.0, 0.5)), limit, flt))
    return out


def _same(a: EdgeStore, name_a: str, b: EdgeStore, name_b: str) -> None:
    queries = _queries(3)
    for x, y in zip(a.search(name_a, queries), b.search(name_b, queries), strict=True):
        assert [p for p, _ in x] == [p for p, _ in y]
        np.testing.assert_allclose([s for _, s in x], [s for _, s in y], rtol=1e-5)
    assert a.count(name_a) == b.count(name_b)
    ids = sorted(r.id for r in b.scroll(name_b))
    got = {r.id: dict(r.payload) for r in a.retrieve(name_a, ids)}
    assert got == {r.id: dict(r.payload) for r in b.retrieve(name_b, ids)}


def _count_seals_apart(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The point counts of the shards sealed by a process of their own (the real one runs)."""
    sealed: list[int] = []

    def counted(directory: str, seal: Any) -> int:
        sealed.append(real(directory, seal))
        return sealed[-1]

    real = edge.seal_apart
    monkeypatch.setattr(edge, "seal_apart", counted)
    return sealed


def _write(store: EdgeStore, name: str, batches: list[Batch], *, bulk: bool) -> None:
    if bulk:
        with store.bulk_write(name):
            for batch in batches:
                store.upsert(name, *batch)
    else:
        for batch in batches:
            store.upsert(name, *batch)
    store.seal(name, {})


@pytest.mark.parametrize("bulk", [False, True])
def test_a_full_build_past_the_cap_is_base_shards_of_at_most_the_cap(
    tmp_path: Path, bulk: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """31 points at a cap of 7, in batches that straddle the rolls: five base shards (7, 7, 7,
    7, 3), the same answers, records and count as one shard; and so after a reopen. Each of the
    five shards is sealed in a process of its own, after the C heap is given back here; one
    shard is sealed here."""
    sealed_apart = _count_seals_apart(monkeypatch)
    caplog.set_level(logging.INFO, logger=edge.log.name)
    trims: list[bool] = []

    def trim() -> bool:
        trims.append(edge_trim_heap())
        return trims[-1]

    monkeypatch.setattr(edge, "trim_heap", trim)
    sharded, one = EdgeStore(tmp_path / "a", shard_points=7), EdgeStore(tmp_path / "b")
    batches, first = [], 0
    for size in (4, 9, 13, 5):
        batches.append(_points(list(range(first, first + size)), first))
        first += size
    for store in (sharded, one):
        _create(store, "a__m__v1")
        _write(store, "a__m__v1", batches, bulk=bulk and store is sharded)
    manifest = sharded.manifest("a__m__v1")
    assert manifest.bases == len(manifest.segments) == 5 and manifest.own is None
    assert [s.points for s in manifest.segments] == [7, 7, 7, 7, 3]
    assert len(one.manifest("a__m__v1").segments) == 1
    assert len(trims) == 5  # the real malloc_trim ran each time (False only without glibc)
    assert sealed_apart == [7, 7, 7, 7, 3]
    sealed_lines = [r.getMessage() for r in caplog.records if " sealed: " in r.getMessage()]
    assert [line.split(": ")[1].split(" points")[0] for line in sealed_lines] == list("77773")
    _same(sharded, "a__m__v1", one, "a__m__v1")
    sharded.close()
    reopened = EdgeStore(tmp_path / "a")
    assert reopened.manifest("a__m__v1").bases == 5
    _same(reopened, "a__m__v1", one, "a__m__v1")
    assert not sharded.compaction_due("a__m__v1")  # its base shards are no deltas
    reopened.close()
    one.close()


def test_a_topic_written_into_one_later_shard_is_asked_again_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards after the first are asked for their share of the limit (SHARE_OVERASK). 20
    shards of 40 points, the points nearest the query (dense and BM25) all in the fourth: its
    share comes back full, the merge asks it again for the whole limit, and the answers are the
    one-shard store's (the oracle); evenly spread points need no second ask."""
    sharded, one = EdgeStore(tmp_path / "a", shard_points=40), EdgeStore(tmp_path / "b")
    names, dense, sparse, payloads = _points(list(range(800)), 5)
    topic = np.zeros(DIM, dtype=np.float32)
    topic[0] = 1.0
    in_topic = range(120, 160)  # the fourth shard: near `topic`, and the heaviest on term 3
    for i in range(800):
        if i in in_topic:
            dense[i] = topic + 0.05 * dense[i]
            sparse[i] = SparseVector((3,), (5.0 + i / 1000,))
        else:
            weight = (i * 7919) % 800 / 100_000  # no shard holds more of the top than another
            sparse[i] = SparseVector((3, 9), (0.1 + weight, 1.0 + weight))
    for store in (sharded, one):
        _create(store, "a__m__v1")
        _write(store, "a__m__v1", [(names, dense, sparse, payloads)], bulk=store is sharded)
    segments = [s.id for s in sharded.manifest("a__m__v1").segments]
    assert len(segments) == 20
    calls: list[tuple[str, list[int]]] = []
    points = EdgeStore._points

    def counted(
        self: EdgeStore, segment: str, queries: list[StageQuery], *a: Any, **kw: Any
    ) -> Any:
        if self is sharded:
            calls.append((segment, [q.limit for q in queries]))
        return points(self, segment, queries, *a, **kw)

    monkeypatch.setattr(EdgeStore, "_points", counted)
    # 30 from the first shard, 4 x 30 / 20 + 20 = 26 from each other one
    shares = [(segments[0], [30])] + [(s, [26]) for s in segments[1:]]
    for query in (StageQuery(DENSE, topic, 30), StageQuery(SPARSE, SparseVector((3,), (1.0,)), 30)):
        calls.clear()
        found = sharded.search("a__m__v1", [query])[0]
        assert {p for p, _ in found} <= {names[i] for i in in_topic}  # the topic's
        assert found == one.search("a__m__v1", [query])[0]
        assert calls == [*shares, (segments[3], [30])]  # the fourth again, in full
    calls.clear()
    spread = StageQuery(SPARSE, SparseVector((9,), (1.0,)), 30)  # all but the topic, evenly
    assert sharded.search("a__m__v1", [spread]) == one.search("a__m__v1", [spread])
    assert calls == shares  # one ask a shard
    _same(sharded, "a__m__v1", one, "a__m__v1")
    sharded.close()
    one.close()


@pytest.mark.parametrize("bulk", [False, True])
def test_an_id_written_again_after_its_shard_rolled_is_served_once_as_last_written(
    tmp_path: Path, bulk: bool
) -> None:
    """Upsert replaces: ids of the first shard written again into the third are tombstoned in
    the first, so the version holds each id once, as last written (oracle: one shard)."""
    sharded, one = EdgeStore(tmp_path / "a", shard_points=5), EdgeStore(tmp_path / "b")
    batches = [_points(list(range(12)), 0), _points([2, 3, 11], 1)]
    for store in (sharded, one):
        _create(store, "a__m__v1")
        _write(store, "a__m__v1", batches, bulk=bulk and store is sharded)
    segments = sharded.manifest("a__m__v1").segments
    assert [len(s.deleted) for s in segments] == [2, 0, 0]  # 2 and 3 (11 was in the third)
    assert sharded.count("a__m__v1") == one.count("a__m__v1") == 12
    ids = batches[1][0]
    assert {r.payload["text"] for r in sharded.retrieve("a__m__v1", ids)} == {
        "v1 2",
        "v1 3",
        "v1 11",
    }
    _same(sharded, "a__m__v1", one, "a__m__v1")
    sharded.close()
    one.close()


def test_deltas_leave_the_base_shards_and_a_base_merge_writes_several_again(
    tmp_path: Path,
) -> None:
    """A delta on a base of three shards tombstones in them and adds a delta shard; the base
    shards are never merged as deltas. Deltas that outgrow the base are merged into a new base
    of base_shards(live) shards, each at most the cap. Every version answers as the same writes
    into a store of one-shard bases."""
    sharded, one = EdgeStore(tmp_path / "a", shard_points=10), EdgeStore(tmp_path / "b")
    rng = random.Random(4)
    for store in (sharded, one):
        _create(store, "a__m__v1")
        _write(store, "a__m__v1", [_points(list(range(27)), 0)], bulk=False)
    base = [s.id for s in sharded.manifest("a__m__v1").segments]
    assert len(base) == 3
    version, live = "a__m__v1", set(range(27))
    for step in range(2, 12):
        drop = set(rng.sample(sorted(live), 2))
        added = [100 + 10 * step + k for k in range(3)]
        name = f"a__m__v{step}"
        for store in (sharded, one):
            dropped = [f"00000000-0000-0000-0000-{i:012d}" for i in drop]
            store.derive(name, version, store.record(version), dropped)
            store.upsert(name, *_points(added, step))
            store.seal(name, {})
        live = (live - drop) | set(added)
        version = name
        manifest = sharded.manifest(name)
        _same(sharded, name, one, name)
        if manifest.bases == 3 and [s.id for s in manifest.segments[:3]] == base:
            assert not outgrown(manifest.segments, 3)  # the base kept, while not outgrown
            continue
        # merged into a new base: several shards again, of at most the cap, holding what is live
        assert manifest.bases == len(manifest.segments) == base_shards(len(live), 10)
        assert all(0 < s.points <= 10 and not s.deleted for s in manifest.segments)
        assert sum(s.points for s in manifest.segments) == len(live)
        break
    else:
        raise AssertionError("the deltas never outgrew the base")
    sharded.close()
    one.close()


def test_a_compaction_writes_a_base_of_several_shards_and_keeps_what_updates_did_meanwhile(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The product's path (ingest, deferred updates, `compact`) with a cap of 8 chunks: the
    full build is several shards, the compaction writes base_shards(live) of them, and serves
    the same texts and answers as before it. Each shard it writes is sealed in a process of its
    own, as a full build's are."""
    store = EdgeStore(tmp_path / "edge", shard_points=8)
    rng = random.Random(1)
    corpus = {f"d{i}": doc(i, rng, rng.randint(3, 9)) for i in range(30)}
    first = write(store, tiny_encoder, tmp_path, list(corpus.values()))
    built = store.manifest(first.collection)
    assert built.bases == len(built.segments) > 1
    due = _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    answers = _answers(store, due.collection, random.Random(7))
    sealed_apart = _count_seals_apart(monkeypatch)

    report = compact(store, "kb", lock_dir=tmp_path)

    assert report.outcome == "compacted"
    name = store.aliases()["kb"]
    manifest = store.manifest(name)
    assert manifest.bases == len(manifest.segments) == base_shards(store.count(name), 8) > 1
    assert sealed_apart == [s.points for s in manifest.segments]
    assert report.shards_made == manifest.bases and report.points == store.count(name)
    assert merged_into(report.kind, report.shards_made) == f"a base of {manifest.bases} shards"
    assert all(s.points <= 8 for s in manifest.segments)
    assert _texts(store, name) == {d.id: d.text for d in corpus.values()}
    _same_answers(_answers(store, name, random.Random(7)), answers)
    assert not store.compaction_due(name)
    store.close()


def test_the_merge_policy_counts_the_base_as_its_shards() -> None:
    base = (Segment("b1", 100), Segment("b2", 100, frozenset({"x"})))
    assert not outgrown(base, 2) and not merge_due(base, 2)
    assert outgrown(base, 1)  # read as one base and a delta of 100 points: outgrown
    assert not outgrown((*base, Segment("d", 99)), 2)
    assert outgrown((*base, Segment("d", 100)), 2)  # 100 + 1 tombstone > 0.5 x 200
    deltas = tuple(Segment(f"d{i}", 1) for i in range(3))
    assert merge_due((*base, *deltas), 2) and not merge_due((*base, *deltas[:2]), 2)
    assert [base_shards(n, 10) for n in (0, 1, 10, 11, 30)] == [1, 1, 1, 2, 3]


def test_a_cap_below_one_is_refused(tmp_path: Path) -> None:
    from rag_retriever import cli
    from rag_retriever.errors import ConfigError
    from rag_retriever.settings import Settings

    with pytest.raises(ConfigError, match="at least 1 point"):
        EdgeStore(tmp_path, shard_points=0)
    for bad in ("0", "-3", "many"):
        with pytest.raises(ConfigError, match="RAG_BASE_SHARD_POINTS"):
            Settings.from_env({"RAG_BASE_SHARD_POINTS": bad})
    data = tmp_path / "data"
    args = ["compact", "--collection", "kb", "--base-shard-points", "0", "--data-dir", str(data)]
    assert cli.main(args) == 2 and not data.exists()  # refused before anything is written


def test_the_ids_an_earlier_base_shard_holds_are_found_by_their_hashes() -> None:
    """Oracle: Python's set of the ids written before the roll."""
    from rag_retriever.store.edge import _Build, _id_hashes

    rng = random.Random(2)
    build = _Build()
    assert not build.wrote_before(_id_hashes(["a"])).any()  # nothing rolled yet
    first = [f"id{i}" for i in rng.sample(range(1000), 300)]
    build.current.append(_id_hashes(first))
    build.roll()
    build.current.append(_id_hashes([f"id{i}" for i in range(1000, 1100)]))
    build.roll()
    asked = [f"id{i}" for i in range(0, 1200, 3)]
    before = set(first) | {f"id{i}" for i in range(1000, 1100)}
    assert build.wrote_before(_id_hashes(asked)).tolist() == [i in before for i in asked]
