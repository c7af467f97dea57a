"""Integration: `diode status` and `diode gaps` pick the side(s) that ran on this host and show
them as tables, or as JSON with --json (the CLI in a subprocess over a real red state, real
Delta tables and a quarantine laid out as the red job lays it out)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bridge.config import Config, load_config
from bridge.fsutil import exclusive_lock
from bridge.red import sequence as sq
from bridge.red.job import open_landing
from tests.red_factory import RED_DIRS_TOML

DIODE = [sys.executable, "-m", "bridge.cli"]


def _config(root: Path) -> Config:
    p = root / "diode.toml"
    chans = "".join(f'[[channels]]\nname = "{c}"\nencrypt = false\n\n' for c in ("old", "new"))
    p.write_text(
        f'[link]\nbridge_id = "status-test"\n\n{chans}[black]\nstate_dir = "black/state"\n'
        f"[red]\n{RED_DIRS_TOML}"
    )
    return load_config(p, environ={})


def _seed_red(cfg: Config) -> None:
    """Red landed bundles 1, 2 and 6 of "old" (3..5 open), 2 breaking the chain, and heard a
    heartbeat saying black has sent 8 (7..8 open); "new" has bundle 1 and no heartbeat."""
    now = datetime.now(UTC)
    landing = open_landing(cfg)
    st = landing.state
    sq.admit(st, sq.BundleFacts("old", 1, "id1", "1" * 64, None, 10, 0, 9), now)
    sq.admit(st, sq.BundleFacts("old", 2, "id2", "2" * 64, "f" * 64, 10, 10, 19), now)
    sq.admit(st, sq.BundleFacts("old", 6, "id6", "6" * 64, None, 10, 50, 59), now)
    sq.admit(st, sq.BundleFacts("new", 1, "idn", "7" * 64, None, 5, 0, 4), now)
    hb = sq.HeartbeatFacts("old", 3, 8, 79, "2026-11-25T00:00:00Z", 10.0)
    sq.heartbeat(st, hb, now - timedelta(seconds=42))
    landing._save_state(landing.land_seq, st.to_json(), 0)
    day = Path(cfg.red.quarantine_dir) / now.strftime("%Y-%m-%d")
    day.mkdir(parents=True)
    stored = (("a.dbundle", "signature"), ("b.dbundle", "signature"), ("c.json", "name"))
    for name, reason in stored:
        (day / name).write_bytes(b"junk")
        rec = {"reason": reason, "original_name": name, "at": now.isoformat()}
        (day / f"{name}.reason.json").write_text(json.dumps(rec))


def _cli(cfg: Config, *args: str) -> str:
    p = subprocess.run(
        [*DIODE, *args, "--config", str(cfg.source)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def _json(cfg: Config, *args: str) -> Any:
    return json.loads(_cli(cfg, *args, "--json"))


def test_status_and_gaps_show_the_side_that_ran_here(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _seed_red(cfg)
    assert not Path(cfg.black.state_dir).exists()  # a red host: only red has run here

    st = _json(cfg, "status")
    red = _json(cfg, "red", "status")  # the same report as `diode red status`
    assert (
        set(st) == set(red)
        and st["channels"]["old"]["open_gaps"] == red["channels"]["old"]["open_gaps"]
    )
    old = st["channels"]["old"]
    assert (old["contig"], old["lag_bundles"], old["highest"]) == (2, 5, 6)  # 3-5 and 7-8
    assert old["open_gaps"][0]["first_bundle_seq"] == 3
    assert old["chain"] == "broken (1), unverified above 2"
    assert 41 <= old["heartbeat_age_s"] < 120
    new = st["channels"]["new"]
    assert (new["lag_bundles"], new["heartbeat_age_s"], new["chain"]) == (0, None, "intact")
    assert st["quarantine"] == {"total": 3, "by_reason": {"name": 1, "signature": 2}}
    assert st["files"]["quarantine"] == 3  # one walk; a file stored as c.json counts too

    table = _cli(cfg, "status")
    assert "red: landing" in table and "black bridge" not in table
    for text in ("old", "new", "3-5, 7-8", "broken (1)", "name 1, signature 2", " s ago"):
        assert text in table, (text, table)
    assert "no exchange landed yet" in table

    gaps = _cli(cfg, "gaps")
    assert "bundles missing in transit" in gaps and "3-5" in gaps
    assert _json(cfg, "gaps")["open_transit_gaps"][0]["last_bundle_seq"] == 5
    assert not Path(cfg.black.state_dir).exists()  # looking created nothing of black's

    black = _json(cfg, "status", "--side", "black")
    assert black["bridge_id"] == "status-test" and set(black["channels"]) == {"old", "new"}
    assert "black bridge status-test" in _cli(cfg, "status", "--side", "black")
    assert not Path(cfg.black.state_dir).exists()  # reports read, they create nothing
    assert set(_json(cfg, "status")) != {"black", "red"}
    Path(cfg.black.state_dir).mkdir(parents=True)  # black ran here too

    # both sides ran here (the demo, a test rig): both are shown
    both = _json(cfg, "status")
    assert set(both) == {"black", "red"} and both["red"]["channels"]["old"]["lag_bundles"] == 5
    assert set(_json(cfg, "gaps")) == {"black", "red"}
    table = _cli(cfg, "gaps")
    assert "messages black lost" in table and "bundles missing in transit" in table

    # a job holding its side's lock is seen from another process (status reads, takes nothing)
    assert both["black"]["job_running"] is False and both["red"]["landing_running"] is False
    with exclusive_lock(Path(cfg.black.state_dir) / "black.lock", what="a stand-in black job"):
        with exclusive_lock(Path(cfg.red.state_dir) / "red.lock", what="a stand-in red job"):
            held = _json(cfg, "status")
    assert held["black"]["job_running"] is True and held["red"]["landing_running"] is True
