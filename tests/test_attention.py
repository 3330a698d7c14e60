"""The CPU attention (rag_retriever/models/attention.py) against PyTorch's own scaled dot-product
attention: the same output in fp32 on every real token (padding past a group's longest sequence
is zeros), any other mask applied as it is, the same hidden states of a whole model with padding,
and the `sdpa` path itself wherever it is not meant to apply (gradients, dropout, causal)."""

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
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(unmasked, expected_unmasked.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_in_bf16_it_is_fp32_attention_to_within_bf16_rounding() -> None:
    """Under bf16 the fused kernel keeps its scores in fp32: the output is fp32 attention of the
    bf16 inputs rounded to bf16 (2^-8 relative), plus a little for the kernel's own roundings."""
    q, k, v, keep, mask = padded(12, 12, 40, 32, seed=11)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    with torch.inference_mode():
        out, _ = grouped_attention(Bidirectional(), q, k, v, mask)
        exact = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=keep[:, None, None, :]
        ).transpose(1, 2)
    assert out.dtype == torch.bfloat16
    error = (out.float() - exact)[keep].abs()
    assert (error <= 2.0**-7 * exact[keep].abs() + 2.0**-9).all()


def test_an_empty_sequence_beside_others_gives_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence whose every key is padding (no tokenizer makes one, a caller might) shares a
    group with real ones: its rows are zeros, and the others' are still right."""
    q, k, v, keep, mask = padded(4, 2, 6, 8, seed=3)
    mask[2] = torch.finfo(torch.float32).min  # sequence 2 has no real key
    keep[2] = False
    monkeypatch.setattr(attention, "sdpa_attention_forward", None)  # not the fallback: the groups
    with torch.inference_mode():
        out, _ = grouped_attention(Bidirectional(), q, k, v, mask)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep[:, None, None, :]
        ).transpose(1, 2)
    assert (out[2] == 0).all()
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=1e-5)


def test_padding_past_a_sequence_alone_is_zeros_and_never_computed() -> None:
    """A sequence that goes alone is cut to its length: its padded rows are zeros, whatever the
    padded positions hold (NaN here, which would poison any product that read them)."""
    q, k, v, keep, mask = padded(3, 12, 170, 8, seed=5)  # one 170-token sequence a group
    for tensor in (q, k, v):
        tensor.transpose(1, 2)[~keep] = float("nan")
    with torch.inference_mode():
        out, _ = grouped_attention(Bidirectional(), q, k, v, mask)
    assert torch.isfinite(out[keep]).all()
    assert (out[~keep] == 0).all()


def test_any_other_mask_is_applied_as_it_is() -> None:
    """Left padding, a mask that differs between query rows, and a soft bias are not right
    padding: every row is computed with the mask added, as `sdpa` does."""
    q, k, v, keep, _ = padded(4, 2, 10, 8, seed=7)
    left = keep.flip(-1)
    left_mask = torch.zeros(4, 1, 10, 10).masked_fill_(~left[:, None, None, :], -3e38)
    causal = torch.full((10, 10), -3e38).triu(1).expand(4, 1, 10, 10)
    bias = torch.randn(4, 1, 10, 10)
    with torch.inference_mode():
        for mask in (left_mask, causal, bias):
            out, _ = grouped_attention(Bidirectional(), q, k, v, mask)
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_right_padding_lengths_only_for_a_tokenizers_padding() -> None:
    _, _, _, keep, mask = padded(5, 2, 9, 4, seed=2)
    assert attention.right_padding_lengths(mask, 9, 9) == keep.sum(-1).tolist()
    assert attention.right_padding_lengths(None, 9, 9) is None
    assert attention.right_padding_lengths(mask, 9, 8) is None
    assert attention.right_padding_lengths(mask.flip(-1), 9, 9) is None  # left padding
    mild = mask.clamp(min=-5.0)  # exp(score - 5) is not 0: not padding
    assert attention.right_padding_lengths(mild, 9, 9) is None
    rows_differ = mask.clone()
    rows_differ[0, 0, 3, 8] = -3e38
    assert attention.right_padding_lengths(rows_differ, 9, 9) is None
    # outside a pass nothing is kept: a mask changed in place is checked again
    assert attention.right_padding_lengths(mask, 9, 9) is not None
    changed = mask.clone()
    assert attention.right_padding_lengths(changed, 9, 9) is not None
    changed[0, 0, 2, 0] = -3e38
    assert attention.right_padding_lengths(changed, 9, 9) is None


def test_a_pass_checks_each_mask_once(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    real_check = attention._right_padding_lengths

    def spy(mask: torch.Tensor, k_len: int) -> list[int] | None:
        checked.append(id(mask))
        return real_check(mask, k_len)

    monkeypatch.setattr(attention, "_right_padding_lengths", spy)
    _, _, _, keep, mask = padded(3, 2, 7, 4, seed=4)
    other = mask.clone()
    with attention.one_pass():
        for _ in range(6):  # six layers
            assert attention.right_padding_lengths(mask, 7, 7) == keep.sum(-1).tolist()
        attention.right_padding_lengths(other, 7, 7)
    assert checked == [id(mask), id(other)]
    attention.right_padding_lengths(mask, 7, 7)  # after the pass: checked again
    assert len(checked) == 3


def test_groups_are_sized_by_the_score_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of one sequence's scores gives groups of one; the result does not change."""
    q, k, v, keep, mask = padded(6, 2, 12, 8, seed=3)
    kernel = torch.nn.functional.scaled_dot_product_attention
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    monkeypatch.setattr(attention, "sdpa_attention_forward", None)  # the groups, never sdpa
    with torch.inference_mode():
        together, _ = grouped_attention(Bidirectional(), q, k, v, mask)
        assert len(calls) == 1
        monkeypatch.setattr(attention, "GROUP_SCORE_BYTES", 2 * 12 * 12 * 4)
        alone, _ = grouped_attention(Bidirectional(), q, k, v, mask)
        assert len(calls) == 1 + 6
    torch.testing.assert_close(together[keep], alone[keep], atol=1e-6, rtol=1e-6)


def test_gradients_dropout_causal_and_other_masks_go_to_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
        grouped_attention(Bidirectional(), q, k, v, None)  # no padding at all
        grouped_attention(Bidirectional(), q, k, v, mask.flip(-1))  # left padding
        grouped_attention(Bidirectional(), q, k, v, mask[:1])  # one mask row for the batch
        grouped_attention(Bidirectional(), q, k, v, mask, position_bias=torch.zeros(1))  # T5's
        assert len(calls) == 8
        grouped_attention(Bidirectional(), q, k, v, mask, position_bias=None)  # the groups
    assert len(calls) == 8


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
