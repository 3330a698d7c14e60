"""The server path's versions: filters over one physical collection, so an edit writes what it
changes (rag_retriever/store/server.py).

Oracles: a model of what each version must serve (the documents written into it, by id and
text), the points each engine call writes (a spy on the client, counting them), and the points
the physical collection may hold (those some kept version sees). Runs on qdrant-client's
in-process implementation of the server API: there is no Qdrant server on this machine.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import QdrantClient

from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents, update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.store import ServerStore
from rag_retriever.store.catalog import apply_retention, promote_version, rollback
from rag_retriever.store.server import CATALOG, WHERE_SUFFIX
from rag_retriever.store.server_terms import TERMS_SUFFIX
from tests.test_update import WORDS


def doc(i: int, rng: random.Random, tag: str = "") -> Document:
    return Document(f"d{i}", f"doc {i}", " ".join(rng.choice(WORDS) for _ in range(6)) + tag)


def write(store: ServerStore, encoder: Encoder, tmp_path: Path, docs: list[Document], **kw: Any):
    kw.setdefault("lock_dir", tmp_path)
    kw.setdefault("retention_grace_s", 0)
    return ingest_documents(
        LoadedCorpus(tuple(docs), 0, "t"), alias="kb", encoder=encoder, store=store, **kw
    )


def edit(store: ServerStore, encoder: Encoder, tmp_path: Path, upsert=(), delete=(), **kw: Any):
    kw.setdefault("lock_dir", tmp_path)
    kw.setdefault("retention_grace_s", 0)
    kw.setdefault("rebase_drift", 1.0)  # these tests follow deltas
    return update_documents(
        list(upsert), list(delete), alias="kb", encoder=encoder, store=store, **kw
    )


def served(store: ServerStore, name: str) -> dict[str, str]:
    """{doc id: its text} of what version `name` serves (one chunk a document here)."""
    texts = {str(r.payload["doc_id"]): str(r.payload["text"]) for r in store.scroll(name)}
    assert store.count(name) == len(texts) == store.record(name).chunks
    return texts


def expected(docs: dict[str, Document]) -> dict[str, str]:
    return {d.id: d.text for d in docs.values()}


def terms_of(store: ServerStore, name: str) -> dict[str, Any]:
    """A version's BM25 table and changes, as its catalog entry holds them."""
    found = store._catalog_get("version", name, ("terms",))
    assert found is not None
    return dict(found["terms"])


def physical_points(store: ServerStore, suffix: str = "__points") -> int:
    return sum(
        store.client.count(c.name, exact=True).count
        for c in store.client.get_collections().collections
        if c.name != CATALOG and c.name.endswith(suffix)
    )


@pytest.fixture
def server() -> Iterator[ServerStore]:
    store = ServerStore(QdrantClient(":memory:"))
    yield store
    store.close()


