"""Reranker training: negatives never gold, a tiny cross-encoder learns, the output loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, cast

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertForSequenceClassification, BertModel

from rag_retriever.cli import EXIT_WORSE, build_parser, main, training_verdict
from rag_retriever.errors import ConfigError
from rag_retriever.eval.questions import load_questions
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.device import Precision
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Chunk, Document
from rag_retriever.store import Store
from rag_retriever.training.common import OptimizerStep
from rag_retriever.training.mining import Example, MinedSet, mine_examples
from rag_retriever.training.reranker import (
    RerankerTrainingConfig,
    _step,
    init_pooler,
    load_base,
    train_reranker,
)
from tests.conftest import GradientsOnly, build_tiny_bert, write_jsonl

WORDS = [
    "apples",
    "pears",
    "wine",
    "river",
    "mountain",
    "paris",
    "king",
    "queen",
    "war",
    "peace",
    "london",
    "gene",
]
DOCS = tuple(
    Document(f"d{i}", f"Note {i}", f"The {w} of the city. Science and the city with {w} and cell.")
    for i, w in enumerate(WORDS)
)


@pytest.fixture
def retriever(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> Retriever:
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"),
        alias="kb",
        encoder=tiny_encoder,
        store=store,
    )
    # Negatives are mined from the hybrid list; the tiny reranker's learning test was calibrated
    # on the RRF k=60 order, so keep that order here (the default fusion is not under test).
    return Retriever(encoder=tiny_encoder, store=store, collection="kb").with_config(fusion="rrf")


def questions(tmp_path: Path, retriever: Retriever, copies: int = 3) -> Path:
    rows: list[dict[str, object]] = []
    for c in range(copies):
        for i, w in enumerate(WORDS):
            rows.append(
                {"id": f"q{i}-{c}", "question": f"{w} science city", "gold_doc_ids": [f"d{i}"]}
            )
    # A question whose gold document is the one hybrid search ranks last: never a candidate.
    last = retriever.search("zzz", k=100, mode="hybrid")[-1].doc_id
    rows.append({"id": "lost", "question": "zzz", "gold_doc_ids": [last]})
    return write_jsonl(tmp_path / "train.jsonl", rows)


def test_negatives_come_from_the_hybrid_list_and_are_never_gold(
    retriever: Retriever, tmp_path: Path
) -> None:
    qs, _ = load_questions(questions(tmp_path, retriever, copies=1))
    mined = mine_examples(retriever, qs, collection="kb", negatives=5, depth=10)
    for ex in mined.examples:
        assert not set(ex.negatives) & ex.gold
        assert set(ex.negatives) <= set(ex.ranked)
    lost = next(ex for ex in mined.examples if ex.question_id == "lost")
    assert not lost.positive_retrieved


def test_tiny_cross_encoder_learns_to_put_the_positive_first(
    retriever: Retriever, tmp_path: Path
) -> None:
    # 64 hidden units: the 32-unit test model learns token matching too slowly for a unit test.
    base = build_tiny_bert(tmp_path / "base", classifier=True, seed=1, hidden=64)
    out = tmp_path / "reranker"
    config = RerankerTrainingConfig(
        negatives=5,
        batch_size=4,
        epochs=20,
        learning_rate=1e-3,
        max_length=48,
        val_fraction=0.0,
        depth=8,
        seed=0,
        # The whole batch in one pass, the path this test was calibrated on: micro-batches give
        # the same gradient (test_micro_batches_accumulate_the_gradient_of_the_whole_batch) but
        # other dropout masks, and this small model's outcome is sensitive to them.
        micro_batch=0,
    )
    qs, _ = load_questions(questions(tmp_path, retriever, copies=1))
    groups = mine_examples(retriever, qs, collection="kb", negatives=5, depth=8)

    def firsts(reranker: CrossEncoderReranker) -> int:
        """Questions whose positive the reranker puts first among its mined group."""
        count = 0
        for ex in groups.examples:
            if not ex.positive_retrieved:
                continue
            rows = [ex.positive, *ex.negatives]
            scores = reranker.score(ex.query, groups.index.embed_texts(rows)).scores
            count += int(np.argmax(scores) == 0)
        return count

    before = firsts(CrossEncoderReranker.load(base, device="cpu", dtype="fp32", max_length=48))
    meta = train_reranker(
        retriever,
        questions(tmp_path, retriever),
        out,
        collection="kb",
        base=str(base),
        config=config,
        device="cpu",
        dtype="fp32",
        progress=False,
    )
    assert meta["examples"]["skipped"]["gold_not_among_candidates"] == 1  # "lost" was skipped
    assert meta["loss_last_20"] < 0.8 * meta["loss_first_20"]
    loaded = CrossEncoderReranker.load(out, device="cpu", dtype="fp32", max_length=48)
    assert loaded.name == "reranker-kb__tiny-bert-32__v1"
    after = firsts(loaded)
    assert after >= before + 3, (before, after)
    metadata = json.loads((out / "rag_training.json").read_text())
    assert metadata["collection_fingerprint"]["model"] == "tiny-bert"
    assert metadata["questions_sha256"]


def test_too_few_usable_questions(
    retriever: Retriever, tiny_reranker_dir: Path, tmp_path: Path
) -> None:
    path = write_jsonl(
        tmp_path / "few.jsonl", [{"id": "a", "question": "apples", "gold_doc_ids": ["d0"]}]
    )
    with pytest.raises(ConfigError, match="usable training questions"):
        train_reranker(
            retriever,
            path,
            tmp_path / "o",
            collection="kb",
            base=str(tiny_reranker_dir),
            config=RerankerTrainingConfig(negatives=3),
            progress=False,
        )


def test_cli_defaults_are_the_training_config_defaults(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["train-reranker", "--collection", "kb", "--questions", "q.jsonl", "--out", "o"]
    )
    defaults = RerankerTrainingConfig()
    for cli_name, field in [
        ("negatives", "negatives"),
        ("batch_size", "batch_size"),
        ("lr", "learning_rate"),
        ("head_lr", "head_learning_rate"),
        ("max_length", "max_length"),
        ("pooler_init", "pooler_init"),
        ("depth", "depth"),
        ("loss", "loss"),
        ("freeze_layers", "freeze_layers"),
    ]:
        assert getattr(args, cli_name) == getattr(defaults, field), cli_name


def _pooler(model: torch.nn.Module) -> torch.nn.Linear:
    dense = model.bert.pooler.dense  # type: ignore[union-attr]
    assert isinstance(dense, torch.nn.Linear)
    return dense


def test_untrained_pooler_under_a_fresh_head_becomes_the_identity(tmp_path: Path) -> None:
    # A plain encoder whose pooler bias is all zeros: what a sentence-transformers checkpoint
    # (mean pooling, pooler never trained) looks like.
    encoder = build_tiny_bert(tmp_path / "enc", seed=2)
    model, _, fresh = load_base(str(encoder))
    assert fresh
    assert not _pooler(model).bias.any()
    assert init_pooler(model, "auto", fresh_head=fresh)
    assert torch.equal(_pooler(model).weight, torch.eye(32))
    assert not _pooler(model).bias.any()
    # "keep" leaves the random pooler alone.
    model, _, fresh = load_base(str(encoder))
    before = _pooler(model).weight.clone()
    assert not init_pooler(model, "keep", fresh_head=fresh)
    assert torch.equal(_pooler(model).weight, before)


def test_a_trained_pooler_or_an_existing_head_is_kept(
    tmp_path: Path, tiny_reranker_dir: Path
) -> None:
    # A cross-encoder base: its head and pooler were trained together; "auto" keeps both.
    model, _, fresh = load_base(str(tiny_reranker_dir))
    assert not fresh
    before = _pooler(model).weight.clone()
    assert not init_pooler(model, "auto", fresh_head=fresh)
    assert torch.equal(_pooler(model).weight, before)
    # "identity" resets it anyway.
    assert init_pooler(model, "identity", fresh_head=fresh)
    assert torch.equal(_pooler(model).weight, torch.eye(32))
    # A plain encoder with a trained pooler (non-zero bias, e.g. BERT's NSP pooler): kept.
    encoder = build_tiny_bert(tmp_path / "enc", seed=3)
    bert = BertModel.from_pretrained(encoder)
    assert bert.pooler is not None
    with torch.no_grad():
        bert.pooler.dense.bias.fill_(0.1)
    bert.save_pretrained(encoder)
    model, _, fresh = load_base(str(encoder))
    assert fresh
    assert not init_pooler(model, "auto", fresh_head=fresh)
    assert _pooler(model).bias.detach().eq(0.1).all()


def test_training_from_a_plain_encoder_skips_the_random_head_validation(
    retriever: Retriever, tmp_path: Path
) -> None:
    base = build_tiny_bert(tmp_path / "enc", seed=4, hidden=64)
    meta = train_reranker(
        retriever,
        questions(tmp_path, retriever, copies=1),
        tmp_path / "out",
        collection="kb",
        base=str(base),
        config=RerankerTrainingConfig(
            negatives=3, batch_size=4, max_length=48, val_fraction=0.3, depth=8
        ),
        device="cpu",
        dtype="fp32",
        progress=False,
    )
    assert meta["fresh_head"] and meta["pooler_reset_to_identity"]
    before, after = meta["validation_before"], meta["validation_after"]
    assert before["questions"] == after["questions"] > 0
    assert not any(k.startswith("rerank") for k in before)  # a random head is not validated
    assert {"hybrid recall@1", "rerank recall@1", "rerank+hybrid recall@1"} <= set(after)
    assert before["hybrid recall@1"] == after["hybrid recall@1"]
    low, high = meta["mrr10_gain_ci95"]
    gain = after["rerank+hybrid mrr@10"] - after["hybrid mrr@10"]
    assert low <= gain + 1e-9 and gain <= high + 1e-9
    held_out, _ = load_questions(tmp_path / "out" / "validation_questions.jsonl")
    assert len(held_out) == meta["examples"]["validation"]
    loaded = CrossEncoderReranker.load(tmp_path / "out", device="cpu", dtype="fp32")
    assert loaded.num_labels == 1


def test_train_reranker_command(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_jsonl(
        tmp_path / "docs.jsonl", [{"id": d.id, "title": d.title, "text": d.text} for d in DOCS]
    )
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    rows: list[dict[str, object]] = [
        {"id": f"q{i}-{c}", "question": f"{w} science city", "gold_doc_ids": [f"d{i}"]}
        for c in range(2)
        for i, w in enumerate(WORDS)
    ]
    qs = write_jsonl(tmp_path / "q.jsonl", rows)
    base = build_tiny_bert(tmp_path / "enc", seed=5)
    out = tmp_path / "reranker"
    cmd = ["train-reranker", "--collection", "kb", "--questions", str(qs), "--out", str(out)]
    small = ["--base", str(base), "--batch-size", "4", "--max-length", "48", "--depth", "8"]
    capsys.readouterr()
    code = main([*cmd, *small, "--val-fraction", "0.25", "--no-progress"])
    printed = capsys.readouterr().out
    assert "(held out: validation_questions.jsonl)" in printed
    assert "validation  rerank recall@1:   -    -> " in printed  # a new head: not validated
    assert "validation  hybrid recall@1: " in printed
    if "verdict     WORSE" in printed:  # never a next step that makes retrieval worse
        assert code == EXIT_WORSE and "next        none" in printed
        assert "RAG_RERANK_MODEL=" not in printed
    else:
        assert code == 0 and f"RAG_RERANK_MODEL={out} rag-retriever search" in printed
    assert CrossEncoderReranker.load(out, device="cpu", dtype="fp32").num_labels == 1
    # The output exists: refused without --overwrite, and left as it was.
    weights = (out / "model.safetensors").read_bytes()
    assert main([*cmd, *small, "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == weights


@pytest.mark.parametrize(
    ("after", "keep", "start"),
    [
        ({"questions": 74, "hybrid mrr@10": 0.818, "rerank+hybrid mrr@10": 0.719}, False, "WORSE"),
        ({"questions": 74, "hybrid mrr@10": 0.70, "rerank+hybrid mrr@10": 0.75}, True, "better"),
        ({"questions": 0}, True, "unjudged"),
    ],
)
def test_the_verdict_compares_with_what_the_model_would_replace(
    after: dict[str, float], keep: bool, start: str
) -> None:
    meta = {"validation_before": {}, "validation_after": after, "mrr10_gain_ci95": [-0.1, 0.2]}
    verdict = training_verdict(meta, new="rerank+hybrid mrr@10", old="hybrid mrr@10", what="it")
    assert verdict[0] is keep and verdict[1].startswith(start)
    if after.get("questions"):
        assert "95% CI -0.1000..+0.2000) on 74 held-out questions" in verdict[1]


@pytest.mark.parametrize("loss", ["listwise", "pointwise"])
def test_micro_batches_accumulate_the_gradient_of_the_whole_batch(
    tmp_path: Path, loss: Literal["listwise", "pointwise"]
) -> None:
    """Oracle: the same step with the whole batch in one forward pass (no dropout, so the two
    differ only in how the batch is cut)."""
    directory = build_tiny_bert(tmp_path / "ce", classifier=True, seed=1)
    model = BertForSequenceClassification.from_pretrained(
        directory, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    model.train()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    precision = Precision(torch.device("cpu"), "fp32")
    reranker = CrossEncoderReranker(model, tokenizer, name="t", precision=precision)
    chunks = [
        Chunk(f"c{i}", f"d{i}", w, 0, 0, 20, f"the {w} and the {WORDS[i + 1]}", 6, "h")
        for i, w in enumerate(WORDS[:7])
    ]
    mined = MinedSet("c", ChunkTable("c", chunks), [], {})
    batch = [
        Example(f"q{i}", f"where is the {WORDS[i]}?", i, frozenset({i}), (i + 1, i + 2), True)
        for i in range(5)
    ]
    grads = []
    for micro_batch in (3, 0):  # one question (3 pairs) per pass, then all 15 pairs at once
        config = RerankerTrainingConfig(negatives=2, micro_batch=micro_batch, loss=loss)
        step = cast(OptimizerStep, GradientsOnly(model))
        value = _step(step, tokenizer, reranker, batch, mined, config, precision).item()
        grads.append(
            (value, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (parts_loss, parts), (whole_loss, whole) = grads
    assert parts_loss == pytest.approx(whole_loss, rel=1e-5)
    assert len(whole) > 30 and set(parts) == set(whole)
    for name, grad in whole.items():
        torch.testing.assert_close(parts[name], grad, rtol=1e-4, atol=1e-6, msg=name)
