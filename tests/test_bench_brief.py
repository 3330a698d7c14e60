"""bench/bench_brief.py's CPU accounting: a process and the helpers it starts, from /proc."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.bench_brief import CpuMeter, children, cpu_seconds

# The helper burns this much CPU time (not wall time: a loaded machine only makes it slower).
BURN_S = 0.3

HELPER = f"""
import sys, time
while time.process_time() < {BURN_S}:
    pass
open(sys.argv[1], "w").close()
time.sleep(60)
"""

PARENT = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_the_meter_counts_a_helper_started_during_the_phase(tmp_path: Path) -> None:
    done = tmp_path / "burnt"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, HELPER, str(done)])
    try:
        meter = CpuMeter(parent.pid)
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, "the helper never finished its work"
            time.sleep(0.05)
        cores = meter.cores()
        elapsed = time.monotonic() - meter.t0
        (helper,) = children(parent.pid)
        assert cpu_seconds(helper) >= BURN_S
        assert cores["helpers_cores"] * elapsed >= BURN_S * 0.9  # counted from 0
        assert cores["server_cores"] * elapsed < cpu_seconds(helper)
    finally:
        for pid in children(parent.pid):
            subprocess.run(["kill", str(pid)], check=False)
        parent.kill()
        parent.wait()
    assert cpu_seconds(parent.pid) == 0.0  # gone: nothing to read
