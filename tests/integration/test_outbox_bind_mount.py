"""Diode, file drop: an outbox behind a bind mount of the staging dir's own file system.

A bind mount keeps the device number (st_dev) but rename(2) still refuses to cross it
(EXDEV): every delivery would fail and black would be stuck. The Outbox and ``diode check``
find it with a rename probe and refuse with the fix, putting nothing in the outbox (a mover
takes every file there, dot-files included); a bind mount made while black runs gets the
same fix in the delivery's error. The default layout inside one bind-mounted folder works.

Real bind mounts (``mount --bind``): needs root (or CAP_SYS_ADMIN), skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bridge.diode.file_drop import Outbox, default_staging
from bridge.errors import ConfigError, TransportError

REPO = Path(__file__).resolve().parents[2]
BUNDLE = "ops.000000000001." + "ab" * 16 + ".dbundle"
BEAT = "ops.000000000001.dheartbeat"


@contextmanager
def bind_mount(src: Path, dst: Path) -> Iterator[Path]:
    """``mount --bind src dst`` for the block; skips the test when mounting is not permitted."""
    src.mkdir(parents=True, exist_ok=True)
    dst.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True,
                       check=False)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"needs a bind mount (root or CAP_SYS_ADMIN): mount --bind said "
                    f"{r.stderr.strip() or r.returncode}")  # fmt: skip
    try:
        yield dst
    finally:
        u = subprocess.run(["umount", str(dst)], capture_output=True, text=True, check=False)
        if u.returncode != 0:  # busy: detach it now, the kernel frees it when unused
            subprocess.run(["umount", "-l", str(dst)], check=True)


def listing(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def test_outbox_bind_mounted_on_the_staging_file_system_is_refused_at_start(
    tmp_path: Path,
) -> None:
    outbox, staging = tmp_path / "black" / "outbox", tmp_path / "black" / "staging"
    staging.mkdir(parents=True)
    with bind_mount(tmp_path / "elsewhere", outbox):
        assert os.stat(outbox).st_dev == os.stat(staging).st_dev, "the case under test"
        with pytest.raises(ConfigError) as e:
            Outbox(outbox, tmp_path / "black" / "archive", retention_days=1, staging=staging)
        msg = str(e.value)
        assert f"black.staging_dir {staging} and black.outbox {outbox}" in msg, msg
        assert "different mounts (a bind mount)" in msg and "Invalid cross-device link" in msg
        assert str(default_staging(outbox)) in msg and "mount the folder above it" in msg, msg
        assert listing(outbox) == [], "the probe must put nothing where a mover looks"
        assert listing(staging) == [], "nor leave anything in the staging dir"


def test_udp_outbox_behind_a_bind_mount_is_refused_at_start(tmp_path: Path) -> None:
    black = tmp_path / "black"
    udp = black / "udp-outbox"
    with bind_mount(tmp_path / "elsewhere", udp):
        with pytest.raises(ConfigError, match=r"and black\.udp_outbox .* different mounts"):
            Outbox(black / "outbox", black / "archive", retention_days=1,
                   channel_dirs={"u1": udp})  # fmt: skip
        assert listing(udp) == []


def test_an_outbox_mounted_read_only_is_refused_at_start(tmp_path: Path) -> None:
    """The probe also meets a read-only mount (EROFS) before any delivery does."""
    disk = tmp_path / "disk"
    for d in ("outbox", ".outbox.staging"):
        (disk / d).mkdir(parents=True)
    with bind_mount(disk, tmp_path / "black") as black:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(black)], capture_output=True,
                           text=True, check=False)  # fmt: skip
        if r.returncode != 0:
            pytest.skip(f"cannot remount the bind mount read-only: {r.stderr.strip()}")
        with pytest.raises(ConfigError) as e:
            Outbox(black / "outbox", tmp_path / "archive", retention_days=1)
        msg = str(e.value)
        assert f"black.outbox {black / 'outbox'} refuses a rename from black.staging_dir" in msg
        assert "Read-only file system" in msg and "mounted read-write" in msg, msg


def test_the_default_layout_inside_one_bind_mounted_folder_works(tmp_path: Path) -> None:
    """The fix the error gives: mount the folder above the outbox, staging beside it."""
    with bind_mount(tmp_path / "disk", tmp_path / "black") as black:
        ob = Outbox(black / "outbox", black / "archive", retention_days=1)
        ob.publish(ob.stage_bytes(BEAT, b"beat"), BEAT, channel="ops")
        assert listing(black / "outbox") == [BEAT]


def test_a_bind_mount_made_after_start_fails_deliveries_with_the_fix(tmp_path: Path) -> None:
    """Mounted over the outbox while black runs: the EXDEV of publish, deliver and resend says
    what is wrong and how to fix it, not only "Invalid cross-device link"."""
    black = tmp_path / "black"
    ob = Outbox(black / "outbox", black / "archive", retention_days=1)
    (black / "archive" / "ops").mkdir(parents=True)
    (black / "archive" / "ops" / BUNDLE).write_bytes(b"sealed")
    hint = (
        rf"black\.staging_dir {ob.staging} and {ob.outbox} are on different mounts "
        r"\(another file system, or a bind mount of the same one\).*mount the folder above it"
    )
    with bind_mount(tmp_path / "elsewhere", black / "outbox"):
        with pytest.raises(TransportError, match=rf"cannot move {BEAT} .*{hint}"):
            ob.publish(ob.stage_bytes(BEAT, b"beat"), BEAT, channel="ops")
        sealed = ob.temp_for(BUNDLE)
        sealed.write_bytes(b"sealed")
        with pytest.raises(TransportError, match=rf"cannot deliver {BUNDLE} .*{hint}"):
            ob.deliver(BUNDLE, sealed, channel="ops", archive=False)
        sealed.unlink()
        with pytest.raises(TransportError, match=rf"stopped at bundle seq 1 .*{hint}"):
            ob.resend("ops", 1, 1)
        with pytest.raises(TransportError, match=rf"cannot re-drop {BUNDLE} .*{hint}"):
            ob.redrop("ops", BUNDLE)
        assert listing(black / "outbox") == []
    assert listing(ob.staging) == [".drop.lock"]


def test_diode_check_refuses_an_outbox_behind_a_bind_mount(tmp_path: Path) -> None:
    """``diode check`` creates nothing; its probe renames an absent name between the existing
    folders (or their nearest existing parents)."""
    cfg = tmp_path / "diode.toml"
    cfg.write_text('[[channels]]\nname = "ops"\nencrypt = false\n\n[black]\ndiscover = false\n')
    outbox = tmp_path / "black" / "outbox"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DIODE_CONFIG", None)
    with bind_mount(tmp_path / "elsewhere", outbox):
        r = subprocess.run(
            [sys.executable, "-m", "bridge.cli", "check", "--config", str(cfg)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert "black.staging_dir" in r.stderr and f"black.outbox {outbox}" in r.stderr
        assert "different mounts (a bind mount)" in r.stderr, r.stderr
        assert "mount the folder above it" in r.stderr, r.stderr
        assert listing(outbox) == []
        assert listing(tmp_path / "black") == ["outbox"], "check must create nothing"
