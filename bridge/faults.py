"""Both sides, testing: named crash points, armed only through the environment.

``DIODE_CRASH_AT=<point>[:<n>]`` makes the process SIGKILL itself (its whole process group
when it leads one, so a Spark driver takes its JVM along) the ``n``-th time (default 1st) it
reaches ``crash_point(<point>)``. Before dying it appends the point's name to the file named
by ``DIODE_CRASH_MARK`` and fsyncs it, so a test can prove the crash hit the window it names;
a point already in that file does not fire again (a restarted process inherits the
environment, and must not die the same way forever). Unarmed, a crash point costs one
comparison.

``DIODE_SLOW_AT=<point>:<seconds>`` makes every ``slow_point(<point>)`` sleep that long (a slow
disk or a busy table, so that a test can hold a step open while it crashes another).
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["crash_point", "slow_point", "CRASH_ENV", "MARK_ENV", "SLOW_ENV"]

CRASH_ENV = "DIODE_CRASH_AT"
MARK_ENV = "DIODE_CRASH_MARK"
SLOW_ENV = "DIODE_SLOW_AT"


def _parse(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, n = spec.partition(":")
    return name, int(n) if n else 1


def _parse_slow(spec: str) -> tuple[str, float] | None:
    if not spec:
        return None
    name, _, secs = spec.partition(":")
    return name, float(secs or 1.0)


_ARMED = _parse(os.environ.get(CRASH_ENV, ""))
_SLOW = _parse_slow(os.environ.get(SLOW_ENV, ""))
_hits = 0


def slow_point(name: str) -> None:
    """Sleep here if the environment armed this point (see the module doc)."""
    if _SLOW is not None and _SLOW[0] == name:
        time.sleep(_SLOW[1])


def crash_point(name: str) -> None:
    """Die here with SIGKILL if the environment armed this point (see the module doc)."""
    global _hits
    if _ARMED is None or _ARMED[0] != name:
        return
    _hits += 1
    if _hits < _ARMED[1]:
        return
    mark = os.environ.get(MARK_ENV)
    if mark:
        try:
            with open(mark) as f:
                if name in f.read().split():
                    return
        except FileNotFoundError:
            pass
        fd = os.open(mark, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{name}\n".encode())
        os.fsync(fd)
        os.close(fd)
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
