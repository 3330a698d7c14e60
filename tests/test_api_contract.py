"""Schemathesis fuzzes the HTTP service from its own OpenAPI schema: no 5xx, and every status,
content type and body is one the schema documents. A real app on a real collection (tiny
encoder, qdrant-client's in-process server implementation); a few hundred cases in all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from bench.bench_fuzz import CHECKED_BEYOND_SCHEMA
from rag_retriever.models.encoder import Encoder
from rag_retriever.service.server import create_app
from rag_retriever.settings import Settings
from tests.test_server import build_retriever


@pytest.fixture(scope="module")
def api_schema(tiny_encoder: Encoder, tmp_path_factory: pytest.TempPathFactory) -> Any:
    retriever, _ = build_retriever(tiny_encoder, tmp_path_factory.mktemp("api"))
    app = create_app(
        retriever, Settings(max_k=8, default_k=5, max_query_chars=300, max_batch_size=3)
    )
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_the_api_keeps_the_word_of_its_schema(api_schema: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 5
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=60,
            deadline=None,
            derandomize=True,  # the same few hundred cases on every run: CI cannot flake
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            # schema-valid bodies that the server still refuses: bench_fuzz says which and why
            excluded = [positive_data_acceptance] if case.path in CHECKED_BEYOND_SCHEMA else []
            case.call_and_validate(excluded_checks=excluded)

        check()


def test_every_route_with_and_without_the_write_key_keeps_the_word_of_its_schema(
    tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """The whole schema (search, writes, changes, feedback, collections) on Qdrant Edge, fuzzed
    as bench/bench_fuzz.py does at a large count: the write key sent, missing, and a server
    without write routes; positive and negative bodies. No 5xx, no broken check."""
    from bench.bench_fuzz import TENANT_KEY, WRITE_KEY, Tally, build_app, fuzz, scoped_keys

    tally = Tally()
    keyed = build_app(tiny_encoder, tmp_path / "keyed", write_key=WRITE_KEY)
    sent = {"Authorization": f"Bearer {WRITE_KEY}"}
    tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
    fuzz(keyed, tally, setup="key sent", examples=12, headers=sent)
    fuzz(keyed, tally, setup="key missing", examples=12, only_writes=True)
    fuzz(
        build_app(tiny_encoder, tmp_path / "plain", write_key=None),
        tally,
        setup="plain",
        examples=8,
    )
    scoped = build_app(
        tiny_encoder, tmp_path / "scoped", write_key=None, keys_file=scoped_keys(tmp_path)
    )
    fuzz(scoped, tally, setup="tenant key", examples=8, headers=tenant)
    assert tally.failures == [] and tally.failed == 0
    assert sum(tally.server_errors.values()) == 0
    groups = {group for _, group in tally.requests}
    assert {"search", "writes", "changes", "feedback", "collections"} <= groups
    # the fuzz reached the writer: some writes were committed, some refused
    assert tally.statuses["key sent", "writes", 200] > 0
    assert tally.statuses["key sent", "writes", 422] > 0
    assert tally.statuses["key missing", "writes", 401] > 0
