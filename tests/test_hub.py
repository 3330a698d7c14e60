"""A model named by hub id: read from the Hugging Face cache with no network, and an id the cache
lacks refused in one quick step (models/hub.py).

No test here reaches the hub: name resolution is replaced by one that counts and refuses, which
is what a machine with no network does (this one has none), so the tests behave the same on a
machine that has one. The download itself needs the hub, so its choice of files is tested with
the hub's file list and `snapshot_download` replaced by a local "repository" (said where).
"""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

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

    huggingface_hub.close_session()  # no connection pooled by an earlier test asks instead
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield asked


def asked_once(lookups: list[str]) -> bool:
    """Whether the hub was asked one question: huggingface_hub's first request of a process
    also fetches its agent registry from the hub (a second lookup, once)."""
    return set(lookups) == {str(urlparse(constants.ENDPOINT).hostname)} and len(lookups) <= 2


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
    assert "RAG_EMBED_MODEL" in message and "the hub did not give it" in message
    # asked once (the repository's file list), not once a file with back-off (transformers)
    assert asked_once(lookups)
    with pytest.raises(ModelLoadError, match="RAG_RERANK_MODEL"):
        CrossEncoderReranker.load("someorg/not-cached", device="cpu")


def test_a_snapshot_the_cache_lists_as_incomplete_still_loads_offline(
    cache: Path, lookups: list[str], tiny_encoder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download of some of a repository's files (this module's, or `hf download --include`)
    leaves the whole repository's file list in the cache; huggingface_hub's own snapshot lookup
    then calls the snapshot incomplete. What a model needs is there, so it loads, offline."""
    cache_model(cache, "someorg/tiny-bert", tiny_encoder_dir)
    listed = [*(p.name for p in tiny_encoder_dir.iterdir()), ".gitattributes", "onnx/model.onnx"]
    trees = cache / "models--someorg--tiny-bert" / "trees"
    trees.mkdir()
    (trees / f"{COMMIT}.json").write_text(
        json.dumps([{"type": "file", "path": name} for name in listed])
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    Encoder.load(ResolvedModel("someorg/tiny-bert", PROFILE), device="cpu", dtype="fp32")
    assert lookups == []


def no_weights(folder: Path) -> None:
    for weights in folder.glob("*.safetensors"):
        weights.unlink()


def half_the_shards(folder: Path) -> None:
    """The weights as two shards and their index, the second shard not downloaded yet."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {"a": shards[0], "b": shards[1]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def no_tokenizer(folder: Path) -> None:
    for pattern in hub.TOKENIZER_FILES:
        for path in folder.glob(pattern):
            path.unlink()


@pytest.mark.parametrize("cut", [no_weights, half_the_shards, no_tokenizer])
def test_a_snapshot_short_of_what_loads_is_not_taken_for_the_model(
    cache: Path, lookups: list[str], tiny_encoder_dir: Path, tmp_path: Path, cut: Any
) -> None:
    """An interrupted download (or a cache warmed by the model alone) can leave a snapshot
    without its weights, some of its shards or its tokenizer: that id is not cached, so the hub
    is asked again (refused here, as with no network)."""
    partial = tmp_path / "partial"
    shutil.copytree(tiny_encoder_dir, partial)
    cut(partial)
    cache_model(cache, "someorg/tiny-bert", partial)
    assert hub.cached_snapshot("someorg/tiny-bert") is None
    with pytest.raises(ModelLoadError, match="the hub did not give it"):
        Encoder.load(ResolvedModel("someorg/tiny-bert", PROFILE), device="cpu")
    assert asked_once(lookups)


def test_a_sharded_snapshot_with_every_shard_is_the_model(
    cache: Path, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    shutil.copytree(tiny_encoder_dir, whole)
    half_the_shards(whole)
    (whole / "model-00002-of-00002.safetensors").write_text("the second shard")
    snapshot = cache_model(cache, "someorg/tiny-bert", whole)
    assert hub.cached_snapshot("someorg/tiny-bert") == snapshot


def test_offline_mode_never_asks(
    cache: Path, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        Encoder.load(ResolvedModel("someorg/not-cached", PROFILE), device="cpu")
    assert lookups == []


def test_a_name_that_is_no_id_says_so(cache: Path, lookups: list[str]) -> None:
    with pytest.raises(ModelLoadError, match="neither a folder nor a hub id"):
        Encoder.load(ResolvedModel("not a model!", PROFILE), device="cpu")
    assert lookups == []


@pytest.mark.parametrize(
    "weights",
    [
        ["model.safetensors", "pytorch_model.bin"],
        ["pytorch_model.bin"],
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
        ],
    ],
)
def test_a_download_takes_one_copy_of_the_top_level_weights(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: list[str]
) -> None:
    # The hub cannot be reached here: its file list and snapshot_download are replaced by a
    # local repository, copied by the patterns asked for (huggingface_hub's own matching).
    remote = tmp_path / "remote"
    others = [
        "config.json",
        "vocab.txt",
        "README.md",
        ".gitattributes",
        "onnx/model.onnx",
        "openvino/openvino_model.bin",
        "2_Dense/model.safetensors",
        "flax_model.msgpack",
    ]
    for name in [*others, *weights]:
        (remote / name).parent.mkdir(parents=True, exist_ok=True)
        (remote / name).write_text(name)
    names = sorted(p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file())

    class Api:
        def model_info(self, repo_id: str, timeout: float | None = None) -> Any:
            assert timeout is not None  # the hub is given a time limit
            return SimpleNamespace(siblings=[SimpleNamespace(rfilename=n) for n in names])

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        local = cache / "snapshot"
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(remote / name, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    directory = hub.model_directory("someorg/remote", what="model", setting="RAG_EMBED_MODEL")
    got = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    safetensors = [w for w in weights if "safetensors" in w]
    assert got == sorted(["config.json", "vocab.txt", *(safetensors or weights)])


def test_a_training_base_by_hub_id_reads_the_cache(
    cache: Path, lookups: list[str], tiny_reranker_dir: Path
) -> None:
    cache_model(cache, "someorg/tiny-reranker", tiny_reranker_dir)
    _, _, fresh_head = load_base("someorg/tiny-reranker")
    assert not fresh_head  # the cached cross-encoder's own head
    assert lookups == []
    with pytest.raises(ModelLoadError, match=r"base model 'someorg/not-cached'.*--base"):
        load_base("someorg/not-cached")
