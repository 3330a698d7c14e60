"""What a search is asked and what it records: the query path's knobs (`RetrievalConfig`), the
stages each mode runs (`MODE_STAGES`, the one table every mode-dependent step reads), a call's
options, and the per-stage `Trace` that evaluation replays.

Example:
    >>> MODE_STAGES["hybrid"]
    Stages(dense=True, bm25=True, fuse=True, rerank=False)
    >>> RetrievalConfig(rrf_k=60).rrf_k
    60

Values only: nothing here searches (query/retriever.py does).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypedDict

from rag_retriever import conditions
from rag_retriever.access import current, with_conditions
from rag_retriever.errors import CollectionNotFound, InvalidRequest, VersionIncompatible
from rag_retriever.models.bm25 import BM25Model
from rag_retriever.query.context import ExpandKind
from rag_retriever.query.fusion import Fusion, FusionMethod
from rag_retriever.records import (
    GROUPS_FIELD,
    TENANT_FIELD,
    Mode,
    SearchFilter,
    StageScore,
    check_tenant,
    is_blank,
)
from rag_retriever.settings import RerankFusion, Settings
from rag_retriever.store import Store, VersionRecord

_SETTINGS = frozenset(Settings.model_fields)
_DEFAULTS = Settings()


@dataclass(frozen=True)
class RetrievalConfig:
    """The query path's knobs. Defaults, meaning and validation are those of the settings of the
    same name (settings.py declares each once)."""

    fusion: FusionMethod = _DEFAULTS.fusion
    dense_top_n: int = _DEFAULTS.dense_top_n
    bm25_top_n: int = _DEFAULTS.bm25_top_n
    rrf_k: int = _DEFAULTS.rrf_k
    # Weights of the dense and the BM25 list in the fusion.
    rrf_weights: tuple[float, float] = _DEFAULTS.rrf_weights
    rerank_candidates: int = _DEFAULTS.rerank_candidates
    rerank_fusion: RerankFusion = _DEFAULTS.rerank_fusion
    # Weights of the cross-encoder order and the hybrid order in the "rrf" rerank fusion.
    rerank_fusion_weights: tuple[float, float] = (1.0, 1.0)
    default_k: int = _DEFAULTS.default_k
    max_k: int = _DEFAULTS.max_k
    max_query_chars: int = _DEFAULTS.max_query_chars
    diversity_candidates: int = _DEFAULTS.diversity_candidates
    expand_tokens: int = _DEFAULTS.expand_tokens

    def __post_init__(self) -> None:
        # One set of rules: those of the settings these fields come from (and only these).
        Settings.check(
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name in _SETTINGS}
        )

    @classmethod
    def from_settings(cls, s: Settings) -> RetrievalConfig:
        """The query-path fields of `s` (those that share a name with a setting)."""
        return cls(**{f.name: getattr(s, f.name) for f in fields(cls) if f.name in _SETTINGS})


@dataclass(frozen=True)
class Stages:
    """The stages a mode runs: embed the query and search the dense vectors, search BM25, fuse
    the two lists, rerank the fused candidates. Its result is the last list it makes."""

    dense: bool
    bm25: bool
    fuse: bool = False
    rerank: bool = False


# Each mode described once, as its stages; everything mode-dependent below reads this table.
MODE_STAGES: dict[Mode, Stages] = {
    "dense": Stages(dense=True, bm25=False),
    "bm25": Stages(dense=False, bm25=True),
    "hybrid": Stages(dense=True, bm25=True, fuse=True),
    "rerank": Stages(dense=True, bm25=True, fuse=True, rerank=True),
}


class SearchOptions(TypedDict, total=False):
    """The options of every search call (Retriever.retrieve_batch documents them)."""

    k: int | None
    mode: Mode | None
    filter: SearchFilter | Mapping[str, Any] | None  # the dict form as the HTTP API takes it
    collection: str | None
    diversity: float | None
    expand: ExpandKind | None
    expand_tokens: int | None
    min_score: float | None
    tenant: str | None


@dataclass(frozen=True)
class HitOptions:
    """What a request asks of its hits besides the ranking: `diversity` (MMR's trade-off, 0 =
    the ranked order) and `expand` (the hit's neighbouring chunks, or its section, merged into
    `Hit.context`, up to `expand_tokens`)."""

    diversity: float = 0.0
    expand: ExpandKind | None = None
    expand_tokens: int = _DEFAULTS.expand_tokens
    # Hits scoring below it (on the mode's own scale: SCORE_RANGES) are left out.
    min_score: float | None = None

    @property
    def key(self) -> str:
        """What the cache tells apart (hits asked for differently are different answers)."""
        tokens = self.expand_tokens if self.expand else ""
        return f"{self.diversity}|{self.expand}|{tokens}|{self.min_score}"


# What a hit's `score` is in each mode, and the thresholds (`min_score`) that can mean anything
# there: dense is the cosine of unit vectors; bm25 the BM25 score (0 up, unbounded); hybrid the
# fusion's score (RRF: a sum of weight / (k + rank); z-score and adaptive fusion: a weighted sum
# of each list's (score - min) / std, 0 and up); rerank the cross-encoder's logit (any sign).
SCORE_RANGES: dict[str, tuple[float, float]] = {
    "dense": (-1.0, 1.0),
    "bm25": (0.0, math.inf),
    "hybrid": (0.0, math.inf),
    "rerank": (-math.inf, math.inf),
}


def check_min_score(value: object, mode: str) -> float:
    """`value` as a threshold for `mode`'s scores; ValueError saying the mode's range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"min_score must be a finite number, got {value!r}")
    value = float(value)  # a NumPy number too
    low, high = SCORE_RANGES[mode]
    if not low <= value <= high:
        raise ValueError(
            f"min_score {value} is outside the {mode} scores' range [{low:g}, {high:g}] "
            f"(dense: cosine -1 to 1; bm25, hybrid: 0 and up; rerank: any number)"
        )
    return float(value)


