"""Linear layers for CPU inference (models/linear.py): bf16 weights cast once and packed once
for oneDNN. The oracle is what they replace: `F.linear` under bf16 autocast over the fp32
weights, which casts weight, bias and input to bf16 on every call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from rag_retriever.models.device import Precision, for_inference
from rag_retriever.models.linear import PackedLinear, bf16_linear_layers, can_pack
from tests.conftest import build_tiny_bert

pytestmark = pytest.mark.skipif(not can_pack(), reason="this torch has no oneDNN packing")


def _autocast(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*args)


@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48), (33, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_gives_autocasts_output(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 40, bias=bias)
    x = torch.randn(*shape)
    expected = _autocast(plain, x)
    packed = PackedLinear(plain)
    with torch.inference_mode():
        assert torch.equal(packed(x), expected)  # fp32 input, cast as autocast casts it
        assert torch.equal(packed(x.bfloat16()), expected)
        wide = torch.randn(*shape[:-1], 96)[..., ::2]  # not contiguous
        assert torch.equal(packed(wide), _autocast(plain, wide))


def test_a_packed_layer_refuses_gradients() -> None:
    packed = PackedLinear(torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="inference only"):
        packed(torch.randn(2, 4))


def test_a_model_gives_its_autocast_hidden_states_packed_or_not(tmp_path: Path) -> None:
    directory = build_tiny_bert(tmp_path / "bert", hidden=64)
    batch = AutoTokenizer.from_pretrained(directory)(
        ["the normans gave their name to normandy", "bm25", "a b c d e f g h i j k l"],
        padding=True,
        return_tensors="pt",
    )
    fp32 = Precision(torch.device("cpu"), "fp32")  # the same CPU attention, fp32 weights
    reference = for_inference(AutoModel.from_pretrained(directory), fp32)
    expected = _autocast(lambda: reference(**batch).last_hidden_state)
    for pack in (True, False):
        model: Any = for_inference(AutoModel.from_pretrained(directory), fp32)
        layers = model.config.num_hidden_layers
        assert bf16_linear_layers(model, pack=pack) == 6 * layers + 1  # q k v o in out, pooler
        kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        assert kinds == ({PackedLinear} if pack else {torch.nn.Linear})
        assert torch.equal(_autocast(lambda m=model: m(**batch).last_hidden_state), expected)


def test_a_weight_another_module_uses_keeps_its_dtype_and_the_rest_is_packed() -> None:
    embedding = torch.nn.Embedding(5, 4)
    decoder = torch.nn.Linear(4, 5, bias=False)
    decoder.weight = embedding.weight  # tied, as a masked-language-model head is
    attention = torch.nn.MultiheadAttention(4, 1)
    model = torch.nn.ModuleList([embedding, decoder, attention, torch.nn.Linear(4, 4)])
    for_inference(model, Precision(torch.device("cpu"), "bf16"))
    assert embedding.weight.dtype == decoder.weight.dtype == torch.float32
    assert model[1] is decoder
    assert attention.out_proj.weight.dtype == torch.float32
    assert isinstance(model[3], PackedLinear)
    assert model[3].weight.dtype == model[3].bias.dtype == torch.bfloat16
    trained_next: Any = for_inference(
        torch.nn.Sequential(torch.nn.Linear(2, 2)),
        Precision(torch.device("cpu"), "bf16"),
        half_weights=False,
    )
    assert type(trained_next[0]) is torch.nn.Linear
    assert trained_next[0].weight.dtype == torch.float32
