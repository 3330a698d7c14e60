"""The CPU attention (rag_retriever/models/attention.py) against PyTorch's own scaled dot-product
attention: the same output in fp32, the same hidden states of a whole model with padding, and
the `sdpa` path itself wherever it is not meant to apply (gradients, dropout, causal)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from rag_retriever.models import attention
from rag_retriever.models.attention import NAME, grouped_attention, use_cpu_attention
from rag_retriever.models.device import Precision, for_inference
from tests.conftest import build_tiny_bert


class Bidirectional(torch.nn.Module):
    is_causal = False


def padded(batch: int, heads: int, length: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v in transformers' (batch, heads, length, dim) layout, the lengths of the rows
    (the first is full) and the additive mask `eager` builds for them."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, length, heads, dim, generator=gen).transpose(1, 2) for _ in "qkv")
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    keep = torch.arange(length)[None, :] < lengths[:, None]
    mask = torch.zeros(batch, 1, length, length)
    mask.masked_fill_(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    return q, k, v, keep, mask


@pytest.mark.parametrize(
    ("batch", "length"),
    # one sequence; groups of many short ones (with a remainder); one per group (170 tokens)
    [(1, 5), (37, 16), (9, 64), (3, 170)],
)
def test_grouped_attention_equals_pytorch_sdpa(batch: int, length: int) -> None:
    q, k, v, keep, mask = padded(batch, 4, length, 8, seed=length)
    with torch.inference_mode():
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep[:, None, None, :]
        ).transpose(1, 2)
        out, weights = grouped_attention(Bidirectional(), q, k, v, mask)
        unmasked, _ = grouped_attention(Bidirectional(), q, k, v, None)
        expected_unmasked = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert weights is None
    assert out.shape == (batch, length, 4, 8)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unmasked, expected_unmasked.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_groups_are_sized_by_the_score_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of one sequence's scores gives groups of one; the result does not change."""
    q, k, v, _, mask = padded(6, 2, 12, 8, seed=3)
    with torch.inference_mode():
        together, _ = grouped_attention(Bidirectional(), q, k, v, mask)
        monkeypatch.setattr(attention, "GROUP_SCORE_BYTES", 2 * 12 * 12 * 4)
        alone, _ = grouped_attention(Bidirectional(), q, k, v, mask)
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-6)


def test_gradients_dropout_and_causal_attention_go_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        calls.append("sdpa")
        return torch.zeros(1), None

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    q, k, v, _, mask = padded(2, 2, 6, 4, seed=1)
    causal = Bidirectional()
    causal.is_causal = True
    grouped_attention(Bidirectional(), q.requires_grad_(), k, v, mask)  # gradients on
    with torch.inference_mode():
        grouped_attention(Bidirectional(), q, k, v, mask, dropout=0.1)
        grouped_attention(causal, q, k, v, None)
        grouped_attention(Bidirectional(), q, k[:, :1], v[:, :1], mask)  # grouped-query
        assert len(calls) == 4
        grouped_attention(Bidirectional(), q, k, v, mask)
    assert len(calls) == 4


def test_a_model_on_the_cpu_gives_the_hidden_states_of_sdpa(tmp_path: Path) -> None:
    directory = build_tiny_bert(tmp_path / "bert", hidden=64)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(
        ["the normans gave their name to normandy", "bm25", "a b c d e f g h i j k l"],
        padding=True,
        return_tensors="pt",
    )
    reference = AutoModel.from_pretrained(directory, attn_implementation="sdpa").eval()
    model: Any = for_inference(
        AutoModel.from_pretrained(directory), Precision(torch.device("cpu"), "fp32")
    )
    assert model.config._attn_implementation == NAME
    real = batch["attention_mask"].bool()
    with torch.inference_mode():
        expected = reference(**batch).last_hidden_state[real]
        torch.testing.assert_close(
            model(**batch).last_hidden_state[real], expected, atol=1e-5, rtol=1e-5
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = model(**batch).last_hidden_state[real].float()
    cosine = torch.nn.functional.cosine_similarity(half, expected, dim=-1)
    assert cosine.min() > 0.99
    # Training the same model: gradients flow (through sdpa) as before.
    model.train()
    model(**batch).last_hidden_state.sum().backward()
    assert model.embeddings.word_embeddings.weight.grad is not None


def test_a_model_without_custom_attention_is_left_alone() -> None:
    linear = torch.nn.Linear(2, 2)
    assert use_cpu_attention(linear) is linear
