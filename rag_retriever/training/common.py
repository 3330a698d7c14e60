"""What both trainers share: output directories, the learning-rate schedule, metadata files."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from rag_retriever.errors import ConfigError
from rag_retriever.eval.metrics import paired_bootstrap_ci
from rag_retriever.eval.questions import Question, file_sha256, load_questions
from rag_retriever.models.device import Precision, choose_precision
from rag_retriever.models.encoder import quiet_transformers
from rag_retriever.progress import progress as progress_of

T = TypeVar("T")
log = logging.getLogger(__name__)


@contextlib.contextmanager
def fresh_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """A new folder beside `out` that a training writes into, put in `out`'s place only when
    the training returns: with --overwrite the old `out` stays until then (deleted at the start,
    a failure or a stop lost it, and a base read from `out` itself was gone before it was
    loaded), and a stopped run leaves no folder that loads as a model. ConfigError, as before,
    for a non-empty `out` without `overwrite`."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(
            f"{out} exists and is not empty; choose another --out or pass --overwrite"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    work.mkdir()
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
        out.rename(old)
        work.rename(out)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        work.rename(out)


def start_training(
    questions_path: Path, *, max_questions: int | None
) -> tuple[list[Question], list[str]]:
    """How both trainers start (in the folder `fresh_output` made): freed memory handed back to
    the system, and the questions (the first `max_questions`) with the input's problems."""
    return_freed_memory()
    questions, problems = load_questions(questions_path)
    if max_questions is not None:
        questions = questions[:max_questions]
    return questions, problems


def save_model(model: Any, tokenizer: Any, out: Path) -> None:
    """A Hugging Face model and its tokenizer, saved into `out` without transformers' chatter."""
    with quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


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


# The progress bar shows the recent loss every this many steps: reading a loss waits for the
# device, so it is read only to be printed, not after every step.
LOSS_SHOWN_EVERY = 10


def run_steps(
    model: torch.nn.Module,
    epochs: Iterable[Iterable[T]],
    step: Callable[[T], torch.Tensor],
    *,
    total: int,
    desc: str,
    progress: bool,
) -> list[float]:
    """The training loop both trainers run: `step` on each batch of each epoch (it returns the
    batch's loss as a detached tensor, left on the device), the model in training mode meanwhile
    (eval mode after), a progress bar of `total` steps showing the mean loss of the last 20
    every LOSS_SHOWN_EVERY steps. Returns each step's loss, read from the device once."""
    model.train()
    losses: list[torch.Tensor] = []
    bar = progress_of(total=total, desc=desc, unit="step", enabled=progress)
    for batches in epochs:
        for batch in batches:
            losses.append(step(batch))
            bar.update(1)
            if progress and len(losses) % LOSS_SHOWN_EVERY == 0:
                bar.set_postfix(loss=f"{torch.stack(losses[-20:]).mean().item():.3f}")
    bar.close()
    model.eval()
    return [float(x) for x in torch.stack(losses).tolist()] if losses else []


def micro_batches(items: Sequence[T], size: int) -> list[Sequence[T]]:
    """`items` in consecutive slices of at most `size`: the forward passes that hold gradients,
    so that training memory follows `size`, not the batch."""
    return [items[i : i + size] for i in range(0, len(items), size)]


VALIDATION_FILE = "validation_questions.jsonl"


def write_question_subset(questions_path: Path, ids: set[str], out: Path) -> int:
    """Copy the lines of the held-out questions, so they can be evaluated on their own later
    (`eval/recall_at_k.py --questions OUT/validation_questions.jsonl`)."""
    # the lines the loader accepted, by its line numbers: a line it skips as a problem (a BOM,
    # malformed JSON, not UTF-8) made a second parse here raise after the model was saved
    questions, _ = load_questions(questions_path)
    keep = {q.line for q in questions if q.id in ids}
    lines = questions_path.read_bytes().split(b"\n")
    with out.open("wb") as dst:
        for lineno in sorted(keep):
            line = lines[lineno - 1].rstrip(b"\r")
            dst.write((line.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else line) + b"\n")
    return len(keep)


def write_metadata(out: Path, filename: str, data: dict[str, Any]) -> None:
    (out / filename).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


METADATA_FILE = "rag_training.json"


def write_training_record(
    out: Path,
    kind: str,
    *,
    questions_path: Path,
    config: Any,
    precision: Precision,
    split: tuple[Sequence[Any], Sequence[Any]],
    skipped: Mapping[str, int],
    problems: Sequence[str],
    steps: int,
    losses: Sequence[float],
    judged: tuple[dict[str, float], dict[str, float], list[float] | None],
    started: float,
    **specific: Any,
) -> dict[str, Any]:
    """The metadata both trainers write beside their model: what it was trained on and how
    (`config`, a dataclass), and how it validated (`judged`, from `judged_validation`);
    `specific` holds each trainer's own keys. Written into `out` with the validation questions
    (METADATA_FILE, VALIDATION_FILE), and returned."""
    train, val = split
    before, after, interval = judged
    ids = {ex.question_id for ex in val}
    write_question_subset(questions_path, ids, out / VALIDATION_FILE)
    record = {
        "kind": kind,
        **specific,
        "questions_file": str(questions_path),
        "questions_sha256": file_sha256(questions_path),
        "parameters": asdict(config),
        "device": precision.describe(),
        "examples": {
            "train": len(train),
            "validation": len(val),
            "skipped": dict(skipped),
            "input_problems": len(problems),
        },
        "steps": steps,
        "loss_first_20": float(np.mean(losses[:20])),
        "loss_last_20": float(np.mean(losses[-20:])),
        "loss_curve": [
            round(float(np.mean(losses[i : i + 20])), 4) for i in range(0, len(losses), 20)
        ],
        "validation_questions": VALIDATION_FILE,
        "validation_before": before,
        "validation_after": after,
        # 95% paired-bootstrap interval of the MRR@10 gain over what the model would replace
        # (None: not validated)
        "mrr10_gain_ci95": interval,
        "time_s": round(time.perf_counter() - started, 1),
    }
    write_metadata(out, METADATA_FILE, record)
    return record


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
