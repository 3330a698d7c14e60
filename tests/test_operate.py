"""Operating the service: the query log, feedback, questions made from it, /metrics.

Real retriever (tiny encoder, Qdrant Edge), real files; the log is read back as the export reads
it, the questions file as the evaluation reads it, the metrics in the Prometheus text format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rag_retriever.cli import main
from rag_retriever.errors import CollectionNotFound, InvalidRequest
from rag_retriever.eval.questions import load_questions
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.querylog import QueryLog, read_lines
from rag_retriever.query.retriever import Retriever
from rag_retriever.service.server import create_app
from rag_retriever.settings import Settings
from rag_retriever.store import Store
from tests.conftest import collection_retriever
from tests.test_retriever import DOCS


@pytest.fixture
def logged(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> Retriever:
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.query_log = QueryLog(tmp_path / "log")
    return retriever


def test_each_query_is_logged_with_its_id_off_the_request_path(
    logged: Retriever, tmp_path: Path
) -> None:
    result = logged.retrieve("the king and the queen", k=3, mode="hybrid")
    assert result.query_id and len(result.query_id) == 32
    assert logged.query_log is not None
    logged.query_log.flush()
    [line] = list(read_lines([tmp_path / "log"], "queries"))
    assert line["query_id"] == result.query_id and line["query"] == "the king and the queen"
    assert line["collection"] == result.collection and line["alias"] == "kb" and line["k"] == 3
    assert [h["chunk_id"] for h in line["hits"]] == [h.chunk_id for h in result.hits]
    first = result.hits[0]
    assert line["hits"][0]["fused_rank"] == first.fused.rank if first.fused else True
    assert line["hits"][0]["start"] == first.start and line["hits"][0]["doc_id"] == first.doc_id
    text = (tmp_path / "log").glob("queries-*.jsonl").__next__().read_text()
    assert "api_key" not in text.lower()


def test_without_text_only_the_query_hash_is_kept(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.query_log = QueryLog(tmp_path / "log", keep_text=False)
    retriever.retrieve("secret question about wine")
    retriever.query_log.flush()
    [line] = list(read_lines([tmp_path / "log"], "queries"))
    assert "query" not in line and len(line["query_sha256"]) == 64
    assert "secret" not in (next((tmp_path / "log").glob("*.jsonl"))).read_text()


def test_an_unwritable_log_never_stops_a_query(
    store: Store, tiny_encoder: Encoder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log directory should be")
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    retriever.query_log = QueryLog(blocker / "log")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert retriever.search("river")
        retriever.query_log.flush()
    assert retriever.query_log.dropped == 3 and retriever.query_log.written == 0
    assert sum("cannot be written" in r.message for r in caplog.records) == 1  # one warning


def test_files_rotate_by_size_and_the_total_is_bounded(logged: Retriever, tmp_path: Path) -> None:
    assert logged.query_log is not None
    logged.query_log.max_file_bytes = 5_000
    logged.query_log.max_total_bytes = 15_000
    for i in range(60):
        logged.retrieve(f"river city {i}")
    logged.query_log.flush()
    files = list((tmp_path / "log").glob("queries-*.jsonl"))
    line = max(len(x) for f in files for x in f.read_text().splitlines()) + 1
    assert len(files) > 1
    # closed files within the bound, plus the open one (a file closes past its size)
    assert sum(f.stat().st_size for f in files) <= 15_000 + 5_000 + line
    written = sum(len(f.read_text().splitlines()) for f in files)
    assert written < 60 and logged.query_log.written == 60  # the oldest were deleted


def test_feedback_checks_what_the_query_returned(logged: Retriever, tmp_path: Path) -> None:
    assert logged.query_log is not None
    result = logged.retrieve("apples", k=2)
    with pytest.raises(CollectionNotFound, match="no logged query"):
        logged.query_log.feedback("nope", chunk_id=result.hits[0].chunk_id, relevant=True)
    with pytest.raises(CollectionNotFound, match="did not return chunk"):
        logged.query_log.feedback(result.query_id or "", chunk_id="other", relevant=True)
    with pytest.raises(InvalidRequest, match="exactly one"):
        logged.query_log.feedback(result.query_id or "", relevant=True)
    logged.query_log.feedback(
        result.query_id or "", chunk_id=result.hits[0].chunk_id, relevant=True
    )
    logged.query_log.flush()
    [fb] = list(read_lines([tmp_path / "log"], "feedback"))
    assert fb["chunk_id"] == result.hits[0].chunk_id and fb["relevant"] is True


def test_the_loop_serve_query_feedback_export_evaluate(
    logged: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over HTTP: queries, feedback, `questions --from-log`, and the file loads as the
    evaluation's questions with the judged chunk as gold."""
    settings = Settings(data_dir=tmp_path)
    other_log = QueryLog(tmp_path / "log")  # a second serving process writing the same directory
    with TestClient(create_app(logged, settings)) as http:
        answers = [
            http.post("/v1/search", json={"query": q, "k": 3}).json()
            for q in ("the king and the queen", "The King and  the Queen", "wine of the city")
        ]
        good = answers[0]["hits"][1]
        ok = http.post(
            "/v1/feedback",
            json={
                "query_id": answers[0]["query_id"],
                "chunk_id": good["chunk_id"],
                "relevant": True,
            },
        )
        assert ok.status_code == 200, ok.text
        same = answers[1]["hits"][0]
        http.post(
            "/v1/feedback",
            json={
                "query_id": answers[1]["query_id"],
                "chunk_id": same["chunk_id"],
                "relevant": True,
            },
        )
        http.post(
            "/v1/feedback",
            json={
                "query_id": answers[2]["query_id"],
                "doc_id": answers[2]["hits"][0]["doc_id"],
                "relevant": False,
            },
        )
        unknown = http.post(
            "/v1/feedback", json={"query_id": "x", "chunk_id": "y", "relevant": True}
        )
        assert unknown.status_code == 404 and "no logged query" in unknown.json()["detail"]
        bad = http.post("/v1/feedback", json={"query_id": "x", "relevant": "yes"})
        assert bad.status_code == 422
    assert logged.query_log is not None
    logged.query_log.flush()
    other_log.close()
    out = tmp_path / "questions.jsonl"
    assert main(["questions", "--from-log", str(tmp_path / "log"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "questions      1 written" in printed and "1 repeats merged" in printed
    assert "1 with only negative feedback" in printed
    questions, problems = load_questions(out)
    assert problems == [] and len(questions) == 1
    [q] = questions
    assert q.question == "the king and the queen"
    spans = {(s.doc_id, s.start, s.end) for s in q.gold_spans}
    assert (good["doc_id"], good["start"], good["end"]) in spans
    assert (same["doc_id"], same["start"], same["end"]) in spans


def test_feedback_without_a_query_log_is_404_with_the_fix(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    retriever = collection_retriever(DOCS, store, tiny_encoder)
    with TestClient(create_app(retriever, Settings(data_dir=tmp_path))) as http:
        r = http.post("/v1/feedback", json={"query_id": "a", "chunk_id": "b", "relevant": True})
    assert r.status_code == 404 and "RAG_QUERY_LOG" in r.json()["detail"]


def test_metrics_in_the_prometheus_format_behind_the_read_key(
    logged: Retriever, tmp_path: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    settings = Settings(data_dir=tmp_path, api_key="k")
    key = {"Authorization": "Bearer k"}
    with TestClient(create_app(logged, settings)) as http:
        http.post("/v1/search", json={"query": "apples", "mode": "hybrid"}, headers=key)
        http.post("/v1/search", json={"query": "apples", "k": 1000}, headers=key)  # a 422
        http.post("/v1/search", json={"query": "apples"})  # a 401
        assert http.get("/metrics").status_code == 401
        text = http.get("/metrics", headers=key).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("rag_requests_total", route="/v1/search", method="POST", status="200") == 1
    assert value("rag_requests_total", route="/v1/search", method="POST", status="422") == 1
    assert value("rag_requests_total", route="unmatched", method="POST", status="401") == 1
    assert value("rag_queries_total", mode="hybrid") == 1
    assert value("rag_stage_duration_seconds_count", stage="encode") == 1
    assert value("rag_stage_duration_seconds_count", stage="total") == 1
    assert value("rag_served_version", alias="kb") == 1
    assert value("rag_served_version_age_seconds", alias="kb") >= 0
    assert value("rag_query_log_lines_total") >= 0
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert "apples" not in text  # never the query text


def test_both_clients_return_the_query_id_and_send_feedback(
    logged: Retriever, tmp_path: Path
) -> None:
    import asyncio

    from rag_retriever.client import AsyncRetrieverClient, NotFound, RetrieverClient
    from rag_retriever.langchain import result_to_documents
    from rag_retriever.service.server import serve_in_thread

    with serve_in_thread(create_app(logged, Settings(data_dir=tmp_path))) as url:
        with RetrieverClient(url) as client:
            result = client.retrieve("river city", k=2)
            assert result.query_id
            assert result_to_documents(result)[0].metadata["query_id"] == result.query_id
            sent = client.feedback(result.query_id, chunk_id=result.hits[0].chunk_id, relevant=True)
            assert sent["status"] == "recorded"
            with pytest.raises(CollectionNotFound):  # a NotFound too: one except for both APIs
                client.feedback("unknown", doc_id="a", relevant=False)
            with pytest.raises(NotFound):
                client.feedback("unknown", doc_id="a", relevant=False)

        async def run() -> str:
            async with AsyncRetrieverClient(url) as client:
                found = await client.retrieve("wine", k=1)
                assert found.query_id
                done = await client.feedback(
                    found.query_id, doc_id=found.hits[0].doc_id, relevant=True
                )
                return str(done["status"])

        assert asyncio.run(run()) == "recorded"


def test_doctor_finds_duplicates_and_boilerplate_and_exits_1(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import write_jsonl

    footer = "Copyright the example company. All rights reserved. Terms apply to every page."
    rows: list[dict[str, object]] = [
        {"id": f"d{i}", "title": f"Doc {i}", "text": f"The river {i} runs to the city.\n\n{footer}"}
        for i in range(6)
    ]
    rows += [
        {"id": "twin-a", "title": "Twin", "text": "Apples and pears grow in the valley."},
        {"id": "twin-b", "title": "Twin", "text": "Apples and pears grow in the valley."},
    ]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    capsys.readouterr()
    code = main(["doctor", "--collection", "kb", "--json"])
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 1 and not report["ok"]
    assert checks["boilerplate"]["figures"]["texts"] >= 1 and not checks["boilerplate"]["ok"]
    dup = checks["near-duplicates"]["figures"]
    assert dup["count"] >= 2 and not checks["near-duplicates"]["ok"]  # the twins find each other
    floor = checks["noise floor"]["figures"]
    assert -1 <= floor["mean"] <= floor["p95"] <= floor["p99"] <= 1
    assert checks["truncation"]["ok"]
    # lenient thresholds: it passes, exit 0, a readable table
    lenient = ["--max-duplicate-share", "1", "--max-boilerplate-share", "1"]
    assert main(["doctor", "--collection", "kb", *lenient]) == 0
    assert "ok    near-duplicates" in capsys.readouterr().out


def test_doctor_reads_the_query_log_for_drift_and_stage_health(
    logged: Retriever, tmp_path: Path
) -> None:
    from rag_retriever.ops.doctor import Doctor, Thresholds

    for q in ["the king", "wine", "apples", "river mountain", "peace", "queen", "city", "war"]:
        logged.retrieve(q, k=3)
    assert logged.query_log is not None
    logged.query_log.flush()
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"id": "1", "question": "the king and the queen", "gold_doc_ids": ["x"]}) + "\n"
    )
    checks = {
        c.name: c
        for c in Doctor(logged, collection="kb", thresholds=Thresholds()).run(
            log=[tmp_path / "log"], questions=questions
        )
    }
    assert checks["drift"].figures["queries"] == 8
    assert 0 <= checks["drift"].figures["far_share_newest"] <= 1
    health = checks["stage health"].figures
    assert health["queries"] == 8 and health["empty_share"] == 0
    assert health["top_hit_dense_first"] + health["top_hit_bm25_first"] > 0
