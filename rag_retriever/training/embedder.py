"""Contrastive fine-tuning of the bi-encoder on the user's labelled questions.

Example:
    rag-retriever train-embedder --collection squad --questions questions_train.jsonl \\
        --out models/minilm-squad --max-questions 2000

Recipe (InfoNCE, as in E5/DPR): each batch holds B questions, their positive chunks and one or
more BM25/dense-mined hard negatives per question; a question's logits are its cosine with every
passage of the batch divided by a temperature (0.05); the loss is the cross entropy of picking
its own positive. Passages that are gold for a question (its other gold chunks, or the same
chunk mined as someone else's negative) are masked out of its negatives, and no batch holds
two questions with the same gold chunk. The model learns to use the `query: ` / `passage: `
prefixes it is trained with; they are saved in `rag_profile.json` beside the weights, with the
pooling, so the normal encoder path loads the result as it is. The new weights (and prefixes)
give a new fingerprint: using the model means a full re-ingest into a new collection version.

Validation (before and after): dense recall@1/@5 of the held-out questions over a pool made of
their gold chunks and mined candidates (cheap, and a fair before/after comparison; the real test
is `eval/recall_at_k.py` on a new collection version).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rag_retriever.errors import ConfigError
from rag_retriever.eval.metrics import mrr_at_k, recall_at_k
from rag_retriever.models.device import Precision, training_thread
from rag_retriever.models.encoder import Encoder, embed_batch
from rag_retriever.models.profiles import ModelProfile, ResolvedModel, write_profile_file
from rag_retriever.query.retriever import Retriever
from rag_retriever.training.common import (
    OptimizerStep,
    Scale,
    fresh_output,
    judged_validation,
    micro_batches,
    run_steps,
    save_model,
    start_training,
    training_precision,
    warmup_linear,
    write_training_record,
)
from rag_retriever.training.mining import (
    Example,
    MinedSet,
    batches_without_shared_gold,
    mine_examples,
    split_examples,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbedderTrainingConfig:
    query_prefix: str = "query: "
    passage_prefix: str = "passage: "
    hard_negatives: int = 1
    batch_size: int = 32
    # Texts (questions and passages) per forward pass with gradients; memory follows this, not
    # batch_size (gradient caching), and the gradient does not depend on it. 0 = the whole batch
    # in one pass, without caching (memory then grows with batch_size).
    micro_batch: int = 8
    epochs: int = 1
    learning_rate: float = 3e-5
    warmup_fraction: float = 0.1
    temperature: float = 0.05
    max_questions: int | None = None
    val_fraction: float = 0.1
    seed: int = 0
    name: str | None = None

    def __post_init__(self) -> None:
        if self.micro_batch < 0:
            raise ConfigError(f"--micro-batch must be 0 or more, got {self.micro_batch}")


class _Embed:
    """The serving forward pass (encoder.embed_batch) of one model, so training and serving
    cannot drift."""

    def __init__(self, model: Any, tokenizer: Any, profile: ModelProfile, precision: Precision):
        self.model, self.tokenizer, self.precision = model, tokenizer, precision
        self.pooling = profile.pooling
        self.max_length = profile.max_seq_length or 256

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        with self.precision.autocast():
            return embed_batch(
                self.model,
                self.tokenizer,
                texts,
                pooling=self.pooling,
                max_length=self.max_length,
                device=self.precision.device,
            )


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> Any:
    """Run with the random state of an earlier pass (the same dropout masks), then carry on
    with the state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class GoldTable:
    """Each training example's gold chunk rows in one array, built once per training run, so
    that a step's loss mask is one array comparison instead of a nested Python loop."""

    def __init__(self, examples: Sequence[Example]) -> None:
        self._index = {ex: i for i, ex in enumerate(examples)}
        width = max((len(ex.gold) for ex in examples), default=1)
        self._gold = np.full((len(examples), width), -1, dtype=np.int64)
        for i, ex in enumerate(examples):
            self._gold[i, : len(ex.gold)] = sorted(ex.gold)

    def mask(self, batch: Sequence[Example], rows: Sequence[int]) -> np.ndarray:
        """(len(batch), len(rows)) booleans: row j is gold for question i, and j != i (question
        i's own positive is column i)."""
        gold = self._gold[[self._index[ex] for ex in batch]]
        mask = (gold[:, :, None] == np.asarray(rows, dtype=np.int64)[None, None, :]).any(axis=1)
        np.fill_diagonal(mask, False)
        return mask


