"""Document loading: valid inputs, and every kind of bad input named with file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.loaders import load_documents
from rag_retriever.errors import DocumentError
from tests.conftest import shared_data, write_jsonl


def test_jsonl_keeps_extra_fields_as_metadata(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": "a", "title": "A", "text": "alpha", "lang": "en", "year": 2020},
            {"id": "b", "text": "bravo"},
        ],
    )
    corpus = load_documents(path)
    a, b = corpus.documents
    assert (a.id, a.title, a.text, dict(a.metadata)) == (
        "a",
        "A",
        "alpha",
        {"lang": "en", "year": 2020},
    )
    assert b.title == "b"  # no title: the id stands in
    assert corpus.skipped_empty == 0


def test_empty_documents_are_skipped_and_counted(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "a", "text": "alpha"}, {"id": "b", "text": "  \n "}, {"id": "c", "text": ""}],
    )
    corpus = load_documents(path)
    assert [d.id for d in corpus.documents] == ["a"]
    assert corpus.skipped_empty == 2


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"id": "x", "text": ', "d.jsonl:2: malformed JSON"),
        ('{"title": "t", "text": "x"}', "d.jsonl:2: missing required field 'id'"),
        ('{"id": "x"}', "d.jsonl:2: missing required field 'text'"),
        ('{"id": 7, "text": "x"}', "d.jsonl:2: field 'id' must be a string, got int"),
        ('{"id": "x", "text": ["a"]}', "d.jsonl:2: field 'text' must be a string, got list"),
        ('{"id": "x", "title": null, "text": "a"}', "d.jsonl:2: field 'title' must be a string"),
        ('["id", "text"]', "d.jsonl:2: expected a JSON object, got list"),
    ],
)
def test_bad_jsonl_lines_are_named(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "ok", "text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DocumentError, match=expected.replace("[", r"\[")) as info:
        load_documents(path)
    assert "nothing was ingested" in str(info.value)


def test_duplicate_ids_are_listed_with_their_lines(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "a", "text": "1"}, {"id": "b", "text": "2"}, {"id": "a", "text": "3"}],
    )
    with pytest.raises(DocumentError) as info:
        load_documents(path)
    message = str(info.value)
    assert "duplicate id 'a' (2 times" in message
    assert "d.jsonl:1" in message and "d.jsonl:3" in message


def test_undecodable_bytes_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n')
    with pytest.raises(DocumentError, match=r"d.jsonl:2: not valid UTF-8"):
        load_documents(path)


def test_all_problems_are_reported_together(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1, "text": "a"}\nnot json\n{"id": "c"}\n', encoding="utf-8")
    with pytest.raises(DocumentError, match=r"3 problem\(s\)"):
        load_documents(path)


def test_directory_titles_ids_and_skips(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "guide.md").write_text(
        "Intro line\n\n## Getting started\n\nBody.\n", encoding="utf-8"
    )
    (tmp_path / "sub" / "notes.txt").write_text("plain text notes", encoding="utf-8")
    (tmp_path / "empty.md").write_text("\n\n", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    corpus = load_documents(tmp_path)
    by_id = {d.id: d for d in corpus.documents}
    assert set(by_id) == {"guide.md", "sub/notes.txt"}
    assert by_id["guide.md"].title == "Getting started"
    assert by_id["sub/notes.txt"].title == "notes"
    assert corpus.skipped_empty == 1


def test_directory_with_bad_bytes_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "bad.md").write_bytes(b"# Title\n\nline two\n\xff\xfe\n")
    with pytest.raises(DocumentError, match=r"bad.md:4: not valid UTF-8"):
        load_documents(tmp_path)


@pytest.mark.parametrize("name", ["missing.jsonl", "file.csv"])
def test_unsupported_or_missing_input(tmp_path: Path, name: str) -> None:
    if name.endswith(".csv"):
        (tmp_path / name).write_text("a,b\n", encoding="utf-8")
    with pytest.raises(DocumentError):
        load_documents(tmp_path / name)


@pytest.mark.data
def test_shared_squad_docs_load() -> None:
    corpus = load_documents(shared_data("squad_v11_dev", "docs.jsonl"))
    assert len(corpus.documents) == 48
