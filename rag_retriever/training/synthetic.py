"""Questions made from the corpus itself, to fit a fusion when there are no labelled ones.

Example:
    >>> made = synthetic_questions(table, 500, seed=0)               # doctest: +SKIP
    >>> lists = synthetic_lists(retriever, table, made)             # doctest: +SKIP

A synthetic question is one sentence taken out of a chunk; its answer is that chunk *without the
sentence*. The sentence is taken out of the corpus, not just asked: every chunk that holds part
of it (chunks overlap) is scored again, dense and BM25, on its text with that part cut, and moved
to where that score ranks it in both first-stage lists (the other chunks keep the engine's
scores; BM25's IDF and average length stay the version's). Without this the question would be
found word for word, and a fusion fitted on it would learn to trust BM25 blindly. Sentences are
drawn from as many documents as possible (one per document, round robin over a seeded shuffle),
so the fit is not that of a few long documents.

Not handled: questions that paraphrase (a sentence is a statement, not a question; the fit learns
how much to trust each list, not how people ask), and sentences that span two chunks without one
holding them whole (skipped).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rag_retriever.models.bm25 import sparse_dot
from rag_retriever.query.chunk_table import ChunkTable
from rag_retriever.query.retriever import Retriever

# A sentence ends at . ! or ? followed by space and a capital, digit or opening quote.
_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+[\"'”’)\]]*)(?=\s+[\"'“‘(\[]?[A-Z0-9]|\s*$)")
# A question long enough to ask something and short enough to leave the chunk most of its text.
MIN_WORDS, MAX_WORDS = 6, 40
BATCH = 64


@dataclass(frozen=True)
class SyntheticQuestion:
    """A sentence of document `doc_id` (text[start:end]), asked as a question; `row` is the
    chunk (ChunkTable row) it was drawn from."""

    id: str
    question: str
    doc_id: str
    start: int
    end: int
    row: int


def synthetic_questions(table: ChunkTable, n: int, *, seed: int = 0) -> list[SyntheticQuestion]:
    """Up to `n` sentences of the chunks of `table` as questions, at most one per document until
    every document gave one (deterministic for a seed)."""
    if n < 1:
        raise ValueError(f"the number of synthetic questions must be at least 1, got {n}")
    rng = random.Random(seed)
    docs = sorted(table.rows_of_doc)
    rng.shuffle(docs)
    pools = {d: rng.sample(table.rows_of_doc[d], len(table.rows_of_doc[d])) for d in docs}
    made: list[SyntheticQuestion] = []
    while len(made) < n and any(pools.values()):
        for doc in docs:
            if len(made) >= n:
                break
            while pools[doc]:
                question = _sentence_of(table, pools[doc].pop(), rng, len(made))
                if question is not None:
                    made.append(question)
                    break
    return made


def _sentence_of(
    table: ChunkTable, row: int, rng: random.Random, number: int
) -> SyntheticQuestion | None:
    """A random sentence of the chunk at `row` that leaves it other text; None if none fits."""
    chunk = table.chunks[row]
    body = table.embed_texts([row])[0][-(chunk.end - chunk.start) :]  # the chunk's own text
    sentences = [
        m
        for m in _SENTENCE.finditer(body)
        if MIN_WORDS <= len(m.group().split()) <= MAX_WORDS
        and len(m.group().strip()) < 0.8 * len(body.strip())
    ]
    if not sentences:
        return None
    m = rng.choice(sentences)
    lead = len(m.group()) - len(m.group().lstrip())
    start, end = chunk.start + m.start() + lead, chunk.start + m.end()
    return SyntheticQuestion(
        f"synthetic-{number}", m.group().strip(), chunk.doc_id, start, end, row
    )


def synthetic_lists(
    retriever: Retriever, table: ChunkTable, questions: Sequence[SyntheticQuestion]
) -> list[tuple[list[tuple[int, float]], list[tuple[int, float]], list[set[int]]]]:
    """For each question, its (dense, BM25) lists of (row, score) as the version would return
    them with the question's sentence taken out of the corpus, and its gold items (the chunks
    that held the whole sentence, one item)."""
    name = table.collection
    opened = retriever.open_collection(name, "hybrid")
    out = []
    for begin in range(0, len(questions), BATCH):
        batch = questions[begin : begin + BATCH]
        texts = [q.question for q in batch]
        _, traces = retriever.trace(texts, mode="hybrid", collection=name)
        query_vectors = retriever.encoder.encode_queries(texts).vectors
        cuts = [_cut_texts(table, q) for q in batch]
        # one encoder call per batch: a call per question costs its fixed overhead each time
        passages = retriever.encoder.encode_passages([t for cut in cuts for t in cut.values()])
        at = 0
        for q, trace, qv, cut in zip(batch, traces, query_vectors, cuts, strict=True):
            vectors = passages.vectors[at : at + len(cut)]
            at += len(cut)
            query_terms = opened.bm25.query_vector(retriever.tokenizer.tokenize(q.question))
            dense_new = {r: float(np.dot(qv, v)) for r, v in zip(cut, vectors, strict=True)}
            bm25_new = {
                r: sparse_dot(
                    query_terms, opened.bm25.document_vector(retriever.tokenizer.tokenize(text))
                )
                for r, text in cut.items()
            }
            bm25_new = {r: s for r, s in bm25_new.items() if s > 0}  # no shared term: no match
            dense = [(table.row_of[c], s.score) for c, s in trace.dense or []]
            bm25 = [(table.row_of[c], s.score) for c, s in trace.bm25 or []]
            gold = {
                r for r in cut if table.chunks[r].start <= q.start and q.end <= table.chunks[r].end
            }
            rows = set(cut)
            out.append((_rescored(dense, dense_new, rows), _rescored(bm25, bm25_new, rows), [gold]))
    return out


def _cut_texts(table: ChunkTable, q: SyntheticQuestion) -> dict[int, str]:
    """The embedded text of every chunk of the question's document that overlaps its sentence,
    with the overlapping part cut out."""
    rows = [
        r
        for r in table.rows_of_doc[q.doc_id]
        if table.chunks[r].start < q.end and q.start < table.chunks[r].end
    ]
    out: dict[int, str] = {}
    for r, text in zip(rows, table.embed_texts(rows), strict=True):
        c = table.chunks[r]
        body_at = len(text) - (c.end - c.start)  # the title prefix comes first
        a, b = max(q.start, c.start) - c.start + body_at, min(q.end, c.end) - c.start + body_at
        out[r] = (text[:a].rstrip() + " " + text[b:].lstrip()).strip()
    return out


def _rescored(
    ranked: list[tuple[int, float]], new: dict[int, float], cut: set[int]
) -> list[tuple[int, float]]:
    """`ranked` with the `cut` rows moved to their `new` scores (or out, when absent), as long as
    it was (a list that was not full held every match, so a cut chunk cannot add one)."""
    merged = [(r, s) for r, s in ranked if r not in cut] + list(new.items())
    return sorted(merged, key=lambda rs: -rs[1])[: len(ranked)]
