"""Red, replay approvals: revisions, durability, locking, malformed files, the audit rows."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from deltalake import DeltaTable
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.config import Config, config_from_dict
from bridge.errors import ConfigError, StateError
from bridge.red import approvals as ap
from bridge.red.approvals import Approvals, approve_exchanges, effective_approved, sync_audit


def _cfg(tmp: Path, approved: list[str] | None = None) -> Config:
    return config_from_dict(
        {
            "channels": [{"name": "c1", "encrypt": False}],
            "red": {
                "state_dir": str(tmp / "state"),
                "tables_dir": str(tmp / "tables"),
                "replay": {"approved": approved or []},
            },
        },
        base=tmp,
        environ={},
    )


def _audit(tmp: Path) -> DeltaTable:
    from bridge.red.tables import RedTables

    t = RedTables(tmp / "tables", "delta-rs")
    t.ensure()
    return DeltaTable(str(t.path("audit")))


def _warned(out: dict) -> list[str]:  # type: ignore[type-arg]
    """The report's warnings but those about names with no landed row (these tests land
    nothing: that check has a test of its own)."""
    return [w for w in out["warnings"] if "has no landed row" not in w]


def test_empty_state_dir_has_nothing_approved(tmp_path: Path) -> None:
    a = Approvals.load(tmp_path / "nowhere")
    assert a.approved() == set() and a.revision == 0 and a.history == []
    assert not (tmp_path / "nowhere").exists()  # reading creates nothing


def test_approve_and_revoke_bump_revisions_and_survive_reload(tmp_path: Path) -> None:
    a = Approvals.load(tmp_path)
    assert a.approve("orders", "ops", "ticket 42") == 1
    assert a.approve("prices", "ops") == 2
    assert a.approve("orders", "someone else") == 1  # approved already: no new revision
    assert a.revision == 2
    assert a.revoke("orders", "ops", "done") == 3
    assert a.revoke("orders", "ops") == 3  # not approved: nothing to revoke
    b = Approvals.load(tmp_path)
    assert b.approved() == {"prices"} and b.revision == 3
    assert [(c.revision, c.action, c.exchange, c.by, c.note) for c in b.history] == [
        (1, "approve", "orders", "ops", "ticket 42"),
        (2, "approve", "prices", "ops", ""),
        (3, "revoke", "orders", "ops", "done"),
    ]
    assert b.approval("prices") is not None and b.approval("orders") is None
    assert [c.revision for c in b.changes_since(1)] == [2, 3]
    # the file is plain JSON, mode 0640, with no temp file left behind
    doc = json.loads((tmp_path / ap.APPROVALS_FILE).read_text())
    assert doc["revision"] == 3 and set(doc["approved"]) == {"prices"}
    assert stat.S_IMODE(os.stat(tmp_path / ap.APPROVALS_FILE).st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_stale_instance_reads_the_file_before_changing_it(tmp_path: Path) -> None:
    one, two = Approvals.load(tmp_path), Approvals.load(tmp_path)
    assert one.approve("a", "x") == 1
    assert two.approve("b", "y") == 2  # two had revision 0 in memory: it must not reuse 1
    assert two.revoke("a", "y") == 3  # and it sees "a" approved by the other instance
    assert Approvals.load(tmp_path).approved() == {"b"}


def in_threads(each: Callable[[str], object], names: list[str], k: int) -> list[BaseException]:
    """Call ``each`` on every name from ``k`` threads at once (names dealt round-robin); the
    errors they raised."""
    errors: list[BaseException] = []

    def work(chunk: list[str]) -> None:
        try:
            for n in chunk:
                each(n)
        except BaseException as e:  # pragma: no cover - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=work, args=(names[i::k],)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_concurrent_approvals_lose_nothing(tmp_path: Path) -> None:
    names = [f"x{i}" for i in range(24)]
    assert in_threads(lambda n: Approvals.load(tmp_path).approve(n, "t"), names, 4) == []
    a = Approvals.load(tmp_path)
    assert a.approved() == set(names)
    assert sorted(c.revision for c in a.history) == list(range(1, 25))


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"format": 2, "revision": 0, "history": []}',
        b'{"format": 1, "revision": 1, "history": [{"revision": 1}]}',
        b'{"format": 1, "revision": 2, "history": [{"revision": 1, "action": "approve", '
        b'"exchange": "a", "by": "x", "note": "", "at": "2026-01-01T00:00:00Z"}]}',
        b'{"format": 1, "revision": 1, "history": [{"revision": 1, "action": "delete", '
        b'"exchange": "a", "by": "x", "note": "", "at": "2026-01-01T00:00:00Z"}]}',
    ],
)
def test_a_malformed_file_is_refused_naming_it(tmp_path: Path, content: bytes) -> None:
    (tmp_path / ap.APPROVALS_FILE).write_bytes(content)
    with pytest.raises(StateError, match=ap.APPROVALS_FILE):
        Approvals.load(tmp_path)


@pytest.mark.parametrize("name", ["", "x" * 256, "é" * 128])
def test_names_that_cannot_be_exchanges_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError):
        Approvals.load(tmp_path).approve(name, "ops")
    assert not (tmp_path / ap.APPROVALS_FILE).exists()


_ops = st.lists(
    st.tuples(st.sampled_from(["approve", "revoke"]), st.sampled_from(["a", "b", "c", "amq.x"])),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_approvals_match_a_set_model(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    d = tmp_path_factory.mktemp("ap")
    model: set[str] = set()
    effective = 0
    a = Approvals.load(d)
    for action, name in ops:
        before = name in model
        rev, changed = a.change(action, name, "h")
        if action == "approve":
            model.add(name)
        else:
            model.discard(name)
        assert changed == (before != (name in model))
        effective += changed
        assert a.revision == effective
        if changed:
            assert rev == effective
    again = Approvals.load(d)
    assert again.approved() == model and again.revision == effective
    assert [c.revision for c in again.history] == list(range(1, effective + 1))


def test_effective_approvals_are_the_config_list_plus_the_file(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, approved=["from-config"])
    assert effective_approved(cfg) == {"from-config"}
    Approvals.load(tmp_path / "state").approve("at-runtime", "ops")
    assert effective_approved(cfg) == {"from-config", "at-runtime"}


def test_approve_exchanges_without_tables_reports_and_defers_the_audit(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, approved=["cfg-x"])
    out = approve_exchanges(cfg, ["a", "b"], note="why", by="ops")
    assert out["changed"] == [{"exchange": "a", "revision": 1}, {"exchange": "b", "revision": 2}]
    assert out["approved"] == ["a", "b", "cfg-x"] and out["audit_rows_written"] == 0
    out = approve_exchanges(cfg, ["a", "cfg-x"], revoke=True, by="ops")
    assert out["changed"] == [{"exchange": "a", "revision": 3}]
    assert out["unchanged"] == ["cfg-x"]
    assert out["approved"] == ["b", "cfg-x"]
    assert len(out["warnings"]) == 1 and "red.replay.approved" in out["warnings"][0]
    json.dumps(out)  # the CLI prints it


def test_approvals_are_audited_once_and_missing_rows_catch_up(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    approve_exchanges(cfg, ["early"], by="ops")  # before the audit table exists
    dt = _audit(tmp_path)
    out = approve_exchanges(cfg, ["orders"], note="ticket 7", by="ops")
    assert out["audit_rows_written"] == 2  # the early one caught up, in the same commit
    approve_exchanges(cfg, ["orders"], revoke=True, by="ops")
    dt.update_incremental()
    assert dt.transaction_version(ap.APP_ID) == 3
    rows = sorted(dt.to_pyarrow_table().to_pylist(), key=lambda r: r["event_id"])
    got = [(r["event"], r["exchange"], r["reason"], json.loads(r["detail"])) for r in rows]
    assert got == [
        ("approved", "early", None, {"by": "ops", "revision": 1}),
        ("approved", "orders", "ticket 7", {"by": "ops", "revision": 2}),
        ("revoked", "orders", None, {"by": "ops", "revision": 3}),
    ]
    assert {r["app_id"] for r in rows} == {ap.APP_ID}
    # idempotent: nothing new to write, nothing written
    assert sync_audit(tmp_path / "tables", Approvals.load(tmp_path / "state")) == 0
    dt.update_incremental()
    assert dt.to_pyarrow_table().num_rows == 3


def _audited(dt: DeltaTable) -> list[tuple[str, str, int]]:
    """(event, exchange, revision) of every approval audit row, in revision order."""
    dt.update_incremental()
    rows = [r for r in dt.to_pyarrow_table().to_pylist() if r["app_id"] == ap.APP_ID]
    got = [(r["event"], r["exchange"], json.loads(r["detail"])["revision"]) for r in rows]
    return sorted(got, key=lambda g: g[2])


def test_a_lost_approvals_file_continues_above_the_audit(tmp_path: Path) -> None:
    """Runbook: approvals.json lost -> "approve again". The new changes must not restart at
    revision 1, at or below the audit's diode-approve version: they would never be audited."""
    cfg = _cfg(tmp_path)
    dt = _audit(tmp_path)
    for name in ("a", "b", "c"):
        approve_exchanges(cfg, [name], by="ops")
    (tmp_path / "state" / ap.APPROVALS_FILE).unlink()
    out = approve_exchanges(cfg, ["orders"], by="ops")
    assert out["changed"] == [{"exchange": "orders", "revision": 4}], out
    assert out["audit_rows_written"] == 1
    (warning,) = _warned(out)  # the operator learns changes 1..3 are not in the file
    assert "revision 0" in warning and "revision 3" in warning and "1..3" in warning, warning
    out = approve_exchanges(cfg, ["orders"], revoke=True, by="ops")
    assert out["changed"] == [{"exchange": "orders", "revision": 5}] and _warned(out) == []
    assert _audited(dt)[3:] == [("approved", "orders", 4), ("revoked", "orders", 5)]
    dt.update_incremental()
    assert dt.transaction_version(ap.APP_ID) == 5
    assert [c.revision for c in Approvals.load(tmp_path / "state").history] == [4, 5]


