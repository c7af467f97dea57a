"""Red, intake: real inbox folders, real renames, real inotify (bridge.red.intake / watch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.errors import ConfigError
from bridge.red import intake as intake_mod
from bridge.red.evidence import REASON_SUFFIX, SAFE_NAME_RE, Evidence, safe_name, shown_name
from bridge.red.intake import REASON_BAD_NAME, REASON_NOT_REGULAR, Intake, ScanResult
from bridge.red.watch import InboxWatcher
from tests.support import REPO, crash_env, crash_marks

HEX = "0123456789abcdef" * 2


def bundle(seq: int, channel: str = "default") -> str:
    return f"{channel}.{seq:012d}.{HEX}.dbundle"


def heartbeat(seq: int, channel: str = "default") -> str:
    return f"{channel}.{seq:012d}.dheartbeat"


class Dirs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.inbox = root / "inbox"
        self.work = root / "work"
        self.processed = root / "processed"
        self.quarantine = root / "quarantine"

    def intake(self, settle: float = 0.0) -> Intake:
        ev = Evidence(self.processed, self.quarantine)
        return Intake(self.inbox, self.work, ev, settle)

    def put(self, name: str | bytes, data: bytes = b"payload") -> Path:
        raw = os.fsencode(name)
        fd = os.open(os.fsencode(self.inbox) + b"/" + raw, os.O_WRONLY | os.O_CREAT, 0o640)
        os.write(fd, data)
        os.close(fd)
        return self.inbox / os.fsdecode(raw)

    def quarantined(self) -> list[Path]:
        return sorted(
            p
            for p in self.quarantine.rglob("*")
            if not p.name.endswith(REASON_SUFFIX) and p.parent.parent == self.quarantine
        )


@pytest.fixture
def dirs(tmp_path: Path) -> Dirs:
    return Dirs(tmp_path)


@pytest.fixture
def watcher(dirs: Dirs) -> Iterator[InboxWatcher]:
    dirs.inbox.mkdir(parents=True, exist_ok=True)
    w = InboxWatcher(dirs.inbox)
    w.start()
    assert w.active
    try:
        yield w
    finally:
        w.stop()


def _reason(p: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads(p.with_name(p.name + REASON_SUFFIX).read_text())
    return data


def _scan_until(intake: Intake, pred, timeout: float = 5.0, **kw) -> ScanResult:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        res = intake.scan(time.monotonic(), **kw)
        if pred(res) or time.monotonic() > deadline:
            return res
        time.sleep(0.02)


# -- setup ------------------------------------------------------------------------------------
def test_creates_missing_folders(dirs: Dirs) -> None:
    intake = dirs.intake()
    for d in (dirs.inbox, dirs.work / "intake", dirs.processed, dirs.quarantine):
        assert d.is_dir()
    assert intake.next_ordinal() == 1
    assert intake.scan(0.0) == ScanResult()


def test_refuses_work_dir_on_another_file_system(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another file system")
    other = shm / f"diode-intake-{os.getpid()}"
    try:
        ev = Evidence(tmp_path / "processed", tmp_path / "quarantine")
        with pytest.raises(ConfigError, match="red.work_dir .* another file system"):
            Intake(tmp_path / "inbox", other, ev, 0)
        ev2 = Evidence(other / "processed", tmp_path / "quarantine")
        with pytest.raises(ConfigError, match="red.processed_dir"):
            Intake(tmp_path / "inbox", tmp_path / "work", ev2, 0)
    finally:
        import shutil

        shutil.rmtree(other, ignore_errors=True)


# -- taking -----------------------------------------------------------------------------------
def test_takes_valid_names_with_increasing_ordinals(dirs: Dirs) -> None:
    intake = dirs.intake()
    names = [bundle(2), bundle(1), heartbeat(1), bundle(1, "other-ch_1")]
    for n in names:
        dirs.put(n, n.encode())
    res = intake.scan(0.0)
    assert res.quarantined == [] and res.waiting == 0
    assert [t.ordinal for t in res.taken] == [1, 2, 3, 4]
    # bundles by name (so by seq within a channel), heartbeats last
    assert [t.name for t in res.taken] == [bundle(1), bundle(2), bundle(1, "other-ch_1"),
                                           heartbeat(1)]  # fmt: skip
    for t in res.taken:
        assert t.path == dirs.work / "intake" / f"{t.ordinal:012d}.{t.name}"
        assert t.path.read_bytes() == t.name.encode() and t.size == len(t.name)
        assert t.received_at.tzinfo is not None
    assert list(dirs.inbox.iterdir()) == []
    assert intake.next_ordinal() == 5
    assert intake.pending() == res.taken


def test_hidden_names_are_ignored_until_abandoned(dirs: Dirs) -> None:
    """A mover's temporaries (hidden names) are left alone while they change; one unchanged
    for hidden_stale_seconds was abandoned: it is quarantined as evidence, never left forever."""
    ev = Evidence(dirs.processed, dirs.quarantine)
    intake = Intake(dirs.inbox, dirs.work, ev, 1.0, hidden_stale_seconds=100.0)
    growing = dirs.put("." + bundle(1) + ".abc.tmp")
    dirs.put("..x.dbundle")
    res = intake.scan(0.0)
    assert (res.hidden, res.taken, res.quarantined) == (2, [], [])
    assert len(list(dirs.inbox.iterdir())) == 2
    assert intake.scan(99.0).hidden == 2
    with open(growing, "ab") as f:  # the mover is still writing this one
        f.write(b"more")
    res = intake.scan(100.0)
    assert res.hidden == 1 and [q.reason for q in res.quarantined] == ["bad_name"]
    assert [p.name for p in dirs.inbox.iterdir()] == [growing.name]
    (q,) = dirs.quarantined()
    why = json.loads(q.with_name(q.name + REASON_SUFFIX).read_text())["detail"]["why"]
    assert "abandoned" in why


BAD_NAMES: list[bytes] = [
    b"DEFAULT.000000000001." + HEX.encode() + b".dbundle",  # uppercase channel
    b"default.000000000001." + HEX.upper().encode() + b".dbundle",  # uppercase id
    b"default.000000000000." + HEX.encode() + b".dbundle",  # seq 0
    b"default.1." + HEX.encode() + b".dbundle",
    b"default.000000000001.dbundle",
    b"default.000000000001." + HEX.encode() + b".dbundle.tmp",
    b"default.000000000001." + HEX.encode() + b".dbundle.part",
    b"x.dbundle",
    b"notes.txt",
    b"a\\b.dbundle",
    b"x\\..\\..\\y.dbundle",
    b"default..000000000001.dheartbeat",
    b"default.000000000001.dheartbeat ",
    b"default.000000000001.dheartbeat\n",
    b"\xff\xfe.dbundle",  # not UTF-8
    "d\u00e9faut.000000000001.dheartbeat".encode(),  # UTF-8 but not ASCII
    b"c" * 120 + b".000000000001.dheartbeat",  # channel too long, name <= 160
    b"c" * 200 + b".dbundle",  # over 160 characters
    b"c" * 247 + b".dbundle",  # 255 bytes: the longest name the kernel allows
]


def test_bad_names_are_quarantined_under_safe_names(dirs: Dirs) -> None:
    intake = dirs.intake()
    for i, raw in enumerate(BAD_NAMES):
        dirs.put(raw, b"data %d" % i)
    dirs.put(bundle(1))
    res = intake.scan(0.0)
    assert [t.name for t in res.taken] == [bundle(1)]
    assert sorted(q.raw_name for q in res.quarantined) == sorted(BAD_NAMES)
    assert list(dirs.inbox.iterdir()) == []
    for q in res.quarantined:
        assert q.reason == REASON_BAD_NAME
        assert SAFE_NAME_RE.fullmatch(q.stored_as.name), q.stored_as
        assert q.stored_as.parent.parent == dirs.quarantine
        reason = _reason(q.stored_as)
        assert reason["reason"] == REASON_BAD_NAME
        detail = reason["detail"]
        assert isinstance(detail, dict)
        assert bytes.fromhex(detail["raw_hex"]) == q.raw_name
        assert detail["raw_name"] == shown_name(q.raw_name)
        assert reason["original_name"] == shown_name(q.raw_name)  # as it arrived, printable
        assert reason["stored_as"] == q.stored_as.name
        i = BAD_NAMES.index(q.raw_name)
        assert q.stored_as.read_bytes() == b"data %d" % i
    assert len({q.stored_as for q in res.quarantined}) == len(BAD_NAMES)


ODD_NAMES: list[tuple[bytes, str]] = [
    (b"notes.txt", "notes.txt"),
    (b"caf\xe9 \xff.dbundle", "caf\\xe9 \\xff.dbundle"),  # not UTF-8
    (b"a\x1b[2J\x1b]0;owned\x07\r\n.dbundle", "a\\x1b[2J\\x1b]0;owned\\x07\\x0d\\x0a.dbundle"),
    ("\u202etxt.exe\u200b.dbundle".encode(), "\\u202etxt.exe\\u200b.dbundle"),  # bidi, zero width
    (b"<script>alert(1)<\\script>", "<script>alert(1)<\\\\script>"),  # plain text, never markup
    (b"\xf0" * 255, "\\xf0" * 255),  # 255 bytes, none of them UTF-8
]


def test_a_refused_name_is_recorded_as_it_arrived(dirs: Dirs) -> None:
    """A file whose name is no wire name is stored under a safe name (``stored_as``), and its
    reason file, its audit record and `diode quarantine list` give the name it arrived under
    (``original_name``, printable: odd bytes escaped), never the safe name."""
    from bridge.config import config_from_dict
    from bridge.red.quarantine import list_quarantined, show_quarantined

    intake = dirs.intake()
    for raw, _ in ODD_NAMES:
        dirs.put(raw)
    res = intake.scan(0.0)
    assert len(res.quarantined) == len(ODD_NAMES) and list(dirs.inbox.iterdir()) == []
    records = {bytes.fromhex(d["raw_name_hex"]): d for d in _records(dirs)}
    for q in res.quarantined:
        shown = dict(ODD_NAMES)[q.raw_name]
        text = q.stored_as.with_name(q.stored_as.name + REASON_SUFFIX).read_bytes()
        assert text.isascii() and all(b >= 0x20 or b == 0x0A for b in text), text
        reason = json.loads(text)
        assert q.stored_as.name == safe_name(q.raw_name) != shown
        assert reason["original_name"] == shown, reason
        assert reason["stored_as"] == q.stored_as.name
        assert reason["detail"]["raw_name"] == shown
        assert bytes.fromhex(reason["detail"]["raw_hex"]) == q.raw_name
        assert records[q.raw_name]["raw_name"] == shown  # what the audit row will say
    cfg = config_from_dict(
        {"channels": [{"name": "c", "encrypt": False}],
         "red": {"quarantine_dir": str(dirs.quarantine)}},
        base=dirs.root, environ={},
    )  # fmt: skip
    listed = {e["stored_as"]: e["original_name"] for e in list_quarantined(cfg)}
    assert listed == {safe_name(raw): shown for raw, shown in ODD_NAMES}
    shown_one = show_quarantined(cfg, safe_name(b"notes.txt"), audit=False)
    assert (shown_one["original_name"], shown_one["record"]["original_name"]) == (
        "notes.txt", "notes.txt",
    )  # fmt: skip
    from click.testing import CliRunner

    from bridge.cli import cli

    toml = dirs.root / "q.toml"
    toml.write_text(f'[[channels]]\nname = "c"\nencrypt = false\n[red]\n'
                    f'quarantine_dir = "{dirs.quarantine}"\n')  # fmt: skip
    toml.chmod(0o600)
    out = CliRunner().invoke(cli, ["quarantine", "list", "--config", str(toml)]).output
    assert f"{safe_name(b'notes.txt')} (arrived as notes.txt)  bad_name" in out, out


def test_same_bad_name_twice_never_overwrites(dirs: Dirs) -> None:
    intake = dirs.intake()
    raw = b"\xff.dbundle"
    dirs.put(raw, b"first")
    first = intake.scan(0.0).quarantined
    dirs.put(raw, b"second")
    second = intake.scan(0.0).quarantined
    assert len(first) == len(second) == 1
    a, b = first[0].stored_as, second[0].stored_as
    assert a != b and b.name == a.name + ".1"
    assert (a.read_bytes(), b.read_bytes()) == (b"first", b"second")


def test_symlink_to_secret_is_quarantined_as_a_link(dirs: Dirs, tmp_path: Path) -> None:
    intake = dirs.intake(settle=30.0)  # not even waiting for settle
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"private")
    os.chmod(secret, 0o600)
    before = os.stat(secret)
    (dirs.inbox / bundle(1)).symlink_to(secret)
    (dirs.inbox / "dangling.dbundle").symlink_to(tmp_path / "nowhere")
    res = intake.scan(0.0)
    assert res.taken == [] and {q.reason for q in res.quarantined} == {REASON_NOT_REGULAR}
    by_raw = {q.raw_name: q.stored_as for q in res.quarantined}
    link = by_raw[bundle(1).encode()]
    assert link.name == bundle(1) and link.is_symlink() and os.readlink(link) == str(secret)
    assert _reason(link)["file_type"] == "symlink"
    assert _reason(link)["original_name"] == bundle(1) == _reason(link)["stored_as"]
    dangling = _reason(by_raw[b"dangling.dbundle"])
    assert dangling["original_name"] == "dangling.dbundle" != dangling["stored_as"]
    assert _reason(link)["sha256"] is None
    after = os.stat(secret)
    assert secret.read_bytes() == b"private"
    assert (after.st_ino, after.st_mtime_ns, after.st_mode) == (
        before.st_ino, before.st_mtime_ns, before.st_mode,
    )  # fmt: skip
    assert by_raw[b"dangling.dbundle"].is_symlink()
    assert list(dirs.inbox.iterdir()) == []


def test_directory_and_fifo_are_quarantined(dirs: Dirs) -> None:
    intake = dirs.intake(settle=30.0)
    (dirs.inbox / bundle(1)).mkdir()
    (dirs.inbox / bundle(1) / "inside").write_bytes(b"x")
    os.mkfifo(dirs.inbox / heartbeat(3))
    res = intake.scan(0.0)
    assert res.taken == []
    got = {q.raw_name: q.stored_as for q in res.quarantined}
    assert (got[bundle(1).encode()] / "inside").read_bytes() == b"x"
    assert _reason(got[bundle(1).encode()])["file_type"] == "directory"
    assert _reason(got[heartbeat(3).encode()])["file_type"] == "fifo"
    assert list(dirs.inbox.iterdir()) == []


def test_file_swapped_for_symlink_after_listing_is_not_taken(
    dirs: Dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    intake = dirs.intake()
    secret = tmp_path / "secret"
    secret.write_bytes(b"private")
    path = dirs.put(bundle(1))
    listed = Intake._list_inbox

    def list_then_swap(self: Intake) -> list[tuple[bytes, os.stat_result]]:
        out = listed(self)
        path.unlink()
        path.symlink_to(secret)  # a hostile writer wins the race
        return out

    monkeypatch.setattr(Intake, "_list_inbox", list_then_swap)
    res = intake.scan(0.0)
    assert res.taken == [] and [q.reason for q in res.quarantined] == [REASON_NOT_REGULAR]
    assert res.quarantined[0].stored_as.is_symlink()
    assert intake.pending() == [] and secret.read_bytes() == b"private"
    assert intake.next_ordinal() == 2  # the ordinal is spent, never reused


def test_file_taken_back_by_the_mover_is_skipped(
    dirs: Dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    intake = dirs.intake()
    gone = dirs.put(bundle(1))
    dirs.put(bundle(2))
    listed = Intake._list_inbox

    def list_then_remove(self: Intake) -> list[tuple[bytes, os.stat_result]]:
        out = listed(self)
        gone.unlink()
        return out

    monkeypatch.setattr(Intake, "_list_inbox", list_then_remove)
    res = intake.scan(0.0)
    assert [(t.ordinal, t.name) for t in res.taken] == [(2, bundle(2))]
    assert res.quarantined == []


# -- settling ---------------------------------------------------------------------------------
def _slow_writer(
    path: Path, seconds: float, done: threading.Event, closing: threading.Event | None = None
) -> threading.Thread:
    """Append to ``path`` for ``seconds`` keeping it open; ``closing`` is set just before the
    close, ``done`` just after."""

    def run() -> None:
        with open(path, "ab", buffering=0) as f:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                f.write(b"x" * 100)
                time.sleep(0.03)
            if closing is not None:
                closing.set()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_slow_in_place_writer_waits_for_settle(dirs: Dirs) -> None:
    settle = 0.4
    intake = dirs.intake(settle=settle)
    path = dirs.inbox / bundle(1)
    done = threading.Event()
    thread = _slow_writer(path, 3 * settle, done)
    while not done.is_set():
        res = intake.scan(time.monotonic())
        assert res.taken == [] and res.quarantined == []
        time.sleep(0.02)
    thread.join()
    closed_at = time.monotonic()
    assert intake.scan(closed_at).waiting == 1
    res = _scan_until(intake, lambda r: bool(r.taken))
    assert [t.name for t in res.taken] == [bundle(1)]
    assert time.monotonic() - closed_at >= settle * 0.9
    assert res.taken[0].size == res.taken[0].path.stat().st_size > 0


def test_unsettled_bad_name_is_not_quarantined_yet(dirs: Dirs) -> None:
    intake = dirs.intake(settle=0.3)
    dirs.put("vendor-temp-name.part")
    assert intake.scan(time.monotonic()).waiting == 1
    assert intake.scan(time.monotonic()).quarantined == []
    res = _scan_until(intake, lambda r: bool(r.quarantined))
    assert [q.reason for q in res.quarantined] == [REASON_BAD_NAME]


def test_watcher_close_beats_settle(dirs: Dirs, watcher: InboxWatcher) -> None:
    intake = dirs.intake(settle=60.0)
    path = dirs.inbox / bundle(1)
    done, closing = threading.Event(), threading.Event()
    thread = _slow_writer(path, 0.5, done, closing)
    res = ScanResult()
    while not done.is_set():
        watcher.wait(0.05)
        names = watcher.closed_names()
        still_open = not closing.is_set()  # checked after the snapshot: no race
        res = intake.scan(time.monotonic(), names)
        if still_open:
            assert res.taken == [], "taken while the writer still had it open"
        elif res.taken:
            break
    thread.join()
    start = time.monotonic()
    while not res.taken and time.monotonic() - start < 5:
        watcher.wait(0.2)
        res = intake.scan(time.monotonic(), watcher.closed_names())
    assert [t.name for t in res.taken] == [bundle(1)]
    assert time.monotonic() - start < 5 < 60
    assert res.taken[0].size == res.taken[0].path.stat().st_size > 0
    assert not path.exists()


def test_a_new_copy_under_a_taken_name_is_not_taken_half_written(
    dirs: Dirs, watcher: InboxWatcher
) -> None:
    """The watcher saw X closed; the intake takes X. A new copy of X that starts arriving
    right away (a resend) must not be taken as "closed" while it is still being written:
    watchdog holds the events after the intake's rename (IN_MOVED_FROM) for ~0.5 s, so the
    name alone is still in the closed set; what was closed (inode, size, mtime) is not it."""
    intake = dirs.intake(settle=60.0)
    path = dirs.put(bundle(1), b"complete copy")
    _wait_for(lambda: bundle(1) in watcher.closed_names())
    res = intake.scan(time.monotonic(), watcher.closed_names())
    assert [t.name for t in res.taken] == [bundle(1)]
    assert bundle(1) not in watcher.closed_names(), "a taken name stays closed"
    with open(path, "wb", buffering=0) as f:  # the new copy, still open for writing
        f.write(b"part")
        deadline = time.monotonic() + 1.5  # past watchdog's hold of the rename's event
        while time.monotonic() < deadline:
            watcher.wait(0.05)
            res = intake.scan(time.monotonic(), watcher.closed_names())
            assert res.taken == [] and res.waiting == 1, "taken while still being written"
        f.write(b" and the rest of it")
    deadline = time.monotonic() + 5  # closed now: taken at once (settle is 60 s)
    while not res.taken and time.monotonic() < deadline:
        watcher.wait(0.05)
        res = intake.scan(time.monotonic(), watcher.closed_names())
    assert [(t.name, t.size) for t in res.taken] == [(bundle(1), len(b"part and the rest of it"))]


def test_watcher_events(dirs: Dirs, watcher: InboxWatcher) -> None:
    watcher.wait(0)
    assert watcher.wait(0.05) is False  # nothing happened
    t0 = time.monotonic()
    threading.Timer(0.1, lambda: dirs.put(bundle(1))).start()
    assert watcher.wait(5) is True
    assert time.monotonic() - t0 < 4
    _wait_for(lambda: bundle(1) in watcher.closed_names())
    # rewritten in place: no longer closed until closed again
    fd = os.open(dirs.inbox / bundle(1), os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"more")
    _wait_for(lambda: bundle(1) not in watcher.closed_names())
    os.close(fd)
    _wait_for(lambda: bundle(1) in watcher.closed_names())
    # a closed hidden temp renamed to its final name stays closed; a removed file is forgotten
    tmp = dirs.put("." + bundle(2) + ".x.tmp")
    _wait_for(lambda: tmp.name in watcher.closed_names())
    os.rename(tmp, dirs.inbox / bundle(2))
    _wait_for(lambda: bundle(2) in watcher.closed_names() and tmp.name not in
              watcher.closed_names())  # fmt: skip
    (dirs.inbox / bundle(1)).unlink()
    _wait_for(lambda: bundle(1) not in watcher.closed_names())
    # non-UTF-8 names are reported as os.fsdecode gives them
    dirs.put(b"\xff.dbundle")
    _wait_for(lambda: os.fsdecode(b"\xff.dbundle") in watcher.closed_names())


def test_watcher_falls_back_to_sleep(dirs: Dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    from watchdog.observers import inotify

    def refuse(self: object) -> None:
        raise OSError(24, "inotify instance limit reached")

    monkeypatch.setattr(inotify.InotifyObserver, "start", refuse)
    w = InboxWatcher(dirs.inbox)
    w.start()
    assert not w.active
    t0 = time.monotonic()
    assert w.wait(0.1) is True and time.monotonic() - t0 >= 0.09
    assert w.wait(0) is True and not w.closed_names()
    w.stop()


def _wait_for(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# -- ordinals across restarts -----------------------------------------------------------------
def test_pending_and_ordinals_survive_restart(dirs: Dirs) -> None:
    intake = dirs.intake()
    for s in (1, 2, 3):
        dirs.put(bundle(s))
    taken = intake.scan(0.0).taken
    again = dirs.intake()  # a restart
    assert again.pending() == taken
    assert again.next_ordinal() == 4
    # landed: the landing moves files out of intake
    taken[0].path.unlink()
    assert [t.ordinal for t in again.pending()] == [2, 3]
    dirs.put(bundle(4))
    assert [t.ordinal for t in again.scan(0.0).taken] == [4]


def test_crash_after_reserving_ordinals_never_reuses_them(
    dirs: Dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    intake = dirs.intake()
    for s in (1, 2, 3):
        dirs.put(bundle(s))
    real = intake_mod.rename_noreplace
    calls = {"n": 0}

    class Crash(BaseException):
        pass

    def crash_on_second(src: Path, dst: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise Crash
        real(src, dst)

    monkeypatch.setattr(intake_mod, "rename_noreplace", crash_on_second)
    with pytest.raises(Crash):
        intake.scan(0.0)
    monkeypatch.setattr(intake_mod, "rename_noreplace", real)
    restarted = dirs.intake()
    assert [(t.ordinal, t.name) for t in restarted.pending()] == [(1, bundle(1))]
    assert restarted.next_ordinal() == 4  # 2 and 3 were reserved: gaps, never reused
    res = restarted.scan(0.0)
    assert [(t.ordinal, t.name) for t in res.taken] == [(4, bundle(2)), (5, bundle(3))]
    ordinals = [t.ordinal for t in restarted.pending()]
    assert ordinals == sorted(set(ordinals)) == [1, 4, 5]


def test_counter_lost_restarts_above_pending(dirs: Dirs) -> None:
    intake = dirs.intake()
    for s in (1, 2):
        dirs.put(bundle(s))
    intake.scan(0.0)
    (dirs.work / "intake" / "NEXT").unlink()
    assert dirs.intake().next_ordinal() == 3


def test_two_intakes_never_share_an_ordinal(dirs: Dirs) -> None:
    a, b = dirs.intake(), dirs.intake()
    names = [bundle(s) for s in range(1, 201)]
    got: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def run(intake: Intake) -> None:
        while not stop.is_set():
            res = intake.scan(0.0)
            with lock:
                got.extend(t.ordinal for t in res.taken)

    threads = [threading.Thread(target=run, args=(i,)) for i in (a, b)]
    for t in threads:
        t.start()
    for n in names:
        dirs.put(n)
    _wait_for(lambda: len(got) == len(names), timeout=20)
    stop.set()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == len(names)
    assert sorted(t.name for t in a.pending()) == sorted(names)


# ------------------------------------------------------------ quarantines are always audited

_SCAN_AND_DIE = """
import sys
from pathlib import Path
from bridge.red.evidence import Evidence
from bridge.red.intake import Intake
root = Path(sys.argv[1])
ev = Evidence(root / "processed", root / "quarantine")
Intake(root / "inbox", root / "work", ev, 0.0).scan(0.0)
"""


def _scan_and_die(dirs: Dirs, point: str) -> None:
    """One intake scan in its own process with crash point ``point`` armed: it must die there
    by SIGKILL."""
    mark = dirs.root / "crash.mark"
    env = {**os.environ, **crash_env(point, mark), "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", _SCAN_AND_DIE, str(dirs.root)], env=env, timeout=60, check=False
    )
    assert r.returncode == -signal.SIGKILL and crash_marks(mark) == [point]


def _records(dirs: Dirs) -> list[dict[str, str]]:
    return [json.loads(p.read_bytes()) for p in sorted((dirs.work / "audit-pending").iterdir())]


def test_a_kill_inside_a_quarantine_leaves_its_audit_record_once(dirs: Dirs) -> None:
    """kill -9 after the file and its reason file are in quarantine, before the inbox entry
    goes (``red.quarantine_before_drop``): the audit record is already durable, and the next
    scan finishes the move and writes the same record, not a second one."""
    dirs.intake()  # the folders
    dirs.put("junk name.txt")
    _scan_and_die(dirs, "red.quarantine_before_drop")
    assert (dirs.inbox / "junk name.txt").exists(), "the crash did not hit the window"
    (q,) = dirs.quarantined()
    (doc,) = _records(dirs)
    assert doc["stored_as"] == str(q) and doc["reason"] == REASON_BAD_NAME

    res = dirs.intake().scan(0.0)
    assert [x.stored_as for x in res.quarantined] == [q]  # the same place, reused
    assert not (dirs.inbox / "junk name.txt").exists() and dirs.quarantined() == [q]
    (again,) = _records(dirs)
    assert {**again, "at": None} == {**doc, "at": None}  # one record: overwritten, not added


def test_a_kill_before_an_entrys_rename_leaves_its_reason_and_record(dirs: Dirs) -> None:
    """An inbox entry that cannot be hard-linked (a directory) is renamed into quarantine:
    kill -9 just before the rename (``red.evidence_before_rename``) finds its reason file and
    audit record already durable, and the next scan renames it into the reserved name."""
    dirs.intake()  # the folders
    (dirs.inbox / "a-directory").mkdir()
    _scan_and_die(dirs, "red.evidence_before_rename")
    assert (dirs.inbox / "a-directory").is_dir(), "the crash did not hit the window"
    (doc,) = _records(dirs)
    assert doc["reason"] == REASON_NOT_REGULAR
    reserved = Path(doc["stored_as"])
    assert not reserved.exists() and reserved.with_name(reserved.name + REASON_SUFFIX).exists()

    res = dirs.intake().scan(0.0)
    assert [x.stored_as for x in res.quarantined] == [reserved]
    assert reserved.is_dir() and not (dirs.inbox / "a-directory").exists()
    (again,) = _records(dirs)
    assert {**again, "at": None} == {**doc, "at": None}
    assert dirs.quarantined() == [reserved]
    reason = json.loads(reserved.with_name(reserved.name + REASON_SUFFIX).read_bytes())
    assert reason["reason"] == REASON_NOT_REGULAR and reason["stored_as"] == reserved.name


def test_a_non_regular_entry_left_in_intake_is_audited(dirs: Dirs) -> None:
    """A crash inside a take can leave a non-regular entry under an intake name: ``pending``
    quarantines it, and its audit record is written like any other."""
    intake = dirs.intake()
    (dirs.work / "intake" / f"000000000007.{bundle(7)}").mkdir()
    assert intake.pending() == []
    (q,) = dirs.quarantined()
    (doc,) = _records(dirs)
    assert doc["reason"] == REASON_NOT_REGULAR and doc["stored_as"] == str(q)
    assert bytes.fromhex(doc["raw_name_hex"]).decode() == f"000000000007.{bundle(7)}"
    reason = json.loads(q.with_name(q.name + REASON_SUFFIX).read_bytes())
    assert (reason["original_name"], reason["stored_as"]) == (bundle(7), q.name)
