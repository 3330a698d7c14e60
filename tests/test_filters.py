"""Metadata filters with `in`, ranges, `not` and `all`/`any` nesting, checked against the version's
fields, and score thresholds.

Oracles: a brute-force evaluation of each condition over the documents' metadata in Python (the
semantics of Qdrant's filter model: a list field matches when an element does, a missing field
fails a match or a range and passes its `not`), compared with what every branch of a search
returns (dense, BM25, hybrid) on Qdrant Edge and on the server code path; hand-written refusals;
the unthresholded ranking for `min_score`.
"""

from __future__ import annotations

import doctest
import json
import math
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qdrant_client import QdrantClient

from rag_retriever import conditions
from rag_retriever.cli import main
from rag_retriever.conditions import All, AnyOf, Condition, Match, Not, Range, parse, to_json
from rag_retriever.errors import InvalidRequest
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.writer import ingest_documents, update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document, Mode, SearchFilter
from rag_retriever.service.server import create_app
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore, ServerStore, Store

TEAMS = ["support", "sales", "legal", "ops"]
TAGS = ["a", "b", "c"]
N_DOCS = 40


def metadata_of(i: int, rng: random.Random) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "team": rng.choice(TEAMS),
        "year": rng.randint(2015, 2025),
        "score": round(rng.uniform(0, 10), 2),
        "tags": rng.sample(TAGS, rng.randint(0, 3)),
        "staff": rng.random() < 0.5,
    }
    # some documents lack fields: a match fails on them and its `not` passes
    for key in ("team", "year", "staff"):
        if rng.random() < 0.15:
            del meta[key]
    return meta


def corpus() -> list[Document]:
    rng = random.Random(7)
    return [
        Document(f"d{i}", f"doc {i}", f"river city report number {i}", metadata_of(i, rng))
        for i in range(N_DOCS)
    ]


def holds(condition: Condition, meta: Mapping[str, Any]) -> bool:
    """The oracle: the condition evaluated on one document's metadata."""
    if isinstance(condition, Match):
        value = meta.get(condition.field)
        items = value if isinstance(value, list) else [] if value is None else [value]
        return any(type(item) is type(v) and item == v for item in items for v in condition.values)
    if isinstance(condition, Range):
        value = meta.get(condition.field)
        items = value if isinstance(value, list) else [] if value is None else [value]
        return any(
            isinstance(x, int | float)
            and not isinstance(x, bool)
            and (condition.gt is None or x > condition.gt)
            and (condition.gte is None or x >= condition.gte)
            and (condition.lt is None or x < condition.lt)
            and (condition.lte is None or x <= condition.lte)
            for x in items
        )
    if isinstance(condition, Not):
        return not holds(condition.condition, meta)
    parts = [holds(c, meta) for c in condition.conditions]
    return all(parts) if isinstance(condition, All) else any(parts)


# -- conditions a version's fields allow ---------------------------------------------------------

_matches = st.one_of(
    st.builds(
        Match,
        st.just("team"),
        st.lists(st.sampled_from(TEAMS), min_size=1, max_size=3, unique=True).map(tuple),
    ),
    st.builds(
        Match,
        st.just("tags"),
        st.lists(st.sampled_from(TAGS), min_size=1, max_size=2, unique=True).map(tuple),
    ),
    st.builds(Match, st.just("staff"), st.sampled_from([(True,), (False,), (True, False)])),
    st.builds(
        Match,
        st.just("year"),
        st.lists(st.integers(2014, 2026), min_size=1, max_size=3, unique=True).map(tuple),
    ),
)


@st.composite
def _ranges(draw: st.DrawFn) -> Range:
    field = draw(st.sampled_from(["year", "score"]))
    span = (2014, 2026) if field == "year" else (-1, 11)
    # halves too: a fractional bound on an integer field
    low = draw(st.one_of(st.none(), st.integers(span[0] * 2, span[1] * 2).map(lambda v: v / 2)))
    high = draw(st.one_of(st.none(), st.integers(span[0] * 2, span[1] * 2).map(lambda v: v / 2)))
    if low is None and high is None:
        low = float(span[0])
    if low is not None and high is not None and low > high:
        low, high = high, low
    strict_low, strict_high = draw(st.booleans()), draw(st.booleans())
    return Range(
        field,
        gt=low if strict_low else None,
        gte=None if strict_low else low,
        lt=high if strict_high else None,
        lte=None if strict_high else high,
    )


