"""The training commands: `train-embedder`, `train-reranker`, `tune-fusion` and `improve`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rag_retriever.cli.common import (
    MODEL,
    STORE,
    at_least,
    command_settings,
    fraction,
    parse_duration,
    positive_number,
    reads_files,
    setting_flags,
)
from rag_retriever.settings import (
    default_of,
    shown_default,
)


def cmd_train_embedder(args: argparse.Namespace) -> int:
    from rag_retriever.models.profiles import resolve_model
    from rag_retriever.query.retriever import Retriever
    from rag_retriever.training.embedder import EmbedderTrainingConfig, train_embedder

    settings = command_settings(args, collection=args.collection)
    retriever = Retriever.from_settings(settings)  # the collection's own model mines negatives
    base = (
        resolve_model(args.base)
        if args.base
        else resolve_model(
            settings.embed_model,
            query_prefix=settings.query_prefix,
            passage_prefix=settings.passage_prefix,
            pooling=settings.pooling,
        )
    )
    prefixes = {"query_prefix": args.query_prefix, "passage_prefix": args.passage_prefix}
    config = EmbedderTrainingConfig(
        **{name: value for name, value in prefixes.items() if value is not None},
        hard_negatives=args.hard_negatives,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        epochs=args.epochs,
        learning_rate=args.lr,
        temperature=args.temperature,
        max_questions=args.max_questions,
        val_fraction=args.val_fraction,
        seed=args.seed,
        name=args.name,
    )
    meta = train_embedder(
        retriever,
        args.questions,
        args.out,
        collection=settings.collection,
        base=base,
        config=config,
        device=settings.device,
        dtype=settings.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    return _print_training(
        meta,
        f"{args.out} ({meta['fingerprint']['model']}@{meta['fingerprint']['id']})",
        f"RAG_EMBED_MODEL={args.out} rag-retriever ingest CORPUS --collection "
        f"{settings.collection} --gate QUESTIONS.jsonl  (a new model means a full re-ingest)",
        verdict=training_verdict(meta, new="mrr@10", old="mrr@10", what="the fine-tuned embedder"),
        allow_worse=args.allow_worse,
    )


# Exit status of a training command whose model validated worse than what it would replace.
EXIT_WORSE = 4


def training_verdict(meta: dict[str, Any], *, new: str, old: str, what: str) -> tuple[bool, str]:
    """(keep?, one plain line): the new model's validation MRR@10 against what it would replace
    (the embedder before training; for a reranker, hybrid search without it)."""
    from rag_retriever.eval.judge import judge

    before, after = meta["validation_before"], meta["validation_after"]
    baseline = after.get(old) if old != new else before.get(old)
    n = int(after.get("questions", 0))
    if not n or baseline is None or new not in after:
        return True, f"unjudged: {what} was not validated (no held-out questions)"
    verdict = judge({"mrr@10": after[new]}, {"mrr@10": baseline}, metric="mrr@10")
    interval = meta.get("mrr10_gain_ci95")
    ci = f", 95% CI {interval[0]:+.4f}..{interval[1]:+.4f}" if interval else ""
    figures = (
        f"MRR@10 {after[new]:.4f} vs {baseline:.4f} ({verdict.change:+.4f}{ci}) "
        f"on {n} held-out questions"
    )
    if verdict.worse:
        return False, f"WORSE: {what} would make retrieval worse: {figures}"
    return True, f"better: {figures}" if verdict.better else f"no change: {figures}"


def _print_training(
    meta: dict[str, Any],
    model: str,
    next_step: str,
    *,
    verdict: tuple[bool, str] = (True, ""),
    allow_worse: bool = False,
) -> int:
    """The summary both training commands print: examples, loss, validation before -> after,
    the verdict; the next step only when the model helps. Returns the exit status."""
    before, after = meta["validation_before"], meta["validation_after"]
    examples = meta["examples"]
    print(f"model       {model}")
    print(
        f"examples    {examples['train']} train, {examples['validation']} validation "
        f"(held out: {meta['validation_questions']}), skipped {examples['skipped']}"
    )
    print(
        f"loss        {meta['loss_first_20']:.3f} -> {meta['loss_last_20']:.3f} "
        f"over {meta['steps']} steps"
    )
    for key in (k for k in after if "@" in k):  # the metrics, not the counts
        was = f"{before[key]:.4f}" if key in before else "  -   "
        print(f"validation  {key}: {was} -> {after[key]:.4f}")
    if any("@" in k and k not in before for k in after):
        print("            (-: the head was new; a random head is not validated before training)")
    print(f"time        {meta['time_s']:.0f}s")
    keep, line = verdict
    print(f"verdict     {line}")
    if keep:
        print(f"next        {next_step}")
        return 0
    print("next        none: keep what you serve now (the model was written, but do not use it)")
    return 0 if allow_worse else EXIT_WORSE


def cmd_train_reranker(args: argparse.Namespace) -> int:
    from rag_retriever.query.retriever import Retriever
    from rag_retriever.training.reranker import RerankerTrainingConfig, train_reranker

    settings = command_settings(args, collection=args.collection, rerank_model=None)
    retriever = Retriever.from_settings(settings.replace(rerank_model=None))
    config = RerankerTrainingConfig(
        negatives=args.negatives,
        epochs=args.epochs,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        learning_rate=args.lr,
        head_learning_rate=args.head_lr,
        max_length=args.max_length,
        max_questions=args.max_questions,
        val_fraction=args.val_fraction,
        seed=args.seed,
        depth=args.depth,
        loss=args.loss,
        freeze_layers=args.freeze_layers,
        pooler_init=args.pooler_init,
        name=args.name,
    )
    meta = train_reranker(
        retriever,
        args.questions,
        args.out,
        collection=settings.collection,
        base=args.base or default_of("embed_model"),
        config=config,
        device=settings.device,
        dtype=settings.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    return _print_training(
        meta,
        f"{args.out} ({meta['name']})",
        f"RAG_RERANK_MODEL={args.out} rag-retriever search QUESTION --mode rerank",
        verdict=training_verdict(
            meta, new="rerank+hybrid mrr@10", old="hybrid mrr@10", what="the reranker"
        ),
        allow_worse=args.allow_worse,
    )


def cmd_tune_fusion(args: argparse.Namespace) -> int:
    from rag_retriever.eval.questions import load_questions
    from rag_retriever.query.retriever import Retriever
    from rag_retriever.training.fusion import tune_fusion

    settings = command_settings(args, collection=args.collection, rerank_model=None)
    questions, problems = load_questions(args.questions)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    retriever = Retriever.from_settings(settings.replace(rerank_model=None))
    report = tune_fusion(
        retriever,
        questions,
        collection=settings.collection,
        held_out_fraction=args.held_out,
        seed=args.seed,
        store=not args.dry_run,
        progress=not args.no_progress,
        lock_dir=settings.data_dir,
        lock_wait_s=settings.lock_wait_s,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    print(f"collection  {report.collection}: {report.candidates} fusions tried")
    print(f"default     {report.default.describe()}")
    print(f"best        {report.best.describe()}")
    names = ("mrr@10", "recall@1", "recall@5", "recall@50", "recall@100")
    print(f"{'':<22}" + "".join(f"{n:>11}" for n in names) + f"{'questions':>11}")
    for part, figures in (("train", report.train), ("held-out", report.held_out)):
        for which, f in figures.items():
            values = f.metrics()
            print(
                f"{part + ' ' + which:<22}"
                + "".join(f"{values[n]:>11.4f}" for n in names)
                + f"{f.questions:>11}"
            )
    if report.stored:
        print(f"stored      the best fusion now serves {report.collection} (rollback restores)")
    elif args.dry_run:
        print("not stored  (--dry-run)")
    else:
        print(
            "not stored  the best fusion did not beat the default on the held-out questions "
            "(MRR@10, without losing recall@50 or @100)"
        )
    return 0


def _training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--collection", required=True, help="collection to mine positives/negatives from"
    )
    p.add_argument(
        "--questions",
        type=Path,
        required=True,
        help="labelled training questions (.jsonl)",
    )
    reads_files(p, "questions")
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    p.add_argument("--epochs", type=at_least(1), default=1, help="passes over the questions (1)")
    p.add_argument("--max-questions", type=at_least(1), help="use only the first N questions")
    p.add_argument(
        "--val-fraction", type=fraction, default=0.1, help="held-out validation part (0.1)"
    )
    p.add_argument(
        "--micro-batch",
        type=at_least(0),
        default=8,
        help="texts (embedder) or pairs (reranker) per forward pass with gradients; memory "
        "follows it, not --batch-size, and the gradient does not depend on it; 0 = the whole "
        "batch at once, for a GPU with memory to spare (8)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split and shuffling (0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument(
        "--allow-worse",
        action="store_true",
        help=f"exit 0 even when the model validates worse than what it replaces ({EXIT_WORSE})",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, plain lines otherwise)",
    )


def add_train_embedder(sub: Any) -> None:
    """`train-embedder`: fine-tune the embedding model on labelled questions."""
    p = sub.add_parser("train-embedder", help="fine-tune the embedding model on labelled questions")
    _training_args(p)
    p.add_argument("--base", help="model to start from (default RAG_EMBED_MODEL)")
    # Unset: the trainer's own defaults (E5's prefixes, EmbedderTrainingConfig), whatever the
    # base model's profile says (RAG_QUERY_PREFIX is the prefix of the model being served).
    p.add_argument(
        "--query-prefix", help="prefix learned for questions (default: E5's query prefix)"
    )
    p.add_argument(
        "--passage-prefix", help="prefix learned for chunks (default: E5's passage prefix)"
    )
    p.add_argument(
        "--hard-negatives",
        type=at_least(0),
        default=1,
        help="mined hard negatives per question (1)",
    )
    p.add_argument("--batch-size", type=at_least(1), default=32, help="questions per step (32)")
    p.add_argument("--lr", type=positive_number, default=3e-5, help="learning rate (3e-05)")
    p.add_argument(
        "--temperature",
        type=positive_number,
        default=0.05,
        help="contrastive loss temperature (0.05)",
    )
    p.add_argument(
        "--name", help="model name recorded in its profile (default <base>-ft-<collection>)"
    )
    setting_flags(p, *MODEL, *STORE)
    p.set_defaults(func=cmd_train_embedder)


def add_train_reranker(sub: Any) -> None:
    """`train-reranker`: train a cross-encoder reranker on labelled questions."""
    p = sub.add_parser(
        "train-reranker", help="train a cross-encoder reranker on labelled questions"
    )
    _training_args(p)
    p.add_argument("--base", help=f"model to start from (default {shown_default('embed_model')})")
    # The same defaults as RerankerTrainingConfig (a test checks), without importing torch here.
    p.add_argument(
        "--negatives", type=at_least(1), default=3, help="hybrid-mined negatives per question (3)"
    )
    p.add_argument("--batch-size", type=at_least(1), default=8, help="questions per step (8)")
    p.add_argument("--lr", type=positive_number, default=1e-4, help="body learning rate (0.0001)")
    p.add_argument(
        "--head-lr",
        type=positive_number,
        default=1e-3,
        help="pooler + classifier learning rate (0.001)",
    )
    p.add_argument(
        "--max-length",
        type=at_least(1),
        default=256,
        help="tokens of question + chunk (256 = RAG_RERANK_MAX_LENGTH's default)",
    )
    p.add_argument(
        "--pooler-init",
        choices=("auto", "identity", "keep"),
        default="auto",
        help="identity: reset the pooler to the identity; auto (default): do so when the head "
        "is new and the base's pooler was never trained (sentence-transformers); keep: leave it",
    )
    p.add_argument(
        "--depth", type=at_least(1), default=30, help="hybrid candidates mined per question (30)"
    )
    p.add_argument(
        "--loss",
        choices=("listwise", "pointwise"),
        default="listwise",
        help="listwise: softmax over each question's candidates (default); pointwise: BCE",
    )
    p.add_argument(
        "--freeze-layers", type=at_least(0), default=0, help="freeze embeddings + first N layers"
    )
    p.add_argument("--name", help="reranker name recorded with it")
    setting_flags(p, *MODEL, *STORE)
    p.set_defaults(func=cmd_train_reranker)


def add_tune_fusion(sub: Any) -> None:
    """`tune-fusion`: fit a version's fusion on labelled questions."""
    p = sub.add_parser(
        "tune-fusion",
        help="fit the fusion of dense and BM25 (RRF k, weights, depths, or DBSF) on questions",
    )
    p.add_argument("--collection", required=True, help="alias or version to tune")
    p.add_argument("--questions", type=Path, required=True, help="labelled questions (.jsonl)")
    reads_files(p, "questions")
    p.add_argument(
        "--held-out", type=float, default=0.3, help="part checked, split by document (0.3)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split (0)")
    p.add_argument("--dry-run", action="store_true", help="report only; store nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, plain lines otherwise)",
    )
    setting_flags(p, *MODEL, *STORE)
    p.set_defaults(func=cmd_tune_fusion)


