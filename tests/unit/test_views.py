"""Unit: the operator tables of `diode status` / `diode gaps` (bridge.views) show what the
reports hold — losses, pending bundles, ranges, silence, held replay — and survive the
partial reports of a host where little has run yet."""

from __future__ import annotations

from typing import Any

from bridge import views


def _text(view: Any) -> str:
    c = views.make_console(record=True, width=220)
    views.print_views([view], console=c)
    return c.export_text()


def test_black_status_and_gaps_show_losses_pending_and_the_udp_link() -> None:
    st = {
        "bridge_id": "b1",
        "outbox_files": 3,
        "udp_outbox_files": 1,
        "channels": {
            "ops": {
                "last_bundle_seq": 12, "last_seq": 4999, "pending": True, "heartbeat_seq": 7,
                "lost": {"maxlen": 3}, "inexact": {}, "undecodable": 2, "outbox_bundles": 2,
                "spool": {"durable_end": 5000, "acked_through": 4999, "paused": False,
                          "tap_pid": 4242, "status_age_s": 0.4},
            },
            "idle": {"last_bundle_seq": 0, "last_seq": -1, "pending": False, "lost": {},
                     "inexact": {}, "spool": {"tap": "never ran"}},
        },
        "link": {"transport": "udp", "gaps_total": 2, "sender": {"epoch": 9, "age_seconds": 1.5,
                 "datagrams_sent": 100}, "receiver": None},
    }  # fmt: skip
    out = _text(views.black_status_view(st))
    want = ("black bridge b1", "3 file(s)", "1 in the UDP outbox", "4242", "maxlen 3",
            "interrupted", "never ran", "UDP link (2 gap", "datagrams_sent 100",
            "no status file", "undecodable 2")  # fmt: skip
    for text in want:
        assert text in out, (text, out)
    st["job_running"] = True  # the same pending bundle while a job runs: being sealed
    out = _text(views.black_status_view(st))
    assert "sealing" in out and "interrupted" not in out, out

    gaps = {
        "ops": {"lost": {"maxlen": 3}, "inexact": {"reordered-headers": 1}, "ranges": [
            {"first_seq": 10, "last_seq": 12, "kind": "lost", "reason": "maxlen", "bundle_seq": 4},
            {"first_seq": 20, "last_seq": 20, "kind": "inexact", "reason": "reordered-headers",
             "bundle_seq": 5},
        ]},
        "idle": {"lost": {}, "inexact": {}, "ranges": []},
    }  # fmt: skip
    out = _text(views.black_gaps_view(gaps))
    assert "10-12" in out and "maxlen" in out and "reordered-headers 1" in out
    assert "│ 20 " in out.replace("┃", "│")  # one seq is not a range
    assert "seq ranges" not in _text(views.black_gaps_view({"idle": gaps["idle"]}))


def test_the_udp_link_shows_a_stopped_end_and_a_damaged_status_file() -> None:
    link = {
        "transport": "udp",
        "gaps_total": 0,
        "sender": {
            "running": False,
            "epoch": 9,
            "age_seconds": 0.3,
            "datagrams_sent": 100,
            "dropped": {"tag": 249, "late": 0},
        },  # fmt: skip
        "receiver": {"running": True, "damaged": "not JSON: Expecting value", "path": "/s/x"},
    }
    out = _text(views._link_view(link))
    assert "stopped" in out and "datagrams_sent 100" in out, out
    assert "dropped tag 249" in out and "dropped late" not in out, out
    assert "status file damaged: not JSON" in out and "/s/x" in out, out
    link["sender"] = {**link["sender"], "running": True}
    assert "stopped" not in _text(views._link_view(link))


