"""Embedder fine-tuning: the mining and batching invariants, and a tiny model that learns."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

from rag_retriever.errors import ConfigError
from rag_retriever.eval.questions import load_questions
from rag_retriever.models.device import Precision
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.profiles import ModelProfile, resolve_model
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Chunk, Document
from rag_retriever.store import Store
from rag_retriever.training.common import OptimizerStep, micro_batches
from rag_retriever.training.embedder import (
    EmbedderTrainingConfig,
    GoldTable,
    _Embed,
    _infonce_step,
    train_embedder,
)
from rag_retriever.training.mining import (
    Example,
    MinedSet,
    batches_without_shared_gold,
    mine_examples,
    split_examples,
)
from tests.conftest import GradientsOnly, collection_retriever, write_jsonl

WORDS = [
    "apples",
    "pears",
    "wine",
    "river",
    "mountain",
    "city",
    "king",
    "queen",
    "war",
    "peace",
    "paris",
    "london",
]
# Each document mixes the same filler words; its "answer word" is unique to it.
DOCS = tuple(
    Document(
        f"d{i}", f"Note {i}", f"The {w} and the city. A story of the king and the queen with {w}."
    )
    for i, w in enumerate(WORDS)
)


# Questions use code words that appear in no document, so the untrained model cannot match
# them (no word overlap): the mapping code word -> document must be learned.
CODES = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def question_rows(tmp_path: Path, copies: int = 2) -> Path:
    rows: list[dict[str, object]] = []
    for c in range(copies):
        for i, code in enumerate(CODES):
            rows.append(
                {"id": f"q{i}-{c}", "question": f"{code} {code}", "gold_doc_ids": [f"d{i}"]}
            )
    return write_jsonl(tmp_path / "train.jsonl", rows)


@pytest.fixture
def retriever(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> Retriever:
    return collection_retriever(DOCS, store, tiny_encoder)


def test_mined_negatives_are_never_gold(retriever: Retriever, tmp_path: Path) -> None:
    questions, _ = load_questions(question_rows(tmp_path, copies=1))
    questions = [
        q.__class__(**{**q.__dict__, "question": f"{WORDS[i]} city"})
        for i, q in enumerate(questions)
    ]
    mined = mine_examples(retriever, questions, collection="kb", negatives=3)
    assert len(mined.examples) == len(WORDS)
    for ex in mined.examples:
        assert ex.positive in ex.gold
        assert len(ex.negatives) == 3 and not set(ex.negatives) & ex.gold
        # the negatives are the hybrid list's best non-gold chunks, in order
        hits = retriever.search(ex.query, k=30, mode="hybrid")
        rows = [mined.index.row_of[h.chunk_id] for h in hits]
        assert list(ex.negatives) == [r for r in rows if r not in ex.gold][:3]


@given(
    st.lists(st.frozensets(st.integers(0, 15), min_size=1, max_size=3), min_size=1, max_size=40),
    st.integers(1, 8),
)
def test_no_batch_holds_two_questions_with_a_shared_gold_chunk(
    golds: list[frozenset[int]], size: int
) -> None:
    examples = [Example(str(i), "q", min(g), g, (), True) for i, g in enumerate(golds)]
    seen: list[str] = []
    for batch in batches_without_shared_gold(examples, size, seed=3):
        assert 1 <= len(batch) <= size
        for i, a in enumerate(batch):
            for b in batch[i + 1 :]:
                assert not a.gold & b.gold
        seen.extend(ex.question_id for ex in batch)
    assert sorted(seen) == sorted(ex.question_id for ex in examples)


def test_tiny_model_learns_and_saves_a_loadable_profile(
    retriever: Retriever, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ft"
    config = EmbedderTrainingConfig(
        batch_size=8, epochs=20, learning_rate=2e-3, val_fraction=0.0, seed=1, hard_negatives=2
    )
    meta = train_embedder(
        retriever,
        question_rows(tmp_path),
        out,
        collection="kb",
        base=resolve_model(str(tiny_encoder_dir)),
        config=config,
        device="cpu",
        dtype="fp32",
        progress=False,
    )
    assert meta["loss_last_20"] < meta["loss_first_20"] * 0.5
    trained = Encoder.load(str(out), device="cpu", dtype="fp32")
    assert (trained.profile.query_prefix, trained.profile.passage_prefix) == (
        "query: ",
        "passage: ",
    )
    assert trained.fingerprint.id != retriever.encoder.fingerprint.id
    assert json.loads((out / "rag_training.json").read_text())["questions_sha256"]
    assert (out / "validation_questions.jsonl").read_text() == ""  # val_fraction=0: none held out

    # The planted positive moves up: rank the documents for each question, before and after.
    def mean_rank(encoder: Encoder) -> float:
        passages = encoder.encode_passages([f"{d.title}\n\n{d.text}" for d in DOCS]).vectors
        queries = encoder.encode_queries([f"{c} {c}" for c in CODES]).vectors
        scores = queries @ passages.T
        return sum(int((scores[i] > scores[i, i]).sum()) + 1 for i in range(len(WORDS))) / len(
            WORDS
        )

    base = Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32")
    before, after = mean_rank(base), mean_rank(trained)
    assert before > 3.0, before  # the untrained model cannot do it
    assert after <= 1.5, after


def test_training_keeps_fp32_weights_where_inference_holds_half_ones(
    retriever: Retriever, tiny_encoder_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CUDA an inference model holds half weights (device.for_inference); the base model about
    # to be trained must not: it keeps fp32 weights under autocast, and is saved in fp32. No GPU
    # here: the CPU is made to hold half weights as CUDA does.
    from safetensors import safe_open

    from rag_retriever.models import device

    monkeypatch.setattr(device, "holds_half_weights", lambda precision: precision.dtype != "fp32")

    out = tmp_path / "ft-bf16"
    config = EmbedderTrainingConfig(batch_size=8, epochs=1, val_fraction=0.0, seed=1)
    train_embedder(
        retriever,
        question_rows(tmp_path),
        out,
        collection="kb",
        base=resolve_model(str(tiny_encoder_dir)),
        config=config,
        device="cpu",
        dtype="bf16",
        progress=False,
    )
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        dtypes = {weights.get_tensor(key).dtype for key in weights.keys()}  # noqa: SIM118
    assert dtypes == {torch.float32}
    served = Encoder.load(str(out), device="cpu", dtype="bf16")
    assert next(served.model.parameters()).dtype == torch.bfloat16


def test_existing_output_is_not_overwritten(
    retriever: Retriever, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--overwrite"):
        train_embedder(
            retriever,
            question_rows(tmp_path),
            out,
            collection="kb",
            base=resolve_model(str(tiny_encoder_dir)),
            config=EmbedderTrainingConfig(),
            progress=False,
        )
    assert (out / "keep.txt").read_text() == "mine"


def test_an_overwrite_keeps_the_old_output_until_the_new_model_is_whole(
    retriever: Retriever, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    """--overwrite deleted the old output at the start: a training that then failed (here: too
    few questions) or was stopped left nothing, and a base read from the output itself was gone
    before it loaded. The new model now takes the old one's place only when it is whole."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="usable training questions"):
        train_embedder(
            retriever,
            question_rows(tmp_path, copies=1),
            out,
            collection="kb",
            base=resolve_model(str(tiny_encoder_dir)),
            config=EmbedderTrainingConfig(batch_size=64),
            overwrite=True,
            progress=False,
        )
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".taken")) == []


