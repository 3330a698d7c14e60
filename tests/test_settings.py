"""RAG_* settings: parsed from the environment, validated at start-up with the variable named."""

from __future__ import annotations

from pathlib import Path

import pytest

from rag_retriever.errors import ConfigError
from rag_retriever.settings import Settings


def test_environment_values_are_parsed() -> None:
    s = Settings.from_env(
        {
            "RAG_DATA_DIR": "/tmp/x",
            "RAG_RRF_K": " 30 ",
            "RAG_RRF_WEIGHTS": "1,0.5",
            "RAG_RERANK_FUSION": "none",
            "RAG_RERANK_MODEL": "models/r",
        }
    )
    assert s.data_dir == Path("/tmp/x")
    assert s.rrf_k == 30 and s.rrf_weights == (1.0, 0.5)
    assert s.rerank_fusion == "none" and s.rerank_model == "models/r"
    assert Settings.from_env({}).rrf_weights == (1.0, 1.0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RAG_RRF_K": "sixty"}, "RAG_RRF_K='sixty' is invalid"),
        ({"RAG_RRF_K": "0"}, "RAG_RRF_K"),
        ({"RAG_RRF_WEIGHTS": "1"}, "RAG_RRF_WEIGHTS must be two non-negative numbers"),
        ({"RAG_RRF_WEIGHTS": "1,-1"}, "RAG_RRF_WEIGHTS must be two non-negative numbers"),
        ({"RAG_RRF_WEIGHTS": "0,0"}, "not both 0"),
        ({"RAG_RRF_WEIGHTS": "1,x"}, "RAG_RRF_WEIGHTS='1,x' is invalid"),
        ({"RAG_RERANK_FUSION": "max"}, "RAG_RERANK_FUSION must be one of none, rrf"),
        ({"RAG_DEFAULT_K": "50", "RAG_MAX_K": "10"}, "must not exceed RAG_MAX_K"),
        ({"RAG_COLLECTION": "a__b"}, "RAG_COLLECTION: collection name 'a__b' is not allowed"),
        ({"RAG_QDRANT_URL": "localhost:6333"}, "must start with http:// or https://"),
    ],
)
def test_invalid_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)
