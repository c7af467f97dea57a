"""Black, spool files: a spool file or folder the file system refuses (another owner, an
immutable attribute) is found at start by the job's check and by the tap's open, and while the
tap writes, as a ConfigError naming the file, the channel, black.spool_dir and the fix; a TAIL
update refused after its batch was durable never makes that batch be written twice. Real files
refused for real (``chattr +i`` as root, mode 0400 / 0500 otherwise), no mock."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bridge.black.job import check_black_writable, make_black_dirs
from bridge.black.spool import SpoolReader, SpoolWriter
from bridge.config import Config
from bridge.diode.file_drop import Outbox
from bridge.errors import ConfigError
from tests.unit.test_file_drop_places import config

CHANNEL = "f1"
ROOT = os.geteuid() == 0


@contextmanager
def refused(path: Path) -> Iterator[str]:
    """Make ``path`` (a file or a folder) refuse the writes of the user running the tests, for
    real: ``chattr +i`` as root (mode bits do not stop root), else mode 0400 (a file) or 0500 (a
    folder). Yields the fix the message must name; restored afterwards."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if ROOT:
        r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"chattr +i refused on {path}'s file system: {r.stderr.strip()}")
    else:
        path.chmod(0o500 if path.is_dir() else 0o400)
    try:
        yield f"`chattr -i -a {path}`" if ROOT else f"`chown -R {os.getuid()} "
    finally:
        if ROOT:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(mode)


def _spool(tmp_path: Path, records: int = 3) -> tuple[Config, Path]:
    """Black's dirs and channel f1's spool as a tap left it: LOCK, TAIL, a segment of records."""
    cfg = config(tmp_path)
    Outbox.from_config(cfg)
    make_black_dirs(cfg)
    root = Path(cfg.black.spool_dir)
    with SpoolWriter.open(root, CHANNEL, min_free_bytes=0) as w:
        for i in range(records):
            w.append_one("ev", "rk", False, b"", b"body-%d" % i)
        w.sync(-1)
    return cfg, root / CHANNEL


def _last_segment(d: Path) -> Path:
    return sorted(d.glob("seg-*.arrow"))[-1]


def _bodies(root: Path) -> list[bytes]:
    r = SpoolReader(root, CHANNEL)
    return [row["body"] for b in r.read(r.first_pos(), r.durable_end()) for row in b.to_pylist()]


@pytest.mark.parametrize("name", ["LOCK", "TAIL", "segment"])
def test_a_spool_file_black_cannot_write_is_refused_at_start(tmp_path: Path, name: str) -> None:
    """Restored under another owner, or immutable: the folder check passed (files can be made
    and removed there) and the tap died mid-run with a traceback of its own, the job saying
    only ``tap failed for channel(s) {...}``. Now the job's check (``diode check`` too) and
    the tap's open name the file, the channel, the key and the fix; nothing is changed."""
    cfg, d = _spool(tmp_path)
    path = _last_segment(d) if name == "segment" else d / name
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in d.iterdir()}
    with refused(path) as fix:
        checks = {
            "job check": lambda: check_black_writable(cfg),
            "job start": lambda: make_black_dirs(cfg),
            "tap open": lambda: SpoolWriter.open(d.parent, CHANNEL, min_free_bytes=0).close(),
        }
        for what, check in checks.items():
            with pytest.raises(ConfigError) as e:
                check()
            msg = str(e.value)
            assert f"black.spool_dir: {path}, in the spool of channel '{CHANNEL}'," in msg, what
            assert "is not writable by the user running black" in msg, (what, msg)
            assert f"(uid {os.getuid()}; " in msg and fix in msg, (what, msg)
            assert "or point black.spool_dir elsewhere" in msg, (what, msg)
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in d.iterdir()}
    assert after == before, "the check creates and changes nothing"
    from bridge.black.spool import unwritable_spool_file  # here: the old code had none

    assert unwritable_spool_file(d.parent, CHANNEL) is None
    assert _bodies(d.parent) == [b"body-0", b"body-1", b"body-2"]


def test_a_tail_refused_after_its_batch_is_durable_never_writes_that_batch_twice(
    tmp_path: Path,
) -> None:
    """TAIL is updated after the batch is fsynced. When that update failed, the batch's
    records stayed pending: the tap took the OSError for a lost broker connection and synced
    them again, at new positions (and the broker, never acked, redelivered them a third
    time). Now the failure is a ConfigError naming TAIL, and a retry writes nothing again."""
    _, d = _spool(tmp_path)
    with SpoolWriter.open(d.parent, CHANNEL, min_free_bytes=0) as w:
        for i in range(3, 5):
            w.append_one("ev", "rk", False, b"", b"body-%d" % i)
        with refused(d / "TAIL") as fix:
            with pytest.raises((ConfigError, OSError)) as e:  # the old code: a bare OSError
                w.sync(2)
            assert (w.pending, w.durable_end) == (0, 5), "durable: nothing left to write again"
            size = _last_segment(d).stat().st_size
            assert w.sync(2) == 5, "what the tap did next: the records are not written again"
            assert _last_segment(d).stat().st_size == size
    msg = str(e.value)
    assert isinstance(e.value, ConfigError), f"a bare {e.value!r}"
    assert f"{d / 'TAIL'}, in the spool of channel '{CHANNEL}'," in msg, msg
    assert fix in msg and "Nothing that is not durable was acked" in msg, msg
    with SpoolWriter.open(d.parent, CHANNEL, min_free_bytes=0) as w:
        assert w.durable_end == 5 and w.acked_through == 2
    assert _bodies(d.parent) == [b"body-%d" % i for i in range(5)]


def test_a_folder_that_refuses_a_new_segment_or_a_release_names_the_folder(
    tmp_path: Path,
) -> None:
    """Mid-run, the folder's permissions changed: the next segment could not be made, or a
    shipped one removed. That was a bare PermissionError the tap took for a lost broker
    connection (it reconnected, then died with a traceback); now it is a ConfigError naming
    the file or folder and the fix, and the writer goes on once the folder is writable."""
    _, d = _spool(tmp_path)  # seg-0 holds positions 0..2
    with SpoolWriter.open(d.parent, CHANNEL, min_free_bytes=0) as w:  # seg-0 closed, seg-3 made
        w.append_one("ev", "rk", False, b"", b"body-3")
        w.sync(3)
        segments = sorted(p.name for p in d.glob("seg-*"))
        sizes = sum((d / n).stat().st_size for n in segments)
        with refused(d) as fix:
            with pytest.raises(ConfigError) as rolled:
                w.make_releasable(3)  # closes seg-3: a new segment, refused
            with pytest.raises(ConfigError) as released:
                w.release_through(3)  # removes seg-0, refused
        assert sorted(p.name for p in d.glob("seg-*")) == segments
        seg4 = d / "seg-0000000000000004.arrow"
        assert f"black.spool_dir: {seg4}, in the spool of channel '{CHANNEL}'," in str(rolled.value)
        assert f"black.spool_dir: {d}, the spool folder of channel '{CHANNEL}'," in str(
            released.value
        )
        for e in (rolled, released):
            msg = str(e.value)
            assert "is not writable by the user running black" in msg, msg
            assert (f"`chattr -i -a {d}`" if ROOT else f"{fix}{d}`") in msg, msg
        assert w.make_releasable(3), "the folder writable again"
        assert w.release_through(3) == sizes and w.used_bytes() == seg4.stat().st_size
    assert sorted(p.name for p in d.glob("seg-*")) == [seg4.name]
