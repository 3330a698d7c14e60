"""Operating the service: the query log, feedback, questions made from it, /metrics.

Real retriever (tiny encoder, Qdrant Edge), real files; the log is read back as the export reads
it, the questions file as the evaluation reads it, the metrics in the Prometheus text format.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rag_retriever import access
from rag_retriever.access import Scope
from rag_retriever.cli import main
from rag_retriever.errors import InvalidRequest, QueryNotLogged
from rag_retriever.eval.questions import load_questions
from rag_retriever.models.encoder import Encoder
from rag_retriever.query import querylog
from rag_retriever.query.querylog import QueryLog, read_lines, read_queries
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


# A process that logs a query and its feedback, then ends at once without closing its log
# (a script's end, `search`): within the writer's one-second flush, before the fix nothing was
# written.
_ENDS_AT_ONCE = """
import sys
from pathlib import Path
from rag_retriever.query.querylog import QueryLog
from rag_retriever.records import Hit, SearchResult, StageScore
log = QueryLog(Path(sys.argv[1]))
hit = Hit("c1", "d1", "T", "text", 0, 4, 0, rank=1, score=0.5, dense=StageScore(1, 0.5))
log.record(SearchResult("q", "dense", "kb__m__v1", (hit,), {}, query_id="id1"), alias="kb", k=1,
           flt=None)
log.feedback("id1", chunk_id="c1", relevant=True)
"""


def test_a_process_that_ends_writes_its_last_lines_first(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ENDS_AT_ONCE, str(tmp_path / "log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    [query] = list(read_lines([tmp_path / "log"], "queries"))
    [feedback] = list(read_lines([tmp_path / "log"], "feedback"))
    assert query["query_id"] == feedback["query_id"] == "id1"


def test_closing_a_log_twice_is_harmless(tmp_path: Path) -> None:
    log = QueryLog(tmp_path / "log")
    log.close()
    log.close()  # the exit hook closes what is still open; a closed log must not wait on it
    assert not log._thread.is_alive()


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


def test_a_full_disk_drops_lines_but_never_stops_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every file is /dev/full: a file closed at its size fails to close. It stayed among the
    open files, the next write raised ValueError on it and the writer thread died (flush then
    waited its 5 s and answered False, and close could hang on a full queue)."""
    log_ = QueryLog(tmp_path / "log", max_file_bytes=100)

    def full_file(kind: str) -> Any:
        if kind not in log_._files:
            log_._files[kind] = Path("/dev/full").open("ab")  # noqa: SIM115 (the log closes it)
        return log_._files[kind]

    monkeypatch.setattr(log_, "_file", full_file)
    with caplog.at_level(logging.WARNING, logger="rag_retriever.query.querylog"):
        for i in range(20):
            log_._put("queries", {"query_id": f"q{i}", "text": "x" * 60})
        assert log_.flush(timeout=5)
    assert log_._thread.is_alive()
    assert log_.dropped > 0
    assert sum("cannot be written" in r.message for r in caplog.records) == 1
    log_.close()
    assert not log_._thread.is_alive()


