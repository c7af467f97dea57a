"""Integration: `diode red write-off` on a real red state and real Delta tables (the CLI in a
subprocess): applied at once when no job runs, queued for a running job's tick otherwise;
refused, naming the open gaps, for bundles red is not waiting for."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bridge.config import Config
from bridge.errors import StateError
from bridge.fsutil import exclusive_lock
from bridge.red import sequence as sq
from bridge.red.job import open_landing
from bridge.red.landing import REQUESTS_DIR, Landing
from bridge.red.writeoff import write_off_gap
from tests.red_factory import keyless_red_config

DIODE = [sys.executable, "-m", "bridge.cli"]
T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)


def _config(root: Path) -> Config:
    return keyless_red_config(root, "write-off-test")


def _with_gap(cfg: Config) -> Landing:
    """A landing whose saved state has bundles 1 and 6 of c1: 2..5 open."""
    landing = open_landing(cfg)
    for n, a, b in ((1, 0, 9), (6, 50, 59)):
        facts = sq.BundleFacts("c1", n, f"id{n}", f"{n:064x}", None, b - a + 1, a, b)
        sq.admit(landing.state, facts, T0)
    landing._save_state(landing.land_seq, landing.state.to_json(), 0)
    return landing


def _cli(cfg: Config, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DIODE, "red", *args, "--config", str(cfg.source)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _gaps(cfg: Config) -> dict[str, Any]:
    p = _cli(cfg, "gaps", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _audit(cfg: Config, event: str) -> list[dict[str, Any]]:
    rows = DeltaTable(str(Path(cfg.red.tables_dir) / "audit")).to_pyarrow_table().to_pylist()
    return [r for r in rows if r["event"] == event]


def test_write_off_applies_at_once_audits_and_closes_the_gap(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _with_gap(cfg)
    p = _cli(cfg, "write-off", "--channel", "c1", "--from", "2", "--to", "4",
             "--note", "INC-7: pruned on black")  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["applied"] is True and out["events"] == {"gap_written_off": 1}
    gaps = _gaps(cfg)
    assert [(g["first_bundle_seq"], g["last_bundle_seq"]) for g in gaps["open_transit_gaps"]] == [
        (5, 5)]  # fmt: skip
    (w,) = gaps["written_off"]
    assert (w["channel"], w["first_bundle_seq"], w["last_bundle_seq"]) == ("c1", 2, 4)
    assert w["note"].startswith("INC-7: pruned on black (by ")
    (row,) = _audit(cfg, "gap_written_off")
    assert (row["channel"], row["reason"], row["app_id"]) == ("c1", "operator", "diode-red")
    assert json.loads(row["detail"])["first_bundle_seq"] == 2
    assert not list((Path(cfg.red.work_dir) / REQUESTS_DIR).glob("*.json"))  # consumed


def test_write_off_refuses_bundles_red_is_not_waiting_for(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _with_gap(cfg)
    p = _cli(cfg, "write-off", "--channel", "c1", "--from", "5", "--to", "7", "--note", "x")
    assert p.returncode == 1
    assert "not all in an open transit gap (open gaps of 'c1': 2..5)" in p.stderr
    p = _cli(cfg, "write-off", "--channel", "c1", "--from", "2", "--to", "2", "--note", " ")
    assert p.returncode == 2 and "--note is required" in p.stderr
    assert not _audit(cfg, "gap_written_off")
    assert [g["first_bundle_seq"] for g in _gaps(cfg)["open_transit_gaps"]] == [2]


def test_write_off_beside_a_running_job_is_queued_for_its_next_tick(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    landing = _with_gap(cfg)
    with exclusive_lock(Path(cfg.red.state_dir) / "red.lock", what="a red job (test)"):
        p = _cli(cfg, "write-off", "--channel", "c1", "--from", "2", "--to", "5", "--note", "x")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["applied"] is False and Path(out["queued"]).exists()
        assert out["note"].startswith("a red job holds "), out["note"]
        assert [g["first_bundle_seq"] for g in _gaps(cfg)["open_transit_gaps"]] == [2]
        res = landing.tick()  # what the running job does about every second
    assert res.events.get("gap_written_off") == 1
    assert _gaps(cfg)["open_transit_gaps"] == []
    assert not Path(out["queued"]).exists()
    assert len(_audit(cfg, "gap_written_off")) == 1


def test_writing_off_a_whole_gap_carries_the_frontier_and_marks_the_link_unverifiable(
    tmp_path: Path,
) -> None:
    """Bundles 2..5 written off with 6 landed: red's status counts 1..6 as accounted (it
    stayed at 1 for good, so 'does not move' alerts fired for ever), and the link into 6 is
    audited as unverifiable."""
    cfg = _config(tmp_path)
    _with_gap(cfg)
    p = _cli(cfg, "write-off", "--channel", "c1", "--from", "2", "--to", "5", "--note", "INC-8")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["events"] == {"gap_written_off": 1, "chain_unverifiable": 1}, out
    (row,) = _audit(cfg, "chain_unverifiable")
    assert (row["channel"], row["bundle_seq"], row["reason"]) == ("c1", 6, "written_off")
    p = _cli(cfg, "status", "--json")
    assert p.returncode == 0, p.stderr
    c1 = json.loads(p.stdout)["channels"]["c1"]
    assert (c1["contig"], c1["accounted"]) == (1, 6), c1
    assert "unverified above" not in c1["chain"] and "unverifiable across 1" in c1["chain"], c1


def test_a_request_file_that_is_not_a_request_is_refused_not_fatal(tmp_path: Path) -> None:
    """A request file holding JSON that is not an object, or seqs that are not integers, is
    refused and audited; the job's tick goes on (a list stopped it at every tick and start)."""
    cfg = _config(tmp_path)
    landing = _with_gap(cfg)
    reqs = Path(cfg.red.work_dir) / REQUESTS_DIR
    reqs.mkdir(parents=True, exist_ok=True)
    (reqs / "a.json").write_text('["write_off"]')
    doc = {"kind": "write_off", "channel": "c1", "first_bundle_seq": "2", "last_bundle_seq": 3.9}
    (reqs / "b.json").write_text(json.dumps(doc))
    res = landing.tick()
    assert res.events == {"request_refused": 2}, res.events
    errors = sorted(json.loads(r["detail"])["error"] for r in _audit(cfg, "request_refused"))
    assert "must be an integer" in errors[0] and "not a JSON object" in errors[1], errors
    assert [g["first_bundle_seq"] for g in _gaps(cfg)["open_transit_gaps"]] == [2]
    assert not list(reqs.glob("*.json"))  # consumed


