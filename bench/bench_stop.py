"""How fast a running ingest stops on SIGTERM (`docker stop`) and Ctrl-C, against the time the
same ingest, from the same point, takes to finish.

The tests check that a signal stops an ingest cleanly (the handler's line and exit status, the
partial version removed, the lock released: tests/test_reingest.py); how long that takes is a
time, so it is measured here, where a busy machine makes a slow figure instead of a failed test.

Usage:
    python -m bench.bench_stop [--docs 200] [--rounds 3]

Each round ingests the first `--docs` SQuAD articles with the default model into a fresh data
dir, in a subprocess that waits after its first vector upsert: the signal is sent there and the
time until the process has exited is taken. The peer is the same ingest left to run on from that
point (measured from the same step to its exit). Does not measure SIGKILL (nothing runs then).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_common import percentile, read_jsonl, shared_path

# Run as a subprocess, by this benchmark and by the kill tests (tests/test_reingest.py):
# `rag-retriever ingest` with one Store method wrapped so it announces each call on stderr and,
# after its `nth` call (0: never), waits there for the signal:
# the signal lands right after that step however fast or busy the machine is (a pause of a
# fixed length let a slow test process signal a later step, and a timer after the progress bar
# was not deterministic either).
KILLABLE_INGEST = """
import signal, sys, threading
from rag_retriever import cli, store
# Every handler installed (the CLI's for SIGTERM, Python's for SIGINT) first notes the signal,
# so the step waiting in the writer's thread returns as the command's own handler runs.
signalled = threading.Event()
install = signal.signal
def noting(signum, handler):
    def handle(sig, frame):
        signalled.set()
        return handler(sig, frame)
    return install(signum, handle if callable(handler) else handler)
signal.signal = noting
signal.signal(signal.SIGINT, signal.default_int_handler)
def announce(name, nth):
    original = getattr(store.EdgeStore, name)
    calls = []
    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(name)
        print("kill-point " + name, file=sys.stderr, flush=True)
        if len(calls) == nth:
            signalled.wait(3600)  # until the signal
        return out
    setattr(store.EdgeStore, name, wrapped)
announce(sys.argv[1], int(sys.argv[2]))
sys.exit(cli.main(sys.argv[3:]))
"""


def _one(corpus: Path, data: Path, sig: signal.Signals | None) -> tuple[float, int]:
    """Seconds from the first upsert (or from the signal sent there) to the exit, and the exit
    status."""
    env = {**os.environ, "RAG_DATA_DIR": str(data), "RAG_LOG_LEVEL": "WARNING"}
    args = ["ingest", str(corpus), "--collection", "kb", "--no-progress", "--full"]
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_INGEST, "upsert", "1" if sig else "0", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.strip() == "kill-point upsert":
            break
    start = time.perf_counter()
    if sig is not None:
        proc.send_signal(sig)
    proc.stderr.read()
    proc.wait()
    return time.perf_counter() - start, proc.returncode


def run(docs: int = 200, rounds: int = 3) -> dict[str, Any]:
    rows = read_jsonl(shared_path("squad_v11_dev", "docs.jsonl"), limit=docs)
    out: dict[str, Any] = {"docs": len(rows), "rounds": rounds}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        times: dict[str, list[float]] = {"finish": [], "SIGTERM": [], "SIGINT": []}
        for i in range(rounds):
            for name, sig in (
                ("finish", None),
                ("SIGTERM", signal.SIGTERM),
                ("SIGINT", signal.SIGINT),
            ):
                seconds, status = _one(corpus, Path(tmp) / f"data-{name}-{i}", sig)
                expected = {"finish": 0, "SIGTERM": 143, "SIGINT": 130}[name]
                if status != expected:
                    raise RuntimeError(f"{name}: exit status {status}, expected {expected}")
                times[name].append(seconds)
    for name, values in times.items():
        out[name] = {"p50_s": percentile(values, 50), "max_s": max(values)}
    return out


def report(result: dict[str, Any]) -> list[str]:
    finish = result["finish"]["p50_s"]
    lines = [
        f"== stopping an ingest ({result['docs']} SQuAD articles, {result['rounds']} rounds) =="
    ]
    for name in ("SIGTERM", "SIGINT"):
        ours = result[name]["p50_s"]
        lines.append(
            f"{name} after the first upsert: exits in {ours:.2f} s (max {result[name]['max_s']:.2f})"
            f" vs finishing from there {finish:.2f} s -> {finish / ours:.1f}x sooner"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_stop", description=__doc__)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for text in report(run(args.docs, args.rounds)):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
