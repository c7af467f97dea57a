"""Black, file drop: a delivery the file system refuses (EACCES, EPERM) says which directory
black cannot write and how to fix it (a bundle at sealing time, a heartbeat), in the words the
start-up check uses; a real immutable (root) or mode-0555 directory, no mock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bridge.diode.file_drop import Outbox
from bridge.errors import TransportError
from tests.unit.test_black_dirs import refused_dir

NAME = "c1.000000000001.0123456789abcdef0123456789abcdef.dbundle"
MOVER_FIX = "give that user write access (e.g. the mover's group, mode 0770)"


def _outbox(tmp_path: Path) -> Outbox:
    return Outbox(tmp_path / "outbox", tmp_path / "archive", retention_days=1)


def test_sealing_into_an_outbox_black_cannot_write_names_the_key_uid_and_fix(
    tmp_path: Path,
) -> None:
    ob = _outbox(tmp_path)
    sealed = ob.stage_bytes(NAME, b"sealed bundle")
    with refused_dir(ob.outbox) as why:
        with pytest.raises(TransportError) as e:
            ob.deliver(NAME, sealed, channel="c1")
    msg = str(e.value)
    assert f"cannot deliver {NAME} (channel 'c1') into {ob.outbox}" in msg, msg
    assert why in msg, "the OS's own error is kept"
    assert f"black.outbox {ob.outbox} is not writable by the user running black" in msg, msg
    assert f"(uid {os.getuid()}" in msg and MOVER_FIX in msg and "start black again" in msg, msg
    assert not any(ob.outbox.iterdir())


def test_a_heartbeat_into_an_outbox_black_cannot_write_names_the_fix(tmp_path: Path) -> None:
    ob = _outbox(tmp_path)
    staged = ob.stage_bytes("c1.000000000001.dheartbeat", b"hb")
    with refused_dir(ob.outbox):
        with pytest.raises(TransportError) as e:
            ob.publish(staged, "c1.000000000001.dheartbeat", channel="c1")
    msg = str(e.value)
    assert f"black.outbox {ob.outbox} is not writable" in msg and MOVER_FIX in msg, msg
    assert not staged.exists() and not any(ob.outbox.iterdir())


def test_an_archive_folder_black_cannot_write_is_named_not_the_outbox(tmp_path: Path) -> None:
    ob = _outbox(tmp_path)
    adir = ob.archive / "c1"
    adir.mkdir()
    sealed = ob.stage_bytes(NAME, b"sealed bundle")
    with refused_dir(adir):
        with pytest.raises(TransportError) as e:
            ob.deliver(NAME, sealed, channel="c1")
    msg = str(e.value)
    assert f"black.archive {adir} is not writable by the user running black" in msg, msg
    assert "point black.archive elsewhere" in msg and "black.outbox" not in msg, msg
    assert not any(ob.outbox.iterdir()), "the archive copy comes first: nothing delivered"


def test_a_staging_dir_black_cannot_write_is_named_when_staging(tmp_path: Path) -> None:
    ob = _outbox(tmp_path)
    with refused_dir(ob.staging):
        with pytest.raises(TransportError) as e:
            ob.stage_bytes("c1.000000000002.dheartbeat", b"hb")
    msg = str(e.value)
    assert f"black.staging_dir {ob.staging} is not writable by the user running black" in msg
