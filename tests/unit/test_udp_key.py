"""UDP link key: made 0600, never overwritten unasked, refused when weak or readable by others."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bridge.diode.udp_key import generate_key_file, load_key
from bridge.errors import ConfigError


def test_generate_then_load(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "udp.key"
    generate_key_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    key = load_key(path)
    assert len(key) == 32
    with pytest.raises(ConfigError, match="--force"):
        generate_key_file(path)
    generate_key_file(path, force=True)
    assert load_key(path) != key


def test_bad_key_files_fail_fast_with_a_fix(tmp_path: Path) -> None:
    path = tmp_path / "udp.key"
    with pytest.raises(ConfigError, match="diode udp keygen"):
        load_key(path)
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_key(path)
    path.chmod(0o600)
    assert load_key(path) == bytes.fromhex("ab" * 32)
    path.write_text("ab" * 16)
    with pytest.raises(ConfigError, match="at least 32"):
        load_key(path)
    path.write_text("not hex")
    with pytest.raises(ConfigError, match="hex"):
        load_key(path)
