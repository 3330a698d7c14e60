"""RAG_HNSW_EF_CONSTRUCT: how wide each new shard's HNSW graph is built, on Qdrant Edge and as
asked of a Qdrant server. What a wider graph buys was measured (docs/benchmarks.md, "How wide
the graph is built"); these check that the width reaches the engine and the server."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import QdrantClient

from rag_retriever.errors import ConfigError
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, Store
from rag_retriever.store.base import QDRANT_EF_CONSTRUCT
from rag_retriever.store.catalog import describe_collections
from rag_retriever.store.open import open_store
from rag_retriever.store.server import ServerStore
from tests.conftest import graph_configs
from tests.test_quantization import add_one

DOCS = tuple(
    Document(f"d{i}", f"Doc {i}", f"alpha bravo charlie {i} delta echo foxtrot {i * 7}")
    for i in range(12)
)


def write(store: Store, encoder: Encoder, tmp_path: Path) -> None:
    """A full build of "kb", then an update (a delta shard of its own)."""
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=encoder, store=store, lock_dir=tmp_path
    )
    add_one(store, encoder, tmp_path)


def test_edge_builds_every_new_shard_at_the_width_asked_for(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    wide = EdgeStore(tmp_path / "wide", ef_construct=200)
    write(wide, tiny_encoder, tmp_path)
    configs = graph_configs(tmp_path / "wide")
    assert len(configs) >= 2  # the base and the update's delta
    assert all(c["ef_construct"] == 200 and c["m"] == 16 for c in configs)
    hits = Retriever(encoder=tiny_encoder, store=wide, collection="kb").search("alpha", k=3)
    assert len(hits) == 3
    wide.close()
    # the default asks nothing of the engine: its own width (Qdrant's 100)
    plain = EdgeStore(tmp_path / "plain")
    write(plain, tiny_encoder, tmp_path)
    assert set(map(str, graph_configs(tmp_path / "plain"))) == {"None"}
    plain.close()


@pytest.mark.parametrize(("width", "asked"), [(200, 200), (QDRANT_EF_CONSTRUCT, None)])
def test_the_server_path_asks_the_server_for_the_width(
    tmp_path: Path,
    tiny_encoder: Encoder,
    monkeypatch: pytest.MonkeyPatch,
    width: int,
    asked: int | None,
) -> None:
    """qdrant-client's in-process implementation keeps no HNSW config (it searches exactly), so
    what the server is asked for is read from the call itself: a spy on create_collection,
    which still runs. What a Qdrant server then builds is not run here."""
    server = ServerStore(QdrantClient(":memory:"), ef_construct=width)
    real = server.client.create_collection
    calls: list[dict[str, Any]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(server.client, "create_collection", spy)
    write(server, tiny_encoder, tmp_path)
    made = [c["hnsw_config"] for c in calls if "quantization_config" in c]  # points, not catalog
    assert made and all((config and config.ef_construct) == asked for config in made)
    server.close()


def test_each_version_says_the_widths_its_graphs_were_built_at(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    """A base built at 200, then an update written at the default: the update's version holds
    graphs of both widths (its base's shards keep theirs), and the listing says so."""
    wide = EdgeStore(tmp_path / "edge", ef_construct=200)
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"), alias="kb", encoder=tiny_encoder, store=wide, lock_dir=tmp_path
    )
    first = wide.resolve("kb")
    assert wide.graph_widths(first) == (200,)
    wide.close()
    plain = EdgeStore(tmp_path / "edge")
    add_one(plain, tiny_encoder, tmp_path)
    second = plain.resolve("kb")
    assert plain.record(second).lineage.base == first  # a delta: the base's shards are shared
    assert plain.graph_widths(second) == (QDRANT_EF_CONSTRUCT, 200)
    assert plain.graph_widths(first) == (200,)
    listed = {
        v["collection"]: v["graph_widths"] for v in describe_collections(plain)["kb"]["versions"]
    }
    assert listed == {first: [200], second: [QDRANT_EF_CONSTRUCT, 200]}
    plain.close()


@pytest.mark.parametrize("width", [200, QDRANT_EF_CONSTRUCT])
def test_the_server_path_records_the_width_of_each_version(
    tmp_path: Path, tiny_encoder: Encoder, width: int
) -> None:
    """The catalog records it when the physical collection is made, and a derived version takes
    its base's: qdrant-client's in-process server reports every collection at the default width,
    so the server is not asked."""
    server = ServerStore(QdrantClient(":memory:"), ef_construct=width)
    write(server, tiny_encoder, tmp_path)
    [full, delta] = [v.name for v in server.versions("kb")]
    assert server.record(delta).lineage.base == full
    assert server.graph_widths(full) == server.graph_widths(delta) == (width,)
    listed = [v["graph_widths"] for v in describe_collections(server)["kb"]["versions"]]
    assert listed == [[width], [width]]
    server.close()


def test_the_width_is_a_setting_checked_at_start_up(tmp_path: Path) -> None:
    assert Settings.from_env({}).hnsw_ef_construct == QDRANT_EF_CONSTRUCT  # the default: Qdrant's
    for bad in ("2", "5000", "wide"):
        with pytest.raises(ConfigError, match="RAG_HNSW_EF_CONSTRUCT"):
            Settings.from_env({"RAG_HNSW_EF_CONSTRUCT": bad})
    store = open_store(
        Settings.from_env({"RAG_DATA_DIR": str(tmp_path), "RAG_HNSW_EF_CONSTRUCT": "200"})
    )
    assert isinstance(store, EdgeStore) and store.ef_construct == 200
    store.close()


def test_a_background_compaction_builds_its_base_at_the_stores_width(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    """The compaction child (a process of its own, as the HTTP service starts it) builds the
    merged base as the store that started it builds its shards, not at the engine's default."""
    from rag_retriever.ingest import compaction as compaction_module
    from rag_retriever.ingest.compaction import wait_for_compactions
    from tests.test_compaction import _outgrow
    from tests.test_update import doc
    from tests.test_update import write as write_corpus

    store = EdgeStore(tmp_path / "edge", ef_construct=200, shard_points=500)
    rng = random.Random(6)
    corpus = {f"d{i}": doc(i, rng) for i in range(30)}
    write_corpus(store, tiny_encoder, tmp_path, list(corpus.values()))
    due = _outgrow(store, tiny_encoder, tmp_path, corpus, rng)
    child = compaction_module.compact_in_background(store, "kb", lock_dir=tmp_path)
    assert wait_for_compactions(60) and child.returncode == 0
    merged = store.aliases()["kb"]
    assert merged != due.collection
    (base,) = store.manifest(merged).segments
    [config] = (tmp_path / "edge" / "segments" / base.id).rglob("edge_config.json")
    assert json.loads(config.read_text())["vectors"]["dense"]["hnsw_config"]["ef_construct"] == 200
    store.close()
