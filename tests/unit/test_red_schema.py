"""Red, tables: unit tests of the red table schemas and the audit / ledger row builders."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.protocol.schema import row_schema
from bridge.red import schema as rs

NOW = datetime(2026, 11, 22, 23, 30, tzinfo=UTC)


def _walk(t: pa.DataType) -> list[pa.DataType]:
    out = [t]
    for i in range(t.num_fields):
        out += _walk(t.field(i).type)
    return out


@pytest.mark.parametrize("name", rs.TABLE_NAMES)
def test_no_timestamp_ntz_anywhere(name: str) -> None:
    for f in rs.schema_for(name):
        for t in _walk(f.type):
            if pa.types.is_timestamp(t):
                assert t.tz == "UTC" and t.unit == "us", (name, f.name, t)


def test_messages_schema_is_the_wire_schema_then_red_columns() -> None:
    wire = row_schema(2)
    m = rs.messages_schema()
    assert m.metadata is None
    assert list(m)[: len(wire)] == list(wire)  # names, types and nullability, in order
    red = [(f.name, f.type, f.nullable) for f in list(m)[len(wire) :]]
    assert red == [
        ("bundle_seq", pa.int64(), False),
        ("bundle_id", pa.string(), False),
        ("land_seq", pa.int64(), False),
        ("landed_at", pa.timestamp("us", tz="UTC"), False),
        ("landed_date", pa.date32(), False),
        ("inexact", pa.string(), True),
    ]
    assert set(rs.MESSAGES_PARTITIONS) <= set(m.names)
    assert rs.MESSAGES_PARTITIONS == ("exchange", "landed_date")


@pytest.mark.parametrize("name", sorted(rs.ADDED_COLUMNS))
def test_added_columns_are_nullable_and_last(name: str) -> None:
    """What ensure adds to a table an earlier build created: nullable (Delta adds no other),
    at the end (where adding puts them: old and new tables keep one column order)."""
    s = rs.schema_for(name)
    added = rs.ADDED_COLUMNS[name]
    assert s.names[-len(added) :] == list(added)
    assert all(s.field(c).nullable for c in added)


def test_bundles_schema_required_columns() -> None:
    s = rs.bundles_schema()
    required = {f.name for f in s if not f.nullable}
    assert required == {
        "channel", "bundle_seq", "file_name", "status", "chain_status", "received_at", "land_seq"
    }  # fmt: skip
    assert s.field("encrypted").type == pa.bool_()
    assert s.field("gaps").type == pa.string()
    assert len(s) == 24


def test_audit_schema_required_columns() -> None:
    s = rs.audit_schema()
    required = {f.name for f in s if not f.nullable}
    assert required == {"event_id", "at", "event", "app_id", "version", "event_date"}
    assert s.field("event_date").type == pa.date32()
    assert rs.AUDIT_PARTITIONS == ("event_date",)


def test_schema_for_unknown_table() -> None:
    with pytest.raises(rs.RedTableError, match="no red table named 'nope'"):
        rs.schema_for("nope")


def test_audit_events_cover_the_brief_and_what_red_emits() -> None:
    brief = (
        "received landed duplicate conflict rejected quarantined gap_opened gap_closed "
        "gap_declared chain_verified chain_broken coverage_mismatch overlap_skipped heartbeat "
        "missing_last_bundle link_silent link_resumed approved revoked replayed replay_failed"
    ).split()
    assert set(brief) <= set(rs.AUDIT_EVENTS)
    assert len(set(rs.AUDIT_EVENTS)) == len(rs.AUDIT_EVENTS)
    # every event name literal in the red package (Event("x"), emit("x"), the replay's
    # self._event("x"), replace(event, kind="x")) is listed
    red_dir = Path(rs.__file__).parent
    pat = re.compile(r'(?:\bEvent\(|\bemit\(|\b_event\(\s*|\breplace\(\w+, kind=)"([a-z_]+)"')
    used = {m for p in red_dir.glob("*.py") for m in pat.findall(p.read_text())}
    assert used, "the scan found no event names: the pattern is stale"
    assert {"replayed", "replay_gap_passed", "replayed_out_of_order"} <= used
    assert used <= set(rs.AUDIT_EVENTS), sorted(used - set(rs.AUDIT_EVENTS))


# -- audit_rows ------------------------------------------------------------------------------


def test_audit_rows_fill_ids_dates_and_nulls() -> None:
    late = datetime(2026, 11, 23, 0, 30, tzinfo=timezone(timedelta(hours=2)))  # 22:30 UTC
    t = rs.audit_rows(
        [
            {"event": "received", "channel": "orders", "file_name": "f1"},
            {"event": "gap_opened", "channel": "orders", "seq_first": 5, "seq_last": 9, "at": late},
        ],
        "diode-red",
        7,
        NOW,
    )
    assert t.schema == rs.audit_schema()
    rows = t.to_pylist()
    assert [r["event_id"] for r in rows] == ["diode-red:7:0", "diode-red:7:1"]
    assert rows[0]["at"] == NOW and rows[0]["event_date"] == date(2026, 11, 22)
    assert rows[1]["at"] == late and rows[1]["event_date"] == date(2026, 11, 22)  # UTC date
    assert rows[0]["seq_first"] is None and rows[0]["detail"] is None
    assert {r["app_id"] for r in rows} == {"diode-red"} and {r["version"] for r in rows} == {7}
    # deterministic: the same events give the same table
    again = rs.audit_rows(
        [
            {"event": "received", "channel": "orders", "file_name": "f1"},
            {"event": "gap_opened", "channel": "orders", "seq_first": 5, "seq_last": 9, "at": late},
        ],
        "diode-red",
        7,
        NOW,
    )
    assert again.equals(t)


def test_audit_rows_empty() -> None:
    t = rs.audit_rows([], "diode-red", 1, NOW)
    assert t.num_rows == 0 and t.schema == rs.audit_schema()


@pytest.mark.parametrize(
    ("event", "match"),
    [
        ({"event": "x", "event_id": "mine"}, r"\['event_id'\] are computed"),
        ({"event": "x", "colour": 1}, r"unknown columns \['colour'\]"),
        ({"channel": "orders"}, "event is required"),
        ({"event": "x", "at": datetime(2026, 1, 1)}, "naive datetime"),
        ({"event": "x", "at": "2026-01-01"}, "at is str"),
        ({"event": "x", "bundle_seq": "seven"}, "audit.bundle_seq"),
    ],
)
def test_audit_rows_refuse_bad_events(event: dict[str, Any], match: str) -> None:
    with pytest.raises(rs.RedTableError, match=match):
        rs.audit_rows([event], "diode-red", 3, NOW)


def test_audit_rows_refuse_naive_commit_time() -> None:
    with pytest.raises(rs.RedTableError, match="diode-red:3: at is a naive"):
        rs.audit_rows([{"event": "x"}], "diode-red", 3, datetime(2026, 1, 1))


# -- bundles_rows ----------------------------------------------------------------------------


def _ledger(**kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "channel": "orders",
        "bundle_seq": 1,
        "file_name": "orders.b000000000001.parquet.gpg",
        "status": "landed",
        "chain_status": "first",
        "received_at": NOW,
        "land_seq": 1,
    }
    row.update(kw)
    return row


def test_bundles_rows_minimal_and_full() -> None:
    t = rs.bundles_rows([_ledger(), _ledger(bundle_seq=2, encrypted=True, gaps="[]", rows=10)])
    assert t.schema == rs.bundles_schema()
    rows = t.to_pylist()
    assert rows[0]["encrypted"] is None and rows[1]["encrypted"] is True
    assert rows[1]["rows"] == 10 and rows[0]["created_at"] is None


def test_bundles_rows_errors_name_the_row() -> None:
    with pytest.raises(rs.RedTableError, match=r"bundles row 0 .*'orders'.*: status is required"):
        rs.bundles_rows([_ledger(status=None)])
    with pytest.raises(rs.RedTableError, match=r"bundles row 1 .*bundle_seq=9.*unknown columns"):
        rs.bundles_rows([_ledger(), _ledger(bundle_seq=9, sha="x")])


# -- properties ------------------------------------------------------------------------------

_AUDIT_OPTIONAL = {
    "channel": st.text(max_size=8),
    "bundle_seq": st.integers(-(2**63), 2**63 - 1),
    "file_name": st.text(max_size=8),
    "seq_first": st.integers(0, 2**63 - 1),
    "seq_last": st.integers(0, 2**63 - 1),
    "exchange": st.text(max_size=8),
    "reason": st.text(max_size=8),
    "detail": st.text(max_size=16),
}
_times = st.datetimes(
    min_value=datetime(1970, 1, 2), max_value=datetime(9000, 1, 1), timezones=st.just(UTC)
)


@st.composite
def _events(draw: st.DrawFn) -> dict[str, Any]:
    ev: dict[str, Any] = {"event": draw(st.sampled_from(rs.AUDIT_EVENTS))}
    keys = draw(st.sets(st.sampled_from(sorted(_AUDIT_OPTIONAL))))
    for k in keys:
        ev[k] = draw(st.none() | _AUDIT_OPTIONAL[k])
    if draw(st.booleans()):
        ev["at"] = draw(_times)
    return ev


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(_events(), max_size=12),
    app_id=st.sampled_from(["diode-red", "diode-replay", "diode-approve"]),
    version=st.integers(0, 2**63 - 1),
    at=_times,
)
def test_audit_rows_property(
    events: list[dict[str, Any]], app_id: str, version: int, at: datetime
) -> None:
    t = rs.audit_rows(events, app_id, version, at)
    assert t.schema == rs.audit_schema() and t.num_rows == len(events)
    for i, (ev, row) in enumerate(zip(events, t.to_pylist(), strict=True)):
        when = ev.get("at", at)
        assert row["event_id"] == f"{app_id}:{version}:{i}"
        assert row["at"] == when and row["event_date"] == when.astimezone(UTC).date()
        assert (row["app_id"], row["version"]) == (app_id, version)
        for k in _AUDIT_OPTIONAL:
            assert row[k] == ev.get(k)  # given values kept, missing ones null
    assert len(set(t.column("event_id").to_pylist())) == len(events)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"bundle_seq": st.integers(1, 2**63 - 1), "land_seq": st.integers(0, 2**40)},
            optional={
                "bundle_id": st.text(max_size=6),
                "encrypted": st.booleans(),
                "rows": st.integers(0, 2**31),
                "landed_at": _times,
                "plaintext_sha256": st.text("0123456789abcdef", min_size=64, max_size=64),
            },
        ),
        max_size=8,
    )
)
def test_bundles_rows_property(parts: list[dict[str, Any]]) -> None:
    rows = [_ledger(**p) for p in parts]
    out = rs.bundles_rows(rows).to_pylist()
    assert len(out) == len(rows)
    for given_row, row in zip(rows, out, strict=True):
        assert set(row) == set(rs.bundles_schema().names)
        for k, v in row.items():
            assert v == given_row.get(k)


def test_chain_statuses_are_those_the_table_docs_list() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "red-tables.md").read_text()
    section = doc.split("### 2.2 Chain statuses", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)[1:]  # after the header
    assert listed == [*rs.CHAIN_STATUSES, rs.CHAIN_NOT_LANDED]
    assert rs.CHAIN_NOT_LANDED not in rs.CHAIN_STATUSES  # never set on a landed row
