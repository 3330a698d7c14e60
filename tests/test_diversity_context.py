"""Diverse hits (MMR), the context around a hit (expand) and heading paths in chunk prefixes:
the pure pieces against brute force and the source text, then through a real collection, the
HTTP API, the CLI."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rag_retriever.cli import main
from rag_retriever.errors import CollectionNotFound, InvalidRequest
from rag_retriever.ingest.chunking import Chunker, ChunkingConfig
from rag_retriever.ingest.loaders import html_document, markdown_headings
from rag_retriever.ingest.writer import update_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.chunk_table import BoundedReads
from rag_retriever.query.context import merge, window
from rag_retriever.query.diversity import mmr
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document, Heading, section_at
from rag_retriever.service.server import create_app
from rag_retriever.settings import Settings
from rag_retriever.store import Store
from rag_retriever.store.base import float32_array
from tests.conftest import collection_retriever


def words(texts: Sequence[str]) -> list[int]:
    return [len(t.split()) for t in texts]


# -- MMR --------------------------------------------------------------------------------------


def objective(
    scores: np.ndarray, vectors: np.ndarray, picked: list[int], i: int, d: float
) -> float:
    """MMR's value of candidate i after `picked`, written out plainly (the oracle)."""
    span = scores.max() - scores.min()
    relevance = (scores[i] - scores.min()) / span if span > 0 else 1.0
    unit = [v / (np.linalg.norm(v) or 1.0) for v in vectors]
    nearest = max((float(unit[i] @ unit[j]) for j in picked), default=0.0)
    return float((1 - d) * relevance - d * nearest)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(-50, 50), min_size=n, max_size=n),
            st.lists(st.lists(st.integers(-3, 3), min_size=3, max_size=3), min_size=n, max_size=n),
        )
    ),
    st.floats(0, 1),
    st.integers(1, 14),
)
def test_each_mmr_pick_is_the_best_remaining_by_the_formula(
    data: tuple[list[int], list[list[int]]], diversity: float, k: int
) -> None:
    scores, vectors = np.array(data[0], dtype=float), np.array(data[1], dtype=float)
    picks = mmr(scores, vectors, diversity=diversity, k=k)
    order = [i for i, _ in picks]
    assert len(order) == min(k, len(scores)) and len(set(order)) == len(order)
    for step, (i, value) in enumerate(picks):
        before = order[:step]
        values = {j: objective(scores, vectors, before, j, diversity) for j in range(len(scores))}
        best = max(v for j, v in values.items() if j not in before)
        assert value == pytest.approx(values[i], abs=1e-9)
        assert values[i] >= best - 1e-9


def test_no_diversity_keeps_the_ranked_order_and_full_diversity_avoids_twins() -> None:
    scores = np.array([0.9, 0.8, 0.7, 0.1])
    vectors = np.array([[1.0, 0.0], [1.0, 0.01], [1.0, 0.02], [0.0, 1.0]])
    assert [i for i, _ in mmr(scores, vectors, diversity=0.0, k=4)] == [0, 1, 2, 3]
    assert [i for i, _ in mmr(scores, vectors, diversity=1.0, k=2)] == [0, 3]
    assert mmr(scores[:0], vectors[:0], diversity=0.5, k=3) == []
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="diversity must be a number from 0"):
            mmr(scores, vectors, diversity=bad, k=2)  # type: ignore[arg-type]


# -- the context around a hit -------------------------------------------------------------------

SENTENCE = st.lists(
    st.sampled_from(["alpha", "beta", "gamma", "delta", "é", "x1"]), min_size=1, max_size=9
)
TEXT = st.lists(
    st.lists(SENTENCE.map(lambda ws: " ".join(ws).capitalize() + "."), min_size=1, max_size=6).map(
        " ".join
    ),
    min_size=1,
    max_size=8,
).map("\n\n".join)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXT, st.integers(0, 50), st.integers(1, 60))
def test_a_window_is_contiguous_within_budget_and_merges_to_the_exact_source_text(
    text: str, at: int, budget: int
) -> None:
    doc = Document("d", "T", text)
    chunks = Chunker(
        words, ChunkingConfig(chunk_tokens=12, overlap_tokens=4, max_seq_length=64)
    ).chunk(doc)
    by_index = {c.chunk_index: c for c in chunks}
    hit = at % len(chunks)
    span = window(by_index, hit, budget=budget, kind="neighbours")
    assert hit in span and span == list(range(span[0], span[-1] + 1))
    used = sum(by_index[i].n_tokens for i in span)
    assert used <= budget or span == [hit]
    for outside in (span[0] - 1, span[-1] + 1):  # a window stops only where the next cannot fit
        if outside in by_index and span != [hit]:
            assert used + by_index[outside].n_tokens > budget
    context = merge([by_index[i] for i in span])
    assert text[context.start : context.end] == context.text
    assert (context.first_chunk, context.last_chunk) == (span[0], span[-1])
    assert by_index[hit].text in context.text


