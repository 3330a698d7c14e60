"""Self-attention for CPU inference, a few sequences at a time.

PyTorch's CPU `scaled_dot_product_attention` (the kernel transformers' `sdpa` calls) runs at a
tenth of the speed of the linear layers around it for MiniLM's 32-wide heads: on 2 cores, a
batch of 32 chunks of ~170 tokens spent 37% of its encoding time in attention against 47% in
all the matrix products of the linear layers, which do 13x the arithmetic. Computed instead as
two batched matrix products per group of sequences, with the scores and the softmax in fp32 and
the group sized to stay in the cache, the same attention takes about half the time (README,
"GPU and CPU speed"). The result is the same attention to within bf16 rounding: under bf16
autocast the scores are rounded to bf16 once before the fp32 softmax.

`use_cpu_attention(model)` switches a transformers model to it; models that do not take a custom
attention function keep theirs. Training (gradients on), dropout, causal and grouped-query
attention go to `sdpa` as before, so only inference changes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

log = logging.getLogger(__name__)

NAME = "rag_cpu_grouped"
# Score bytes (fp32) per group of sequences: 1 MiB measured best among 1-8 MiB for 16-230 tokens
# on 2 cores (a 170-token sequence's 12 heads already take 1.4 MiB, so it goes alone).
GROUP_SCORE_BYTES = 1 << 20


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
    returns the output as (batch, length, heads, head dim)."""
    causal = attention_mask is None and getattr(module, "is_causal", False)
    if torch.is_grad_enabled() or dropout > 0 or causal or key.shape[1] != query.shape[1]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, q_len, dim = query.shape
    k_len = key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    group = max(1, GROUP_SCORE_BYTES // (heads * q_len * k_len * 4))
    out = value.new_empty((batch, heads, q_len, value.shape[-1]))
    # Views of each group, made once: every Python-level torch call takes the GIL, which the
    # ingest's writer thread wants too, so the loop keeps to five calls a group.
    masks = attention_mask.float().split(group) if attention_mask is not None else None
    parts = zip(
        query.split(group),
        key.transpose(2, 3).split(group),
        value.split(group),
        out.split(group),
        strict=True,
    )
    for i, (q, k_t, v, o) in enumerate(parts):
        scores = torch.matmul(q, k_t)
        if masks is None:
            scores = scores.float().mul_(scale)
        else:  # mask + scale * scores, in fp32 (the mask's dtype) in one call
            scores = torch.add(masks[i], scores, alpha=scale)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        torch.matmul(probs, v, out=o)
    return out.transpose(1, 2), None


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
