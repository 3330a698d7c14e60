"""What both trainers share: output directories, the learning-rate schedule, metadata files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from rag_retriever.errors import ConfigError


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
