"""Unit: the Spark source's position planning over the spool (pure logic; the spool tail is
given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql.streaming.datasource import ReadMaxRows

from bridge.black.source import SpoolStreamReader
from bridge.black.state import ChannelState, StateStore
from bridge.config import config_from_dict


def _reader(tmp_path: Path, tails: dict[str, int], **black: Any) -> SpoolStreamReader:
    cfg = config_from_dict(
        {"channels": [{"name": "a", "encrypt": False}, {"name": "b", "encrypt": False}],
         "black": {"max_messages_per_batch": 100, **black}},
        base=tmp_path, environ={},
    )  # fmt: skip
    r = object.__new__(SpoolStreamReader)
    r.cfg, r.channels, r.target, r._planned, r._lagging = cfg, ["a", "b"], None, False, set()
    r._empty_at, r._shipped = {}, {}
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


def test_continuous_runs_hold_a_small_batch_only_while_it_stays_young_enough(
    tmp_path: Path,
) -> None:
    """Rotation by time: a trickle is collected while its first message would still be within
    ``bundle.max_age_seconds`` at the next trigger; the age is bounded by the last plan that
    found the channel empty. A full bundle's worth, or a backlog of unknown age, goes at once."""
    r = _reader(tmp_path, {"a": 0, "b": 0}, trigger_seconds=2.0, bundle={"max_age_seconds": 5.0})
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 0, "b": 0}  # empty
    r._tail = {"a": 5, "b": 0}.__getitem__  # type: ignore[method-assign]
    # 1 s since the empty plan: at most 1 s old, 3 s at the next trigger: held
    r._empty_at["a"] -= 1.0
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 0, "b": 0}
    # 3.5 s: 5.5 s at the next trigger would pass max_age: cut now
    r._empty_at["a"] -= 2.5
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 5, "b": 0}
    # everything up to the tail was cut: what comes next is younger than this plan
    assert r._empty_at["a"] > r._empty_at["b"] - 1.0
    # max_age == trigger: every trigger cuts what is there
    eager = _reader(
        tmp_path / "e", {"a": 0, "b": 0}, trigger_seconds=2.0, bundle={"max_age_seconds": 2.0}
    )
    eager.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200))
    eager._tail = {"a": 3, "b": 0}.__getitem__  # type: ignore[method-assign]
    assert eager.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 3, "b": 0}
    # a backlog found at start (age unknown) is not held
    backlog = _reader(tmp_path / "x", {"a": 5, "b": 0})
    assert backlog.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 5, "b": 0}
    full = _reader(tmp_path / "y", {"a": 1000, "b": 0})  # the read cap (100) is reached: no hold
    full.latestOffset({"a": 1000, "b": 0}, ReadMaxRows(200))  # seen empty
    assert full.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 100, "b": 0}
    assert "a" not in full._empty_at  # the rest is older than any plan: unknown age


def test_available_now_never_holds(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 5, "b": 0})
    r.target = {"a": 5, "b": 0}
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 5, "b": 0}
