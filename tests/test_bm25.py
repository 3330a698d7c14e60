"""BM25: exact rank-bm25 scores (hand-computed and on a real corpus), top-k, masks, persistence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from rag_retriever.bm25 import BM25Index, Tokenizer
from tests.conftest import shared_data

CORPUS = [["red", "apple"], ["green", "apple", "apple"], ["red", "wine", "red"], ["blue"]]


def test_hand_computed_scores() -> None:
    index = BM25Index.build(CORPUS)
    n, avgdl, k1, b = 4, 9 / 4, 1.5, 0.75
    idf_red = math.log(n - 2 + 0.5) - math.log(2 + 0.5)  # = 0: red is in half the documents
    idf_wine = math.log(n - 1 + 0.5) - math.log(1 + 0.5)
    tf, dl = 1, 3
    wine = idf_wine * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)))
    scores = index.scores(["wine", "red"])
    assert idf_red == 0.0
    assert scores[2] == pytest.approx(wine)
    assert scores[0] == 0.0 and scores[3] == 0.0


def test_equals_rank_bm25_including_negative_idf_floor_and_repeats() -> None:
    index = BM25Index.build(CORPUS)
    ref = BM25Okapi(CORPUS)
    for query in (["apple"], ["red", "red", "apple"], ["unknown"], ["blue", "green", "wine"]):
        np.testing.assert_array_equal(index.scores(query), ref.get_scores(query))


def test_top_k_orders_by_score_then_index_and_skips_non_matching() -> None:
    corpus = [["a"], ["b"], ["a"], ["a", "b"], ["c"]]
    index = BM25Index.build(corpus)
    top = index.top_k(["a"], 10)
    assert list(top.indices) == [0, 2, 3]  # equal scores: by index; doc 3 is longer
    assert list(index.top_k(["a"], 2).indices) == [0, 2]
    mask = np.array([False, True, True, True, True])
    assert list(index.top_k(["a"], 10, mask).indices) == [2, 3]
    assert len(index.top_k(["zzz"], 5).indices) == 0
    with pytest.raises(ValueError):
        index.top_k(["a"], 0)


def test_matched_terms() -> None:
    index = BM25Index.build(CORPUS)
    assert index.matched_terms(["wine", "apple", "red"], 2) == ["wine", "red"]


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    index = BM25Index.build(CORPUS)
    index.save(tmp_path)
    loaded = BM25Index.load(tmp_path)
    np.testing.assert_array_equal(loaded.scores(["red", "apple"]), index.scores(["red", "apple"]))
    assert loaded.vocab == index.vocab


def test_tokenizer_stems_lowercases_and_drops_stopwords() -> None:
    tok = Tokenizer()
    assert tok.tokenize("The Running dogs of NORMANDY") == ["run", "dog", "normandi"]
    assert tok.analyze("Running") == [("running", "run")]
    assert tok.tokenize("the of and") == []
    assert tok.tokenize("Ｆｕｌｌ width") == ["full", "width"]  # NFKC


def test_empty_corpus_is_refused() -> None:
    with pytest.raises(ValueError):
        BM25Index.build([])


@pytest.mark.data
def test_identical_top_100_ids_and_scores_on_a_real_corpus() -> None:
    """SciFact abstracts (5,183 documents), 100 real claims: ids and scores bit-identical."""
    tok = Tokenizer()
    with shared_data("scifact", "docs.jsonl").open(encoding="utf-8") as fh:
        docs = [json.loads(line) for line in fh]
    corpus = tok.tokenize_many([d["title"] + "\n\n" + d["text"] for d in docs])
    index = BM25Index.build(corpus)
    ref = BM25Okapi(corpus)
    with shared_data("scifact", "questions_train.jsonl").open(encoding="utf-8") as fh:
        claims = [json.loads(line)["question"] for line in fh][:100]
    for claim in claims:
        query = tok.tokenize(claim)
        expected = ref.get_scores(query)
        terms = set(query)
        contains = [i for i, doc in enumerate(corpus) if terms & set(doc)]
        order = sorted(contains, key=lambda i: (-expected[i], i))[:100]
        top = index.top_k(query, 100)
        assert list(top.indices) == order
        np.testing.assert_array_equal(top.scores, expected[order])
