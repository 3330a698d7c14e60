"""End to end with the real all-MiniLM-L6-v2: ingest the project's docs, search, evaluate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_retriever.cli import main as cli_main
from rag_retriever.eval.recall_at_k import main as recall_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.model


def test_ingest_search_and_evaluate_the_docs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAG_DATA_DIR", str(tmp_path / "data"))
    assert cli_main(["ingest", str(DOCS), "--collection", "docs", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["promoted"] and report["truncated"] == 0 and report["chunks"] > 5
    assert not report.get("skipped_files"), "the docs folder holds only documents"

    for mode in ("dense", "bm25", "hybrid"):
        assert (
            cli_main(
                [
                    "search",
                    "how do I roll back to the previous version?",
                    "--collection",
                    "docs",
                    "-k",
                    "3",
                    "--mode",
                    mode,
                    "--json",
                ]
            )
            == 0
        )
        result = json.loads(capsys.readouterr().out)
        assert result["hits"][0]["doc_id"] == "versions.md", (mode, result["hits"][0])

    out = tmp_path / "eval"
    code = recall_main(
        [
            "--collection",
            "docs",
            "--questions",
            str(ROOT / "eval" / "demo_questions.jsonl"),
            "--out",
            str(out),
            "--no-progress",
            "--fail-under",
            "hybrid:recall@5=0.9",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions_evaluated"] == 12
