"""Red, start-up: a red directory with the append-only or immutable attribute is refused by
``check_red_config`` (key, path, attribute, fix) before Spark starts, not when red first renames
a file out of the inbox or replaces its state mid-run; the checks leave no file behind.

Real directories with real attributes (``chattr``: root on a file system that has them, else
skipped), each cleared in a ``finally``; real gpg keys (``check_red_config`` checks them)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bridge.config import Config
from bridge.errors import ConfigError, StateError
from bridge.red.job import check_red_config
from bridge.red.layout import RED_DIR_KEYS
from tests.red_factory import RedKeys, temp_red_keys
from tests.unit.test_red_dirs import load

pytestmark = [pytest.mark.gpg]


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    with temp_red_keys("rsd") as k:
        yield k


@contextmanager
def attribute(d: Path, flag: str) -> Iterator[None]:
    """``chattr +<flag> d`` for the body, ``chattr -<flag>`` after it whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("chattr +a / +i needs root")
    r = subprocess.run(["chattr", f"+{flag}", str(d)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"no file attributes here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", f"-{flag}", str(d)], check=True)


def made(tmp_path: Path, keys: RedKeys) -> Config:
    cfg = load(tmp_path, keys)
    check_red_config(cfg)  # every red dir created, writable
    return cfg


@pytest.mark.parametrize("key", RED_DIR_KEYS)
def test_an_append_only_red_dir_is_refused_at_start_and_no_probe_file_stays(
    tmp_path: Path, keys: RedKeys, key: str
) -> None:
    """The old check (access(2)) passed: files may be created there, but red renames files out
    of the inbox and replaces its state and Spark's checkpoint metadata by rename, which the
    attribute refuses even to root."""
    cfg = made(tmp_path, keys)
    d = Path(getattr(cfg.red, key))
    before = sorted(os.listdir(d))
    with attribute(d, "a"):
        with pytest.raises(ConfigError) as e:
            check_red_config(cfg)
        after = sorted(os.listdir(d))
    msg = str(e.value)
    assert f"red.{key} {d} refuses red's files" in msg, msg
    assert "append-only attribute" in msg and f"chattr -i -a {d}" in msg, msg
    assert f"point red.{key} elsewhere" in msg, msg
    assert after == before, "a probe file stayed in an append-only directory"


@pytest.mark.parametrize("key", ["inbox", "state_dir", "tables_dir"])
def test_an_immutable_red_dir_names_the_attribute_not_the_mode(
    tmp_path: Path, keys: RedKeys, key: str
) -> None:
    """Refused before too, but as "give that user write access (mode 750)", which cannot help
    root: the message now says an attribute refuses it and how to clear it."""
    cfg = made(tmp_path, keys)
    d = Path(getattr(cfg.red, key))
    with attribute(d, "i"):
        with pytest.raises(ConfigError) as e:
            check_red_config(cfg)
    msg = str(e.value)
    assert f"red.{key} {d} refuses red's files" in msg, msg
    assert f"lsattr -d {d}" in msg and f"chattr -i -a {d}" in msg, msg


def test_writable_red_dirs_pass_and_the_probes_leave_nothing(tmp_path: Path, keys: RedKeys) -> None:
    cfg = made(tmp_path, keys)
    check_red_config(cfg)
    for key in RED_DIR_KEYS:
        assert os.listdir(getattr(cfg.red, key)) == [], key


def test_what_the_refusal_spares_an_append_only_inbox_fails_the_intake_mid_run(
    tmp_path: Path, keys: RedKeys
) -> None:
    """Why the start refuses it: the intake's rename out of such an inbox is refused."""
    from bridge.red.source import make_intake

    cfg = made(tmp_path, keys)
    inbox = Path(cfg.red.inbox)
    (inbox / f"orders.000000000001.{'ab' * 16}.dbundle").write_bytes(b"x")
    intake = make_intake(cfg)
    with attribute(inbox, "a"), pytest.raises(StateError, match="needs write and search") as e:
        intake.scan(0.0, {})
        intake.scan(1e9, {})
    assert f"permission on {inbox}" in str(e.value) and "chattr -i -a" in str(e.value)
