"""bench/copy_floor.py, the ping-pong floors docs/mpi.md quotes: every way runs and moves
the data (each message is checked on arrival), and a failing process ends the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "copy_floor.py"


@pytest.mark.timeout(120)
def test_every_way_moves_the_message() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "16K,64K", "--pieces", "16K",
         "--iterations", "50", "--rounds", "1"],
        capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["16384", "65536"], result.stdout
    for row in rows:
        assert len(row) == 4 and all(float(t) > 0 for t in row[1:]), result.stdout


@pytest.mark.timeout(60)
def test_a_peer_that_fails_ends_the_run() -> None:
    """The receiver's check fails (the sender's buffer is not what it expects): both
    processes stop instead of spinning for a flag that never comes."""
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "import copy_floor\n"
        "copy_floor._check = lambda dst, peer: (_ for _ in ()).throw(AssertionError('bad'))\n"
        "copy_floor.pingpong(16384, 20, 'single', 16384)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=50)
    assert result.returncode != 0
    assert "failed" in result.stderr or "bad" in result.stderr, result.stderr[-2000:]
