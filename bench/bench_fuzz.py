"""Schemathesis fuzzes every route of the HTTP service from its own OpenAPI schema, with the write
key sent, with it missing, and on a server without write routes; it counts the requests per
route group and the answers that were server errors (5xx) or broke the schema's word.

The test suite runs the same harness at a few dozen examples per route
(tests/test_api_contract.py); this script runs it at a large count, where a rare input has a
chance to turn up. The service runs as in production: Qdrant Edge on disk, the default model
(its real tokenizer chunks what the fuzzer sends), every accepted write a sealed version, the
query log on (so feedback reaches the log). Each route is fuzzed with schema-valid bodies
(positive) and schema-breaking ones (negative); the write routes half with the alias fixed to
the served one (so valid bodies reach the writer) and half with any alias.

Usage:
    python -m bench.bench_fuzz [--examples 150] [--model all-MiniLM-L6-v2] [--seed 0]

`--examples` is per route, mode and alias choice (hypothesis may run fewer for a route whose
inputs it exhausts). Does not fuzz the transport (malformed HTTP, slow clients: uvicorn's part)
or several clients at once (tests/test_write_api.py covers group commit).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import positive_data_acceptance

from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.service.server import create_app
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore

WRITE_KEY = "fuzz-write-key"
ALIAS = "kb"
DOCS = tuple(
    Document(f"d{i}", f"doc {i}", f"alpha bravo {w} river city king queen {w}", {"n": i})
    for i, w in enumerate(["apple", "pear", "wine", "rollo", "paris", "london"])
)
# Route template -> the group the report counts it in.
GROUPS = {
    "/v1/search": "search",
    "/v1/search/batch": "search",
    "/v1/collections/{alias}/documents": "writes",
    "/v1/collections/{alias}/documents:delete": "writes",
    "/v1/changes/{change_id}": "changes",
    "/v1/feedback": "feedback",
    "/v1/collections": "collections",
}
WRITE_PATHS = frozenset(p for p, g in GROUPS.items() if g in ("writes", "changes"))
# Routes whose schema-valid bodies can still be refused (422), so schemathesis's "valid data is
# accepted" check is off there: JSON Schema cannot say "each id once in the list" or bound the
# depth and size of a free-form value (upserts), nor "a field the served version's documents
# have" or "a threshold within the chosen mode's score range" (search filters, min_score), nor
# what a scoped key may name (a tenant outside it is a 403: search, upsert and delete).
CHECKED_BEYOND_SCHEMA = frozenset(
    {
        "/v1/collections/{alias}/documents",
        "/v1/collections/{alias}/documents:delete",
        "/v1/search",
        "/v1/search/batch",
    }
)
# Distinct failure messages kept for the report (the first line of each).
KEPT_FAILURES = 20


@dataclass
class Tally:
    """Requests, server errors and failed checks, by (setup, route group)."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    server_errors: Counter[tuple[str, str]] = field(default_factory=Counter)
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    failed: int = 0

    def record(self, setup: str, path: str, status: int) -> None:
        group = GROUPS.get(path, "other")
        self.requests[setup, group] += 1
        self.statuses[setup, group, status] += 1
        if status >= 500:
            self.server_errors[setup, group] += 1

    def fail(self, where: str, exc: BaseException) -> None:
        self.failed += 1
        # schemathesis raises a group of its check failures (each with a title), else one error
        parts = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        for part in parts:
            lines = str(part).strip().splitlines()
            title = getattr(part, "title", type(part).__name__)
            text = f"{where}: {title}: {' | '.join(lines[:3])[:300]}"
            if text not in self.failures and len(self.failures) < KEPT_FAILURES:
                self.failures.append(text)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": {f"{s} / {g}": n for (s, g), n in sorted(self.requests.items())},
            "server_errors": {f"{s} / {g}": n for (s, g), n in sorted(self.server_errors.items())},
            "statuses": {f"{s} / {g} / {c}": n for (s, g, c), n in sorted(self.statuses.items())},
            "failed_checks": self.failed,
            "failures": self.failures,
        }


def build_app(
    encoder: Any, root: Path, *, write_key: str | None, keys_file: Path | None = None
) -> FastAPI:
    """The service over a fresh Qdrant Edge data dir holding DOCS as `kb`, the query log on
    (with `keys_file`, its scoped keys too)."""
    store = EdgeStore(root / "edge")
    ingest_documents(
        LoadedCorpus(DOCS, 0, "fuzz"), alias=ALIAS, encoder=encoder, store=store, lock_dir=root
    )
    retriever = Retriever(encoder=encoder, store=store, collection=ALIAS)
    config = Settings(
        data_dir=root,
        write_api_key=write_key,
        keys_file=keys_file,
        write_window_ms=0,
        query_log=root / "log",
        compaction="inline",
        retention_grace_s=0,
        bm25_rebase_drift=1.0,
        max_k=8,
        default_k=5,
        max_query_chars=300,
        max_batch_size=3,
    )
    return create_app(retriever, config)


TENANT_KEY = "fuzz-tenant-key"


def scoped_keys(root: Path) -> Path:
    """A keys file with one key: tenant `acme`, read and write, of every collection."""
    root.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    line = {"name": "acme", "sha256": digest, "tenants": ["acme"], "access": ["read", "write"]}
    path = root / "keys.jsonl"
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    return path