def test_a_section_window_stops_at_the_next_heading() -> None:
    text = "# Guide\n\n" + "\n\n".join(
        f"## Part {p}\n\n" + " ".join(f"Part {p} sentence {i} here." for i in range(12))
        for p in range(3)
    )
    doc = Document("g.md", "Guide", text, headings=markdown_headings(text, "Guide"))
    chunks = Chunker(
        words, ChunkingConfig(chunk_tokens=20, overlap_tokens=5, max_seq_length=128)
    ).chunk(doc)
    by_index = {c.chunk_index: c for c in chunks}
    middle = next(c for c in chunks if c.section == "Part 1")
    span = window(by_index, middle.chunk_index, budget=10_000, kind="section")
    assert {by_index[i].section for i in span} == {"Part 1"}
    assert len(span) == sum(c.section == "Part 1" for c in chunks)
    whole = window(by_index, middle.chunk_index, budget=10_000, kind="neighbours")
    assert whole == sorted(by_index)


# -- heading paths ------------------------------------------------------------------------------


def test_section_at_follows_heading_levels() -> None:
    hs = [
        Heading(0, 2, "A"),
        Heading(10, 3, "A1"),
        Heading(20, 4, "A1x"),
        Heading(30, 3, "A2"),
        Heading(40, 1, "B"),
    ]
    assert [section_at(hs, p) for p in (0, 15, 25, 35, 45)] == [
        "A",
        "A > A1",
        "A > A1 > A1x",
        "A > A2",
        "B",
    ]


def test_markdown_and_html_headings_point_at_their_text() -> None:
    md = "# Guide\n\nIntro.\n\n## Install\n\nRun it.\n\n```sh\n# a comment, not a heading\n```\n\n### On Linux ###\n\napt."
    headings = markdown_headings(md, "Guide")
    assert [(h.level, h.text) for h in headings] == [(2, "Install"), (3, "On Linux")]
    assert all(md[h.start :].lstrip("# ").startswith(h.text) for h in headings)
    html = "<title>Guide</title><h1>Guide</h1><p>Intro.</p><h2> Install  it </h2><p>Run.</p><h3>Linux</h3><p>apt</p>"
    doc = html_document(html, "g.html", "g")
    assert [(h.level, h.text) for h in doc.headings] == [(2, "Install it"), (3, "Linux")]
    assert all(doc.text[h.start : h.start + len(h.text)] == h.text for h in doc.headings)


def test_chunks_carry_their_heading_path_and_still_fit_the_window(tiny_encoder: Encoder) -> None:
    body = " ".join(f"Step {i} runs the installer again." for i in range(60))
    use = " ".join(f"Ask question {i} of it." for i in range(30))
    md = f"# Guide\n\nAbout it.\n\n## Install\n\n### Linux\n\n{body}\n\n## Use\n\n{use}"
    doc = Document("g.md", "Guide", md, headings=markdown_headings(md, "Guide"))
    config = ChunkingConfig(chunk_tokens=60, overlap_tokens=10, max_seq_length=96)
    chunker = Chunker(tiny_encoder.count_tokens, config)
    chunks = chunker.chunk(doc)
    assert chunks[0].section == ""  # the chunk starts before the first heading below the title
    assert "Install > Linux" in {c.section for c in chunks} and chunks[-1].section == "Use"
    linux = next(c for c in chunks if c.section == "Install > Linux")
    assert linux.embed_text.startswith("Guide > Install > Linux\n\n")
    embedded = tiny_encoder.count_tokens([c.embed_text for c in chunks])
    assert max(embedded) + config.special_tokens <= config.max_seq_length
    assert chunker.chunk_many([doc])[0] == chunks
    # without headings (or with the path off) the prefix is the title alone, as before
    off = Chunker(
        tiny_encoder.count_tokens, ChunkingConfig(**{**config.__dict__, "heading_path": False})
    )
    assert {c.section for c in off.chunk(doc)} == {""}


# -- through a collection -----------------------------------------------------------------------

