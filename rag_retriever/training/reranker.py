"""Train a cross-encoder reranker on the user's questions, with negatives from the retriever.

Example:
    rag-retriever train-reranker --collection squad --questions questions_train.jsonl \\
        --out models/reranker-squad --max-questions 2000

Each training group is one question, its gold chunk and `negatives` chunks taken from the top
of the collection's own hybrid list (never a gold chunk, never random): exactly the candidates
the reranker will see at query time. The model is `AutoModelForSequenceClassification` with one
logit, initialised from `--base` (default: all-MiniLM-L6-v2). The loss is the softmax cross
entropy of the gold chunk within its group (listwise); `--loss pointwise` uses binary cross
entropy per pair instead. Questions whose gold chunk is not among the candidates are skipped
and counted (the reranker cannot learn from them, nor fix them).

Starting from a sentence-embedding checkpoint (the default) the head is new, and the BERT pooler
under it was never trained (mean pooling never used it): `pooler_init="auto"` makes that pooler
the identity. Even so, such a model has to learn from scratch to carry query-passage relevance
into its CLS state: on SQuAD the loss stays at ln(group size) for the first ~800-950 questions
(~11 minutes of one CPU core; flat for the first 60 steps at every learning rate tried, 4e-5 to
2e-4, with or without the identity pooler). What it learns is bought by questions, so train on
as many as the budget allows, or continue from an earlier run (`--base` = its output directory:
the next run starts past the plateau). Measured on held-out SQuAD train questions, recall@1
(hybrid 0.69-0.75): after 1,791 questions 0.55 alone, 0.69 fused by RRF with hybrid; after
1,955 more in a second run 0.78 alone, 0.80 fused; one run over 3,385 questions (23 minutes on
2 cores) 0.81 alone, 0.83 fused.

Validation, before and after: on the held-out questions, recall@1/@5 and MRR@10 of the hybrid
order of their candidates, of the reranked order, and of the two fused by RRF (what `rerank`
mode returns with RAG_RERANK_FUSION=rrf). A fresh head is not validated before training.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import transformers

from rag_retriever.errors import ConfigError
from rag_retriever.eval.metrics import mrr_at_k, recall_at_k
from rag_retriever.models.device import Precision, training_thread
from rag_retriever.models.encoder import quiet_transformers
from rag_retriever.models.hub import model_directory
from rag_retriever.models.profiles import resolve_model
from rag_retriever.models.reranker import CrossEncoderReranker
from rag_retriever.query.fusion import rrf
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
from rag_retriever.training.mining import Example, MinedSet, mine_examples, split_examples

log = logging.getLogger(__name__)

NAME_FILE = "rag_reranker.json"
MIN_TRAIN_QUESTIONS = 8
# Weight names of the classification head of transformers' sequence classifiers (BERT-style
# "classifier", decoder-style "score").
HEAD_PREFIXES = ("classifier", "score")


PoolerInit = Literal["auto", "identity", "keep"]


@dataclass(frozen=True)
class RerankerTrainingConfig:
    # 3 (the hardest hybrid negatives) rather than 7: on a CPU the budget is pairs, and the
    # plateau a fresh head sits on ended after a similar number of *questions* with 7 negatives
    # (~800) and with 3 (~800-950) on SQuAD, so fewer pairs per question get past it sooner. The
    # top negatives are the ones that cost recall@1.
    negatives: int = 3
    epochs: int = 1
    batch_size: int = 8  # questions per step; each brings 1 + negatives pairs (32 pairs)
    # Pairs per forward pass with gradients (whole questions, at least one): memory follows this,
    # not batch_size. The loss is a mean over questions, so the accumulated gradient is the
    # batch's (exactly so without dropout). 0 = the whole batch in one pass.
    micro_batch: int = 8
    # 1e-4 / 1e-3 instead of BERT's usual 4e-5: at 4e-5 the model could not even memorise 16
    # training groups in 40 steps (loss 2.07 -> 1.89); at 2e-4 it did in 20 (-> 0.03).
    learning_rate: float = 1e-4
    head_learning_rate: float | None = 1e-3  # None = learning_rate
    warmup_fraction: float = 0.1
    # 256 = RAG_RERANK_MAX_LENGTH: train on what the reranker reads at query time. On SQuAD the
    # median question + gold chunk is 184 tokens (p90 213), so 192 cut half the gold chunks.
    max_length: int = 256
    max_questions: int | None = None
    val_fraction: float = 0.1
    seed: int = 0
    depth: int = 30  # hybrid candidates mined per question (and reranked in validation)
    loss: Literal["listwise", "pointwise"] = "listwise"
    freeze_layers: int = 0  # freeze the embeddings and the first N transformer layers
    # "auto": a fresh head on a checkpoint whose pooler was never trained (bias all zeros, as in
    # sentence-transformers checkpoints) gets an identity pooler instead of that random one.
    pooler_init: PoolerInit = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.micro_batch < 0:
            raise ConfigError(f"--micro-batch must be 0 or more, got {self.micro_batch}")


def load_base(source: str) -> tuple[Any, Any, bool]:
    """A one-logit sequence classifier from a cross-encoder or a plain encoder directory.

    Returns (model, tokenizer, fresh_head): whether the classification head was newly initialised
    (the source was not a sequence classifier).
    """
    directory = model_directory(source, what="base model", setting="--base")
    with quiet_transformers(new_head_expected=True):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            directory, num_labels=1, ignore_mismatched_sizes=True, output_loading_info=True
        )
    new = set(info.get("missing_keys") or ()) | {k for k, *_ in info.get("mismatched_keys") or ()}
    head = {k for k in new if k.startswith(HEAD_PREFIXES)}
    fresh_head = bool(head)
    if fresh_head:
        log.info("%s has no one-logit classification head: a new one is initialised", source)
    others = sorted(new - head)
    if others:
        log.warning(
            "%s: %d weights newly initialised besides the head: %s",
            source,
            len(others),
            ", ".join(others[:5]),
        )
    return model, tokenizer, fresh_head


def init_pooler(model: Any, mode: PoolerInit, *, fresh_head: bool) -> bool:
    """Make the pooler the identity (before its tanh) where asked or needed; True if it did.

    A sentence-transformers checkpoint (mean pooling) carries a BERT pooler that never got a
    gradient: all-MiniLM-L6-v2's has bias exactly 0 and weight std 0.009. Under a fresh one-logit
    classifier (std 0.02) the score is then a product of two small random maps of the CLS state
    (a saddle at zero); with an identity pooler the classifier reads tanh(CLS) directly. This
    removes a random projection, not the plateau: measured alone it did not make the loss move
    sooner (the CLS state itself carries no relevance at the start).
    """
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    dense = getattr(getattr(base, "pooler", None), "dense", None)
    if mode == "keep" or not isinstance(dense, torch.nn.Linear):
        if mode == "identity":
            raise ConfigError(
                f"--pooler-init identity needs a BERT-style pooler (a square dense layer); "
                f"{type(model).__name__} has none. Use --pooler-init keep."
            )
        return False
    if dense.in_features != dense.out_features:
        return False
    if mode == "auto" and not (fresh_head and not bool(dense.bias.detach().any())):
        return False
    with torch.no_grad():
        dense.weight.copy_(torch.eye(dense.in_features, dtype=dense.weight.dtype))
        dense.bias.zero_()
    return True


def _freeze(model: Any, layers: int) -> None:
    if layers <= 0:
        return
    base = getattr(model, model.base_model_prefix)
    for p in base.embeddings.parameters():
        p.requires_grad = False
    for layer in base.encoder.layer[:layers]:
        for p in layer.parameters():
            p.requires_grad = False


def _param_groups(model: Any, lr: float, head_lr: float | None) -> list[dict[str, Any]]:
    head_names = ("classifier", "pooler", "score")
    head = [
        p
        for n, p in model.named_parameters()
        if p.requires_grad and any(h in n for h in head_names)
    ]
    body = [
        p
        for n, p in model.named_parameters()
        if p.requires_grad and not any(h in n for h in head_names)
    ]
    return [{"params": body, "lr": lr}, {"params": head, "lr": head_lr or lr}]


def validate(
    reranker: CrossEncoderReranker | None, mined: MinedSet, examples: list[Example]
) -> dict[str, Any]:
    """Recall@1/@5 and MRR@10 of hybrid, reranked, and RRF(reranked, hybrid) candidate orders.

    `rerank+hybrid` is what `rerank` mode returns with RAG_RERANK_FUSION=rrf (RRF k=60, equal
    weights); `rerank` what it returns with RAG_RERANK_FUSION=none. Without a reranker: hybrid only.
    """
    if not examples:
        return {}
    orders: dict[str, list[list[int]]] = {"hybrid": []}
    if reranker is not None:
        orders |= {"rerank": [], "rerank+hybrid": []}
    for ex in examples:
        candidates = list(ex.ranked)
        orders["hybrid"].append(candidates)
        if reranker is None:
            continue
        scores = reranker.score(ex.query, mined.index.embed_texts(candidates)).scores
        reranked = [candidates[i] for i in np.argsort(-scores, kind="stable")]
        orders["rerank"].append(reranked)
        orders["rerank+hybrid"].append([r for r, _ in rrf([reranked, candidates])])
    out: dict[str, Any] = {"questions": len(examples)}
    n = len(examples)
    for name, lists in orders.items():
        pairs = list(zip(lists, examples, strict=True))
        # one gold item per question: any of its gold chunks answers it (eval/metrics.py)
        out[f"{name} recall@1"] = sum(recall_at_k(o, [ex.gold], 1) for o, ex in pairs) / n
        out[f"{name} recall@5"] = sum(recall_at_k(o, [ex.gold], 5) for o, ex in pairs) / n
        rr = [mrr_at_k(o, [ex.gold], 10) for o, ex in pairs]
        out[f"{name} mrr@10"] = sum(rr) / n
        out[f"{name} rr@10"] = rr  # per question, for the verdict's interval; not saved
    return out


def _fit(
    model: Any,
    tokenizer: Any,
    reranker: CrossEncoderReranker,
    train: list[Example],
    mined: MinedSet,
    config: RerankerTrainingConfig,
    precision: Precision,
    progress: bool,
) -> tuple[list[float], int]:
    """The training loop: shuffled batches of (question, positive + negatives) groups. Returns
    the per-step losses and the number of steps."""
    steps_per_epoch = -(-len(train) // config.batch_size)
    total = steps_per_epoch * config.epochs
    optimizer = torch.optim.AdamW(
        _param_groups(model, config.learning_rate, config.head_learning_rate), weight_decay=0.01
    )
    step = OptimizerStep(
        model, optimizer, warmup_linear(optimizer, total, config.warmup_fraction), precision
    )
    losses = run_steps(
        model,
        _epochs(train, config),
        lambda batch: _step(step, tokenizer, reranker, batch, mined, config, precision),
        total=total,
        desc="train-reranker",
        progress=progress,
    )
    return losses, total


def _epochs(train: list[Example], config: RerankerTrainingConfig) -> Iterator[list[list[Example]]]:
    """Each epoch's batches: the training examples in a new seeded order, cut into batches."""
    rng = np.random.default_rng(config.seed)
    for _ in range(config.epochs):
        order = rng.permutation(len(train))
        yield [
            [train[i] for i in order[start : start + config.batch_size]]
            for start in range(0, len(train), config.batch_size)
        ]


