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