def _infonce(
    vectors: torch.Tensor, n_questions: int, mask: np.ndarray, temperature: float
) -> torch.Tensor:
    """The loss of the batch's questions (the first `n_questions` vectors) against its passages
    (the rest), with `mask` (GoldTable.mask) taking each question's other gold chunks out of its
    negatives."""
    q, p = vectors[:n_questions], vectors[n_questions:]
    logits = (q @ p.T) / temperature
    on_host = torch.from_numpy(mask)
    if logits.device.type == "cuda":
        on_host = on_host.pin_memory()
    logits = logits.masked_fill(on_host.to(logits.device, non_blocking=True), float("-inf"))
    return torch.nn.functional.cross_entropy(
        logits, torch.arange(n_questions, device=logits.device)
    )


def _infonce_step(
    embed: _Embed,
    batch: list[Example],
    mined: MinedSet,
    config: EmbedderTrainingConfig,
    step: OptimizerStep,
    gold: GoldTable,
) -> torch.Tensor:
    """One step of InfoNCE over the batch: each question against every positive and hard negative
    in it; a passage that is gold for question i is no negative for it (except its own column).

    Gradient caching (Gao et al., 2021): the batch is embedded without gradients, micro-batch by
    micro-batch; the loss is backpropagated to the embeddings only; then each micro-batch is
    embedded again, with gradients and the same dropout masks, and backpropagates its slice of
    the embeddings' gradient. The gradient is the full batch's (a test compares), while memory
    holds the activations of one micro-batch, however large the batch. `micro_batch=0`: the
    whole batch in one pass (for a GPU with memory to spare; on a 2-core CPU it was slower).
    Returns the loss, detached and on the device: reading it would wait for the device."""
    rows = [ex.positive for ex in batch] + [
        r for ex in batch for r in ex.negatives[: config.hard_negatives]
    ]
    texts = [config.query_prefix + ex.query for ex in batch] + [
        config.passage_prefix + text for text in mined.index.embed_texts(rows)
    ]
    mask = gold.mask(batch, rows)
    if config.micro_batch == 0:  # the whole batch in one pass with gradients
        loss = _infonce(embed(texts), len(batch), mask, config.temperature)
        step(loss)
        return loss.detach()
    device = embed.precision.device
    parts = micro_batches(texts, config.micro_batch)
    states, cached = [], []
    with torch.no_grad():
        for part in parts:
            states.append(_rng_state(device))
            cached.append(embed(part))
    vectors = torch.cat(cached).requires_grad_()
    loss = _infonce(vectors, len(batch), mask, config.temperature)

    def backward(scale: Scale) -> None:
        scale(loss).backward()  # to the embeddings only: they are leaves here
        assert vectors.grad is not None
        grads = vectors.grad.split([len(part) for part in parts])
        for part, state, grad in zip(parts, states, grads, strict=True):
            with _replayed(state, device):
                embed(part).backward(grad)

    step.run(backward)
    return loss.detach()


def validate(encoder: Encoder, mined: MinedSet, examples: list[Example]) -> dict[str, Any]:
    """Dense recall@1/@5 and MRR@10 of `examples` over the pool of their gold + mined chunks."""
    if not examples:
        return {}
    pool_rows = sorted({r for ex in examples for r in (*ex.gold, *ex.negatives)})
    passages = encoder.encode_passages(mined.index.embed_texts(pool_rows)).vectors
    queries = encoder.encode_queries([ex.query for ex in examples]).vectors
    scores = queries @ passages.T
    r1 = r5 = 0.0
    rr = []
    for i, ex in enumerate(examples):
        ranking = [pool_rows[j] for j in np.argsort(-scores[i], kind="stable")]
        # one gold item per question: any of its gold chunks answers it (eval/metrics.py)
        r1 += recall_at_k(ranking, [ex.gold], 1)
        r5 += recall_at_k(ranking, [ex.gold], 5)
        rr.append(mrr_at_k(ranking, [ex.gold], 10))
    n = len(examples)
    return {
        "recall@1": r1 / n,
        "recall@5": r5 / n,
        "mrr@10": sum(rr) / n,
        "questions": n,
        "pool": len(pool_rows),
        "rr@10": rr,  # per question, for the verdict's interval; not saved
    }