def fuzz(
    app: FastAPI,
    tally: Tally,
    *,
    setup: str,
    examples: int,
    headers: dict[str, str] | None = None,
    only_writes: bool = False,
    rng_seed: int | None = None,
) -> None:
    """Fuzz every operation of `app`'s schema (or only the write routes), positive and negative,
    into `tally`: a failed check is counted and kept, never raised (every example runs)."""
    schema: Any = schemathesis.openapi.from_asgi("/openapi.json", app, headers=headers or {})
    fixed = {"alias": ALIAS, "change_id": _a_change(app, headers)}
    for result in schema.get_all_operations():
        operation = result.ok()
        if only_writes and operation.path not in WRITE_PATHS:
            continue
        excluded = [positive_data_acceptance] if operation.path in CHECKED_BEYOND_SCHEMA else []
        for mode, params in _variants(operation.path, fixed):
            strategy = operation.as_strategy(mode, path_parameters=params)
            label = f"{setup} {operation.method.upper()} {operation.path} ({mode.value})"
            _run(
                strategy, tally, setup, operation.path, label, examples, headers, rng_seed, excluded
            )


def _a_change(app: FastAPI, headers: dict[str, str] | None) -> str | None:
    """The id of a committed write, so the change route is fuzzed on a known change too (only
    with the write key: else there is none to know)."""
    if not headers or not any(getattr(r, "path", "") in WRITE_PATHS for r in app.routes):
        return None
    body = {"documents": [{"id": "fuzz-seed", "text": "alpha seed"}]}
    with TestClient(app) as http:
        answer = http.put(f"/v1/collections/{ALIAS}/documents", json=body, headers=headers)
    answer.raise_for_status()
    return str(answer.json()["change_id"])


def _variants(
    path: str, fixed: dict[str, str | None]
) -> Iterator[tuple[schemathesis.GenerationMode, dict[str, Any] | None]]:
    """Each generation mode with free path parameters, and with each that has a known value
    fixed (valid bodies reach the writer only on the served alias)."""
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        yield mode, None
        for name, value in fixed.items():
            if value is not None and f"{{{name}}}" in path:
                yield mode, {name: value}


def _run(
    strategy: Any,
    tally: Tally,
    setup: str,
    path: str,
    label: str,
    examples: int,
    headers: dict[str, str] | None,
    rng_seed: int | None,
    excluded: list[Any],
) -> None:
    @given(case=strategy)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # every example counts; nothing is shrunk or replayed
        derandomize=rng_seed is None,  # the test suite: the same cases on every run
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        where = f"{label} body={str(case.body)[:80]!r}"
        try:
            response = case.call(headers=headers)
        except Exception as exc:  # the app raised past its error boundary: a server error
            tally.record(setup, path, 500)
            tally.fail(where, exc)
            return
        tally.record(setup, path, response.status_code)
        try:
            case.validate_response(response, headers=headers, excluded_checks=excluded)
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis's failures: kept
            tally.fail(f"{where} -> {response.status_code} {response.text[:200]}", exc)

    if rng_seed is not None:
        seed(rng_seed)(check)
    with contextlib.suppress(Unsatisfiable):  # no schema-breaking input exists for the route
        check()


def run(examples: int = 150, model: str = "all-MiniLM-L6-v2", rng_seed: int = 0) -> dict[str, Any]:
    from rag_retriever.models.encoder import Encoder

    encoder = Encoder.load(model, device="cpu")
    tally = Tally()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        keyed = build_app(encoder, Path(tmp) / "keyed", write_key=WRITE_KEY)
        sent = {"Authorization": f"Bearer {WRITE_KEY}"}
        fuzz(keyed, tally, setup="key sent", examples=examples, headers=sent, rng_seed=rng_seed)
        fuzz(
            keyed,
            tally,
            setup="key missing",
            examples=examples,
            only_writes=True,
            rng_seed=rng_seed,
        )
        plain = build_app(encoder, Path(tmp) / "plain", write_key=None)
        fuzz(plain, tally, setup="no write routes", examples=examples, rng_seed=rng_seed)
        scoped = build_app(
            encoder, Path(tmp) / "scoped", write_key=None, keys_file=scoped_keys(Path(tmp))
        )
        fuzz(
            scoped,
            tally,
            setup="tenant key",
            examples=examples,
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
            rng_seed=rng_seed,
        )
        versions = len(keyed.state.retriever.store.versions(ALIAS))
    return {
        "examples": examples,
        "model": model,
        "seed": rng_seed,
        "seconds": round(time.perf_counter() - start, 1),
        "versions_left": versions,
        **tally.to_dict(),
    }


def report(result: dict[str, Any]) -> list[str]:
    lines = [
        f"== fuzzing the HTTP API (schemathesis, {result['examples']} examples per route, mode and "
        f"alias choice; {result['model']}, seed {result['seed']}, {result['seconds']} s) =="
    ]
    for key, n in result["requests"].items():
        statuses = ", ".join(
            f"{name.rsplit(' / ', 1)[1]}: {count}"
            for name, count in result["statuses"].items()
            if name.rsplit(" / ", 1)[0] == key
        )
        lines.append(
            f"{key}: {n} requests, {result['server_errors'].get(key, 0)} x 5xx ({statuses})"
        )
    total = sum(result["requests"].values())
    errors = sum(result["server_errors"].values())
    writes = sum(
        n
        for key, n in result["requests"].items()
        if key.split(" / ")[1] in ("writes", "changes", "feedback")
    )
    lines.append(
        f"all: {total} requests ({writes} to the write, change and feedback routes), "
        f"{errors} x 5xx, {result['failed_checks']} failed schema checks"
    )
    lines.extend(f"  failure: {text}" for text in result["failures"])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_fuzz", description=__doc__)
    parser.add_argument("--examples", type=int, default=150)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args.examples, args.model, args.seed)
    for text in report(result):
        print(text)
    return 1 if sum(result["server_errors"].values()) or result["failed_checks"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