def serving_record(store: Store, alias_or_name: str) -> VersionRecord | None:
    """The record of the version an alias serves; None when there is none yet (or it cannot be
    read: opening it for a query then says why)."""
    try:
        return store.record(store.resolve(alias_or_name))
    except (CollectionNotFound, VersionIncompatible):
        return None


@dataclass
class Trace:
    """What each stage returned for one query: (chunk id, StageScore), best first.

    A stage that did not run is None.
    """

    query: str
    dense: list[tuple[str, StageScore]] | None = None
    bm25: list[tuple[str, StageScore]] | None = None
    fused: list[tuple[str, StageScore]] | None = None
    rerank: list[tuple[str, StageScore]] | None = None
    # The reranked candidates' final order when `rerank_fusion` fuses it with the hybrid order.
    rerank_fused: list[tuple[str, StageScore]] | None = None
    query_truncated: bool = False
    # BM25 ran and the question held no word it indexes (only stop words, punctuation)
    no_indexed_words: bool = False
    rerank_truncated: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    fusion: str | None = None  # the fusion in force for the traced version

    def final(self, mode: Mode) -> list[tuple[str, StageScore]]:
        """The ranked chunk ids a mode returns: the list of its last stage."""
        stages = MODE_STAGES[mode]
        if stages.rerank:
            # The reranked candidates first, then the rest of the fused list in fused order.
            head = self.rerank_fused if self.rerank_fused is not None else self.rerank or []
            return head + (self.fused or [])[len(head) :]
        if stages.fuse:
            return self.fused or []
        return (self.dense if stages.dense else self.bm25) or []


@dataclass(frozen=True)
class OpenCollection:
    """A resolved collection version and what querying it needs."""

    name: str
    bm25: BM25Model
    record: VersionRecord
    # The version's own fusion when it was tuned (`tune-fusion`), else None (the settings').
    tuned_fusion: Fusion | None = None
    opened_at: float = 0.0


# How many of a version's fields an invalid filter's message lists.
MAX_LISTED_FIELDS = 50
# The field kinds (store/record.py field_kinds) a match value is checked against, by its type.
_VALUE_TYPES = ("keyword", "integer", "bool")


