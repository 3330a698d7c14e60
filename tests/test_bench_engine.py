"""The engine benchmark's own parts that its figures rest on: the synthetic chunks (the same
length at every corpus size) and the brute-force search its recall is measured against.
Oracles: the windows written out by hand, and a full cosine ranking of the vectors held."""

from __future__ import annotations

import numpy as np

from bench.bench_bm25 import iter_synthetic_chunks
from bench.bench_engine import BATCH, _unit_vectors, exact_top

SENTENCES = [f"s{i}" for i in range(10)]


def test_synthetic_chunks_stay_two_to_four_sentences_and_distinct_past_the_windows() -> None:
    chunks = list(iter_synthetic_chunks(200, SENTENCES))
    assert len(chunks) == 200
    # first the windows of 2, 3 and 4 consecutive sentences (8, 7 and 6 of them)
    assert chunks[:3] == ["s0 s1", "s1 s2", "s2 s3"]
    assert chunks[8] == "s0 s1 s2" and chunks[15] == "s0 s1 s2 s3"
    # past them, a sentence and the ones after a gap, wrapping round
    assert chunks[21:23] == ["s0 s2", "s1 s3"] and chunks[30] == "s9 s1"
    assert all(2 <= len(c.split()) <= 4 for c in chunks)
    assert len(set(chunks)) == len(chunks)


def test_exact_top_is_a_full_cosine_ranking_of_the_build_vectors() -> None:
    n = 3 * BATCH + 17  # a short last batch, as a build's
    rng = np.random.default_rng(0)
    held = np.concatenate([_unit_vectors(rng, min(BATCH, n - s)) for s in range(0, n, BATCH)])
    queries = _unit_vectors(np.random.default_rng(7), 5)
    want = np.argsort(-(queries @ held.T), axis=1, kind="stable")[:, :100]
    assert (exact_top(queries, n, k=100) == want).all()
