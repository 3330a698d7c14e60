"""eval/recall_at_k.py end to end on a small real collection (tiny encoder, in-memory Qdrant)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_retriever.errors import InvalidRequest
from rag_retriever.eval.questions import load_questions
from rag_retriever.eval.recall_at_k import build_parser, run
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.store import Store
from tests.conftest import collection_retriever, write_jsonl

LONG = " ".join(f"The king of city {i} held a war." for i in range(40))  # several chunks
DOCS = (
    Document("apples", "Apples", "Red apples grow in the city.\n\nGreen apples are sour."),
    Document("wine", "Wine", "Red wine comes from France. Paris drinks the wine."),
    Document("river", "River", "The river runs from the mountain to the city."),
    Document("kings", "Kings", LONG),
)


@pytest.fixture
def retriever(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> Retriever:
    return collection_retriever(DOCS, store, tiny_encoder)


def questions_file(tmp_path: Path) -> Path:
    wine = DOCS[1].text
    start = wine.index("Paris")
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {
                "id": "q1",
                "question": "where does red wine come from",
                "gold_doc_ids": ["wine"],
                "gold_spans": [{"doc_id": "wine", "start": start, "end": start + 5}],
            },
            {"id": "q2", "question": "green apples", "gold_doc_ids": ["apples"]},
            {"id": "q3", "question": "mountain river", "gold_doc_ids": ["ghost"]},
            {
                "id": "q4",
                "question": "the whole kings text",
                "gold_doc_ids": ["kings"],
                "gold_spans": [{"doc_id": "kings", "start": 0, "end": len(LONG)}],
            },
        ],
    )
    with path.open("a", encoding="utf-8") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"id": "q6", "question": "", "gold_doc_ids": ["wine"]}) + "\n")
    return path


def test_question_loader_reports_bad_lines(tmp_path: Path) -> None:
    questions, problems = load_questions(questions_file(tmp_path))
    assert [q.id for q in questions] == ["q1", "q2", "q3", "q4"]
    assert any(":5: malformed JSON" in p for p in problems)
    assert any(":6: 'question' must be a non-empty string" in p for p in problems)


def test_full_run_writes_every_output(
    retriever: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = build_parser().parse_args(
        [
            "--questions",
            str(questions_file(tmp_path)),
            "--collection",
            "kb",
            "--k",
            "1",
            "3",
            "10",
            "--out",
            str(out),
            "--no-progress",
            "--allow-missing-gold",
        ]
    )
    assert run(args, retriever) == 0
    captured = capsys.readouterr()
    assert "line 3: gold doc id(s) ['ghost'] not in collection" in captured.err
    assert "line 4: no chunk of" in captured.err and "chunking miss" in captured.err
    assert ":5: malformed JSON" in captured.err
    assert "1 skipped" in captured.out  # the summary says how many were left out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions_evaluated"] == 3  # q1, q2 and the chunking miss q4
    assert summary["questions_skipped"] == {"unknown_gold_doc": 1}
    assert summary["failure_classes"]["chunking_miss"] == 1
    assert set(summary["modes"]) == {"dense", "bm25", "hybrid"}
    rows = {r["id"]: r for r in map(json.loads, (out / "per_question.jsonl").open())}
    # Oracle: the rank of the gold chunk in plain BM25 search.
    bm25_hits = retriever.search(rows["q1"]["question"], k=100, mode="bm25")
    gold = set(rows["q1"]["gold_chunk_ids"])
    expected = next(h.rank for h in bm25_hits if h.chunk_id in gold)
    assert rows["q1"]["rank_bm25"] == expected
    assert rows["q1"]["hit@1_bm25"] == (expected == 1)
    assert rows["q4"]["failure_class"] == "chunking_miss" and rows["q4"]["rank_hybrid"] is None
    assert (out / "per_question.csv").read_text().startswith("id,line,question")
    assert (out / "recall_curve.png").read_bytes()[:4] == b"\x89PNG"
    recall1 = sum(r["hit@1_bm25"] for r in rows.values()) / 3
    assert summary["modes"]["bm25"]["recall@1"] == pytest.approx(recall1, abs=1e-4)


def test_fail_under_and_compare(
    retriever: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    qfile = questions_file(tmp_path)
    base = [
        "--questions",
        str(qfile),
        "--collection",
        "kb",
        "--no-progress",
        "--modes",
        "bm25",
        "dense",
        "--allow-missing-gold",
    ]
    first, second = tmp_path / "a", tmp_path / "b"
    assert run(build_parser().parse_args([*base, "--out", str(first)]), retriever) == 0
    code = run(
        build_parser().parse_args(
            [
                *base,
                "--out",
                str(second),
                "--compare",
                str(first),
                "--fail-under",
                "bm25:recall@10=1.01",
                "--fail-under",
                "recall@1=0.0",
            ]
        ),
        retriever,
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "FAIL: bm25:recall@10" in err and "recall@1 =" not in err
    comparison = json.loads((second / "compare.json").read_text())
    assert comparison["modes"]["bm25"] == {
        "improved": 0,
        "regressed": 0,
        "improvements": [],
        "regressions": [],
    }
    bad = build_parser().parse_args(
        [*base, "--out", str(second), "--fail-under", "bm25:recall@7=0.1"]
    )
    with pytest.raises(ValueError, match="recall@K needs K in --k"):
        run(bad, retriever)  # refused before any question is evaluated
    unknown_mode = build_parser().parse_args(
        [*base, "--out", str(second), "--fail-under", "rerank:recall@10=0.1"]
    )
    with pytest.raises(ValueError, match="mode 'rerank' is not evaluated"):
        run(unknown_mode, retriever)  # a mode that will not run: refused before the run


def test_unknown_gold_documents_fail_the_run_unless_allowed(
    retriever: Retriever, tmp_path: Path
) -> None:
    args = build_parser().parse_args(
        ["--questions", str(questions_file(tmp_path)), "--collection", "kb", "--no-progress"]
    )
    with pytest.raises(InvalidRequest, match=r"1 of 4 questions .* \(e\.g\. ghost\)"):
        run(args, retriever)


def test_doc_level_and_sampling(retriever: Retriever, tmp_path: Path) -> None:
    out = tmp_path / "doc"
    args = build_parser().parse_args(
        [
            "--questions",
            str(questions_file(tmp_path)),
            "--collection",
            "kb",
            "--level",
            "doc",
            "--sample",
            "2",
            "--seed",
            "1",
            "--out",
            str(out),
            "--no-progress",
            "--json",
            "--allow-missing-gold",
        ]
    )
    assert run(args, retriever) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["level"] == "doc" and summary["sample"] == 2
    rows = [json.loads(line) for line in (out / "per_question.jsonl").open()]
    assert len(rows) <= 2 and all(r["failure_class"] != "chunking_miss" for r in rows)


def test_rerank_mode_without_reranker_is_an_error(retriever: Retriever, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "--questions",
            str(questions_file(tmp_path)),
            "--collection",
            "kb",
            "--modes",
            "rerank",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert run(args, retriever) == 2


def test_a_span_no_chunk_holds_is_a_missed_item_not_dropped(
    retriever: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two spans, one in a chunk of its own document and one the length of a document of
    several chunks: recall@k is at most 1/2 (the second can never be found), and the run says
    why. Dropping the uncovered span scored the question 1.0."""
    wine = DOCS[1].text
    start = wine.index("Paris")
    path = write_jsonl(
        tmp_path / "two.jsonl",
        [
            {
                "id": "q1",
                "question": "red wine Paris France",
                "gold_doc_ids": ["wine", "kings"],
                "gold_spans": [
                    {"doc_id": "wine", "start": start, "end": start + 5},
                    {"doc_id": "kings", "start": 0, "end": len(LONG)},
                ],
            }
        ],
    )
    out = tmp_path / "out"
    args = build_parser().parse_args(
        ["--questions", str(path), "--collection", "kb", "--out", str(out), "--no-progress"]
    )
    assert run(args, retriever) == 0
    assert "line 1: 1 of 2 gold spans lie in no chunk" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    row = json.loads((out / "per_question.jsonl").read_text())
    assert row["failure_class"] != "chunking_miss"
    for mode, figures in summary["modes"].items():
        assert figures["recall@10"] == 0.5, (mode, figures)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fail-under", "recall@10=nan"], "finite number"),  # nothing is below NaN
        (["--fail-under", "recall@10=high"], "must be a number"),
        (["--fail-under", "hybird:recall@10=0.5"], "mode 'hybird' is not evaluated"),
        (["--fail-under", "hybrid:recall@10=0.5"], "mode 'hybrid' is not evaluated"),
        (["--compare", "OUT"], "is this run's --out"),  # compared with itself: 0 regressed
        (["--compare", "MISSING"], "no per_question.jsonl there"),
    ],
)
def test_arguments_that_would_make_a_check_lie_are_refused_before_the_run(
    retriever: Retriever, tmp_path: Path, extra: list[str], message: str
) -> None:
    out = tmp_path / "out"
    (out).mkdir()
    (out / "per_question.jsonl").write_text("", encoding="utf-8")
    paths = {"OUT": str(out), "MISSING": str(tmp_path / "missing")}
    args = build_parser().parse_args(
        [
            "--questions",
            str(questions_file(tmp_path)),
            "--collection",
            "kb",
            "--modes",
            "bm25",
            "dense",
            "--out",
            str(out),
            *(paths.get(a, a) for a in extra),
        ]
    )
    with pytest.raises(ValueError, match=message):
        run(args, retriever)


def test_a_run_of_one_list_reports_no_candidate_recall_rather_than_zero(
    retriever: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = build_parser().parse_args(
        [
            "--questions",
            str(questions_file(tmp_path)),
            "--collection",
            "kb",
            "--modes",
            "dense",
            "--out",
            str(out),
            "--no-progress",
            "--allow-missing-gold",
            "--fail-under",
            "candidate_recall=0.1",
        ]
    )
    assert run(args, retriever) == 1  # the threshold cannot be checked: it fails, saying why
    captured = capsys.readouterr()
    assert "no fused list in this run" in captured.out
    assert "candidate_recall=0.1: no fused list in this run" in captured.err
    assert json.loads((out / "summary.json").read_text())["candidate_recall"] is None