def _kind_of(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    return "integer" if isinstance(value, int) else "keyword"


def at_least(
    final: list[tuple[str, StageScore]], trace: Trace, mode: Mode, threshold: float
) -> list[tuple[str, StageScore]]:
    """The ranked list without the hits scoring below `threshold`; in rerank mode only
    reranked ones count (the rest carry fusion scores, another scale)."""
    if MODE_STAGES[mode].rerank:
        final = final[: len(trace.rerank_fused or trace.rerank or ())]
    return [(cid, s) for cid, s in final if s.score >= threshold]


# The fields of document-level access (docs/tenants.md): a collection whose documents have no
# tenant still answers a tenant's key, with nothing.
ACCESS_FIELDS = (TENANT_FIELD, GROUPS_FIELD)


def check_filter(flt: SearchFilter | None, opened: OpenCollection) -> None:
    """Every field the filter names is a metadata field of the version's documents, used as
    its values allow (a range on numbers, a match with values of the field's kind): a filter
    that can match nothing is a mistake to report, not 0 hits. Versions that do not record
    their fields (written before 0.3) are not checked, nor is the filter of a key limited to
    tenants or groups: the fields are the whole version's, so a 422 listing them (or answering
    for a field only another tenant's documents hold, and its kind) would tell one tenant what
    the others' documents hold; such a filter gets no hits, as the engine answers it."""
    fields = opened.record.fields
    scope = current()
    if flt is None or fields is None or (scope is not None and not scope.unrestricted):
        return
    problems = []
    for name, use, values in flt.field_uses():
        kind = fields.get(name)
        if kind is None and name in ACCESS_FIELDS:
            continue  # a key's scope names them in every search: no such document, no hit
        if kind is None:
            problems.append(f"no document of {opened.name} has the field {name!r}")
        elif use == "range" and kind not in ("integer", "float"):
            problems.append(f"a range needs a numeric field; {name!r} holds {kind} values")
        elif use == "match" and kind == "float":
            problems.append(f"{name!r} holds floats: match it with a range, not a value")
        elif use == "match" and kind in _VALUE_TYPES:
            wrong = [v for v in values if _kind_of(v) != kind]
            if wrong:
                hint = (
                    " (digits are text in JSON quotes: --filter "
                    f'\'{{"field": "{name}", "equals": "{wrong[0]}"}}\'; --where reads them as '
                    "an integer)"
                    if kind == "keyword"
                    and isinstance(wrong[0], int)
                    and not isinstance(wrong[0], bool)
                    else ""
                )
                problems.append(
                    f"{name!r} holds {kind} values; the filter matches {wrong[0]!r}{hint}"
                )
    if problems:
        known = ", ".join(f"{k} ({v})" for k, v in list(fields.items())[:MAX_LISTED_FIELDS])
        more = len(fields) - MAX_LISTED_FIELDS
        raise ValueError(
            "invalid filter: "
            + "; ".join(problems)
            + f". The fields it can name: {known or 'none (no document has metadata)'}"
            + (f" and {more} more" if more > 0 else "")
        )


def check_query(query: object, max_chars: int) -> None:
    """InvalidRequest for a query that is not a string, blank, not valid Unicode, or longer than
    `max_chars` (RAG_MAX_QUERY_CHARS)."""
    if not isinstance(query, str):
        raise InvalidRequest(f"the query must be a string, got {type(query).__name__}")
    if is_blank(query):
        raise InvalidRequest("the query is empty; send a question with at least one word")
    try:
        query.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise InvalidRequest(
            f"the query is not valid Unicode (a lone surrogate at character {exc.start}); "
            f"send UTF-8 text"
        ) from None
    if len(query) > max_chars:
        raise InvalidRequest(
            f"the query is {len(query)} characters long; the limit is {max_chars} "
            f"(RAG_MAX_QUERY_CHARS)"
        )


def check_request(
    queries: object,
    collection: object,
    flt: SearchFilter | Mapping[str, Any] | None,
    default_collection: str,
) -> SearchFilter | None:
    """A search call's queries and collection checked, and its filter as a SearchFilter (the
    dict form as the HTTP API takes it accepted); InvalidRequest for what it cannot mean."""
    if isinstance(queries, str):  # would be searched letter by letter
        raise InvalidRequest(
            "queries must be a list of questions, not one string; search(query) asks one"
        )
    if not isinstance(queries, Sequence):
        raise InvalidRequest(f"queries must be a list of questions, got {type(queries).__name__}")
    if collection is not None and (not isinstance(collection, str) or not collection):
        raise InvalidRequest(
            f"collection must be an alias or version name, got {collection!r}; leave it out "
            f"for the default ({default_collection!r})"
        )
    try:
        return SearchFilter.of(flt)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(str(exc)) from None


def tenant_filter(flt: SearchFilter | None, tenant: str | None) -> SearchFilter | None:
    """`flt` narrowed to `tenant`'s documents (InvalidRequest for a malformed tenant name)."""
    if tenant is None:
        return flt
    try:
        name = check_tenant(tenant)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return with_conditions(flt, [conditions.Match(TENANT_FIELD, (name,))])
