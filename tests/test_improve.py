"""`rag-retriever improve`: steps kept only when they help on held-out questions, a gated
promotion, and a run that resumes where it stopped. Tiny models, a real collection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from rag_retriever.cli import main
from rag_retriever.errors import ConfigError, InvalidRequest
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


def _improve(questions: Path, steps: str, folds: int = 1) -> list[str]:
    return ["improve", "--collection", "kb", "--questions", str(questions), "--steps", steps,
            "--folds", str(folds), "--no-progress"]  # fmt: skip


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


def test_a_run_stopped_while_a_fusion_is_judged_restores_the_one_before_it(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after the fusion step wrote its fit into the candidate's record and before the
    judgement (minutes), a resumed run took that unjudged fit as the fusion to restore: a fit
    judged worse stayed in the version (and was promoted with any other step kept)."""
    _ingest(tmp_path)
    questions = _questions(tmp_path, filler=False)  # nothing helps: the fit is dropped
    args = _improve(questions, "fusion")
    evaluate = improve.Improve._evaluate
    stopped: list[str] = []

    def stop_while_judging(self: improve.Improve, name: str, **kw: object) -> dict:
        fusion = self.store.record(name).fusion
        if fusion and "tuning" in fusion and not stopped:
            stopped.append(name)
            raise KeyboardInterrupt
        return evaluate(self, name, **kw)  # type: ignore[arg-type]

    def stop_at_the_gate(self: improve.Improve) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(improve.Improve, "_evaluate", stop_while_judging)
    monkeypatch.setattr(improve.Improve, "_gate", stop_at_the_gate)
    assert main(args) == 130 and stopped  # stopped judging the fit
    assert main(args) == 130  # resumed, judged (dropped), stopped at the gate
    store = EdgeStore(env / "edge")
    try:
        assert store.record(stopped[0]).fusion is None  # the fit judged worse is gone
    finally:
        store.close()
    state = json.loads((env / "improve" / "kb" / "state.json").read_text())
    assert not state["results"]["fusion"]["kept"]
    assert state["before_step"] == {"fusion": None}


