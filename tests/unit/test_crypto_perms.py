"""Crypto: file modes the bridge writes, and the permission checks, on real files."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.config import load_config
from bridge.crypto import perms
from bridge.crypto.perms import lock_down_home, permission_problems, secret_keys_in, write_file
from bridge.errors import ConfigError

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


def test_a_passphrase_file_that_is_a_device_is_never_told_to_be_chmodded(tmp_path: Path) -> None:
    """passphrase_file = "/dev/null" (mode 0666): the fix once said `chmod 600 /dev/null`,
    which an operator following it would apply to the host's /dev/null (every service that
    writes there then fails). A device is named as the wrong kind of file instead."""
    cfg = _setup(tmp_path, 'passphrase_file = "/dev/null"\n', cfg_mode=0o600, home_mode=0o700)
    problems = permission_problems(load_config(cfg, environ={}), side="black")
    text = "\n".join(problems)
    assert "/dev/null (black.passphrase_file) is not a regular file" in text, problems
    assert "chmod 600 /dev/null" not in text and "install -m 600 /dev/null FILE" in text


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


# ------------------------------------------------------------------------ the config decides trust


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_config_writable_by_group_or_others_is_named_with_the_fix(
    tmp_path: Path, mode: int
) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=mode, home_mode=0o700)  # no secrets in it at all
    problems = permission_problems(load_config(cfg, environ={}), side="red")
    assert len(problems) == 1, problems
    assert f"config {cfg.resolve()} is writable by" in problems[0]
    assert "black_signers" in problems[0] and f"`chmod go-w {cfg.resolve()}`" in problems[0]


def test_config_in_a_directory_others_may_write_is_named_with_the_fix(tmp_path: Path) -> None:
    folder = tmp_path / "conf"
    folder.mkdir()
    cfg = _setup(tmp_path, "", cfg_mode=0o600, home_mode=0o700)
    cfg = cfg.rename(folder / "diode.toml")
    (tmp_path / "conf" / "kb").symlink_to(tmp_path / "kb")  # gnupg_home is relative
    folder.chmod(0o775)
    problems = permission_problems(load_config(cfg, environ={}), side="black")
    assert len(problems) == 1, problems
    assert f"directory {folder.resolve()}, writable by group" in problems[0]
    assert f"`chmod go-w {folder.resolve()}`" in problems[0]
    folder.chmod(0o1777)  # sticky (like /tmp): nobody else can replace the owner's file
    assert permission_problems(load_config(cfg, environ={}), side="black") == []
    folder.chmod(0o755)
    assert permission_problems(load_config(cfg, environ={}), side="black") == []


# ------------------------------------------------------------------------ red's directories


def _red_dirs(tmp_path: Path) -> dict[str, Path]:
    """The red directories permission_problems checks, at their default places."""
    red = tmp_path / "red"
    return {
        "inbox": red / "inbox",
        "work_dir": red / "work",
        "processed_dir": red / "processed",
        "quarantine_dir": red / "quarantine",
        "state_dir": red / "state",
        "checkpoint_dir": red / "checkpoint",
        "tables_dir": red / "tables",
    }


def test_red_dirs_made_by_the_bridge_have_no_problem(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=0o600, home_mode=0o700)
    for key, d in _red_dirs(tmp_path).items():
        d.mkdir(parents=True)
        d.chmod(0o770 if key == "inbox" else 0o750)  # a vendor mover may drop into the inbox
    assert permission_problems(load_config(cfg, environ={}), side="red") == []


def test_red_dirs_writable_by_others_are_named_with_the_fix(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=0o600, home_mode=0o700)
    dirs = _red_dirs(tmp_path)
    for d in dirs.values():
        d.mkdir(parents=True)
        d.chmod(0o777)
    problems = permission_problems(load_config(cfg, environ={}), side="red")
    assert len(problems) == len(dirs), problems
    text = "\n".join(problems)
    for key, d in dirs.items():
        assert f"red.{key} {d} is writable by" in text, (key, text)
    assert f"`chmod o-w {dirs['inbox']}`" in text  # group write stays for the mover
    assert f"`chmod go-w {dirs['work_dir']}`" in text
    assert permission_problems(load_config(cfg, environ={}), side="black") == []  # red's only


def test_red_udp_spool_is_checked_when_udp_is_configured(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, "", cfg_mode=0o600, home_mode=0o700)
    cfg.write_text(cfg.read_text() + '[udp.receive]\nspool_dir = "spool"\n')
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool").chmod(0o757)
    problems = permission_problems(load_config(cfg, environ={}), side="red")
    assert len(problems) == 1 and "udp.receive.spool_dir" in problems[0], problems


# ------------------------------------------------------------------------ fix-it, not tracebacks


def test_lock_down_home_leaves_symlinks_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (elsewhere / "k.key").write_text("x")
    (home / "private-keys-v1.d").symlink_to(elsewhere)
    (home / "pubring.kbx").symlink_to(elsewhere / "k.key")
    (home / "trustdb.gpg").write_text("x")
    lock_down_home(home)
    assert home.stat().st_mode & 0o777 == 0o700
    assert (home / "trustdb.gpg").stat().st_mode & 0o777 == 0o600
    assert elsewhere.stat().st_mode & 0o777 == 0o755  # a link's target is not the home's
    assert (home / "private-keys-v1.d").is_symlink()
    assert f"{home / 'private-keys-v1.d'} is a symlink" in caplog.text
    assert f"{home / 'pubring.kbx'} is a symlink" in caplog.text


def test_write_file_under_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'afile'}, which is a file"):
        write_file(tmp_path / "afile" / "x" / "k.asc", b"k", mode=0o644)
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        write_file(tmp_path / "afile" / "k.asc", b"k", mode=0o644)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="symlink to .*nowhere, which does not exist"):
        write_file(tmp_path / "gone" / "k.asc", b"k", mode=0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "gone"]


def test_check_dir_path_creates_nothing(tmp_path: Path) -> None:
    perms.check_dir_path(tmp_path / "a" / "b", what="pub dir")
    perms.check_dir_path(tmp_path, what="pub dir")
    assert list(tmp_path.iterdir()) == []