def _step(
    step: OptimizerStep,
    tokenizer: Any,
    reranker: CrossEncoderReranker,
    batch: list[Example],
    mined: MinedSet,
    config: RerankerTrainingConfig,
    precision: Precision,
) -> torch.Tensor:
    """One optimizer step over the batch, its gradient accumulated micro-batch by micro-batch
    (each part's mean loss weighted by its share of the questions). Returns the batch's loss,
    detached and on the device (reading it would wait for the device: run_steps reads the
    losses only to print them, and all of them once at the end)."""
    per_part = (
        max(1, config.micro_batch // (1 + config.negatives)) if config.micro_batch else len(batch)
    )
    parts = micro_batches(batch, per_part)
    shares: list[torch.Tensor] = []

    def backward(scale: Scale) -> None:
        for part in parts:
            loss = _batch_loss(tokenizer, reranker, list(part), mined, config, precision)
            share = loss * (len(part) / len(batch))
            scale(share).backward()
            shares.append(share.detach())

    step.run(backward)
    return torch.stack(shares).sum()


def _batch_loss(
    tokenizer: Any,
    reranker: CrossEncoderReranker,
    batch: list[Example],
    mined: MinedSet,
    config: RerankerTrainingConfig,
    precision: Precision,
) -> torch.Tensor:
    """Listwise: softmax cross-entropy with the positive first in each group; pointwise: BCE."""
    group = 1 + config.negatives
    queries = [ex.query for ex in batch for _ in range(group)]
    passages = mined.index.embed_texts([r for ex in batch for r in (ex.positive, *ex.negatives)])
    encoded = tokenizer(
        queries,
        passages,
        padding=True,
        truncation="only_second",
        max_length=config.max_length,
        return_tensors="pt",
    ).to(precision.device)
    with precision.autocast():
        logits = reranker.logits(dict(encoded)).view(len(batch), group)
    if config.loss == "listwise":
        target = torch.zeros(len(batch), dtype=torch.long, device=logits.device)
        return torch.nn.functional.cross_entropy(logits, target)
    labels = torch.zeros_like(logits)
    labels[:, 0] = 1.0
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _split(
    mined: MinedSet, config: RerankerTrainingConfig, problems: Sequence[str]
) -> tuple[list[Example], list[Example], dict[str, int]]:
    """The training and validation examples (those whose gold chunk is among the candidates:
    a reranker cannot learn from the others), and the skipped counts."""
    usable = [ex for ex in mined.examples if ex.positive_retrieved]
    skipped = dict(mined.skipped)
    skipped["gold_not_among_candidates"] = len(mined.examples) - len(usable)
    train, val = split_examples(usable, config.val_fraction, config.seed, mined.index)
    if len(train) < max(MIN_TRAIN_QUESTIONS, config.batch_size):
        raise ConfigError(
            f"only {len(train)} usable training questions (skipped: {skipped}, input problems: "
            f"{len(problems)}); the reranker needs questions whose gold chunk is among the top "
            f"{config.depth} hybrid candidates"
        )
    return train, val, skipped


def _save(model: transformers.PreTrainedModel, tokenizer: Any, out: Path, name: str) -> None:
    """The trained model as `CrossEncoderReranker.load` reads it (every layer trainable again,
    for whoever fine-tunes it next), with its name."""
    model.eval()
    for p in model.parameters():
        p.requires_grad = True
    save_model(model, tokenizer, out)
    (out / NAME_FILE).write_text(json.dumps({"name": name}) + "\n", encoding="utf-8")


@training_thread
def train_reranker(
    retriever: Retriever,
    questions_path: Path,
    out: Path,
    *,
    collection: str,
    base: str,
    config: RerankerTrainingConfig,
    device: str = "auto",
    dtype: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train into a new folder that takes `out`'s place when done (`fresh_output`)."""
    with fresh_output(out, overwrite) as work:
        started = time.perf_counter()
        questions, problems = start_training(questions_path, max_questions=config.max_questions)
        source = resolve_model(base).source if not Path(base).is_dir() else base
        # found (or refused) before the minutes of mining, not after
        directory = model_directory(source, what="base model", setting="--base")
        mined = mine_examples(
            retriever,
            questions,
            collection=collection,
            negatives=config.negatives,
            depth=config.depth,
            progress=progress,
        )
        train, val, skipped = _split(mined, config, problems)
        torch.manual_seed(config.seed)  # the head initialisation and dropout
        model, tokenizer, fresh_head = load_base(str(directory))
        pooler_reset = init_pooler(model, config.pooler_init, fresh_head=fresh_head)
        precision = training_precision(device, dtype)
        reranker = CrossEncoderReranker(
            model, tokenizer, name=str(work), precision=precision, max_length=config.max_length
        )
        # A fresh head scores at random: validating it would only cost time (minutes on a CPU).
        before = validate(None if fresh_head else reranker, mined, val)
        _freeze(model, config.freeze_layers)
        losses, total = _fit(model, tokenizer, reranker, train, mined, config, precision, progress)
        name = config.name or f"reranker-{mined.collection}"
        _save(model, tokenizer, work, name)
        trained = CrossEncoderReranker.load(
            work, device=device, dtype=dtype, max_length=config.max_length
        )
        after = validate(trained, mined, val)
        return write_training_record(
            work,
            "reranker",
            questions_path=questions_path,
            config=config,
            precision=precision,
            split=(train, val),
            skipped=skipped,
            problems=problems,
            steps=total,
            losses=losses,
            # the gain is over hybrid without a reranker, what this model would change
            judged=judged_validation(
                before, after, new=after.get("rerank+hybrid rr@10"), old=after.get("hybrid rr@10")
            ),
            started=started,
            name=name,
            base_model=source,
            collection=mined.collection,
            collection_fingerprint=retriever.store.record(mined.collection).fingerprint.to_json(),
            fresh_head=fresh_head,
            pooler_reset_to_identity=pooler_reset,
            pairs_per_step=config.batch_size * (1 + config.negatives),
        )