LONG = " ".join(f"The river port number {i} ships grain and timber downstream." for i in range(40))
DOCS = (
    Document("long", "River trade", LONG),
    Document("twin-a", "Apples", "Apples grow in the orchard near the old mill."),
    Document("twin-b", "Apples", "Apples grow in the orchard near the old mill."),
    Document("twin-c", "Apples", "Apples grow in the orchard near the old mill."),
    Document("pears", "Pears", "Pears ripen late in the orchard after the apples."),
    Document("wine", "Wine", "Wine is made from grapes grown on the hills."),
)


@pytest.fixture
def kb(store: Store, tiny_encoder: Encoder) -> Retriever:
    return collection_retriever(DOCS, store, tiny_encoder)


def test_expanded_hits_hold_the_exact_text_around_them(kb: Retriever) -> None:
    result = kb.retrieve("river port grain timber", k=3, mode="hybrid", expand="neighbours")
    source = {d.id: d.text for d in DOCS}
    for hit in result.hits:
        assert hit.context is not None
        assert source[hit.doc_id][hit.context.start : hit.context.end] == hit.context.text
        assert hit.context.start <= hit.start and hit.end <= hit.context.end
    long_hits = [h for h in result.hits if h.doc_id == "long"]
    assert long_hits and any(h.context and h.context.text != h.text for h in long_hits)
    assert "expand" in result.timings_ms
    tight = kb.retrieve(
        "river port grain timber", k=3, mode="hybrid", expand="neighbours", expand_tokens=1
    )
    assert all(h.context is not None and h.context.text == h.text for h in tight.hits)
    plain = kb.retrieve("river port grain timber", k=3, mode="hybrid")
    assert all(h.context is None for h in plain.hits)


def test_expansion_reads_the_version_it_serves(
    kb: Retriever, store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    short = Document("long", "River trade", LONG[:200])
    update_documents(
        [short],
        [],
        alias="kb",
        encoder=tiny_encoder,
        store=store,
        lock_dir=tmp_path,
        rebase_drift=1.0,
    )
    result = kb.retrieve(
        "river port grain timber", k=6, mode="hybrid", expand="neighbours", expand_tokens=8192
    )
    hit = next(h for h in result.hits if h.doc_id == "long")
    assert hit.context is not None and hit.context.text == short.text


def test_diversity_keeps_near_duplicates_out_of_the_top_k(kb: Retriever) -> None:
    query = "apples orchard mill"
    plain = kb.retrieve(query, k=3, mode="hybrid")
    assert {h.doc_id for h in plain.hits} == {"twin-a", "twin-b", "twin-c"}
    assert all(h.mmr is None for h in plain.hits)
    # the tiny test model puts unrelated texts close together too: full diversity, so that
    # only an exact twin (similarity 1) is certain to lose its place
    diverse = kb.retrieve(query, k=3, mode="hybrid", diversity=1.0)
    twins = [h for h in diverse.hits if h.doc_id.startswith("twin")]
    assert len(twins) == 1 and diverse.hits[0].chunk_id == plain.hits[0].chunk_id
    assert [h.mmr.rank for h in diverse.hits if h.mmr] == [1, 2, 3]
    assert [h.rank for h in diverse.hits] == [1, 2, 3]
    unchanged = kb.retrieve(query, k=3, mode="hybrid", diversity=0.0)
    assert [h.chunk_id for h in unchanged.hits] == [h.chunk_id for h in plain.hits]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"diversity": 1.5}, "diversity must be a number from 0"),
        ({"diversity": "much"}, "diversity must be a number from 0"),
        ({"expand": "page"}, "expand must be one of neighbours, section"),
        ({"expand": "neighbours", "expand_tokens": 0}, "expand_tokens must be an integer from 1"),
        ({"expand_tokens": 10**6}, "expand_tokens must be an integer from 1 to 8192"),
    ],
)
def test_bad_options_say_what_is_accepted(
    kb: Retriever, options: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        kb.retrieve("apples", **options)  # type: ignore[arg-type]


def test_http_takes_diversity_and_expand(kb: Retriever) -> None:
    with TestClient(create_app(kb, Settings())) as http:
        answer = http.post(
            "/v1/search",
            json={
                "query": "river port grain",
                "k": 2,
                "mode": "hybrid",
                "expand": "neighbours",
                "diversity": 0.3,
            },
        )
        assert answer.status_code == 200, answer.text
        hits = answer.json()["hits"]
        assert all(h["context"]["text"] and h["mmr"]["rank"] == h["rank"] for h in hits)
        for body in ({"diversity": 2}, {"expand": "page"}, {"expand_tokens": -1}):
            bad = http.post("/v1/search", json={"query": "river", **body})
            assert bad.status_code == 422 and bad.json()["error"] == "invalid_request", bad.text


def test_the_cli_prints_contexts_and_refuses_bad_diversity(
    env: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": d.id, "title": d.title, "text": d.text}) + "\n" for d in DOCS)
    )
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    capsys.readouterr()
    args = ["search", "river port", "--collection", "kb", "--mode", "hybrid", "-k", "2"]
    assert main([*args, "--expand", "neighbours", "--diversity", "0.5", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert all(h["context"] is not None and h["mmr"] is not None for h in hits)
    assert main([*args, "--expand", "neighbours"]) == 0
    assert "context: chunks" in capsys.readouterr().out
    assert main([*args, "--diversity", "3"]) == 2
    assert "diversity must be a number from 0" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["store", "server_store"])
def test_vectors_can_be_read_without_payloads(
    which: str, request: pytest.FixtureRequest, tiny_encoder: Encoder
) -> None:
    """What MMR reads: the dense vectors alone, equal to those read with their payloads."""
    engine: Store = request.getfixturevalue(which)
    retriever = collection_retriever(DOCS, engine, tiny_encoder)
    name = engine.resolve("kb")
    ids = [h.chunk_id for h in retriever.search("apples", k=4, mode="bm25")]
    full = {r.id: r for r in engine.retrieve(name, ids, with_dense=True)}
    bare = {r.id: r for r in engine.retrieve(name, ids, with_dense=True, with_payload=False)}
    assert set(bare) == set(full) == set(ids)
    for cid, record in bare.items():
        assert record.payload == {} and full[cid].payload["chunk_id"] == cid
        read_with_payload = full[cid].dense
        assert record.dense is not None and read_with_payload is not None
        assert np.array_equal(record.dense, read_with_payload)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), max_size=40))