leaves = st.one_of(_matches, _ranges())
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).map(lambda cs: All(tuple(cs))),
        st.lists(inner, min_size=1, max_size=3).map(lambda cs: AnyOf(tuple(cs))),
        inner.map(Not),
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module", params=["edge", "edge-indexed", "server"])
def searched(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_encoder: Encoder
) -> Iterator[Retriever]:
    """The corpus ingested (and a delta on top, so a filter spans shards) on either store; on
    Edge its shards are too small for payload indexes (a filter reads their payloads), and
    "edge-indexed" builds them all the same, so both ways of filtering are held to the oracle."""
    tmp = tmp_path_factory.mktemp("filters")
    store: Store = (
        ServerStore(QdrantClient(":memory:"))
        if request.param == "server"
        else EdgeStore(tmp / "edge")
    )
    docs = corpus()
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "edge-indexed":
            patch.setattr("rag_retriever.store.edge.INDEXED_SHARD_POINTS", 0)
        ingest_documents(
            LoadedCorpus(tuple(docs[:30]), 0, "t"),
            alias="kb",
            encoder=tiny_encoder,
            store=store,
            lock_dir=tmp,
            rebase_drift=1.0,
        )
        update_documents(
            docs[30:], alias="kb", encoder=tiny_encoder, store=store, lock_dir=tmp, rebase_drift=1.0
        )
    if isinstance(store, EdgeStore):
        segments = store.manifest(store.resolve("kb")).segments
        indexed = store._index_kinds(segments)
        assert bool(indexed) == (request.param == "edge-indexed"), indexed
    yield Retriever(encoder=tiny_encoder, store=store, collection="kb")
    store.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(condition=trees)
def test_every_branch_returns_exactly_the_documents_the_condition_holds_for(
    searched: Retriever, condition: Condition
) -> None:
    expected = {d.id for d in corpus() if holds(condition, d.metadata)}
    flt = SearchFilter(where=condition)
    for mode in ("bm25", "dense", "hybrid"):
        hits = searched.search("river city report", k=N_DOCS, mode=mode, filter=flt)
        assert {h.doc_id for h in hits} == expected, (mode, to_json(condition))
    # its JSON form is the same filter
    assert SearchFilter.from_dict({"where": to_json(condition)}).where == condition


