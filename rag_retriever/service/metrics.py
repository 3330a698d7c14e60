"""Prometheus metrics of the HTTP service (`GET /metrics`, the Prometheus text format).

Example:
    $ curl -s localhost:8000/metrics -H "Authorization: Bearer $RAG_API_KEY" | grep rag_
    rag_requests_total{method="POST",route="/v1/search",status="200"} 42.0

What is measured, with bounded label sets (routes are the app's route templates, never a query
text or an id):
- `rag_requests_total{route, method, status}` (a method outside GET, HEAD, POST, PUT, DELETE,
  OPTIONS, PATCH is "other") and `rag_request_duration_seconds{route}`: every
  request, errors included;
- `rag_queries_total{mode}`, `rag_stage_duration_seconds{stage}` (encode, search = the dense and
  BM25 lists in one engine call, fuse, rerank, total), `rag_hits_returned` (per query),
  `rag_queries_truncated_total` (queries longer than the embedder's window);
- `rag_scoped_queries_total{key, tenant}`: queries by the name of the key that asked (never the
  key) and the tenant searched, each label bounded to MAX_LABELS values plus "other";
- `rag_served_version{alias}` and `rag_served_version_age_seconds{alias}` (read at scrape time);
- `rag_query_log_lines_total`, `rag_query_log_dropped_total` (when the query log is on);
- `rag_cache_hits_total{kind}` (exact, semantic), `rag_cache_misses_total`, `rag_cache_entries`
  (when the cache is on);
- `process_resident_memory_bytes` and the other `process_*` metrics of prometheus-client.

Each app has its own registry (several apps in one process do not mix). With `RAG_METRICS_PORT`
the same registry is also served on a port of its own, without the API key, for a scraper.
Does not do: push gateways, exemplars, per-collection request labels.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rag_retriever.access import Scope, single_tenant
from rag_retriever.errors import RagError
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import SearchResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a cached BM25 query (~1 ms) to a reranked batch on a CPU (seconds).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
HITS_BUCKETS = (0, 1, 3, 5, 10, 20, 50, 100)


# The methods counted by name in rag_requests_total.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})


class Metrics:
    """The metrics of one app, in a registry of its own."""

    def __init__(self, retriever: Retriever) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "rag_requests",
            "HTTP requests by route template, method and status",
            ("route", "method", "status"),
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "rag_request_duration_seconds",
            "HTTP request latency by route template",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queries = Counter(
            "rag_queries", "queries answered, by mode", ("mode",), registry=self.registry
        )
        self.stage_seconds = Histogram(
            "rag_stage_duration_seconds",
            "time per query in each stage (encode, search, fuse, rerank) and in all (total)",
            ("stage",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.hits = Histogram(
            "rag_hits_returned",
            "hits returned per query",
            buckets=HITS_BUCKETS,
            registry=self.registry,
        )
        self.truncated = Counter(
            "rag_queries_truncated",
            "queries longer than the embedder's window (their tail was not embedded)",
            registry=self.registry,
        )
        self.scoped = Counter(
            "rag_scoped_queries",
            f"queries by the name of the key that asked and the tenant searched (each label the "
            f"first {MAX_LABELS} values seen, then 'other'; tenant 'all' = every tenant the key "
            f"reads)",
            ("key", "tenant"),
            registry=self.registry,
        )
        self._key_labels = BoundedLabels(MAX_LABELS)
        self._tenant_labels = BoundedLabels(MAX_LABELS)
        self.registry.register(_StateCollector(retriever))

    def observe(
        self, results: Sequence[SearchResult], scope: Scope | None = None, tenant: str | None = None
    ) -> None:
        if scope is not None:
            tenant = single_tenant(scope, tenant)
            self.scoped.labels(
                self._key_labels.of(scope.name), self._tenant_labels.of(tenant or "all")
            ).inc(len(results))
        for result in results:
            self.queries.labels(result.mode).inc()
            for stage, ms in result.timings_ms.items():
                self.stage_seconds.labels(stage).observe(ms / 1000)
            self.hits.observe(len(result.hits))
            if result.query_truncated:
                self.truncated.inc()

    def count_request(self, route: str, method: str, status: int, seconds: float) -> None:
        # any token is a method to the HTTP parser, before any key is checked: one series each
        # would grow the registry without bound, so other methods share "other"
        method = method if method in HTTP_METHODS else "other"
        self.requests.labels(route, method, str(status)).inc()
        self.request_seconds.labels(route).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# Distinct values of a label a metric may carry (key names, tenants): a scraper's series stay
# bounded whatever the keys file or the requests hold.
MAX_LABELS = 50


class BoundedLabels:
    """A label's values: the first `limit` seen as themselves, every later one as "other"."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def of(self, value: str) -> str:
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return "other"


class _StateCollector(Collector):
    """What is read at scrape time: the served version of each alias and its age, the query
    log's counters."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    def collect(self) -> Iterator[Any]:
        version = GaugeMetricFamily(
            "rag_served_version", "the version number each alias serves", labels=["alias"]
        )
        age = GaugeMetricFamily(
            "rag_served_version_age_seconds",
            "seconds since the served version was completed",
            labels=["alias"],
        )
        store = self.retriever.store
        with contextlib.suppress(RagError):
            for alias, name in sorted(store.aliases().items()):
                with contextlib.suppress(RagError):
                    record = store.record(name)
                    version.add_metric([alias], record.version)
                    done = record.completed_at or record.created_at
                    if done:
                        age.add_metric(
                            [alias], time.time() - datetime.fromisoformat(done).timestamp()
                        )
        yield version
        yield age
        cache = self.retriever.cache
        if cache is not None:
            hits = CounterMetricFamily(
                "rag_cache_hits", "questions answered from the cache", labels=["kind"]
            )
            for kind, n in cache.hits.items():
                hits.add_metric([kind], n)
            yield hits
            yield _counter("rag_cache_misses", "questions the cache could not answer", cache.misses)
            yield GaugeMetricFamily("rag_cache_entries", "questions in the cache", value=len(cache))
        log = self.retriever.query_log
        if log is not None:
            yield _counter("rag_query_log_lines", "query log lines written", log.written)
            yield _counter(
                "rag_query_log_dropped", "query log lines dropped (unwritable, full)", log.dropped
            )


def _counter(name: str, doc: str, value: float) -> Any:
    return CounterMetricFamily(name, doc, value=value)
