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


def test_a_black_job_waits_for_a_heartbeat_beat_holding_its_run_lock(tmp_path: Path) -> None:
    """`diode black heartbeat` holds black.lock for a beat (milliseconds, at most its gpg
    timeout): a scheduled job starting meanwhile was refused at once (exit 1, a lost run).
    It waits for the beat, and still refuses a second job once the wait is over."""
    from bridge.black.heartbeat import JOB_LOCK_WAIT_SECONDS
    from bridge.black.job import run_lock

    state = tmp_path / "state"
    beat = HOLD.replace("time.sleep(60)", "time.sleep(1.5)")
    p = subprocess.Popen([sys.executable, "-c", beat, str(state / "black.lock")],
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with run_lock(state):
            waited = time.monotonic() - t0
            assert p.poll() is not None  # the case: it got the lock once the beat ended
        assert 0.5 < waited < JOB_LOCK_WAIT_SECONDS
    finally:
        p.kill()
        p.wait()
