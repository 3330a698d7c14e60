"""examples/chat_app.py: the prompt it builds from hits, and the script end to end (in-process
against embedded Qdrant on disk, and through a real HTTP server)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.records import Hit, StageScore
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore
from tests.test_retriever import DOCS
from tests.test_server import build_retriever, live_server

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "chat_app.py"


@pytest.fixture(scope="module")
def chat_app() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chat_app", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hit(rank: int, doc_id: str, title: str, text: str, start: int) -> Hit:
    return Hit(
        chunk_id=f"c{rank}",
        doc_id=doc_id,
        title=title,
        text=text,
        start=start,
        end=start + len(text),
        chunk_index=0,
        rank=rank,
        score=1.0 / rank,
        dense=StageScore(rank, 0.5),
    )


HITS = [
    hit(1, "normans.md", "Normans", "Rollo founded Normandy in 911.", 120),
    hit(2, "paris.txt", "Paris — capital", "Paris is on the Seine.\nIt is big.", 0),
]


def test_prompt_numbers_sources_in_hit_order_with_their_text(chat_app: ModuleType) -> None:
    prompt = chat_app.build_prompt("Who founded Normandy?", HITS)
    first = "[1] Normans (normans.md, chars 120-150)\nRollo founded Normandy in 911."
    second = "[2] Paris — capital (paris.txt, chars 0-33)\nParis is on the Seine.\nIt is big."
    assert first in prompt and second in prompt
    assert prompt.index(first) < prompt.index(second)
    assert prompt.rstrip().endswith("Question: Who founded Normandy?")
    assert "[1]" in chat_app.INSTRUCTIONS  # the model is told how to cite


def test_prompt_without_hits_says_so(chat_app: ModuleType) -> None:
    prompt = chat_app.build_prompt("Anything?", [])
    assert "(none found)" in prompt and not re.search(r"^\[\d+\]", prompt, re.M)


def test_placeholder_llm_echoes_the_sources_it_would_cite(chat_app: ModuleType) -> None:
    answer = chat_app.call_llm(chat_app.build_prompt("q", HITS))
    assert answer.startswith("[placeholder]")
    assert "  [1] Normans (normans.md, chars 120-150)" in answer
    assert "  [2] Paris — capital (paris.txt, chars 0-33)" in answer
    assert "Rollo founded" not in answer  # sources, not texts
    assert "(no sources)" in chat_app.call_llm(chat_app.build_prompt("q", []))


def test_script_in_process(
    chat_app: ModuleType,
    tiny_encoder: Encoder,
    tiny_encoder_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(data_dir=tmp_path, embed_model=str(tiny_encoder_dir))
    store = EdgeStore(settings.edge_dir)
    ingest_documents(LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=tiny_encoder, store=store)
    store.close()
    monkeypatch.setenv("RAG_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RAG_EMBED_MODEL", str(tiny_encoder_dir))
    monkeypatch.setenv("RAG_DEVICE", "cpu")
    assert (
        chat_app.main(["the wine of the king", "--collection", "kb", "-k", "2", "--show-prompt"])
        == 0
    )
    out = capsys.readouterr().out
    cited = re.findall(r"^  (\[\d\] .+ \(doc\d, chars \d+-\d+\))$", out, re.M)
    assert [c[:3] for c in cited] == ["[1]", "[2]"]
    assert "Question: the wine of the king" in out


def test_script_over_http(
    chat_app: ModuleType,
    tiny_encoder: Encoder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    retriever, _ = build_retriever(tiny_encoder, tmp_path)
    expected = retriever.search("apples and pears", k=3, mode="bm25")
    monkeypatch.setenv("RAG_API_KEY", "example-key")
    with live_server(retriever, Settings(api_key="example-key")) as url:
        code = chat_app.main(["apples and pears", "--url", url, "-k", "3", "--mode", "bm25"])
    assert code == 0
    out = capsys.readouterr().out
    for i, h in enumerate(expected, start=1):
        assert f"  [{i}] {h.title} ({h.doc_id}, chars {h.start}-{h.end})" in out