class Writes:
    """A spy on the client's write calls: how many points each writes, data and catalog apart."""

    def __init__(self, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.points = 0
        self.terms = 0  # BM25 table points
        self.catalog = 0
        self.copied_reads = 0
        for method, count in (
            ("upsert", lambda kw: len(kw["points"])),
            ("set_payload", lambda kw: len(kw["points"])),
            (
                "delete",
                lambda kw: (
                    len(kw["points_selector"]) if isinstance(kw["points_selector"], list) else 0
                ),
            ),
        ):
            self._wrap(client, method, count, monkeypatch)
        real_scroll = client.scroll

        def scroll(collection: str, *args: Any, **kw: Any) -> Any:
            self.copied_reads += bool(kw.get("with_vectors"))
            return real_scroll(collection, *args, **kw)

        monkeypatch.setattr(client, "scroll", scroll)

    def _wrap(self, client: Any, method: str, count: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        real = getattr(client, method)

        def spy(collection: str, *args: Any, **kw: Any) -> Any:
            if collection == CATALOG:
                self.catalog += 1
            elif collection.endswith(TERMS_SUFFIX):
                self.terms += count(kw)
            else:
                self.points += count(kw)
            return real(collection, *args, **kw)

        monkeypatch.setattr(client, method, spy)


@pytest.mark.parametrize("size", [40, 400])
def test_a_ten_document_edit_writes_what_it_changes_whatever_the_corpus_size(
    size: int,
    server: ServerStore,
    tiny_encoder: Encoder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(3)
    corpus = {f"d{i}": doc(i, rng) for i in range(size)}
    first = write(server, tiny_encoder, tmp_path, list(corpus.values()))
    before = served(server, first.collection)
    changed = [doc(i, rng, " changed") for i in range(5)] + [doc(size + i, rng) for i in range(3)]
    writes = Writes(server.client, monkeypatch)
    report = edit(server, tiny_encoder, tmp_path, changed, ["d10", "d11"])
    assert report.kind == "delta" and report.upserted == 8 and report.deleted == 2
    corpus.update({d.id: d for d in changed})
    del corpus["d10"], corpus["d11"]
    assert served(server, report.collection) == expected(corpus)
    # 8 chunks added, 7 marked removed (5 replaced, 2 deleted), and the 8 chunk ids' "where"
    # points (the versions that wrote them): never the corpus, never copied
    assert writes.points == 8 + 7 + 8 and writes.copied_reads == 0
    # BM25: the changed terms' frequencies go in the version's catalog entry, on the table it
    # shares; in the small corpus they pass a quarter of its vocabulary: a new table
    terms = terms_of(server, report.collection)
    if size == 400:
        assert terms["changes"] and terms["table"] == first.collection and writes.terms == 0
    else:
        assert not terms["changes"] and terms["table"] == report.collection
        assert writes.terms == terms["table_size"] == terms["size"]  # one point a term here
    assert writes.points <= 10 * 10
    assert writes.catalog <= 12  # the version's record, frequencies, counter, alias
    assert served(server, first.collection) == before  # the base serves what it served
    assert physical_points(server) == size + 8  # one collection, the base's points shared
    assert physical_points(server, WHERE_SUFFIX) == 8  # the ids a derived version wrote


def test_a_reader_of_the_base_never_sees_a_delta_being_written(
    server: ServerStore, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    rng = random.Random(5)
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    first = write(server, tiny_encoder, tmp_path, list(corpus.values()))
    before = served(server, first.collection)
    retriever = Retriever(encoder=tiny_encoder, store=server, collection="kb")
    hits = [h.doc_id for h in retriever.search("alpha bravo", k=10, mode="bm25")]
    # a delta written but not promoted
    report = edit(
        server, tiny_encoder, tmp_path, [doc(1, rng, " new"), doc(99, rng)], ["d2"], promote=False
    )
    assert report.kind == "delta" and not report.promoted
    assert served(server, first.collection) == before
    assert [h.doc_id for h in retriever.search("alpha bravo", k=10, mode="bm25")] == hits
    assert server.aliases()["kb"] == first.collection
    assert "d99" in served(server, report.collection) and "d2" not in served(
        server, report.collection
    )


def test_rollback_then_an_edit_forks_and_every_version_keeps_what_it_served(
    server: ServerStore, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """v1 full; v2 changes d0; rollback to v1; v3 (from v1) changes d1 and deletes d0: v3 sees
    v1's d0 gone and never v2's text of it; v2 still serves its own. Then retention deletes v2
    and the points only it saw."""
    rng = random.Random(7)
    corpus = {f"d{i}": doc(i, rng) for i in range(12)}
    v1 = write(server, tiny_encoder, tmp_path, list(corpus.values()), keep_versions=5)
    model = {v1.collection: expected(corpus)}
    two = dict(corpus, d0=doc(0, rng, " two"))
    v2 = edit(server, tiny_encoder, tmp_path, [two["d0"]], keep_versions=5)
    model[v2.collection] = expected(two)
    assert rollback(server, "kb") == v1.collection
    three = dict(corpus, d1=doc(1, rng, " three"))
    del three["d0"]
    v3 = edit(server, tiny_encoder, tmp_path, [three["d1"]], ["d0"], keep_versions=5)
    assert v3.base == v1.collection
    model[v3.collection] = expected(three)
    four = dict(three, d5=doc(5, rng, " four"))
    v4 = edit(server, tiny_encoder, tmp_path, [four["d5"]], keep_versions=5)
    model[v4.collection] = expected(four)
    for name, texts in model.items():
        assert served(server, name) == texts, name
    promote_version(server, "kb", v2.version)  # a forked version is still served whole
    assert served(server, server.aliases()["kb"]) == model[v2.collection]
    promote_version(server, "kb", v4.version)
    deleted = apply_retention(server, "kb", keep=1, grace_s=0)
    assert sorted(deleted) == sorted([v1.collection, v2.collection, v3.collection])
    assert served(server, v4.collection) == model[v4.collection]
    assert physical_points(server) == len(model[v4.collection])  # nothing no version sees


def test_a_collection_made_before_where_points_is_still_edited_right(
    server: ServerStore, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.4 made no "where" collection: its versions are looked up and marked by filter, and the
    versions derived from them too; a new build gets one, and an edit then scans no points."""
    rng = random.Random(11)
    corpus = {f"d{i}": doc(i, rng) for i in range(12)}
    v1 = write(server, tiny_encoder, tmp_path, list(corpus.values()))
    physical = server._entry(v1.collection).physical
    # as 0.4 left it: no "where" or "__terms" collection, the frequencies whole in the entry
    freqs = dict(server.doc_freqs(v1.collection).items())
    server.client.delete_collection(physical + WHERE_SUFFIX)
    server.client.delete_collection(physical + TERMS_SUFFIX)
    server._catalog_set(
        v1.collection,
        {"located": False, "terms": None, "terms_table": None, "doc_freqs": freqs, "points": None},
    )
    server._entries.clear()
    for i in range(2):
        new = [doc(1, rng, f" v{i}"), doc(20 + i, rng)]
        changed = dict(corpus) | {d.id: d for d in new}
        del changed[f"d{2 + i}"]
        report = edit(server, tiny_encoder, tmp_path, new, [f"d{2 + i}"])
        corpus = changed
        assert not server._entry(report.collection).located
        assert served(server, report.collection) == expected(corpus)
    # a full build of today makes the "where" collection, and an edit then reads points by id
    rebuilt = write(server, tiny_encoder, tmp_path, list(corpus.values()), full=True)
    assert server._entry(rebuilt.collection).located
    scans: list[str] = []
    real = {method: getattr(server.client, method) for method in ("scroll", "count")}

    def spy(method: str) -> Any:
        def call(collection: str, *args: Any, **kw: Any) -> Any:
            if collection.endswith("__points"):  # (a new BM25 table reads the old one)
                scans.append(method)
            return real[method](collection, *args, **kw)

        return call

    for method in real:
        monkeypatch.setattr(server.client, method, spy(method))
    changed = dict(corpus, d1=doc(1, rng, " again"))
    report = edit(server, tiny_encoder, tmp_path, [changed["d1"]], ["d5"])
    # the live chunks and the marks read by id; the count kept from the writes
    assert scans == []
    for method, call in real.items():
        monkeypatch.setattr(server.client, method, call)
    del changed["d5"]
    assert served(server, report.collection) == expected(changed)


def test_a_derived_version_counts_what_it_holds_when_a_write_is_tried_again(
    server: ServerStore,
) -> None:
    """The count a derived version keeps from its writes (its parent's, less what it marks,
    plus what it adds) equals the points its filter matches, with a batch written twice (a
    retried call) and ids old and new in it."""
    import numpy as np

    from rag_retriever.models.bm25 import BM25Model
    from rag_retriever.store.record import bare_record

    model = BM25Model.build([["a"], ["b"]])

    def write(name: str, ids: list[str]) -> None:
        server.upsert(
            name,
            ids,
            np.ones((len(ids), 4), dtype=np.float32),
            [model.document_vector(["a"]) for _ in ids],
            [{"doc_id": i} for i in ids],
        )

    ids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(6)]
    server.create("t__x__v1", 4, bare_record("t__x__v1", dim=4, bm25=model.stats))
    write("t__x__v1", ids[:4])
    server.seal("t__x__v1", {})
    server.derive(
        "t__x__v2", "t__x__v1", bare_record("t__x__v2", dim=4, bm25=model.stats), [ids[0]]
    )
    for _ in range(2):
        write("t__x__v2", [ids[1], ids[4]])
    write("t__x__v2", [ids[1], ids[5]])
    server.seal("t__x__v2", {})
    kept = server.count("t__x__v2")
    assert kept == server._count(server._entry("t__x__v2")) == 5  # ids 1-5
    assert server.count("t__x__v1") == 4


def test_a_bm25_table_goes_with_the_last_version_naming_it(
    server: ServerStore, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A small edit layers its frequencies on the table; one past a quarter of the vocabulary
    writes a new table; once retention has deleted every version naming the old one, its
    points go. Each version's BM25 is checked against rank-bm25 elsewhere (test_update.py)."""
    rng = random.Random(13)
    corpus = {f"d{i}": doc(i, rng) for i in range(200)}
    v1 = write(server, tiny_encoder, tmp_path, list(corpus.values()), keep_versions=5)
    physical = server._entry(v1.collection).physical

    def table_points(table: str) -> int:
        from qdrant_client import models as qm

        match = qm.FieldCondition(key="table", match=qm.MatchValue(value=table))
        return server.client.count(
            physical + TERMS_SUFFIX, count_filter=qm.Filter(must=[match]), exact=True
        ).count

    assert table_points(v1.collection) == terms_of(server, v1.collection)["table_size"] > 0
    v2 = edit(server, tiny_encoder, tmp_path, [doc(1, rng, " two")], keep_versions=5)
    assert (
        terms_of(server, v2.collection)["table"] == v1.collection
        and terms_of(server, v2.collection)["changes"]
    )
    # most documents rewritten with new words: past a quarter of the vocabulary
    new_words = [doc(i, rng, f" zz{i} yy{i}") for i in range(150)]
    v3 = edit(server, tiny_encoder, tmp_path, new_words, keep_versions=5)
    assert terms_of(server, v3.collection)["table"] == v3.collection
    assert table_points(v3.collection) > 0 and table_points(v1.collection) > 0
    deleted = apply_retention(server, "kb", keep=1, grace_s=0)
    assert sorted(deleted) == sorted([v1.collection, v2.collection])
    assert table_points(v1.collection) == 0 and table_points(v3.collection) > 0


def test_a_number_once_given_is_never_given_again(
    server: ServerStore, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A deleted version's removal marks stay on points: its number must not name a new one."""
    rng = random.Random(9)
    corpus = {f"d{i}": doc(i, rng) for i in range(6)}
    v1 = write(server, tiny_encoder, tmp_path, list(corpus.values()))
    v2 = edit(server, tiny_encoder, tmp_path, [], ["d3"], promote=False)
    server.delete(v2.collection)  # as orphan removal would
    assert server.next_version("kb") == v2.version + 1
    v3 = edit(server, tiny_encoder, tmp_path, [doc(7, rng)])
    assert v3.version == v2.version + 1 and v3.base == v1.collection
    assert set(served(server, v3.collection)) == set(corpus) | {"d7"}  # d3 is back


# -- SIGKILL ------------------------------------------------------------------------------------

KILLABLE = """
import signal, sys, time, pathlib
from qdrant_client import QdrantClient
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.writer import update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.store import ServerStore
method, nth, when, root, model, change = sys.argv[1:7]
calls = []
original = getattr(ServerStore, method)
def wrapped(self, *args, **kwargs):
    calls.append(method)
    if when == "before" and len(calls) == int(nth):
        print("kill-point", file=sys.stderr, flush=True); time.sleep(3600)
    out = original(self, *args, **kwargs)
    if when == "after" and len(calls) == int(nth):
        print("kill-point", file=sys.stderr, flush=True); time.sleep(3600)
    return out
setattr(ServerStore, method, wrapped)
store = ServerStore(QdrantClient(path=root))
docs = load_documents(pathlib.Path(change)).documents
update_documents(
    docs, ["d20"], alias="kb", encoder=Encoder.load(model, device="cpu"), store=store,
    lock_dir=pathlib.Path(root).parent, keep_versions=1, retention_grace_s=0, rebase_drift=1.0,
)
print("finished", file=sys.stderr, flush=True)
"""

# (the ServerStore call, which call of it, before or after it, whether the alias moved then)
SERVER_KILL_POINTS = [
    ("derive", 1, "after", False),  # the catalog point written, removals marked
    ("_mark_removed", 1, "before", False),  # the catalog point written, nothing marked
    ("_note_writer", 1, "after", False),  # the "where" points written, not the points
    ("upsert", 1, "after", False),  # the delta's points written
    ("seal", 1, "after", False),  # still building
    ("point_alias", 1, "after", True),  # served; the old version not yet retired
    ("_sweep", 1, "before", True),  # compaction: the old version's catalog point gone, its
    # points not yet deleted
]


@pytest.mark.slow
def test_sigkill_at_each_step_of_a_server_edit_and_its_compaction_keeps_a_complete_version(
    tiny_encoder_dir: Path, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A real process writing an edit on the server path, SIGKILLed at each step: the served
    version stays complete, and the next edit succeeds and removes what the killed one left."""
    root = tmp_path / "qdrant"
    rng = random.Random(11)
    corpus = {f"d{i}": doc(i, rng) for i in range(40)}
    store = ServerStore(QdrantClient(path=str(root)))
    write(store, tiny_encoder, tmp_path, list(corpus.values()), keep_versions=1)
    store.close()
    for i, (method, nth, when, moved) in enumerate(SERVER_KILL_POINTS):
        store = ServerStore(QdrantClient(path=str(root)))
        before = store.aliases()["kb"]
        store.close()
        change = tmp_path / f"change{i}.jsonl"
        change.write_text(f'{{"id": "n{i}", "title": "t", "text": "new {i} alpha"}}\n')
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                KILLABLE,
                method,
                str(nth),
                when,
                str(root),
                str(tiny_encoder_dir),
                str(change),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "RAG_LOG_LEVEL": "WARNING"},
        )
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.strip() in ("kill-point", "finished"):
                break
        assert lines and lines[-1].strip() == "kill-point", "".join(lines[-20:])
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        store = ServerStore(QdrantClient(path=str(root)))
        now = store.aliases()["kb"]
        assert (now != before) == moved, method
        record = store.record(now)
        assert record.status == "complete"
        assert len(served(store, now)) == record.chunks
        assert (f"n{i}" in served(store, now)) == moved
        # the next edit succeeds, removes what the killed one left, and leaves only the points
        # the one kept version sees
        report = edit(store, tiny_encoder, tmp_path, [doc(100 + i, rng)], keep_versions=1)
        assert report.promoted and f"d{100 + i}" in served(store, report.collection)
        assert [v.name for v in store.versions("kb")] == [report.collection]
        assert physical_points(store) == store.count(report.collection)
        store.close()
