"""Test support: a greedy vendor mover that takes every file the moment it appears in a folder.

``GreedyMover(src, dst)`` watches ``src`` with inotify (watchdog) and, as a fallback, polls it
every few milliseconds; every entry that shows up — dot-files included — is taken at once:
moved into ``dst`` (or, with ``delete=True``, read and deleted, like a mover that ships a file
and removes it). Each take records the name and a hash of the bytes *at that moment*, so
:meth:`GreedyMover.validate` can prove that every file black ever exposed was already whole: a
complete, validly signed bundle or heartbeat whose authenticated content matches its name.
Files keep their names in ``dst``; a name taken again (a re-drop) goes to ``dst/dup/``.

The ``greedy_mover`` fixture starts movers and stops them after the test::

    def test_x(greedy_mover):
        mover = greedy_mover(outbox)
        ...  # run black
        mover.stop()
        report = mover.validate(Gpg(red_home), [black_fpr])
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from bridge.crypto.gpg import Gpg
from bridge.errors import BundleNameError, DiodeError
from bridge.fsutil import FILE_MODE
from bridge.protocol.bundle import unpack_bundle
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.naming import parse_bundle_name, parse_heartbeat_name

__all__ = ["GreedyMover", "MoverReport", "Taken", "greedy_mover"]


@dataclass(frozen=True)
class Taken:
    """One file the mover took."""

    name: str
    """Its name in the watched folder."""
    stored: Path
    """Where the mover keeps it."""
    size: int
    sha256: str
    """Of the bytes as they were when the mover took the file."""
    mode: int
    """Permission bits of the file as black left it."""


@dataclass
class MoverReport:
    """What :meth:`GreedyMover.validate` found: every file whole and valid."""

    bundles: list[str] = field(default_factory=list)
    heartbeats: list[str] = field(default_factory=list)


class _Events(FileSystemEventHandler):
    def __init__(self, mover: GreedyMover) -> None:
        self.mover = mover

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory or event.event_type in ("deleted", "opened", "closed_no_write"):
            return
        for raw in (event.src_path, event.dest_path):
            path = os.fsdecode(raw)
            if path and os.path.dirname(path) == self.mover.src_str:
                self.mover.take(os.path.basename(path))


class GreedyMover:
    """Moves (or deletes) every file of ``src`` the moment it appears; see the module doc."""

    def __init__(
        self, src: Path, dst: Path, *, delete: bool = False, poll_seconds: float = 0.002
    ) -> None:
        self.src, self.dst = Path(src), Path(dst)
        self.src.mkdir(mode=0o750, parents=True, exist_ok=True)
        (self.dst / "dup").mkdir(parents=True, exist_ok=True)
        self.src_str = os.fspath(self.src)
        self.delete = delete
        self.poll_seconds = poll_seconds
        self._rename = not delete and os.stat(self.src).st_dev == os.stat(self.dst).st_dev
        self._lock = threading.Lock()
        self._taken: list[Taken] = []
        self._stored: set[str] = set()
        self.strays: list[str] = []
        """Entries that are not regular files (black never puts one in the outbox)."""
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="greedy-mover", daemon=True)
        self._observer = Observer()
        self._observer.schedule(_Events(self), self.src_str, recursive=False)

    # ------------------------------------------------------------------ running

    def start(self) -> GreedyMover:
        self._observer.start()  # the inotify watch exists when start() returns
        self._poller.start()
        return self

    def stop(self) -> None:
        """Stop watching, then take whatever is still there (so nothing is left unchecked)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join()
        if self._observer.is_alive():
            self._observer.unschedule_all()  # no event is queued into a stopped emitter
            self._observer.stop()
            self._observer.join()
        self.scan()

    def __enter__(self) -> GreedyMover:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(self.poll_seconds)

    def scan(self) -> None:
        """Take every entry of ``src`` now."""
        try:
            names = os.listdir(self.src)
        except FileNotFoundError:
            return
        for name in names:
            self.take(name)

    def take(self, name: str) -> None:
        """Take ``src/name`` if it is (still) there; record it."""
        path = self.src / name
        with self._lock:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return
            if not stat.S_ISREG(st.st_mode):
                if name not in self.strays:
                    self.strays.append(name)
                return
            stored = self.dst / name
            if name in self._stored or stored.exists():
                stored = self.dst / "dup" / f"{len(self._taken)}.{name}"
            if self._rename:
                try:
                    os.rename(path, stored)
                except FileNotFoundError:
                    return
                data = stored.read_bytes()
            else:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except FileNotFoundError:
                    return
                try:
                    data = _read_all(fd)
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(fd)
                stored.write_bytes(data)
            self._stored.add(name)
            self._taken.append(
                Taken(
                    name=name,
                    stored=stored,
                    size=len(data),
                    sha256=hashlib.sha256(data).hexdigest(),
                    mode=stat.S_IMODE(st.st_mode),
                )
            )

    # ------------------------------------------------------------------ results

    @property
    def taken(self) -> list[Taken]:
        with self._lock:
            return list(self._taken)

    @property
    def names(self) -> list[str]:
        """Every name taken, in order (a re-dropped bundle appears once per drop)."""
        return [t.name for t in self.taken]

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Block until at least ``count`` files were taken (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while len(self.taken) < count:
            assert time.monotonic() < deadline, f"mover took {len(self.taken)} of {count} files"
            time.sleep(0.005)

    def validate(
        self,
        gpg: Gpg,
        pinned_signers: Sequence[str],
        *,
        expect_mode: int | None = FILE_MODE,
    ) -> MoverReport:
        """Assert that every file taken was whole and valid; returns what it was.

        Each file must be named as a bundle or a heartbeat, unchanged since it was taken,
        open (decrypt if encrypted, verify) with ``gpg`` under a pinned signer, and carry
        authenticated content that agrees with its name: a bundle's manifest (checked against
        its rows) names the same channel, bundle seq and id; a heartbeat the same channel and
        heartbeat seq. ``expect_mode`` (if not None) is the permission bits black must give it.
        """
        report = MoverReport()
        problems: list[str] = []
        for t in self.taken:
            data = t.stored.read_bytes()
            if hashlib.sha256(data).hexdigest() != t.sha256:
                problems.append(f"{t.name}: changed after the mover took it (still being written)")
                continue
            if expect_mode is not None and t.mode != expect_mode:
                problems.append(f"{t.name}: mode {t.mode:o}, expected {expect_mode:o}")
            try:
                problem = self._check(t.name, data, gpg, pinned_signers, report)
            except DiodeError as e:
                problem = f"{type(e).__name__}: {e}"
            if problem:
                problems.append(f"{t.name} ({t.size} bytes): {problem}")
        problems += [f"{n}: not a regular file" for n in self.strays]
        assert not problems, f"the greedy mover took {len(problems)} bad file(s):\n" + "\n".join(
            problems
        )
        return report

    @staticmethod
    def _check(
        name: str, data: bytes, gpg: Gpg, pinned: Sequence[str], report: MoverReport
    ) -> str | None:
        try:
            bn = parse_bundle_name(name)
        except BundleNameError:
            pass
        else:
            plain, _ = gpg.open_bytes(data, pinned_signers=pinned)
            m, _rows = unpack_bundle(plain)
            if (m.channel, m.bundle_seq, m.bundle_id) != (bn.channel, bn.bundle_seq, bn.bundle_id):
                return f"manifest says {m.where}"
            report.bundles.append(name)
            return None
        try:
            hn = parse_heartbeat_name(name)
        except BundleNameError:
            return "neither a bundle nor a heartbeat name (a temp or stray file was exposed)"
        plain, _ = gpg.open_bytes(data, pinned_signers=pinned)
        hb = Heartbeat.from_json(plain)
        if (hb.channel, hb.heartbeat_seq) != (hn.channel, hn.heartbeat_seq):
            return f"content says {hb.where}"
        report.heartbeats.append(name)
        return None


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture
def greedy_mover(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., GreedyMover]]:
    """Start a :class:`GreedyMover` on a folder: ``greedy_mover(src, dst=None, delete=False)``.

    ``dst`` defaults to a fresh temp folder; every mover is stopped after the test.
    """
    started: list[GreedyMover] = []

    def start(src: Path, dst: Path | None = None, *, delete: bool = False) -> GreedyMover:
        mover = GreedyMover(src, dst or tmp_path_factory.mktemp("taken"), delete=delete)
        started.append(mover.start())
        return mover

    yield start
    for mover in started:
        mover.stop()
