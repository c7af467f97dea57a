"""Both sides, process life: stop a loop cleanly on SIGTERM / SIGINT; exit without teardown."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["exit_now", "stop_on_signals"]


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[threading.Event]:
    """Set ``stop`` on SIGTERM / SIGINT while inside; the previous handlers come back after.

    Outside the main thread (where Python allows no handlers) it does nothing.
    """
    saved: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            saved[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def exit_now(code: int) -> None:
    """Flush stdout and stderr, then end the process with ``code`` and no interpreter teardown:
    delta-rs can abort at interpreter exit (NOTES.md), which must never fail a finished run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
