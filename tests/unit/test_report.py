"""Unit: black report — status from the journal, strict parsing of file names on disk; red
report — silence judged by the clock from a saved red state."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bridge.black.report import channel_status, files_table
from bridge.black.state import ChannelState, StateStore
from bridge.config import config_from_dict, load_config
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


def test_a_damaged_file_of_one_channel_is_shown_and_the_others_still_reported(
    tmp_path: Path,
) -> None:
    """An empty journal (channel-b.json), a torn heartbeat seq file (a's), a damaged tap status
    file (c's): `diode status` and `diode gaps` used to fail for every channel on the first, and
    showed the second as "-" and the third as "never ran". Each now says "unreadable: <reason>"
    for its channel only; the other channels are reported as before."""
    from click.testing import CliRunner

    from bridge.black.gaplog import append_gaps
    from bridge.cli import cli
    from bridge.protocol.manifest import Gap

    toml = tmp_path / "diode.toml"
    toml.write_text(
        "".join(f'[[channels]]\nname = "{c}"\nencrypt = false\n' for c in "abcd")
        + '[black]\nstate_dir = "state"\noutbox = "outbox"\narchive = "archive"\n'
    )
    cfg = load_config(toml, environ={})
    state = Path(cfg.black.state_dir)
    store = StateStore(state)
    for c in "acd":
        store.save(ChannelState(channel=c, last_bundle_seq=3, last_seq=20,
                                counters={"lost_maxlen": 2}))  # fmt: skip
        append_gaps(state, c, 2, (Gap(5, 6, "maxlen"),))
    (state / "channel-b.json").write_bytes(b"")  # the damage: an empty journal
    append_gaps(state, "b", 1, (Gap(1, 1, "oversize"),))
    (state / "heartbeat-a.json").write_bytes(b'{"heartbeat_s')  # torn
    (state / "heartbeat-d.json").write_text('{"heartbeat_seq": 42}')
    (state / "tap-c.json").write_text("[]")  # JSON, not a status

    ch = channel_status(cfg)["channels"]
    assert str(ch["b"]["last_bundle_seq"]).startswith("unreadable: ")
    assert str(state / "channel-b.json") in ch["b"]["journal_error"]
    assert ch["b"]["lost"] is None and ch["b"]["last_seq"] is None  # unknown, not zero
    assert str(ch["a"]["heartbeat_seq"]).startswith("unreadable: heartbeat seq file ")
    assert str(state / "heartbeat-a.json") in ch["a"]["heartbeat_seq"]
    assert ch["c"]["spool"]["tap"].startswith(f"unreadable: tap status file {state}/tap-c.json")
    for c in "acd":
        assert (ch[c]["journal_error"], ch[c]["last_bundle_seq"], ch[c]["lost"]) == (
            None, 3, {"maxlen": 2})  # fmt: skip
    assert ch["d"]["heartbeat_seq"] == 42 and ch["d"]["spool"] == {"tap": "never ran"}

    runner = CliRunner()
    status = runner.invoke(cli, ["status", "--side", "black", "--config", str(toml), "--json"])
    assert status.exit_code == 0, status.output
    doc = json.loads(status.output)
    assert doc["channels"]["b"]["last_bundle_seq"] == ch["b"]["last_bundle_seq"]
    assert doc["channels"]["d"]["last_bundle_seq"] == 3
    table = runner.invoke(cli, ["status", "--side", "black", "--config", str(toml)])
    assert table.exit_code == 0, table.output
    assert "unreadable" in table.output
    gaps = runner.invoke(cli, ["gaps", "--side", "black", "--config", str(toml), "--json"])
    assert gaps.exit_code == 0, gaps.output
    got = json.loads(gaps.output)
    assert [(r["first_seq"], r["reason"]) for r in got["b"]["ranges"]] == [(1, "oversize")]
    assert got["b"]["lost"] is None and got["a"]["lost"] == {"maxlen": 2}


def test_a_tap_that_stopped_is_shown_stopped_not_by_its_last_pid(tmp_path: Path) -> None:
    """The tap status file keeps the pid and age of a tap that exited: `diode status` showed
    `pid 1425, 35.4 s ago` as if it ran. Whether it runs is its spool LOCK (held while it
    runs, released by the kernel however it ends)."""
    from dataclasses import asdict

    from bridge.black.spool import SpoolWriter
    from bridge.black.tap import TapStatus, status_path
    from bridge.views import black_status_view, make_console, print_views

    toml = tmp_path / "diode.toml"
    toml.write_text('[[channels]]\nname = "a"\nencrypt = false\n[black]\nstate_dir = "state"\n'
                    'spool_dir = "spool"\noutbox = "outbox"\narchive = "archive"\n')  # fmt: skip
    cfg = load_config(toml, environ={})
    durable_mkdir(Path(cfg.black.state_dir))
    st = TapStatus(channel="a", pid=1425, durable_end=7, updated=datetime.now(UTC).timestamp())
    atomic_write_bytes(status_path(cfg, "a"), json.dumps(asdict(st)).encode())

    def shown() -> tuple[bool, str]:
        doc = channel_status(cfg)
        c = make_console(record=True, width=220)
        print_views([black_status_view(doc)], console=c)
        return doc["channels"]["a"]["spool"]["tap_running"], c.export_text()

    with SpoolWriter.open(Path(cfg.black.spool_dir), "a", min_free_bytes=0):  # a running tap
        running, text = shown()
        assert running is True and "pid 1425" in text and "stopped" not in text, text
    running, text = shown()
    assert running is False and "stopped (pid 1425" in text, text
