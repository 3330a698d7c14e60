"""Document loading: valid inputs, and every kind of bad input named with file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from rag_retriever.errors import DocumentError
from rag_retriever.ingest.loaders import HIDDEN, load_documents
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


def minimal_pdf(pages: list[str], title: str = "Manual") -> bytes:
    """A valid PDF with one line of Helvetica text per page, built by hand (offsets and all)."""
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [{}] /Count {} >>".format(
            " ".join(f"{4 + 2 * i} 0 R" for i in range(len(pages))), len(pages)
        ),
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, text in enumerate(pages):
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET"
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>"
        )
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
    objects.append(f"<< /Title ({title}) >>")
    out = b"%PDF-1.4\n"
    offsets = []
    for n, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{n} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += (
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R /Info {len(objects)} 0 R >>\n"
        f"startxref\n{xref}\n%%EOF\n"
    ).encode()
    return out


def test_html_and_pdf_files_are_loaded_with_titles_and_page_offsets(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_text(
        "<html><head><title>Install  guide</title><style>p{x:1}</style></head><body>"
        "<h1>Install</h1><p>Run <b>make</b> demo.</p><script>var secret=1</script>"
        "<p>Then &amp; search.</p></body></html>",
        encoding="utf-8",
    )
    (tmp_path / "manual.pdf").write_bytes(minimal_pdf(["Rivers run to the sea.", "Page two."]))
    corpus = load_documents(tmp_path)
    pdf, html = sorted(corpus.documents, key=lambda d: d.id)
    assert html.title == "Install guide"
    assert html.text == "Install\n\nRun make demo.\n\nThen & search."
    assert "secret" not in html.text and "x:1" not in html.text
    assert pdf.title == "Manual" and pdf.metadata["pages"] == 2
    starts = pdf.metadata["page_starts"]
    assert pdf.text[starts[0] :].startswith("Rivers run to the sea.")
    assert pdf.text[starts[1] :] == "Page two."


def test_folder_reports_skipped_types_and_refuses_symlinks_that_leave_it(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.md").write_text("# A\n\nalpha", encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG")
    (root / "notes").write_text("no suffix", encoding="utf-8")
    (root / "inside.md").symlink_to(root / "a.md")  # stays inside: fine
    secret = tmp_path / "secret.md"
    secret.write_text("password", encoding="utf-8")
    (root / "passwd.md").symlink_to(secret)
    with pytest.raises(DocumentError, match="outside") as refused:
        load_documents(root)
    assert "passwd.md" in str(refused.value) and "--follow-symlinks" in str(refused.value)
    corpus = load_documents(root, follow_symlinks=True)
    assert sorted(d.id for d in corpus.documents) == ["a.md", "inside.md", "passwd.md"]
    assert corpus.skipped_files == {".png": 1, "no suffix": 1}


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([{"id": "a", "text": "bad \ud800 text"}], "not valid Unicode"),
        ([{"id": "a", "text": "fine", 'page "n"': 3}], "cannot be filtered on"),
        ([{"id": "a", "text": ""}, {"id": "b", "text": "  "}], "no document with text"),
        ([], "no document with text"),
    ],
)
def test_bad_text_and_empty_corpora_are_one_clear_error(
    tmp_path: Path, rows: list[dict[str, object]], expected: str
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DocumentError, match=expected):
        load_documents(path)


def test_folder_of_empty_files_and_oversized_documents(tmp_path: Path) -> None:
    (tmp_path / "empty.md").write_text("   ", encoding="utf-8")
    with pytest.raises(DocumentError, match="no document with text"):
        load_documents(tmp_path)
    (tmp_path / "big.md").write_text("word " * 100, encoding="utf-8")
    with pytest.raises(DocumentError, match="over the limit of 100"):
        load_documents(tmp_path, max_chars=100)


def test_a_linked_folder_leading_out_is_counted_in_the_skipped_report(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.md").write_text("# A\n\nalpha", encoding="utf-8")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "b.md").write_text("# B\n\nbeta", encoding="utf-8")
    (root / "linked").symlink_to(outside, target_is_directory=True)
    corpus = load_documents(root)
    assert [d.id for d in corpus.documents] == ["a.md"]
    assert corpus.skipped_files == {"link to a folder outside": 1}


@pytest.mark.parametrize(
    "rows",
    [
        [{"id": "a", "title": "the", "text": "the of and"}],
        [{"id": "a", "text": "s t"}, {"id": "b", "title": "The", "text": "... ,,, !"}],
    ],
)
def test_a_corpus_with_no_word_to_index_is_refused(
    tmp_path: Path, rows: list[dict[str, object]]
) -> None:
    with pytest.raises(DocumentError, match="no document has a word to index"):
        load_documents(write_jsonl(tmp_path / "d.jsonl", rows))


def test_a_folder_whose_only_file_holds_a_stop_word_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s.md").write_text("# S", encoding="utf-8")
    with pytest.raises(DocumentError, match="no document has a word to index"):
        load_documents(tmp_path)
    (tmp_path / "t.md").write_text("# Tea\n\nGreen tea.", encoding="utf-8")
    assert len(load_documents(tmp_path).documents) == 2  # one indexable document is enough


# -- the rules every path shares (rag_retriever/ingest/validation.py, issue 39) -----------------


def _nested(levels: int, inner: object = 1) -> object:
    for _ in range(levels):
        inner = [inner]
    return inner


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"k": float("nan")}, "metadata['k'] is nan; metadata numbers must be finite"),
        ({"k": [1, float("-inf")]}, "metadata['k'][1] is -inf"),
        ({"k": "\ud800"}, "metadata['k'] is not valid Unicode (lone surrogate at 0)"),
        ({"k": {"\udc80x": 1}}, "metadata['k'] has the key '\\udc80x'"),
        ({"k": {1: "a"}}, "metadata['k'] has the key 1"),
        ({"\ud800": 1}, "metadata field name '\\ud800' cannot be filtered on"),
        ({"": 1}, "metadata field name '' cannot be filtered on"),
        ({'a"b': 1}, "cannot be filtered on"),
        ({"k": _nested(200)}, "nests deeper than 16 levels (MAX_METADATA_DEPTH"),
        ({"k": _nested(16)}, "nests deeper than 16 levels"),  # 17 with the metadata object
        ({"k": 2**53}, "outside ±9007199254740991"),
        ({"k": -(2**53)}, "outside ±9007199254740991"),
        ({"k": {1, 2}}, "metadata['k'] is a set; metadata values must be a string, finite number"),
        ({"k": b"raw"}, "is a bytes"),
        ({"k": object()}, "is a object"),
        ({"k": "x" * 70_000}, "over the limit of 65,536 (MAX_METADATA_BYTES"),
        ([("k", 1)], "metadata must be an object of field: value, got list"),
    ],
)
def test_metadata_the_engine_cannot_store_or_filter_is_named(
    metadata: object, expected: str
) -> None:
    from rag_retriever.ingest.validation import metadata_problems

    problems = metadata_problems(metadata)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "metadata",
    [
        {},
        {"k": None, "b": True, "i": 2**53 - 1, "j": -(2**53 - 1), "f": 1e308, "z": -0.0},
        {"k": _nested(13, {"leaf": ["a", 1.5, None]})},  # exactly 16 levels
        {"path": "a.md", "pages": 2, "page_starts": [0, 120]},  # a PDF's
        {"k": ("a", "b")},  # a tuple is written as a JSON array
        {"k": "x" * (64 * 1024 - 8)},  # exactly MAX_METADATA_BYTES as compact JSON
        {"é 名": {'nested key with " and \\': "fine below the top level"}},
    ],
)
def test_metadata_within_the_rules_passes(metadata: dict) -> None:
    from rag_retriever.ingest.validation import metadata_problems

    assert metadata_problems(metadata) == []


def test_a_jsonl_file_is_refused_by_the_same_rules_as_the_http_writes(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [
        '{"id": "ok", "text": "alpha"}',
        '{"id": "nan", "text": "alpha", "score": NaN}',
        '{"id": "inf", "text": "alpha", "score": [Infinity]}',
        '{"id": "sur", "text": "alpha", "tag": "\\ud800"}',
        '{"id": "deep", "text": "alpha", "k": ' + "[" * 200 + "]" * 200 + "}",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DocumentError) as caught:
        load_documents(path)
    message = str(caught.value)
    assert message.startswith("4 problem(s) in") and "nothing was ingested" in message
    for expected in (
        "d.jsonl:2: metadata['score'] is nan",
        "d.jsonl:3: metadata['score'][0] is inf",
        "d.jsonl:4: metadata['tag'] is not valid Unicode",
        "d.jsonl:5: metadata['k']",
    ):
        assert expected in message, message


def test_documents_and_ids_from_python_get_the_same_checks() -> None:
    from rag_retriever.ingest.validation import validate_delete_ids, validate_documents
    from rag_retriever.records import Document

    docs = [
        Document("a", "A", "alpha", {"k": float("nan")}),
        Document("b", "B", 42, {}),  # type: ignore[arg-type]
        Document("c", "C", "   "),
    ]
    with pytest.raises(DocumentError) as caught:
        validate_documents(docs, source="docs")
    message = str(caught.value)
    assert "docs[0] (id 'a'): metadata['k'] is nan" in message
    assert "docs[1] (id 'b'): field 'text' must be a string, got int" in message
    assert "docs[2] (id 'c'): the document has no text" in message
    validate_documents(docs[2:], source="corpus", allow_empty_text=True)  # a corpus may hold one
    with pytest.raises(DocumentError, match=r"ids\[1\]: id '\\ud800' is not valid Unicode"):
        validate_delete_ids(["a", "\ud800", "b"], source="ids")
    with pytest.raises(DocumentError, match=r"ids\[0\]: '' is not a document id"):
        validate_delete_ids([""], source="ids")
    validate_delete_ids(["a", "é"], source="ids")


# -- found by a review of the ingest path (2026-12-07) ------------------------------------------


def test_a_folder_that_cannot_be_read_is_a_problem_not_a_silent_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pathlib's rglob skips a folder it may not list without a word, so a re-ingest would have
    deleted every document under it. The tests run as root, which reads any folder: the
    permission error is raised by a patched os.scandir for that one folder."""
    import os

    from rag_retriever.ingest import loaders

    root = tmp_path / "kb"
    (root / "sub").mkdir(parents=True)
    (root / "a.md").write_text("# A\n\nalpha", encoding="utf-8")
    (root / "sub" / "b.md").write_text("# B\n\nbeta", encoding="utf-8")
    assert sorted(d.id for d in load_documents(root).documents) == ["a.md", "sub/b.md"]
    real = os.scandir

    def scandir(path: Any) -> Any:
        if Path(path).name == "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(loaders.os, "scandir", scandir)
    with pytest.raises(DocumentError, match=r"sub: cannot read this folder \(Permission denied\)"):
        load_documents(root)


