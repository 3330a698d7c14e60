"""Device and precision choice shared by the encoder, the reranker and the trainers.

`auto` means: CUDA with fp16 when a GPU is present; otherwise the CPU, with bf16 autocast when
the CPU has native bf16 instructions (AVX512-BF16 / AMX; emulated bf16 is slower than fp32),
else fp32. Explicit choices are honoured or refused with a clear error, never swapped silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rag_retriever.errors import ConfigError
from rag_retriever.settings import default_of


@dataclass(frozen=True)
class Precision:
    device: torch.device
    dtype: str  # "fp32" | "bf16" | "fp16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Autocast for the forward pass; a no-op in fp32."""
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.torch_dtype)

    def describe(self) -> str:
        return f"{self.device.type}/{self.dtype}"


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - older or unusual builds
        return False


def choose_precision(
    device: str = default_of("device"), dtype: str = default_of("dtype")
) -> Precision:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("RAG_DEVICE=cuda but torch sees no CUDA device; set RAG_DEVICE=cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"RAG_DEVICE must be auto, cpu or cuda; got {device!r}")
    if dtype == "auto":
        if device == "cuda":
            dtype = "fp16"
        else:
            dtype = "bf16" if cpu_has_native_bf16() else "fp32"
    if dtype == "fp16" and device == "cpu":
        raise ConfigError("fp16 is only supported on CUDA; use RAG_DTYPE=bf16 or fp32 on the CPU")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"RAG_DTYPE must be auto, fp32, bf16 or fp16; got {dtype!r}")
    return Precision(torch.device(device), dtype)


@contextlib.contextmanager
def inference(precision: Precision) -> Iterator[None]:
    with torch.inference_mode(), precision.autocast():
        yield