def test_rotation_keeps_the_file_another_live_writer_writes(tmp_path: Path) -> None:
    """Another writer's newest file, however old, is not deleted while that writer holds its
    lock (it would write on into a deleted file: lost, its space never freed); a writer whose
    lock nobody holds (it died; a restarted container's earlier run, PID 1 again) loses its
    file and its lock file."""
    import fcntl

    folder = tmp_path / "log"
    folder.mkdir()
    live = folder / "feedback-otherhost-1-abcd1234-1.jsonl"
    gone = folder / "feedback-otherhost-1-dead0000-1.jsonl"
    for old in (live, gone):
        old.write_bytes(b"x" * 4_000)
        os.utime(old, (1, 1))
    stale = folder / ".writer-otherhost-1-dead0000.lock"
    stale.touch()
    with (folder / ".writer-otherhost-1-abcd1234.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another writer, alive
        log_ = QueryLog(folder, max_file_bytes=100, max_total_bytes=1_000)
        log_._put("queries", {"query_id": "q", "text": "y" * 200})
        assert log_.flush()
        assert list(folder.glob(".writer-*-*-*.lock")) != []
        log_.close()
    assert live.exists() and not gone.exists() and not stale.exists()
    assert sorted(p.name for p in folder.glob(".writer-*.lock")) == [
        ".writer-otherhost-1-abcd1234.lock"  # its own lock removed when it closed
    ]


def test_feedback_waits_a_bounded_time_for_another_scan_then_answers_busy(
    logged: Retriever, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Feedback on an id this process does not remember scans the log files, one scan at a
    time: made-up ids each waited for the lock without bound, a worker thread each, until the
    searches queued behind them. Now a short wait, then 429 busy."""
    from rag_retriever.errors import Busy

    assert logged.query_log is not None
    monkeypatch.setattr(querylog, "SCAN_WAIT_S", 0.05)
    unknown = uuid.uuid4().hex
    with querylog._SCAN_LOCK, pytest.raises(Busy, match="retry"):
        logged.query_log.feedback(unknown, chunk_id="c", relevant=True)
    with pytest.raises(QueryNotLogged) as caught:  # the lock free: scanned, not found
        logged.query_log.feedback(unknown, chunk_id="c", relevant=True)
    assert str(tmp_path) not in str(caught.value)  # no server path in an answer
    assert Busy.http_status == 429


def test_feedback_checks_what_the_query_returned(logged: Retriever, tmp_path: Path) -> None:
    assert logged.query_log is not None
    result = logged.retrieve("apples", k=2)
    with pytest.raises(QueryNotLogged, match="no logged query"):
        logged.query_log.feedback("nope", chunk_id=result.hits[0].chunk_id, relevant=True)
    with pytest.raises(QueryNotLogged, match="did not return chunk"):
        logged.query_log.feedback(result.query_id or "", chunk_id="other", relevant=True)
    with pytest.raises(InvalidRequest, match="exactly one"):
        logged.query_log.feedback(result.query_id or "", relevant=True)
    logged.query_log.feedback(
        result.query_id or "", chunk_id=result.hits[0].chunk_id, relevant=True
    )
    logged.query_log.flush()
    [fb] = list(read_lines([tmp_path / "log"], "feedback"))
    assert fb["chunk_id"] == result.hits[0].chunk_id and fb["relevant"] is True


def test_feedback_reaches_any_process_that_shares_the_log_directory(
    logged: Retriever, tmp_path: Path
) -> None:
    """Two `serve` processes behind one load balancer: the feedback on a query of the first
    reaches the second, which checks it against the first's query line (the directory's)."""
    assert logged.query_log is not None
    with access.serving(Scope("alice")):
        result = logged.retrieve("apples", k=2)
        logged.retrieve("the king and the queen", k=2)  # a later line, in the same file
    logged.query_log.flush()
    other = QueryLog(tmp_path / "log")  # the second process: its own memory and files
    query_id, chunk = result.query_id or "", result.hits[0].chunk_id
    try:
        with pytest.raises(QueryNotLogged, match=r"no logged query 'nope'.*may need a retry"):
            other.feedback("nope", chunk_id=chunk, relevant=True)
        # another key's query: as unknown as none
        with access.serving(Scope("mallory")), pytest.raises(QueryNotLogged, match="no logged"):
            other.feedback(query_id, chunk_id=chunk, relevant=True)
        with access.serving(Scope("alice")):
            with pytest.raises(QueryNotLogged, match="did not return chunk"):
                other.feedback(query_id, chunk_id="other", relevant=True)
            other.feedback(query_id, doc_id=result.hits[0].doc_id, relevant=False)
            other.feedback(query_id, chunk_id=chunk, relevant=True)
        other.flush()
    finally:
        other.close()
    judged = [
        (f["query_id"], f["chunk_id"], f["relevant"])
        for f in read_lines([tmp_path / "log"], "feedback")
    ]
    assert judged == [(query_id, None, False), (query_id, chunk, True)]


def test_a_feedback_scan_reads_the_newest_lines_within_its_bound(
    logged: Retriever, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query older than the scan's bound is not found; one within it is, wherever its line
    lies in its file."""
    assert logged.query_log is not None
    old = logged.retrieve("apples", k=2)
    new = logged.retrieve("wine of the city", k=2)
    logged.query_log.flush()
    [path] = (tmp_path / "log").glob("queries-*.jsonl")
    last = len(path.read_bytes().splitlines(keepends=True)[-1])
    monkeypatch.setattr(querylog, "FEEDBACK_SCAN_BYTES", last)  # the newest line only
    other = QueryLog(tmp_path / "log")
    try:
        other.feedback(new.query_id or "", chunk_id=new.hits[0].chunk_id, relevant=True)
        with pytest.raises(QueryNotLogged, match="no logged query"):
            other.feedback(old.query_id or "", chunk_id=old.hits[0].chunk_id, relevant=True)
        monkeypatch.setattr(querylog, "FEEDBACK_SCAN_BYTES", path.stat().st_size)
        other.feedback(old.query_id or "", chunk_id=old.hits[0].chunk_id, relevant=True)
    finally:
        other.close()


def _query_line(query_id: str, at: float, scope: str | None = None) -> str:
    """A query line as QueryLog.record writes it (json.dumps, the query id first)."""
    entry: dict[str, object] = {
        "query_id": query_id,
        "time": datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds"),
        "alias": "kb",
        "hits": [{"chunk_id": f"c-{query_id[:6]}", "doc_id": "d", "start": 0, "end": 9}],
        "query": "what a query asks " * 20,
    }
    if scope is not None:
        entry["scope"] = {"key": scope, "tenants": None, "filtered": False}
    return json.dumps(entry, ensure_ascii=False) + "\n"


def test_a_feedback_scan_reads_the_newest_lines_of_every_writer_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two live writers: A has an hour of lines and the newest mtime, B's newest line is the
    query judged. The scan reads A's newest window, then B's, where a scan of A's whole file
    first would spend its bound on A's older lines."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    now = time.time()
    a_lines = [_query_line(uuid.uuid4().hex, now - 3600 + 180 * i) for i in range(20)]
    (log_dir / "queries-a-1-aaaa-1.jsonl").write_text("".join(a_lines))
    target = uuid.uuid4().hex
    b_file = log_dir / "queries-b-2-bbbb-1.jsonl"
    b_file.write_text(_query_line(uuid.uuid4().hex, now - 60) + _query_line(target, now - 5))
    os.utime(b_file, (now - 5, now - 5))
    window = max(len(x) for x in a_lines) * 2
    monkeypatch.setattr(querylog, "FEEDBACK_SCAN_WINDOW", window)
    monkeypatch.setattr(querylog, "FEEDBACK_SCAN_BYTES", 2 * window)
    reader = QueryLog(log_dir)
    try:
        reader.feedback(target, chunk_id=f"c-{target[:6]}", relevant=True)
        # A's oldest line lies beyond the bound
        oldest = json.loads(a_lines[0])["query_id"]
        with pytest.raises(QueryNotLogged, match="no logged query"):
            reader.feedback(oldest, chunk_id=f"c-{oldest[:6]}", relevant=True)
    finally:
        reader.close()


def test_a_query_made_outside_a_request_takes_no_keys_feedback(tmp_path: Path) -> None:
    """A line with no scope (the CLI's `search`, a script) is judged in-process only: a key's
    feedback finds it as unknown, in memory or in the files."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    mine, theirs = uuid.uuid4().hex, uuid.uuid4().hex
    (log_dir / "queries-c-3-cccc-1.jsonl").write_text(
        _query_line(mine, time.time(), scope="alice") + _query_line(theirs, time.time())
    )
    reader = QueryLog(log_dir)
    try:
        with access.serving(Scope("alice")):
            reader.feedback(mine, chunk_id=f"c-{mine[:6]}", relevant=True)
            with pytest.raises(QueryNotLogged, match="no logged query"):
                reader.feedback(theirs, chunk_id=f"c-{theirs[:6]}", relevant=True)
        reader.feedback(theirs, chunk_id=f"c-{theirs[:6]}", relevant=True)  # in-process
    finally:
        reader.close()


def test_the_loop_serve_query_feedback_export_evaluate(
    logged: Retriever,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over HTTP: queries, feedback, `questions --from-log`, and the file loads as the
    evaluation's questions with the judged chunk as gold."""
    monkeypatch.setattr(querylog, "FLUSH_S", 3600.0)  # no timed flush: only what feedback asks
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
        # on disk when it answers, with the query it judges (no flush, no wait)
        assert [f["chunk_id"] for f in read_lines([tmp_path / "log"], "feedback")] == [
            good["chunk_id"]
        ]
        logged_ids = {q["query_id"] for q in read_lines([tmp_path / "log"], "queries")}
        assert answers[0]["query_id"] in logged_ids
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
        assert unknown.json()["error"] == "query_not_logged"  # not a missing collection
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
    assert r.json()["error"] == "query_not_logged"


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
        for made_up in ("X1", "X2", "BREW"):  # the HTTP parser takes any token as a method
            http.request(made_up, "/healthz")
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
    assert not {m for (n, labels), _ in samples.items() for k, m in labels if k == "method"} - {
        "GET",
        "POST",
        "other",
    }
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
            with pytest.raises(QueryNotLogged):  # a NotFound too: one except for both APIs
                client.feedback("unknown", doc_id="a", relevant=False)
            with pytest.raises(NotFound):
                client.feedback("unknown", doc_id="a", relevant=False)
            # search() too: its hits carry the query id feedback names
            hits = client.search("the king", k=2)
            assert hits.query_id and hits.query_id != result.query_id
            sent = client.feedback(hits.query_id, chunk_id=hits[1].chunk_id, relevant=True)
            assert sent["query_id"] == hits.query_id
            [batch] = client.search_batch(["apples"], k=1)
            assert batch.query_id and client.feedback(
                batch.query_id, doc_id=batch[0].doc_id, relevant=False
            )

        async def run() -> list[str]:
            async with AsyncRetrieverClient(url) as client:
                found = await client.retrieve("wine", k=1)
                assert found.query_id
                done = await client.feedback(
                    found.query_id, doc_id=found.hits[0].doc_id, relevant=True
                )
                hits = await client.search("peace", k=1)
                assert hits.query_id
                also = await client.feedback(hits.query_id, doc_id=hits[0].doc_id, relevant=True)
                return [str(done["status"]), str(also["status"])]

        assert asyncio.run(run()) == ["recorded", "recorded"]
    assert logged.query_log is not None
    logged.query_log.flush()
    judged = {fb["query_id"] for fb in read_lines([tmp_path / "log"], "feedback")}
    assert hits.query_id in judged and batch.query_id in judged


def ingest_duplicates(tmp_path: Path) -> None:
    """Collection "kb": six documents sharing a footer (boilerplate) and two twins."""
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


def test_doctor_finds_duplicates_and_boilerplate_and_exits_1(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ingest_duplicates(tmp_path)
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


# -- the feedback loop per collection -----------------------------------------------------------


@pytest.fixture
def two_aliases(logged: Retriever, store: Store, tiny_encoder: Encoder) -> Retriever:
    """`logged` serving "kb", with a second alias "other" in the same store and query log."""
    from rag_retriever.ingest.loaders import LoadedCorpus
    from rag_retriever.ingest.writer import ingest_documents

    ingest_documents(
        LoadedCorpus(tuple(DOCS[:3]), 0, "test"), alias="other", encoder=tiny_encoder, store=store
    )
    return logged


def judge_first_hit(retriever: Retriever, query: str, collection: str) -> str:
    """Search `query` on `collection`, judge its first hit relevant; the hit's doc id."""
    assert retriever.query_log is not None
    hits = retriever.search(query, k=2, collection=collection)
    retriever.query_log.feedback(hits.query_id or "", chunk_id=hits[0].chunk_id, relevant=True)
    return hits[0].doc_id


def test_search_returns_its_query_id_with_the_hits(logged: Retriever, tmp_path: Path) -> None:
    import copy
    import pickle

    from rag_retriever import SearchHits

    hits = logged.search("the king and the queen", k=3)
    batch = logged.search_batch(["apples", "river"], k=2)
    assert isinstance(hits, SearchHits) and hits.query_id and len(hits.query_id) == 32
    assert all(isinstance(b, SearchHits) and b.query_id for b in batch)
    assert len({hits.query_id, *(b.query_id for b in batch)}) == 3  # one id per search
    assert logged.query_log is not None
    logged.query_log.flush()
    lines = {line["query"]: line for line in read_lines([tmp_path / "log"], "queries")}
    assert lines["the king and the queen"]["query_id"] == hits.query_id  # the id feedback names
    assert [lines[q]["query_id"] for q in ("apples", "river")] == [b.query_id for b in batch]
    # a list like any other: equal to the same hits, and it survives a copy and a pickle
    assert hits == list(hits) and hits[:1] == [hits[0]] and not isinstance(hits[:1], SearchHits)
    for twin in (copy.copy(hits), pickle.loads(pickle.dumps(hits))):
        assert twin == hits and isinstance(twin, SearchHits) and twin.query_id == hits.query_id
    assert "query_id=" in repr(hits)


def test_questions_read_only_the_alias_asked_for(
    two_aliases: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kb_doc = judge_first_hit(two_aliases, "the king and the queen", "kb")
    judge_first_hit(two_aliases, "apples and pears", "other")
    assert two_aliases.query_log is not None
    two_aliases.query_log.flush()
    log, out = tmp_path / "log", tmp_path / "questions.jsonl"
    argv = ["questions", "--from-log", str(log), "--out", str(out)]
    assert main([*argv, "--collection", "kb", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["alias"], report["queries"], report["questions"]) == ("kb", 1, 1)
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["question"] == "the king and the queen" and row["gold_doc_ids"] == [kb_doc]
    # the file is what the evaluation of that alias accepts
    questions, problems = load_questions(out)
    assert problems == [] and [q.question for q in questions] == ["the king and the queen"]
    assert main([*argv, "--collection", "other"]) == 0
    assert "logged queries 1 of alias other" in capsys.readouterr().out


def test_questions_refuse_an_alias_the_log_does_not_hold_naming_those_it_does(
    two_aliases: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    judge_first_hit(two_aliases, "the king", "kb")
    judge_first_hit(two_aliases, "apples", "other")
    assert two_aliases.query_log is not None
    two_aliases.query_log.flush()
    out = tmp_path / "questions.jsonl"
    argv = ["questions", "--from-log", str(tmp_path / "log"), "--out", str(out)]
    assert main([*argv, "--collection", "kbb"]) == 2
    err = capsys.readouterr().err
    assert "no query of alias 'kbb'" in err and "aliases in it: kb, other" in err
    assert "--collection" in err and not out.exists()
    # without --collection a log of several aliases is refused: eval scores one collection
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "2 aliases (kb, other)" in err and "pass --collection ALIAS" in err
    assert not out.exists()


def test_questions_of_a_log_of_one_alias_say_which_on_stderr(
    logged: Retriever, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    judge_first_hit(logged, "the king", "kb")
    assert logged.query_log is not None
    logged.query_log.flush()
    out = tmp_path / "questions.jsonl"
    assert main(["questions", "--from-log", str(tmp_path / "log"), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "reading every alias of the query log: kb" in printed.err
    assert "--collection ALIAS" in printed.err
    assert "questions      1 written" in printed.out


@pytest.mark.parametrize("collection", [[], ["--collection", "kb"]])
def test_questions_of_an_empty_log_say_so_and_write_nothing(
    collection: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "log").mkdir()
    out = tmp_path / "questions.jsonl"
    argv = ["questions", "--from-log", str(tmp_path / "log"), "--out", str(out), *collection]
    assert main(argv) == 0  # as for a log without positive feedback: nothing to make yet
    printed = capsys.readouterr().out
    assert "logged queries 0" in printed and "holds no logged query yet" in printed
    assert "RAG_QUERY_LOG" in printed and out.read_text() == ""


def test_doctor_judges_drift_and_stage_health_on_its_alias_only(
    two_aliases: Retriever, tmp_path: Path
) -> None:
    from rag_retriever.ops.doctor import Doctor, Thresholds

    for q in ["the king", "wine", "apples", "river mountain"]:
        two_aliases.retrieve(q, k=3)
    for q in ["peace", "queen", "city", "war", "pears", "sea"]:
        two_aliases.retrieve(q, k=3, collection="other")
    assert two_aliases.query_log is not None
    two_aliases.query_log.flush()
    log = [tmp_path / "log"]
    for alias, count in (("kb", 4), ("other", 6)):
        doctor = Doctor(two_aliases, collection=alias, thresholds=Thresholds())
        checks = {c.name: c for c in doctor.run(log=log)}
        assert checks["drift"].figures["queries"] == count
        assert checks["stage health"].figures["queries"] == count
        assert checks["truncation"].figures["queries"] == count
        scope = checks["query log"]
        assert scope.figures == {"alias": alias, "queries": count, "judged": count,
                                 "aliases": ("kb", "other")}  # fmt: skip
        assert f"{count} logged queries of alias {alias}" in scope.summary


def test_doctor_with_a_log_without_its_alias_says_so_and_skips_the_log_checks(
    two_aliases: Retriever, store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    from rag_retriever.ops.doctor import Doctor, Thresholds

    two_aliases.retrieve("the king", k=3)
    assert two_aliases.query_log is not None
    two_aliases.query_log.flush()
    doctor = Doctor(two_aliases, collection="other", thresholds=Thresholds())
    checks = {c.name: c for c in doctor.run(log=[tmp_path / "log"])}
    assert "drift" not in checks and "stage health" not in checks
    scope = checks["query log"]
    assert scope.ok and "no logged query of alias other; aliases in the log: kb" in scope.summary
    assert checks["truncation"].figures["queries"] == 0


def test_doctor_lines_show_the_limit_they_were_judged_against(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import re

    ingest_duplicates(tmp_path)
    capsys.readouterr()
    assert main(["doctor", "--collection", "kb", "--max-boilerplate-share", "0.25"]) == 1
    printed = capsys.readouterr().out
    fail = re.search(
        r"^FAIL  near-duplicates  (\d\.\d{3}) > limit 0\.050 \(--max-duplicate-share\): ",
        printed,
        re.MULTILINE,
    )
    assert fail and float(fail[1]) > 0.05, printed
    boilerplate = re.search(
        r"^FAIL  boilerplate      (\d\.\d{3}) > limit 0\.250 \(--max-boilerplate-share\): ",
        printed,
        re.MULTILINE,
    )
    assert boilerplate and float(boilerplate[1]) > 0.25, printed
    assert "ok    truncation       0.000 <= limit 0.010 (--max-truncated-share): " in printed
    assert "ok    noise floor      random chunk pairs" in printed  # reported, not judged
    assert main(["doctor", "--collection", "kb", "--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    dup = checks["near-duplicates"]
    assert (dup["limit"], dup["threshold"]) == (0.05, "max_duplicate_share")
    assert dup["value"] == pytest.approx(dup["figures"]["share"], abs=1e-4)
    assert dup["value"] > 0.05 and not dup["ok"]
    assert checks["noise floor"]["value"] is None and checks["noise floor"]["limit"] is None


def test_the_last_judgement_of_a_chunk_is_the_latest_by_time_not_by_file(
    tmp_path: Path,
) -> None:
    """Judged relevant at 10:00 on one replica, not relevant at 09:00 on another whose file was
    written to last: the 10:00 judgement wins (read in file order, the older one did)."""
    from rag_retriever.query.querylog import questions_from_log

    log = tmp_path / "log"
    log.mkdir()
    hit = {"chunk_id": "c1", "doc_id": "d1", "start": 0, "end": 5}
    query = {"query_id": "a" * 32, "alias": "kb", "query": "what is it?", "hits": [hit]}
    (log / "queries-h-1-x-1.jsonl").write_text(json.dumps(query) + "\n")
    for name, time_, relevant, mtime in (
        ("feedback-h-2-y-1.jsonl", "2026-12-08T10:00:00.000+00:00", True, 100),
        ("feedback-h-3-z-1.jsonl", "2026-12-08T09:00:00.000+00:00", False, 200),
    ):
        line = {"query_id": "a" * 32, "time": time_, "chunk_id": "c1", "relevant": relevant}
        (log / name).write_text(json.dumps(line) + "\n")
        os.utime(log / name, (mtime, mtime))
    rows, report = questions_from_log([log])
    assert [row["gold_doc_ids"] for row in rows] == [["d1"]] and report.negative_only == 0


def test_an_id_set_holds_its_ids_in_8_bytes_each() -> None:
    from rag_retriever.query.querylog import IdSet

    ids = [uuid.uuid4().hex for _ in range(100)]
    held = IdSet(ids)
    assert all(i in held for i in ids) and len(held) == 100
    assert not any(uuid.uuid4().hex in held for _ in range(1000))
    assert 3 not in held and "" not in held and "x" not in IdSet([])
    assert held._hashes.nbytes == 800  # a frozenset of these strings: about 13 KB


def test_the_newest_logged_queries_are_the_newest_by_time_across_writers(tmp_path: Path) -> None:
    """doctor reads the newest 2,000 queries: they were the last lines in file order (one
    replica's), read after the whole log was loaded."""
    log = tmp_path / "log"
    log.mkdir()
    times = {"a": [1, 4, 5], "b": [2, 3, 6]}  # two replicas' files, interleaved in time
    for writer, minutes in times.items():
        lines = [
            {
                "query_id": f"{writer}{m}",
                "alias": "kb",
                "time": f"2026-12-08T10:0{m}:00",
                "hits": [],
            }
            for m in minutes
        ]
        (log / f"queries-{writer}-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    os.utime(log / "queries-a-1.jsonl", (300, 300))  # a's file read last
    os.utime(log / "queries-b-1.jsonl", (100, 100))
    logged = read_queries([log], alias="kb", newest=3)
    assert [e["query_id"] for e in logged.lines] == ["a4", "a5", "b6"] and logged.matched == 6
    assert len(read_queries([log], alias="kb").lines) == 6
