"""Integration: the pipelined landing (``Landing.submit``) on real Delta tables, no Spark:
``submit`` returns while the apply runs; a failed apply — in the background or in a tick —
fails every later call instead of letting a new landing be journaled over the unapplied one;
a closed landing refuses batches; a restart finishes the landing from the journal."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bridge.config import Config
from bridge.red.job import open_landing
from bridge.red.landing import INTENT_FILE, REQUESTS_DIR, Landing, LandingError
from bridge.red.layout import intent_path
from bridge.red.tables import RedTables
from bridge.red.verify import Verdict
from tests.red_factory import keyless_red_config


def _config(root: Path) -> Config:
    return keyless_red_config(root, "pipeline-test")


def _junk(landing: Landing, ordinal: int) -> dict[str, Any]:
    """An intake file and the verdict row of its rejection (what an executor would send)."""
    name = f"c1.{ordinal:012d}.{ordinal:032x}.dbundle"
    (landing.intake_dir / f"{ordinal:012d}.{name}").write_bytes(b"junk")
    v = Verdict(name, "bundle", "reject", 4, reason="crypto", detail=f"{name}: not OpenPGP",
                channel="c1", seq=ordinal)  # fmt: skip
    return {"ordinal": ordinal, **v.to_row()}


def _audit_land_seqs(cfg: Config) -> list[int]:
    t = DeltaTable(str(Path(cfg.red.tables_dir) / "audit")).to_pyarrow_table()
    return sorted({v for a, v in zip(t["app_id"].to_pylist(), t["version"].to_pylist(),
                                      strict=True) if a == "diode-red"})  # fmt: skip


def _intent(cfg: Config) -> dict[str, Any]:
    return dict(json.loads((Path(cfg.red.state_dir) / "landing" / "intent.json").read_bytes()))


def test_submit_returns_before_the_apply_and_drain_hands_its_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    entered, release = threading.Event(), threading.Event()
    real = RedTables.append

    def held_append(self: RedTables, name: str, data: Any, **kw: Any) -> bool:
        entered.set()
        assert release.wait(30), "the test never released the apply"
        return real(self, name, data, **kw)

    monkeypatch.setattr(RedTables, "append", held_append)
    assert landing.submit([_junk(landing, 1)]) == []  # returned: the apply waits in append
    assert entered.wait(30), "the apply never started"
    assert _intent(cfg)["land_seq"] == 1 and landing.land_seq == 1
    # the inbox source (which must not import the landing) reads the same journal file
    assert intent_path(cfg.red.state_dir) == landing.journal_dir / INTENT_FILE
    release.set()
    done = landing.drain()
    assert [(r.land_seq, r.rejected) for r in done] == [(1, 1)]
    assert not (Path(cfg.red.state_dir) / "landing" / "intent.json").exists()
    assert _audit_land_seqs(cfg) == [1]
    landing.drain(close=True)
    with pytest.raises(LandingError, match="stopping"):
        landing.submit([_junk(landing, 2)])


def test_a_failed_background_apply_fails_every_later_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    real = RedTables.append
    fired: list[int] = []

    def failing(self: RedTables, name: str, data: Any, **kw: Any) -> bool:
        if name == "audit" and kw["version"] == 2:
            fired.append(2)
            raise OSError(28, "No space left on device (injected)")
        return real(self, name, data, **kw)

    monkeypatch.setattr(RedTables, "append", failing)
    landing.submit([_junk(landing, 1)])
    landing.submit([_junk(landing, 2)])  # landing 2 fails in the background
    for call in (lambda: landing.submit([_junk(landing, 3)]), landing.tick, landing.drain):
        with pytest.raises(LandingError, match="landing 2 failed: OSError.*injected"):
            call()
    assert fired == [2], "the fault did not fire"
    assert _intent(cfg)["land_seq"] == 2, "a later landing was journaled over landing 2"
    assert _audit_land_seqs(cfg) == [1]

    monkeypatch.setattr(RedTables, "append", real)
    again = open_landing(cfg)  # a restart: landing 2 is finished from the journal
    assert again.land_seq == 2 and _audit_land_seqs(cfg) == [1, 2]
    again.submit([_junk(again, 3)])
    assert [r.land_seq for r in again.drain()] == [3]


def test_a_failed_tick_apply_is_sticky_and_its_intent_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    landing.submit([_junk(landing, 1)])
    landing.drain()
    requests = Path(cfg.red.work_dir) / REQUESTS_DIR
    requests.mkdir(parents=True, exist_ok=True)
    (requests / "r1.json").write_text(json.dumps({"kind": "retire", "channel": "gone"}))
    real_save = Landing._save_state
    fired: list[int] = []

    def failing_save(self: Landing, n: int, *a: Any) -> None:
        if n == 2:
            fired.append(n)
            raise OSError(28, "No space left on device (injected)")
        real_save(self, n, *a)

    monkeypatch.setattr(Landing, "_save_state", failing_save)
    with pytest.raises(LandingError, match="landing 2 failed"):
        landing.tick()  # the audit of landing 2 is committed, its state save fails
    assert fired == [2], "the fault did not fire"
    with pytest.raises(LandingError, match="landing 2 failed"):
        landing.submit([_junk(landing, 2)])  # never journaled as landing 2 over the tick's
    assert _intent(cfg)["land_seq"] == 2 and _intent(cfg)["plains"] == []

    monkeypatch.setattr(Landing, "_save_state", real_save)
    again = open_landing(cfg)
    assert again.land_seq == 2
    again.submit([_junk(again, 2)])
    assert [r.land_seq for r in again.drain()] == [3]
    assert _audit_land_seqs(cfg) == [1, 2, 3]


def test_intake_quarantine_records_are_audited_and_unreadable_ones_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tick audits each record the intake left in ``work_dir/audit-pending`` once; a record
    that is not JSON, or not a record, is set aside with an error log instead of being skipped
    silently on every tick."""
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    pending = Path(cfg.red.work_dir) / "audit-pending"
    pending.mkdir(parents=True, exist_ok=True)
    good = {"raw_name": "x y", "raw_name_hex": b"x y".hex(), "reason": "bad_name",
            "stored_as": str(tmp_path / "quarantine" / "d" / "x_y-1"), "at": None}  # fmt: skip
    (pending / "a.json").write_text(json.dumps(good))
    (pending / "b.json").write_bytes(b"{torn")
    (pending / "c.json").write_text(json.dumps({"reason": "bad_name"}))
    with caplog.at_level("ERROR", logger="bridge.red.landing"):
        res = landing.tick()
    assert res.events.get("quarantined") == 1, res.events
    assert sorted(p.name for p in pending.iterdir()) == ["b.json.unreadable", "c.json.unreadable"]
    assert sum("intake quarantine record unreadable" in r.getMessage() for r in caplog.records) == 2
    t = DeltaTable(str(Path(cfg.red.tables_dir) / "audit")).to_pyarrow_table()
    rows = [r for r in t.to_pylist() if r["event"] == "quarantined"]
    assert [(r["file_name"], r["reason"]) for r in rows] == [("x_y-1", "bad_name")]
    assert landing.tick().events == {}  # nothing left to audit, nothing audited twice
    landing.drain(close=True)


