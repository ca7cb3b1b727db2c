"""A short soak (bench/soak.py) in CI: mixed messages between every pair, every byte checked.

The full soak (100,000 messages at 16 ranks) is a benchmark run; docs/reliability.md has
its figures. Here a few thousand messages per transport show the same checks passing and
fds not growing after the first round.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"
TIMEOUT = 180


@pytest.mark.parametrize("transport", ["shm", "cma", "vmfd"])
def test_mixed_messages_arrive_intact(transport):
    done = subprocess.run([sys.executable, "-m", "cma.run", "-n", "3", "--transport", transport,
                           "--timeout", str(TIMEOUT), sys.executable, str(SOAK), "--messages", "800"],
                          capture_output=True, text=True, timeout=TIMEOUT + 30)
    assert done.returncode == 0, done.stderr
    totals = json.loads(done.stdout.strip().splitlines()[-1])
    assert totals["messages"] >= 800
    assert totals["transport"] == transport
