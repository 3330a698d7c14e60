"""Quantized dense vectors (RAG_QUANTIZATION): part of a version like its model, applied by the
engine, searched with rescoring from the float32 originals.

Oracles: the engine's own files (a binary version's shard holds quantized vectors, a float32 one
does not), a brute-force cosine ranking of the stored vectors, and the version records. Real
Qdrant Edge and qdrant-client's in-process server API, the tiny encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rag_retriever.errors import ConfigError, VersionIncompatible
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents, update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, Store
from rag_retriever.store.catalog import describe_collections
from rag_retriever.store.record import VersionRecord

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]
DOCS = tuple(
    Document(f"d{i}", f"doc {i}", " ".join(WORDS[(i * j) % len(WORDS)] for j in range(1, 9)))
    for i in range(60)
)


def ingest(store: Store, encoder: Encoder, tmp_path: Path, quantization: str, **kw: object) -> str:
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"),
        alias="kb",
        encoder=encoder,
        store=store,
        lock_dir=tmp_path,
        quantization=quantization,
        **kw,  # type: ignore[arg-type]
    )
    return store.resolve("kb")


def add_one(store: Store, encoder: Encoder, tmp_path: Path, **kw: object) -> None:
    """One new document as an update of "kb": a delta of the live version."""
    update_documents(
        [Document("new", "new", "alpha mike november")],
        alias="kb",
        encoder=encoder,
        store=store,
        lock_dir=tmp_path,
        rebase_drift=1.0,
        **kw,  # type: ignore[arg-type]
    )


def quantized_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("quantized*") if p.is_file()]


@pytest.mark.parametrize("quantization", ["binary", "binary2", "int8"])
def test_a_quantized_version_is_quantized_by_the_engine_and_searched_with_rescoring(
    tmp_path: Path, tiny_encoder: Encoder, quantization: str
) -> None:
    plain, quantized = EdgeStore(tmp_path / "plain"), EdgeStore(tmp_path / quantization)
    names = {
        "none": ingest(plain, tiny_encoder, tmp_path, "none"),
        quantization: ingest(quantized, tiny_encoder, tmp_path, quantization),
    }
    assert plain.record(names["none"]).quantization == "none"
    assert quantized.record(names[quantization]).quantization == quantization
    # int8: Edge's TurboQuant at 8 bits (its scalar int8 config writes nothing: docs/versions.md)
    assert quantized_files(tmp_path / quantization) and not quantized_files(tmp_path / "plain")
    # the oracle: cosine of the stored float32 vectors, every chunk
    every = [r.id for r in plain.scroll(names["none"])]
    records = plain.retrieve(names["none"], every, with_dense=True)
    ids = [r.id for r in records]
    matrix = np.stack([np.asarray(r.dense) for r in records])
    for query in ("alpha bravo", "kilo lima golf", "echo"):
        vector = tiny_encoder.encode_queries([query]).vectors[0]
        cosine = dict(zip(ids, (matrix @ vector).tolist(), strict=True))
        exact = [ids[i] for i in np.argsort(-(matrix @ vector), kind="stable")[:5]]
        for store in (plain, quantized):
            hits = Retriever(encoder=tiny_encoder, store=store, collection="kb").search(
                query, k=5, mode="dense"
            )
            # rescored with the originals: the exact top 5 (the same chunk ids in both stores)
            assert len(set(h.chunk_id for h in hits) & set(exact)) >= 4, (query, store)
            # ... and their scores are the float32 cosines, not the quantized estimates
            for hit in hits:
                assert hit.score == pytest.approx(cosine[hit.chunk_id], abs=1e-4)
    plain.close()
    quantized.close()


def test_a_change_of_quantization_is_a_full_build_and_an_update_keeps_the_live_one(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    store = EdgeStore(tmp_path / "edge")
    first = ingest(store, tiny_encoder, tmp_path, "none")
    second = ingest(store, tiny_encoder, tmp_path, "binary", rebase_drift=1.0)
    assert store.record(second).lineage.base is None  # a full build, not a delta of `first`
    assert store.record(second).quantization == "binary" and first != second
    add_one(store, tiny_encoder, tmp_path, quantization="none")  # an update keeps the live one's
    third = store.resolve("kb")
    assert store.record(third).lineage.base == second
    assert store.record(third).quantization == "binary"
    # the listing (`rag-retriever collections`, GET /v1/collections) says it of each version
    listed = {
        v["collection"]: v["quantization"] for v in describe_collections(store)["kb"]["versions"]
    }
    assert listed == {second: "binary", third: "binary"} | (
        {first: "none"} if first in listed else {}
    )
    store.close()


def test_unknown_quantization_names_are_refused(tmp_path: Path, tiny_encoder: Encoder) -> None:
    with pytest.raises(
        ConfigError, match="RAG_QUANTIZATION must be one of none, int8, binary, binary2"
    ):
        Settings(quantization="fp8")
    store = EdgeStore(tmp_path / "edge")
    # a record naming a quantization this version of rag-retriever cannot read
    good = ingest(store, tiny_encoder, tmp_path, "binary")
    data = {**store.record(good).to_json(), "quantization": "int4"}
    with pytest.raises(VersionIncompatible, match="unknown quantization 'int4'"):
        VersionRecord.from_json(data, name=good)
    store.close()


def test_the_server_path_asks_the_server_for_the_quantized_collection(
    server_store: Store, tiny_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qdrant-client's in-process implementation drops a collection's quantization config (it
    searches exactly), so what the server is asked for is read from the call itself: a spy on
    create_collection, which still runs. What a Qdrant server then builds is not run here."""
    client = server_store.client  # type: ignore[attr-defined]
    real = client.create_collection
    asked: list[dict[str, Any]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "create_collection", spy)
    name = ingest(server_store, tiny_encoder, tmp_path, "int8")
    assert server_store.record(name).quantization == "int8"
    [points] = [call for call in asked if "quantization_config" in call]  # not the catalog
    config = points["quantization_config"]
    assert config.scalar.type == "int8" and config.scalar.always_ram is True
    assert points["vectors_config"]["dense"].on_disk is True  # the originals, for rescoring
    hits = Retriever(encoder=tiny_encoder, store=server_store, collection="kb").search(
        "alpha", k=3, mode="dense"
    )
    assert len(hits) == 3
    asked.clear()
    name = ingest(server_store, tiny_encoder, tmp_path, "binary2")
    assert server_store.record(name).quantization == "binary2"
    [points] = [call for call in asked if "quantization_config" in call]
    binary = points["quantization_config"].binary
    assert binary.encoding == "two_bits" and binary.query_encoding == "scalar8bits"
    assert binary.always_ram is True


