"""Unit: the Spark source's offset planning (pure logic; the broker probe is replaced)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql.streaming.datasource import ReadMaxRows

from bridge.black.source import RabbitStreamReader
from bridge.black.state import ChannelState, StateStore
from bridge.config import config_from_dict
from bridge.errors import BrokerError, StateError


def _reader(tmp_path: Path, tails: dict[str, int | Exception]) -> RabbitStreamReader:
    cfg = config_from_dict(
        {"channels": [{"name": "a", "encrypt": False}, {"name": "b", "encrypt": False}],
         "black": {"max_messages_per_batch": 100}},
        base=tmp_path, environ={},
    )  # fmt: skip
    r = object.__new__(RabbitStreamReader)
    r.cfg, r.channels, r.target, r._tails, r._planned = cfg, ["a", "b"], None, {}, False

    def tail(ch: str) -> int:
        t = tails[ch]
        if isinstance(t, Exception):
            raise t
        return t

    r._tail = tail  # type: ignore[method-assign]
    (tmp_path / "black" / "state").mkdir(parents=True)
    (tmp_path / "black" / "state" / "read-hint.json").write_text(
        '{"avg_row_bytes": {"a": 10, "b": 10}}'
    )
    return r


def test_broker_blip_means_no_new_data_not_a_dead_query(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": BrokerError("down"), "b": 50})
    assert r.latestOffset({"a": 7, "b": 0}, ReadMaxRows(200)) == {"a": 7, "b": 50}


def test_read_limit_per_channel(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 1000, "b": 30})
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 100, "b": 30}


def test_recreated_stream_is_refused_with_the_fix(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 3, "b": 0})
    with pytest.raises(StateError, match="re-created.*last_offset to -1"):
        r.latestOffset({"a": 10, "b": 0}, ReadMaxRows(200))


def test_first_batch_starts_at_the_journal(tmp_path: Path) -> None:
    r = _reader(tmp_path, {"a": 500, "b": 0})
    StateStore(r.cfg.black.state_dir).save(ChannelState(channel="a", last_offset=149, last_seq=149))
    parts = r.partitions({"a": 300, "b": 0}, {"a": 400, "b": 0})
    assert [(p.start, p.end) for p in parts] == [(150, 400)]  # type: ignore[attr-defined]
    parts = r.partitions({"a": 400, "b": 0}, {"a": 500, "b": 0})  # later batches: as planned
    assert [(p.start, p.end) for p in parts] == [(400, 500)]  # type: ignore[attr-defined]


def test_backlog_skips_the_tail_probe(tmp_path: Path) -> None:
    probes: list[str] = []
    r = _reader(tmp_path, {"a": 1000, "b": 30})
    real = r._tail

    def counting(ch: str) -> int:
        probes.append(ch)
        r._tails[ch] = real(ch)
        return r._tails[ch]

    r._tail = counting  # type: ignore[method-assign]
    assert r.latestOffset({"a": 0, "b": 0}, ReadMaxRows(200)) == {"a": 100, "b": 30}
    assert probes == ["a", "b"]
    assert r.latestOffset({"a": 100, "b": 30}, ReadMaxRows(200)) == {"a": 200, "b": 30}
    assert probes == ["a", "b", "b"], "a's known tail (1000) is ahead of 100+100: no probe"
