"""The data directory: errors say where the store looked; reading a data dir that does not
exist creates nothing (only a write makes its folders)."""

from __future__ import annotations

from pathlib import Path

import pytest
from qdrant_client import QdrantClient

from rag_retriever.cli import main
from rag_retriever.errors import CollectionNotFound
from rag_retriever.eval.recall_at_k import main as eval_main
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, open_store
from rag_retriever.store.server import ServerStore
from tests.conftest import write_jsonl


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_opening_and_reading_a_missing_edge_store_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "data" / "edge"
    store = EdgeStore(root)
    assert store.collection_names() == [] and store.aliases() == {}
    assert store.running_compaction("kb") is None and store.collect_garbage("kb") == []
    with pytest.raises(CollectionNotFound) as caught:
        store.resolve("kb")
    assert f"in the Qdrant Edge store at {root.resolve()}" in str(caught.value)
    assert f"nothing was ingested there yet ({root.resolve()} does not exist)" in str(caught.value)
    store.close()
    assert tree(tmp_path) == []


def test_open_store_names_the_data_dir_or_the_server_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    edge = open_store(Settings(data_dir=tmp_path / "rag-data"))
    with pytest.raises(CollectionNotFound, match="existing: none") as caught:
        edge.resolve("docs")
    message = str(caught.value)
    assert f"in the data dir {(tmp_path / 'rag-data').resolve()} (RAG_DATA_DIR)" in message
    assert "point RAG_DATA_DIR or RAG_QDRANT_URL where it was ingested" in message
    edge.close()
    assert not (tmp_path / "rag-data").exists()

    # no server to reach here: the client open_store makes is an in-process one
    monkeypatch.setattr("qdrant_client.QdrantClient", lambda **_: QdrantClient(":memory:"))
    server = open_store(Settings(qdrant_url="http://qdrant.internal:6333"))
    assert server.where == "the Qdrant server at http://qdrant.internal:6333 (RAG_QDRANT_URL)"
    memory = ServerStore(QdrantClient(":memory:"))
    with pytest.raises(CollectionNotFound, match="in qdrant-client's in-process store; existing"):
        memory.resolve("docs")


def test_read_only_commands_on_a_missing_data_dir_create_nothing_and_say_where(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    questions = write_jsonl(
        tmp_path / "q.jsonl", [{"id": "q1", "question": "apples?", "gold_doc_ids": ["a"]}]
    )
    before = tree(tmp_path)
    assert main(["collections"]) == 0
    assert f"no collections yet in the data dir {env.resolve()}" in capsys.readouterr().out
    assert main(["collections", "--json"]) == 0
    assert main(["search", "apples", "--collection", "kb", "--mode", "bm25"]) == 2
    err = capsys.readouterr().err
    assert f"'kb' does not exist in the data dir {env.resolve()} (RAG_DATA_DIR)" in err
    assert "nothing was ingested there yet" in err and "existing: none" in err
    code = eval_main(
        ["--questions", str(questions), "--collection", "kb", "--modes", "bm25", "--json"]
    )
    assert code == 2
    assert f"the data dir {env.resolve()}" in capsys.readouterr().err
    assert tree(tmp_path) == before and not env.exists()

    # a write makes the folders
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "Red apples."}])
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    assert (env / "edge" / "collections").is_dir() and (env / "edge" / "aliases").is_dir()