def test_engine_vectors_become_the_same_float32_array_as_numpy_makes(values: list[float]) -> None:
    """The fast conversion of the bindings' float lists (what MMR reads) against np.asarray."""
    assert np.array_equal(float32_array(values), np.asarray(values, dtype=np.float32))
    assert float32_array(values).dtype == np.float32


def test_engine_vectors_outside_float32_convert_as_numpy_converts() -> None:
    with np.errstate(over="ignore"):
        assert np.array_equal(float32_array([1e300, 1.0]), np.asarray([np.inf, 1.0], np.float32))
    assert float32_array([1, 2]).tolist() == [1.0, 2.0]
    assert float32_array(None).shape == ()


def test_the_vector_cache_returns_the_stored_vectors_and_stays_bounded(kb: Retriever) -> None:
    """What MMR reads through the cache equals what the engine holds; a second read of the
    same ids costs no engine call; the cache holds at most `size` vectors; a missing id (the
    version changed under the reader) is an error, not a shorter list."""
    name = kb.store.resolve("kb")
    ids = [h.chunk_id for h in kb.search("apples orchard", k=6, mode="dense")]
    assert len(ids) == 6
    stored = {
        r.id: r.dense for r in kb.store.retrieve(name, ids, with_dense=True) if r.dense is not None
    }
    reads: list[list[str]] = []

    def read(version: str, wanted: list[str]) -> dict[str, np.ndarray]:
        reads.append(wanted)
        found = kb.store.retrieve(version, wanted, with_dense=True, with_payload=False)
        return {r.id: r.dense for r in found if r.dense is not None}

    cache = BoundedReads(read, size=4)
    first = cache.get(name, ids)
    assert set(first) == set(ids) and reads == [ids]
    assert all(np.array_equal(first[i], stored[i]) for i in ids)
    again = cache.get(name, ids[-4:])
    assert reads == [ids] and all(np.array_equal(again[i], stored[i]) for i in ids[-4:])
    cache.get(name, ids[:1])  # evicted by the bound: read again
    assert reads[-1] == ids[:1]
    with pytest.raises(CollectionNotFound, match="changed while it was read"):
        cache.get(name, [str(uuid.uuid4())])
    # MMR reads through the retriever's cache: the same diverse search again reads nothing
    kb.vector_cache, reads[:] = BoundedReads(read, size=100), []
    first_hits = kb.retrieve("apples orchard", k=3, mode="hybrid", diversity=0.5).hits
    again_hits = kb.retrieve("apples orchard", k=3, mode="hybrid", diversity=0.5).hits
    assert len(reads) == 1 and [h.chunk_id for h in first_hits] == [h.chunk_id for h in again_hits]
