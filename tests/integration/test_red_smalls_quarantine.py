"""Red, operator: `diode quarantine list` tells the truth about a reason file marked
``pending_move`` whose file is not beside it. The move is pending only while the inbox or the
intake still holds that very entry unmoved (device, inode, ctime: what the mark records and
what bridge.red.evidence honours); once it was removed or changed, no red run will finish it.

Real processes: the intake is killed (``DIODE_CRASH_AT=red.evidence_before_rename``) between
the reason file and the rename of a folder it quarantines; the CLI runs in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.faults import CRASH_ENV, MARK_ENV
from tests.red_factory import keyless_red_config

REPO = Path(__file__).resolve().parents[2]
SCAN = """
import sys, time
from pathlib import Path
from bridge.config import load_config
from bridge.red.source import make_intake
make_intake(load_config(Path(sys.argv[1]), environ={})).scan(time.monotonic())
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DIODE")}


def _scan(cfg: Config, *, crash: bool) -> None:
    """One intake scan in its own process; ``crash``: killed before the quarantine's rename."""
    env = _env()
    if crash:
        env |= {CRASH_ENV: "red.evidence_before_rename", MARK_ENV: str(cfg.source) + ".mark"}
        Path(env[MARK_ENV]).unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-c", SCAN, str(cfg.source)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert p.returncode == (-9 if crash else 0), p.stderr


def _list(cfg: Config, *json_flag: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "quarantine", "list", "--config", str(cfg.source),
         *json_flag],
        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout


def _entries(cfg: Config) -> dict[str, dict[str, Any]]:
    doc = json.loads(_list(cfg, "--json"))
    return {e["original_name"] + "|" + e["stored_as"]: e for e in doc["entries"]}


def _crashed_move(cfg: Config, name: str) -> Path:
    """A folder ``name`` in the inbox whose quarantine stopped after its reason file."""
    _scan(cfg, crash=False)  # red's dirs
    folder = Path(cfg.red.inbox) / name
    folder.mkdir()
    _scan(cfg, crash=True)
    assert folder.is_dir()
    return folder


def test_a_move_still_pending_says_where_the_file_waits(tmp_path: Path) -> None:
    cfg = keyless_red_config(tmp_path, "diode-bridge")
    folder = _crashed_move(cfg, "a.d")
    [e] = _entries(cfg).values()
    assert e["file_gone"] is True and e["pending_move"] is True, e
    assert e["pending_at"] == str(folder), e
    assert e["why"].startswith(f"[move pending: a crash came before the rename; the file waits "
                               f"at {folder}"), e  # fmt: skip
    _scan(cfg, crash=False)  # the next run finishes the move: no longer gone
    [e] = _entries(cfg).values()
    assert not e.get("file_gone") and "pending_move" not in e, e


def test_a_pending_mark_whose_file_was_removed_is_no_longer_called_pending(
    tmp_path: Path,
) -> None:
    """The old listing said "move pending (... the file is still in the inbox or intake)"
    for ever, with the inbox empty."""
    cfg = keyless_red_config(tmp_path, "diode-bridge")
    shutil.rmtree(_crashed_move(cfg, "a.d"))  # an operator cleans the inbox up
    [e] = _entries(cfg).values()
    assert e["file_gone"] is True and e["pending_move"] is False, e
    assert e["why"].startswith("[file gone, move abandoned: a crash came before the rename"), e
    assert "pending_at" not in e
    text = _list(cfg)
    assert "move pending" not in text and "move abandoned" in text, text


def test_a_changed_entry_is_quarantined_anew_and_the_old_mark_is_abandoned(
    tmp_path: Path,
) -> None:
    """The mover wrote into the folder after the crash (its ctime changed): the next scan
    quarantines it under a name of its own; the first reservation will never be honoured."""
    cfg = keyless_red_config(tmp_path, "diode-bridge")
    folder = _crashed_move(cfg, "b.d")
    (folder / "late").write_bytes(b"x")
    _scan(cfg, crash=False)
    assert list(Path(cfg.red.inbox).iterdir()) == []
    entries = sorted(_entries(cfg).values(), key=lambda e: e["stored_as"])
    assert [(e.get("file_gone", False), e.get("pending_move")) for e in entries] == [
        (True, False),  # the abandoned reservation
        (False, None),  # the folder itself, as <name>.1
    ], entries
    assert entries[1]["stored_as"] == entries[0]["stored_as"] + ".1"


def test_when_the_intake_cannot_be_listed_the_listing_says_it_cannot_tell(
    tmp_path: Path,
) -> None:
    cfg = keyless_red_config(tmp_path, "diode-bridge")
    _crashed_move(cfg, "a.d")
    intake = Path(cfg.red.work_dir) / "intake"
    saved = intake.with_name("intake.saved")
    intake.rename(saved)
    intake.write_text("not a folder\n")  # scandir: NotADirectoryError
    try:
        [e] = _entries(cfg).values()
    finally:
        intake.unlink()
        saved.rename(intake)
    assert e["file_gone"] is True and e["pending_move"] is None, e
    assert e["why"].startswith("[move pending or abandoned: a crash came before the rename; "
                               f"cannot tell which: {intake}: "), e  # fmt: skip
