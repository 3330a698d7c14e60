"""Opening the store the settings name: a Qdrant server or cluster when RAG_QDRANT_URL is set,
else Qdrant Edge under RAG_DATA_DIR.

Example:
    >>> store = open_store(Settings.from_env())                    # doctest: +SKIP

The factory lives here, above both engines, so that the contract (`base.py`) imports neither.
It does not create collections or check what a collection holds (the catalog and the record do).
"""

from __future__ import annotations

from pathlib import Path

from rag_retriever.errors import ConfigError
from rag_retriever.settings import Settings
from rag_retriever.store.base import Store


def open_store(settings: Settings) -> Store:
    """A Qdrant server store when RAG_QDRANT_URL is set, else Qdrant Edge under data_dir."""
    if settings.qdrant_url:
        from qdrant_client import QdrantClient

        from rag_retriever.store.server import ServerStore

        client = QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key, timeout=30)
        return ServerStore(
            client,
            shard_number=settings.qdrant_shards,
            replication_factor=settings.qdrant_replicas,
            write_consistency_factor=settings.qdrant_write_consistency,
            ef_construct=settings.hnsw_ef_construct,
            where=f"the Qdrant server at {settings.qdrant_url} (RAG_QDRANT_URL)",
        )
    from rag_retriever.store.edge import EdgeStore

    check_data_dir(settings.data_dir)
    where = f"the data dir {settings.data_dir.resolve()} (RAG_DATA_DIR)"
    return EdgeStore(
        settings.edge_dir,
        where=where,
        shard_points=settings.base_shard_points,
        ef_construct=settings.hnsw_ef_construct,
    )


def check_data_dir(data_dir: Path) -> None:
    """Refuse a data dir that is a file, or was written by rag-retriever 0.1."""
    if data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(f"RAG_DATA_DIR {data_dir} is a file, not a directory; point it at one")
    old = [p for p in (data_dir / "qdrant", data_dir / "indexes") if p.is_dir()]
    if old:
        raise ConfigError(
            f"{data_dir} holds collections written by rag-retriever 0.1 "
            f"({', '.join(str(p) for p in old)}: qdrant-client local mode and a BM25 sidecar), "
            f"which this version does not read. Re-ingest your documents into a new data dir "
            f"(RAG_DATA_DIR=new-dir rag-retriever ingest PATH --collection NAME), or remove "
            f"those folders to re-ingest in place."
        )