def test_an_older_backup_is_warned_about_and_new_changes_are_audited(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    dt = _audit(tmp_path)
    approve_exchanges(cfg, ["a", "b"], by="ops")
    path = tmp_path / "state" / ap.APPROVALS_FILE
    backup = path.read_bytes()  # revision 2
    approve_exchanges(cfg, ["c"], by="ops")  # revision 3, audited
    path.write_bytes(backup)  # restored from the older backup
    out = approve_exchanges(cfg, ["a"], by="ops")  # approved already: no new revision
    assert out["unchanged"] == ["a"] and out["audit_rows_written"] == 0
    (warning,) = _warned(out)
    assert str(path) in warning and "revision 2" in warning and "revision 3" in warning, warning
    assert "3..3" in warning and ap.APP_ID in warning
    out = approve_exchanges(cfg, ["d"], by="ops")  # still behind: warned again, numbered above
    assert out["changed"] == [{"exchange": "d", "revision": 4}] and _warned(out) == [warning]
    assert out["audit_rows_written"] == 1
    assert _audited(dt)[-1] == ("approved", "d", 4)
    assert _warned(approve_exchanges(cfg, ["e"], by="ops")) == []  # caught up: no warning


def test_a_lost_approvals_file_numbers_above_the_audit_and_keeps_counting(
    tmp_path: Path,
) -> None:
    state, tables = tmp_path / "state", tmp_path / "tables"
    cfg = _cfg(tmp_path)
    assert approve_exchanges(cfg, ["x"], by="ops")["changed"] == [{"exchange": "x", "revision": 1}]
    assert ap.audited_revision(tables) is None  # no audit table yet: the file's numbering stands
    dt = _audit(tmp_path)
    approve_exchanges(cfg, ["z"], by="ops")  # revision 2, audited with x
    assert ap.audited_revision(tables) == 2 and _audited(dt)[-1] == ("approved", "z", 2)
    (state / ap.APPROVALS_FILE).unlink()  # lost: numbering continues above the audit
    assert approve_exchanges(cfg, ["w"], by="ops")["changed"] == [{"exchange": "w", "revision": 3}]
    assert Approvals.load(state).change("approve", "v", "ops") == (4, True)


def test_the_audit_rows_are_written_holding_the_approvals_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `diode approve` runs that write the audit outside the lock can both read the old
    txn version and append the same rows (delta-rs accepts both commits)."""
    from bridge.fsutil import lock_held
    from bridge.red.tables import RedTables

    cfg = _cfg(tmp_path)
    _audit(tmp_path)
    real_append = RedTables.append
    held: list[bool] = []

    def append_seeing_the_lock(self: RedTables, name: str, data: object, **kw: object) -> bool:
        held.append(lock_held(tmp_path / "state" / ap.LOCK_FILE))
        return real_append(self, name, data, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(RedTables, "append", append_seeing_the_lock)
    out = approve_exchanges(cfg, ["orders", "prices"], by="ops")
    assert out["audit_rows_written"] == 2 and held == [True]


def test_concurrent_approve_runs_audit_each_revision_once(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    dt = _audit(tmp_path)
    names = [f"x{i}" for i in range(12)]
    assert in_threads(lambda n: approve_exchanges(cfg, [n], by="t"), names, 3) == []
    got = _audited(dt)
    assert [g[2] for g in got] == list(range(1, 13)), got
    assert sorted(g[1] for g in got) == sorted(names)


def test_approving_a_name_no_row_has_landed_under_is_warned_about(tmp_path: Path) -> None:
    """A typo (`ordres`) was approved silently: the replay then waits for rows that never
    come. The report names it and the exchanges that did land."""
    import pyarrow as pa

    from bridge.protocol.exchange import ExchangeDecl
    from bridge.protocol.rows import build_rows
    from bridge.red.tables import RedTables

    cfg = _cfg(tmp_path)
    out = approve_exchanges(cfg, ["early"], by="ops")
    assert any("nothing has landed yet" in w for w in out["warnings"]), out
    tables = RedTables(tmp_path / "tables", "delta-rs")
    tables.ensure()
    decl = ExchangeDecl("orders", "topic", True)
    batch = build_rows("c1", [0, 1], ["orders"] * 2, ["rk"] * 2, [False] * 2,
                       [b"\x00\x00"] * 2, [b"a", b"b"], {"orders": decl})  # fmt: skip
    t = pa.Table.from_batches([batch])
    now = datetime.now(UTC)
    for name, value in (("bundle_seq", 1), ("bundle_id", "b1"), ("land_seq", 1)):
        t = t.append_column(name, pa.array([value] * 2))
    t = t.append_column("landed_at", pa.array([now] * 2, pa.timestamp("us", tz="UTC")))
    t = t.append_column("landed_date", pa.array([now.date()] * 2, pa.date32()))
    assert tables.append("messages", t, app_id="diode-red", version=1)
    assert ap.landed_exchanges(tmp_path / "tables") == {"orders"}
    out = approve_exchanges(cfg, ["orders", "ordres"], by="ops")
    (warning,) = out["warnings"]
    assert "'ordres' has no landed row (landed: 'orders')" in warning, warning
    assert "diode approve --revoke ordres" in warning
    assert approve_exchanges(cfg, ["orders"], revoke=True, by="ops")["warnings"] == []
