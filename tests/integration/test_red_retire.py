"""Integration: `diode red retire` on a real red state and real Delta tables (the CLI in a
subprocess): refused while the channel is configured; once removed from the config, its open
gaps are written off, it is audited and no longer watched; configured again, reinstated."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from bridge.config import Config
from bridge.fsutil import exclusive_lock
from bridge.red import sequence as sq
from bridge.red.job import open_landing
from bridge.red.landing import LOCK_FILE, REQUESTS_DIR
from tests.red_factory import keyless_red_config

DIODE = [sys.executable, "-m", "bridge.cli"]
T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)


def _config(root: Path, channels: list[str]) -> Config:
    return keyless_red_config(root, "retire-test", channels)


def _seed(root: Path) -> None:
    """Red has landed bundles 1 and 6 of "old" (2..5 open) and bundle 1 of "new"; both silent."""
    cfg = _config(root, ["old", "new"])
    landing = open_landing(cfg)
    for ch, n, a, b in (("old", 1, 0, 9), ("old", 6, 50, 59), ("new", 1, 0, 4)):
        facts = sq.BundleFacts(ch, n, f"id{n}", f"{n:064x}", None, b - a + 1, a, b)
        sq.admit(landing.state, facts, T0)
    landing._save_state(landing.land_seq, landing.state.to_json(), 0)
    res = landing.tick(T0 + timedelta(days=1))  # watch_since is unset: this starts the watch
    res = landing.tick(T0 + timedelta(days=2))
    assert res.events == {"link_silent": 2}


def _cli(cfg: Config, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DIODE, "red", *args, "--config", str(cfg.source)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _audit(cfg: Config, event: str) -> list[dict[str, Any]]:
    rows = DeltaTable(str(Path(cfg.red.tables_dir) / "audit")).to_pyarrow_table().to_pylist()
    return [r for r in rows if r["event"] == event]


def test_retire_is_refused_while_configured_then_audits_and_stops_the_watch(
    tmp_path: Path,
) -> None:
    _seed(tmp_path)
    cfg = _config(tmp_path, ["old", "new"])
    p = _cli(cfg, "retire", "--channel", "old", "--note", "CHG-42")
    assert p.returncode == 1 and "still in red's [[channels]]: remove it" in p.stderr
    assert not _audit(cfg, "channel_retired")

    cfg = _config(tmp_path, ["new"])  # the operator removes it, then retires it
    p = _cli(cfg, "retire", "--channel", "old", "--note", "CHG-42: feed decommissioned")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["applied"] is True and out["gaps_written_off"] == [[2, 5]]
    assert out["events"] == {"gap_written_off": 1, "chain_unverifiable": 1, "channel_retired": 1}
    (row,) = _audit(cfg, "channel_retired")
    detail = json.loads(row["detail"])
    assert (row["channel"], row["reason"], detail["was_silent"]) == ("old", "operator", True)
    assert detail["note"].startswith("CHG-42: feed decommissioned (by ")
    (wo,) = _audit(cfg, "gap_written_off")
    assert json.loads(wo["detail"])["first_bundle_seq"] == 2

    st = _cli(cfg, "status", "--json")
    assert st.returncode == 0, st.stderr
    old = json.loads(st.stdout)["channels"]["old"]
    assert old["retired"]["note"].startswith("CHG-42") and old["silent"] is False
    assert old["open_gaps"] == []
    assert not list((Path(cfg.red.work_dir) / REQUESTS_DIR).glob("*.json"))  # consumed

    p = _cli(cfg, "retire", "--channel", "old", "--note", "again")
    assert p.returncode == 1 and "retired already" in p.stderr

    # configured again: the next tick reinstates it
    cfg = _config(tmp_path, ["old", "new"])
    res = open_landing(cfg).tick()
    assert res.events == {"channel_reinstated": 1}
    (back,) = _audit(cfg, "channel_reinstated")
    assert json.loads(back["detail"])["retired_note"].startswith("CHG-42")


def test_retire_beside_a_running_job_is_queued_for_its_next_tick(tmp_path: Path) -> None:
    _seed(tmp_path)
    cfg = _config(tmp_path, ["new"])
    landing = open_landing(cfg)
    with exclusive_lock(Path(cfg.red.state_dir) / LOCK_FILE, what="a red job (test)"):
        p = _cli(cfg, "retire", "--channel", "old", "--note", "CHG-43")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["applied"] is False and Path(out["queued"]).exists()
        res = landing.tick()  # what the running job does about every second
    assert res.events == {"gap_written_off": 1, "chain_unverifiable": 1, "channel_retired": 1}
    assert not Path(out["queued"]).exists()
    assert landing.state.channels["old"].retired is not None


def test_a_retire_refused_by_a_job_still_configured_with_the_channel_is_audited(
    tmp_path: Path,
) -> None:
    _seed(tmp_path)
    job = open_landing(_config(tmp_path, ["old", "new"]))  # started before the config edit
    cfg = _config(tmp_path, ["new"])
    with exclusive_lock(Path(cfg.red.state_dir) / LOCK_FILE, what="a red job (test)"):
        p = _cli(cfg, "retire", "--channel", "old", "--note", "CHG-44")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["applied"] is False and "config it was started with" in out["note"]
        res = job.tick()
    assert res.events == {"request_refused": 1}  # the fault fired: refused, and said so
    (row,) = _audit(cfg, "request_refused")
    detail = json.loads(row["detail"])
    assert (row["channel"], row["reason"], detail["kind"]) == ("old", "retire", "retire")
    assert "still in red's [[channels]]" in detail["error"]
    assert detail["doc"]["note"].startswith("CHG-44")
    assert not Path(out["queued"]).exists() and job.state.channels["old"].retired is None
