"""Re-ingest: the promotion gate, crash safety under SIGKILL, queries during a swap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# The ingest the tests kill, waiting at a named store call until the signal (one definition,
# shared with the stop benchmark).
from bench.bench_stop import KILLABLE_INGEST
from rag_retriever.errors import ConfigError, GateRejected
from rag_retriever.eval.gate import make_gate
from rag_retriever.ingest.loaders import LoadedCorpus
from rag_retriever.ingest.lock import IngestLock
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.models.encoder import Encoder
from rag_retriever.query.retriever import Retriever
from rag_retriever.records import Document
from rag_retriever.settings import Settings
from rag_retriever.store import STATUS_COMPLETE, EdgeStore, Store
from tests.conftest import write_jsonl

GOOD = tuple(
    Document(f"d{i}", f"Topic {w}", f"The {w} is a {w} about the {w} city.")
    for i, w in enumerate(["apples", "pears", "wine", "river", "mountain", "king", "queen", "war"])
)


def questions(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "gate.jsonl",
        [
            {"id": f"q{i}", "question": doc.title.split()[1], "gold_doc_ids": [doc.id]}
            for i, doc in enumerate(GOOD)
        ],
    )


def gate_of(
    store: Store,
    encoder: Encoder,
    tmp_path: Path,
    *,
    min_recall: float = 0.0,
    max_regression: float = 0.01,
):
    """The gate of the GOOD questions at recall@1."""
    return make_gate(
        questions(tmp_path),
        settings=Settings(data_dir=tmp_path),
        encoder=encoder,
        store=store,
        k=1,
        min_recall=min_recall,
        max_regression=max_regression,
    )


def ingest(store: Store, encoder: Encoder, root: Path, docs, **kw):
    kw.setdefault("full", True)  # a new version to judge, even of the same corpus
    return ingest_documents(
        LoadedCorpus(tuple(docs), 0, "t"),
        alias="kb",
        encoder=encoder,
        store=store,
        **kw,
    )


def test_gate_promotes_an_equal_version_and_refuses_a_worse_one(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    gate = gate_of(store, tiny_encoder, tmp_path, max_regression=0.0)
    v1 = ingest(store, tiny_encoder, tmp_path, GOOD, gate=gate)  # no live version: judged alone
    assert v1.promoted and v1.gate is not None and "new 1.0000" in v1.gate.summary
    v2 = ingest(store, tiny_encoder, tmp_path, GOOD, gate=gate)
    assert v2.promoted and "vs live 1.0000" in v2.gate.summary
    # The new corpus lost the words of half the documents: BM25 cannot find them any more.
    worse = [
        Document(d.id, "Untitled", "Nothing here.") if i % 2 else d for i, d in enumerate(GOOD)
    ]
    with pytest.raises(GateRejected, match="REFUSED") as info:
        ingest(store, tiny_encoder, tmp_path, worse, gate=gate)
    report = info.value.report
    assert report is not None and not report.promoted  # type: ignore[attr-defined]
    assert store.aliases()["kb"] == v2.collection  # the alias did not move
    assert report.gate.details["regressed"] > 0  # type: ignore[attr-defined]
    kept = store.info(report.collection)  # type: ignore[attr-defined]
    assert kept.status == STATUS_COMPLETE  # built and kept, so it can be promoted by hand


def test_gate_min_recall(store: Store, tiny_encoder: Encoder, tmp_path: Path) -> None:
    gate = gate_of(store, tiny_encoder, tmp_path, min_recall=0.9)
    worse = [
        Document(d.id, "Untitled", "Nothing here.") if i % 2 else d for i, d in enumerate(GOOD)
    ]
    with pytest.raises(GateRejected, match=r"recall@1 0.5000 < --min-recall 0.9"):
        ingest(store, tiny_encoder, tmp_path, worse, gate=gate)
    assert "kb" not in store.aliases()


def test_gate_counts_a_gold_document_a_version_lacks_as_a_miss(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A corpus that adds the document a gate question needs is what a gate should pass, and one
    that drops it what it should refuse: the version without the gold document scores that
    question as a miss (the eval's missing-gold error once stopped both ingests)."""
    gate = gate_of(store, tiny_encoder, tmp_path, max_regression=0.0)
    v1 = ingest(store, tiny_encoder, tmp_path, GOOD[:-1], gate=gate)  # d7 not yet written
    assert v1.promoted and v1.gate.details["new_without_gold"] == 1
    assert "new 0.8750 (1 questions' gold not in it: misses)" in v1.gate.summary
    v2 = ingest(store, tiny_encoder, tmp_path, GOOD, gate=gate)  # adds it: better
    assert v2.promoted and v2.gate.details["live_without_gold"] == 1
    assert "new 1.0000 vs live 0.8750" in v2.gate.summary
    with pytest.raises(GateRejected, match="REFUSED") as info:  # drops d0: a regression
        ingest(store, tiny_encoder, tmp_path, GOOD[1:], gate=gate)
    details = info.value.report.gate.details  # type: ignore[attr-defined]
    assert details["new_without_gold"] == 1 and details["regressions"][0]["id"] == "q0"
    assert details["regressions"][0]["rank_now"] is None
    assert store.aliases()["kb"] == v2.collection


