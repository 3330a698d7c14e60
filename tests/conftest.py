"""Shared fixtures: a tiny BERT encoder and cross-encoder built here, real Qdrant in memory.

The tiny models are randomly initialised (no download): they exercise the real loading, pooling,
batching and scoring code paths in milliseconds. Tests that need meaningful embeddings use the
real all-MiniLM-L6-v2 and are marked `model`.
"""

from __future__ import annotations

import json
import os
import signal
import string
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from qdrant_client import QdrantClient
from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizer

from rag_retriever import tracing
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.models.profiles import ModelProfile, write_profile_file
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.store import EdgeStore, ServerStore, Store

# Property tests check correctness, not speed: no per-example deadline, which a busy CI machine
# can miss on a slow first example.
settings.register_profile("rag-retriever", deadline=None)
settings.load_profile("rag-retriever")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# The tests that press Ctrl-C on a command (SIGINT to its process group) need the command to take
# SIGINT as one started from a terminal does. A suite started as a background job (`make test &`
# in a script, nohup, some CI runners) inherits SIGINT ignored, and an ignored signal stays
# ignored across exec, so those commands would ignore Ctrl-C and the tests fail or hang: the
# default handler is restored here (a Python handler is reset to the default on exec, so every
# child starts with Python's own KeyboardInterrupt).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "be",
    "are",
    "or",
    "an",
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "apple",
    "apples",
    "pear",
    "pears",
    "red",
    "green",
    "blue",
    "wine",
    "river",
    "mountain",
    "city",
    "king",
    "queen",
    "war",
    "peace",
    "qdrant",
    "vector",
    "search",
    "chunk",
    "chunks",
    "index",
    "bm25",
    "rerank",
    "model",
    "query",
    "passage",
    "document",
    "normandy",
    "normans",
    "rollo",
    "france",
    "paris",
    "london",
    "science",
    "cell",
    "protein",
    "gene",
    "cancer",
]


def _vocab() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    pieces = [f"##{c}" for c in string.ascii_lowercase + string.digits]
    return specials + sorted(set(WORDS)) + chars + pieces


def build_tiny_bert(
    directory: Path,
    *,
    classifier: bool = False,
    seed: int = 0,
    num_labels: int = 1,
    hidden: int = 32,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(_vocab())}, do_lower_case=True)
    config = BertConfig(
        vocab_size=len(_vocab()),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2 if hidden == 32 else 4,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
    )
    config.num_labels = num_labels
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config) if classifier else BertModel(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = build_tiny_bert(tmp_path_factory.mktemp("tiny-encoder"))
    write_profile_file(directory, ModelProfile("tiny-bert", "", "", "mean", 64))
    return directory


@pytest.fixture(scope="session", autouse=True)
def _own_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This session's own temp dir, for it and its subprocesses: what a store without a data dir
    keeps in the machine's temp dir (a Qdrant server store's ingest locks) is then not shared
    with another test session running on the same machine (two sessions at once each ingested
    'kb' into their own in-memory server and refused the other's lock)."""
    path = str(tmp_path_factory.mktemp("tmp"))
    saved_dir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = path, path
    yield
    tempfile.tempdir = saved_dir
    if saved_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved_env


@pytest.fixture(autouse=True)
def _compaction_inside_the_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that follow a version's shards expect each write to compact inside itself (and no
    detached `rag-retriever compact` outliving a CLI test); tests of background compaction set
    RAG_COMPACTION or `compaction=` themselves."""
    monkeypatch.setenv("RAG_COMPACTION", "inline")


@pytest.fixture
def env(tmp_path: Path, tiny_encoder_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The environment of a CLI test: data under tmp_path, the tiny encoder, the CPU; returns
    RAG_DATA_DIR."""
    monkeypatch.setenv("RAG_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RAG_EMBED_MODEL", str(tiny_encoder_dir))
    monkeypatch.setenv("RAG_DEVICE", "cpu")
    return tmp_path / "data"


@pytest.fixture(scope="session")
def tiny_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-reranker"), classifier=True, seed=1)


@pytest.fixture(scope="session")
def tiny_encoder(tiny_encoder_dir: Path) -> Encoder:
    return Encoder.load(str(tiny_encoder_dir), device="cpu", dtype="fp32", batch_size=4)


@pytest.fixture(scope="session")
def minilm() -> Encoder:
    """The real default model (tests using it are marked `model`)."""
    return Encoder.load("all-MiniLM-L6-v2", device="cpu")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The embedded default: Qdrant Edge shards under tmp_path."""
    edge = EdgeStore(tmp_path / "edge")
    yield edge
    edge.close()


@pytest.fixture
def server_store() -> Iterator[Store]:
    """The server code path, on qdrant-client's in-process implementation of the server API."""
    server = ServerStore(QdrantClient(":memory:"))
    yield server
    server.close()


def collection_retriever(
    docs: Sequence[Document],
    store: Store,
    encoder: Encoder,
    *,
    alias: str = "kb",
) -> Retriever:
    """`docs` ingested as `alias` (a real versioned collection), and a retriever serving it."""
    ingest_documents(
        LoadedCorpus(tuple(docs), 0, "test"),
        alias=alias,
        encoder=encoder,
        store=store,
    )
    return Retriever(encoder=encoder, store=store, collection=alias)


def shared_data(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is not present on this machine")
    return path


def graph_configs(root: Path) -> list[Any]:
    """Each Qdrant Edge shard's HNSW config under `root`, as given to the engine (None: the
    engine's own default)."""
    return [
        json.loads(p.read_text())["vectors"]["dense"].get("hnsw_config")
        for p in sorted(root.rglob("edge_config.json"))
    ]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class GradientsOnly:
    """An optimizer step (training.common.OptimizerStep.run) that only accumulates the gradients,
    so that tests can compare them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, loss: torch.Tensor) -> None:
        self.run(lambda scale: scale(loss).backward())

    def run(self, backward: Callable[[Callable[[torch.Tensor], torch.Tensor]], None]) -> None:
        self.model.zero_grad()
        backward(lambda loss: loss)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing "on" with a provider of the test's own (the global one can be set only once)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure("on", provider=provider)
    yield exporter
    tracing.shutdown()
    provider.shutdown()


class OutOfMemoryAbove(torch.nn.Module):
    """The tiny model, except that a batch of more than `rows` texts raises the out-of-memory
    error CUDA raises. Only the error is simulated; the forward pass is the real model's."""

    def __init__(self, model: torch.nn.Module, rows: int) -> None:
        super().__init__()
        self.inner, self.rows, self.config = model, rows, model.config
        self.calls: list[int] = []
        # whether an exception was being handled at each call: a retry inside the `except`
        # block runs while the traceback holds the failed pass's activations
        self.in_handler: list[bool] = []

    def forward(self, **batch: torch.Tensor) -> Any:
        self.calls.append(len(batch["input_ids"]))
        self.in_handler.append(sys.exc_info()[0] is not None)
        if len(batch["input_ids"]) > self.rows:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.inner(**batch)