def test_red_status_shows_silence_held_replay_and_channels_not_heard_yet() -> None:
    st: dict[str, Any] = {
        "land_seq": 7,
        "state_saved_at": "2026-11-25T00:00:00Z",
        "link_silent_seconds": 60,
        "channels": {
            "ops": {"contig": 4, "highest": 9, "last_bundle_seq": 4, "lag_bundles": 5,
                    "open_gaps": [{"first_bundle_seq": 5, "last_bundle_seq": 8}],
                    "chain": "intact", "heartbeat_age_s": 75.0, "silent": True, "retired": None,
                    "counters": {"rows": 900, "declared_lost": 2}},
            "later": {"note": "nothing received yet"},
        },
        "files": {"inbox": 0, "intake": 1, "processed": 9, "quarantine": 0},
        "quarantine": {"total": 0, "by_reason": {}},
        "interrupted_landing": True,
        "replay": {"target": "amqp://red", "live": {"running": True}, "exchanges": {
            "orders": {"approved": True, "progress": {"channel": "ops", "seq": 41,
                       "confirmed_rows": 42}, "lag_rows": 3, "in_flight": 1,
                       "held": {"until": "soon"}, "stopped": None},
            "": {"approved": False, "progress": None, "lag_rows": 5, "in_flight": 0}}},
    }  # fmt: skip
    out = _text(views.red_status_view(st))
    for text in ("landing 7", "5-8", "SILENT (> 60 s)", "75.0 s ago", "nothing received yet",
                 "interrupted landing", ": running", "ops:41", "until", "(default)"):  # fmt: skip
        assert text in out, (text, out)
    assert "approval" not in out
    st["replay"] |= {"approvals_error": "approvals.json: bad JSON",
                     "unapproved_waiting": {"": 5, "audit.x": 2}}  # fmt: skip
    st["quarantine"] = {"error": "quarantine not readable: EIO"}
    out = _text(views.red_status_view(st))
    for text in (
        "approvals not readable: approvals.json: bad JSON",
        "waiting for approval",
        "(default) (5 rows), audit.x (2 rows)",
        "quarantine not readable: EIO",
    ):
        assert text in out, (text, out)
    st["replay"] = {"error": "OSError: no tables"}
    assert "replay: OSError: no tables" in _text(views.red_status_view(st))
    st |= {"interrupted_landing": False, "landing_running": True}
    out = _text(views.red_status_view(st))
    assert "is landing now" in out and "interrupted" not in out, out


def test_red_gaps_lists_each_kind_of_gap() -> None:
    gaps = {
        "open_transit_gaps": [{"channel": "ops", "first_bundle_seq": 5, "last_bundle_seq": 8,
                               "since": "t0"}],
        "written_off": [{"channel": "ops", "first_bundle_seq": 2, "last_bundle_seq": 2,
                         "at": "t1", "note": "CHG-1 [/rollback] [see ticket]"}],
        "declared_by_black": [{"channel": "ops", "seq_first": 100, "seq_last": 109,
                               "messages": 10, "reason": "maxlen", "bundle_seq": 3}],
        "udp_transport_gaps": [{"channel": "ops", "kind": "bundle", "seq": 6,
                                "reason": "timeout", "blocks_done": 1, "blocks_total": 4,
                                "epoch": 1795000000123, "object_id": 41},
                               {"channel": None, "kind": None, "reason": "unseen",
                                "epoch": 1795000000123, "object_id": 57,
                                "object_id_last": 63, "objects": 7}],
    }  # fmt: skip
    out = _text(views.red_gaps_view(gaps))
    for text in ("5-8", "CHG-1 [/rollback] [see ticket]", "100-109", "maxlen", "timeout", "1/4",
                 "1795000000123", "41", "unseen", "57-63"):  # fmt: skip
        assert text in out, (text, out)
    assert "None/None" not in out, out  # an unseen object had no blocks
    bare = _text(views.red_gaps_view({"open_transit_gaps": [], "declared_by_black": []}))
    assert "written off" not in bare and "UDP" not in bare


def test_names_from_the_wire_are_never_rich_markup() -> None:
    """Exchange, channel, bridge id, reasons and notes come from the wire, the broker or an
    operator: ``[/x]`` must not raise MarkupError and ``[bold]x`` must show as it is, on any
    console — not only on ``make_console``'s (markup off)."""
    from rich.console import Console

    nasty = ["[/x]", "[bold]x", "[link=http://evil]y[/link]", ":warning:"]
    red: dict[str, Any] = {
        "land_seq": 1,
        "state_saved_at": "[/t]",
        "channels": {n: {"contig": 1, "highest": 1, "chain": n, "silent": False,
                         "counters": {}} for n in nasty} | {"[/late]": {"note": "[/note]"}},
        "files": {"inbox": 0},
        "quarantine": {"total": 1, "by_reason": {"[/r]": 1}},
        "replay": {"target": "[/amqp]", "live": {}, "exchanges": {
            n: {"approved": True, "progress": {"channel": n, "seq": 1}, "held": n}
            for n in nasty}, "unapproved_waiting": {"[/w]": 2},
            "approvals_error": "[/e]"},
        "link": {"transport": "udp", "sender": {"epoch": 1, "[/k]": 3}, "receiver": None},
    }  # fmt: skip
    black: dict[str, Any] = {
        "bridge_id": "[/b]",
        "channels": {n: {"lost": {"[/l]": 1}, "inexact": {n: 1}, "spool": {"tap": n}}
                     for n in nasty},
    }  # fmt: skip
    gaps: dict[str, Any] = {
        "open_transit_gaps": [{"channel": n, "first_bundle_seq": 1, "last_bundle_seq": 1,
                               "since": n} for n in nasty],
        "written_off": [{"channel": "[/c]", "first_bundle_seq": 2, "last_bundle_seq": 2,
                         "note": "[/note] [bold]n"}],
        "udp_transport_gaps": [{"channel": "[/c]", "kind": "[/k]", "reason": "[/why]"}],
    }  # fmt: skip
    black_gaps = {n: {"lost": {n: 1}, "ranges": [{"first_seq": 1, "last_seq": 1, "kind": n,
                                                  "reason": n}]} for n in nasty}  # fmt: skip
    for view in (views.red_status_view(red), views.black_status_view(black),
                 views.red_gaps_view(gaps), views.black_gaps_view(black_gaps)):  # fmt: skip
        wide: dict[str, Any] = {"record": True, "width": 400}
        for console in (Console(**wide), views.make_console(**wide)):  # markup on, and off
            console.print(view)
            out = console.export_text()
            for n in nasty:
                assert n in out, (n, out)
    out = _text(views.red_status_view(red))
    want = ("[/t]", "[/late]", "[/note]", "[/r] 1", "[/amqp]", "[/w] (2 rows)", "[/e]", "[/k] 3")
    for text in want:
        assert text in out, (text, out)
    assert "[/b]" in _text(views.black_status_view(black))
    out = _text(views.red_gaps_view(gaps))
    assert "[/note] [bold]n" in out and "[/why]" in out


