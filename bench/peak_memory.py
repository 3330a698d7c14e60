"""The peak memory of a process and its descendants, sampled by a process of its own.

Example:
    >>> peaks = PeakSampler("RssAnon", "VmRSS")     # samples this process's tree # doctest: +SKIP
    >>> build()                                                          # doctest: +SKIP
    >>> peaks.stop()["RssAnon"]                                          # doctest: +SKIP

Why a process: Qdrant Edge's Python bindings hold the interpreter lock inside their calls, and a
seal's optimize is one call of minutes. A sampling thread in the measured process does not run
during it: measured on a build of two 500k-chunk shards, such a thread's samples stopped for 134
and 136 s (each shard's optimize), so the build's private peak it read (1,178 MB) was what the
process held before and after the optimizes, not during. This process reads /proc beside it.

Run as `python -m bench.peak_memory PID EVERY_S FIELD...`: samples until its stdin has a line
or closes, then prints each field's peak (MB) as JSON; a bad argument exits 2 with a message.
It imports the standard library only (and bench_common, which does too), so it starts in
milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from bench.bench_common import positive_count

ROOT = Path(__file__).resolve().parents[1]


def status_mb(pid: int | str = "self") -> dict[str, float]:
    """The sizes /proc/<pid>/status gives (its kB fields), in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.endswith(" kB"):
            out[key] = int(value.split()[0]) / 1024
    return out


def tree_mb(fields: Iterable[str], root: int, leave_out: int | None = None) -> dict[str, float]:
    """Each of `fields` of /proc/<pid>/status summed over process `root` and its descendants
    (but `leave_out`, the sampler itself), from one walk of /proc; a process that ends while
    being read counts 0."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    totals = dict.fromkeys(fields, 0.0)
    tree = [root]
    while tree:
        pid = tree.pop()
        tree += children.get(pid, [])
        if pid == leave_out:
            continue
        try:
            status = status_mb(pid)
        except OSError:
            continue
        for field in totals:
            totals[field] += status.get(field, 0.0)
    return totals


class PeakSampler:
    """The largest sum of each of `fields` over this process's tree, read every `every_s` by a
    sampler process (see the module docstring); `stop()` returns them in MB."""

    def __init__(self, *fields: str, every_s: float = 0.1) -> None:
        self.fields = fields
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.peak_memory", str(os.getpid()), str(every_s), *fields],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> dict[str, float]:
        out, _ = self._process.communicate("stop\n", timeout=60)
        if self._process.returncode != 0:
            raise RuntimeError(f"the memory sampler exited with code {self._process.returncode}")
        return {field: float(mb) for field, mb in json.loads(out).items()}


def sample(root: int, every_s: float, fields: Iterable[str]) -> dict[str, float]:
    """Peaks of `fields` over `root`'s tree (this process left out) until stdin has a line or
    closes."""
    peaks = dict.fromkeys(fields, 0.0)
    stopped = False
    while True:
        for field, value in tree_mb(peaks, root, leave_out=os.getpid()).items():
            peaks[field] = max(peaks[field], value)
        if stopped:  # sampled once more after the stop, as the caller's work ended
            return peaks
        stopped = bool(select.select([sys.stdin], [], [], every_s)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peak_memory",
        description="Peaks of /proc/<pid>/status fields over a process tree, until stdin has a "
        "line or closes; printed as JSON (MB).",
    )
    parser.add_argument("pid", type=positive_count, help="the root of the tree")
    parser.add_argument("every_s", type=float, help="seconds between samples (> 0)")
    parser.add_argument("fields", nargs="+", help="/proc/<pid>/status fields in kB, e.g. RssAnon")
    args = parser.parse_args(argv)
    if not args.every_s > 0:
        parser.error(f"every_s must be more than 0 (got {args.every_s})")
    if not Path(f"/proc/{args.pid}").is_dir():
        parser.error(f"no process {args.pid} to sample")
    print(json.dumps(sample(args.pid, args.every_s, args.fields)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