def add_improve(sub: Any) -> None:
    """`improve`: embedder, fusion and reranker fitted to the user's questions, then a gate."""
    p = sub.add_parser(
        "improve",
        help="fit the embedder, the fusion and a reranker to labelled questions; promote the "
        "result only when it beats the live version on held-out questions",
    )
    p.add_argument("--collection", required=True, help="the alias to improve")
    p.add_argument("--questions", type=Path, required=True, help="labelled questions (.jsonl)")
    reads_files(p, "questions")
    p.add_argument(
        "--steps",
        default="embedder,fusion,reranker",
        help="comma-separated steps to try; they run in the order embedder, fusion, reranker "
        "(embedder,fusion,reranker)",
    )
    p.add_argument(
        "--budget",
        type=parse_duration,
        help="time budget of this invocation, e.g. 45m or 2h; the steps are sized to it",
    )
    p.add_argument(
        "--folds",
        type=int,
        help="judge each step by k-fold cross-validation over every question and refit the kept "
        "ones on all of them (2-10), or 1 for one held-out part (--held-out, --fusion-part); "
        "default 5 folds below 2,000 questions, else 1",
    )
    p.add_argument(
        "--held-out",
        type=float,
        default=0.3,
        help="with --folds 1: the part judged on, split by document (0.3)",
    )
    p.add_argument(
        "--fusion-part",
        type=float,
        default=0.2,
        help="with --folds 1: the part the fusion is fitted on, split by document; no model "
        "trains on it (0.2)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split and training (0)")
    p.add_argument(
        "--max-regression",
        type=float,
        default=0.01,
        help="refuse to promote if held-out recall@10 falls by more (0.01)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        help="where the run keeps its state and question splits, to resume "
        "(default RAG_DATA_DIR/improve/ALIAS)",
    )
    p.add_argument("--json", action="store_true", help="print the final state as JSON")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (bars on a terminal, plain lines otherwise)",
    )
    # The models are the versions' own; these settings shape the run.
    setting_flags(
        p,
        "device",
        "dtype",
        "embed_batch_size",
        "rerank_candidates",
        "keep_versions",
        "retention_grace_s",
        *STORE,
    )
    p.set_defaults(func=cmd_improve)