def _silence_report(**channel: Any) -> dict[str, Any]:
    ops = {"contig": 4, "highest": 4, "chain": "intact", "heartbeat_age_s": 7200.0,
           "silent": False, "counters": {}} | channel  # fmt: skip
    return {"land_seq": 3, "link_silent_seconds": 60, "channels": {"ops": ops},
            "files": {}, "quarantine": {}, "landing_running": False}  # fmt: skip


def test_red_status_without_a_job_judges_silence_by_the_heartbeats_age() -> None:
    """The saved ``silent`` is only updated by a running job's tick: with no job, a heartbeat
    two hours old must not show "ok", and the view says nobody is watching."""
    st = _silence_report(silent_now=True, quiet_s=7200.0)
    out = _text(views.red_status_view(st))
    assert "SILENT (> 60 s)" in out and "│ ok" not in out.replace("┃", "│"), out
    assert "silence is not being watched" in out and "silent now: ops" in out, out
    st = _silence_report(heartbeat_age_s=5.0, silent_now=False, quiet_s=5.0)
    out = _text(views.red_status_view(st))
    assert "SILENT" not in out and "silence is not being watched" in out, out
    assert "silent now" not in out, out
    st = _silence_report(silent_now=True, quiet_s=7200.0, retired={"at": "t", "note": "gone"})
    out = _text(views.red_status_view(st))
    assert "retired" in out and "SILENT" not in out and "silent now" not in out, out
    st = _silence_report(silent_now=False, quiet_s=5.0) | {"landing_running": True}
    out = _text(views.red_status_view(st))
    assert "not being watched" not in out and "is landing now" in out, out


def test_udp_gap_records_show_how_many_objects_each_stands_for() -> None:
    """An ``unseen`` range and a summary record (the disk refused records) each stand for many
    objects: the table counts them per record, a summary's id range says it is not every id,
    and the link title counts objects, not records."""
    gaps = {
        "open_transit_gaps": [], "declared_by_black": [],
        "udp_transport_gaps": [
            {"channel": "ops", "kind": "bundle", "seq": 4, "reason": "expired", "epoch": 9,
             "object_id": 3, "blocks_total": 2, "blocks_done": 1},
            {"reason": "unseen", "epoch": 9, "object_id": 10, "object_id_last": 14,
             "objects": 5},
            {"channel": "ops", "reason": "spool_error", "epoch": 9, "summary": True,
             "objects": 7, "object_id": 20, "object_id_last": 90},
        ],
    }  # fmt: skip
    rows = [line for line in _text(views.red_gaps_view(gaps)).splitlines() if "│" in line]
    expired = next(r for r in rows if "expired" in r)
    unseen = next(r for r in rows if "unseen" in r)
    summary = next(r for r in rows if "spool_error" in r)
    assert expired.rstrip(" │").endswith("1"), expired
    assert "10-14" in unseen and unseen.rstrip(" │").endswith("5"), unseen
    assert "20-90 (some)" in summary and summary.rstrip(" │").endswith("7"), summary
    link = {"transport": "udp", "gaps_total": 3, "gap_objects_total": 13}
    assert "UDP link (13 object(s) lost in 3 gap record(s)" in _text(views._link_view(link))
