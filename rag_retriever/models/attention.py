"""Self-attention for CPU inference, a sequence (or a few short ones) at a time.

PyTorch's CPU `scaled_dot_product_attention` (the kernel transformers' `sdpa` calls) runs at a
tenth of the speed of the linear layers around it for MiniLM's 32-wide heads: on 2 cores, a
batch of 32 chunks of ~170 tokens spent 37% of its encoding time in attention against 47% in
all the matrix products of the linear layers, which do 13x the arithmetic. Computed instead as
two batched matrix products per group of sequences, the group sized to stay in the cache, the
same attention takes about half the time (docs/benchmarks.md, "GPU and CPU speed").

A tokenizer's batch pads on the right, so each group is cut to its longest sequence: a long
chunk goes alone, at its own length, with no mask to add and no padding computed. The scale is
applied inside the first product (`baddbmm`), and the softmax takes and gives the scores' dtype
(it accumulates in fp32), so a bf16 pass makes no fp32 copy of its scores. Under bf16 autocast
the result is the same attention to within bf16 rounding: each score is rounded to bf16 once.

`use_cpu_attention(model)` switches a transformers model to it; models that do not take a custom
attention function keep theirs. Training (gradients on), dropout, causal and grouped-query
attention go to `sdpa` as before, so only inference changes.
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
# Score bytes (fp32) per group of sequences: 1 MiB measured best among 1-8 MiB for 16-230 tokens
# on 2 cores (a 170-token sequence's 12 heads already take 1.4 MiB, so it goes alone). With groups
# cut to their length (2026-12-05), 64 KiB to 1 MiB encoded passages alike and 1 MiB batched
# queries fastest: 1,300-1,400 a second against ~1,100 at 64 KiB and ~800 one per group.
GROUP_SCORE_BYTES = 1 << 20
# A padded key's additive mask is at most this: exp(score + mask) is 0 in fp32 for any real score.
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
    the next layer and pooling skips padding)."""
    causal = attention_mask is None and getattr(module, "is_causal", False)
    if torch.is_grad_enabled() or dropout > 0 or causal or key.shape[1] != query.shape[1]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, q_len, dim = query.shape
    k_len = key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    lengths = right_padding_lengths(attention_mask, q_len, k_len)
    group = max(1, GROUP_SCORE_BYTES // (heads * q_len * k_len * 4))
    zero = query.new_zeros(1, 1, 1)
    out = value.new_zeros((batch, heads, q_len, value.shape[-1]))
    for start in range(0, batch, group):
        stop = min(batch, start + group)
        size = stop - start
        if lengths is None:
            n_q, n_k, masked = q_len, k_len, attention_mask is not None
        else:
            n_q = n_k = max(lengths[start:stop])
            masked = min(lengths[start:stop]) < n_q
        if n_q == 0:
            continue
        # (size * heads, n, dim): a view for one sequence, a copy for a group.
        q = query[start:stop, :, :n_q].flatten(0, 1)
        k = key[start:stop, :, :n_k].flatten(0, 1)
        v = value[start:stop, :, :n_k].flatten(0, 1)
        # scale * q.k in the matrix product itself, rounded once to the input's dtype
        scores = torch.baddbmm(zero, q, k.transpose(1, 2), beta=0, alpha=scale)
        if masked:  # the mask's dtype (fp32): mask + scores, one call
            assert attention_mask is not None
            rows = attention_mask if attention_mask.shape[0] == 1 else attention_mask[start:stop]
            scores = torch.add(rows[..., :n_q, :n_k], scores.view(size, heads, n_q, n_k))
        # The softmax accumulates in fp32 whatever its input (bf16 in, bf16 out, as autocast).
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(size * heads, n_q, n_k)
        if size == 1:
            torch.bmm(probs, v, out=out[start, :, :n_q])
        else:
            out[start:stop, :, :n_q] = torch.bmm(probs, v).view(size, heads, n_q, -1)
    return out.transpose(1, 2), None


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
