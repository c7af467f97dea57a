"""Red, operator: with no red job and many silent links, `diode red status` names a handful of
them in its "silence is not being watched" warning and says how many more there are (one short
line, not every channel's name), while `--json` still gives every channel's ``silent_now``.

The CLI in a subprocess over a real red state (heartbeats heard two hours ago)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bridge.config import Config, load_config
from bridge.red import sequence as sq
from bridge.red.job import open_landing
from tests.red_factory import RED_DIRS_TOML

CHANNELS = [f"orders-eu-west-{i:02d}" for i in range(12)]
SILENT_NAMES_SHOWN = 5
"""bridge.views.SILENT_NAMES_SHOWN"""


def _config(root: Path) -> Config:
    p = root / "diode.toml"
    chans = "".join(f'[[channels]]\nname = "{c}"\nencrypt = false\n\n' for c in CHANNELS)
    p.write_text(f'[link]\nbridge_id = "silent-test"\n\n{chans}[red]\n{RED_DIRS_TOML}')
    return load_config(p, environ={})


def _all_heard_two_hours_ago(cfg: Config) -> None:
    landing = open_landing(cfg)
    st = landing.state
    then = datetime.now(UTC) - timedelta(hours=2)
    for name in CHANNELS:
        sq.heartbeat(st, sq.HeartbeatFacts(name, 1, None, None, "2026-11-25T00:00:00Z", 10.0), then)
    landing._save_state(landing.land_seq, st.to_json(), 0)


def _cli(cfg: Config, *args: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "red", "status", "--config", str(cfg.source), *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_many_silent_links_make_one_short_warning_and_json_lists_them_all(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path)
    _all_heard_two_hours_ago(cfg)
    doc: dict[str, Any] = json.loads(_cli(cfg, "--json"))
    assert sorted(n for n, c in doc["channels"].items() if c["silent_now"]) == CHANNELS
    table = _cli(cfg)
    flat = " ".join(table.split())  # the console folds long lines
    shown, more = CHANNELS[:SILENT_NAMES_SHOWN], len(CHANNELS) - SILENT_NAMES_SHOWN
    names = ", ".join(shown)
    all_ = f"({len(CHANNELS)} in all: --json, channels.*.silent_now)"
    want = f"silent now: {names} +{more} more {all_}"
    assert want in flat, table
    warning = flat[flat.index("no red job is running") :]
    assert not any(n in warning for n in CHANNELS[SILENT_NAMES_SHOWN:]), warning


def test_status_counts_no_lost_and_found(tmp_path: Path) -> None:
    """An inbox, or a processed_dir, that is a mount point has fsck's lost+found: the status
    counted it as a file waiting in the inbox (never taken: `files.inbox` never fell to 0)
    and the files in it as processed evidence. Red leaves it alone, and so does the count."""
    from bridge.red.report import red_status

    cfg = _config(tmp_path)
    open_landing(cfg)  # red's dirs and state
    inbox, processed = Path(cfg.red.inbox), Path(cfg.red.processed_dir)
    for root in (inbox, processed):
        (root / "lost+found").mkdir(parents=True)
        (root / "lost+found" / "#1234").write_bytes(b"fsck's")
    (processed / "2030-01-02").mkdir()
    (processed / "2030-01-02" / "a.000000000001.dbundle").write_bytes(b"evidence")
    files = red_status(cfg)["files"]
    assert (files["inbox"], files["processed"]) == (0, 1), files