def test_a_file_that_cannot_be_read_is_a_named_problem(tmp_path: Path) -> None:
    """A read that fails (here /proc/self/mem, which answers EIO) is a problem naming the file,
    not a traceback."""
    root = tmp_path / "kb"
    root.mkdir()
    (root / "a.md").write_text("# A\n\nalpha", encoding="utf-8")
    (root / "mem.md").symlink_to("/proc/self/mem")
    with pytest.raises(DocumentError, match=r"mem\.md: cannot read this file"):
        load_documents(root, follow_symlinks=True)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"id": "a", "text": "x", "n": ' + "9" * 5000 + "}", "malformed JSON (Exceeds"),
        (
            '{"id": "a", "text": "x", "m": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "malformed JSON (nested too deeply",
        ),
    ],
    ids=["huge-integer", "deep-nesting"],
)
def test_json_python_cannot_convert_is_a_named_problem(
    tmp_path: Path, line: str, expected: str
) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(DocumentError, match=re.escape(f"docs.jsonl:1: {expected}")):
        load_documents(path)


def test_a_byte_order_mark_is_not_text(tmp_path: Path) -> None:
    """Editors on Windows save UTF-8 with a byte order mark: a .jsonl's first line still parses,
    and a markdown file's first heading is still its title."""
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "text": "alpha"}).encode() + b"\n")
    assert [d.id for d in load_documents(path).documents] == ["a"]
    root = tmp_path / "kb"
    root.mkdir()
    (root / "a.md").write_bytes("\ufeff# Real Title\n\nalpha beta".encode())
    doc = load_documents(root).documents[0]
    assert doc.title == "Real Title" and not doc.text.startswith("\ufeff")


