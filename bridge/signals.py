"""Both sides: stop a long-running loop cleanly on SIGTERM / SIGINT (main thread only)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["stop_on_signals"]


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
