"""Document updates as incremental versions: a delta costs what it changes.

Oracles: rank-bm25 on the corpus as it is after a random sequence of upserts and deletes (with
the lineage's recorded average length), on Qdrant Edge and on the server code path; the bytes of
the base version's shards before and after a delta; the documents each version must serve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from qdrant_client import QdrantClient
from rank_bm25 import BM25Okapi

from rag_retriever.errors import DocumentError, UpdateRefused
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import (
    FIRST_PROBE,
    PROBE_GROWTH,
    ingest_documents,
    update_documents,
)
from rag_retriever.models import bm25 as bm25_module
from rag_retriever.models.bm25 import BM25Model, Tokenizer, as_doc_freqs
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.profiles import ModelProfile, write_profile_file
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document, embed_text
from rag_retriever.store import DENSE, SPARSE, EdgeStore, Record, ServerStore, StageQuery, Store
from rag_retriever.store import shards as shards_module
from rag_retriever.store import terms as terms_module

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "river",
    "city",
]


def doc(i: int, rng: random.Random, n: int = 6) -> Document:
    return Document(f"d{i}", f"doc {i}", " ".join(rng.choice(WORDS) for _ in range(n)))


@pytest.fixture(params=["edge", "server"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Every engine runs the same contract."""
    if request.param == "edge":
        store: Store = EdgeStore(tmp_path / "edge")
    else:
        store = ServerStore(QdrantClient(":memory:"))
    yield store
    store.close()


def write(store: Store, encoder: Encoder, tmp_path: Path, docs: list[Document], **kw):
    kw.setdefault("lock_dir", tmp_path)
    return ingest_documents(
        LoadedCorpus(tuple(docs), 0, "t"), alias="kb", encoder=encoder, store=store, **kw
    )


def update(store: Store, encoder: Encoder, tmp_path: Path, upsert=(), delete=(), **kw):
    kw.setdefault("lock_dir", tmp_path)
    kw.setdefault("rebase_drift", 1.0)  # these tests follow deltas; the re-base has its own
    return update_documents(
        list(upsert), list(delete), alias="kb", encoder=encoder, store=store, **kw
    )


def served_docs(store: Store) -> set[str]:
    name = store.aliases()["kb"]
    return {str(r.payload["doc_id"]) for r in store.scroll(name)}


def random_delta(
    store: Store,
    encoder: Encoder,
    tmp_path: Path,
    corpus: dict[str, Document],
    rng: random.Random,
    *,
    ids: int,
    deletes: int,
):
    """Up to 4 documents upserted (ids below `ids`, new or replacing) and `deletes` others
    deleted; `corpus` follows."""
    upserts = [doc(rng.randint(0, ids), rng, rng.randint(2, 9)) for _ in range(4)]
    upserts = list({d.id: d for d in upserts}.values())
    gone = rng.sample(sorted(set(corpus) - {d.id for d in upserts}), deletes)
    report = update(store, encoder, tmp_path, upserts, gone)
    corpus.update({d.id: d for d in upserts})
    for doc_id in gone:
        del corpus[doc_id]
    return report


def assert_bm25_is_rank_bm25s(
    store: Store, name: str, corpus: dict[str, Document], rng: random.Random
) -> None:
    """The engine's BM25 scores of version `name` are rank-bm25's on `corpus` (with the lineage's
    recorded average length) to 1e-5, for whole lists and for short ones."""
    record = store.record(name)
    tok = Tokenizer()
    ids = sorted(corpus)
    terms = [tok.tokenize(embed_text(corpus[i].title, corpus[i].text)) for i in ids]
    ref = BM25Okapi(terms)
    ref.avgdl = record.bm25.avgdl
    model = BM25Model(record.bm25, store.doc_freqs(name))
    doc_freqs = Counter(t for d in terms for t in set(d))
    assert dict(model.doc_freqs.items()) == doc_freqs
    # the histogram the IDF floor is computed from, as the version recorded it
    assert as_doc_freqs(model.doc_freqs).histogram == Counter(doc_freqs.values())
    doc_of = {r.id: str(r.payload["doc_id"]) for r in store.scroll(name)}
    queries = [rng.sample(WORDS, 2) for _ in range(8)]
    vectors = [model.query_vector(tok.tokenize(" ".join(q))) for q in queries]
    results = store.search(name, [StageQuery(SPARSE, v, 100) for v in vectors])
    for q, found in zip(queries, results, strict=True):
        expected = dict(zip(ids, ref.get_scores(tok.tokenize(" ".join(q))), strict=True))
        got = {doc_of[pid]: score for pid, score in found}
        assert got.keys() == {i for i, s in expected.items() if s > 0}
        for doc_id, score in got.items():
            np.testing.assert_allclose(score, expected[doc_id], rtol=1e-5, atol=1e-5)
    # a short list (the tombstoned points of the base dropped after an over-fetch, or asked again
    # with the filter) is still the exact top 3
    short = store.search(name, [StageQuery(SPARSE, v, 3) for v in vectors])
    for q, found in zip(queries, short, strict=True):
        expected_top = sorted(ref.get_scores(tok.tokenize(" ".join(q))), reverse=True)[:3]
        got_top = [score for _, score in found]
        positive = [e for e in expected_top if e > 0]
        np.testing.assert_allclose(got_top[: len(positive)], positive, rtol=1e-5, atol=1e-5)