def test_gate_refuses_a_questions_file_with_bad_lines(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """A gate on fewer questions than were written is not the gate asked for: every bad line is
    named, and nothing is written."""
    path = questions(tmp_path)
    with path.open("a", encoding="utf-8") as out:
        out.write('{"id": "q9", "question": "no gold"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"2 bad line\(s\); nothing was written") as info:
        make_gate(path, settings=Settings(data_dir=tmp_path), encoder=tiny_encoder, store=store)
    assert "gate.jsonl:9" in str(info.value) and "gate.jsonl:10" in str(info.value)


def test_queries_keep_answering_while_a_new_version_is_swapped_in(
    store: Store, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """Embedded mode, one process: searches run on threads while ingests swap the alias."""
    ingest(store, tiny_encoder, tmp_path, GOOD)
    retriever = Retriever(encoder=tiny_encoder, store=store, collection="kb")
    errors: list[BaseException] = []
    answered = 0
    stop = threading.Event()

    def search_loop() -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                hits = retriever.search("the wine city", k=3)
                assert hits and hits[0].doc_id.startswith("d")
                answered += 1
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

    threads = [threading.Thread(target=search_loop) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(3):
        ingest(store, tiny_encoder, tmp_path, GOOD, keep_versions=2)
    # at least one answer, however slowly a busy machine runs the threads (a hang guard only)
    deadline = time.monotonic() + 300
    while answered == 0 and not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert answered > 0


def kill_after(method: str, nth: int, args: list[str], env: dict[str, str]) -> None:
    """Run the CLI with `args`, SIGKILL it right after its `nth` call of the store's `method`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_INGEST, method, str(nth), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = 0
    for line in proc.stderr:
        seen += line.strip() == f"kill-point {method}"
        if seen == nth:
            break
    assert seen == nth, f"{args[0]} ended before {method} #{nth}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


# (the Store call to kill after, which call of it, whether the new version is served then)
KILL_POINTS = [
    ("upsert", 1, False),  # vectors half written
    ("seal", 1, False),  # indexed, flushed and optimized, still marked building
    ("write_meta", 2, False),  # marked complete (call 1 wrote `building`), alias not moved
    ("point_alias", 1, True),  # alias moved, the old version not yet stamped retired
]


@pytest.mark.slow
def test_sigkill_at_each_write_step_never_breaks_the_alias(
    tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    """A real `rag-retriever ingest` subprocess on Qdrant Edge, killed with SIGKILL."""
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(
        corpus,
        [
            {
                "id": f"d{i}",
                "title": f"Doc {i}",
                "text": f"The river {i} runs to the city of kings. " * 6,
            }
            for i in range(300)
        ],
    )
    env = {
        **os.environ,
        "RAG_DATA_DIR": str(tmp_path / "data"),
        "RAG_EMBED_MODEL": str(tiny_encoder_dir),
        "RAG_DEVICE": "cpu",
    }
    args = ["ingest", str(corpus), "--collection", "kb", "--no-progress", "--full"]
    cmd = [sys.executable, "-m", "rag_retriever.cli", *args]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr

    def served() -> tuple[str, list[str]]:
        store = EdgeStore(tmp_path / "data" / "edge")
        try:
            name = store.aliases()["kb"]
            record = store.record(name)
            assert record.status == STATUS_COMPLETE
            assert record.chunks >= 300 and store.count(name) == record.chunks
            return name, [i.name for i in store.versions("kb") if i.status != STATUS_COMPLETE]
        finally:
            store.close()

    before, _ = served()
    left_behind = 0
    for method, nth, moved in KILL_POINTS:
        kill_after(method, nth, args, env)
        now, unfinished = served()
        assert (now != before) == moved, method
        left_behind += len(unfinished)
        before = now
    assert left_behind >= 1  # the half-written version, still marked building
    final = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    report = json.loads(final.stdout)
    store = EdgeStore(tmp_path / "data" / "edge")
    try:
        statuses = [i.status for i in store.versions("kb")]
        assert all(s == STATUS_COMPLETE for s in statuses), statuses  # orphans were removed
        assert report["promoted"]
        encoder = Encoder.load(str(tiny_encoder_dir), device="cpu")
        retriever = Retriever(encoder=encoder, store=store, collection="kb")
        assert retriever.search("river city", k=3)
    finally:
        store.close()


def _signal_after_the_first_upsert(
    args: list[str], env: dict[str, str], sig: signal.Signals
) -> tuple[int, str]:
    """Run the killable ingest and send `sig` right after its first upsert: its exit status and
    what it printed after that. How long it takes to stop is a benchmark's figure
    (bench/bench_stop.py), not a test's: the wait below only keeps a hung process from hanging
    the suite."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_INGEST, "upsert", "1", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.strip() == "kill-point upsert":
            break
    proc.send_signal(sig)
    rest = proc.stderr.read()
    proc.wait(timeout=300)
    return proc.returncode, rest


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_write_stops_cleanly(
    tiny_encoder_dir: Path, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """`docker stop` / Ctrl-C during an ingest: the handler ran (its line, its exit status),
    the partial version is removed from disk, the lock released, the alias untouched."""
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(
        corpus,
        [{"id": f"d{i}", "text": f"The river {i} runs to the city. " * 6} for i in range(300)],
    )
    env = {
        **os.environ,
        "RAG_DATA_DIR": str(tmp_path / "data"),
        "RAG_EMBED_MODEL": str(tiny_encoder_dir),
        "RAG_DEVICE": "cpu",
    }
    args = ["ingest", str(corpus), "--collection", "kb", "--no-progress", "--full"]
    first = subprocess.run(
        [sys.executable, "-m", "rag_retriever.cli", *args],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    store = EdgeStore(tmp_path / "data" / "edge")
    served = store.aliases()["kb"]
    status, rest = _signal_after_the_first_upsert(args, env, sig)
    assert status == code, rest
    assert "nothing unfinished was kept" in rest and "Traceback" not in rest
    assert store.aliases()["kb"] == served
    assert [i.status for i in store.versions("kb")] == [STATUS_COMPLETE]
    assert store.collection_names() == [served]  # the partial version's files are gone
    with IngestLock(tmp_path / "data", "kb"):  # released
        pass
    store.close()


def test_an_ingest_stopped_by_sigterm_logs_no_failure(
    tiny_encoder_dir: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"id": f"d{i}", "text": f"The river {i} runs." * 6} for i in range(300)])
    env = {
        **os.environ,
        "RAG_DATA_DIR": str(tmp_path / "data"),
        "RAG_EMBED_MODEL": str(tiny_encoder_dir),
        "RAG_DEVICE": "cpu",
        "RAG_LOG_LEVEL": "INFO",
    }
    args = ["ingest", str(corpus), "--collection", "kb", "--no-progress"]
    status, rest = _signal_after_the_first_upsert(args, env, signal.SIGTERM)
    assert status == 143, rest
    assert "stopped by SIGTERM" in rest
    assert not [line for line in rest.splitlines() if line.startswith("ERROR")], rest


@pytest.mark.parametrize(
    ("k", "min_recall", "max_regression", "message"),
    [
        (0, 0.0, 0.01, "--gate-k must be a positive integer"),  # raised after the build before
        (1, 0.0, float("nan"), "must lie in"),  # NaN: the gate never saw a regression
        (1, float("nan"), 0.01, "must lie in"),
        (1, 1.5, 0.01, "must lie in"),
        (1, 0.0, -0.1, "must lie in"),
    ],
)
def test_a_gate_that_could_not_judge_is_refused_before_anything_is_written(
    store: Store,
    tiny_encoder: Encoder,
    tmp_path: Path,
    k: int,
    min_recall: float,
    max_regression: float,
    message: str,
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_gate(
            questions(tmp_path),
            settings=Settings(data_dir=tmp_path),
            encoder=tiny_encoder,
            store=store,
            k=k,
            min_recall=min_recall,
            max_regression=max_regression,
        )
