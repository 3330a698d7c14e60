"""Several processes on one data dir: `serve` keeps answering while `ingest` builds and swaps in a
new version from another process, and follows the alias without a restart.

Real processes, real Qdrant Edge shards, the tiny encoder; the client is httpx over loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_jsonl

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def corpus(path: Path, word: str, n: int) -> Path:
    return write_jsonl(
        path,
        [
            {"id": f"{word}{i}", "title": f"{word} {i}", "text": f"The {word} {i} runs far. " * 5}
            for i in range(n)
        ],
    )


def test_ingest_in_another_process_while_serving(tiny_encoder_dir: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "RAG_DATA_DIR": str(tmp_path / "data"),
        "RAG_EMBED_MODEL": str(tiny_encoder_dir),
        "RAG_DEVICE": "cpu",
        "RAG_LOG_LEVEL": "WARNING",
    }
    cli = [sys.executable, "-m", "rag_retriever.cli"]
    flags = ["--collection", "kb", "--no-progress", "--json"]

    def ingest(path: Path) -> subprocess.CompletedProcess[str]:
        command = [*cli, "ingest", str(path), *flags]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    first = ingest(corpus(tmp_path / "v1.jsonl", "river", 40))
    assert first.returncode == 0, first.stderr
    port = free_port()
    server = subprocess.Popen(
        [*cli, "serve", "--collection", "kb", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    # (sent, answered, status, collection) per request, in the order they were sent
    records: list[tuple[float, float, int, str]] = []
    stop = threading.Event()

    def query_continuously() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                sent = time.monotonic()
                r = client.post("/v1/search", json={"query": "river mountain", "k": 3})
                served = r.json().get("collection", "") if r.status_code == 200 else r.text
                records.append((sent, time.monotonic(), r.status_code, served))

    def sent_after(t: float) -> int:
        return sum(1 for sent, *_ in records if sent > t)

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            time.sleep(0.2)
        else:
            pytest.fail("serve did not become ready")
        reader = threading.Thread(target=query_continuously)
        reader.start()
        second = ingest(corpus(tmp_path / "v2.jsonl", "mountain", 60))
        swapped = time.monotonic()  # the alias moved before the ingest process ended
        # A few requests sent after the swap, however slow a busy machine answers them (the
        # deadline only stops a hung server from hanging the suite).
        deadline = time.monotonic() + 120
        while sent_after(swapped) < 3 and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        reader.join(timeout=60)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert second.returncode == 0, second.stderr
    assert records and all(status == 200 for _, _, status, _ in records), [
        r for r in records if r[2] != 200
    ][:3]
    assert {c for *_, c in records} == {"kb__tiny-bert-32__v1", "kb__tiny-bert-32__v2"}
    # The server reads the alias per query: every request sent after the ingest ended was
    # answered by v2 (a behaviour, not a latency: no bound on how long the answers took) ...
    assert sent_after(swapped) >= 3
    assert all(c.endswith("__v2") for sent, _, _, c in records if sent > swapped)
    # ... and once v2 answered, no later-sent request went back to v1.
    first_v2 = min(answered for _, answered, _, c in records if c.endswith("__v2"))
    assert all(c.endswith("__v2") for sent, _, _, c in records if sent > first_v2)
