"""Training examples mined from a collection: gold positives and hard negatives.

Example:
    >>> examples, stats = mine_examples(retriever, questions, collection="squad", negatives=7)  # doctest: +SKIP

The positive of a question is its best-ranked gold chunk in the collection's hybrid list (the
first gold chunk when none was retrieved); the gold set is every chunk that contains a gold span
(or, without spans, every chunk of a gold document). Negatives are the highest-ranked chunks of
the hybrid list (dense + BM25) that are not gold: hard, and never random. Questions without any
gold chunk (a chunking miss) or with unknown documents are skipped and counted.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rag_retriever.eval.evaluation import gold_items
from rag_retriever.eval.questions import Question
from rag_retriever.progress import progress as progress_of
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.retriever import Retriever

MINE_BATCH = 64


@dataclass(frozen=True)
class Example:
    question_id: str
    query: str
    positive: int  # chunk row
    gold: frozenset[int]  # every gold chunk row (never used as a negative)
    negatives: tuple[int, ...]  # hardest first
    positive_retrieved: bool  # the gold chunk was among the hybrid candidates
    ranked: tuple[int, ...] = ()  # the hybrid list the negatives came from (rows, best first)


@dataclass(frozen=True)
class MinedSet:
    collection: str
    index: ChunkTable
    examples: list[Example]
    skipped: dict[str, int]


def mine_examples(
    retriever: Retriever,
    questions: Sequence[Question],
    *,
    collection: str,
    negatives: int,
    depth: int = 30,
    progress: bool = False,
) -> MinedSet:
    """Mine one example per usable question; `depth` = how far down the hybrid list to look."""
    name = retriever.open_collection(collection, "hybrid").name
    index = ChunkTable.load(retriever.store, name)
    rows_of_doc = index.rows_of_doc
    skipped = Counter[str]()
    usable: list[tuple[Question, frozenset[int]]] = []
    for q in questions:
        if not any(d in rows_of_doc for d in q.gold_doc_ids):
            skipped["unknown_gold_doc"] += 1
            continue
        items = gold_items(q, index, rows_of_doc, "chunk")
        gold = frozenset(int(r) for item in items for r in item)  # type: ignore[call-overload]
        if not gold:
            skipped["no_gold_chunk"] += 1
            continue
        usable.append((q, gold))
    examples: list[Example] = []
    bar = progress_of(total=len(usable), desc="mining negatives", unit="q", enabled=progress)
    for start in range(0, len(usable), MINE_BATCH):
        batch = usable[start : start + MINE_BATCH]
        _, traces = retriever.trace([q.question for q, _ in batch], mode="hybrid", collection=name)
        for (q, gold), trace in zip(batch, traces, strict=True):
            ranked = index.rows([cid for cid, _ in trace.fused or []][:depth])
            retrieved_gold = [r for r in ranked if r in gold]
            positive = retrieved_gold[0] if retrieved_gold else min(gold)
            hard = [r for r in ranked if r not in gold][:negatives]
            if len(hard) < negatives:
                skipped["too_few_negatives"] += 1
                continue
            examples.append(
                Example(
                    q.id,
                    q.question,
                    positive,
                    gold,
                    tuple(hard),
                    bool(retrieved_gold),
                    tuple(ranked),
                )
            )
        bar.update(len(batch))
    bar.close()
    return MinedSet(name, index, examples, dict(skipped))


def split_examples(
    examples: Sequence[Example],
    val_fraction: float,
    seed: int,
    index: ChunkTable | None = None,
) -> tuple[list[Example], list[Example]]:
    """A seeded train/validation split. With the chunk `index`, by document: the questions whose
    positive lies in one document all go to the same side, so validation asks about documents the
    model was not trained on (split by question, 538 of SciFact's 809 claims share a gold
    abstract with another claim, and validation reported +0.14 MRR@10 where unseen abstracts lost
    0.01 nDCG@10; docs/design-decisions.md, "`improve` with a few hundred questions"). Fewer than two documents: by question."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    order = list(examples)
    random.Random(seed).shuffle(order)
    n_val = round(len(order) * val_fraction)
    docs = [index.chunks[ex.positive].doc_id for ex in order] if index is not None else []
    distinct = list(dict.fromkeys(docs))
    if len(distinct) < 2:
        return order[n_val:], order[:n_val]
    sizes = Counter(docs)
    held: set[str] = set()
    taken = 0
    for doc in distinct:  # in shuffled order
        if taken >= n_val or len(held) == len(distinct) - 1:
            break
        held.add(doc)
        taken += sizes[doc]
    train = [ex for ex, doc in zip(order, docs, strict=True) if doc not in held]
    val = [ex for ex, doc in zip(order, docs, strict=True) if doc in held]
    return train, val


def batches_without_shared_gold(
    examples: Sequence[Example], batch_size: int, seed: int
) -> Iterator[list[Example]]:
    """Shuffled batches in which no two questions share a gold chunk.

    In-batch negatives treat every other question's positive as a negative; two questions with
    the same gold chunk in one batch would teach the model to push away a right answer. An
    example that would clash waits for a later batch.
    """
    pending = list(examples)
    random.Random(seed).shuffle(pending)
    while pending:
        batch: list[Example] = []
        taken: set[int] = set()
        rest: list[Example] = []
        for ex in pending:
            if len(batch) < batch_size and not (ex.gold & taken):
                batch.append(ex)
                taken |= ex.gold
            else:
                rest.append(ex)
        yield batch
        pending = rest