def _shared_probe(cfg: Config) -> int:
    """What `diode red status` does to red.lock (a shared flock), held until closed."""
    fd = os.open(Path(cfg.red.state_dir) / "red.lock", os.O_RDONLY | os.O_CREAT, 0o640)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def test_write_off_waits_for_a_command_that_holds_red_lock_briefly(tmp_path: Path) -> None:
    """Another command's shared hold on red.lock (a status probe) is not a running job: the
    write-off waits for it and is applied, not queued for a tick that no job will run."""
    cfg = _config(tmp_path)
    _with_gap(cfg)
    fd = _shared_probe(cfg)
    threading.Timer(0.5, os.close, (fd,)).start()
    out = write_off_gap(cfg, "c1", 2, 3, "INC-1")
    assert out["applied"] is True, out
    assert [g["first_bundle_seq"] for g in _gaps(cfg)["open_transit_gaps"]] == [4]
    assert not list((Path(cfg.red.work_dir) / REQUESTS_DIR).glob("*.json"))


def test_write_off_queued_while_no_job_runs_does_not_claim_a_job(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _with_gap(cfg)
    fd = _shared_probe(cfg)
    try:
        began = time.monotonic()
        out = write_off_gap(cfg, "c1", 2, 3, "INC-1")
        assert time.monotonic() - began >= 1.0  # it waited for the lock first
    finally:
        os.close(fd)
    assert out["applied"] is False and Path(out["queued"]).exists()
    assert "a red job holds" not in out["note"] and "no red job holds" in out["note"], out


def test_a_second_write_off_says_when_and_with_which_note_it_was_written_off(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path)
    _with_gap(cfg)
    assert write_off_gap(cfg, "c1", 4, 5, "INC-2")["applied"] is True
    (w,) = _gaps(cfg)["written_off"]
    with pytest.raises(StateError) as e:
        write_off_gap(cfg, "c1", 4, 5, "INC-2")
    msg = str(e.value)
    assert f"bundle seqs 4..5: already written off: 4..5 at {w['at']} (note: 'INC-2 (by " in msg
    assert msg.endswith("; nothing to do") and "open gaps" not in msg, msg
    p = _cli(cfg, "write-off", "--channel", "c1", "--from", "3", "--to", "5", "--note", "x")
    assert p.returncode == 1
    assert "already written off: 4..5" in p.stderr
    assert "not all in an open transit gap (open gaps of 'c1': 2..3)" in p.stderr
