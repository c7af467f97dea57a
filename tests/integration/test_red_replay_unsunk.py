"""Red, replay: events the audit sink has not taken survive a close and a kill -9.

The replay saves its progress past a skipped row (``replay_failed`` kind ``bad_row``) or a gap
it went past (``replay_gap_passed``): such a row is never read again. Its event used to be kept
only in memory while the sink failed (dropped at close with "retrying later", no retry ever
came) or until the pass end (a kill after a save lost it): ``diode red rewind --skipped`` then
never found the row. Real Delta tables, a real red vhost, the replay in this process or killed
in one of its own.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bridge.errors import StateError
from bridge.protocol.exchange import ExchangeDecl
from bridge.red.replay import Replayer, audit_sink
from bridge.red.replay_results import bound_events
from bridge.red.replay_rewind import Rewind, Target, plan_rewind, rewind_exchange
from bridge.red.replay_state import PROGRESS_FILE, load_progress
from bridge.red.tables import RedTables
from tests.conftest import Vhost
from tests.integration.test_red_replay import (
    BAD_ROWS,
    crash_after_save,
    land,
    make_cfg,
    rows,
    save_state,
)
from tests.support import json_lines

X = ExchangeDecl("x.unsunk", "fanout", True)
BAD_PROPS = BAD_ROWS["truncated_properties"][1]  # property bytes that do not parse


def _failed(channel: str | None, first: int | None, kind: str, n: int) -> dict[str, Any]:
    return {"event": "replay_failed", "exchange": "x", "channel": channel, "seq_first": first,
            "seq_last": first, "reason": f"why {n}",
            "detail": json.dumps({"kind": kind, "rows": 1, "land_seq": n})}  # fmt: skip


def _down(events: list[dict[str, Any]]) -> None:
    raise OSError(28, "No space left on device")  # the audit table's disk is full


def _saved_events(state: Path) -> list[dict[str, Any]]:
    doc = json.loads((state / PROGRESS_FILE).read_text())
    return doc["exchanges"][X.name].get("unaudited_events", [])


def _audited(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind, the rows the events other than ``replayed`` name: ``(channel, seq_first,
    seq_last)`` each, rows counted for ``unroutable`` (its events fall into passes by timing)."""
    out: dict[str, Any] = {}
    for e in events:
        if e["event"] == "replayed":
            continue
        d = json.loads(e["detail"])
        kind = d.get("kind", e["event"])
        if kind == "unroutable":
            out[kind] = out.get(kind, 0) + d["rows"]
        else:
            out.setdefault(kind, []).append((e["channel"], e["seq_first"], e["seq_last"]))
    return out


# ---------------------------------------------------------------------------- pure pieces
def test_events_beyond_the_cap_fold_into_summaries_that_still_count_them() -> None:
    events = [_failed("c1", s, "bad_row", s) for s in (7, 3, 9)]
    events += [_failed("c2", 4, "user_id", 10), _failed(None, None, "declare", 11)]
    events += [_failed("c1", 20, "bad_row", 12)]
    kept, folded = bound_events([dict(e) for e in events], 1)
    assert folded == 5 and kept[-1] == events[-1]  # the newest kept as it came
    by = {(e["channel"], json.loads(e["detail"])["kind"]): e for e in kept[:-1]}
    assert set(by) == {("c1", "bad_row"), ("c2", "user_id"), (None, "declare")}
    c1 = by[("c1", "bad_row")]
    assert (c1["seq_first"], c1["seq_last"]) == (3, 9)  # starts at the first row skipped
    d = json.loads(c1["detail"])
    assert (d["folded"], d["rows"], d["first_reason"]) == (3, 3, "why 7")
    assert "3 replay_failed events" in c1["reason"] and "why 7" in c1["reason"]
    assert by[("c2", "user_id")] == events[3]  # alone in its group: unchanged
    newest = _failed("c1", 1, "bad_row", 13)
    again, more = bound_events([*kept, newest], 1)  # the summary folds again, counts add up
    assert more == 4 and again[-1] == newest
    (c1,) = [e for e in again[:-1] if e["channel"] == "c1"]
    assert json.loads(c1["detail"])["folded"] == 4 and (c1["seq_first"], c1["seq_last"]) == (3, 20)
    assert bound_events(events, 10) == (events, 0)