def test_the_commits_are_fsynced_before_the_state_says_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delta-rs fsyncs none of its commits: the landing's commit files (and ``_delta_log``)
    must be fsynced before red-state.json is written, or a power loss could leave a state
    that says "landed" over a table that lost the commit (the resend would then be skipped)."""
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    seen: list[Path] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    landing.submit([_junk(landing, 1)])
    assert [r.land_seq for r in landing.drain(close=True)] == [1]
    state_at = next(i for i, p in enumerate(seen) if p.name.startswith(".red-state.json."))
    for name in ("bundles", "audit"):
        log_dir = (Path(cfg.red.tables_dir) / name / "_delta_log").resolve()
        v = DeltaTable(str(log_dir.parent)).version()
        assert log_dir / f"{v:020d}.json" in seen[:state_at], f"{name} commit not fsynced first"
        assert log_dir in seen[:state_at]


def test_a_table_that_lost_a_landed_commit_is_refused_at_start(tmp_path: Path) -> None:
    """The state records the last landing each table holds: a table behind it (it lost a
    commit, e.g. to a power loss, or was restored from an older backup) is refused at start
    instead of skipping those rows for good."""
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    for k in (1, 2):
        landing.submit([_junk(landing, k)])
    landing.drain(close=True)
    assert _audit_land_seqs(cfg) == [1, 2]
    open_landing(cfg).drain(close=True)  # consistent: starts
    log_dir = Path(cfg.red.tables_dir) / "audit" / "_delta_log"
    newest = max(log_dir.glob("*.json"))
    newest.unlink()  # landing 2's audit commit, lost
    with pytest.raises(LandingError, match="table 'audit' holds landing 1 but the state"):
        open_landing(cfg)
