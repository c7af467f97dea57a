"""Crypto: file modes the bridge writes, and the permission checks, on real files."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.config import load_config
from bridge.crypto.perms import lock_down_home, permission_problems, secret_keys_in, write_file

FPR = "A" * 40


@given(data=st.binary(max_size=70_000), mode=st.sampled_from([0o600, 0o644, 0o400]))
def test_write_file_round_trip(data: bytes, mode: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        final = Path(d) / "sub" / "f.asc"
        write_file(final, data, mode=mode)
        assert final.read_bytes() == data
        assert final.stat().st_mode & 0o777 == mode
        assert sorted(p.name for p in final.parent.iterdir()) == ["f.asc"]  # no temp left


def test_write_file_replaces_and_ignores_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_file(tmp_path / "k.asc", b"one", mode=0o644)
    finally:
        os.umask(old)
    assert (tmp_path / "k.asc").stat().st_mode & 0o777 == 0o644
    write_file(tmp_path / "k.asc", b"two", mode=0o600)
    assert (tmp_path / "k.asc").read_bytes() == b"two"
    assert (tmp_path / "k.asc").stat().st_mode & 0o777 == 0o600


def test_lock_down_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "private-keys-v1.d").mkdir(parents=True, mode=0o755)
    (home / "pubring.kbx").write_text("x")
    (home / "private-keys-v1.d" / "k.key").write_text("x")
    for p in (home, home / "pubring.kbx", home / "private-keys-v1.d" / "k.key"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    lock_down_home(home)
    assert home.stat().st_mode & 0o777 == 0o700
    assert (home / "private-keys-v1.d").stat().st_mode & 0o777 == 0o700
    assert (home / "pubring.kbx").stat().st_mode & 0o777 == 0o600
    assert (home / "private-keys-v1.d" / "k.key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"black": {"amqp_url": "amqp://u:pw@h:5672/v"}}, ["black.amqp_url"]),
        ({"black": {"amqp_url": "amqp://u@h:5672/v"}}, []),
        ({"black": {"management_password": "guest"}}, ["black.management_password"]),
        ({"black": {"management_password": ""}}, []),
        ({"black": {"passphrase_file": "/etc/pw", "passphrase_env": "X"}}, []),
        ({"red": {"hooks": [{"token": "t"}]}}, ["red.hooks[0].token"]),
        ({"link": {"bridge_id": "a"}, "channels": [{"name": "x"}]}, []),
    ],
)
def test_secret_keys_in(data: dict, expected: list[str]) -> None:  # type: ignore[type-arg]
    assert secret_keys_in(data) == expected


def _setup(tmp_path: Path, cfg_text: str, *, cfg_mode: int, home_mode: int) -> Path:
    home = tmp_path / "kb"
    home.mkdir()
    (home / "pubring.kbx").write_text("x")
    (home / "pubring.kbx").chmod(0o600)
    home.chmod(home_mode)
    cfg = tmp_path / "diode.toml"
    cfg.write_text(
        f'[link]\nblack_signers = ["{FPR}"]\n[[channels]]\nname = "default"\n'
        f'recipients = ["{FPR}"]\n[black]\ngnupg_home = "kb"\nsigning_key = "{FPR}"\n' + cfg_text
    )
    cfg.chmod(cfg_mode)
    return cfg


def test_tight_setup_has_no_problem(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, 'amqp_url = "amqp://u:S3cret@h/v"\n', cfg_mode=0o600, home_mode=0o700)
    assert permission_problems(load_config(cfg, environ={}), side="black") == []


def test_config_without_secrets_may_be_readable(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=0o644, home_mode=0o700)
    assert permission_problems(load_config(cfg, environ={}), side="black") == []


def test_loose_setup_names_every_problem_and_fix(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s")
    pw.chmod(0o640)
    cfg = _setup(
        tmp_path,
        'amqp_url = "amqp://u:S3cret@h/v"\npassphrase_file = "pw"\n',
        cfg_mode=0o644,
        home_mode=0o750,
    )
    (tmp_path / "kb" / "pubring.kbx").chmod(0o644)
    problems = permission_problems(load_config(cfg, environ={}), side="black")
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "black.amqp_url" in text and f"chmod 600 {cfg.resolve()}" in text
    assert f"chmod 700 {tmp_path / 'kb'}" in text
    assert "pubring.kbx" in text and "chmod -R go-rwx" in text
    assert f"chmod 600 {pw}" in text
    assert "S3cret" not in text  # names the key, never the value


def _black_dirs(tmp_path: Path) -> dict[str, Path]:
    """The black directories permission_problems checks, at their default places."""
    black = tmp_path / "black"
    return {
        "outbox": black / "outbox",
        "staging_dir": black / ".outbox.staging",
        "archive": black / "archive",
        "state_dir": black / "state",
        "spool_dir": black / "spool",
    }


def test_black_dirs_made_by_the_bridge_have_no_problem(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=0o600, home_mode=0o700)
    dirs = _black_dirs(tmp_path)
    for key, d in dirs.items():
        d.mkdir(parents=True)
        d.chmod(0o770 if key == "outbox" else 0o750)  # the outbox is the mover group's too
    assert permission_problems(load_config(cfg, environ={}), side="black") == []


def test_pre_created_black_dirs_writable_by_others_are_named_with_the_fix(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=0o600, home_mode=0o700)
    dirs = _black_dirs(tmp_path)
    for key, d in dirs.items():
        d.mkdir(parents=True)
        # group-writable is intended for the outbox only; world-writable never
        d.chmod(0o777 if key == "outbox" else 0o770)
    problems = permission_problems(load_config(cfg, environ={}), side="black")
    assert len(problems) == len(dirs), problems
    text = "\n".join(problems)
    for key, d in dirs.items():
        assert f"black.{key}" in text and str(d) in text, (key, text)
    assert f"`chmod o-w {dirs['outbox']}`" in text  # group write stays for the mover
    for key in ("staging_dir", "archive", "state_dir", "spool_dir"):
        assert f"`chmod go-w {dirs[key]}`" in text, text


def test_missing_black_dirs_are_no_problem(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=0o600, home_mode=0o700)  # no black/ folder at all
    assert permission_problems(load_config(cfg, environ={}), side="black") == []