def test_a_progress_file_without_unaudited_events_loads_and_a_malformed_one_is_refused(
    tmp_path: Path,
) -> None:
    old = {"land_seq": 3, "channel": "c1", "seq": 9, "confirmed_rows": 9, "updated_at": None,
           "high": {"c1": 9}, "passed": {}}  # fmt: skip
    path = tmp_path / PROGRESS_FILE
    path.write_text(json.dumps({"format": 1, "exchanges": {"x": old}}))
    p = load_progress(tmp_path)["x"]
    assert p.key == (3, "c1", 9) and p.unaudited_events == []
    assert "unaudited_events" not in p.to_json()  # saved as before while there are none
    path.write_text(json.dumps({"format": 1, "exchanges": {"x": {**old,
                    "unaudited_events": [{"event": "replay_failed"}, 7]}}}))  # fmt: skip
    with pytest.raises(StateError, match="malformed.*unaudited_events"):
        load_progress(tmp_path)


# ---------------------------------------------------------------------------- the broker
@pytest.mark.broker
def test_events_a_failing_sink_did_not_take_are_written_first_at_the_next_start(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    """The sink fails for the whole first run (disk full): the progress goes past the skipped
    row, the gap and the returned rows (no queue bound on red), their events are saved with it;
    the next run writes them first, once."""
    url = red_vhost.amqp_url
    ago = datetime.now(UTC) - timedelta(hours=1)  # the gap's hold (1 s) ran out long ago
    land(tables, 1, rows("c1", [0], X), rows("c1", [1], X, props=BAD_PROPS),
         rows("c1", range(2, 5), X), landed_at=ago)  # fmt: skip
    land(tables, 2, rows("c1", range(10, 15), X), landed_at=ago)
    save_state(tmp_path, 2, [(1, 0, 4), (3, 10, 14)])  # bundle 2 (seqs 5-9) never came
    cfg = make_cfg(tmp_path, url, [X.name], gap_hold_seconds=1.0)
    state = tmp_path / "state"
    first = Replayer(cfg, sink=_down).run(until_caught_up=True, timeout=20)
    assert first.caught_up and first.confirmed == 9, first
    want = {"bad_row": [("c1", 1, 1)], "replay_gap_passed": [("c1", 10, 10)], "unroutable": 9}
    assert _audited(first.events) == want
    assert load_progress(state)[X.name].seq == 14  # past all of them: never read again
    assert _audited(_saved_events(state)) == want
    shown = Replayer(cfg).status()["exchanges"][X.name]["progress"]  # counted, not listed
    assert shown["unaudited_events"] == len(_saved_events(state)), shown
    # `diode red rewind --skipped` meanwhile: the audit table has none of them, the progress has
    plan = plan_rewind(cfg, X.name, Target(skipped=True), load_progress(state))
    assert isinstance(plan, Rewind) and plan.first == (1, "c1", 1), plan
    sunk: list[dict[str, Any]] = []
    second = Replayer(cfg, sink=sunk.extend).run(until_caught_up=True, timeout=20)
    assert second.caught_up and second.published == 0, second
    (bad,) = [e for e in sunk if e["event"] == "replay_failed" and e["seq_first"] == 1]
    assert (bad["exchange"], bad["channel"], bad["seq_last"]) == (X.name, "c1", 1)
    assert json.loads(bad["detail"])["kind"] == "bad_row"  # what `rewind --skipped` finds
    assert _audited(sunk) == want
    others = [e for e in sunk if e["event"] != "replayed"]
    assert sunk[: len(others)] == others  # written first
    replayed = [e for e in sunk if e["event"] == "replayed"]  # the first run's ranges too
    assert sum(json.loads(e["detail"])["rows"] for e in replayed) == 9
    assert _saved_events(state) == []  # taken: forgotten
    third: list[dict[str, Any]] = []
    Replayer(cfg, sink=third.extend).run(until_caught_up=True, timeout=20)
    assert third == []


@pytest.mark.broker
def test_a_kill_9_after_a_save_past_a_skipped_row_loses_no_replay_failed(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    """Killed right after the first save, which went past the skipped row before the pass end
    handed its event to the sink: the next run writes the event."""
    url = red_vhost.amqp_url
    land(tables, 1, rows("c1", [1], X, props=BAD_PROPS))  # a batch of it alone: batch_rows 1
    land(tables, 2, rows("c1", [2, 3], X))
    spec = {
        "channels": [{"name": "c1", "encrypt": False}],
        "red": {
            "state_dir": str(tmp_path / "state"),
            "tables_dir": str(tmp_path / "tables"),
            "replay": {"amqp_url": url, "approved": [X.name], "batch_rows": 1},
        },
    }
    audit = crash_after_save(tmp_path, spec)
    assert load_progress(tmp_path / "state")[X.name].seq == 1  # the save went past it
    sunk: list[dict[str, Any]] = []
    s = Replayer(make_cfg(tmp_path, url, [X.name]), sink=sunk.extend).run(
        until_caught_up=True, timeout=20
    )
    assert s.caught_up and s.confirmed == 2, s
    events = (json_lines(audit) if audit.exists() else []) + sunk
    assert _audited(events)["bad_row"] == [("c1", 1, 1)]  # once (rows 2-3: unroutable, no queue)


def _skipped_run(tmp_path: Path, tables: RedTables, url: str) -> Any:
    """A replay whose audit sink failed for its whole run past a skipped row (c1 seq 1): the
    replay_failed event waits in the progress. Returns the config."""
    land(tables, 1, rows("c1", [0], X), rows("c1", [1], X, props=BAD_PROPS),
         rows("c1", range(2, 5), X))  # fmt: skip
    save_state(tmp_path, 1, [(1, 0, 4)])
    cfg = make_cfg(tmp_path, url, [X.name])
    first = Replayer(cfg, sink=_down).run(until_caught_up=True, timeout=20)
    assert first.caught_up and _audited(_saved_events(tmp_path / "state"))["bad_row"]
    return cfg


def _audit_rows(tables: RedTables) -> list[tuple[int, str]]:
    got = tables.read("audit", columns=["version", "event", "app_id"]).to_pylist()
    return sorted((r["version"], r["event"]) for r in got if r["app_id"] == "diode-replay")


@pytest.mark.broker
def test_a_skipped_rewind_writes_the_skips_it_republishes_with_its_own_row(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    """`--skipped` found the skip still waiting in the progress; the replay then wrote it at
    a version above the rewind's row, so the next `--skipped` went back to it again (rows
    republished twice, nothing skipped since). The rewind writes them in its own commit."""
    cfg = _skipped_run(tmp_path, tables, red_vhost.amqp_url)
    out = rewind_exchange(cfg, X.name, Target(skipped=True))
    assert out["rewound"] and out["audit_rows_written"] == 1, out
    assert out["first_row"]["seq"] == 1
    versions = {v for v, e in _audit_rows(tables) if e in ("replay_rewound", "replay_failed")}
    assert len(versions) == 1, _audit_rows(tables)  # one commit
    assert _saved_events(tmp_path / "state") == []
    again = rewind_exchange(cfg, X.name, Target(skipped=True))
    assert not again["rewound"] and "nothing to rewind" in again["note"], again


@pytest.mark.broker
def test_a_rewind_whose_audit_row_is_refused_stands_and_the_replay_writes_it(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    """The rewind saved the progress, then failed writing its audit row: exit 1, and running
    it again said "nothing to rewind", so the row was never written. It waits in the progress
    and the replay writes it first at its next start."""
    from tests.unit.test_black_dirs import refused_dir

    cfg = _skipped_run(tmp_path, tables, red_vhost.amqp_url)
    with refused_dir(tables.path("audit") / "_delta_log"):  # the fault: no commit there
        out = rewind_exchange(cfg, X.name, Target(skipped=True))
    assert out["rewound"] and out["audit_rows_written"] == 0, out
    assert "replay writes it first" in out["note"], out
    assert "replay_rewound" not in {e for _, e in _audit_rows(tables)}  # the case
    waiting = [e["event"] for e in _saved_events(tmp_path / "state")]
    assert "replay_rewound" in waiting and "replay_failed" in waiting, waiting
    Replayer(cfg, sink=audit_sink(cfg)).run(until_caught_up=True, timeout=20)
    written = _audit_rows(tables)
    (v,) = {v for v, e in written if e == "replay_rewound"}
    assert (v, "replay_failed") in written  # with the skip it republishes, in one commit
    # the republished bad row is skipped (and audited) again, after the rewind: found again
    assert any(w > v and e == "replay_failed" for w, e in written), written
