"""What both trainers share: output directories, the learning-rate schedule, metadata files."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from rag_retriever.device import Precision, choose_precision
from rag_retriever.errors import ConfigError
from rag_retriever.eval.metrics import paired_bootstrap_ci

T = TypeVar("T")
log = logging.getLogger(__name__)


def prepare_output(out: Path, overwrite: bool) -> None:
    """Refuse to overwrite a non-empty directory unless asked to."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"{out} exists and is not empty; choose another --out or pass --overwrite"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def warmup_linear(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the base rate over `warmup_fraction` of the steps, then linear decay."""
    warmup = max(1, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def training_precision(device: str, dtype: str) -> Precision:
    """`choose_precision`, except that `auto` on a GPU with bf16 (Ampere and later) trains in bf16,
    which needs no loss scaling; fp16 (older GPUs, or asked for) trains through a GradScaler."""
    precision = choose_precision(device, dtype)
    if dtype == "auto" and precision.device.type == "cuda" and torch.cuda.is_bf16_supported():
        return Precision(precision.device, "bf16")
    return precision


Scale = Callable[[torch.Tensor], torch.Tensor]


class OptimizerStep:
    """One optimisation step: zero the gradients, backpropagate, clip the gradient norm to 1,
    step the optimizer and the schedule. In fp16 the loss goes through a GradScaler, so that small
    gradients do not underflow to zero (and a step with inf/nan gradients is skipped).

    `step(loss)` backpropagates one loss; `step.run(backward)` lets `backward(scale)` accumulate
    the gradients itself, piece by piece (micro-batches), calling `scale(loss).backward()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        precision: Precision,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = (
            torch.amp.GradScaler(precision.device.type) if precision.dtype == "fp16" else None
        )

    def __call__(self, loss: torch.Tensor) -> None:
        self.run(lambda scale: scale(loss).backward())

    def run(self, backward: Callable[[Scale], None]) -> None:
        self.optimizer.zero_grad()
        backward(self._scale)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()

    def _scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)


# glibc's mallopt parameter for the size from which an allocation gets its own mapping.
_M_MMAP_THRESHOLD = -3


def return_freed_memory() -> None:
    """Make glibc give freed activation buffers back to the system (Linux only; a no-op
    elsewhere).

    By default glibc raises its mmap threshold each time a large block is freed, after which the
    activations of each step come from the heap, which fragments and never shrinks: measured on
    train-embedder, resident memory between steps grew from 1.7 to 2.7 GB over 6 steps, and stayed
    at 1.0-1.2 GB with the threshold fixed at 1 MiB (what MALLOC_MMAP_THRESHOLD_ does)."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc (musl, say): its allocator returns memory
        log.debug("mallopt unavailable; the allocator keeps its own policy")


class PeakMemory:
    """The peak resident memory of this process while the `with` block runs, in MB (Linux;
    `mb` stays None elsewhere), sampled every `interval` seconds by a thread. It does not reset
    the kernel's high-water mark, so `/usr/bin/time` still sees the whole run's peak."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
        while True:
            try:
                pages = int(Path("/proc/self/statm").read_text().split()[1])
            except (OSError, ValueError):
                return
            self.mb = max(self.mb or 0.0, round(pages * page_mb, 1))
            if self._stop.wait(self.interval):
                return


def micro_batches(items: Sequence[T], size: int) -> list[Sequence[T]]:
    """`items` in consecutive slices of at most `size`: the forward passes that hold gradients,
    so that training memory follows `size`, not the batch."""
    return [items[i : i + size] for i in range(0, len(items), size)]


VALIDATION_FILE = "validation_questions.jsonl"


def write_question_subset(questions_path: Path, ids: set[str], out: Path) -> int:
    """Copy the lines of the held-out questions, so they can be evaluated on their own later
    (`eval/recall_at_k.py --questions OUT/validation_questions.jsonl`)."""
    written = 0
    with questions_path.open(encoding="utf-8") as src, out.open("w", encoding="utf-8") as dst:
        for line in src:
            if line.strip() and str(json.loads(line).get("id")) in ids:
                dst.write(line if line.endswith("\n") else line + "\n")
                written += 1
    return written


def write_metadata(out: Path, filename: str, data: dict[str, Any]) -> None:
    (out / filename).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def judged_validation(
    before: dict[str, Any],
    after: dict[str, Any],
    *,
    new: list[float] | None,
    old: list[float] | None,
) -> tuple[dict[str, float], dict[str, float], list[float] | None]:
    """Validation figures to save (per-question lists dropped), and the 95% paired-bootstrap
    interval of the per-question MRR@10 gain of `new` over `old` (None without held-out
    questions)."""
    interval = None
    if new and old:
        low, high = paired_bootstrap_ci(new, old)
        interval = [round(low, 4), round(high, 4)]

    def figures(validation: dict[str, Any]) -> dict[str, float]:
        return {k: v for k, v in validation.items() if not isinstance(v, list)}

    return figures(before), figures(after), interval
