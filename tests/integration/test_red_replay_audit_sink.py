"""Integration: the replay's audit sink never loses events to another writer's commit."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bridge.red.replay import APP_ID, audit_sink
from bridge.red.schema import audit_rows
from bridge.red.tables import RedTables
from tests.unit.test_file_drop_places import config


def test_an_audit_commit_whose_version_another_writer_took_is_written_at_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink read the table's last version of diode-replay, and appended with the next; if
    another writer committed that version in between (a rewind, a second publisher), append
    found it taken and wrote nothing, and the sink returned as if written: the events were
    lost. It tries the next version."""
    cfg = config(tmp_path)
    tables = RedTables(Path(cfg.red.tables_dir), "delta-rs")
    tables.ensure()
    other = RedTables(Path(cfg.red.tables_dir), "delta-rs")  # the other writer
    real = RedTables.append
    raced: list[int] = []

    def raced_once(self: RedTables, name: str, data: Any, *, app_id: str, version: int) -> bool:
        if name == "audit" and not raced:  # commits the version the sink read, first
            theirs = audit_rows([{"event": "replay_rewound"}], APP_ID, version, datetime.now(UTC))
            assert real(other, "audit", theirs, app_id=APP_ID, version=version)
            raced.append(version)
        return real(self, name, data, app_id=app_id, version=version)

    monkeypatch.setattr(RedTables, "append", raced_once)
    audit_sink(cfg)([{"event": "replayed", "exchange": "x", "channel": "c", "seq_first": 1}])
    assert raced == [1]  # the case: the other writer took version 1 first
    rows = tables.read("audit", columns=["event", "version"]).to_pylist()
    assert sorted((r["version"], r["event"]) for r in rows) == [
        (1, "replay_rewound"), (2, "replayed"),
    ]  # fmt: skip
