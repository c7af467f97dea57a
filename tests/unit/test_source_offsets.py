"""Unit: the Spark source's position planning over the spool (pure logic; the spool tail is
given)."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql.streaming.datasource import ReadMaxRows

from bridge.black.source import SpoolStreamReader
from bridge.black.state import ChannelState, StateStore
from bridge.config import config_from_dict


def _reader(tmp_path: Path, tails: dict[str, int]) -> SpoolStreamReader:
    cfg = config_from_dict(
        {"channels": [{"name": "a", "encrypt": False}, {"name": "b", "encrypt": False}],
         "black": {"max_messages_per_batch": 100}},
        base=tmp_path, environ={},
    )  # fmt: skip
    r = object.__new__(SpoolStreamReader)
    r.cfg, r.channels, r.target, r._planned, r._lagging = cfg, ["a", "b"], None, False, set()
    r._waiting = {}
    r._tail = tails.__getitem__  # type: ignore[method-assign]
    (tmp_path / "black" / "state").mkdir(parents=True)
    (tmp_path / "black" / "state" / "read-hint.json").write_text(
        '{"avg_row_bytes": {"a": 10, "b": 10}}'
    )
    return r


def test_read_limit_per_channel(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 1000, "b": 30})
    r.target = {"a": 1000, "b": 30}  # availableNow: nothing is held back for rotation by age
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 100, "b": 30}


def test_spool_tail_behind_the_journal_means_wait(tmp_path: Path) -> None:
    """A lagging TAIL (not fsynced) after a power loss: no new data, not a dead query."""
    r = _reader(tmp_path, {"a": 3, "b": 0})
    assert r.latestOffset({"a": 10, "b": 0}, ReadMaxRows(200)) == {"a": 10, "b": 0}
    assert r._lagging == {"a"}


def test_first_batch_starts_at_the_journal(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 500, "b": 0})
    StateStore(r.cfg.black.state_dir).save(ChannelState(channel="a", last_seq=149))
    parts = r.partitions({"a": 300, "b": 0}, {"a": 400, "b": 0})
    assert [(p.start, p.end) for p in parts] == [(150, 400)]  # type: ignore[attr-defined]
    parts = r.partitions({"a": 400, "b": 0}, {"a": 500, "b": 0})  # later batches: as planned
    assert [(p.start, p.end) for p in parts] == [(400, 500)]  # type: ignore[attr-defined]


def test_initial_offset_follows_the_journal(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 0, "b": 0})
    StateStore(r.cfg.black.state_dir).save(ChannelState(channel="b", last_seq=41))
    assert r.initialOffset() == {"a": 0, "b": 42}


def test_continuous_runs_hold_a_small_batch_until_it_is_old_enough(tmp_path: Path) -> None:
    """Rotation by time: a trickle is collected until the first message has waited
    ``bundle.max_age_seconds``; a full bundle's worth goes at once."""
    r = _reader(tmp_path, {"a": 5, "b": 0})
    r._waiting = {}
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 0, "b": 0}  # held
    r._waiting["a"] -= r.cfg.black.bundle.max_age_seconds  # as if it had waited that long
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 5, "b": 0}
    assert "a" not in r._waiting
    full = _reader(tmp_path / "x", {"a": 1000, "b": 0})  # the read cap (100) is reached: no hold
    full._waiting = {}
    assert full.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 100, "b": 0}


def test_available_now_never_holds(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 5, "b": 0})
    r._waiting, r.target = {}, {"a": 5, "b": 0}
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 5, "b": 0}
