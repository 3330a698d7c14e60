"""The Python write API (`Collection`): upsert, delete and ingest as the CLI does them, folder ids
that cannot make second documents, provenance kept across replacements, and no model loaded for
a write with nothing to embed.

Oracles: the documents each version must serve (searched back by BM25 and listed by the store),
the CLI's own messages and exit status for the same bad input, and a count of model loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rag_retriever import Collection, DocumentError
from rag_retriever.cli import main
from rag_retriever.ingest.path_ids import alternatives
from rag_retriever.ingest.versions import documents_of
from rag_retriever.models import encoder as encoder_module

RECORDS = [
    {"id": "returns", "title": "Returns", "text": "Items may be returned within thirty days."},
    {"id": "shipping", "title": "Shipping", "text": "Parcels leave the warehouse every morning."},
    {"id": "warranty", "title": "Warranty", "text": "The warranty covers defects for two years."},
]


@pytest.fixture(autouse=True)
def _no_rebase(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few short documents move the average length far: these tests follow deltas, so BM25
    is not re-based with a full build (tests/test_update.py tests the re-base)."""
    monkeypatch.setenv("RAG_BM25_REBASE_DRIFT", "1")


@pytest.fixture
def kb(env: Path) -> Iterator[Collection]:
    collection = Collection.open("kb")
    yield collection
    collection.retriever.store.close()


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each load of an embedding model through load_encoder (the CLI's and Collection's way)."""
    calls: list[str] = []
    real = encoder_module.load_encoder

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("load")
        return real(*args, **kwargs)

    monkeypatch.setattr(encoder_module, "load_encoder", counted)
    return calls


def served(kb: Collection) -> dict[str, Any]:
    """The live version's documents, by id."""
    store = kb.retriever.store
    return {d.id: d for d in documents_of(store, store.resolve("kb")).documents}


def test_ingest_upsert_and_delete_from_python_make_versions_served_by_search(
    kb: Collection,
) -> None:
    first = kb.ingest(RECORDS)
    assert (first.kind, first.version, first.documents, first.promoted) == ("full", 1, 3, True)
    hits = kb.search("warranty defects", k=1, mode="bm25")
    assert hits[0].doc_id == "warranty" and hits.query_id

    second = kb.upsert([{"id": "faq", "text": "Opening hours are nine to five.", "team": "ops"}])
    assert (second.kind, second.version, second.upserted, second.documents) == ("delta", 2, 1, 4)
    assert kb.search("opening hours", k=1, mode="bm25")[0].doc_id == "faq"
    assert served(kb)["faq"].metadata == {"team": "ops"}  # extra fields are metadata

    third = kb.delete(["shipping", "never-there"])
    assert (third.version, third.deleted, third.not_found, third.documents) == (3, 1, 1, 3)
    assert set(served(kb)) == {"returns", "warranty", "faq"}
    assert all(h.doc_id != "shipping" for h in kb.search("parcels warehouse", mode="bm25"))

    # ingest replaces the whole collection: what is not in it goes
    fourth = kb.ingest(RECORDS[:1])
    assert (fourth.kind, fourth.documents) == ("delta", 1)
    assert set(served(kb)) == {"returns"}


def test_a_delete_or_an_unchanged_upsert_loads_no_model(env: Path, loads: list[str]) -> None:
    setup = Collection.open("kb")
    setup.ingest(RECORDS)
    setup.retriever.store.close()
    assert loads == ["load"]

    kb = Collection.open("kb")  # a fresh process's view: nothing loaded yet
    try:
        assert kb.delete("shipping").deleted == 1
        unchanged = kb.upsert(RECORDS[:1])
        assert (unchanged.kind, unchanged.unchanged) == ("unchanged", 1)
        assert loads == ["load"]  # neither loaded the model
        assert kb.retriever._encoder is None

        changed = kb.upsert([{**RECORDS[0], "text": "Items may be returned within sixty days."}])
        assert changed.kind == "delta" and changed.encoded >= 1
        assert loads == ["load", "load"]  # text to embed: now it is loaded, once
        kb.upsert([{**RECORDS[0], "text": "Items may be returned within ninety days."}])
        assert loads == ["load", "load"]
    finally:
        kb.retriever.store.close()


def test_the_cli_delete_loads_no_model(env: Path, loads: list[str], tmp_path: Path) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(__import__("json").dumps(r) for r in RECORDS) + "\n")
    assert main(["ingest", str(docs), "--collection", "kb", "--no-progress"]) == 0
    assert loads == ["load"]
    assert main(["update", "--delete", "returns", "--collection", "kb", "--json"]) == 0
    assert loads == ["load"]


def test_bad_records_are_all_reported_as_the_cli_reports_them_and_nothing_is_written(
    kb: Collection,
) -> None:
    kb.ingest(RECORDS)
    bad: list[Any] = [
        {"id": "no-text"},
        {"id": 3, "text": "a number for an id"},
        {"id": "nan", "text": "fine", "score": math.nan},
        {"id": "returns", "text": "one"},
        {"id": "returns", "text": "twice"},
    ]
    with pytest.raises(DocumentError) as caught:
        kb.upsert(bad)
    message = str(caught.value)
    assert "nothing was ingested" in message
    for where in ("documents[0]", "documents[1]", "documents[2]"):
        assert where in message
    assert "missing required field 'text'" in message
    assert "'returns'" in message and "documents[4]" in message  # the duplicate, both places
    # an emptied document: skipped, its old text would stay served; refused as HTTP refuses it
    with pytest.raises(DocumentError, match=r"documents\[1\] \('returns'\): the document has no"):
        kb.upsert([{"id": "faq", "text": "hours"}, {"id": "returns", "text": "  "}])
    with pytest.raises(DocumentError, match="wrap it in a list"):
        kb.upsert({"id": "x", "text": "y"})  # type: ignore[dict-item]
    with pytest.raises(DocumentError, match="no ids given"):
        kb.delete([])
    assert kb.retriever.store.record(kb.retriever.store.resolve("kb")).version == 1


