"""Concurrent queries share forward passes (rag_retriever/models/batching.py).

Oracles: a fake encoder whose vector names its text (so a row handed to the wrong caller shows),
counting its passes and their sizes; and the tiny encoder, whose vectors encoded together must
equal the ones encoded alone (masked pooling)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rag_retriever.models.batching import QueryBatcher
from rag_retriever.models.encoder import Encoded, Encoder


class SlowEncoder:
    """Encodes text "q<i>" as the row [i, 1]; each pass takes `seconds`."""

    def __init__(self, seconds: float = 0.05, fail_on: str | None = None) -> None:
        self.seconds = seconds
        self.fail_on = fail_on
        self.sizes: list[int] = []
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def __call__(self, texts: list[str]) -> Encoded:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.seconds)
        with self._lock:
            self.running -= 1
            self.sizes.append(len(texts))
        if self.fail_on in texts:
            raise RuntimeError(f"cannot encode {self.fail_on}")
        rows = np.array([[float(t[1:]), 1.0] for t in texts], dtype=np.float32)
        return Encoded(rows, 0, len(texts))


def many(batcher: QueryBatcher, texts: list[list[str]]) -> list[Encoded | BaseException]:
    """Every list of texts encoded by its own thread, all started together."""
    start = threading.Barrier(len(texts))

    def one(group: list[str]) -> Encoded | BaseException:
        start.wait()
        try:
            return batcher.encode(group)
        except RuntimeError as exc:
            return exc

    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(one, texts))


def test_concurrent_callers_share_passes_and_each_gets_its_own_rows() -> None:
    fake = SlowEncoder()
    batcher = QueryBatcher(fake)
    groups = [[f"q{i}"] if i % 3 else [f"q{i}", f"q{i + 1000}"] for i in range(24)]
    results = many(batcher, groups)
    for group, result in zip(groups, results, strict=True):
        assert isinstance(result, Encoded)
        assert result.vectors[:, 0].tolist() == [float(t[1:]) for t in group]
    assert sum(fake.sizes) == sum(len(g) for g in groups)  # every query encoded once
    assert len(fake.sizes) < len(groups) and batcher.passes == len(fake.sizes)
    assert fake.most_at_once == 1  # one pass at a time: no threads fighting over the cores


def test_a_lone_caller_encodes_at_once_and_passes_respect_the_limit() -> None:
    fake = SlowEncoder(seconds=0)
    batcher = QueryBatcher(fake, max_batch=4)
    for i in range(3):
        assert batcher.encode([f"q{i}"]).vectors[0, 0] == i
    assert fake.sizes == [1, 1, 1]
    fake.seconds = 0.05
    many(batcher, [[f"q{i}", f"q{i + 100}"] for i in range(10)])
    assert max(fake.sizes) <= 4
    big = batcher.encode([f"q{i}" for i in range(9)])  # one caller over the limit: one pass
    assert big.vectors.shape == (9, 2) and fake.sizes[-1] == 9


def test_an_encoder_error_reaches_every_caller_of_its_pass_and_the_next_pass_runs() -> None:
    fake = SlowEncoder(fail_on="q5")
    batcher = QueryBatcher(fake)
    results = many(batcher, [[f"q{i}"] for i in range(12)])
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all("cannot encode q5" in str(r) for r in failed)
    assert any(isinstance(r, Encoded) for r in results) or len(fake.sizes) == 1
    assert batcher.encode(["q7"]).vectors[0, 0] == 7  # not stuck busy


def test_vectors_encoded_together_equal_the_ones_encoded_alone(tiny_encoder: Encoder) -> None:
    texts = [f"where is the river {w}?" * (1 + i % 3) for i, w in enumerate("abcdefgh")]
    alone = np.stack([tiny_encoder.encode_queries([t]).vectors[0] for t in texts])
    batcher = QueryBatcher(tiny_encoder.encode_queries)
    together = many(batcher, [[t] for t in texts])
    rows = np.stack([r.vectors[0] for r in together if isinstance(r, Encoded)])
    assert rows.shape == alone.shape
    assert np.min(np.sum(rows * alone, axis=1)) == pytest.approx(1.0, abs=1e-5)
