"""Black, job start: a directory black cannot create is a ConfigError naming its key."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from bridge.black.job import make_black_dirs
from bridge.black.spool import SPOOL_DIR_MODE
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
        with pytest.raises(ConfigError, match="cannot create black.checkpoint_dir .* not writable"):
            make_black_dirs(cfg)
