"""Self-attention for CPU inference, a sequence (or a few short ones) at a time.

A tokenizer's batch pads on the right to its longest sequence, and PyTorch's CPU
`scaled_dot_product_attention` (the kernel transformers' `sdpa` calls) over that batch computes
every padded position. Here the batch is cut into groups, each group to its own longest
sequence (a long chunk goes alone, at its own length, with no mask; short queries in groups),
and the padding rows past it are zeros, which nothing reads.

Each group then runs PyTorch's fused kernel (flash attention on the CPU: its scores stay in fp32
and are never written out), with a mask of each sequence's keys only where the group's lengths
differ. The output is written in the layout the output projection reads, (batch, length, heads,
head dim), so nothing copies it again. On 2 cores, 32 chunks of 150-250 tokens, one layer: 17.3
ms against 30.2 ms for the two batched products and softmax this module ran before (2026-12-07;
the products themselves had halved `sdpa` over the padded batch, docs/benchmarks.md "GPU and CPU
speed"), and the encoder 1.16-1.23x faster; its bf16 error against fp32 attention is 1.9-3.7
times smaller than theirs, which rounded each score to bf16.

Any other mask (left padding, a causal part, a bias, one batch row for all), or none (no
padding), goes to `sdpa` over the whole batch as it is. `use_cpu_attention(model)` switches a
transformers model to it; models that do not take a custom attention function keep theirs.
Training (gradients on), dropout, causal and grouped-query attention go to `sdpa` as before, so
only inference changes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

log = logging.getLogger(__name__)

NAME = "rag_cpu_grouped"
# Groups are sized by their scores' fp32 bytes, as when this module wrote the scores out (the
# fused kernel does not). Then: 1 MiB measured best among 1-8 MiB for 16-230 tokens
# on 2 cores (a 170-token sequence's 12 heads already take 1.4 MiB, so it goes alone). With groups
# cut to their length (2026-12-05), 64 KiB to 1 MiB encoded passages alike and 1 MiB batched
# queries fastest: 1,300-1,400 a second against ~1,100 at 64 KiB and ~800 one per group. With the
# fused kernel (2026-12-07), which never writes the scores, 1 and 4 MiB ran alike on 32 sequences
# of 12-250 tokens (within 10% either way), so the grouping stayed.
GROUP_SCORE_BYTES = 1 << 20
# A padded key's additive mask is at most this (exp(score + mask) is 0 in fp32 for any real
# score), or the mask is not taken for right padding.
PADDING_MASK_AT_MOST = -1e4


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query, key, value (batch, heads, length, head dim);
    `attention_mask` is `eager`'s additive mask (0 = attend, the dtype's minimum = not) or None;
    returns the output as (batch, length, heads, head dim).

    Where the mask only pads keys on the right (a tokenizer's batch), each group is cut to its
    longest sequence, so no padding is computed and a group of equal lengths needs no mask; the
    rows of padding past that length are zeros (nothing reads them: a padded key is masked in
    the next layer and pooling skips padding). Anything else goes to transformers' `sdpa`."""
    batch, heads, q_len, dim = query.shape
    k_len = key.shape[2]
    causal = attention_mask is None and getattr(module, "is_causal", False)
    # a bias, attention sinks or soft-capping (T5's position bias, ...) are `sdpa`'s to apply
    extras = any(kwargs.get(name) is not None for name in ("position_bias", "s_aux", "softcap"))
    plain = not (
        torch.is_grad_enabled() or dropout > 0 or causal or key.shape[1] != heads or extras
    )
    lengths = right_padding_lengths(attention_mask, q_len, k_len) if plain else None
    if lengths is None or len(lengths) != batch:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = dim**-0.5 if scaling is None else scaling
    group = max(1, GROUP_SCORE_BYTES // (heads * q_len * k_len * 4))
    return _attend_by_length(query, key, value, lengths, scale=scale, group=group), None


def _attend_by_length(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
    *,
    scale: float,
    group: int,
) -> torch.Tensor:
    """Attention of right-padded sequences, `group` at a time, each group cut to its longest
    sequence: PyTorch's fused CPU kernel (`scaled_dot_product_attention`, which keeps its scores
    in fp32 and never writes them out) over the real tokens only, with a mask of each
    sequence's keys only where a group's lengths differ. Returns (batch, length, heads, head
    dim), contiguous: the layout the output projection reads, so nothing copies it again. A
    sequence with no real token (no tokenizer makes one) gets zeros, the kernel's answer for a
    row whose keys are all masked (a test holds it to that)."""
    batch, heads, q_len, _ = query.shape
    out = value.new_zeros((batch, q_len, heads, value.shape[-1]))
    for start in range(0, len(lengths), group):
        stop = min(len(lengths), start + group)
        n = max(lengths[start:stop])
        if n == 0:
            continue
        mask = None
        if min(lengths[start:stop]) < n:
            real = torch.tensor(lengths[start:stop], device=query.device)
            mask = (torch.arange(n, device=query.device) < real[:, None])[:, None, None, :]
        out[start:stop, :n] = torch.nn.functional.scaled_dot_product_attention(
            query[start:stop, :, :n],
            key[start:stop, :, :n],
            value[start:stop, :, :n],
            attn_mask=mask,
            scale=scale,
        ).transpose(1, 2)
    return out


def right_padding_lengths(mask: torch.Tensor | None, q_len: int, k_len: int) -> list[int] | None:
    """The number of real tokens of each sequence when `mask` (batch, 1, q_len, k_len) masks only
    keys padded on the right, the same for every query row (what `eager` builds from a
    tokenizer's batch); None for no mask or any other mask, which is then applied as it is.
    Within `one_pass()` the answer is kept per mask (every layer of a pass gets the same one)."""
    if mask is None or q_len != k_len or mask.dim() != 4 or mask.shape[1:] != (1, q_len, k_len):
        return None
    memo = _PASS_MASKS.get()
    if memo is not None and id(mask) in memo:
        return memo[id(mask)][1]
    lengths = _right_padding_lengths(mask, k_len)
    if memo is not None:  # the mask is held with its answer: its id is not reused in the pass
        memo[id(mask)] = (mask, lengths)
    return lengths


# Masks seen in the current forward pass (`one_pass`) and their lengths.
_PASS_MASKS: ContextVar[dict[int, tuple[torch.Tensor, list[int] | None]] | None] = ContextVar(
    "rag_pass_masks", default=None
)


@contextlib.contextmanager
def one_pass() -> Iterator[None]:
    """Within: one forward pass, whose masks nothing changes in place, so each mask is checked
    once instead of once a layer (~0.4 ms for 32 x 170 tokens, 2.6% of a pass)."""
    token = _PASS_MASKS.set({})
    try:
        yield
    finally:
        _PASS_MASKS.reset(token)


def _right_padding_lengths(mask: torch.Tensor, k_len: int) -> list[int] | None:
    row = mask[:, 0, 0, :]
    real = row == 0
    lengths = real.sum(-1)
    if not torch.equal(real, torch.arange(k_len, device=mask.device) < lengths[:, None]):
        return None  # not right padding
    # exp(score + mask) must be exactly 0 on a padded key, as it is for the dtype's minimum
    if bool((row[~real] > PADDING_MASK_AT_MOST).any()):
        return None
    if not torch.equal(mask, row[:, None, None, :].expand_as(mask)):
        return None  # query rows that differ
    return [int(n) for n in lengths.tolist()]


AttentionInterface.register(NAME, grouped_attention)
AttentionMaskInterface.register(NAME, eager_mask)


def use_cpu_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch `model` (a transformers model about to run on the CPU) to `grouped_attention`;
    a model that takes no custom attention function keeps its own (logged at debug level)."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return model
    try:
        setter(NAME)
    except (ValueError, TypeError, NotImplementedError) as exc:
        log.debug("%s keeps its attention: %s", type(model).__name__, exc)
    return model