def test_the_version_records_its_fields_and_a_delta_adds_to_them(searched: Retriever) -> None:
    record = searched.store.record(searched.store.resolve("kb"))
    assert record.lineage.base  # the fixture's last write was a delta
    assert record.fields == {
        "score": "float",
        "staff": "bool",
        "tags": "keyword",
        "team": "keyword",
        "year": "integer",
    }


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ({"field": "region", "equals": "eu"}, "no document of kb__"),
        (
            {"field": "team", "range": {"gte": 1}},
            "a range needs a numeric field; 'team' holds keyword",
        ),
        ({"field": "score", "equals": 3}, "'score' holds floats: match it with a range"),
        (
            {"field": "year", "in": ["2020"]},
            "'year' holds integer values; the filter matches '2020'",
        ),
        ({"field": "staff", "equals": 1}, "'staff' holds bool values; the filter matches 1"),
        ({"not": {"field": "nope", "equals": 1}}, "has the field 'nope'"),
    ],
)
def test_a_filter_the_version_s_fields_cannot_satisfy_is_refused_listing_them(
    searched: Retriever, where: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        searched.search("river", mode="bm25", filter=SearchFilter(where=parse(where)))
    assert message in str(caught.value)
    assert "score (float), staff (bool), tags (keyword), team (keyword), year (integer)" in str(
        caught.value
    )
    with pytest.raises(InvalidRequest, match=r"no document of .* has the field 'region'"):
        searched.search("river", mode="bm25", filter=SearchFilter(equals={"region": "eu"}))


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ({"field": "a"}, "exactly one operator"),
        ({"field": "a", "equals": 1, "in": [1]}, "exactly one operator"),
        ({"field": "a", "like": 1}, "unknown key(s) ['like']"),
        ({"all": []}, "a non-empty list of conditions"),
        ({"any": {"field": "a", "equals": 1}}, "a non-empty list of conditions"),
        ({"not": {"field": "a", "equals": 1}, "field": "a"}, "takes no 'field'"),
        ({"field": "", "equals": 1}, "non-empty metadata field name"),
        ({"field": "a", "in": []}, "a list of 1 to 1024 values"),
        ({"field": "a", "in": [1, "1"]}, "values of one kind"),
        ({"field": "a", "equals": 1.5}, "match a float with a range"),
        ({"field": "a", "equals": None}, "a string, integer or boolean"),
        ({"field": "a", "equals": 2**60}, "integers lie within"),
        ({"field": "a", "range": {}}, "an object of bounds"),
        ({"field": "a", "range": {"gte": "1"}}, "a number, got str"),
        ({"field": "a", "range": {"gte": True}}, "a number, got bool"),
        ({"field": "a", "range": {"gte": math.inf}}, "a finite number"),
        # an integer past a float's range (JSON allows it): an OverflowError was a 500
        ({"field": "a", "range": {"gt": 10**400}}, "integers lie within"),
        ({"field": "a", "range": {"gt": 1, "gte": 1}}, "one lower bound"),
        ({"field": "a", "range": {"gte": 3, "lt": 1}}, "above the upper bound"),
        ({"field": "a", "range": {"near": 1}}, "unknown bound(s) ['near']"),
        ([1], "a condition is an object"),
    ],
)
def test_malformed_conditions_say_what_is_allowed(where: Any, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse(where)
    assert message in str(caught.value)


def test_depth_and_size_are_bounded() -> None:
    deep: dict[str, Any] = {"field": "a", "equals": 1}
    for _ in range(conditions.MAX_DEPTH):
        deep = {"not": deep}
    with pytest.raises(ValueError, match="nest at most 8 levels"):
        parse(deep)
    wide = {"any": [{"field": "a", "equals": i} for i in range(conditions.MAX_CONDITIONS)]}
    with pytest.raises(ValueError, match="at most 64 conditions"):
        parse(wide)


def test_the_module_examples_hold() -> None:
    assert doctest.testmod(conditions).failed == 0


def test_min_score_keeps_the_ranking_above_the_threshold(searched: Retriever) -> None:
    cases: list[tuple[Mode, float]] = [("dense", 0.0), ("bm25", 0.5), ("hybrid", 0.0)]
    for mode, threshold in cases:
        full = searched.search("report number 7 river", k=N_DOCS, mode=mode)
        kept = searched.search("report number 7 river", k=N_DOCS, mode=mode, min_score=threshold)
        expected = [h.chunk_id for h in full if h.score >= threshold]
        assert [h.chunk_id for h in kept] == expected
        assert 0 < len(expected) < len(full) or mode != "dense" or expected
    refused: list[tuple[Mode, float]] = [
        ("dense", 1.5),
        ("dense", -2.0),
        ("bm25", -0.1),
        ("hybrid", math.nan),
    ]
    for mode, bad in refused:
        with pytest.raises(InvalidRequest, match="min_score"):
            searched.search("river", mode=mode, min_score=bad)


def test_http_takes_where_and_min_score_and_refuses_with_422(
    searched: Retriever, tmp_path: Path
) -> None:
    with TestClient(create_app(searched, Settings(data_dir=tmp_path))) as http:
        where = {
            "any": [{"field": "team", "in": ["legal"]}, {"field": "year", "range": {"lt": 2017}}]
        }
        r = http.post(
            "/v1/search",
            json={"query": "river city", "k": N_DOCS, "mode": "bm25", "filter": {"where": where}},
        )
        assert r.status_code == 200, r.text
        expected = {d.id for d in corpus() if holds(parse(where), d.metadata)}
        assert {h["doc_id"] for h in r.json()["hits"]} == expected
        bad = {"query": "river", "filter": {"where": {"field": "region", "equals": "eu"}}}
        r = http.post("/v1/search", json=bad)
        assert r.status_code == 422 and "has the field 'region'" in r.json()["detail"]
        r = http.post("/v1/search", json={"query": "river", "filter": {"where": {"field": "a"}}})
        assert r.status_code == 422 and "exactly one operator" in r.json()["detail"]
        r = http.post("/v1/search", json={"query": "river", "mode": "bm25", "min_score": -1})
        assert r.status_code == 422 and "min_score" in r.json()["detail"]
        # a fused score is 0 and up in every fusion: a negative threshold would mean nothing
        r = http.post("/v1/search", json={"query": "river", "mode": "hybrid", "min_score": -0.5})
        assert r.status_code == 422 and "hybrid scores' range [0, inf]" in r.json()["detail"]


def test_the_cli_takes_a_filter_and_a_threshold(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "docs.jsonl"
    rows = [{"id": d.id, "title": d.title, "text": d.text, **d.metadata} for d in corpus()]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["ingest", str(path), "--collection", "kb", "--no-progress"]) == 0
    capsys.readouterr()
    where = {"all": [{"field": "tags", "in": ["a"]}, {"not": {"field": "staff", "equals": True}}]}
    args = ["search", "river city", "--collection", "kb", "--mode", "bm25", "-k", "40", "--json"]
    assert main([*args, "--filter", json.dumps(where)]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert {h["doc_id"] for h in hits} == {
        d.id for d in corpus() if holds(parse(where), d.metadata)
    }
    assert main([*args, "--filter", '{"field": "nope", "equals": 1}']) == 2
    assert "has the field 'nope'" in capsys.readouterr().err
    assert main([*args, "--filter", "{not json"]) == 2
    assert "--filter" in capsys.readouterr().err
    assert main([*args, "--min-score", "-1"]) == 2
    capsys.readouterr()
    # a bad filter is refused before any model loads (this one could not be loaded)
    dense = ["search", "river", "--collection", "kb", "--model", str(tmp_path / "no-model")]
    assert main([*dense, "--filter", "{not json"]) == 2
    assert capsys.readouterr().err.startswith("error: --filter: ")


@pytest.mark.parametrize("kind", ["edge", "server"])
def test_any_plain_metadata_field_name_can_be_filtered_on(
    kind: str, tmp_path: Path, tiny_encoder: Encoder
) -> None:
    names = ["a b", "*", "a/b", ".", "😀", "a[0]", "$", "page number"]
    docs = [
        Document(f"d{i}", f"doc {i}", "king of the river city", {name: "3"})
        for i, name in enumerate(names)
    ]
    store: Store = (
        EdgeStore(tmp_path / "edge") if kind == "edge" else ServerStore(QdrantClient(":memory:"))
    )
    ingest_documents(
        LoadedCorpus(tuple(docs), 0, "t"),
        alias="kb",
        encoder=tiny_encoder,
        store=store,
        lock_dir=tmp_path,
    )
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="kb")
    for i, name in enumerate(names):
        for mode in ("dense", "bm25", "hybrid"):
            for flt in (
                SearchFilter(equals={name: "3"}),
                SearchFilter(where=parse({"field": name, "in": ["3"]})),
            ):
                hits = retriever.search("king", k=10, mode=mode, filter=flt)
                assert [h.doc_id for h in hits] == [f"d{i}"], (name, mode)
    store.close()


def test_where_reads_digits_with_a_leading_zero_as_text() -> None:
    """A zip code or an account number with a leading zero is text: `--where zip=02139` once
    became the integer 2139 and matched nothing (found by a review)."""
    from rag_retriever.cli.common import parse_where

    assert parse_where(["zip=02139", "n=5", "m=-3", "z=0", "t=true", "q=--5"]) == {
        "zip": "02139",
        "n": 5,
        "m": -3,
        "z": 0,
        "t": True,
        "q": "--5",
    }


def test_where_reads_only_ascii_integers_json_keeps_exact_and_one_value_a_field() -> None:
    """`٣` and `３` became the integer 3, `²` a ValueError named as --filter's, and a 20-digit
    account number an integer refused as too large; a repeated field kept its last value."""
    from rag_retriever.cli.common import parse_where
    from rag_retriever.errors import RagError

    long = "12345678901234567890"
    assert parse_where(["a=٣", "b=３", "c=²", f"acct={long}", "d=9007199254740991"]) == {
        "a": "٣",
        "b": "３",
        "c": "²",
        "acct": long,
        "d": 9007199254740991,
    }
    with pytest.raises(RagError, match="--where team= given twice"):
        parse_where(["team=a", "team=b"])
    assert parse_where(["team=a", "team=a"]) == {"team": "a"}
    with pytest.raises(RagError, match="given twice"):
        parse_where(["a=1", "a=true"])  # 1 == True to Python, not to a filter


def test_a_float_bound_past_an_exact_integer_survives_the_round_trip() -> None:
    """`to_dict` wrote 1e20 as an integer, which parsing then refused: a filter that worked in
    Python was a 422 over HTTP (the client sends `to_dict`)."""
    for bound in (1e20, 9007199254740993.0, -1e300, 2.5, 4.0):
        flt = SearchFilter.from_dict({"where": {"field": "size", "range": {"lt": bound}}})
        again = SearchFilter.from_dict(json.loads(json.dumps(flt.to_dict())))
        assert again == flt
