"""The versioned writer on a real (in-memory) Qdrant: versions, alias, reuse, failure, locks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from rag_retriever.errors import CollectionNotFound, ConfigError, IngestLocked, InvalidRequest
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.lock import IngestLock
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoded, Encoder
from rag_retriever.models.profiles import ModelProfile, write_profile_file
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.records import Document, chunk_point_id
from rag_retriever.store import EdgeStore, Store
from rag_retriever.store.catalog import promote_version, rollback
from rag_retriever.store.record import bare_record

DOCS = (
    Document("a", "Apples", "Red apples grow on trees.\n\nGreen apples are sour.", {"lang": "en"}),
    Document("b", "Wine", "Red wine comes from France. Paris drinks it.", {"lang": "fr"}),
    Document("c", "Rivers", "The river runs from the mountain to the city.", {"lang": "en"}),
)


def corpus(docs: Sequence[Document] = DOCS) -> LoadedCorpus:
    return LoadedCorpus(tuple(docs), 0, "test")


def run(store: Store, encoder: Encoder, tmp_path: Path, docs: Sequence[Document] = DOCS, **kw):
    """A full build (a new version even of an unchanged corpus, which is what these tests of
    versions need; the delta path has its own tests in test_update.py)."""
    kw.setdefault("full", True)
    return ingest_documents(corpus(docs), alias="kb", encoder=encoder, store=store, **kw)


def test_first_ingest_writes_a_complete_version_behind_the_alias(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    report = run(store, tiny_encoder, tmp_path)
    assert report.collection == "kb__tiny-bert-32__v1"
    assert store.aliases() == {"kb": report.collection}
    record = store.record(report.collection)
    assert record.status == "complete" and record.fingerprint.id == tiny_encoder.fingerprint.id
    assert store.count(report.collection) == report.chunks == report.encoded
    index = ChunkTable.load(store, report.collection)
    assert index is not None and len(index) == report.chunks
    first = index.chunks[0]
    assert first.id == chunk_point_id(first.doc_id, first.chunk_index)
    payloads = {p["chunk_id"]: p for p in (r.payload for r in store.scroll(report.collection))}
    assert payloads[first.id]["text"] == DOCS[0].text[first.start : first.end]
    # the table holds positions, not texts; it reads texts from the engine when asked
    assert not hasattr(first, "text") and index.embed_texts([0]) == [
        f"{payloads[first.id]['title']}\n\n{DOCS[0].text[first.start : first.end]}"
    ]
    assert payloads[first.id]["metadata"] == {"lang": "en"}
    assert (report.documents, report.reused, report.removed, report.truncated) == (3, 0, 0, 0)


def test_reingest_reuses_vectors_and_counts_changes(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    first = run(store, tiny_encoder, tmp_path)
    changed = [
        DOCS[0],
        Document("c", "Rivers", "A different river text now."),
        Document("d", "New", "Fresh doc."),
    ]
    second = run(store, tiny_encoder, tmp_path, changed)
    assert second.version == 2 and second.previous == first.collection
    assert second.reused == 1  # doc a's one chunk
    assert second.encoded == 2  # changed c, new d
    assert second.removed == 2  # old b and old c
    assert store.aliases()["kb"] == second.collection
    # A reused vector is the vector the encoder gives for that text.
    index = ChunkTable.load(store, second.collection)
    assert index is not None
    chunk = next(c for c in index.chunks if c.doc_id == "a")
    stored = {
        r.id: r.dense for r in store.retrieve(second.collection, [chunk.id], with_dense=True)
    }[chunk.id]
    assert stored is not None
    np.testing.assert_allclose(
        stored,
        tiny_encoder.encode_passages(index.embed_texts([index.row_of[chunk.id]])).vectors[0],
        atol=1e-5,
    )
    assert {c.doc_id for c in index.chunks} == {"a", "c", "d"}


def test_retention_keeps_the_newest_versions(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    reports = [
        run(store, tiny_encoder, tmp_path, keep_versions=2, retention_grace_s=0) for _ in range(3)
    ]
    names = [i.name for i in store.versions("kb")]
    assert names == [reports[1].collection, reports[2].collection]
    assert reports[2].deleted_versions == (reports[0].collection,)


def test_retention_spares_a_version_retired_within_the_grace_period(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A reader that resolved v1 just before the swap to v2 can finish; v1 goes later."""
    reports = [run(store, tiny_encoder, tmp_path, keep_versions=1) for _ in range(2)]
    assert reports[1].deleted_versions == ()
    assert (store.record(reports[0].collection).retired_at or 0) > 0
    later = run(store, tiny_encoder, tmp_path, keep_versions=1, retention_grace_s=0)
    assert set(later.deleted_versions) == {reports[0].collection, reports[1].collection}
    assert [i.name for i in store.versions("kb")] == [later.collection]