def test_too_few_questions_is_a_clear_error(
    retriever: Retriever, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="usable training questions"):
        train_embedder(
            retriever,
            question_rows(tmp_path, copies=1),
            tmp_path / "o",
            collection="kb",
            base=resolve_model(str(tiny_encoder_dir)),
            config=EmbedderTrainingConfig(batch_size=64),
            progress=False,
        )


def test_held_out_questions_are_written_for_evaluation(
    retriever: Retriever, tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ft"
    config = EmbedderTrainingConfig(batch_size=8, epochs=1, val_fraction=0.25, seed=2)
    meta = train_embedder(
        retriever,
        question_rows(tmp_path),
        out,
        collection="kb",
        base=resolve_model(str(tiny_encoder_dir)),
        config=config,
        device="cpu",
        dtype="fp32",
        progress=False,
    )
    held_out, problems = load_questions(out / "validation_questions.jsonl")
    assert not problems and len(held_out) == meta["examples"]["validation"] == 6
    assert meta["validation_before"]["questions"] == 6
    # the verdict's interval compares the trained model with the base, question by question
    low, high = meta["mrr10_gain_ci95"]
    gain = meta["validation_after"]["mrr@10"] - meta["validation_before"]["mrr@10"]
    assert low <= gain + 1e-9 and gain <= high + 1e-9
    assert not any(isinstance(v, list) for v in meta["validation_after"].values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_caching_gives_the_gradient_of_the_whole_batch(
    tiny_encoder_dir: Path, dropout: float
) -> None:
    """Oracle: the loss over embeddings computed with gradients in one graph. Without dropout
    that graph is the whole batch in one forward pass; with dropout it is the same micro-batches
    in the same order from the same seed (the same masks), so only the caching differs."""
    model = transformers.BertModel.from_pretrained(
        tiny_encoder_dir, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout
    )
    model.train()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_encoder_dir)
    chunks = [
        Chunk(f"c{i}", f"d{i}", f"Note {i}", 0, 0, len(d.text), d.text, 10, "h")
        for i, d in enumerate(DOCS[:6])
    ]
    examples = [
        Example(
            f"q{i}", f"what about {WORDS[i]} and {WORDS[i + 1]}?", i, frozenset({i}), (i + 1,), True
        )
        for i in range(4)
    ]
    mined = MinedSet("c", ChunkTable("c", chunks), examples, {})
    config = EmbedderTrainingConfig(micro_batch=3, hard_negatives=1)
    precision = Precision(torch.device("cpu"), "fp32")
    embed = _Embed(model, tokenizer, ModelProfile("t", "", "", "mean", 64), precision)

    torch.manual_seed(0)
    gold = GoldTable(examples)
    loss = _infonce_step(
        embed, examples, mined, config, cast(OptimizerStep, GradientsOnly(model)), gold
    ).item()
    cached = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    torch.manual_seed(0)
    rows = [ex.positive for ex in examples] + [r for ex in examples for r in ex.negatives]
    texts = [config.query_prefix + ex.query for ex in examples] + [
        config.passage_prefix + chunks[r].embed_text for r in rows
    ]
    parts = micro_batches(texts, 3 if dropout else len(texts))
    vectors = torch.cat([embed(part) for part in parts])
    q, p = vectors[: len(examples)], vectors[len(examples) :]
    logits = (q @ p.T) / config.temperature
    # question i's negative is question i+1's gold chunk: not a negative for question i+1
    for i in (1, 2, 3):
        logits[i, len(examples) + i - 1] = float("-inf")
    reference = torch.nn.functional.cross_entropy(logits, torch.arange(len(examples)))
    reference.backward()

    assert loss == pytest.approx(reference.item(), rel=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(cached) > 30 and set(cached) == set(grads)  # all but the unused pooler
    for name, grad in grads.items():
        torch.testing.assert_close(cached[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if not dropout:  # --micro-batch 0: the whole batch in one pass, no caching
        torch.manual_seed(0)
        plain = replace(config, micro_batch=0)
        whole = _infonce_step(
            embed, examples, mined, plain, cast(OptimizerStep, GradientsOnly(model)), gold
        ).item()
        assert whole == pytest.approx(reference.item(), rel=1e-5)
        for name, grad in model.named_parameters():
            if grad.grad is not None:
                torch.testing.assert_close(cached[name], grad.grad, rtol=1e-4, atol=1e-6)


@given(
    golds=st.lists(
        st.frozensets(st.integers(0, 12), min_size=1, max_size=4), min_size=1, max_size=8
    ),
    extra=st.lists(st.integers(0, 12), max_size=10),
)
def test_the_loss_mask_equals_the_nested_loop_it_replaced(golds, extra) -> None:
    """GoldTable.mask against the per-step Python comprehension the trainer used to build."""
    batch = [Example(f"q{i}", "q", min(g), g, (), True) for i, g in enumerate(golds)]
    rows = [ex.positive for ex in batch] + extra
    expected = [[r in ex.gold and j != i for j, r in enumerate(rows)] for i, ex in enumerate(batch)]
    table = GoldTable([*batch, Example("other", "q", 99, frozenset({99, 5}), (), True)])
    assert table.mask(batch, rows).tolist() == expected


def _table(docs: list[str]) -> ChunkTable:
    """A chunk table with one chunk per entry of `docs` (row i in document docs[i])."""
    chunks = [Chunk(f"c{i}", doc, doc, i, 0, 1, "x", 1, f"h{i}") for i, doc in enumerate(docs)]
    return ChunkTable("t", chunks)


def test_validation_is_split_by_document_so_it_judges_documents_never_trained_on() -> None:
    docs = [f"d{i // 3}" for i in range(60)]  # 20 documents, 3 chunks each
    table = _table(docs)
    examples = [
        Example(f"q{r}", "q", r, frozenset({r}), (), True) for r in range(len(table.chunks))
    ]
    train, val = split_examples(examples, 0.2, seed=3, index=table)
    doc_of = {r: table.chunks[r].doc_id for r in range(len(table.chunks))}
    assert {doc_of[ex.positive] for ex in train}.isdisjoint({doc_of[ex.positive] for ex in val})
    assert len(val) == 12 and len(train) == 48  # whole documents, 20% of the questions
    assert sorted(ex.question_id for ex in train + val) == sorted(e.question_id for e in examples)
    # the same seed, the same split; by question (no index) any document may be on both sides
    assert split_examples(examples, 0.2, seed=3, index=table) == (train, val)
    by_question = split_examples(examples, 0.2, seed=3)
    assert len(by_question[1]) == 12
    # one document: nothing to split by, so by question; never every document held out
    single = _table(["only"] * 10)
    one_doc = [Example(f"q{r}", "q", r, frozenset({r}), (), True) for r in range(10)]
    assert [len(part) for part in split_examples(one_doc, 0.3, seed=0, index=single)] == [7, 3]
    two = _table(["a"] * 9 + ["b"])
    pair = [Example(f"q{r}", "q", r, frozenset({r}), (), True) for r in range(10)]
    assert all(split_examples(pair, 0.9, seed=s, index=two)[0] for s in range(5))
