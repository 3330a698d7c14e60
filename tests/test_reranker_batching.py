"""The cross-encoder's batching: each pair tokenised once, batches sorted by token length, one
copy of the scores per call; the oracle is the path it replaced (each batch tokenised with the
tokenizer's own truncation and padding). Also where weights are held in half precision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForSequenceClassification

from rag_retriever.models.device import (
    AUTO_RERANK_BATCH_SIZE,
    Precision,
    for_inference,
    holds_half_weights,
    inference,
)
from rag_retriever.models.linear import PackedLinear, can_pack
from rag_retriever.models.reranker import CrossEncoderReranker
from tests.conftest import WORDS


def _reference(reranker: CrossEncoderReranker, query: str, passages: list[str]) -> tuple:
    tok = reranker.tokenizer
    full = tok([query] * len(passages), passages, truncation=False)["input_ids"]
    truncated = sum(len(ids) > reranker.max_length for ids in full)
    query_len = len(tok(query)["input_ids"])
    strategy = "only_second" if query_len < reranker.max_length - 8 else "longest_first"
    scores = []
    with torch.inference_mode():
        for p in passages:  # one at a time: no padding at all
            batch = tok(
                [query],
                [p],
                truncation=strategy,
                max_length=reranker.max_length,
                return_tensors="pt",
            )
            scores.append(float(reranker.logits(dict(batch))[0]))
    return np.array(scores, dtype=np.float32), truncated


passage = st.lists(st.sampled_from(WORDS), min_size=0, max_size=80).map(" ".join)


@given(
    query=st.lists(st.sampled_from(WORDS), min_size=1, max_size=70).map(" ".join),
    passages=st.lists(passage, min_size=1, max_size=9),
    batch_size=st.integers(1, 4),
)
def test_scores_and_truncation_equal_the_reference(
    tiny_reranker_dir: Path, query: str, passages: list[str], batch_size: int
) -> None:
    reranker = CrossEncoderReranker.load(
        tiny_reranker_dir, device="cpu", dtype="fp32", batch_size=batch_size, max_length=64
    )
    ours = reranker.score(query, passages)
    scores, truncated = _reference(reranker, query, passages)
    np.testing.assert_allclose(ours.scores, scores, atol=1e-5)
    assert ours.truncated == truncated


def test_batches_are_sorted_by_tokens_not_characters(tiny_reranker_dir: Path) -> None:
    reranker = CrossEncoderReranker.load(tiny_reranker_dir, device="cpu", dtype="fp32")
    # "qdrant" is one token in 6 characters; "x y z ..." one token per 2 characters
    passages = ["qdrant " * 6, "x " * 20, "a"]
    tokens = reranker.tokenize_pairs("q", passages)
    (first, *_) = list(tokens.batches(1))
    assert first.rows.tolist() == [1]  # the most tokens, not the most characters


def test_half_weights_on_cuda_only() -> None:
    assert holds_half_weights(Precision(torch.device("cuda"), "fp16"))
    assert holds_half_weights(Precision(torch.device("cuda"), "bf16"))
    assert not holds_half_weights(Precision(torch.device("cuda"), "fp32"))
    assert not holds_half_weights(Precision(torch.device("cpu"), "bf16"))  # autocast there


def test_on_the_cpu_only_linear_layers_hold_bf16_packed_and_the_scores_are_autocasts(
    tiny_reranker_dir: Path,
) -> None:
    # The oracle: the same model with every weight in fp32 under bf16 autocast, which casts a
    # linear layer's weight and bias to bf16 on every pass (what the CPU path did before).
    reranker = CrossEncoderReranker.load(tiny_reranker_dir, device="cpu", dtype="bf16")
    model = reranker.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    # packed where this torch has oneDNN (it has on this machine: test_linear.py), else plain
    assert all(isinstance(m, PackedLinear) == can_pack() for m in linears)
    assert {p.dtype for m in linears for p in m.parameters()} == {torch.bfloat16}
    others = {p.dtype for n, p in model.named_parameters() if "LayerNorm" in n or "embeddings" in n}
    assert others == {torch.float32}  # layer norms and embeddings stay exact
    reference = for_inference(  # fp32 weights, with the same CPU attention
        AutoModelForSequenceClassification.from_pretrained(tiny_reranker_dir),
        Precision(torch.device("cpu"), "fp32"),
    )
    pairs = reranker.tokenizer(
        ["who named normandy"] * 3,
        ["the normans gave their name to normandy", "bm25", "a b c d e f g h"],
        padding=True,
        return_tensors="pt",
    )
    with inference(reranker.precision, model):
        assert torch.is_autocast_enabled("cpu")
        ours = model(**pairs).logits
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**pairs).logits
    assert torch.equal(ours, expected)


@pytest.mark.parametrize(
    ("weights", "autocast"),
    [
        ((torch.float32,) * 2, True),
        ((torch.bfloat16,) * 2, False),
        ((torch.bfloat16, torch.float32), True),
    ],
)
def test_autocast_unless_every_weight_has_the_target_dtype(
    weights: tuple[torch.dtype, torch.dtype], autocast: bool
) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2).to(weights[0]), torch.nn.LayerNorm(2).to(weights[1])
    )
    with inference(Precision(torch.device("cpu"), "bf16"), model):
        assert torch.is_autocast_enabled("cpu") is autocast
        model(torch.ones(1, 2, dtype=weights[1]))  # mixed weights run under autocast


def test_batch_size_auto_is_the_devices_default(tiny_reranker_dir: Path) -> None:
    reranker = CrossEncoderReranker.load(tiny_reranker_dir, device="cpu")
    assert reranker.batch_size == AUTO_RERANK_BATCH_SIZE["cpu"] == 32
    assert AUTO_RERANK_BATCH_SIZE["cuda"] >= 100  # the 100 pairs of a request: one pass
    assert CrossEncoderReranker.load(tiny_reranker_dir, device="cpu", batch_size=5).batch_size == 5
