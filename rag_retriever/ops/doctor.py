"""`rag-retriever doctor`: the monitoring jobs an embedding index needs, each a number, what it
means, and a threshold that makes the command exit non-zero (for cron or CI).

Example:
    $ rag-retriever doctor --collection docs --log rag-data/query-log --questions q.jsonl --json

Checks (each on a seeded sample, so a run takes seconds on 2 cores):
- noise floor: cosine similarity of random chunk pairs (mean, p95, p99) and the norm of the mean
  unit vector (anisotropy: 0 = directions spread evenly, 1 = all alike). A similarity threshold
  below p99 of unrelated pairs means nothing;
- near-duplicates: chunks whose nearest other chunk is above `duplicate_similarity` (and above
  the floor's p99), with examples and their share; boilerplate: chunk texts that several
  documents share word for word;
- truncation: the share of chunks, and of logged queries, that hit the embedder's token window;
- drift (with a query log): how close recent queries come to the corpus (their best chunk's
  similarity) and to the evaluation questions (their nearest question's), oldest window next to
  newest, and the share of recent queries whose nearest question is below the noise floor's p95;
- stage health (with a query log): which stage ranked each top hit first, empty results,
  latency percentiles.

Drift and stage health read only the logged queries of the collection's alias (the name the
searches were asked with); a log that holds none of them says so and skips both. A judged
check carries its value and the limit it was judged against (`verdict()`: "0.310 > limit 0.050
(--max-duplicate-share)").

Does not do: plots (the JSON carries the distributions' percentiles), or fixing anything.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rag_retriever.errors import ConfigError
from rag_retriever.eval.questions import Question, load_questions
from rag_retriever.query.querylog import read_queries
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import content_hash
from rag_retriever.store import DENSE, StageQuery

# Random pairs for the noise floor: p99 of 4,000 pairs is stable to ~0.01.
FLOOR_PAIRS = 4000
# Chunks whose nearest neighbour is looked up (all of them up to this many).
SAMPLE_CHUNKS = 2000
# Recent logged queries used for drift and stage health, split into an oldest and a newest half.
LOG_QUERIES = 2000


@dataclass(frozen=True)
class Thresholds:
    """When a check fails (the command then exits 1)."""

    duplicate_similarity: float = 0.98  # a pair this similar is a near-duplicate
    max_duplicate_share: float = 0.05
    max_boilerplate_share: float = 0.05
    max_truncated_share: float = 0.01
    max_far_query_share: float = 0.25  # recent queries with no evaluation question near them
    max_empty_share: float = 0.05

    def __post_init__(self) -> None:
        # a share outside [0, 1] would fail or pass every time; a cosine above 1 finds nothing
        for name, value in self.__dict__.items():
            low = 0.0 if name.startswith("max_") else -1.0
            if not low <= value <= 1.0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be between {low:g} and 1; got {value:g}")


@dataclass
class Check:
    name: str
    ok: bool
    summary: str
    meaning: str
    figures: dict[str, Any] = field(default_factory=dict)
    # What was judged: the value, the limit it may not exceed, and the Thresholds field (and
    # flag) that set it; None for a check that only reports.
    value: float | None = None
    limit: float | None = None
    threshold: str | None = None

    def verdict(self) -> str:
        """The judgement in one phrase, e.g. "0.310 > limit 0.050 (--max-duplicate-share)"."""
        if self.value is None or self.limit is None:
            return ""
        flag = f" (--{self.threshold.replace('_', '-')})" if self.threshold else ""
        return f"{self.value:.3f} {'<=' if self.ok else '>'} limit {self.limit:.3f}{flag}"


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "mean": round(float(arr.mean()), 4),
        "p5": round(float(np.percentile(arr, 5)), 4),
        "p50": round(float(np.percentile(arr, 50)), 4),
        "p95": round(float(np.percentile(arr, 95)), 4),
        "p99": round(float(np.percentile(arr, 99)), 4),
    }


class Doctor:
    def __init__(
        self, retriever: Retriever, *, collection: str, thresholds: Thresholds, seed: int = 0
    ) -> None:
        self.retriever = retriever
        self.store = retriever.store
        self.alias = collection
        self.name = self.store.resolve(collection)
        self.record = self.store.record(self.name)
        self.thresholds = thresholds
        self.rng = random.Random(seed)

    def run(
        self, *, log: Sequence[Path] = (), questions: Path | Sequence[Question] | None = None
    ) -> list[Check]:
        ids, payloads = self._chunks()
        sample = self.rng.sample(ids, min(SAMPLE_CHUNKS, len(ids)))
        vectors = self._vectors(sample)
        floor = self._noise_floor(vectors)
        checks = [floor, self._duplicates(sample, vectors, floor), self._boilerplate(payloads)]
        labelled = labelled_questions(questions) if isinstance(questions, Path) else questions
        entries: Sequence[dict[str, Any]] = []
        if log:
            logged = read_queries(log, alias=self.alias, newest=LOG_QUERIES)
            entries = logged.lines
            checks.append(self._log_scope(logged.aliases, logged.matched, len(entries)))
        checks.append(self._truncation(payloads, entries))
        if entries:
            checks.append(self._drift(entries, labelled, floor))
            checks.append(self._stage_health(entries))
        return checks

    # -- data ---------------------------------------------------------------------------------

    def _chunks(self) -> tuple[list[str], dict[str, dict[str, Any]]]:
        payloads = {r.id: dict(r.payload) for r in self.store.scroll(self.name)}
        return sorted(payloads), payloads

    def _vectors(self, ids: Sequence[str]) -> np.ndarray:
        found: dict[str, np.ndarray] = {}
        for at in range(0, len(ids), 1024):
            for r in self.store.retrieve(self.name, ids[at : at + 1024], with_dense=True):
                if r.dense is not None:
                    found[r.id] = r.dense
        return np.stack([found[i] for i in ids]) if ids else np.empty((0, 1), np.float32)

    def _judged(
        self,
        name: str,
        value: float,
        threshold: str,
        *,
        summary: str,
        meaning: str,
        figures: dict[str, Any],
    ) -> Check:
        """A check that fails when `value` is above the Thresholds field `threshold`."""
        limit = float(getattr(self.thresholds, threshold))
        return Check(
            name, value <= limit, summary, meaning, figures, value, limit, threshold=threshold
        )

    # -- checks -------------------------------------------------------------------------------

    def _log_scope(self, aliases: Sequence[str], of_alias: int, judged: int) -> Check:
        """Which logged queries drift and stage health read: this alias's newest LOG_QUERIES."""
        figures = {"alias": self.alias, "queries": of_alias, "judged": judged, "aliases": aliases}
        if not of_alias:
            present = ", ".join(aliases) or "none (no query is logged there yet)"
            return Check(
                "query log",
                True,
                f"no logged query of alias {self.alias}; aliases in the log: {present}; drift and "
                f"stage health are skipped (--collection names the alias the searches asked for; "
                f"--log the RAG_QUERY_LOG of the process that serves it)",
                "",
                figures,
            )
        return Check(
            "query log",
            True,
            f"{of_alias} logged queries of alias {self.alias} (aliases in the log: "
            f"{', '.join(aliases)}); drift and stage health read the newest {judged}",
            "",
            figures,
        )

    def _noise_floor(self, vectors: np.ndarray) -> Check:
        n = len(vectors)
        if n < 2:
            return Check("noise floor", True, "too few chunks to measure", "", {})
        a = np.array([self.rng.randrange(n) for _ in range(FLOOR_PAIRS)])
        b = np.array([self.rng.randrange(n) for _ in range(FLOOR_PAIRS)])
        keep = a != b
        sims = np.einsum("ij,ij->i", vectors[a[keep]], vectors[b[keep]])
        stats = _percentiles(sims.tolist())
        anisotropy = float(np.linalg.norm(vectors.mean(axis=0)))
        return Check(
            "noise floor",
            True,
            f"random chunk pairs: mean {stats['mean']:.3f}, p95 {stats['p95']:.3f}, p99 "
            f"{stats['p99']:.3f}; mean-vector norm {anisotropy:.3f}",
            "similarity that unrelated chunks reach by chance: a threshold below p99 keeps noise",
            {"pairs": int(keep.sum()), **stats, "anisotropy": round(anisotropy, 4)},
        )

    def _duplicates(self, ids: Sequence[str], vectors: np.ndarray, floor: Check) -> Check:
        t = self.thresholds
        limit = max(t.duplicate_similarity, float(floor.figures.get("p99", 0.0)))
        queries = [StageQuery(DENSE, v, 2) for v in vectors]
        near: list[tuple[str, str, float]] = []
        for at in range(0, len(queries), 256):
            results = self.store.search(self.name, queries[at : at + 256])
            for pid, found in zip(ids[at : at + 256], results, strict=True):
                other = next(((i, s) for i, s in found if i != pid), None)
                if other is not None and other[1] >= limit:
                    near.append((pid, other[0], other[1]))
        share = len(near) / len(ids) if ids else 0.0
        examples = [{"chunk": a, "nearest": b, "similarity": round(s, 4)} for a, b, s in near[:5]]
        return self._judged(
            "near-duplicates",
            share,
            "max_duplicate_share",
            summary=f"{len(near)} of {len(ids)} sampled chunks ({share:.1%}) have a neighbour at "
            f"cosine >= {limit:.3f}",
            meaning="near-identical chunks crowd the top k with one answer repeated",
            figures={
                "sampled": len(ids),
                "count": len(near),
                "share": round(share, 4),
                "similarity": limit,
                "examples": examples,
            },
        )

    def _boilerplate(self, payloads: dict[str, dict[str, Any]]) -> Check:
        docs_of: dict[str, set[str]] = {}
        for p in payloads.values():
            text = " ".join(str(p.get("text", "")).split()).lower()
            if len(text) >= 40:
                docs_of.setdefault(content_hash(text), set()).add(str(p.get("doc_id")))
        shared = {h for h, docs in docs_of.items() if len(docs) >= 3}
        count = sum(
            1
            for p in payloads.values()
            if content_hash(" ".join(str(p.get("text", "")).split()).lower()) in shared
        )
        share = count / len(payloads) if payloads else 0.0
        return self._judged(
            "boilerplate",
            share,
            "max_boilerplate_share",
            summary=f"{count} chunks ({share:.1%}) repeat a text that 3 or more documents share "
            f"word for word",
            meaning="navigation, footers, licences: they match many questions and answer none",
            figures={"chunks": count, "share": round(share, 4), "texts": len(shared)},
        )

    def _truncation(
        self, payloads: dict[str, dict[str, Any]], entries: Sequence[dict[str, Any]]
    ) -> Check:
        window = self.record.fingerprint.max_seq_length
        budget = int(self.record.chunking.get("chunk_tokens", window))
        cut = sum(1 for p in payloads.values() if int(p.get("n_tokens", 0)) > budget)
        chunk_share = cut / len(payloads) if payloads else 0.0
        queries_cut = sum(1 for e in entries if e.get("query_truncated"))
        query_share = queries_cut / len(entries) if entries else 0.0
        return self._judged(
            "truncation",
            max(chunk_share, query_share),
            "max_truncated_share",
            summary=f"chunks over their {budget}-token budget {chunk_share:.2%}; logged queries "
            f"over the {window}-token window {query_share:.2%} ({queries_cut} of {len(entries)})",
            meaning="text past the model's window is not embedded: it cannot be found by meaning",
            figures={
                "chunk_share": round(chunk_share, 4),
                "query_share": round(query_share, 4),
                "queries": len(entries),
            },
        )

    def _drift(
        self,
        entries: Sequence[dict[str, Any]],
        labelled: Sequence[Question] | None,
        floor: Check,
    ) -> Check:
        texts = [e["query"] for e in entries if e.get("query")]
        if len(texts) < 2:
            return Check("drift", True, "too few logged query texts", "", {"queries": len(texts)})
        encoder = self.retriever.encoder
        vectors = encoder.encode_queries(texts).vectors
        best = [
            found[0][1] if found else 0.0
            for found in self.store.search(self.name, [StageQuery(DENSE, v, 1) for v in vectors])
        ]
        half = len(texts) // 2
        figures: dict[str, Any] = {
            "queries": len(texts),
            "best_chunk_oldest": _percentiles(best[:half]),
            "best_chunk_newest": _percentiles(best[half:]),
        }
        summary = (
            f"best-chunk similarity p50 {figures['best_chunk_oldest'].get('p50', 0):.3f} (oldest "
            f"half) -> {figures['best_chunk_newest'].get('p50', 0):.3f} (newest half)"
        )
        meaning = "queries moving away from the corpus or from what the evaluation covers"
        if labelled is None:  # nothing to judge against: reported, never failed
            return Check("drift", True, summary, meaning, figures)
        q_vectors = encoder.encode_queries([q.question for q in labelled]).vectors
        nearest = (vectors @ q_vectors.T).max(axis=1)
        far_line = float(floor.figures.get("p95", 0.0))
        far = float(np.mean(nearest[half:] < far_line))
        figures.update(
            nearest_question_oldest=_percentiles(nearest[:half].tolist()),
            nearest_question_newest=_percentiles(nearest[half:].tolist()),
            far_share_newest=round(far, 4),
            far_below=far_line,
        )
        return self._judged(
            "drift",
            far,
            "max_far_query_share",
            summary=f"{summary}; {far:.1%} of the newest queries have no labelled question above "
            f"the noise floor's p95 ({far_line:.3f})",
            meaning=meaning,
            figures=figures,
        )

    def _stage_health(self, entries: Sequence[dict[str, Any]]) -> Check:
        top_by: Counter[str] = Counter()
        empty = 0
        latencies = [float(e["latency_ms"]) for e in entries if e.get("latency_ms") is not None]
        for e in entries:
            hits = e.get("hits") or []
            if not hits:
                empty += 1
                continue
            for stage in ("dense", "bm25"):
                if hits[0].get(f"{stage}_rank") == 1:
                    top_by[stage] += 1
        n = len(entries)
        empty_share = empty / n if n else 0.0
        return self._judged(
            "stage health",
            empty_share,
            "max_empty_share",
            summary=f"top hit ranked first by dense {top_by['dense'] / n:.0%}, by BM25 "
            f"{top_by['bm25'] / n:.0%}; empty results {empty_share:.1%}; latency p50 "
            f"{_percentiles(latencies).get('p50', 0):.1f} ms",
            meaning="a stage that never contributes, or many empty answers, says a list is broken",
            figures={
                "queries": n,
                "top_hit_dense_first": round(top_by["dense"] / n, 4) if n else 0,
                "top_hit_bm25_first": round(top_by["bm25"] / n, 4) if n else 0,
                "empty_share": round(empty_share, 4),
                "latency_ms": _percentiles(latencies),
            },
        )


def labelled_questions(path: Path) -> list[Question]:
    """The questions drift is measured against; a file with a bad line, or none, is refused
    before any check runs (no drift measured against nothing)."""
    labelled, problems = load_questions(path)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"--questions: {problems[0]}{more}; fix the file or leave it out")
    if not labelled:
        raise ConfigError(f"--questions: {path} holds no questions; give labelled questions")
    return labelled
