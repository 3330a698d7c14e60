"""A model named by hub id: read from the Hugging Face cache with no network, and an id the cache
lacks refused in one quick step (models/hub.py).

No test here reaches the hub: name resolution is replaced by one that counts and refuses, which
is what a machine with no network does (this one has none), so the tests behave the same on a
machine that has one. The download itself needs the hub, so its choice of files is tested with
`snapshot_download` replaced by a copy from a local "repository" (said where it is done).
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from rag_retriever.errors import ModelLoadError
from rag_retriever.models import hub
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.profiles import ModelProfile, ResolvedModel
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.training.reranker import load_base

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROFILE = ModelProfile("tiny-bert", "", "", "mean", 64)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache of this test's own."""
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return root


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every host name anything tries to resolve; each is refused, as with no network."""
    asked: list[str] = []

    def refuse(host: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(str(host))
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield asked


def cache_model(cache: Path, repo_id: str, files: Path) -> Path:
    """`files` put into `cache` as the hub's cache lays out `repo_id` at its main revision."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_cached_hub_id_loads_without_the_network(
    cache: Path, lookups: list[str], tiny_encoder_dir: Path
) -> None:
    snapshot = cache_model(cache, "someorg/tiny-bert", tiny_encoder_dir)
    encoder = Encoder.load(ResolvedModel("someorg/tiny-bert", PROFILE), device="cpu", dtype="fp32")
    direct = Encoder.load(ResolvedModel(str(snapshot), PROFILE), device="cpu", dtype="fp32")
    assert lookups == []
    assert encoder.source == "someorg/tiny-bert"  # what a version records, to load it again
    assert encoder.fingerprint == direct.fingerprint
    texts = ["a cached model", "no network"]
    assert (encoder.encode_passages(texts).vectors == direct.encode_passages(texts).vectors).all()


def test_a_cached_reranker_loads_without_the_network(
    cache: Path, lookups: list[str], tiny_reranker_dir: Path
) -> None:
    cache_model(cache, "someorg/tiny-reranker", tiny_reranker_dir)
    reranker = CrossEncoderReranker.load("someorg/tiny-reranker", device="cpu", dtype="fp32")
    assert lookups == []
    assert len(reranker.score("query", ["one passage", "another"]).scores) == 2


def test_an_uncached_id_with_no_network_fails_after_one_question(
    cache: Path, lookups: list[str]
) -> None:
    with pytest.raises(ModelLoadError) as raised:
        Encoder.load(ResolvedModel("someorg/not-cached", PROFILE), device="cpu")
    message = str(raised.value)
    assert "'someorg/not-cached'" in message and str(cache) in message
    assert "RAG_EMBED_MODEL" in message
    # asked once (the repository's file list), not once a file with back-off (transformers)
    assert 1 <= len(lookups) <= 2
    with pytest.raises(ModelLoadError, match="RAG_RERANK_MODEL"):
        CrossEncoderReranker.load("someorg/not-cached", device="cpu")


def test_offline_mode_never_asks(
    cache: Path, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        Encoder.load(ResolvedModel("someorg/not-cached", PROFILE), device="cpu")
    assert lookups == []


def test_a_name_that_is_no_id_says_so(cache: Path, lookups: list[str]) -> None:
    with pytest.raises(ModelLoadError, match="neither a folder nor a hub id"):
        Encoder.load(ResolvedModel("not a model!", PROFILE), device="cpu")
    assert lookups == []


@pytest.mark.parametrize(
    ("weights", "asked"),
    [
        (["model.safetensors", "pytorch_model.bin"], [hub.WEIGHTS]),
        (["pytorch_model.bin"], [hub.WEIGHTS, hub.FALLBACK_WEIGHTS]),
    ],
)
def test_a_download_takes_one_copy_of_the_weights(
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    weights: list[str],
    asked: list[str],
) -> None:
    # The hub cannot be reached here: snapshot_download is replaced by a copy from a local
    # repository of the files its patterns select (its own pattern matching, not ours).
    remote = tmp_path / "remote"
    (remote / "onnx").mkdir(parents=True)
    for name in ["config.json", "vocab.txt", "onnx/model.onnx", "flax_model.msgpack", *weights]:
        (remote / name).write_text(name)
    patterns: list[str] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        allow = kwargs["allow_patterns"]
        patterns.append(next(p for p in allow if p not in hub.SMALL_FILES))
        local = cache / "snapshot"
        for path in remote.rglob("*"):
            name = path.relative_to(remote).as_posix()
            if path.is_file() and list(filter_repo_objects([name], allow_patterns=allow)):
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    directory = hub.model_directory("someorg/remote")
    assert patterns == asked
    got = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    assert got == sorted(["config.json", "vocab.txt", weights[0]])


def test_a_training_base_by_hub_id_reads_the_cache(
    cache: Path, lookups: list[str], tiny_reranker_dir: Path
) -> None:
    cache_model(cache, "someorg/tiny-reranker", tiny_reranker_dir)
    _, _, fresh_head = load_base("someorg/tiny-reranker")
    assert not fresh_head  # the cached cross-encoder's own head
    with pytest.raises(ModelLoadError, match="base model 'someorg/not-cached'"):
        load_base("someorg/not-cached")
    assert len(lookups) <= 2  # only the uncached id asked the hub
