"""Unit: durable directories (exact mode, fsynced in their parent), atomic writes, timed locks."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge import fsutil
from bridge.diode.file_drop import _TEMP_RE
from bridge.errors import BundleNameError, StateError
from bridge.fsutil import (
    DIR_MODE,
    FILE_MODE,
    atomic_write_bytes,
    durable_mkdir,
    exclusive_lock,
    lock_held,
    shared_lock,
    tmp_path_for,
)
from bridge.protocol.naming import (
    MAX_SEQ,
    bundle_name,
    heartbeat_name,
    parse_bundle_name,
    parse_heartbeat_name,
)


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every directory fsutil fsyncs (the real fsync still runs)."""
    seen: list[Path] = []
    real = fsutil.fsync_dir

    def spy(path: Path) -> None:
        seen.append(Path(path))
        real(path)

    monkeypatch.setattr(fsutil, "fsync_dir", spy)
    return seen


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_durable_mkdir_creates_parents_with_exact_mode_each_fsynced_in_its_parent(
    tmp_path: Path, strict_umask: None, synced: list[Path]
) -> None:
    target = tmp_path / "a" / "b" / "c"
    assert durable_mkdir(target) == target
    for d in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert mode(d) == DIR_MODE, d  # not masked to 0o700 by the umask
    assert synced == [tmp_path, tmp_path / "a", tmp_path / "a" / "b"]


def test_durable_mkdir_leaves_an_existing_directory_alone(
    tmp_path: Path, synced: list[Path]
) -> None:
    d = tmp_path / "mine"
    d.mkdir(mode=0o770)
    os.chmod(d, 0o770)  # e.g. an operator gave the mover's group write access
    durable_mkdir(d)
    assert mode(d) == 0o770 and synced == []
    durable_mkdir(d, mode=0o700)
    assert mode(d) == 0o770


def test_durable_mkdir_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        durable_mkdir(tmp_path / "f")
    with pytest.raises(NotADirectoryError):
        durable_mkdir(tmp_path / "f" / "sub")


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200_000))
def test_atomic_write_round_trip(tmp_path: Path, data: bytes) -> None:
    final = tmp_path / "state" / "x.json"
    atomic_write_bytes(final, data)
    assert final.read_bytes() == data
    assert mode(final) == FILE_MODE
    assert sorted(os.listdir(final.parent)) == ["x.json"], "no temp file left"


def test_atomic_write_exact_mode_and_cleanup_on_failure(
    tmp_path: Path, strict_umask: None, synced: list[Path]
) -> None:
    final = tmp_path / "new" / "key.asc"
    atomic_write_bytes(final, b"pub", mode=0o644)
    assert mode(final) == 0o644 and mode(final.parent) == DIR_MODE
    assert synced == [tmp_path, final.parent], "the new folder, then the rename"
    blocker = tmp_path / "new" / "dir"
    (blocker / "inside").mkdir(parents=True)  # os.replace onto a non-empty folder fails
    with pytest.raises(OSError):
        atomic_write_bytes(blocker, b"x")
    assert sorted(os.listdir(tmp_path / "new")) == ["dir", "key.asc"], "temp removed"


_channel = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,62}", fullmatch=True)
_seq = st.integers(1, MAX_SEQ)


@given(
    name=st.one_of(
        st.builds(bundle_name, _channel, _seq, st.from_regex(r"[0-9a-f]{32}", fullmatch=True)),
        st.builds(heartbeat_name, _channel, _seq),
    )
)
def test_temp_names_are_always_swept_and_never_wire_names(name: str) -> None:
    tmp = tmp_path_for(Path("/staging") / name).name
    assert tmp.startswith(".") and _TEMP_RE.match(tmp), tmp
    for parse in (parse_bundle_name, parse_heartbeat_name):
        with pytest.raises(BundleNameError):
            parse(tmp)


def test_shared_holders_coexist_and_keep_an_exclusive_one_out(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "drop.lock"
    with shared_lock(lock, what="resend 1"), shared_lock(lock, what="resend 2"):
        with pytest.raises(StateError) as e:
            with exclusive_lock(lock, what="sweep", timeout=0.02, hint="wait for the resend"):
                pass
    msg = str(e.value)
    assert msg.startswith("sweep: waited 0.02s for an exclusive lock on ")
    assert str(lock) in msg and "wait for the resend" in msg and "fuser -v" in msg
    assert mode(lock) == FILE_MODE and mode(lock.parent) == DIR_MODE
    with exclusive_lock(lock, what="sweep"):  # free again
        with pytest.raises(StateError, match=r"^resend: another process holds .*retry once"):
            with shared_lock(lock, what="resend"):
                pass


def test_a_waiting_lock_is_granted_when_the_holder_lets_go(tmp_path: Path) -> None:
    lock = tmp_path / "black.lock"
    got = threading.Event()

    def waiter() -> None:
        with shared_lock(lock, what="re-drop", timeout=120):
            got.set()

    with exclusive_lock(lock, what="sweep"):
        t = threading.Thread(target=waiter)
        t.start()
        t.join(0.2)
        assert t.is_alive() and not got.is_set(), "the waiter waits while the lock is held"
    t.join()
    assert got.is_set()


def test_lock_held_tells_a_held_lock_and_creates_nothing(tmp_path: Path) -> None:
    lock = tmp_path / "state" / "red.lock"
    assert lock_held(lock) is False and not lock.parent.exists()  # nothing created
    with exclusive_lock(lock, what="test"):
        assert lock_held(lock) is True
        assert lock_held(lock) is True  # asking twice takes nothing away from the holder
    assert lock_held(lock) is False
    with exclusive_lock(lock, what="test again"):  # and asking left no lock behind
        pass