def _fit(
    embed: _Embed,
    train: list[Example],
    mined: MinedSet,
    config: EmbedderTrainingConfig,
    progress: bool,
) -> tuple[list[float], int]:
    """The training loop: shuffled batches without a shared gold chunk, one InfoNCE step each.
    Returns the per-step losses and the number of steps."""
    model = embed.model
    gold = GoldTable(train)
    steps_per_epoch = sum(
        1 for _ in batches_without_shared_gold(train, config.batch_size, config.seed)
    )
    total = steps_per_epoch * config.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.01)
    step = OptimizerStep(
        model, optimizer, warmup_linear(optimizer, total, config.warmup_fraction), embed.precision
    )
    epochs = (
        batches_without_shared_gold(train, config.batch_size, config.seed + epoch)
        for epoch in range(config.epochs)
    )
    losses = run_steps(
        model,
        epochs,
        lambda batch: _infonce_step(embed, batch, mined, config, step, gold),
        total=total,
        desc="train-embedder",
        progress=progress,
    )
    return losses, total


def _profile(
    base: ResolvedModel, config: EmbedderTrainingConfig, collection: str, max_seq_length: int
) -> ModelProfile:
    """The fine-tuned model's profile: the base's pooling, the configured prefixes."""
    return ModelProfile(
        name=config.name or f"{base.profile.name.split('/')[-1]}-ft-{collection}",
        query_prefix=config.query_prefix,
        passage_prefix=config.passage_prefix,
        pooling=base.profile.pooling,
        max_seq_length=max_seq_length,
    )


@training_thread
def train_embedder(
    retriever: Retriever,
    questions_path: Path,
    out: Path,
    *,
    collection: str,
    base: ResolvedModel,
    config: EmbedderTrainingConfig,
    device: str = "auto",
    dtype: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train into a new folder that takes `out`'s place when done (`fresh_output`)."""
    with fresh_output(out, overwrite) as work:
        started = time.perf_counter()
        questions, problems = start_training(questions_path, max_questions=config.max_questions)
        mined = mine_examples(
            retriever,
            questions,
            collection=collection,
            negatives=max(1, config.hard_negatives),
            progress=progress,
        )
        train, val = split_examples(mined.examples, config.val_fraction, config.seed, mined.index)
        if len(train) < config.batch_size:
            raise ConfigError(
                f"only {len(train)} usable training questions (skipped: {mined.skipped}, input problems: "
                f"{len(problems)}); need at least one batch of {config.batch_size}"
            )
        profile = _profile(base, config, collection, retriever.encoder.max_seq_length)
        precision = training_precision(device, dtype)
        torch.manual_seed(config.seed)  # dropout
        base_with_new_prefixes = Encoder.load(
            ResolvedModel(base.source, profile), device=device, dtype=dtype, trainable=True
        )
        before = validate(base_with_new_prefixes, mined, val)
        model = base_with_new_prefixes.model
        tokenizer = base_with_new_prefixes.tokenizer
        embed = _Embed(model, tokenizer, profile, precision)
        losses, total = _fit(embed, train, mined, config, progress)
        save_model(model, tokenizer, work)
        write_profile_file(work, profile)
        trained = Encoder.load(str(work), device=device, dtype=dtype)
        after = validate(trained, mined, val)
        return write_training_record(
            work,
            "embedder",
            questions_path=questions_path,
            config=config,
            precision=precision,
            split=(train, val),
            skipped=mined.skipped,
            problems=problems,
            steps=total,
            losses=losses,
            judged=judged_validation(
                before, after, new=after.get("rr@10"), old=before.get("rr@10")
            ),
            started=started,
            base_model=base.source,
            base_profile=base.profile.to_json(),
            profile=profile.to_json(),
            fingerprint=trained.fingerprint.to_json(),
            collection=mined.collection,
        )