class FailingEncoder:
    """Wraps a real encoder and fails on the n-th call (injected failure mid-ingest)."""

    def __init__(self, inner: Encoder, fail_on_call: int) -> None:
        self.inner = inner
        self.fingerprint = inner.fingerprint
        self.max_seq_length = inner.max_seq_length
        self.special_tokens = inner.special_tokens
        self.calls = 0
        self.fail_on_call = fail_on_call

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return self.inner.count_tokens(texts)

    def encode_passages(self, passages: Sequence[str], *, progress: bool = False) -> Encoded:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("injected failure")
        return self.inner.encode_passages(passages)


def test_failure_mid_ingest_leaves_the_alias_and_no_partial_collection(
    store: Store, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = run(store, tiny_encoder, tmp_path)
    monkeypatch.setattr(
        "rag_retriever.ingest.writer.ENCODE_BLOCK", 2
    )  # several blocks, so the failure is mid-way
    many = [Document(f"d{i}", f"T{i}", f"Text number {i} about apples.") for i in range(9)]
    failing = FailingEncoder(tiny_encoder, fail_on_call=3)
    with pytest.raises(RuntimeError, match="injected failure"):
        run(store, failing, tmp_path, many)  # type: ignore[arg-type]
    assert failing.calls == 3
    assert store.aliases() == {"kb": good.collection}
    assert [i.name for i in store.versions("kb")] == [good.collection]
    # nothing of the failed version is left on disk either
    assert sorted(p.name for p in (tmp_path / "edge" / "collections").iterdir()) == [
        good.collection
    ]


def test_orphans_of_a_killed_ingest_are_removed_next_time(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    good = run(store, tiny_encoder, tmp_path)
    orphan = "kb__tiny-bert-32__v7"
    store.create(orphan, 32, bare_record(orphan, dim=32, bm25=store.record(good.collection).bm25))
    report = run(store, tiny_encoder, tmp_path)
    assert report.orphans_removed == (orphan,)
    assert report.version == 2  # computed after the orphan was removed
    assert not store.exists(orphan)
    assert store.aliases()["kb"] == report.collection != good.collection


def test_another_model_never_writes_into_the_old_collection(
    store: Store, tiny_encoder: Encoder, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    first = run(store, tiny_encoder, tmp_path)
    other_dir = Path(shutil.copytree(tiny_encoder_dir, tmp_path / "other"))
    write_profile_file(other_dir, ModelProfile("other-bert", "query: ", "passage: ", "mean", 64))
    other = Encoder.load(str(other_dir), device="cpu", dtype="fp32")
    second = run(store, other, tmp_path)
    assert second.collection == "kb__other-bert-32__v2"
    assert (second.reused, second.encoded) == (0, second.chunks)  # same text, new model: all new
    assert (
        store.record(first.collection).fingerprint.id
        != store.record(second.collection).fingerprint.id
    )


def test_promote_and_rollback(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> None:
    v1 = run(store, tiny_encoder, tmp_path)
    v2 = run(store, tiny_encoder, tmp_path, promote=False)
    assert not v2.promoted and store.aliases()["kb"] == v1.collection
    assert promote_version(store, "kb", 2) == v2.collection
    assert rollback(store, "kb") == v1.collection
    with pytest.raises(InvalidRequest, match="no older version that it served before"):
        rollback(store, "kb")
    with pytest.raises(CollectionNotFound, match="versions: 1, 2"):
        promote_version(store, "kb", 9)
    with pytest.raises(CollectionNotFound):
        rollback(store, "nope")


def test_rollback_returns_to_what_was_served_before_not_to_the_highest_number(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """Found by a review: rollback took the highest-numbered older version. A version that was
    only built (a gate's refusal, --no-promote) was never served, and one rolled back from
    is the one the operator left: neither is where a rollback goes."""
    v1 = run(store, tiny_encoder, tmp_path)
    v2 = run(store, tiny_encoder, tmp_path)
    built = run(store, tiny_encoder, tmp_path, promote=False)  # v3: never served
    v4 = run(store, tiny_encoder, tmp_path)
    assert rollback(store, "kb") == v2.collection  # not v3
    v5 = run(store, tiny_encoder, tmp_path)  # made after the rollback
    assert store.aliases()["kb"] == v5.collection
    # v4 was rolled back from: the next rollback goes back to v2, not forth to v4
    assert rollback(store, "kb") == v2.collection
    assert rollback(store, "kb") == v1.collection  # and further back, not forth
    with pytest.raises(InvalidRequest, match="promote kb VERSION"):
        rollback(store, "kb")
    # promote serves any complete version, and clears its rolled-back mark
    assert promote_version(store, "kb", 4) == v4.collection
    assert store.record(v4.collection).rolled_back_at is None
    assert built.collection != v4.collection


def test_second_ingest_of_the_same_alias_is_refused(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    with (
        IngestLock(tmp_path, "kb"),
        pytest.raises(IngestLocked, match="another write of 'kb' is running"),
    ):
        run(store, tiny_encoder, tmp_path)
    run(store, tiny_encoder, tmp_path)  # released: works


def test_a_killed_holder_does_not_leave_the_lock_stuck(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from rag_retriever.ingest.lock import IngestLock\n"
        f"lock = IngestLock(Path({str(tmp_path)!r}), 'kb').__enter__()\n"
        "print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    with pytest.raises(IngestLocked, match=f"pid {proc.pid}"), IngestLock(tmp_path, "kb"):
        pass
    proc.kill()
    proc.wait()
    # The holder is dead, so the lock is free (the kernel releases it with the process).
    with IngestLock(tmp_path, "kb"):
        pass


@pytest.mark.parametrize(
    "alias", ["../victim", "/abs/path", "a/b", "my coll*", "x" * 300, "a__b", ".hidden", ""]
)
def test_unsafe_collection_names_are_refused_before_any_path_is_written(
    store: Store, tiny_encoder: Encoder, tmp_path: Path, alias: str
) -> None:
    outside = tmp_path.parent
    before = sorted(os.listdir(outside))
    with pytest.raises(InvalidRequest, match="collection name"):
        ingest_documents(corpus(DOCS), alias=alias, encoder=tiny_encoder, store=store)
    assert sorted(os.listdir(outside)) == before  # nothing written beside this test's folder
    assert not (tmp_path / "locks").exists() and store.collection_names() == []


def test_links_inside_the_data_dir_cannot_lead_writes_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    data = tmp_path / "data"
    (data / "edge").mkdir(parents=True)
    (data / "edge" / "aliases").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ConfigError, match="leads outside the data dir"):
        EdgeStore(data / "edge")
    (data / "locks").mkdir()
    (data / "locks" / "kb.lock").symlink_to(outside / "victim.lock")
    with pytest.raises(ConfigError, match="leads outside the data dir"), IngestLock(data, "kb"):
        pass
    assert list(outside.iterdir()) == []  # nothing was written there


def test_a_complete_version_of_a_newer_schema_is_no_orphan(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A version another (newer) rag-retriever completed is not left by an interrupted write:
    it is kept until retention ages it out (it was deleted by the next write, before even an
    update that then refused)."""
    good = run(store, tiny_encoder, tmp_path)
    newer = "kb__tiny-bert-32__v5"
    store.create(newer, 32, bare_record(newer, dim=32, bm25=store.record(good.collection).bm25))
    meta = store.read_meta(newer)
    store.write_meta(newer, {**meta, "status": "complete", "schema": 99})
    assert [i.status for i in store.versions("kb") if i.name == newer] == ["incompatible"]
    report = run(store, tiny_encoder, tmp_path)
    assert report.orphans_removed == () and store.exists(newer)


def test_a_failed_write_deletes_only_a_version_it_made(
    store: Store, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name already there when the write meant to make it (another writer's, or a case twin
    on a case-insensitive disk) failed the write, whose failure handler then deleted it."""
    good = run(store, tiny_encoder, tmp_path)
    monkeypatch.setattr(store, "next_version", lambda alias: 1)  # the served version's number
    with pytest.raises(Exception):  # noqa: B017 (whatever the engine raises on a second create)
        run(store, tiny_encoder, tmp_path)
    assert store.exists(good.collection) and store.aliases() == {"kb": good.collection}
    assert store.count(good.collection) == good.chunks


def test_an_alias_that_differs_from_another_only_in_case_is_refused(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """On a case-insensitive disk `Docs` and `docs` share folders: ingesting `docs` found `Docs`'s
    served v1 where it meant to make its own v1, and deleted it on the failure."""
    first = ingest_documents(corpus(DOCS), alias="Docs", encoder=tiny_encoder, store=store)
    with pytest.raises(InvalidRequest, match="differs from the existing 'Docs' only in case"):
        ingest_documents(corpus(DOCS), alias="docs", encoder=tiny_encoder, store=store)
    assert store.aliases() == {"Docs": first.collection} and store.exists(first.collection)
    # an alias that already exists is written as before (twins made before this check)
    again = ingest_documents(corpus(DOCS), alias="Docs", encoder=tiny_encoder, store=store)
    assert again.kind == "unchanged"


def test_deleting_every_document_is_a_refusal_not_a_traceback(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    from rag_retriever.errors import UpdateRefused
    from rag_retriever.ingest.writer import update_documents

    good = run(store, tiny_encoder, tmp_path)
    with pytest.raises(UpdateRefused, match="cannot be left with zero documents"):
        update_documents(
            [], [d.id for d in DOCS], alias="kb", encoder=tiny_encoder, store=store,
            lock_dir=tmp_path,
        )  # fmt: skip
    assert store.aliases() == {"kb": good.collection}


def test_an_alias_never_moves_before_the_version_it_leaves_is_stamped(
    store: Store, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between the two, the version left looked never served: retention gave it no grace
    and rollback passed it over. Now the stamp comes first: a failure there leaves the alias
    where it was."""
    from rag_retriever.store.catalog import point_alias

    v1 = run(store, tiny_encoder, tmp_path)
    v2 = run(store, tiny_encoder, tmp_path, promote=False)

    def killed(name: str, record: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "put_record", killed)
    with pytest.raises(KeyboardInterrupt):
        point_alias(store, "kb", v2.collection)
    assert store.aliases() == {"kb": v1.collection}


def test_what_a_killed_delete_left_in_the_trash_is_swept(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A delete renames a version (or a shard) to `.deleted-*`, then removes it: killed during
    the removal, the folder stayed forever, and a shard's fixed trash name refused the next
    rename of that shard."""
    old = run(store, tiny_encoder, tmp_path)
    edge = tmp_path / "edge"
    left = [edge / "collections" / ".deleted-kb__x__v9-0000", edge / "segments" / ".deleted-kb--ab"]
    for folder in left:
        (folder / "inner").mkdir(parents=True)
        (folder / "inner" / "data").write_bytes(b"x" * 100)
    run(store, tiny_encoder, tmp_path)
    store.delete(old.collection)  # a delete collects the alias's garbage
    assert not any(folder.exists() for folder in left)


def test_a_compaction_never_served_does_not_stand_in_for_its_base(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A compaction killed before its promotion: complete, never served. Retention counted its
    base as compacted away and deleted it past RAG_KEEP_VERSIONS, though only the base was ever
    served (a rollback target)."""
    import dataclasses

    from rag_retriever.ingest.writer import update_documents
    from rag_retriever.store import Lineage
    from rag_retriever.store.catalog import apply_retention

    run(store, tiny_encoder, tmp_path)
    edit = Document("extra", "Extra", "A new note about pears and the river.")
    v2 = update_documents([edit], alias="kb", encoder=tiny_encoder, store=store, lock_dir=tmp_path)
    v3 = "kb__tiny-bert-32__v3"
    record = store.record(v2.collection)
    store.create(v3, 32, bare_record(v3, dim=32, bm25=record.bm25))
    compacted = Lineage(base=v2.collection, full_build=record.lineage.full_build, compacted=True)
    store.put_record(v3, dataclasses.replace(record, version=3, lineage=compacted))
    newer = Document("extra", "Extra", "A newer note about pears.")
    update_documents([newer], alias="kb", encoder=tiny_encoder, store=store, lock_dir=tmp_path)
    apply_retention(store, "kb", keep=3, grace_s=0)
    assert store.exists(v2.collection)  # the version served before; v1, the oldest, went
    assert [i.version for i in store.versions("kb")] == [2, 3, 4]


def test_an_alias_move_that_fails_leaves_no_stamp(
    store: Store, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stamped before the move, a version kept its stamp when the move then failed: a served
    version stamped `rolled_back_at` would be passed over by every later rollback."""
    from rag_retriever.store.catalog import point_alias

    v1 = run(store, tiny_encoder, tmp_path)
    v2 = run(store, tiny_encoder, tmp_path, promote=False)

    def unreachable(alias: str, name: str) -> None:
        raise OSError("the alias could not be written")

    monkeypatch.setattr(store, "point_alias", unreachable)
    with pytest.raises(OSError):
        point_alias(store, "kb", v2.collection, rolled_back=[v1.collection])
    record = store.record(v1.collection)
    assert record.rolled_back_at is None and record.retired_at is None
