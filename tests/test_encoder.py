"""The encoder: masked pooling, batch invariance, unit vectors, truncation counts, fingerprints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_retriever.errors import ConfigError, ModelLoadError
from rag_retriever.models.encoder import Encoder, hash_weights, masked_mean, pool
from rag_retriever.models.profiles import ModelProfile, resolve_model, write_profile_file


def test_masked_mean_equals_hand_computed_mean() -> None:
    hidden = torch.tensor(
        [[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]], [[5.0, 6.0], [0.0, 0.0], [9.0, 9.0]]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    expected = torch.tensor([[(1 + 3) / 2, (2 + 4) / 2], [(5 + 9) / 2, (6 + 9) / 2]])
    assert torch.allclose(masked_mean(hidden, mask), expected)


def test_cls_pooling_takes_each_row_s_first_real_token_whichever_side_pads() -> None:
    """Right padding: position 0; left padding: the first position the mask holds (position 0
    was a pad token's state there, so a vector depended on its batch-mates)."""
    hidden = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    left = torch.tensor([[0, 1, 1], [0, 0, 1]])
    assert torch.equal(pool(hidden, right, "cls"), hidden[:, 0])
    assert torch.equal(pool(hidden, left, "cls"), torch.stack([hidden[0, 1], hidden[1, 2]]))


def test_pooling_uses_only_real_tokens(tiny_encoder: Encoder) -> None:
    """The pooled vector equals a hand-masked mean of the model's own hidden states."""
    text = "alpha bravo charlie"
    batch = tiny_encoder.tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        hidden = tiny_encoder.model(**batch).last_hidden_state[0]
    manual = hidden.mean(dim=0)
    manual = manual / manual.norm()
    ours = tiny_encoder.encode_passages([text]).vectors[0]
    np.testing.assert_allclose(ours, manual.numpy(), atol=1e-5)


def test_vector_does_not_depend_on_batch_mates(tiny_encoder: Encoder) -> None:
    short = "red wine"
    alone = tiny_encoder.encode_passages([short]).vectors[0]
    long_mates = ["the king of france and the queen of london " * 4, short, "pear"]
    together = tiny_encoder.encode_passages(long_mates).vectors[1]
    np.testing.assert_allclose(alone, together, atol=1e-5)


def test_vectors_are_unit_length_and_keep_input_order(tiny_encoder: Encoder) -> None:
    texts = ["a", "the river and the mountain " * 3, "blue", "king queen war peace"]
    out = tiny_encoder.encode_passages(texts).vectors
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    for i, t in enumerate(texts):  # smart batching sorted them; order must be restored
        np.testing.assert_allclose(out[i], tiny_encoder.encode_passages([t]).vectors[0], atol=1e-5)


def test_inputs_beyond_the_window_are_counted(tiny_encoder: Encoder) -> None:
    long = "alpha " * 200  # the tiny profile's window is 64 tokens
    result = tiny_encoder.encode_passages([long, "short"])
    assert result.truncated == 1
    assert result.n_tokens == 64 + len(tiny_encoder.tokenizer("short")["input_ids"])


def test_prefixes_come_from_the_profile(tiny_encoder_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_encoder_dir, tmp_path / "prefixed"))
    write_profile_file(copy, ModelProfile("tiny-prefixed", "query: ", "passage: ", "mean", 64))
    plain = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32")
    prefixed = Encoder.load(str(copy), device="cpu", dtype="fp32")
    np.testing.assert_allclose(
        prefixed.encode_queries(["red"]).vectors,
        plain.encode_passages(["query: red"]).vectors,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        prefixed.encode_passages(["red"]).vectors,
        plain.encode_passages(["passage: red"]).vectors,
        atol=1e-5,
    )
    assert prefixed.fingerprint.id != plain.fingerprint.id


def test_fingerprint_follows_weights_and_settings(tiny_encoder_dir: Path, tmp_path: Path) -> None:
    a = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32")
    b = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32")
    assert a.fingerprint == b.fingerprint
    cls_profile = resolve_model(str(tiny_encoder_dir), pooling="cls")
    assert Encoder.load(cls_profile, device="cpu").fingerprint.id != a.fingerprint.id
    changed = Path(shutil.copytree(tiny_encoder_dir, tmp_path / "changed"))
    weights = next(changed.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")
    assert hash_weights(changed) != hash_weights(tiny_encoder_dir)
    data = a.fingerprint.to_json()
    assert data["id"] == a.fingerprint.id and data["dim"] == 32


def test_model_profiles_by_family() -> None:
    minilm = resolve_model("all-MiniLM-L6-v2")
    assert (minilm.profile.query_prefix, minilm.profile.pooling) == ("", "mean")
    assert Path(minilm.source).is_dir()
    e5 = resolve_model("intfloat/e5-small-v2")
    assert (e5.profile.query_prefix, e5.profile.passage_prefix, e5.profile.pooling) == (
        "query: ",
        "passage: ",
        "mean",
    )
    bge = resolve_model("BAAI/bge-small-en-v1.5")
    assert bge.profile.pooling == "cls" and bge.profile.query_prefix.startswith("Represent")


def test_a_model_path_that_is_no_folder_is_named_as_such(tmp_path: Path) -> None:
    # not "no profile is known", which sends a user to set prefixes for a typo in a path
    with pytest.raises(ModelLoadError, match="no such directory; set RAG_EMBED_MODEL"):
        resolve_model(str(tmp_path / "no-such-model"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file, not a directory"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_unknown_model_needs_explicit_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="RAG_QUERY_PREFIX, RAG_PASSAGE_PREFIX and RAG_POOLING"):
        resolve_model("acme/secret-embedder")
    explicit = resolve_model(
        "acme/secret-embedder", query_prefix="q: ", passage_prefix="", pooling="cls"
    )
    assert explicit.profile.pooling == "cls"


def test_unloadable_model_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "rag_profile.json").write_text(json.dumps(ModelProfile("x", "", "", "mean").to_json()))
    with pytest.raises(ModelLoadError, match="cannot load embedding model"):
        Encoder.load(str(bad), device="cpu")


@pytest.mark.model
def test_minilm_matches_sentence_transformers(minilm: Encoder) -> None:
    from sentence_transformers import SentenceTransformer

    texts = ["Normans were the people who gave their name to Normandy.", "BM25 scores terms."]
    ref = SentenceTransformer(resolve_model("all-MiniLM-L6-v2").source, device="cpu").encode(
        texts, normalize_embeddings=True
    )
    ours = (
        Encoder.load("all-MiniLM-L6-v2", device="cpu", dtype="fp32").encode_passages(texts).vectors
    )
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    # The default (bf16 on CPUs that have it) stays within rounding of fp32.
    assert np.min(np.sum(minilm.encode_passages(texts).vectors * ref, axis=1)) > 0.995


def test_a_local_model_dir_needs_no_bundled_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory named after a known family resolves to that family's profile when the
    packaged MiniLM is not installed (as on a machine given only the model's files); before,
    comparing the path with the missing package's raised ConfigError."""

    def not_installed() -> Path:
        raise ConfigError("the default model comes from a package that is not installed")

    monkeypatch.setattr("rag_retriever.models.profiles._bundled_minilm", not_installed)
    directory = tmp_path / "all-MiniLM-L6-v2"
    directory.mkdir()
    resolved = resolve_model(str(directory))
    assert resolved.profile.name == "all-MiniLM-L6-v2"
    assert resolved.source == str(directory.resolve())
