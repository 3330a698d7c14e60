"""Maximal marginal relevance (Carbonell & Goldstein, SIGIR 1998) over a ranked list, as a pure
function: which candidates to show so the top k are relevant and not near-copies of each other.

Example:
    >>> import numpy as np
    >>> vectors = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])   # the first two are twins
    >>> [i for i, _ in mmr(np.array([1.0, 0.9, 0.5]), vectors, diversity=0.5, k=2)]
    [0, 2]
    >>> [i for i, _ in mmr(np.array([1.0, 0.9, 0.5]), vectors, diversity=0.0, k=2)]
    [0, 1]

Each step picks the candidate with the highest
    (1 - diversity) * relevance - diversity * max(similarity to those already picked),
relevance being the candidates' own scores mapped to [0, 1] (min-max over the candidates), so a
`diversity` means the same with RRF, BM25, cosine or cross-encoder scores; similarity is the
cosine of the chunks' dense vectors. `diversity=0` keeps the given order; 1 ignores relevance
after the first pick. Equal MMR scores keep the given order.

It runs after fusion and reranking, over the candidates they ranked, which is why Qdrant's own
MMR (a dense query option, applied inside one engine search) does not fit: it would diversify
the dense list before fusion and never see the BM25 or cross-encoder order.
Not handled: similarity measures other than cosine.
"""

from __future__ import annotations

import numpy as np


def check_diversity(diversity: object) -> float:
    """`diversity` as a float in [0, 1], else ValueError saying what is accepted."""
    if (
        isinstance(diversity, bool)
        or not isinstance(diversity, int | float)
        or not 0.0 <= diversity <= 1.0
    ):
        raise ValueError(
            f"diversity must be a number from 0 (the ranked order) to 1 (most diverse), "
            f"got {diversity!r}"
        )
    return float(diversity)


def mmr(
    scores: np.ndarray, vectors: np.ndarray, *, diversity: float, k: int
) -> list[tuple[int, float]]:
    """The first min(k, n) picks as (candidate index, MMR score), in pick order.

    `scores`: the candidates' relevance, higher is better, shape (n,); `vectors`: their
    embeddings, shape (n, d), any length (normalised here)."""
    diversity = check_diversity(diversity)
    n = len(scores)
    if vectors.shape[0] != n:
        raise ValueError(f"got {n} scores and {vectors.shape[0]} vectors")
    if n == 0 or k < 1:
        return []
    low = scores.min()
    span = float(scores.max() - low)
    relevance = (scores - low) / span if span > 0 else np.ones(n)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    unit = vectors / norms
    similarity = unit @ unit.T
    weighted = (1.0 - diversity) * relevance
    # The best similarity of each candidate to any pick so far (no penalty before the first),
    # and -inf on the candidates already picked.
    penalty = np.zeros(n)
    picked = np.zeros(n)
    picks: list[tuple[int, float]] = []
    for step in range(min(k, n)):
        value = weighted - diversity * penalty + picked
        best = int(np.argmax(value))  # the first of equal values: the given order
        picks.append((best, float(value[best])))
        picked[best] = -np.inf
        penalty = similarity[best] if step == 0 else np.maximum(penalty, similarity[best])
    return picks
