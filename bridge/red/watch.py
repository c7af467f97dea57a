"""Red, intake: inotify on the inbox (watchdog) — when to scan, and which files were closed.

The watcher only *hints*: the intake still lists the folder and applies its own rules, so a
lost event costs latency, never a file. Without inotify (no kernel support, the instance or
watch limit reached, the observer died) ``wait`` just sleeps and reports a change, so the
caller scans on every call.

A file closed after writing is recorded with what it was then (inode, size, mtime: its
``CloseSig``); the intake counts it closed only while the file in the inbox still matches.
A name alone is not enough: events reach the watcher late (watchdog holds every event behind
an ``IN_MOVED_FROM`` for ~0.5 s, e.g. the intake's own rename), so a new copy arriving under a
name just taken would otherwise pass for closed while it is still being written.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)

from bridge.fsutil import durable_mkdir
from bridge.logs import get_logger, log_event

__all__ = ["CloseSig", "ClosedFiles", "InboxWatcher", "close_sig"]

log = get_logger("bridge.red.watch")

_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent,
    FileModifiedEvent,
    FileClosedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
]
_MAX_CLOSED = 100_000  # names kept; beyond that all are dropped (files then settle by time)

CloseSig = tuple[int, int, int]
"""``(st_ino, st_size, st_mtime_ns)`` of a file when it was closed after writing."""


def close_sig(st: os.stat_result) -> CloseSig:
    """The ``CloseSig`` of ``st`` (a rename keeps it; ctime is left out for that reason)."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _base(path: bytes | str) -> str:
    return os.path.basename(os.fsdecode(path))


class ClosedFiles(dict[str, CloseSig]):
    """A snapshot of the watcher's closed files: name (``os.fsdecode`` of the raw name, as
    the intake compares them) -> the ``CloseSig`` the file had when it was closed."""

    def __init__(self, items: dict[str, CloseSig], watcher: InboxWatcher | None = None) -> None:
        super().__init__(items)
        self._watcher = watcher

    def forget(self, gone: Iterable[tuple[str, CloseSig]]) -> None:
        """Drop names whose files left the inbox (taken or quarantined by the intake) from
        the watcher at once, without waiting for its (late) events; a name closed again
        since (another file) is kept."""
        if self._watcher is not None:
            self._watcher._forget(gone)


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: InboxWatcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.watcher._on_event(event)


class InboxWatcher:
    """Watches one inbox folder (not its subfolders) with inotify."""

    def __init__(self, inbox: Path) -> None:
        self.inbox = Path(inbox)
        self._inbox_norm = os.path.normpath(str(self.inbox))
        self._cond = threading.Condition()
        self._changed = False
        self._closed: dict[str, CloseSig] = {}
        self._observer: Any = None
        self._blind = False

    @property
    def active(self) -> bool:
        """True while inotify events arrive (False: ``wait`` is a plain sleep)."""
        return self._observer is not None and self._observer.is_alive() and not self._blind

    def start(self) -> None:
        """Start watching (creates the inbox if missing); falls back to sleeping on failure."""
        if self._observer is not None or self._blind:
            return
        durable_mkdir(self.inbox)
        try:
            from watchdog.observers.inotify import InotifyObserver

            observer = InotifyObserver()
            observer.schedule(
                _Handler(self), str(self.inbox), recursive=False, event_filter=_EVENTS
            )
            observer.start()
        except (ImportError, OSError) as e:
            self._go_blind(f"{type(e).__name__}: {e}")
            return
        self._observer = observer

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=5)
        with self._cond:
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until something happened in the inbox or ``timeout`` seconds passed; True if
        anything happened since the previous call (always True without inotify)."""
        if self._observer is not None and not self._observer.is_alive() and not self._blind:
            self._go_blind("the inotify observer stopped (inbox removed?)")
        if self._blind or self._observer is None:
            if timeout > 0:
                time.sleep(timeout)
            return True
        with self._cond:
            if not self._changed and timeout > 0:
                self._cond.wait(timeout)
            changed, self._changed = self._changed, False
        return changed

    def closed_names(self) -> ClosedFiles:
        """Files closed after writing with no event for their name since, with what each was
        when closed (the intake checks the file still is that)."""
        with self._cond:
            return ClosedFiles(self._closed, self)

    def _forget(self, gone: Iterable[tuple[str, CloseSig]]) -> None:
        with self._cond:
            for name, sig in gone:
                if self._closed.get(name) == sig:
                    del self._closed[name]

    # -- events (observer thread) ---------------------------------------------------------
    def _on_event(self, event: FileSystemEvent) -> None:
        with self._cond:
            self._track(event)
            self._changed = True
            self._cond.notify_all()

    def _track(self, event: FileSystemEvent) -> None:
        if os.path.normpath(os.fsdecode(event.src_path)) == self._inbox_norm:
            return  # the inbox itself: an entry came or went
        name = _base(event.src_path)
        if isinstance(event, FileClosedEvent):
            self._closed.pop(name, None)
            try:
                st = os.lstat(event.src_path)
            except OSError:
                return  # gone already: nothing to vouch for
            if len(self._closed) >= _MAX_CLOSED:
                self._closed.clear()
            # what is there *now*: if the file was replaced since the close, the new one's
            # own events (created, modified) follow this one and drop it again
            self._closed[name] = close_sig(st)
        elif isinstance(event, FileMovedEvent | DirMovedEvent):
            sig = self._closed.pop(name, None)
            dest = _base(event.dest_path) if event.dest_path else ""
            if dest:
                self._closed.pop(dest, None)
                if sig is not None and not event.is_directory:
                    self._closed[dest] = sig  # a closed temp renamed to its final name
        else:
            self._closed.pop(name, None)

    def _go_blind(self, why: str) -> None:
        self._blind = True
        log_event(
            log, 30, "inotify unavailable: the inbox is listed on every wait instead",
            inbox=str(self.inbox), why=why,
        )  # fmt: skip
