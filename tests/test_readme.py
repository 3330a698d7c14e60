"""The README's Python snippets, pasted in order into one interpreter, against the tour's data.

The tour's ingest (`rag-retriever ingest docs --collection demo` into `tour-data`) is done first
with the real default model, a server on the tour's data is started, and each ```python block
runs in one namespace from a folder holding `tour-data`. The one edit: the server's address
(`http://127.0.0.1:8000`) becomes the test server's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rag_retriever.cli import main
from rag_retriever.query.retriever import Retriever
from rag_retriever.service.server import create_app, serve_in_thread
from rag_retriever.settings import Settings

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_python_snippets_run_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAG_DATA_DIR", "tour-data")
    monkeypatch.setenv("RAG_DEVICE", "cpu")
    assert main(["ingest", str(ROOT / "docs"), "--collection", "demo", "--no-progress"]) == 0
    blocks = python_blocks()
    assert len(blocks) >= 3
    settings = Settings.from_env(collection="demo")
    with serve_in_thread(create_app(Retriever.from_settings(settings), settings)) as url:
        namespace: dict[str, object] = {}
        for block in blocks:
            exec(
                compile(block.replace("http://127.0.0.1:8000", url), "README.md", "exec"), namespace
            )
    assert namespace["docs"]  # the LangChain snippet's documents
