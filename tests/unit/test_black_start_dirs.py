"""Black, job start: a channel's own folder (``<spool_dir>/<channel>``, ``<archive>/<channel>``)
that black cannot write is a ConfigError naming the folder, its key, its channel and the fix,
before a tap or the sealer first writes there; and the messages that say how to make or open a
directory name the mode black makes it with (one builder for the job and the outbox). Real
directories, refused for real (``chattr +i`` / ``+a`` as root, mode 0555 otherwise)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bridge.black.job import check_black_writable, make_black_dirs
from bridge.black.spool import SPOOL_DIR_MODE
from bridge.config import Config
from bridge.diode.file_drop import Outbox
from bridge.errors import ConfigError, TransportError
from tests.unit.test_black_dirs import refused_dir
from tests.unit.test_file_drop_places import config

CHANNEL = "f1"
NAME = f"{CHANNEL}.000000000001.0123456789abcdef0123456789abcdef.dbundle"
FOLDERS = {"spool_dir": ("spool", SPOOL_DIR_MODE), "archive": ("archive", 0o750)}


def _made(tmp_path: Path) -> tuple[Config, dict[str, Path]]:
    """Black's directories as a run left them: each channel's spool and archive folder too."""
    cfg = config(tmp_path)
    Outbox.from_config(cfg)
    make_black_dirs(cfg)
    folders = {}
    for key, (top, mode) in FOLDERS.items():
        folders[key] = tmp_path / "black" / top / CHANNEL
        folders[key].mkdir(mode=mode)
    return cfg, folders


@pytest.mark.parametrize("key", list(FOLDERS))
def test_a_channel_folder_black_cannot_write_is_refused_at_start(tmp_path: Path, key: str) -> None:
    """The tap (spool) or the sealer (archive) found it mid-run: the tap died with a traceback
    of its own, or the first bundle failed to seal after the taps had drained the broker."""
    cfg, folders = _made(tmp_path)
    d = folders[key]
    mode = FOLDERS[key][1]
    with refused_dir(d) as why:
        for check in (lambda: check_black_writable(cfg), lambda: make_black_dirs(cfg)):
            with pytest.raises(ConfigError) as e:
                check()
            msg = str(e.value)
            assert f"black.{key} {d} is not writable by the user running black" in msg, msg
            assert (
                f"(uid {os.getuid()}; {why}" in msg and f"the folder of channel '{CHANNEL}'" in msg
            )
            assert f"`chown -R {os.getuid()} {d}`, mode {mode:04o}" in msg, msg
            assert f"or point black.{key} elsewhere (the channel's" in msg, msg
    assert sorted(os.listdir(d)) == [], "the probes leave nothing behind"


def test_an_append_only_channel_folder_is_found_and_no_probe_file_is_stranded(
    tmp_path: Path,
) -> None:
    """Files can be made there but not removed (the tap releases segments, the pruner old
    bundles): read from the attribute by `diode check` and the job alike, so the job's
    create-and-unlink probe never leaves a file it cannot remove."""
    cfg, folders = _made(tmp_path)
    d = folders["spool_dir"]
    with refused_dir(d, attr="a"):
        for check in (lambda: check_black_writable(cfg), lambda: make_black_dirs(cfg)):
            with pytest.raises(ConfigError, match=f"black.spool_dir {d} is not"):
                check()
        assert not [p.name for p in d.iterdir() if "write-probe" in p.name]


@pytest.mark.parametrize("key", list(FOLDERS))
def test_a_file_in_place_of_a_channel_folder_is_refused_at_start(tmp_path: Path, key: str) -> None:
    cfg, folders = _made(tmp_path)
    d = folders[key]
    d.rmdir()
    d.write_text("not a directory")
    for check in (lambda: check_black_writable(cfg), lambda: make_black_dirs(cfg)):
        with pytest.raises(ConfigError) as e:
            check()
        msg = str(e.value)
        assert f"black.{key} {d} is not a directory" in msg and f"Move {d} out" in msg, msg


def test_channel_folders_not_made_yet_and_writable_ones_pass(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    Outbox.from_config(cfg)
    make_black_dirs(cfg)  # no channel folder yet: made later in a checked directory
    cfg, folders = _made(tmp_path / "again")
    check_black_writable(cfg)
    make_black_dirs(cfg)
    assert all(not any(d.iterdir()) for d in folders.values())


def test_the_sealer_names_the_channel_folder_in_the_same_words(tmp_path: Path) -> None:
    """A refusal while running (the folder changed under a running job) says what start says."""
    cfg, folders = _made(tmp_path)
    ob = Outbox.from_config(cfg)
    sealed = ob.stage_bytes(NAME, b"sealed bundle")
    with refused_dir(folders["archive"]):
        with pytest.raises(TransportError) as running:
            ob.deliver(NAME, sealed, channel=CHANNEL)
        with pytest.raises(ConfigError) as start:
            make_black_dirs(cfg)
    assert str(start.value) in str(running.value), (str(start.value), str(running.value))


# ---------------------------------------------------------------- one builder, with the mode
def test_an_outbox_that_cannot_be_made_names_its_own_mode(tmp_path: Path) -> None:
    """The outbox is made 0770 (the mover's group takes files there); its message said 750."""
    (tmp_path / "a-file").write_text("not a directory")
    cfg = config(tmp_path, outbox="a-file/outbox")
    with pytest.raises(ConfigError) as e:
        Outbox.from_config(cfg)
    msg = str(e.value)
    outbox = tmp_path / "a-file" / "outbox"
    assert f"cannot create black.outbox {outbox}: Not a directory; create it (mode 770)" in msg
    assert "point black.outbox elsewhere" in msg, msg


@pytest.mark.parametrize(
    ("key", "place", "mode"),
    [
        ("archive", "archive", 0o750),
        ("staging_dir", "staging", 0o750),
        ("spool_dir", "spool", 0o700),
    ],
)
def test_the_outbox_and_the_job_build_one_message_with_the_mode_they_make(
    tmp_path: Path, key: str, place: str, mode: int
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    cfg = config(tmp_path, **{key: f"a-file/{place}"})
    make = make_black_dirs if key == "spool_dir" else Outbox.from_config
    with pytest.raises(ConfigError) as e:
        make(cfg)
    d = tmp_path / "a-file" / place
    assert str(e.value) == (
        f"cannot create black.{key} {d}: Not a directory; create it (mode {mode:o}) for the "
        f"user running black, or point black.{key} elsewhere"
    )


def test_a_udp_outbox_black_cannot_write_names_the_mode_it_is_made_with(tmp_path: Path) -> None:
    """Only the outbox is the mover's (0770): the UDP outbox is made 0750, and `diode check`
    fails when its group can write. The fix said "the mover's group, mode 0770"."""
    cfg = config(tmp_path, udp=True)
    Outbox.from_config(cfg)
    make_black_dirs(cfg)
    udp = tmp_path / "black" / "udp-outbox"
    assert stat.S_IMODE(udp.stat().st_mode) == 0o750
    with refused_dir(udp):
        with pytest.raises(ConfigError) as e:
            check_black_writable(cfg)
    msg = str(e.value)
    assert f"black.udp_outbox {udp} is not writable" in msg, msg
    assert "give that user write access (e.g. its owner, mode 0750)" in msg, msg
    assert "mover" not in msg, msg
