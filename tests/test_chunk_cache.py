"""The bounded chunk and vector caches of a serving process carry over an edit: a version made
from another one (a delta, a compaction) records the chunk ids it changed, and every other id's
record, read once from the base, is not read again (issue 37: every edit used to start the
chunk cache cold). Oracles: the engine's own records of the new version, and counted reads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents, update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.chunk_table import LINKS_KEPT, BoundedReads
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Chunk, Document
from rag_retriever.store import EdgeStore, Record, Store
from rag_retriever.store.record import CHANGED_IDS_KEPT, Lineage


class Reads:
    """A source of items: `name:id` for each id, and every read it was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[str]]] = []

    def __call__(self, name: str, ids: list[str]) -> dict[str, str]:
        self.asked.append((name, list(ids)))
        return {cid: f"{name}:{cid}" for cid in ids}


def test_a_linked_version_reads_only_the_ids_it_changed() -> None:
    reads = Reads()
    cache: BoundedReads[str] = BoundedReads(reads, size=100)
    assert cache.find("v1", ["a", "b", "c"]) == {"a": "v1:a", "b": "v1:b", "c": "v1:c"}
    cache.link("v2", "v1", {"b"})
    cache.link("v3", "v2", {"c"})
    reads.asked.clear()
    assert cache.find("v3", ["a", "b", "c"]) == {"a": "v1:a", "b": "v3:b", "c": "v3:c"}
    # b changed in v2 and c in v3: the base's records of those are never used
    assert reads.asked == [("v3", ["b", "c"])]
    reads.asked.clear()
    assert cache.find("v2", ["a", "b"]) == {"a": "v1:a", "b": "v2:b"}
    assert reads.asked == [("v2", ["b"])]
    # an unlinked version shares nothing
    reads.asked.clear()
    cache.find("other", ["a"])
    assert reads.asked == [("other", ["a"])]


def test_links_are_bounded_and_cleared() -> None:
    reads = Reads()
    cache: BoundedReads[str] = BoundedReads(reads, size=100)
    cache.find("v0", ["a"])
    for n in range(1, LINKS_KEPT + 2):
        cache.link(f"v{n}", f"v{n - 1}", ())
    reads.asked.clear()
    assert cache.find(f"v{LINKS_KEPT + 1}", ["a"]) == {"a": f"v{LINKS_KEPT + 1}:a"}
    assert reads.asked == [(f"v{LINKS_KEPT + 1}", ["a"])]  # v1's link to v0 was dropped
    cache.clear()
    reads.asked.clear()
    cache.find("v2", ["z"])
    cache.link("v3", "v2", ())
    cache.clear()
    cache.find("v3", ["z"])
    assert reads.asked == [("v2", ["z"]), ("v3", ["z"])]


def test_the_lineage_keeps_the_changed_ids_only_when_recorded() -> None:
    lineage = Lineage(base="v1", full_build="v1", deltas=1, changed=("a", "b"))
    assert Lineage.from_json(lineage.to_json()) == lineage
    full = Lineage(full_build="v1")
    assert "changed" not in full.to_json()  # records written before it read the same
    assert Lineage.from_json(full.to_json()).changed is None


def _docs(n: int, edited: int | None = None) -> list[Document]:
    return [
        Document(
            f"d{i}",
            f"Title {i}",
            f"Apples {i} grow on trees. The river runs to the city.\n\nKings drink wine. "
            + ("An edited paragraph about cats. " if i == edited else ""),
        )
        for i in range(n)
    ]


class CountingStore(EdgeStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.retrieved: list[str] = []

    def retrieve(self, name: str, ids: Sequence[str], **kwargs: Any) -> list[Record]:
        self.retrieved.extend(ids)
        return super().retrieve(name, ids, **kwargs)


def _all_chunks(store: Store, name: str) -> dict[str, Chunk]:
    return {p.id: Chunk.from_payload(p.payload) for p in store.scroll(name)}


def test_after_an_edit_the_serving_cache_reads_only_what_the_edit_changed(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    store = CountingStore(tmp_path / "edge")
    first = ingest_documents(
        LoadedCorpus(tuple(_docs(6)), 0, "t"), alias="kb", encoder=tiny_encoder, store=store
    ).collection
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="kb")
    retriever.open_collection("kb")
    before = _all_chunks(store, first)
    assert retriever.chunks(first, sorted(before)) == before
    edit = update_documents(
        _docs(6, edited=2)[2:3],
        ["d4"],
        alias="kb",
        encoder=tiny_encoder,
        store=store,
        rebase_drift=1.0,
    )
    after = _all_chunks(store, edit.collection)
    record = store.record(edit.collection)
    changed = {cid for cid, c in before.items() if c.doc_id in ("d2", "d4")} | {
        cid for cid, c in after.items() if c.doc_id == "d2"
    }
    assert record.lineage.base == first and set(record.lineage.changed or ()) == changed
    retriever.open_collection("kb")  # the serving process sees the alias move
    store.retrieved.clear()
    assert retriever.chunks(edit.collection, sorted(after)) == after  # the new version's own
    assert set(store.retrieved) == set(after) & changed  # d2's new chunks; d4's are gone
    assert store.retrieved


def test_a_delta_past_the_bound_records_no_ids(
    tmp_path: Path, tiny_encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rag_retriever.ingest.writer.CHANGED_IDS_KEPT", 1)
    assert CHANGED_IDS_KEPT > 1
    store = EdgeStore(tmp_path / "edge")
    ingest_documents(
        LoadedCorpus(tuple(_docs(3)), 0, "t"), alias="kb", encoder=tiny_encoder, store=store
    )
    edit = update_documents(_docs(3, edited=1)[1:2], alias="kb", encoder=tiny_encoder, store=store)
    assert store.record(edit.collection).lineage.changed is None
