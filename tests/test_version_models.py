"""A collection version names its models: settings that name none serve (and re-ingest) a version
with the embedder that built it and the reranker recorded for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rag_retriever.cli import main
from rag_retriever.errors import FingerprintMismatch
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, open_store
from tests.conftest import build_tiny_bert, write_jsonl

DOCS = tuple(
    Document(f"d{i}", f"Note {i}", f"The {w} and the king. A story of {w}.")
    for i, w in enumerate(["apples", "pears", "wine", "river", "city"])
)


def _settings(data: Path, **env: str) -> Settings:
    """Settings from this environment only (not the test process's)."""
    return Settings.from_env({"RAG_DATA_DIR": str(data), "RAG_DEVICE": "cpu", **env})


def _ingest(data: Path, model_dir: Path) -> str:
    settings = _settings(data)
    store = open_store(settings)
    encoder = Encoder.load(str(model_dir), device="cpu", dtype="fp32")
    report = ingest_documents(
        LoadedCorpus(DOCS, 0, "test"), alias="kb", encoder=encoder, store=store
    )
    store.close()
    return report.collection


def test_a_version_is_served_with_the_model_that_built_it(
    tmp_path: Path, tiny_encoder_dir: Path
) -> None:
    _ingest(tmp_path / "data", tiny_encoder_dir)
    retriever = Retriever.from_settings(_settings(tmp_path / "data", RAG_COLLECTION="kb"))
    assert retriever.encoder.fingerprint.model == "tiny-bert"
    assert retriever.search("apples", k=1)[0].doc_id == "d0"
    # a model named in the settings is used as it is, and must match
    pinned = _settings(tmp_path / "data", RAG_COLLECTION="kb", RAG_EMBED_MODEL="all-MiniLM-L6-v2")
    with pytest.raises(FingerprintMismatch):
        Retriever.from_settings(pinned).search("apples")


def test_a_version_names_its_reranker_unless_the_settings_do(
    tmp_path: Path, tiny_encoder_dir: Path, tiny_reranker_dir: Path
) -> None:
    name = _ingest(tmp_path / "data", tiny_encoder_dir)
    store = EdgeStore(tmp_path / "data" / "edge")
    record = store.record(name)
    store.put_record(name, dataclasses.replace(record, reranker={"source": str(tiny_reranker_dir)}))
    store.close()
    settings = _settings(tmp_path / "data", RAG_COLLECTION="kb")
    retriever = Retriever.from_settings(settings)
    assert retriever.default_mode == "rerank"
    assert retriever.retrieve("apples", k=2).hits[0].rerank is not None
    assert Retriever.from_settings(settings.replace(rerank_model=None)).reranker is None


def test_a_re_ingest_keeps_the_collection_s_model(
    tmp_path: Path,
    tiny_encoder_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = build_tiny_bert(tmp_path / "other", seed=7)
    (other / "rag_profile.json").write_text(
        (tiny_encoder_dir / "rag_profile.json")
        .read_text(encoding="utf-8")
        .replace("tiny-bert", "other-bert"),
        encoding="utf-8",
    )
    _ingest(tmp_path / "data", other)
    monkeypatch.setenv("RAG_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RAG_DEVICE", "cpu")
    monkeypatch.delenv("RAG_EMBED_MODEL", raising=False)
    corpus = write_jsonl(
        tmp_path / "c.jsonl", [{"id": d.id, "title": d.title, "text": d.text} for d in DOCS[:3]]
    )
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    assert "other-bert" in capsys.readouterr().out


def test_a_version_s_documents_are_put_together_from_its_chunks(
    tmp_path: Path, tiny_encoder_dir: Path
) -> None:
    from rag_retriever.ingest.versions import documents_of
    from rag_retriever.ingest.writer import ingest_documents as ingest

    long = Document("long", "Long", " ".join(f"Sentence {i} of a long text." for i in range(60)))
    docs = (*DOCS, long, Document("m", "M", "Tagged.", {"lang": "fr"}))
    store = open_store(_settings(tmp_path / "data"))
    encoder = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32")
    report = ingest(LoadedCorpus(docs, 0, "t"), alias="kb", encoder=encoder, store=store)
    assert report.chunks > len(docs)  # the long document is several overlapping chunks
    rebuilt = {d.id: d for d in documents_of(store, report.collection).documents}
    assert rebuilt == {d.id: d for d in docs}