def test_binary2_holds_two_bits_a_dimension_asked_at_eight_where_binary_holds_one(
    tmp_path: Path, tiny_encoder: Encoder
) -> None:
    """The oracle is the engine's own account of what it built (the quantized storage's config
    file beside its codes), and the record says which setting each version holds."""
    built = {}
    for setting in ("binary", "binary2"):
        store = EdgeStore(tmp_path / setting)
        name = ingest(store, tiny_encoder, tmp_path, setting)
        assert store.record(name).quantization == setting
        store.close()
        [config] = (tmp_path / setting).rglob("quantized.config.json")
        built[setting] = json.loads(config.read_text())["quantization_config"]["binary"]
    assert built["binary"].get("encoding", "one_bit") == "one_bit"
    assert built["binary"].get("query_encoding", "default") == "default"
    assert built["binary2"]["encoding"] == "two_bits"
    assert built["binary2"]["query_encoding"] == "scalar8bits"


def test_every_quantized_setting_has_its_engine_configs_oversampling_and_size() -> None:
    """The per-setting tables are kept beside each other by hand: each names every setting (an
    unknown name would fall back to float32's figures or config silently)."""
    import qdrant_edge

    from rag_retriever.ops.plan import BYTES_PER_DIMENSION
    from rag_retriever.records import QUANTIZATIONS, UNQUANTIZED
    from rag_retriever.store.base import QUANTIZATION_OVERSAMPLING
    from rag_retriever.store.edge import _edge_quantization
    from rag_retriever.store.server import _server_quantization

    quantized = set(QUANTIZATIONS) - {UNQUANTIZED}
    assert set(BYTES_PER_DIMENSION) == set(QUANTIZATIONS)
    assert set(QUANTIZATION_OVERSAMPLING) == quantized
    for name in QUANTIZATIONS:
        held = (_edge_quantization(qdrant_edge, name), _server_quantization(name))
        assert held == (None, None) if name == UNQUANTIZED else None not in held, name


