"""Black, job start: a directory black cannot create or write is a ConfigError naming its key."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bridge.black.job import check_black_writable, make_black_dirs
from bridge.black.spool import SPOOL_DIR_MODE
from bridge.config import Config
from bridge.diode.file_drop import Outbox
from bridge.errors import ConfigError
from tests.support import small_tmpfs
from tests.unit.test_file_drop_places import config


@pytest.mark.parametrize("key", ["state_dir", "spool_dir", "checkpoint_dir"])
def test_a_directory_under_a_regular_file_is_a_config_error_naming_its_key(
    tmp_path: Path, key: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    cfg = config(tmp_path, **{key: "a-file/sub"})
    with pytest.raises(ConfigError) as e:
        make_black_dirs(cfg)
    msg = str(e.value)
    assert f"cannot create black.{key} {tmp_path / 'a-file' / 'sub'}" in msg
    assert f"point black.{key} elsewhere" in msg


def test_the_directories_are_made_with_their_modes(tmp_path: Path) -> None:
    make_black_dirs(config(tmp_path))
    for name, mode in (("state", 0o750), ("spool", SPOOL_DIR_MODE)):
        assert stat.S_IMODE((tmp_path / "black" / name).stat().st_mode) == mode, name
    assert not (tmp_path / "black" / "checkpoint").exists(), "Spark makes it, once it starts"


def test_a_checkpoint_dir_on_a_read_only_file_system_is_refused(tmp_path: Path) -> None:
    with small_tmpfs("1m", "black-ro-") as fs:
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        cfg = config(tmp_path, checkpoint_dir=str(fs / "ckpt"))
        with pytest.raises(ConfigError, match="cannot create black.checkpoint_dir .* read-only"):
            make_black_dirs(cfg)


@contextmanager
def refused_dir(d: Path, attr: str = "i") -> Iterator[str]:
    """Make directory ``d`` refuse new files to the user running the tests, for real: as root
    (which mode bits do not stop) ``chattr +<attr>`` (i: immutable, a: append-only, where files
    can be made but not removed), else mode 0555. Yields the reason the OS gives; proves it
    (a file cannot be made, or with ``a`` not removed, there)."""
    root = os.geteuid() == 0
    if not root and attr != "i":
        pytest.skip(
            f"chattr +{attr} needs root (CAP_LINUX_IMMUTABLE); tests run as uid {os.getuid()}"
        )
    mode = stat.S_IMODE(d.stat().st_mode)
    if root:
        r = subprocess.run(["chattr", f"+{attr}", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"chattr +{attr} refused on {d}'s file system: {r.stderr.strip()}")
    else:
        d.chmod(0o555)
    proof = d / "proof-of-refusal"
    try:
        with pytest.raises(OSError):  # the fault is real
            proof.touch()
            proof.unlink()
        yield "Operation not permitted" if root else "Permission denied"
    finally:
        if root:
            subprocess.run(["chattr", f"-{attr}", str(d)], check=True)
        else:
            d.chmod(mode)
        proof.unlink(missing_ok=True)
        for p in d.glob(".write-probe.*.tmp"):  # chattr +a: the probe black could not remove
            p.unlink()


def _made(tmp_path: Path, **black: str) -> tuple[Path, Config]:
    cfg = config(tmp_path, **black)
    Outbox.from_config(cfg)  # the job makes outbox, archive and staging first, then the rest
    make_black_dirs(cfg)
    return tmp_path / "black", cfg


PLACES = {
    "outbox": "outbox",
    "staging_dir": ".outbox.staging",
    "archive": "archive",
    "state_dir": "state",
    "spool_dir": "spool",
}


@pytest.mark.parametrize("key", list(PLACES))
def test_a_directory_black_cannot_write_is_refused_at_start_with_key_uid_and_fix(
    tmp_path: Path, key: str
) -> None:
    """Found by `diode check`'s probe (creates nothing) and by the job's, before any drain."""
    base, cfg = _made(tmp_path)
    d = base / PLACES[key]
    with refused_dir(d) as why:
        for check in (lambda: check_black_writable(cfg), lambda: make_black_dirs(cfg)):
            with pytest.raises(ConfigError) as e:
                check()
            msg = str(e.value)
            assert f"black.{key} {d} is not writable by the user running black" in msg, msg
            assert f"(uid {os.getuid()}; {why}" in msg and f"point black.{key} elsewhere" in msg
            mover = "give that user write access (e.g. the mover's group, mode 0770)"
            assert (mover in msg) == (key == "outbox"), msg
    assert not any((base / "outbox").iterdir()), "a probe must never appear in the outbox"


@pytest.mark.parametrize("attr", ["a", "i"], ids=["append-only", "immutable"])
def test_a_checkpoint_dir_spark_could_not_write_is_refused_by_both_checks(
    tmp_path: Path, attr: str
) -> None:
    """`diode check` never looked at the checkpoint dir (made by Spark's first run), and the
    start checked it with access(2) alone: it is checked like black's own dirs, by both (a
    real probe at start), so an append-only or immutable one is a ConfigError naming the key,
    not a Java stack trace from the query."""
    base, cfg = _made(tmp_path)
    ckpt = base / "checkpoint"
    ckpt.mkdir()
    with refused_dir(ckpt, attr=attr) as why:
        for check in (lambda: check_black_writable(cfg), lambda: make_black_dirs(cfg)):
            with pytest.raises(ConfigError) as e:
                check()
            msg = str(e.value)
            assert f"black.checkpoint_dir {ckpt} is not writable by the user running" in msg
            assert (why if attr == "i" else "append-only attribute") in msg, msg
            assert "point black.checkpoint_dir elsewhere" in msg
        assert not [p.name for p in ckpt.iterdir() if "write-probe" in p.name]


def test_a_checkpoint_dir_under_an_immutable_parent_is_refused_by_both_checks(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "frozen"
    parent.mkdir()
    cfg = config(tmp_path, checkpoint_dir="frozen/ckpt")
    with refused_dir(parent) as why:
        for check in (lambda: check_black_writable(cfg), lambda: make_black_dirs(cfg)):
            with pytest.raises(ConfigError) as e:
                check()
            msg = str(e.value)
            assert f"cannot create black.checkpoint_dir {parent / 'ckpt'}: {parent}" in msg
            assert why in msg
        assert not (parent / "ckpt").exists()


def test_a_directory_not_made_yet_counts_as_its_parent(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    cfg = config(tmp_path, outbox="ro/outbox")
    with refused_dir(parent) as why:
        with pytest.raises(ConfigError) as e:
            check_black_writable(cfg)
    msg = str(e.value)
    assert f"cannot create black.outbox {parent / 'outbox'}: {parent} is not writable" in msg
    assert why in msg and "point black.outbox elsewhere" in msg
    assert not (parent / "outbox").exists()


def test_an_append_only_staging_dir_is_found_by_both_checks(tmp_path: Path) -> None:
    """Files can be made there but not renamed away: the attribute is read, so the check that
    creates nothing (`diode check`) finds it too, and no probe file is stranded there."""
    base, cfg = _made(tmp_path)
    staging = base / ".outbox.staging"
    with refused_dir(staging, attr="a"):
        for check in (lambda: check_black_writable(cfg), lambda: make_black_dirs(cfg)):
            with pytest.raises(ConfigError, match=f"black.staging_dir {staging} is not writable"):
                check()
        assert not [p.name for p in staging.iterdir() if "write-probe" in p.name]


def test_the_probes_leave_nothing_behind(tmp_path: Path) -> None:
    base, cfg = _made(tmp_path)
    before = {p: sorted(os.listdir(base / p)) for p in PLACES.values()}
    check_black_writable(cfg)
    make_black_dirs(cfg)
    assert {p: sorted(os.listdir(base / p)) for p in PLACES.values()} == before
    assert before["outbox"] == []
