"""Pipe create/use/close cycles leave the process as they found it: no fd, mapping,
thread or resident memory grows beyond a stated bound, and no child is left a zombie.

``bench/pipe_cycles.py`` does the cycles (each: ``a, b = cma.Pipe()`` with transport
``auto``, a child with ``b``, an eager and a rendezvous message each way, both ends
closed, the child joined) in a fresh process and reports its readings before and after.
CI runs as many as fit in a few seconds; the issue's 1000 are a benchmark run, whose
figures are in docs/reliability.md ("Resources").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "pipe_cycles.py"
# Growth allowed over the cycles (the first cycle's one-time costs excluded by a warm-up):
# a leak of one fd, mapping, thread or zombie per cycle exceeds these, and over the fork
# cycles one of 17 KiB of memory per cycle. Measured: none at all over 1000 fork cycles
# but 132 KiB of resident memory (docs/reliability.md, "Resources").
BOUNDS = {"fds": 0, "maps": 8, "threads": 0, "tasks": 0, "rss_kib": 2 << 10, "zombies": 0}
TIMEOUT = 120
# glibc's mmap threshold held at its default: once the first cycle's 3 MiB arrays are
# freed glibc raises it, and the next cycle's come from a heap that grows by ~9 MiB once
# and stays (2026-12-05: 36.5 -> 45.7 MiB between the first and second cycle, flat
# after): the allocator's growth, not cma's, which this test is about.
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


@pytest.mark.parametrize(("context", "count"), [("fork", 120), ("spawn", 2)])
def test_pipe_cycles_leave_no_resources_behind(context: str, count: int) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--cycles", str(count),
                           "--context", context], capture_output=True, text=True,
                          timeout=TIMEOUT, env=ENV)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    over = {k: (report["before"][k], report["after"][k])
            for k, grown in report["growth"].items() if grown > BOUNDS[k]}
    assert not over, f"after {count} {context} cycles, (before, after) beyond {BOUNDS}: {over}"
