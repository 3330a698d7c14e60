"""The encoder's batching: one tokenisation per text, the prefetch thread, device-aware batch
sizes, and halving the batch after an out-of-memory. The oracle is the straightforward path the
encoder used before: the tokenizer's own truncation and padding, one forward pass per batch."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rag_retriever.errors import ConfigError
from rag_retriever.models.device import AUTO_BATCH_SIZE, choose_precision
from rag_retriever.models.encoder import (
    Encoder,
    Prefetch,
    TokenBatch,
    embed_batch,
    tokenize,
)
from tests.conftest import WORDS, OutOfMemoryAbove

TEXTS = st.lists(
    st.lists(st.sampled_from([*WORDS, "naïve", "x" * 30, "!"]), min_size=0, max_size=90).map(
        " ".join
    ),
    min_size=1,
    max_size=12,
)


def _reference(encoder: Encoder, texts: list[str]) -> tuple[np.ndarray, int, int]:
    """Vectors, truncation count and token count as the encoder computed them before: lengths
    from one tokenizer call, each batch tokenised again with truncation and padding."""
    lengths = [len(x) for x in encoder.tokenizer(texts, truncation=False)["input_ids"]]
    with torch.inference_mode():
        vectors = embed_batch(
            encoder.model,
            encoder.tokenizer,
            texts,
            pooling=encoder.profile.pooling,
            max_length=encoder.max_seq_length,
            device="cpu",
        )
    window = encoder.max_seq_length
    return (
        vectors.numpy(),
        sum(n > window for n in lengths),
        sum(min(n, window) for n in lengths),
    )


@given(texts=TEXTS)
def test_one_tokenisation_gives_the_tokenizers_own_truncation_and_padding(
    tiny_encoder: Encoder, texts: list[str]
) -> None:
    tok = tiny_encoder.tokenizer
    tokens = tokenize(tok, texts, tiny_encoder.max_seq_length)
    assert tokens.lengths == [len(x) for x in tok(texts, truncation=False)["input_ids"]]
    batches = list(tokens.batches(len(texts)))
    assert len(batches) == 1
    (batch,) = batches
    order = [int(i) for i in batch.rows]
    expected = tok(
        [texts[i] for i in order],
        padding=True,
        truncation=True,
        max_length=tiny_encoder.max_seq_length,
        return_tensors="pt",
    )
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(batch.tensors[key], expected[key]), key


@given(texts=TEXTS, batch_size=st.integers(1, 5))
def test_vectors_and_counts_equal_the_reference(
    tiny_encoder_dir: Any, texts: list[str], batch_size: int
) -> None:
    encoder = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32", batch_size=batch_size)
    ours = encoder.encode_passages(texts)
    vectors, truncated, n_tokens = _reference(encoder, texts)
    np.testing.assert_allclose(ours.vectors, vectors, atol=1e-5)
    assert (ours.truncated, ours.n_tokens) == (truncated, n_tokens)


@given(texts=TEXTS, batch_size=st.integers(1, 5))
def test_prepared_encoding_is_encode_passages(
    tiny_encoder_dir: Any, texts: list[str], batch_size: int
) -> None:
    """The ingest's two steps (tokenise in one stage, encode in the next) give the reference's
    vectors and counts, as `encode_passages` does."""
    encoder = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32", batch_size=batch_size)
    ours = encoder.encode_prepared(encoder.prepare_passages(texts))
    vectors, truncated, n_tokens = _reference(encoder, texts)
    np.testing.assert_allclose(ours.vectors, vectors, atol=1e-5)
    assert (ours.truncated, ours.n_tokens) == (truncated, n_tokens)


def test_many_sort_windows_keep_the_input_order(tiny_encoder: Encoder) -> None:
    """More texts than one sort window (batch 4 x 32): rows come back where they were."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 40))) for _ in range(300)]
    ours = tiny_encoder.encode_passages(texts)
    vectors, truncated, n_tokens = _reference(tiny_encoder, texts)
    np.testing.assert_allclose(ours.vectors, vectors, atol=1e-5)
    assert (ours.truncated, ours.n_tokens) == (truncated, n_tokens)


