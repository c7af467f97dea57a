"""Red, directories: a red job refuses, before it creates or moves anything, red directories that
overlap where that breaks red (inside the inbox, the inbox inside one, two the same, one inside
a directory red walks), and a red directory it cannot create or write is a ConfigError naming
the key, the path, the OS's reason and the fix, never a traceback (bridge.red.job).

Real config files, real gpg keys (``check_red_config`` checks them), real directories; the
read-only cases mount a real tmpfs (root only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.config import Config, load_config
from bridge.errors import ConfigError
from bridge.red.job import check_red_config
from tests.red_factory import BRIDGE_ID, RedKeys, temp_red_keys

pytestmark = [pytest.mark.gpg]

REPO = Path(__file__).resolve().parents[2]
DIRS = {
    "inbox": "red/inbox",
    "work_dir": "red/work",
    "processed_dir": "red/processed",
    "quarantine_dir": "red/quarantine",
    "state_dir": "red/state",
    "checkpoint_dir": "red/checkpoint",
    "tables_dir": "red/tables",
}
RED_DIR_KEYS = tuple(DIRS)
NO_JAVA = "/nonexistent/diode-test-no-java"


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    with temp_red_keys("drd") as k:
        yield k


def cfg_file(root: Path, keys: RedKeys, **red: str) -> Path:
    """A red config file under ``root``: the red dirs of ``DIRS`` (relative to ``root``) with
    ``red`` overriding them (or adding keys)."""
    keys_dirs = {"gnupg_home": str(keys.red_home), **DIRS, **red}
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys_dirs.items())
    p = root / "diode.toml"
    p.write_text(
        f'[link]\nbridge_id = "{BRIDGE_ID}"\nblack_signers = ["{keys.black_fpr}"]\n\n'
        f'[[channels]]\nname = "orders"\nrecipients = {json.dumps(keys.recipients)}\n\n'
        f"[red]\n{lines}"
    )
    p.chmod(0o600)
    return p


def load(root: Path, keys: RedKeys, **red: str) -> Config:
    return load_config(cfg_file(root, keys, **red), environ={})


def refused(cfg: Config) -> str:
    with pytest.raises(ConfigError) as e:
        check_red_config(cfg)
    return str(e.value)


# -- places -------------------------------------------------------------------------------------


def test_reviewer_layout_red_dirs_inside_the_inbox_refused_before_anything_is_created(
    tmp_path: Path, keys: RedKeys
) -> None:
    """The reviewer's layout: work and processed inside the inbox. Red would quarantine its own
    work area (decrypted plaintexts included) as ``not_regular_file``."""
    cfg = load(
        tmp_path,
        keys,
        inbox="nest/inbox",
        work_dir="nest/inbox/work",
        processed_dir="nest/inbox/processed",
    )
    msg = refused(cfg)
    nest = tmp_path / "nest"
    assert f"red.work_dir {nest / 'inbox' / 'work'} is inside red.inbox {nest / 'inbox'}" in msg
    assert "not_regular_file" in msg
    assert f"Set red.work_dir to a path outside red.inbox, e.g. {nest / 'work'}" in msg
    assert not nest.exists(), "nothing may be created before the layout is checked"


@pytest.mark.parametrize(
    "key", [k for k in RED_DIR_KEYS if k != "inbox"] + ["gnupg_home", "passphrase_file"]
)
def test_anything_red_keeps_inside_the_inbox_is_refused(
    tmp_path: Path, keys: RedKeys, key: str
) -> None:
    cfg = load(tmp_path, keys, **{key: f"red/inbox/{key}"})
    msg = refused(cfg)
    inbox = tmp_path / "red" / "inbox"
    assert f"red.{key} {inbox / key} is inside red.inbox {inbox}" in msg, msg
    assert f"outside red.inbox, e.g. {tmp_path / 'red' / key}" in msg, msg
    assert not inbox.exists()


def test_a_red_dir_that_is_the_inbox_is_refused(tmp_path: Path, keys: RedKeys) -> None:
    msg = refused(load(tmp_path, keys, quarantine_dir="red/inbox"))
    assert f"red.quarantine_dir {tmp_path / 'red' / 'inbox'} is red.inbox" in msg, msg
    assert f"e.g. {tmp_path / 'red' / 'quarantine'}" in msg, msg


@pytest.mark.parametrize("key", [k for k in RED_DIR_KEYS if k != "inbox"])
def test_the_inbox_inside_a_red_dir_is_refused(tmp_path: Path, keys: RedKeys, key: str) -> None:
    cfg = load(tmp_path, keys, inbox=f"{DIRS[key]}/inbox")
    msg = refused(cfg)
    outer = tmp_path / DIRS[key]
    assert f"red.inbox {outer / 'inbox'} is inside red.{key} {outer}" in msg, msg
    assert f"Set red.inbox to a directory beside it, e.g. {tmp_path / 'red' / 'inbox'}" in msg
    assert not (tmp_path / "red").exists()


@pytest.mark.parametrize(
    ("a", "b"),
    [("work_dir", "state_dir"), ("processed_dir", "quarantine_dir"),
     ("checkpoint_dir", "tables_dir"), ("state_dir", "tables_dir")],
)  # fmt: skip
def test_two_red_dirs_the_same_are_refused(tmp_path: Path, keys: RedKeys, a: str, b: str) -> None:
    cfg = load(tmp_path, keys, **{b: DIRS[a]})
    msg = refused(cfg)
    same = tmp_path / DIRS[a]
    assert f"red.{a} and red.{b} are the same directory {same}" in msg, msg
    assert f"Set red.{b} to a directory of its own" in msg, msg
    assert not (tmp_path / "red").exists()


@pytest.mark.parametrize(
    ("inner", "outer"),
    [("tables_dir", "work_dir"), ("state_dir", "processed_dir"),
     ("checkpoint_dir", "quarantine_dir")],
)  # fmt: skip
def test_a_red_dir_inside_one_red_walks_is_refused(
    tmp_path: Path, keys: RedKeys, inner: str, outer: str
) -> None:
    """work_dir/plain is swept of *.parquet (Delta's data files), processed and quarantine are
    counted file by file as evidence."""
    cfg = load(tmp_path, keys, **{inner: f"{DIRS[outer]}/plain"})
    msg = refused(cfg)
    o = tmp_path / DIRS[outer]
    assert f"red.{inner} {o / 'plain'} is inside red.{outer} {o}" in msg, msg
    assert "and move its contents there" in msg


def test_dirs_nested_where_nothing_walks_them_are_fine(tmp_path: Path, keys: RedKeys) -> None:
    cfg = load(tmp_path, keys, checkpoint_dir="red/state/checkpoint")
    check_red_config(cfg)
    for key in RED_DIR_KEYS:
        assert Path(getattr(cfg.red, key)).is_dir()


# -- creating -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", RED_DIR_KEYS)
def test_a_red_dir_under_a_regular_file_is_a_config_error(
    tmp_path: Path, keys: RedKeys, key: str
) -> None:
    (tmp_path / "afile").write_text("not a directory\n")
    cfg = load(tmp_path, keys, **{key: "afile/sub"})
    msg = refused(cfg)
    d = tmp_path / "afile" / "sub"
    assert f"cannot create red.{key} {d}: Not a directory" in msg, msg
    assert f"create it (mode 750) for the user running red, or point red.{key} elsewhere" in msg


@pytest.mark.parametrize("key", ["inbox", "tables_dir"])
def test_a_red_dir_that_is_a_regular_file_is_a_config_error(
    tmp_path: Path, keys: RedKeys, key: str
) -> None:
    (tmp_path / "afile").write_text("not a directory\n")
    msg = refused(load(tmp_path, keys, **{key: "afile"}))
    assert f"cannot create red.{key} {tmp_path / 'afile'}: " in msg, msg
    assert "exists and is not a directory" in msg and f"point red.{key} elsewhere" in msg


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs mounted (read-write) at ``tmp_path/fs``; root only."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount_ro(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


@pytest.mark.parametrize("key", RED_DIR_KEYS)
def test_a_red_dir_on_a_read_only_file_system_cannot_be_created(
    tmp_path: Path, tmpfs: Path, keys: RedKeys, key: str
) -> None:
    _remount_ro(tmpfs)
    cfg = load(tmp_path, keys, **{key: "fs/red/x"})
    msg = refused(cfg)
    d = tmpfs / "red" / "x"
    assert f"cannot create red.{key} {d}: Read-only file system" in msg, msg
    assert f"or point red.{key} elsewhere" in msg


def test_red_dirs_that_exist_on_a_read_only_file_system_are_refused(
    tmp_path: Path, tmpfs: Path, keys: RedKeys
) -> None:
    """Created, then the file system went read-only: red could not take, land or keep a file."""
    red = {k: f"fs/{v}" for k, v in DIRS.items()}
    check_red_config(load(tmp_path, keys, **red))  # all created, writable
    _remount_ro(tmpfs)
    msg = refused(load(tmp_path, keys, **red))
    assert f"red.inbox {tmpfs / 'red' / 'inbox'} is on a read-only file system" in msg, msg
    assert "Mount it read-write, or point red.inbox to a writable directory" in msg


# -- the command line ---------------------------------------------------------------------------


def _red_run(cfg: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIODE__", "DIODE_CONFIG"))}
    env["JAVA_HOME"] = NO_JAVA  # a run that reached Spark would die of the Java gateway
    r = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "--log-format", "text", "red", "run",
         "--trigger", "available-now", "--config", str(cfg)],
        capture_output=True, text=True, timeout=120, check=False, env=env, cwd=REPO,
    )  # fmt: skip
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize(
    "red",
    [
        {"inbox": "nest/inbox", "work_dir": "nest/inbox/work",
         "processed_dir": "nest/inbox/processed"},
        {"work_dir": "afile/work"},
    ],
    ids=["work-inside-inbox", "work-under-a-file"],
)  # fmt: skip
def test_diode_red_run_refuses_with_exit_2_and_no_traceback(
    tmp_path: Path, keys: RedKeys, red: dict[str, str]
) -> None:
    (tmp_path / "afile").write_text("not a directory\n")
    code, out = _red_run(cfg_file(tmp_path, keys, **red))
    assert code == 2, out
    assert "Traceback" not in out and NO_JAVA not in out and "Java gateway" not in out, out
    assert f"red.work_dir {tmp_path / red['work_dir']}" in out, out