def test_folder_ids_that_would_duplicate_a_file_are_refused_until_the_root_is_given(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "kb"
    (root / "policies").mkdir(parents=True)
    (root / "policies" / "returns.md").write_text("# Returns\n\nThirty days to return.\n")
    (root / "about.md").write_text("# About\n\nWe sell bicycles.\n")
    assert main(["ingest", str(root), "--collection", "kb", "--no-progress"]) == 0
    (root / "policies" / "returns.md").write_text("# Returns\n\nSixty days to return.\n")

    # the CLI: exit 2, both ids named, the fix given, nothing written
    code = main(["update", "--upsert", str(root / "policies"), "--collection", "kb"])
    err = capsys.readouterr().err
    assert code == 2
    assert "returns.md would be a second document beside policies/returns.md" in err
    assert "--root" in err
    # the root given: the same file, replaced
    capsys.readouterr()
    args = ["update", "--upsert", str(root / "policies"), "--root", str(root), "--json"]
    assert main([*args, "--collection", "kb"]) == 0
    assert '"upserted": 1' in capsys.readouterr().out

    kb = Collection.open("kb")
    try:
        with pytest.raises(DocumentError, match=r"second document beside policies/returns\.md"):
            kb.upsert(root / "policies")
        report = kb.upsert(root / "policies", root=root)
        assert (report.kind, report.unchanged, report.documents) == ("unchanged", 1, 2)
        assert set(served(kb)) == {"about.md", "policies/returns.md"}
        (tmp_path / "elsewhere").mkdir()
        with pytest.raises(DocumentError, match="does not hold"):
            kb.upsert(root / "policies", root=tmp_path / "elsewhere")
        with pytest.raises(DocumentError, match="not a folder"):
            kb.upsert(root / "policies", root=tmp_path / "missing")
    finally:
        kb.retriever.store.close()


def test_a_moved_file_can_be_upserted_with_its_old_id_deleted_in_the_same_update(
    env: Path, tmp_path: Path
) -> None:
    root = tmp_path / "kb"
    (root / "policies").mkdir(parents=True)
    (root / "policies" / "returns.md").write_text("# Returns\n\nThirty days.\n")
    assert main(["ingest", str(root), "--collection", "kb", "--no-progress"]) == 0
    args = ["update", "--upsert", str(root / "policies"), "--delete", "policies/returns.md"]
    assert main([*args, "--collection", "kb"]) == 0


def test_a_replacement_without_the_path_keeps_the_path_ingest_gave_it(
    env: Path, tmp_path: Path
) -> None:
    root = tmp_path / "kb"
    root.mkdir()
    (root / "returns.md").write_text("# Returns\n\nThirty days.\n")
    assert main(["ingest", str(root), "--collection", "kb", "--no-progress"]) == 0
    kb = Collection.open("kb")
    try:
        kb.upsert([{"id": "returns.md", "text": "Sixty days.", "team": "support"}])
        assert served(kb)["returns.md"].metadata == {"team": "support", "path": "returns.md"}
        # a replacement that sets its own path keeps its own
        kb.upsert([{"id": "returns.md", "text": "Ninety days.", "path": "policies/returns.md"}])
        assert served(kb)["returns.md"].metadata == {"path": "policies/returns.md"}
    finally:
        kb.retriever.store.close()


def test_alternative_ids_are_the_same_file_seen_from_other_roots() -> None:
    assert alternatives("returns.md", Path("/srv/kb/policies")) == [
        "kb/policies/returns.md",
        "policies/returns.md",
        "srv/kb/policies/returns.md",
    ]
    assert alternatives("kb/policies/returns.md", Path("/srv")) == [
        "policies/returns.md",
        "returns.md",
        "srv/kb/policies/returns.md",
    ]


def test_a_delete_of_ids_that_are_not_strings_is_a_document_error(env: Path) -> None:
    """An int among the ids was a TypeError from sorting; a None tenant passed unchecked."""
    kb = Collection.open("kb")
    try:
        kb.ingest(RECORDS)
        with pytest.raises(DocumentError, match=r"pair of strings, got \('', 1\)"):
            kb.delete(["shipping", 1])  # type: ignore[list-item]
        with pytest.raises(DocumentError, match="tenant is a name"):
            kb.delete(["shipping"], tenant=None)  # type: ignore[arg-type]
        # the trace of an evaluation takes a filter's dict form, as search does
        name, traces = kb.retriever.trace(
            ["returned within days"], mode="bm25", filter={"doc_ids": ["returns"]}
        )
        assert {cid for cid, _ in traces[0].bm25 or []} and all(
            kb.retriever.chunks(name, [cid])[cid].doc_id == "returns"
            for cid, _ in traces[0].bm25 or []
        )
    finally:
        kb.retriever.store.close()
