"""What both trainers share: output directories, the learning-rate schedule, metadata files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from rag_retriever.device import Precision, choose_precision
from rag_retriever.errors import ConfigError
from rag_retriever.eval.metrics import paired_bootstrap_ci


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


class OptimizerStep:
    """One optimisation step: zero the gradients, backpropagate, clip the gradient norm to 1,
    step the optimizer and the schedule. In fp16 the loss goes through a GradScaler, so that small
    gradients do not underflow to zero (and a step with inf/nan gradients is skipped)."""

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
        self.optimizer.zero_grad()
        if self.scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()


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
