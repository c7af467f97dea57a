"""Diode, file drop: black's own directories inside the outbox or UDP outbox are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config, config_from_dict
from bridge.diode.file_drop import Outbox
from bridge.errors import ConfigError


def config(base: Path, udp: bool = False, **black: str) -> Config:
    data: dict[str, Any] = {
        "channels": [{"name": "f1", "encrypt": False}],
        "black": {
            "outbox": "black/outbox",
            "archive": "black/archive",
            "state_dir": "black/state",
            "spool_dir": "black/spool",
            "checkpoint_dir": "black/checkpoint",
            "gnupg_home": "keys/black",
            **black,
        },
    }
    if udp:
        data["channels"].append({"name": "u1", "encrypt": False, "transport": "udp"})
        data["udp"] = {"key_file": "udp.key", "send": {"destination": "127.0.0.1:9"}}
        data["black"].setdefault("udp_outbox", "black/udp-outbox")
    return config_from_dict(data, base=base, environ={})


def test_archive_inside_the_outbox_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    outbox = tmp_path / "outbox"
    with pytest.raises(ConfigError) as e:
        Outbox(outbox, outbox / "archive", retention_days=1)
    msg = str(e.value)
    assert f"black.archive {outbox / 'archive'} is inside black.outbox {outbox}" in msg
    assert f"e.g. {tmp_path / 'archive'}" in msg  # the fix: beside the outbox
    assert not outbox.exists(), "nothing may be created for a refused layout"


def test_archive_equal_to_the_outbox_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="black.archive .* is inside black.outbox"):
        Outbox(tmp_path / "box", tmp_path / "box", retention_days=1)


def test_outbox_inside_the_archive_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="black.outbox .* is inside black.archive .* pruner"):
        Outbox(tmp_path / "archive" / "outbox", tmp_path / "archive", retention_days=1)


@pytest.mark.parametrize(
    "key", ["archive", "state_dir", "spool_dir", "checkpoint_dir", "gnupg_home"]
)
def test_own_directories_inside_the_outbox_are_refused(tmp_path: Path, key: str) -> None:
    cfg = config(tmp_path, **{key: f"black/outbox/{key}"})
    with pytest.raises(ConfigError) as e:
        Outbox.from_config(cfg)
    msg = str(e.value)
    assert f"black.{key} {tmp_path / 'black/outbox' / key} is inside black.outbox" in msg
    assert f"e.g. {tmp_path / 'black' / key}" in msg
    assert not (tmp_path / "black" / "outbox").exists()


@pytest.mark.parametrize("key", ["state_dir", "spool_dir", "checkpoint_dir", "gnupg_home"])
def test_own_directories_inside_the_udp_outbox_are_refused(tmp_path: Path, key: str) -> None:
    """(The configuration itself refuses the archive and the staging dir there.)"""
    cfg = config(tmp_path, udp=True, **{key: f"black/udp-outbox/{key}"})
    with pytest.raises(ConfigError, match=f"black.{key} .* is inside black.udp_outbox"):
        Outbox.from_config(cfg)


def test_the_default_layout_and_siblings_are_accepted(tmp_path: Path) -> None:
    ob = Outbox.from_config(config(tmp_path, udp=True))
    assert ob.outbox == tmp_path / "black" / "outbox" and ob.archive.is_dir()
    # a name that merely starts like the outbox's is not inside it
    Outbox.from_config(config(tmp_path / "b", archive="black/outbox-archive"))
