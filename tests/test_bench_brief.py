"""bench/bench_brief.py's CPU accounting (a process and the helpers it and they start, from
/proc) and the service's cost it writes for the plan."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.bench_brief import CpuMeter, cpu_seconds, descendants, served_constants

# The helper burns this much CPU time (not wall time: a loaded machine only makes it slower).
BURN_S = 0.3
TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # /proc counts in clock ticks

BURNER = f"""
import sys, time
while time.process_time() < {BURN_S}:
    pass
open(sys.argv[1], "w").close()
time.sleep(60)
"""

# Starts `sys.argv[1]` (code) with the rest of its arguments, then waits.
SPAWNER = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]])
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_the_meter_counts_helpers_of_helpers_started_during_the_phase(tmp_path: Path) -> None:
    """server -> writer -> compaction: the compaction's CPU counts, from 0."""
    done = tmp_path / "burnt"
    server = subprocess.Popen([sys.executable, "-c", SPAWNER, SPAWNER, BURNER, str(done)])
    try:
        meter = CpuMeter(server.pid)
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, "the helper never finished its work"
            time.sleep(0.05)
        cores = meter.cores()
        elapsed = time.monotonic() - meter.t0
        writer, compaction = descendants(server.pid)
        assert descendants(writer) == [compaction]
        assert cpu_seconds(compaction) >= BURN_S - 2 * TICK_S
        helpers_s = cores["helpers_cores"] * elapsed
        assert helpers_s >= cpu_seconds(compaction) - 2 * TICK_S  # counted from 0
        assert cores["server_cores"] * elapsed < cpu_seconds(compaction)
    finally:
        for pid in descendants(server.pid):
            os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()
    assert cpu_seconds(server.pid) == 0.0  # gone: nothing to read


def test_the_services_cost_is_written_only_from_a_whole_phase() -> None:
    """The plan takes `service_p50_ms` as measured; a phase with failures or no split (NaN)
    writes None, and the plan falls back to its inference."""
    single = {
        "p50_ms": 19.0,
        "queries_failed": 0,
        "encode_p50_ms": 9.6,
        "search_p50_ms": 1.5,
        "service_p50_ms": 7.7,
    }
    load = {"p50_ms": 36.8, "p95_ms": 75.4, "queries_failed": 0, "queries_sent": 3013}
    results = {"chunks": 2468, "qps": 50.0, "single": single, "phases": [load]}
    served = served_constants(results, "python -m bench.bench_brief")
    assert served["service_p50_ms"] == 7.7 and served["single_search_p50_ms"] == 1.5
    failed = served_constants(dict(results, single=single | {"queries_failed": 1}), "cmd")
    assert failed["service_p50_ms"] is None and failed["single_encode_p50_ms"] is None
    unsplit = served_constants(dict(results, single=single | {"service_p50_ms": math.nan}), "cmd")
    assert unsplit["service_p50_ms"] is None and unsplit["single_search_p50_ms"] == 1.5