@pytest.mark.model
def test_minilm_lengths_and_truncation_counts_are_unchanged(minilm: Encoder) -> None:
    texts = ["Normans " * 300, "a short one", "naïve café — ünïcode " * 80, ""]
    tokens = tokenize(minilm.tokenizer, texts, minilm.max_seq_length)
    full = minilm.tokenizer(texts, truncation=False)["input_ids"]
    cut = minilm.tokenizer(texts, truncation=True, max_length=minilm.max_seq_length)["input_ids"]
    assert tokens.lengths == [len(x) for x in full]
    assert tokens.ids == cut
    assert tokens.truncated == 2


def _encoder_around(tiny: Encoder, model: torch.nn.Module, batch_size: int) -> Encoder:
    return Encoder(
        model,  # type: ignore[arg-type]
        tiny.tokenizer,
        tiny.profile,
        precision=tiny.precision,
        weights_sha256="x",
        max_seq_length=tiny.max_seq_length,
        batch_size=batch_size,
    )


def test_an_out_of_memory_halves_the_batch_once_with_one_warning(
    tiny_encoder: Encoder, caplog: pytest.LogCaptureFixture
) -> None:
    texts = [" ".join(WORDS[i : i + 5 + i % 7]) for i in range(20)]
    wrapped = OutOfMemoryAbove(tiny_encoder.model, rows=3)
    encoder = _encoder_around(tiny_encoder, wrapped, batch_size=8)
    with caplog.at_level(logging.WARNING, logger="rag_retriever.models.encoder"):
        result = encoder.encode_passages(texts)
        again = encoder.encode_passages(texts)
    np.testing.assert_allclose(result.vectors, _reference(tiny_encoder, texts)[0], atol=1e-5)
    np.testing.assert_allclose(again.vectors, result.vectors, atol=1e-6)
    assert wrapped.calls[:3] == [8, 4, 2]  # 8 failed, 4 failed, 2 ran
    assert max(wrapped.calls[3:]) == 2  # and stayed halved, in this call and the next
    assert not any(wrapped.in_handler)  # each retry after the failed pass was let go
    warnings = [r for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(warnings) == 1


def test_an_out_of_memory_at_one_text_is_raised(tiny_encoder: Encoder) -> None:
    encoder = _encoder_around(tiny_encoder, OutOfMemoryAbove(tiny_encoder.model, rows=0), 4)
    with pytest.raises(torch.OutOfMemoryError):
        encoder.encode_passages(["red wine", "blue river"])
    assert not [t for t in threading.enumerate() if t.name == "encoder-prefetch"]


def test_the_prefetch_thread_raises_its_error_in_the_caller_and_stops() -> None:
    def batches() -> Iterator[TokenBatch]:
        yield TokenBatch(np.array([0]), {})
        raise ValueError("tokenizer broke")

    prefetch = Prefetch(batches(), depth=1)
    seen: list[TokenBatch] = []
    with pytest.raises(ValueError, match="tokenizer broke"):
        seen.extend(prefetch)
    prefetch.close()
    assert len(seen) == 1


def test_a_consumer_that_stops_early_stops_the_thread() -> None:
    def endless() -> Iterator[TokenBatch]:
        while True:
            yield TokenBatch(np.array([0]), {})

    prefetch = Prefetch(endless(), depth=2)
    next(iter(prefetch))
    prefetch.close()  # returns: the thread saw the stop while the queue was full
    assert not [t for t in threading.enumerate() if t.name == "encoder-prefetch"]


def test_batch_size_auto_is_the_devices_default(tiny_encoder_dir: Any) -> None:
    encoder = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32")
    assert encoder.batch_size == AUTO_BATCH_SIZE["cpu"] == 32
    with pytest.raises(ConfigError, match="positive integer or auto"):
        Encoder.load(str(tiny_encoder_dir), device="cpu", batch_size=0)
    assert choose_precision("cpu", "fp32").device.type == "cpu"
