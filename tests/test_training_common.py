"""What both trainers share: the optimisation step (with fp16 loss scaling) and the precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rag_retriever.eval.questions import load_questions
from rag_retriever.models.device import Precision
from rag_retriever.training.common import (
    OptimizerStep,
    training_precision,
    warmup_linear,
    write_question_subset,
)


def one_step(precision: Precision, scale: float) -> tuple[torch.Tensor, OptimizerStep]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step = OptimizerStep(model, optimizer, warmup_linear(optimizer, 10, 0.0), precision)
    x = torch.ones(3, 4)
    step(model(x).sum() * scale)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), step


def test_fp16_step_unscales_before_clipping_and_stepping() -> None:
    # Gradients of norm < 1, so clipping leaves them alone: a scaled gradient that was not
    # unscaled would be clipped to norm 1 and give another update.
    cpu = torch.device("cpu")
    plain, fp32_step = one_step(Precision(cpu, "fp32"), 1e-3)
    scaled, fp16_step = one_step(Precision(cpu, "fp16"), 1e-3)
    assert fp32_step.scaler is None and fp16_step.scaler is not None
    assert torch.allclose(plain, scaled)
    untouched, _ = one_step(Precision(cpu, "fp32"), 0.0)
    assert not torch.allclose(plain, untouched)  # the step did move the weights


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_fp16_step_skips_non_finite_gradients() -> None:
    before, _ = one_step(Precision(torch.device("cpu"), "fp32"), 0.0)
    skipped, _ = one_step(Precision(torch.device("cpu"), "fp16"), float("inf"))
    assert torch.equal(before, skipped)  # no update: the scaler dropped the step


def test_auto_precision_trains_in_bf16_on_a_gpu_that_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU here: CUDA's presence and its bf16 support are mocked.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert training_precision("auto", "auto").describe() == "cuda/bf16"
    assert training_precision("cuda", "fp16").describe() == "cuda/fp16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert training_precision("auto", "auto").describe() == "cuda/fp16"


def test_peak_memory_sees_an_allocation_inside_the_block() -> None:
    import sys
    import time

    import numpy as np

    from rag_retriever.training.common import PeakMemory

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    with PeakMemory(interval=0.01) as before:
        time.sleep(0.05)
    assert before.mb is not None  # it samples once as it starts
    with PeakMemory(interval=0.01) as during:
        block = np.ones(50_000_000)  # 400 MB, touched
        # held until the sampling thread has seen it, however late a busy machine runs it
        deadline = time.monotonic() + 120
        while (during.mb or 0.0) <= before.mb + 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    assert during.mb is not None and during.mb > before.mb + 300


def test_a_question_subset_copies_the_lines_the_loader_accepted(tmp_path: Path) -> None:
    """A BOM, malformed JSON and a non-object line are problems to the loader; a second parse
    here raised on them (after the model was saved, leaving it without its record)."""
    rows = [
        '\ufeff{"id": "a", "question": "alpha?", "gold_doc_ids": ["d1"]}',
        "{not json",
        "[1, 2]",
        '{"id": "b", "question": "bravo?", "gold_doc_ids": ["d2"]}',
        "",
        '{"id": "c", "question": "charlie?", "gold_doc_ids": ["d3"]}\r',
    ]
    source = tmp_path / "q.jsonl"
    source.write_text("\n".join(rows), encoding="utf-8")
    out = tmp_path / "subset.jsonl"
    assert write_question_subset(source, {"a", "c", "zzz"}, out) == 2
    kept, problems = load_questions(out)
    assert [q.id for q in kept] == ["a", "c"] and problems == []
    assert not out.read_bytes().startswith(b"\xef\xbb\xbf")


@pytest.mark.parametrize(
    ("command", "flag", "value", "message"),
    [
        ("train-embedder", "--batch-size", "0", "must be at least 1"),  # hung forever
        ("train-reranker", "--batch-size", "0", "must be at least 1"),  # ZeroDivisionError
        ("train-embedder", "--val-fraction", "1", "must be at least 0 and below 1"),
        ("train-reranker", "--max-length", "0", "must be at least 1"),
        ("train-reranker", "--negatives", "0", "must be at least 1"),  # a loss of 0: no learning
        ("train-embedder", "--temperature", "0", "must be a finite number above 0"),  # a NaN loss
        ("train-embedder", "--epochs", "0", "must be at least 1"),  # NaN in the record
        ("train-reranker", "--max-questions", "-5", "must be at least 1"),  # dropped 5 silently
        ("train-embedder", "--lr", "nan", "must be a finite number above 0"),
    ],
)
def test_training_flags_out_of_range_are_usage_errors(
    command: str, flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rag_retriever.cli import main

    args = [command, "--collection", "kb", "--questions", "q.jsonl", "--out", "o", flag, value]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