def test_titles_keep_a_closing_hash_and_skip_code_blocks(tmp_path: Path) -> None:
    root = tmp_path / "kb"
    root.mkdir()
    (root / "c.md").write_text("# Intro to C#\n\n## F#\n\ntext\n\n## Done ##\n", encoding="utf-8")
    (root / "fenced.md").write_text(
        "Setup notes.\n\n```sh\n# install deps\n```\n\n# The Real Title\n\nbody", encoding="utf-8"
    )
    (root / "none.md").write_text("```\n# not a title\n```\n\nbody", encoding="utf-8")
    docs = {d.id: d for d in load_documents(root).documents}
    assert docs["c.md"].title == "Intro to C#"
    assert [h.text for h in docs["c.md"].headings] == ["F#", "Done"]
    assert docs["fenced.md"].title == "The Real Title"
    assert docs["none.md"].title == "none"


def test_follow_symlinks_enters_a_linked_folder_outside_once(tmp_path: Path) -> None:
    """`--follow-symlinks` ingests what a folder links to outside itself, folders included (the
    help says so); a link back into the folder, or a second link to the same folder, is not
    entered again."""
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.md").write_text("# A\n\nalpha", encoding="utf-8")
    outside = tmp_path / "elsewhere"
    (outside / "deep").mkdir(parents=True)
    (outside / "b.md").write_text("# B\n\nbeta", encoding="utf-8")
    (outside / "deep" / "c.md").write_text("# C\n\ngamma", encoding="utf-8")
    (outside / "loop").symlink_to(outside, target_is_directory=True)
    (outside / "home").symlink_to(root, target_is_directory=True)
    (root / "linked").symlink_to(outside, target_is_directory=True)
    corpus = load_documents(root, follow_symlinks=True)
    assert sorted(d.id for d in corpus.documents) == [
        "a.md",
        "linked/b.md",
        "linked/deep/c.md",
    ]
    assert load_documents(root).skipped_files == {"link to a folder outside": 1}
    # a link to a parent folder: root's own documents are not read a second time through it
    (root / "up").symlink_to(tmp_path, target_is_directory=True)
    again = load_documents(root, follow_symlinks=True)
    assert sorted(d.id for d in again.documents) == ["a.md", "linked/b.md", "linked/deep/c.md"]


