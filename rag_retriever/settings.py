"""Configuration: `RAG_*` environment variables, overridable by CLI flags, validated at start-up.

Example:
    >>> s = Settings.from_env({"RAG_DENSE_TOP_N": "50"})
    >>> s.dense_top_n
    50

Every field has a documented default; an invalid value raises ConfigError naming the variable
and what it accepts. This module does not read files or load models.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from rag_retriever.errors import ConfigError
from rag_retriever.records import check_alias

DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DTYPES = ("auto", "fp32", "bf16", "fp16")
POOLINGS = ("mean", "cls")
# How `rerank` mode orders the reranked candidates (see rag_retriever/retriever.py).
RerankFusion = Literal["none", "rrf"]
RERANK_FUSIONS: tuple[RerankFusion, ...] = get_args(RerankFusion)


@dataclass(frozen=True)
class Settings:
    # Where embedded Qdrant (Qdrant Edge shards, aliases) and the ingest locks live.
    data_dir: Path = Path("rag-data")
    # A Qdrant server (`http://host:6333`); None = Qdrant Edge, embedded, under data_dir.
    qdrant_url: str | None = None
    qdrant_api_key: str | None = None
    # New collections on a server or cluster: shards, copies of each shard, and how many copies
    # must acknowledge a write. None = the server's default (1 each).
    qdrant_shards: int | None = None
    qdrant_replicas: int | None = None
    qdrant_write_consistency: int | None = None
    # The alias queries go through when none is given.
    collection: str = "docs"

    # Embedding model: a name from the profile table, a hub id or a local directory.
    embed_model: str = "all-MiniLM-L6-v2"
    # Overrides of the model profile; None = take the profile's value.
    query_prefix: str | None = None
    passage_prefix: str | None = None
    pooling: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # 32 measured fastest on a 2-core CPU with bf16 (64 was ~25% slower: more padding per batch).
    embed_batch_size: int = 32

    # Chunk bodies are packed up to this many tokens of the embedder's tokenizer. 200 leaves room
    # for a title and the model's special tokens inside all-MiniLM-L6-v2's 256-token window, and
    # holds one SQuAD paragraph (median ~150 tokens) whole.
    chunk_tokens: int = 200
    # Consecutive chunks share up to this many tokens: one or two sentences.
    chunk_overlap_tokens: int = 48

    # Query path depths.
    dense_top_n: int = 100
    bm25_top_n: int = 100
    # Reciprocal rank fusion constant (Cormack, Clarke & Buettcher, SIGIR 2009).
    rrf_k: int = 60
    # Weights of the dense and the BM25 list in the hybrid fusion (RAG_RRF_WEIGHTS="1,1").
    rrf_weights: tuple[float, float] = (1.0, 1.0)
    rerank_model: str | None = None
    rerank_candidates: int = 50
    # "rrf": the final order of the candidates is the RRF (k = rrf_k) of the cross-encoder's order
    # and their hybrid order; "none": the cross-encoder's order alone. rrf measured better with a
    # reranker from `train-reranker` (SQuAD dev, 5,708 questions, 20 candidates: recall@1 hybrid
    # 0.720, none 0.776, rrf 0.791) and bounds the damage of a weak one.
    rerank_fusion: RerankFusion = "rrf"
    rerank_batch_size: int = 32
    rerank_max_length: int = 256
    default_k: int = 10
    max_k: int = 100
    max_query_chars: int = 2000

    # Ingest refuses a document longer than this many characters (a few thousand pages): such a
    # file is usually a dump to split, and one document is held in memory while it is chunked.
    max_document_chars: int = 10_000_000
    # Versions of a collection kept after a promotion (the live one included).
    keep_versions: int = 2
    # A version that stopped serving is deleted by retention only this many seconds later, so a
    # process that resolved the alias just before the swap finishes its queries on it.
    retention_grace_s: int = 60

    # HTTP service.
    api_key: str | None = None
    max_batch_size: int = 64
    max_body_bytes: int = 1_000_000

    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not isinstance(self.data_dir, Path):  # a str from Python callers
            object.__setattr__(self, "data_dir", Path(self.data_dir))

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{_env_name(name)} must be a positive integer, got {value!r}")

        for name in (
            "embed_batch_size",
            "chunk_tokens",
            "dense_top_n",
            "bm25_top_n",
            "rrf_k",
            "rerank_candidates",
            "rerank_batch_size",
            "rerank_max_length",
            "default_k",
            "max_k",
            "max_query_chars",
            "keep_versions",
            "max_document_chars",
            "max_batch_size",
            "max_body_bytes",
        ):
            positive(name)
        for name in ("qdrant_shards", "qdrant_replicas", "qdrant_write_consistency"):
            if getattr(self, name) is not None:
                positive(name)
        if not isinstance(self.retention_grace_s, int) or self.retention_grace_s < 0:
            raise ConfigError(
                f"RAG_RETENTION_GRACE_S must be a non-negative integer, "
                f"got {self.retention_grace_s!r}"
            )
        if self.chunk_overlap_tokens < 0 or self.chunk_overlap_tokens >= self.chunk_tokens:
            raise ConfigError(
                f"RAG_CHUNK_OVERLAP_TOKENS must be in [0, RAG_CHUNK_TOKENS={self.chunk_tokens}), "
                f"got {self.chunk_overlap_tokens}"
            )
        if self.default_k > self.max_k:
            raise ConfigError(
                f"RAG_DEFAULT_K ({self.default_k}) must not exceed RAG_MAX_K ({self.max_k})"
            )
        _choice("device", self.device, DEVICES)
        _choice("log_level", self.log_level.upper(), LOG_LEVELS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("rerank_fusion", self.rerank_fusion, RERANK_FUSIONS)
        if (
            len(self.rrf_weights) != 2
            or not all(w >= 0 for w in self.rrf_weights)
            or not any(self.rrf_weights)
        ):
            raise ConfigError(
                f"RAG_RRF_WEIGHTS must be two non-negative numbers, not both 0 (dense,bm25), "
                f"got {self.rrf_weights!r}"
            )
        if self.pooling is not None:
            _choice("pooling", self.pooling, POOLINGS)
        try:
            check_alias(self.collection)
        except ValueError as exc:
            raise ConfigError(f"RAG_COLLECTION: {exc}") from None
        if self.qdrant_url is not None and not self.qdrant_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"RAG_QDRANT_URL must start with http:// or https://, got {self.qdrant_url!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read `RAG_<FIELD>` variables, then apply keyword overrides (CLI flags), then validate.

        Overrides that are None are ignored, so CLI flags that were not given do not reset
        environment values.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(_env_name(f.name))
            # An empty prefix is a real value ("no prefix"); elsewhere empty means unset.
            if raw is None or (raw == "" and f.name not in ("query_prefix", "passage_prefix")):
                continue
            values[f.name] = _parse(f.name, raw, _CONVERTERS[f.name])
        for key, value in overrides.items():
            if key not in _CONVERTERS:
                raise ConfigError(f"unknown setting {key!r}")
            if value is not None:
                values[key] = value
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @property
    def edge_dir(self) -> Path:
        """Qdrant Edge shards and aliases of the embedded store."""
        return self.data_dir / "edge"


def _env_name(field_name: str) -> str:
    return f"RAG_{field_name.upper()}"


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{_env_name(name)} must be one of {', '.join(allowed)}; got {value!r}")


def _parse(name: str, raw: str, convert: Callable[[str], Any]) -> Any:
    try:
        return convert(raw)
    except ValueError as exc:
        raise ConfigError(f"{_env_name(name)}={raw!r} is invalid: {exc}") from None


def _optional_str(raw: str) -> str | None:
    return raw


def _int(raw: str) -> int:
    return int(raw.strip())


def _weights(raw: str) -> tuple[float, ...]:
    return tuple(float(part) for part in raw.split(","))


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "data_dir": Path,
    "qdrant_url": _optional_str,
    "qdrant_api_key": _optional_str,
    "qdrant_shards": _int,
    "qdrant_replicas": _int,
    "qdrant_write_consistency": _int,
    "collection": str,
    "embed_model": str,
    "query_prefix": str,
    "passage_prefix": str,
    "pooling": str,
    "device": str,
    "dtype": str,
    "embed_batch_size": _int,
    "chunk_tokens": _int,
    "chunk_overlap_tokens": _int,
    "dense_top_n": _int,
    "bm25_top_n": _int,
    "rrf_k": _int,
    "rrf_weights": _weights,
    "rerank_model": _optional_str,
    "rerank_candidates": _int,
    "rerank_fusion": str,
    "rerank_batch_size": _int,
    "rerank_max_length": _int,
    "default_k": _int,
    "max_k": _int,
    "max_query_chars": _int,
    "keep_versions": _int,
    "max_document_chars": _int,
    "retention_grace_s": _int,
    "api_key": _optional_str,
    "max_batch_size": _int,
    "max_body_bytes": _int,
    "log_level": str,
}