def test_an_update_is_a_delta_version_with_its_report(
    any_store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    rng = random.Random(0)
    docs = [doc(i, rng) for i in range(20)]
    first = write(any_store, tiny_encoder, tmp_path, docs)
    changed = dataclasses.replace(docs[3], text="qdrant vector search apple pear")
    new = Document("new", "new one", "kilo lima river")
    report = update(any_store, tiny_encoder, tmp_path, [changed, new, docs[4]], ["d5", "absent"])
    assert report.kind == "delta" and report.base == first.collection
    assert (report.upserted, report.deleted, report.unchanged, report.not_found) == (2, 1, 1, 1)
    assert (report.encoded, report.chunks) == (2, 20)  # only the two new texts were encoded
    record = any_store.record(report.collection)
    assert record.lineage.base == first.collection and record.lineage.deltas == 1
    assert record.lineage.full_build == first.collection
    assert any_store.count(report.collection) == record.chunks == 20
    assert served_docs(any_store) == {d.id for d in docs} - {"d5"} | {"new"}
    texts = {r.payload["doc_id"]: r.payload["text"] for r in any_store.scroll(report.collection)}
    assert texts["d3"] == changed.text
    # the previous version still serves what it served (rollback target)
    assert {r.payload["doc_id"] for r in any_store.scroll(first.collection)} == {d.id for d in docs}
    retriever = Retriever(encoder=tiny_encoder, store=any_store, collection="kb")
    assert retriever.search("qdrant apple", mode="bm25", k=1)[0].doc_id == "d3"


def test_an_alias_ending_in_underscore_keeps_its_versions_apart_from_its_prefix(
    any_store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """kb_'s versions are named kb___SLUG__vN: parsed with a lazy alias they read as kb's, so
    kb_ saw none of its own, its second write took the served version's name, failed, and
    deleted it (found by a review). Each alias now sees only its own; retention of one never
    touches the other's."""
    from rag_retriever.store import parse_collection_name

    rng = random.Random(4)
    docs = [doc(i, rng) for i in range(4)]
    for alias in ("kb_", "kb"):
        ingest_documents(
            LoadedCorpus(tuple(docs), 0, "t"),
            alias=alias,
            encoder=tiny_encoder,
            store=any_store,
            lock_dir=tmp_path,
        )
    for i in range(3):
        report = update_documents(
            [Document(f"n{i}", "new", f"kilo lima {i}")],
            [],
            alias="kb_",
            encoder=tiny_encoder,
            store=any_store,
            lock_dir=tmp_path,
            keep_versions=5,
        )
        assert report.version == i + 2 and any_store.aliases()["kb_"] == report.collection
    parsed = parse_collection_name(report.collection)
    assert parsed is not None and parsed[0] == "kb_"
    assert [v.version for v in any_store.versions("kb")] == [1]
    assert [v.version for v in any_store.versions("kb_")] == [1, 2, 3, 4]
    assert any_store.resolve("kb_").endswith("__v4")
    assert served_docs(any_store) == {d.id for d in docs}  # kb's version untouched
    if isinstance(any_store, EdgeStore):  # kb_'s shards are its own, and collected with it
        for info in any_store.versions("kb_")[:-1]:
            any_store.delete(info.name)
        held = {seg.id for seg in any_store.manifest(any_store.resolve("kb_")).segments}
        held |= {seg.id for seg in any_store.manifest(any_store.resolve("kb")).segments}
        on_disk = {p.name for p in (any_store.root / "segments").iterdir()}
        assert on_disk == held and all(s.startswith("kb_--") for s in held - {
            seg.id for seg in any_store.manifest(any_store.resolve("kb")).segments})  # fmt: skip


def test_a_serving_process_lets_go_of_versions_another_removed(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A serving process opens each new version and never asks for an old one again: it used
    to keep every old shard mapped (the disk of a deleted shard was not freed) and every
    version's BM25 frequencies for as long as it ran (found by a review). The writer here is
    another store, as another process's would be; the maps are the kernel's (/proc)."""
    import gc

    from rag_retriever.query import retriever as retriever_module

    reader_store = EdgeStore(tmp_path / "edge")
    writer_store = EdgeStore(tmp_path / "edge")
    rng = random.Random(8)
    docs = [doc(i, rng) for i in range(6)]
    first = write(writer_store, tiny_encoder, tmp_path, docs)
    reader = Retriever(encoder=tiny_encoder, store=reader_store, collection="kb")
    assert reader.search("apple", mode="hybrid", k=3)
    old_shards = {seg.id for seg in reader_store.manifest(first.collection).segments}
    versions = 2 + retriever_module.OPENED_KEPT
    for _ in range(versions):  # each a full build: the old shards all go
        write(writer_store, tiny_encoder, tmp_path, docs, full=True, keep_versions=1,
              retention_grace_s=0)  # fmt: skip
        assert reader.search("apple", mode="hybrid", k=3)
    assert not old_shards & set(reader_store._shards)
    assert len(reader._opened) <= retriever_module.OPENED_KEPT
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert not [line for line in maps.splitlines() if "(deleted)" in line and any(
        s in line for s in old_shards)]  # fmt: skip
    reader_store.close()
    writer_store.close()


def test_a_delta_after_a_failed_full_build_of_its_number_is_a_delta(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """Edge numbers the next version after the newest one kept, so a failed full build's number
    (and name) comes again; the store kept the failed build's state, and the delta that took the
    name wrote into a new base shard (found by a review). The failure is the writer's own
    handler: `delete` of the version it was building."""
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(9)
    docs = [doc(i, rng) for i in range(5)]
    first = write(store, tiny_encoder, tmp_path, docs)
    record = store.record(first.collection)
    failed = first.collection.replace("__v1", "__v2")
    store.create(failed, tiny_encoder.dim, dataclasses.replace(record, version=2))
    store.delete(failed)
    report = update(store, tiny_encoder, tmp_path, [Document("new", "new", "kilo lima")])
    assert report.collection == failed and report.kind == "delta"
    manifest = store.manifest(report.collection)
    assert manifest.bases == store.manifest(first.collection).bases == 1
    assert len(manifest.segments) == 2  # the base's shard and the delta's own
    store.close()


def test_an_unchanged_upsert_writes_nothing(
    any_store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    rng = random.Random(1)
    docs = [doc(i, rng) for i in range(5)]
    first = write(any_store, tiny_encoder, tmp_path, docs)
    report = update(any_store, tiny_encoder, tmp_path, docs[:2], ["nope"])
    assert report.kind == "unchanged" and report.collection == first.collection
    assert (report.unchanged, report.not_found, report.promoted) == (2, 1, False)
    assert [i.name for i in any_store.versions("kb")] == [first.collection]


def _paragraphs(rng: random.Random, n: int) -> list[str]:
    """`n` paragraphs of 24 words: one chunk apiece at the default chunk budget."""
    return [
        ". ".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(3)) + "."
        for _ in range(n)
    ]


def test_an_edit_rewrites_only_the_chunks_it_changed(
    any_store: Store, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sentence added to the fourth paragraph of a long document: the delta writes the first
    chunk (it carries the document's hash), the changed chunk and those its offsets moved, and
    keeps the rest as the live version holds them. Oracle: a full build of the edited corpus
    (same ids, payloads and vectors); the points written and removed, counted at the store."""
    rng = random.Random(7)
    paragraphs = _paragraphs(rng, 8)
    long = Document("long", "A long one", "\n\n".join(paragraphs))
    others = [doc(i, rng) for i in range(5)]
    first = write(any_store, tiny_encoder, tmp_path, [long, *others])
    before = {
        int(r.payload["chunk_index"]): r.id
        for r in any_store.scroll(first.collection)
        if r.payload["doc_id"] == "long"
    }
    assert len(before) == len(paragraphs), "one chunk a paragraph"
    edited_paragraphs = list(paragraphs)
    edited_paragraphs[3] += " An added sentence about qdrant."
    edited = dataclasses.replace(long, text="\n\n".join(edited_paragraphs))
    upserted: list[str] = []
    dropped: list[str] = []
    upsert, derive = any_store.upsert, any_store.derive

    def counted_upsert(name: str, ids: Sequence[str], *args: Any, **kwargs: Any) -> None:
        upserted.extend(ids)
        upsert(name, ids, *args, **kwargs)

    def counted_derive(name: str, base: str, record: Any, drop: Iterable[str]) -> None:
        drop = list(drop)
        dropped.extend(drop)
        derive(name, base, record, drop)

    monkeypatch.setattr(any_store, "upsert", counted_upsert)
    monkeypatch.setattr(any_store, "derive", counted_derive)
    report = update(any_store, tiny_encoder, tmp_path, [edited])
    assert report.kind == "delta" and report.chunks == first.chunks
    at = {before[i]: i for i in before}
    # chunk 0 (the hash), chunk 3 (the new sentence) and every later one (moved offsets)
    expected = {before[i] for i in before if i == 0 or i >= 3}
    assert set(upserted) == set(dropped) == expected, sorted(at[i] for i in upserted)
    # the new version holds what a full build of the edited corpus holds
    fresh = EdgeStore(tmp_path / "fresh")
    rebuilt = ingest_documents(
        LoadedCorpus((edited, *others), 0, "t"),
        alias="kb",
        encoder=tiny_encoder,
        store=fresh,
        lock_dir=tmp_path / "fresh-locks",
    )

    def points(store: Store, name: str) -> dict[str, Record]:
        ids = [r.id for r in store.scroll(name)]
        return {r.id: r for r in store.retrieve(name, ids, with_dense=True, with_sparse=True)}

    got, want = points(any_store, report.collection), points(fresh, rebuilt.collection)
    # only the new texts were encoded (the changed chunk, and the next one's overlap); the moved
    # ones kept their vectors
    old_texts = {r.payload["text"] for r in any_store.scroll(first.collection)}
    assert report.encoded == len({r.payload["text"] for r in want.values()} - old_texts) >= 1
    assert got.keys() == want.keys()
    for pid, ref in want.items():
        mine = got[pid]
        assert {**mine.payload, "doc_hash": ""} == {**ref.payload, "doc_hash": ""}
        assert mine.dense is not None and ref.dense is not None
        np.testing.assert_allclose(mine.dense, ref.dense, rtol=1e-5, atol=1e-6)
        # the same terms (the weights follow each version's lineage of BM25 statistics)
        assert mine.sparse is not None and ref.sparse is not None
        assert sorted(mine.sparse.indices) == sorted(ref.sparse.indices)
    # a kept point is the live version's, untouched: payload (its hash included) and vectors
    old = points(any_store, first.collection)
    for pid in set(before.values()) - expected:
        assert got[pid].payload == old[pid].payload
        np.testing.assert_array_equal(got[pid].dense, old[pid].dense)
        assert got[pid].sparse == old[pid].sparse
    fresh.close()
    # the document's hash is the new one: the same text again is unchanged, the old one a delta
    assert update(any_store, tiny_encoder, tmp_path, [edited]).kind == "unchanged"
    upserted.clear()
    back = update(any_store, tiny_encoder, tmp_path, [long])
    assert back.kind == "delta" and set(upserted) == expected


def test_an_edit_reads_every_live_chunk_of_long_documents(
    any_store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """An edit reads a document's live chunks by id, FIRST_PROBE at first and PROBE_GROWTH times
    more each time all were found: documents of one chunk and of each side of those bounds,
    edited at their end or deleted, leave nothing of their old chunks behind. Oracle: a full
    build of the edited corpus."""
    rng = random.Random(17)
    sizes = [1, FIRST_PROBE, FIRST_PROBE + 1, FIRST_PROBE * (1 + PROBE_GROWTH) + 1]
    # one chunk a paragraph, the first two paragraphs in one
    docs = [Document(f"long{n}", "Long", "\n\n".join(_paragraphs(rng, n + (n > 1)))) for n in sizes]
    first = write(any_store, tiny_encoder, tmp_path, docs)

    def held(store: Store, name: str) -> dict[tuple[str, int], str]:
        return {
            (r.payload["doc_id"], r.payload["chunk_index"]): r.payload["text"]
            for r in store.scroll(name)
        }

    chunks = Counter(doc_id for doc_id, _ in held(any_store, first.collection))
    assert sorted(chunks.values()) == sizes
    edited = [
        dataclasses.replace(d, text=d.text.rsplit("\n\n", 1)[0] + "\n\nA new end.") for d in docs
    ]
    for kept, gone in ((edited[::2], docs[1::2]), (edited[1::2], docs[::2])):
        report = update(any_store, tiny_encoder, tmp_path, kept, [d.id for d in gone])
        fresh = EdgeStore(tmp_path / f"fresh{len(kept)}{kept[0].id}")
        rebuilt = ingest_documents(
            LoadedCorpus(tuple(kept), 0, "t"),
            alias="kb",
            encoder=tiny_encoder,
            store=fresh,
            lock_dir=tmp_path / "fresh-locks",
        )
        assert report.kind == "delta" and held(any_store, report.collection) == held(
            fresh, rebuilt.collection
        )
        assert any_store.count(report.collection) == rebuilt.chunks
        fresh.close()
        # back to the documents as first written, for the next round
        update(any_store, tiny_encoder, tmp_path, docs)


@pytest.mark.parametrize("engine", ["edge", "server"])
def test_bm25_after_random_deltas_equals_rank_bm25_on_the_current_corpus(
    engine: str, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """Upserts and deletes at random; the engine's BM25 scores are rank-bm25's on the corpus as
    it is now, with the lineage's recorded average length, to 1e-5."""
    store: Store = (
        EdgeStore(tmp_path / "edge") if engine == "edge" else ServerStore(QdrantClient(":memory:"))
    )
    rng = random.Random(7)
    corpus = {f"d{i}": doc(i, rng, rng.randint(2, 9)) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    for step in range(6):
        report = random_delta(store, tiny_encoder, tmp_path, corpus, rng, ids=45, deletes=2)
        assert report.kind == "delta", step
    name = store.aliases()["kb"]
    assert store.record(name).lineage.deltas == 6
    assert_bm25_is_rank_bm25s(store, name, corpus, rng)
    store.close()


@pytest.mark.parametrize("over_fetch", [True, False])
def test_a_search_across_shards_and_tombstones_equals_a_brute_force_one(
    over_fetch: bool, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense and BM25 top k (k from 1 to past the corpus) after random deltas equal an exact
    search over the live points; without the over-fetch every tombstone near the top sends the
    merge back to the engine with the tombstones as a filter, and the answer stays the same."""
    if not over_fetch:
        monkeypatch.setattr(
            EdgeStore, "_fetch_limit", staticmethod(lambda seg, q, share=1.0: q.limit)
        )
    monkeypatch.setattr(shards_module, "BASE_MERGE_FRACTION", 10.0)  # keep the tombstones
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(11)
    corpus = {f"d{i}": doc(i, rng, rng.randint(2, 9)) for i in range(40)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    for _ in range(5):
        upserts = [doc(rng.randint(0, 60), rng, rng.randint(2, 9)) for _ in range(6)]
        upserts = list({d.id: d for d in upserts}.values())
        deletes = rng.sample(sorted(set(corpus) - {d.id for d in upserts}), 3)
        update(store, tiny_encoder, tmp_path, upserts, deletes)
        corpus.update({d.id: d for d in upserts})
        for gone in deletes:
            del corpus[gone]
    name = store.aliases()["kb"]
    segments = store.manifest(name).segments
    assert len(segments) > 1 and segments[0].deleted
    live = [r.id for r in store.scroll(name)]
    records = store.retrieve(name, live, with_dense=True, with_sparse=True)
    assert len(live) == len(records) == len(set(live))
    model = BM25Model(store.record(name).bm25, store.doc_freqs(name))
    tok = Tokenizer()
    for terms in ([rng.choice(WORDS)], rng.sample(WORDS, 2), rng.sample(WORDS, 3)):
        sparse = model.query_vector(tok.tokenize(" ".join(terms)))
        weights = dict(zip(sparse.indices, sparse.values, strict=True))
        bm25 = {
            r.id: sum(
                weights.get(i, 0.0) * v
                for i, v in zip(r.sparse.indices, r.sparse.values, strict=True)
            )
            for r in records
            if r.sparse is not None
        }
        dense = records[rng.randrange(len(records))].dense
        assert dense is not None
        cosine = {r.id: float(np.dot(r.dense, dense)) for r in records if r.dense is not None}
        for limit in (1, 2, 3, 5, 10, 60):
            found_sparse, found_dense = store.search(
                name, [StageQuery(SPARSE, sparse, limit), StageQuery(DENSE, dense, limit)]
            )
            positive = {pid: s for pid, s in bm25.items() if s > 0}
            for found, exact in ((found_sparse, positive), (found_dense, cosine)):
                best = sorted(exact.values(), reverse=True)[:limit]
                np.testing.assert_allclose([s for _, s in found], best, rtol=1e-5, atol=1e-5)
                assert {pid for pid, _ in found} <= exact.keys()  # live points only
                # every point clearly above the k-th score is in (ties may go either way)
                assert {p for p, s in exact.items() if s > best[-1] + 1e-5} <= dict(found).keys()
    store.close()


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_delta_never_writes_into_the_base_version_s_shards(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(2)
    docs = [doc(i, rng) for i in range(40)]
    first = write(store, tiny_encoder, tmp_path, docs)
    base = store.manifest(first.collection).segments[0].id
    before = _files(tmp_path / "edge" / "segments" / base)
    report = update(store, tiny_encoder, tmp_path, [doc(3, rng), doc(99, rng)], ["d7"])
    assert report.kind == "delta"
    assert _files(tmp_path / "edge" / "segments" / base) == before
    segments = store.manifest(report.collection).segments
    assert segments[0].id == base and len(segments) == 2
    assert len(segments[0].deleted) == 2  # d3 replaced, d7 deleted: tombstones, not rewrites
    store.close()


def test_delta_shards_are_merged_and_unnamed_shards_collected(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shards_module, "MAX_DELTA_SHARDS", 2)
    monkeypatch.setattr(shards_module, "BASE_MERGE_FRACTION", 10.0)
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(3)
    docs = {f"d{i}": doc(i, rng) for i in range(30)}
    write(store, tiny_encoder, tmp_path, list(docs.values()))
    for i in range(5):
        changed = doc(i, rng)
        docs[changed.id] = changed
        update(store, tiny_encoder, tmp_path, [changed], retention_grace_s=0, keep_versions=1)
    name = store.aliases()["kb"]
    assert len(store.manifest(name).segments) <= 3  # base + at most MAX_DELTA_SHARDS deltas
    assert served_docs(store) == set(docs)
    texts = {r.payload["doc_id"]: r.payload["text"] for r in store.scroll(name)}
    assert all(texts[k] == d.text for k, d in docs.items())
    # retention kept one version: only the shards it names are left on disk
    named = {s.id for s in store.manifest(name).segments}
    assert {p.name for p in (tmp_path / "edge" / "segments").iterdir()} == named
    store.close()


def test_the_deltas_outgrowing_the_base_are_merged_into_a_new_base(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shards_module, "BASE_MERGE_FRACTION", 0.1)
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(4)
    docs = [doc(i, rng) for i in range(20)]
    write(store, tiny_encoder, tmp_path, docs)
    report = update(store, tiny_encoder, tmp_path, [doc(1, rng), doc(2, rng), doc(50, rng)], ["d9"])
    segments = store.manifest(report.collection).segments
    assert len(segments) == 1 and not segments[0].deleted and segments[0].points == 20
    assert store.count(report.collection) == 20
    store.close()


def test_average_length_drift_re_bases_with_a_full_build(
    tiny_encoder: Encoder, store: Store, tmp_path: Path
) -> None:
    rng = random.Random(5)
    docs = [doc(i, rng, 4) for i in range(10)]
    write(store, tiny_encoder, tmp_path, docs)
    long_doc = Document("long", "long", " ".join(rng.choice(WORDS) for _ in range(60)))
    report = update(store, tiny_encoder, tmp_path, [long_doc], rebase_drift=0.02)
    assert report.kind == "full" and report.full_reason and "drifted" in report.full_reason
    assert (report.upserted, report.reused) == (1, 10)  # the other vectors were reused
    record = store.record(report.collection)
    assert record.lineage.deltas == 0 and record.bm25.drift == 0.0


def test_ingest_of_a_whole_corpus_takes_the_delta_path(
    any_store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    rng = random.Random(6)
    docs = [doc(i, rng) for i in range(12)]
    write(any_store, tiny_encoder, tmp_path, docs)
    docs[0] = dataclasses.replace(docs[0], text="alpha alpha bravo charlie delta echo")
    report = write(any_store, tiny_encoder, tmp_path, docs[:-1], rebase_drift=1.0)
    assert report.kind == "delta"
    assert (report.upserted, report.deleted, report.unchanged, report.encoded) == (1, 1, 10, 1)
    assert served_docs(any_store) == {d.id for d in docs[:-1]}
    full = write(any_store, tiny_encoder, tmp_path, docs[:-1], full=True)
    assert full.kind == "full" and full.full_reason == "--full was asked"


def test_updates_are_refused_where_only_ingest_can_help(
    store: Store, tiny_encoder: Encoder, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(8)
    with pytest.raises(UpdateRefused, match=r"no live version.*rag-retriever ingest"):
        update(store, tiny_encoder, tmp_path, [doc(1, rng)])
    write(store, tiny_encoder, tmp_path, [doc(i, rng) for i in range(4)])
    other_dir = tmp_path / "other"
    import shutil

    shutil.copytree(tiny_encoder_dir, other_dir)
    write_profile_file(other_dir, ModelProfile("other-bert", "", "", "mean", 64))
    other = Encoder.load(str(other_dir), device="cpu", dtype="fp32")
    with pytest.raises(UpdateRefused, match=r"embedded with.*run `rag-retriever ingest"):
        update(store, other, tmp_path, [doc(1, rng)])
    with pytest.raises(UpdateRefused, match="chunked with"):
        update(store, tiny_encoder, tmp_path, [doc(1, rng)], chunk_tokens=50, overlap_tokens=10)
    assert len(store.versions("kb")) == 1


def test_invalid_documents_are_all_reported_and_nothing_is_written(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    rng = random.Random(9)
    first = write(store, tiny_encoder, tmp_path, [doc(i, rng) for i in range(4)])
    bad = [
        Document("x", "t", "   "),
        Document("y", "t", "ok text"),
        Document("y", "t", "twice"),
        Document("z", "t", "bad \ud800 text"),
    ]
    with pytest.raises(DocumentError) as info:
        update(store, tiny_encoder, tmp_path, bad, ["q"])
    message = str(info.value)
    assert "[0]" in message and "no text" in message
    assert "duplicate id 'y'" in message and "[3]" in message and "Unicode" in message
    with pytest.raises(DocumentError, match="both upserted and deleted"):
        update(store, tiny_encoder, tmp_path, [doc(1, rng)], ["d1"])
    assert [i.name for i in store.versions("kb")] == [first.collection]


# (the Store call to kill the `update` after, which call of it, whether the alias moved then)
UPDATE_KILL_POINTS = [
    ("derive", 1, False),  # the new version's manifest written, nothing added yet
    ("upsert", 1, False),  # the delta half written
    ("seal", 1, False),  # sealed, still marked building
    ("write_meta", 2, False),  # marked complete, alias not moved
    ("point_alias", 1, True),  # alias moved
]


def _cli_env(tmp_path: Path, encoder_dir: Path) -> dict[str, str]:
    import os

    return {
        **os.environ,
        "RAG_DATA_DIR": str(tmp_path / "data"),
        "RAG_EMBED_MODEL": str(encoder_dir),
        "RAG_DEVICE": "cpu",
        "RAG_BM25_REBASE_DRIFT": "1",
        "RAG_LOG_LEVEL": "WARNING",
    }


def _cli_ingest(corpus: Path, env: dict[str, str]) -> list[str]:
    """`rag-retriever ingest CORPUS --collection kb` in a subprocess; returns the CLI command."""
    import subprocess
    import sys

    cli = [sys.executable, "-m", "rag_retriever.cli"]
    first = subprocess.run(
        [*cli, "ingest", str(corpus), "--collection", "kb", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    return cli


def _write_corpus(path: Path, docs: list[Document]) -> Path:
    import json

    path.write_text(
        "".join(json.dumps({"id": d.id, "title": d.title, "text": d.text}) + "\n" for d in docs),
        encoding="utf-8",
    )
    return path


@pytest.mark.slow
def test_sigkill_at_each_step_of_an_update_leaves_a_complete_version_served(
    tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    """A real `rag-retriever update` subprocess, killed with SIGKILL after each named step; the
    alias always serves a complete version and the next update succeeds."""
    import subprocess

    from tests.test_reingest import kill_after

    rng = random.Random(11)
    env = _cli_env(tmp_path, tiny_encoder_dir)
    corpus = _write_corpus(tmp_path / "corpus.jsonl", [doc(i, rng) for i in range(50)])
    cli = _cli_ingest(corpus, env)

    def served() -> str:
        store = EdgeStore(tmp_path / "data" / "edge")
        try:
            name = store.aliases()["kb"]
            record = store.record(name)
            assert record.status == "complete" and store.count(name) == record.chunks
            return name
        finally:
            store.close()

    before = served()
    for i, (method, nth, moved) in enumerate(UPDATE_KILL_POINTS):
        change = _write_corpus(tmp_path / f"change{i}.jsonl", [doc(100 + i, rng), doc(i, rng)])
        args = [
            "update",
            "--collection",
            "kb",
            "--upsert",
            str(change),
            "--delete",
            f"d{20 + i}",
            "--no-progress",
        ]
        kill_after(method, nth, args, env)
        now = served()
        assert (now != before) == moved, method
        before = now
    final = subprocess.run(
        [
            *cli,
            "update",
            "--collection",
            "kb",
            "--upsert",
            str(tmp_path / "change0.jsonl"),
            "--no-progress",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert final.returncode == 0, final.stderr
    store = EdgeStore(tmp_path / "data" / "edge")
    try:
        assert all(i.status == "complete" for i in store.versions("kb"))  # orphans removed
        named = {s.id for i in store.versions("kb") for s in store.manifest(i.name).segments}
        assert {p.name for p in (tmp_path / "data" / "edge" / "segments").iterdir()} == named
        assert "d100" in served_docs(store)
    finally:
        store.close()


@pytest.mark.slow
def test_two_updates_at_once_from_two_processes_lose_nothing(
    tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    import subprocess

    rng = random.Random(12)
    env = _cli_env(tmp_path, tiny_encoder_dir)
    corpus = _write_corpus(tmp_path / "corpus.jsonl", [doc(i, rng) for i in range(20)])
    cli = _cli_ingest(corpus, env)
    procs = []
    for name in ("left", "right"):
        change = _write_corpus(
            tmp_path / f"{name}.jsonl", [Document(name, name, f"{name} golf hotel")]
        )
        procs.append(
            subprocess.Popen(
                [*cli, "update", "--collection", "kb", "--upsert", str(change), "--no-progress"],
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    store = EdgeStore(tmp_path / "data" / "edge")
    try:
        assert {"left", "right"} <= set(served_docs(store))
        assert store.record(store.aliases()["kb"]).lineage.deltas == 2
    finally:
        store.close()


def test_a_version_of_another_schema_is_refused_with_the_fix(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A version written by rag-retriever 0.2 (an untyped record, IDF on the document side) is
    listed as incompatible and refused at query time with a message to re-ingest (409)."""
    import json

    from rag_retriever.errors import VersionIncompatible

    rng = random.Random(13)
    report = write(store, tiny_encoder, tmp_path, [doc(i, rng) for i in range(3)])
    meta_file = tmp_path / "edge" / "collections" / report.collection / "meta.json"
    old = json.loads(meta_file.read_text())
    del old["schema"]
    meta_file.write_text(json.dumps(old))
    info = store.versions("kb")[0]
    assert info.status == "incompatible" and info.problem and "re-ingest" in info.problem
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="kb")
    with pytest.raises(VersionIncompatible, match=r"schema 1.*re-ingest") as caught:
        retriever.search("alpha")
    assert caught.value.http_status == 409
    with pytest.raises(UpdateRefused, match=r"schema 1.*re-ingest"):
        update(store, tiny_encoder, tmp_path, [doc(1, rng)])
    # ingest rebuilds it (the message's fix), reusing nothing it cannot read
    again = write(store, tiny_encoder, tmp_path, [doc(i, rng) for i in range(3)])
    assert again.kind == "full" and again.full_reason and "schema 1" in again.full_reason
    assert retriever.search("alpha")


def test_the_update_command_refuses_bad_input_with_exit_2_and_writes_nothing(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rag_retriever.cli import main

    rng = random.Random(14)
    corpus = _write_corpus(tmp_path / "corpus.jsonl", [doc(i, rng) for i in range(5)])
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "ok"}\n{"id": "a", "text": "dup"}\n{"text": "no id"}\n')
    cases = [
        (["update", "--collection", "kb"], "nothing to do"),
        (["update", "--collection", "kb", "--upsert", str(bad)], "duplicate id 'a'"),
        (
            ["update", "--collection", "kb", "--upsert", str(tmp_path / "nope.jsonl")],
            "does not exist",
        ),
        (
            ["update", "--collection", "kb", "--delete-ids", str(tmp_path / "nope.txt")],
            "cannot read",
        ),
        (["update", "--collection", "other", "--delete", "x"], "no live version"),
    ]
    for argv, message in cases:
        assert main([*argv, "--no-progress"]) == 2, argv
        assert message in capsys.readouterr().err, argv
    ok = _write_corpus(tmp_path / "ok.jsonl", [doc(1, rng)])
    assert main(["update", "--collection", "kb", "--upsert", str(ok), "--delete", "d1"]) == 2
    assert "both upserted and deleted" in capsys.readouterr().err
    store = EdgeStore(env / "edge")
    assert len(store.versions("kb")) == 1  # nothing was written
    store.close()
    assert (
        main(
            ["questions", "--from-log", str(tmp_path / "nolog"), "--out", str(tmp_path / "q.jsonl")]
        )
        == 2
    )
    assert "not a query log directory" in capsys.readouterr().err
    assert main(["doctor", "--collection", "nope"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_document_frequencies_are_a_shared_table_and_the_changes_since_it(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Edge keeps a full build's frequencies in a table that the deltas' versions hard-link (it
    is never written again) and writes only the changes beside it; past REBASE_FRACTION a delta
    writes a new table. Every term hashes onto one of 16 indices, so terms entering and leaving
    collide all the time: every term of a version keeps an index of its own, a term keeps its
    index while it stays, the frequencies are the corpus's and the scores rank-bm25's."""
    real = bm25_module.term_index
    monkeypatch.setattr(bm25_module, "term_index", lambda term: real(term) % 16)
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(11)
    corpus = {f"d{i}": doc(i, rng, rng.randint(2, 9)) for i in range(30)}
    first = write(store, tiny_encoder, tmp_path, list(corpus.values()))
    table = tmp_path / "edge" / "collections" / first.collection / terms_module.TABLE_FILE
    inode, digest = table.stat().st_ino, hashlib.sha256(table.read_bytes()).hexdigest()
    tok = Tokenizer()
    previous: dict[str, int] = {}
    # a vocabulary this small changes by more than the default share at every delta
    monkeypatch.setattr(terms_module, "REBASE_FRACTION", 100.0)
    for step in range(8):
        if step == 6:  # from here on the changes are always past the fraction
            monkeypatch.setattr(terms_module, "REBASE_FRACTION", 0.0)
        report = random_delta(store, tiny_encoder, tmp_path, corpus, rng, ids=60, deletes=3)
        assert report.kind == "delta", step
        directory = tmp_path / "edge" / "collections" / report.collection
        shared = (directory / terms_module.TABLE_FILE).stat().st_ino == inode
        assert shared == (step < 6), step
        model = BM25Model(store.record(report.collection).bm25, store.doc_freqs(report.collection))
        vocabulary = {t for d in corpus.values() for t in tok.tokenize(embed_text(d.title, d.text))}
        index = {t: model.index_of(t) for t in vocabulary}
        assert len(set(index.values())) == len(index), step
        assert all(index[t] == i for t, i in previous.items() if t in index), step
        previous = index
        assert_bm25_is_rank_bm25s(store, report.collection, corpus, rng)
    # the full build's table was never written through its links
    assert hashlib.sha256(table.read_bytes()).hexdigest() == digest
    store.delete(first.collection)  # a version's link goes with it; the others still read
    assert_bm25_is_rank_bm25s(store, store.aliases()["kb"], corpus, rng)
    store.close()


def test_versions_written_without_the_histogram_are_read_and_updated(
    tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables and changes written before the histogram of document frequencies was recorded:
    it is counted from them, the scores are still rank-bm25's, and the next delta records it."""
    # a vocabulary this small changes by more than the default share at every delta
    monkeypatch.setattr(terms_module, "REBASE_FRACTION", 100.0)
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(9)
    corpus = {f"d{i}": doc(i, rng) for i in range(14)}
    write(store, tiny_encoder, tmp_path, list(corpus.values()))
    report = random_delta(store, tiny_encoder, tmp_path, corpus, rng, ids=20, deletes=2)
    assert report.kind == "delta"
    directory = tmp_path / "edge" / "collections" / report.collection
    with sqlite3.connect(directory / terms_module.TABLE_FILE) as db:  # every link's table
        db.execute("DROP TABLE histogram")
    changes = json.loads((directory / terms_module.CHANGES_FILE).read_text())
    del changes["histogram"]
    (directory / terms_module.CHANGES_FILE).write_text(json.dumps(changes))
    assert_bm25_is_rank_bm25s(store, report.collection, corpus, rng)
    again = random_delta(store, tiny_encoder, tmp_path, corpus, rng, ids=20, deletes=1)
    assert again.kind == "delta"
    written = json.loads(
        (
            tmp_path / "edge" / "collections" / again.collection / terms_module.CHANGES_FILE
        ).read_text()
    )
    assert "histogram" in written
    assert_bm25_is_rank_bm25s(store, again.collection, corpus, rng)
    store.close()


def test_a_version_that_keeps_its_frequencies_in_one_file_is_read_and_updated(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """Versions written before the table hold one doc_freqs.json: read as it is, and the next
    delta writes a table."""
    store = EdgeStore(tmp_path / "edge")
    rng = random.Random(5)
    corpus = {f"d{i}": doc(i, rng) for i in range(12)}
    first = write(store, tiny_encoder, tmp_path, list(corpus.values()))
    directory = tmp_path / "edge" / "collections" / first.collection
    whole = dict(store.doc_freqs(first.collection).items())
    (directory / terms_module.TABLE_FILE).unlink()
    (directory / terms_module.CHANGES_FILE).unlink()
    (directory / terms_module.WHOLE_FILE).write_text(json.dumps(whole))
    assert dict(store.doc_freqs(first.collection).items()) == whole
    assert_bm25_is_rank_bm25s(store, first.collection, corpus, rng)
    new = doc(40, rng)
    report = update(store, tiny_encoder, tmp_path, [new], ["d2"])
    assert report.kind == "delta"
    corpus["d40"] = new
    del corpus["d2"]
    assert (
        tmp_path / "edge" / "collections" / report.collection / terms_module.TABLE_FILE
    ).exists()
    assert_bm25_is_rank_bm25s(store, report.collection, corpus, rng)
    store.close()


def test_a_re_base_never_switches_the_model_an_update_did_not_embed_with(
    tiny_encoder: Encoder, tiny_encoder_dir: Path, store: Store, tmp_path: Path
) -> None:
    """A delete-only update under another model that crossed the drift limit re-based with that
    model: `kb__other-bert__v2` served, where update refuses a model change."""
    import shutil

    from rag_retriever.models.profiles import ModelProfile, write_profile_file

    rng = random.Random(7)
    docs = [doc(i, rng, 4 + 8 * (i % 2)) for i in range(10)]
    first = write(store, tiny_encoder, tmp_path, docs)
    other_dir = Path(shutil.copytree(tiny_encoder_dir, tmp_path / "other"))
    write_profile_file(other_dir, ModelProfile("other-bert", "", "", "mean", 64))
    other = Encoder.load(str(other_dir), device="cpu", dtype="fp32")
    with pytest.raises(UpdateRefused, match="was embedded with"):
        update(store, other, tmp_path, [], ["d1", "d3", "d5"], rebase_drift=0.0)
    assert store.aliases() == {"kb": first.collection}


def test_a_document_without_text_is_skipped_by_every_ingest(
    tiny_encoder: Encoder, store: Store, tmp_path: Path
) -> None:
    """It made no chunk, so no ingest found it in the live version: each one wrote a new version
    (documents 3, 4, 5 of a corpus of 2)."""
    rng = random.Random(8)
    docs = [doc(0, rng), doc(1, rng), Document("blank", "Blank", "  ")]
    first = write(store, tiny_encoder, tmp_path, docs)
    assert first.skipped_empty == 1 and store.record(first.collection).documents == 2
    again = write(store, tiny_encoder, tmp_path, docs)
    assert again.kind == "unchanged" and again.collection == first.collection
