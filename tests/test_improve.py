"""`rag-retriever improve`: steps kept only when they help on held-out questions, a gated
promotion, and a run that resumes where it stopped. Tiny models, a real collection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_retriever.cli import main
from rag_retriever.settings import Settings
from rag_retriever.store import EdgeStore
from rag_retriever.training import improve
from tests.conftest import write_jsonl

UNIQUE = [f"{a}{b}" for a in "bcdfgklmnp" for b in "aeiou"][:40]  # 40 made-up words
FILLER = "the king and the queen of the city in a story about the river"


def _corpus(tmp_path: Path) -> Path:
    rows: list[dict[str, object]] = [
        {"id": f"d{i}", "title": f"Note {i}", "text": f"{FILLER}. This one is about {word}."}
        for i, word in enumerate(UNIQUE)
    ]
    return write_jsonl(tmp_path / "docs.jsonl", rows)


def _questions(tmp_path: Path, *, filler: bool) -> Path:
    """Three questions a document, each naming its unique word (with or without the filler
    words every document shares)."""
    rows: list[dict[str, object]] = []
    templates = ("{w}", "about {w}", "{w} story") if filler else ("{w}", "{w}?", "{w} {w}")
    for i, word in enumerate(UNIQUE):
        for j, template in enumerate(templates):
            text = template.format(w=word) + (f" {FILLER}" if filler else "")
            rows.append({"id": f"q{i}-{j}", "question": text, "gold_doc_ids": [f"d{i}"]})
    return write_jsonl(tmp_path / f"questions-{filler}.jsonl", rows)


@pytest.fixture(autouse=True)
def _rrf_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """RRF k=60 as the untuned fusion: it lets the tiny encoder's noise in, so the fusion step
    has a loss to fix (the adaptive default already ranks each unique word's document first)."""
    monkeypatch.setenv("RAG_FUSION", "rrf")


def _ingest(tmp_path: Path) -> None:
    assert main(["ingest", str(_corpus(tmp_path)), "--collection", "kb", "--no-progress"]) == 0


def _improve(questions: Path, steps: str) -> list[str]:
    return ["improve", "--collection", "kb", "--questions", str(questions), "--steps", steps,
            "--no-progress"]  # fmt: skip


def _served(env: Path) -> str:
    store = EdgeStore(env / "edge")
    try:
        return store.resolve("kb")
    finally:
        store.close()


def test_nothing_is_promoted_when_nothing_helps(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One matching word a question: BM25 finds exactly the gold document, so the default
    # fusion already ranks it first; no fusion can do better on the held-out part.
    _ingest(tmp_path)
    live = _served(env)
    questions = _questions(tmp_path, filler=False)
    assert main(_improve(questions, "fusion")) == 0
    out = capsys.readouterr().out
    assert "not promoted (no step helped)" in out
    assert _served(env) == live
    assert [p.name for p in (env / "edge" / "collections").iterdir()] == [live]


def test_a_helpful_fusion_is_promoted_and_a_run_resumes(
    env: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _ingest(tmp_path)
    live = _served(env)
    questions = _questions(tmp_path, filler=True)
    args = _improve(questions, "embedder,fusion,reranker")

    def stop(self: improve.Improve) -> dict:
        raise KeyboardInterrupt

    reranker_step = improve.Improve._reranker
    monkeypatch.setattr(improve.Improve, "_reranker", stop)
    assert main(args) == 130  # stopped during the reranker step
    assert _served(env) == live  # the live version served throughout
    state = json.loads((env / "improve" / "kb" / "state.json").read_text())
    assert set(state["results"]) == {"baseline", "embedder", "candidate", "fusion"}
    capsys.readouterr()

    monkeypatch.setattr(improve.Improve, "_reranker", reranker_step)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fusion     done in an earlier run (resumed)" in out
    fusion = state["results"]["fusion"]
    assert fusion["kept"], fusion["summary"]
    new = _served(env)
    assert new != live and "promoted: kb ->" in out
    meta = json.loads((env / "edge" / "collections" / new / "meta.json").read_text())
    assert meta["fusion"]["method"] in ("rrf", "dbsf", "minmax", "zscore", "adaptive")
    reranker = json.loads((env / "improve" / "kb" / "state.json").read_text())["results"][
        "reranker"
    ]
    # a reranker is named by the version only when it helped
    assert (meta["reranker"] is not None) == reranker["kept"]
    assert "baseline" in out and "gate" in out  # the before -> after table
    # three parts, no gold document in two; the fusion was fitted on questions the new
    # embedder never trained on
    docs = {
        part: {
            json.loads(line)["gold_doc_ids"][0]
            for line in (env / "improve" / "kb" / f"questions_{part}.jsonl").open()
        }
        for part in ("train", "fusion", "held_out")
    }
    assert all(docs.values())
    assert not (docs["train"] & docs["fusion"] or docs["train"] & docs["held_out"])
    assert not docs["fusion"] & docs["held_out"]
    embedder_kept = state["results"]["embedder"]["kept"]
    assert fusion["fitted_on"].endswith("(fusion part)" if embedder_kept else "fusion parts)")


@pytest.mark.parametrize(("fusion_part", "fitted_on"), [(0.2, "fusion part"), (0.05, "fewer than")])
def test_a_new_embedder_s_fusion_is_fitted_on_questions_it_never_trained_on(
    env: Path, tmp_path: Path, fusion_part: float, fitted_on: str
) -> None:
    _ingest(tmp_path)
    run = improve.Improve(
        Settings.from_env(collection="kb"),
        _questions(tmp_path, filler=True),
        work_dir=tmp_path / "work",
        options=improve.ImproveOptions(fusion_part=fusion_part, progress=False),
        say=lambda line: None,
    )
    run._start()
    split = run.state["split"]
    assert sum(split.values()) == 120 and split["fusion"] >= 3  # whole documents of 3
    run.state["results"]["embedder"] = {"kept": True}
    questions, which = run._fusion_questions()
    assert fitted_on in which
    # the fusion part alone when it is big enough to fit on, else with the training part
    expected = split["fusion"] if fitted_on == "fusion part" else split["fusion"] + split["train"]
    assert len(questions) == expected
    run.state["results"]["embedder"] = {"kept": False}  # the live model saw none of them
    assert len(run._fusion_questions()[0]) == split["fusion"] + split["train"]


def test_the_loop_serve_query_feedback_export_improve_answers_better(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 19's loop, end to end: a served collection with a query log, users' questions and
    their feedback over HTTP, `questions --from-log`, `improve` on the exported questions, and
    the promoted version ranks the judged documents higher on those questions."""
    from fastapi.testclient import TestClient

    from rag_retriever.querylog import QueryLog
    from rag_retriever.retriever import Retriever
    from rag_retriever.server import create_app

    _ingest(tmp_path)
    live = _served(env)
    settings = Settings.from_env(collection="kb")
    retriever = Retriever.from_settings(settings)
    retriever.query_log = QueryLog(tmp_path / "log")
    asked = [json.loads(line) for line in _questions(tmp_path, filler=True).open()]
    with TestClient(create_app(retriever, settings)) as http:
        for q in asked:
            body = http.post("/v1/search", json={"query": q["question"], "k": 10}).json()
            gold = q["gold_doc_ids"][0]
            if any(h["doc_id"] == gold for h in body["hits"]):  # users judge what they saw
                sent = http.post(
                    "/v1/feedback",
                    json={"query_id": body["query_id"], "doc_id": gold, "relevant": True},
                )
                assert sent.status_code == 200, sent.text
    retriever.query_log.close()
    retriever.store.close()
    exported = tmp_path / "exported.jsonl"
    assert main(["questions", "--from-log", str(tmp_path / "log"), "--out", str(exported)]) == 0
    made = [json.loads(line) for line in exported.open()]
    assert len(made) >= 100  # most documents were found in the top 10 and judged
    capsys.readouterr()
    assert main(_improve(exported, "fusion")) == 0
    assert "promoted: kb ->" in capsys.readouterr().out
    new = _served(env)
    assert new != live

    def first_hits(name: str) -> int:
        r = Retriever.from_settings(settings)
        try:
            return sum(
                r.search(q["question"], k=1, mode="hybrid", collection=name)[0].doc_id
                == q["gold_doc_ids"][0]
                for q in made
            )
        finally:
            r.store.close()

    before, after = first_hits(live), first_hits(new)
    assert after > before