def test_an_improve_does_not_promote_over_a_write_made_during_its_run(
    env: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The candidate is built from the live version's documents: an update that lands during
    the run (hours on real data) would be dropped from serving by the promotion (found by a
    review). The gate now promotes only while the alias still serves what the run started
    from, under the alias's lock; else it says so and keeps the candidate unpromoted."""
    _ingest(tmp_path)
    live = _served(env)
    questions = _questions(tmp_path, filler=True)
    change = write_jsonl(tmp_path / "change.jsonl", [{"id": "late", "text": "written meanwhile"}])
    real_gate = improve.Improve._gate

    def gate_after_a_write(self: improve.Improve) -> dict:
        assert main(["update", "--collection", "kb", "--upsert", str(change)]) == 0
        return real_gate(self)

    monkeypatch.setattr(improve.Improve, "_gate", gate_after_a_write)
    assert main(_improve(questions, "fusion")) == 0
    out = capsys.readouterr().out
    written = _served(env)
    assert written != live and f"not promoted: kb moved from {live} to {written}" in out
    store = EdgeStore(env / "edge")
    try:
        assert "late" in {str(r.payload["doc_id"]) for r in store.scroll(written)}
    finally:
        store.close()


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

    from rag_retriever.query.querylog import QueryLog
    from rag_retriever.query.retriever import Retriever
    from rag_retriever.service.server import create_app

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


# -- k-fold decisions (issue 21, item 7) -------------------------------------------------------


@given(
    docs=st.lists(st.integers(min_value=0, max_value=30), min_size=6, max_size=80),
    k=st.integers(min_value=2, max_value=5),
    seed=st.integers(min_value=0, max_value=3),
)
@hypothesis_settings(max_examples=60, deadline=None)
def test_folds_split_by_document_and_stay_even(docs: list[int], k: int, seed: int) -> None:
    from rag_retriever.eval.questions import Question
    from rag_retriever.training.folds import folds_by_document

    questions = [Question(f"q{i}", "x", (f"d{d}",), (), (), i) for i, d in enumerate(docs)]
    if len(set(docs)) < k:
        with pytest.raises(InvalidRequest, match="one document per fold"):
            folds_by_document(questions, k, seed=seed)
        return
    folds = folds_by_document(questions, k, seed=seed)
    assert len(folds) == k and all(folds)
    assert sorted(q.id for f in folds for q in f) == sorted(q.id for q in questions)
    doc_sets = [{q.gold_doc_ids[0] for q in f} for f in folds]
    assert all(not (a & b) for i, a in enumerate(doc_sets) for b in doc_sets[i + 1 :])
    # each group went to the smallest fold: sizes differ by at most the largest group
    largest = max(docs.count(d) for d in set(docs))
    assert max(map(len, folds)) - min(map(len, folds)) <= largest


def test_folds_are_chosen_by_question_count_and_checked(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rag_retriever.training.improve_kfold import KFoldImprove
    from rag_retriever.training.improver import KFOLDS_DEFAULT, improver

    _ingest(tmp_path)
    questions = _questions(tmp_path, filler=True)

    def made(**options: object) -> improve.Improve:
        return improver(
            Settings.from_env(collection="kb"),
            questions,
            work_dir=tmp_path / "work",
            options=improve.ImproveOptions(progress=False, **options),  # type: ignore[arg-type]
        )

    auto = made()  # 120 questions: fewer than KFOLD_BELOW
    assert isinstance(auto, KFoldImprove) and auto.options.folds == KFOLDS_DEFAULT
    one = made(folds=1)
    assert type(one) is improve.Improve
    assert type(made(folds=1, held_out=0.2)) is improve.Improve
    with pytest.raises(ConfigError, match="add --folds 1 to split instead"):
        made(held_out=0.2)  # ignored with k folds: said, not silently dropped
    capsys.readouterr()
    assert main(_improve(questions, "fusion", folds=11)) == 2
    assert "--folds takes 1 (one held-out part) to 10" in capsys.readouterr().err


def test_k_fold_decisions_judge_each_step_out_of_fold_and_refit_on_everything(
    env: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rag_retriever.training import improve_kfold

    _ingest(tmp_path)
    live = _served(env)
    questions = _questions(tmp_path, filler=True)
    trained: list[tuple[str, set[str]]] = []  # (model dir name, questions it trained on)
    train = improve_kfold.KFoldImprove._train_embedder
    stopped: list[bool] = []

    def recording(self: improve_kfold.KFoldImprove, path: Path, out: Path, *a: object) -> dict:
        trained.append((out.name, {json.loads(line)["id"] for line in path.open()}))
        if len(trained) == 2 and not stopped:
            stopped.append(True)
            raise KeyboardInterrupt  # stopped while training the second fold's model
        return train(self, path, out, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(improve_kfold.KFoldImprove, "_train_embedder", recording)
    args = _improve(questions, "embedder,fusion,reranker", folds=3)
    assert main(args) == 130
    assert _served(env) == live
    work = env / "improve" / "kb"
    assert (work / "lists_embedder_fold0.json").is_file()
    capsys.readouterr()

    assert main(args) == 0  # resumes: fold 0's lists are not made again
    out = capsys.readouterr().out
    assert [name for name, _ in trained] == [
        "embedder-fold0", "embedder-fold1", "embedder-fold1", "embedder-fold2"
    ] + (["embedder"] if "kept, retrained on all 120" in out else [])  # fmt: skip
    folds = [
        {json.loads(line)["id"]: json.loads(line)["gold_doc_ids"][0] for line in
         (work / f"questions_fold{i}.jsonl").open()}
        for i in range(3)
    ]  # fmt: skip
    assert sum(map(len, folds)) == 120
    for i, fold in enumerate(folds):
        # fold i's model never saw fold i's questions, nor any question on their documents
        seen = next(ids for name, ids in trained if name == f"embedder-fold{i}")
        assert not seen & set(fold)
        assert len(seen) == 120 - len(fold)
        lists = json.loads((work / f"lists_embedder_fold{i}.json").read_text())
        assert set(lists) == set(fold)
    state = json.loads((work / "state.json").read_text())
    results = state["results"]
    assert state["split"]["folds"] == [len(f) for f in folds]
    assert results["baseline"]["figures"]["questions"] == 120  # every question judges
    embedder = results["embedder"]
    assert embedder["folds"]["after"]["questions"] == 120
    # the pooled figures of the cached live lists are eval/recall_at_k's on the live version
    for metric in ("mrr@10", "recall@1", "recall@10"):
        assert embedder["folds"]["before"][metric] == pytest.approx(
            results["baseline"]["figures"][metric],
            abs=5e-5,  # the summary's rounding
        )
    if embedder["kept"]:
        assert trained[-1] == ("embedder", set().union(*folds))  # refitted on every question
    # the scratch versions of the folds are gone: the live one and the new one are left
    versions = {p.name for p in (env / "edge" / "collections").iterdir()}
    assert live in versions and len(versions) <= 2
    assert not list((env / "models").rglob("embedder-fold*"))
    fusion = results["fusion"]
    assert len(fusion["fold_choices"]) == 3 and "3 folds" in fusion["fitted_on"]
    gate = results["gate"]
    assert gate["promoted"] == (_served(env) != live)
    if gate["promoted"]:
        assert gate["new"]["mrr@10"] > gate["live"]["mrr@10"]
    # a new run (other folds) never reads the lists an earlier run saved: they are removed
    assert main(_improve(questions, "fusion", folds=2)) == 0
    assert not (work / "lists_embedder_fold0.json").exists()
    assert set(json.loads((work / "lists_live.json").read_text())) == set().union(*folds)


def test_a_kept_embedder_is_retrained_on_every_question_and_builds_the_version(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rag_retriever.training import improve_kfold

    _ingest(tmp_path)
    live = _served(env)
    monkeypatch.setattr(improve_kfold, "_better", lambda after, before: True)  # keep it
    assert main(_improve(_questions(tmp_path, filler=True), "embedder", folds=2)) == 0
    state = json.loads((env / "improve" / "kb" / "state.json").read_text())
    embedder = state["results"]["embedder"]
    assert embedder["kept"] and "retrained on all 120 questions" in embedder["summary"]
    record = json.loads((Path(embedder["model"]) / "rag_training.json").read_text())
    assert sum(record["examples"][part] for part in ("train", "validation")) == 120
    new = state["results"]["candidate"]["version"]
    assert (
        new != live
        and "embedder retrained on every question" in (state["results"]["candidate"]["summary"])
    )
    # promoted or kept unpromoted (the gate judges the real out-of-fold figures), it names it
    meta = json.loads((env / "edge" / "collections" / new / "meta.json").read_text())
    assert Path(meta["model_source"]) == Path(embedder["model"])


def test_k_fold_decisions_are_not_taken_for_a_version_that_serves_a_reranker(
    env: Path, tmp_path: Path, tiny_reranker_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """k-fold figures fuse first-stage lists: a live version that serves a reranker was judged
    reranked against them, and its reranker went to the candidate unjudged."""
    import dataclasses

    from rag_retriever.training.improver import improver

    _ingest(tmp_path)
    store = EdgeStore(env / "edge")
    name = store.resolve("kb")
    reranker = {"source": str(tiny_reranker_dir), "trained_by": "improve"}
    store.put_record(name, dataclasses.replace(store.record(name), reranker=reranker))
    store.close()
    questions = _questions(tmp_path, filler=False)  # 120: k-fold by default
    assert main(_improve(questions, "fusion", folds=3)) == 2
    assert "which k-fold decisions cannot judge" in capsys.readouterr().err
    said: list[str] = []
    run = improver(
        Settings.from_env(collection="kb"),
        questions,
        work_dir=tmp_path / "work",
        options=improve.ImproveOptions(steps=("fusion",)),
        say=said.append,
    )
    assert type(run) is improve.Improve and run.options.folds == 1
    assert any("serves a reranker" in line for line in said)