def oversampling_asked(request: Any) -> float | None:
    """The oversampling an engine request asks of a quantized search (None: none asked)."""
    params = request.params
    return (
        None if params is None or params.quantization is None else params.quantization.oversampling
    )


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [("none", None), ("int8", 2.0), ("binary", 4.0), ("binary2", 4.0)],
)
def test_each_setting_is_searched_at_its_own_oversampling_in_every_shard(
    tmp_path: Path,
    tiny_encoder: Encoder,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str,
    expected: float | None,
) -> None:
    """Binary's 1-bit ranking is coarser than int8's, so it rescores twice as many candidates
    (store/base.py, QUANTIZATION_OVERSAMPLING); float32 has nothing to rescore. Read from the
    engine requests themselves (a spy on the store's request builder, which still runs), in a
    one-shard version and in an update's delta (the several-shard path)."""
    store = EdgeStore(tmp_path / "edge")
    ingest(store, tiny_encoder, tmp_path, quantization)
    built = EdgeStore._request
    asked: list[float | None] = []

    def spy(self: EdgeStore, q: Any, *args: Any, **kwargs: Any) -> Any:
        request = built(self, q, *args, **kwargs)
        if q.using == "dense":
            asked.append(oversampling_asked(request))
        return request

    monkeypatch.setattr(EdgeStore, "_request", spy)
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="kb")
    assert retriever.search("alpha bravo", k=5, mode="dense")
    add_one(store, tiny_encoder, tmp_path)
    assert len(store.manifest(store.resolve("kb")).segments) == 2  # base and delta
    assert retriever.search("alpha mike", k=5, mode="dense")
    assert len(asked) >= 3 and set(asked) == {expected}
    store.close()


@pytest.mark.filterwarnings("ignore:Local mode performs exact")
@pytest.mark.parametrize(("quantization", "expected"), [("none", None), ("binary", 4.0)])
def test_the_server_path_asks_each_setting_for_its_own_oversampling(
    server_store: Store,
    tiny_encoder: Encoder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str,
    expected: float | None,
) -> None:
    """qdrant-client's in-process implementation searches exactly and is sent no search
    parameters, so the store is told it talks to a server for the query (the in-process
    implementation takes the parameters and warns), and what the server is asked is read from
    the call: a spy on query_batch_points, which still runs."""
    ingest(server_store, tiny_encoder, tmp_path, quantization)
    client = server_store.client  # type: ignore[attr-defined]
    real = client.query_batch_points
    asked: list[float | None] = []

    def spy(collection: str, requests: Any, **kwargs: Any) -> Any:
        asked.extend(oversampling_asked(r) for r in requests if r.using == "dense")
        return real(collection, requests=requests, **kwargs)

    monkeypatch.setattr(client, "query_batch_points", spy)
    monkeypatch.setattr(server_store, "embedded", False)
    hits = Retriever(encoder=tiny_encoder, store=server_store, collection="kb").search(
        "alpha", k=3, mode="dense"
    )
    assert len(hits) == 3 and asked == [expected]
