"""Unit: black report — status from the journal, strict parsing of file names on disk; red
report — silence judged by the clock from a saved red state."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bridge.black.report import channel_status, files_table
from bridge.black.state import ChannelState, StateStore
from bridge.config import config_from_dict
from bridge.fsutil import atomic_write_bytes, durable_mkdir
from bridge.red import sequence as sq
from bridge.red.layout import STATE_FILE
from bridge.red.report import red_status
from tests.red_factory import keyless_red_config


def test_status_and_files(tmp_path: Path) -> None:
    cfg = config_from_dict(
        {"channels": [{"name": "c", "encrypt": False}]}, base=tmp_path, environ={}
    )
    StateStore(cfg.black.state_dir).save(
        ChannelState(channel="c", last_bundle_seq=2, last_seq=9, counters={"lost_maxlen": 3})
    )
    (cfg.black.archive / "c").mkdir(parents=True)
    (cfg.black.outbox).mkdir(parents=True)
    good = "c.000000000002." + "a" * 32 + ".dbundle"
    (cfg.black.archive / "c" / good).write_bytes(b"x" * 10)
    (cfg.black.outbox / good).write_bytes(b"x" * 10)
    (cfg.black.outbox / "c.000000000007.dheartbeat").write_bytes(b"h")
    (cfg.black.outbox / "../../evil.dbundle").resolve().write_bytes(b"")  # outside: never listed
    (cfg.black.outbox / "c.2.short.dbundle").write_bytes(b"")  # malformed: skipped
    st = channel_status(cfg)
    ch = st["channels"]["c"]
    assert (ch["last_bundle_seq"], ch["last_seq"], ch["lost"]) == (2, 9, {"maxlen": 3})
    assert ch["outbox_bundles"] == 1
    arch = files_table(cfg, where="archive").to_pylist()
    assert [(r["kind"], r["seq"], r["bytes"]) for r in arch] == [("bundle", 2, 10)]
    out = files_table(cfg, where="outbox").to_pylist()
    assert sorted((r["kind"], r["seq"]) for r in out) == [("bundle", 2), ("heartbeat", 7)]


def _save_red_state(state_dir: Path, state: sq.SequenceState) -> None:
    """``red-state.json`` as a landing leaves it (the job has stopped since)."""
    doc = {"land_seq": 1, "sequence": state.to_json(), "saved_at": "2026-11-25T00:00:00Z"}
    atomic_write_bytes(durable_mkdir(state_dir) / STATE_FILE, json.dumps(doc).encode())


def test_red_status_judges_silence_by_the_clock_without_a_job(tmp_path: Path) -> None:
    """``silent`` is the stopped job's last verdict (false); ``silent_now`` is what the clock
    says: a heartbeat two hours old is silent now, with no job running to notice."""
    cfg = keyless_red_config(tmp_path, "rep", channels=("old", "new", "never"))
    now = datetime.now(UTC)
    two_hours_ago = now - timedelta(hours=2)
    st = sq.SequenceState()
    sq.heartbeat(st, sq.HeartbeatFacts("old", 1, 0, None, "2026-11-25T00:00:00Z", 10.0),
                 two_hours_ago)  # fmt: skip
    sq.heartbeat(st, sq.HeartbeatFacts("new", 1, 0, None, "2026-11-25T00:00:00Z", 10.0),
                 now - timedelta(seconds=5))  # fmt: skip
    sq.heartbeat(st, sq.HeartbeatFacts("gone", 1, 0, None, "2026-11-25T00:00:00Z", 10.0),
                 two_hours_ago)  # fmt: skip
    sq.tick(st, two_hours_ago, cfg.red.link_silent_seconds, ["never"])  # watched, never heard
    sq.retire(st, "gone", "CHG-1", two_hours_ago, ["old", "new", "never"])
    _save_red_state(Path(cfg.red.state_dir), st)

    report = red_status(cfg)
    assert report["landing_running"] is False and cfg.red.link_silent_seconds < 3600
    ch = report["channels"]
    old, new, never, gone = ch["old"], ch["new"], ch["never"], ch["gone"]
    assert old["silent"] is False and old["silent_now"] is True  # the saved flag is unchanged
    assert 7200 <= old["quiet_s"] < 7300 and old["quiet_s"] == old["heartbeat_age_s"]
    assert new["silent_now"] is False and new["quiet_s"] < 60
    assert never["heartbeat_age_s"] is None and never["silent_now"] is True
    assert 7200 <= never["quiet_s"] < 7300  # since red began watching it
    assert gone["retired"] is not None and gone["silent_now"] is None
    json.dumps(report)  # --json prints it