def test_an_upsert_refuses_a_document_emptied_rather_than_leaving_its_old_text(
    tmp_path: Path,
) -> None:
    """An upsert that skipped an emptied document would keep its old text served (the HTTP
    routes refuse it too); a full ingest skips and counts it (the document leaves)."""
    from rag_retriever.ingest.loaders import read_upserts

    path = write_jsonl(
        tmp_path / "ch.jsonl", [{"id": "keep", "text": "new words"}, {"id": "old", "text": " "}]
    )
    with pytest.raises(DocumentError, match=r"ch\.jsonl:2: the document has no text"):
        read_upserts([path])
    assert load_documents(path).skipped_empty == 1


def test_a_jsonl_suffix_in_capitals_is_a_jsonl_file(tmp_path: Path) -> None:
    """A folder's suffixes are read in any case; a file's .JSONL is too."""
    path = write_jsonl(tmp_path / "DATA.JSONL", [{"id": "a", "text": "alpha"}])
    assert [d.id for d in load_documents(path).documents] == ["a"]


def test_hidden_files_and_folders_are_skipped_and_counted_unless_included(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "notes.txt").write_text("git internals", encoding="utf-8")
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "LICENSE.md").write_text("# MIT\n\nlicence", encoding="utf-8")
    (root / "guide").mkdir()
    (root / "guide" / "a.md").write_text("# A\n\nalpha", encoding="utf-8")
    (root / "guide" / ".draft.md").write_text("# Draft\n\nunfinished", encoding="utf-8")
    corpus = load_documents(root)
    assert [d.id for d in corpus.documents] == ["guide/a.md"]
    # a hidden folder counts once: its files are not walked
    assert corpus.skipped_files == {HIDDEN: 3}
    included = load_documents(root, include_hidden=True)
    assert [d.id for d in included.documents] == [
        ".git/notes.txt",
        ".venv/lib/LICENSE.md",
        "guide/.draft.md",
        "guide/a.md",
    ]
    assert HIDDEN not in included.skipped_files
    # the folder named is read even when its own name is hidden
    assert [d.id for d in load_documents(root / ".venv").documents] == ["lib/LICENSE.md"]
