"""Reranker training: negatives never gold, a tiny cross-encoder learns, the output loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eval.questions import load_questions
from ingest.loaders import LoadedCorpus
from ingest.writer import ingest_documents
from rag_retriever.encoder import Encoder
from rag_retriever.errors import ConfigError
from rag_retriever.records import Document
from rag_retriever.reranker import CrossEncoderReranker
from rag_retriever.retriever import Retriever
from rag_retriever.store import QdrantStore
from rag_retriever.training.mining import mine_examples
from rag_retriever.training.reranker import RerankerTrainingConfig, train_reranker
from tests.conftest import build_tiny_bert, write_jsonl

WORDS = [
    "apples",
    "pears",
    "wine",
    "river",
    "mountain",
    "paris",
    "king",
    "queen",
    "war",
    "peace",
    "london",
    "gene",
]
DOCS = tuple(
    Document(f"d{i}", f"Note {i}", f"The {w} of the city. Science and the city with {w} and cell.")
    for i, w in enumerate(WORDS)
)


@pytest.fixture
def retriever(store: QdrantStore, tiny_encoder: Encoder, tmp_path: Path) -> Retriever:
    ingest_documents(
        LoadedCorpus(DOCS, 0, "t"),
        alias="kb",
        encoder=tiny_encoder,
        store=store,
        index_root=tmp_path / "idx",
    )
    return Retriever(
        encoder=tiny_encoder, store=store, index_root=tmp_path / "idx", collection="kb"
    )


def questions(tmp_path: Path, retriever: Retriever, copies: int = 3) -> Path:
    rows: list[dict[str, object]] = []
    for c in range(copies):
        for i, w in enumerate(WORDS):
            rows.append(
                {"id": f"q{i}-{c}", "question": f"{w} science city", "gold_doc_ids": [f"d{i}"]}
            )
    # A question whose gold document is the one hybrid search ranks last: never a candidate.
    last = retriever.search("zzz", k=100, mode="hybrid")[-1].doc_id
    rows.append({"id": "lost", "question": "zzz", "gold_doc_ids": [last]})
    return write_jsonl(tmp_path / "train.jsonl", rows)


def test_negatives_come_from_the_hybrid_list_and_are_never_gold(
    retriever: Retriever, tmp_path: Path
) -> None:
    qs, _ = load_questions(questions(tmp_path, retriever, copies=1))
    mined = mine_examples(retriever, qs, collection="kb", negatives=5, depth=10)
    for ex in mined.examples:
        assert not set(ex.negatives) & ex.gold
        assert set(ex.negatives) <= set(ex.ranked)
    lost = next(ex for ex in mined.examples if ex.question_id == "lost")
    assert not lost.positive_retrieved


def test_tiny_cross_encoder_learns_to_put_the_positive_first(
    retriever: Retriever, tmp_path: Path
) -> None:
    # 64 hidden units: the 32-unit test model learns token matching too slowly for a unit test.
    base = build_tiny_bert(tmp_path / "base", classifier=True, seed=1, hidden=64)
    out = tmp_path / "reranker"
    config = RerankerTrainingConfig(
        negatives=5,
        batch_size=4,
        epochs=10,
        learning_rate=1e-3,
        max_length=48,
        val_fraction=0.0,
        depth=8,
        seed=0,
    )
    qs, _ = load_questions(questions(tmp_path, retriever, copies=1))
    groups = mine_examples(retriever, qs, collection="kb", negatives=5, depth=8)

    def firsts(reranker: CrossEncoderReranker) -> int:
        """Questions whose positive the reranker puts first among its mined group."""
        count = 0
        for ex in groups.examples:
            if not ex.positive_retrieved:
                continue
            rows = [ex.positive, *ex.negatives]
            scores = reranker.score(
                ex.query, [groups.index.chunks[r].embed_text for r in rows]
            ).scores
            count += int(np.argmax(scores) == 0)
        return count

    before = firsts(CrossEncoderReranker.load(base, device="cpu", dtype="fp32", max_length=48))
    meta = train_reranker(
        retriever,
        questions(tmp_path, retriever),
        out,
        collection="kb",
        base=str(base),
        config=config,
        device="cpu",
        dtype="fp32",
        progress=False,
    )
    assert meta["examples"]["skipped"]["gold_not_among_candidates"] == 1  # "lost" was skipped
    assert meta["loss_last_20"] < 0.8 * meta["loss_first_20"]
    loaded = CrossEncoderReranker.load(out, device="cpu", dtype="fp32", max_length=48)
    assert loaded.name == "reranker-kb__tiny-bert-32__v1"
    after = firsts(loaded)
    assert after >= before + 3, (before, after)
    metadata = json.loads((out / "rag_training.json").read_text())
    assert metadata["collection_fingerprint"]["model"] == "tiny-bert"
    assert metadata["questions_sha256"]


def test_too_few_usable_questions(
    retriever: Retriever, tiny_reranker_dir: Path, tmp_path: Path
) -> None:
    path = write_jsonl(
        tmp_path / "few.jsonl", [{"id": "a", "question": "apples", "gold_doc_ids": ["d0"]}]
    )
    with pytest.raises(ConfigError, match="usable training questions"):
        train_reranker(
            retriever,
            path,
            tmp_path / "o",
            collection="kb",
            base=str(tiny_reranker_dir),
            config=RerankerTrainingConfig(negatives=3),
            progress=False,
        )
