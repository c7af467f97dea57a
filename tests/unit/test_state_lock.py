"""Unit: one black job per state dir — a second process is refused while the first runs, and a
killed holder never leaves the lock behind (the kernel releases flock on exit)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.errors import StateError
from bridge.fsutil import exclusive_lock

HOLD = """
import sys, time
from pathlib import Path
from bridge.fsutil import exclusive_lock
with exclusive_lock(Path(sys.argv[1]), what="holder"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_second_holder_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    lock = tmp_path / "state" / "black.lock"
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        with pytest.raises(StateError, match="another process holds .*black.lock"):
            with exclusive_lock(lock, what="black run"):
                pass
    finally:
        p.kill()  # SIGKILL: no cleanup code runs in the holder
        p.wait()
    deadline = time.monotonic() + 5
    while True:
        try:
            with exclusive_lock(lock, what="black run"):
                break
        except StateError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
