"""Training memory and time: micro-batches (the default, `--micro-batch 8`) against the whole
batch in one pass (`--micro-batch 0`, what training did before), side by side in one run.

Usage (through `make bench`, or alone on a collection built by it):
    python -m bench --only training

Each command runs in its own process on the SQuAD collection, with the first questions of
`questions_train.jsonl`; the peak resident memory is that process's own (VmHWM), the time its
wall time (model loading, mining and validation included, as a user sees it).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# A child that runs the CLI and reports its own peak resident memory (Linux).
_CHILD = (
    "import sys\n"
    "from rag_retriever.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
    "print('PEAK_KB', peak)\n"
    "sys.exit(code)\n"
)
# (command, questions): 5 steps of 32 questions, 10 steps of 8.
RUNS = (("train-embedder", 160), ("train-reranker", 80))


def run(data_dir: Path, questions: Path, collection: str = "squad") -> dict[str, Any]:
    results: dict[str, Any] = {}
    for command, n in RUNS:
        for micro in (0, 8):
            with tempfile.TemporaryDirectory() as out:
                args = [
                    command,
                    "--collection",
                    collection,
                    "--questions",
                    str(questions),
                    "--max-questions",
                    str(n),
                    "--micro-batch",
                    str(micro),
                    "--out",
                    out,
                    "--allow-worse",
                    "--no-progress",
                    "--data-dir",
                    str(data_dir),
                ]
                results[f"{command} micro {micro}"] = _measure(args)
    return results


def _measure(args: list[str]) -> dict[str, float]:
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, check=True
    )
    seconds = time.perf_counter() - began
    peak = next(line for line in done.stdout.splitlines() if line.startswith("PEAK_KB"))
    return {"seconds": round(seconds, 1), "peak_mb": round(int(peak.split()[1]) / 1024, 1)}


def report(results: dict[str, Any]) -> list[str]:
    lines = ["", "## training memory: --micro-batch 8 (ours) vs the whole batch in one pass (peer)"]
    for command, n in RUNS:
        ours, peer = results[f"{command} micro 8"], results[f"{command} micro 0"]
        lines.append(
            f"{command} ({n} questions): peak {ours['peak_mb']:.0f} MB vs "
            f"{peer['peak_mb']:.0f} MB ({peer['peak_mb'] / ours['peak_mb']:.2f}x less); time "
            f"{ours['seconds']:.0f} s vs {peer['seconds']:.0f} s "
            f"({ours['seconds'] / peer['seconds']:.2f}x)"
        )
    return lines