def cmd_improve(args: argparse.Namespace) -> int:
    from rag_retriever.training.improve import ImproveOptions
    from rag_retriever.training.improver import improver

    settings = command_settings(args, collection=args.collection)
    options = ImproveOptions(
        steps=tuple(s.strip() for s in args.steps.split(",") if s.strip()),
        budget_s=args.budget,
        held_out=args.held_out,
        fusion_part=args.fusion_part,
        seed=args.seed,
        max_regression=args.max_regression,
        progress=not args.no_progress,
        folds=args.folds,
    )
    work_dir = args.work_dir or settings.data_dir / "improve" / settings.collection
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    run = improver(settings, args.questions, work_dir=work_dir, options=options, say=say)
    state = run.run()
    if args.json:
        print(json.dumps(state, indent=2, default=str))
    else:
        _print_improve_table(state)
    return 0


def _print_improve_table(state: dict[str, Any]) -> None:
    """One before -> after row per step, on the held-out questions."""
    results = state["results"]
    print(
        f"\n{'step':<10}{'kept':>6}{'mrr@10':>9}{'recall@1':>10}{'recall@10':>11}"
        f"{'time':>8}{'peak MB':>9}"
    )
    for step in ("baseline", "embedder", "candidate", "fusion", "reranker", "gate"):
        r = results.get(step)
        if r is None:
            continue
        figures = r.get("figures") or r.get("new") or {}
        kept = {True: "yes", False: "no"}.get(r.get("kept", r.get("promoted")), "")
        row = f"{step:<10}{kept:>6}"
        if figures:
            row += f"{figures['mrr@10']:>9.4f}{figures['recall@1']:>10.4f}{figures['recall@10']:>11.4f}"
        else:
            row += " " * 30
        print(f"{row}{r.get('time_s', 0):>7.0f}s{r.get('peak_rss_mb') or 0:>9.0f}")
