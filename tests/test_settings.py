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
        ({"RAG_RRF_WEIGHTS": "1"}, "RAG_RRF_WEIGHTS='1' is invalid: must be two finite non-neg"),
        ({"RAG_RRF_WEIGHTS": "1,-1"}, "RAG_RRF_WEIGHTS='1,-1' is invalid: must be two finite"),
        ({"RAG_RRF_WEIGHTS": "inf,1"}, "RAG_RRF_WEIGHTS='inf,1' is invalid: must be two finite"),
        ({"RAG_RRF_WEIGHTS": "1e400,1"}, "must be two finite"),
        ({"RAG_RRF_WEIGHTS": "0,0"}, "not both 0"),
        ({"RAG_RRF_WEIGHTS": "1,x"}, "RAG_RRF_WEIGHTS='1,x' is invalid"),
        ({"RAG_RERANK_FUSION": "max"}, "RAG_RERANK_FUSION must be one of none, rrf"),
        ({"RAG_DEFAULT_K": "50", "RAG_MAX_K": "10"}, "must not exceed RAG_MAX_K"),
        (
            {"RAG_COLLECTION": "a__b"},
            "RAG_COLLECTION='a__b' is invalid: collection name 'a__b' is not allowed",
        ),
        ({"RAG_LOG_LEVEL": "LOUD"}, "RAG_LOG_LEVEL must be one of DEBUG, INFO"),
        ({"RAG_POOLING": "max"}, "RAG_POOLING must be one of mean, cls"),
        (
            {"RAG_CHUNK_TOKENS": "40", "RAG_CHUNK_OVERLAP_TOKENS": "40"},
            "RAG_CHUNK_OVERLAP_TOKENS must be in",
        ),
        ({"RAG_RETENTION_GRACE_S": "-1"}, "RAG_RETENTION_GRACE_S='-1' is invalid"),
        ({"RAG_QDRANT_URL": "localhost:6333"}, "must start with http:// or https://"),
        ({"RAG_WRITE_PROCESS": "maybe"}, "RAG_WRITE_PROCESS must be one of auto, true, false"),
    ],
)
def test_invalid_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_python_callers_get_the_same_validation() -> None:
    with pytest.raises(ConfigError, match="RAG_MAX_K=0 is invalid"):
        Settings(max_k=0)
    with pytest.raises(ConfigError, match="unknown setting 'rrf'"):
        Settings.from_env({}, rrf=3)
    assert Settings(data_dir="x").data_dir == Path("x")
    assert Settings().replace(rrf_k=5).rrf_k == 5
    with pytest.raises(ConfigError, match="RAG_RRF_K"):
        Settings().replace(rrf_k=-5)


def test_settings_ignore_the_environment_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAG_RRF_K", "7")
    monkeypatch.setenv("RAG_QUERY_PREFIX", "")  # an empty prefix is a value: "no prefix"
    monkeypatch.setenv("RAG_DEVICE", "")  # elsewhere empty means unset
    assert Settings().rrf_k == 60
    s = Settings.from_env()
    assert (s.rrf_k, s.query_prefix, s.device) == (7, "", "auto")
    assert Settings.from_env(rrf_k=9, device=None).rrf_k == 9  # None: a flag not given


def test_the_configuration_doc_lists_the_declared_settings() -> None:
    from rag_retriever.settings import markdown_table

    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert markdown_table() in doc, "regenerate it: python -m rag_retriever.settings"


def test_the_collection_setting_takes_an_alias_or_one_version_s_name() -> None:
    version = "docs__all-minilm-l6-v2-384__v3"
    assert Settings.from_env({"RAG_COLLECTION": version}).collection == version
    for bad in ("docs__v3", "../x__m__v1", "docs__m__v", "a" * 65 + "__m__v1", "x__m/..__v1"):
        with pytest.raises(ConfigError, match="RAG_COLLECTION"):
            Settings.from_env({"RAG_COLLECTION": bad})


def test_a_misspelt_variable_is_warned_about_naming_the_setting_it_may_mean(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RAG_QUERYLOG_TEXT=false was ignored without a word: every query text stayed logged."""
    from rag_retriever import settings as settings_module

    monkeypatch.setattr(settings_module, "_WARNED_UNKNOWN", set())
    environ = {
        "RAG_QUERYLOG_TEXT_X": "false",
        "RAG_ZZZ_UNKNOWN": "1",
        "RAG_log_level": "ERROR",  # a setting in another case: read, not warned about
        "RAG_PORT": "tcp://10.0.0.1:8000",  # Kubernetes' service links
        "RAG_SERVICE_HOST": "10.0.0.1",
        "RAG_PORT_8000_TCP_ADDR": "10.0.0.1",
    }
    with caplog.at_level("WARNING", logger="rag_retriever.settings"):
        settings = Settings.from_env(environ)
    assert settings.query_log_text is True and settings.log_level == "ERROR"
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "RAG_QUERYLOG_TEXT_X is not a setting of rag-retriever and is ignored; did you mean "
        "RAG_QUERY_LOG_TEXT?"
    ) in messages
    assert "RAG_ZZZ_UNKNOWN is not a setting of rag-retriever and is ignored" in messages
    assert len(messages) == 2, messages
