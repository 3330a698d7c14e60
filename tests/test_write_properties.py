"""A property of the HTTP writes (issue 39): whatever documents a client sends, either the version
seals and serves them exactly, or the answer is a 4xx and nothing is written (the alias, every
version and every file of the data dir as they were). Never a 5xx.

Documents of random shape are generated clean (valid Unicode, finite numbers, metadata within
the bounds) or with one defect put in at a random place (a lone surrogate in the text, the id, a
metadata key or value; NaN or ±Infinity; nesting past MAX_METADATA_DEPTH; an integer past
MAX_EXACT_INT): clean ones must be accepted, defective ones refused. Runs on Qdrant Edge (where a
seal once failed on deep metadata) with the tiny encoder; a few dozen examples.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rag_retriever.ingest.validation import MAX_METADATA_DEPTH
from rag_retriever.models.encoder import Encoder
from rag_retriever.records import MAX_EXACT_INT
from rag_retriever.store import EdgeStore
from tests.test_write_api import UPSERT, data_dir_state, edge_app, nested, send

# Characters of every kind but surrogates (hypothesis's text() leaves those out); one always a
# letter so that a text or id is never blank.
TEXT = st.builds(lambda word, rest: word + rest, st.sampled_from("ab"), st.text(max_size=12))
KEYS = st.text(max_size=6).filter(lambda k: k and '"' not in k and "\\" not in k)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_EXACT_INT, max_value=MAX_EXACT_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
# Metadata values of random shape, at most 4 levels deep (well within the bound).
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
METADATA = st.dictionaries(KEYS, VALUES, max_size=4)
DEFECTS = {
    "surrogate in the text": lambda doc, _: {**doc, "text": doc["text"] + "\ud800"},
    "surrogate in the id": lambda doc, _: {**doc, "id": "\udfff" + doc["id"]},
    "surrogate in a metadata key": lambda doc, at: _put(doc, at, {"\udc80": 1}),
    "surrogate in a metadata value": lambda doc, at: _put(doc, at, "x\ud801"),
    "NaN": lambda doc, at: _put(doc, at, math.nan),
    "Infinity": lambda doc, at: _put(doc, at, -math.inf),
    "nesting past the bound": lambda doc, at: _put(doc, at, nested(MAX_METADATA_DEPTH)),
    "an integer past 2**53": lambda doc, at: _put(doc, at, MAX_EXACT_INT + 1),
}


def _put(doc: dict[str, Any], at: int, value: object) -> dict[str, Any]:
    """`doc` with `value` put into its metadata: at the top, or inside its `at`-th container."""
    metadata = json.loads(json.dumps(doc["metadata"]))  # a deep copy
    containers: list[Any] = [metadata]
    stack = [metadata]
    while stack:
        node = stack.pop()
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                containers.append(child)
                stack.append(child)
    target = containers[at % len(containers)]
    if isinstance(target, dict):
        target["defect"] = value
    else:
        target.append(value)
    return {**doc, "metadata": metadata}


def same_json(served: object, sent: object) -> bool:
    """Equal, but a float may come back 1 ulp off: Qdrant Edge 0.9 parses payload floats
    without exact round-tripping (about 1 in 6 random floats; reported in issue 39's PR)."""
    if isinstance(sent, float) and isinstance(served, float | int):
        return math.isclose(served, sent, rel_tol=4e-16, abs_tol=0.0) or served == sent
    if isinstance(sent, dict) and isinstance(served, dict):
        return served.keys() == sent.keys() and all(same_json(served[k], sent[k]) for k in sent)
    if isinstance(sent, list) and isinstance(served, list):
        return len(served) == len(sent) and all(map(same_json, served, sent))
    return type(served) is type(sent) and served == sent


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[dict[str, Any]], str | None]:
    """1-3 documents with distinct ids (not the served ones), and the defect of one, if any."""
    n = draw(st.integers(1, 3))
    ids = draw(st.lists(TEXT, min_size=n, max_size=n, unique_by=str.strip))
    docs = [
        {
            "id": f"p-{i}",
            "title": draw(st.none() | st.text(max_size=8)),
            "text": draw(TEXT),
            "metadata": draw(METADATA),
        }
        for i in ids
    ]
    defect = draw(st.none() | st.sampled_from(sorted(DEFECTS)))
    if defect is not None:
        which = draw(st.integers(0, n - 1))
        docs[which] = DEFECTS[defect](docs[which], draw(st.integers(0, 10)))
    return docs, defect


@pytest.fixture(scope="module")
def service(
    tiny_encoder: Encoder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestClient, EdgeStore, Path]]:
    root = tmp_path_factory.mktemp("writes")
    app, store = edge_app(root, tiny_encoder, compaction="inline", retention_grace_s=0)
    with TestClient(app) as http:
        yield http, store, root / "edge"
    store.close()


@given(request=requests())
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same cases on every run: CI cannot flake
    phases=[Phase.explicit, Phase.generate],  # each case is a sealed version: no long shrink
    suppress_health_check=list(HealthCheck),
)
def test_a_write_is_served_exactly_or_refused_with_nothing_written(
    service: tuple[TestClient, EdgeStore, Path], request: tuple[list[dict[str, Any]], str | None]
) -> None:
    http, store, data = service
    docs, defect = request
    before = data_dir_state(store, data)
    r = send(http, UPSERT, {"documents": docs})
    if defect is not None:
        assert r.status_code == 422, (defect, r.text[:300])
        assert data_dir_state(store, data) == before, defect
        return
    assert r.status_code == 200, r.text[:500]
    assert r.json()["collection"] == store.aliases()["kb"]  # sealed and serving
    chunks: dict[str, list[Any]] = {}
    for point in store.scroll(store.aliases()["kb"]):
        chunks.setdefault(str(point.payload["doc_id"]), []).append(point.payload)
    for doc in docs:
        assert doc["id"] in chunks, doc  # served: at least one chunk
        for payload in chunks[doc["id"]]:
            assert payload["title"] == (doc["title"] or doc["id"])
            assert same_json(payload["metadata"], json.loads(json.dumps(doc["metadata"])))
            assert doc["text"][payload["start"] : payload["end"]] == payload["text"]
