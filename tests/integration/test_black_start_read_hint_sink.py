"""Integration: the sink's ``read-hint.json`` keeps the hint of a channel a run did not read
(real spool, real sealer, real gpg; no Spark). The hint sizes that channel's first batch of
its next run; without it the source sizes a few messages, which for a channel of mostly small
messages and a few large ones planned a batch of many times ``black.max_batch_bytes``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import ReadMaxRows

from bridge.black.catalog import default_catalog_path, save_catalog
from bridge.black.sink import BatchSink
from bridge.black.source import RANGE_SCHEMA, SpoolStreamReader, read_hint
from bridge.black.spool import SpoolWriter
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.keys import KeyInventory
from tests.integration.test_sink_replay import CATALOG, keys, sealer

__all__ = ["keys"]  # the module-scoped fixture

pytestmark = pytest.mark.gpg

BUDGET = 1 << 20
"""black.max_batch_bytes (its minimum)."""


def body_size(pos: int) -> int:
    """Channel "b": 1 KB messages, one of 400 KB every 100 (none among the first 64)."""
    return 400_000 if pos % 100 == 99 else 1000


class Batch:
    """What ``foreachBatch`` hands the sink: only ``toArrow`` is used."""

    def __init__(self, *ranges: tuple[str, int, int]) -> None:
        cols = list(zip(*ranges, strict=True))
        self.table = pa.table(
            {"channel": cols[0], "start": cols[1], "end": cols[2]}, schema=RANGE_SCHEMA
        )

    def toArrow(self) -> pa.Table:  # noqa: N802 - Spark's name
        return self.table


def make_cfg(keys: KeyInventory, base: Path) -> Config:
    cfg = config_from_dict(
        {
            "link": {"bridge_id": "hint-test", "black_signers": [keys.black_fpr]},
            "channels": [
                {"name": n, "recipients": list(keys.red_fprs.values())} for n in ("a", "b")
            ],
            "black": {
                "gnupg_home": str(keys.black_home),
                "signing_key": keys.black_fpr,
                "outbox": "outbox",
                "archive": "archive",
                "state_dir": "state",
                "checkpoint_dir": "checkpoint",
                "spool_dir": "spool",
                "max_batch_bytes": BUDGET,
                "max_messages_per_batch": 100_000,
            },
        },
        base=base,
        environ={},
    )
    save_catalog(default_catalog_path(cfg.black), CATALOG)
    return cfg


def spool(cfg: Config, channel: str, n: int) -> None:
    with SpoolWriter.open(Path(cfg.black.spool_dir), channel, min_free_bytes=0) as w:
        for pos in range(n):
            size = body_size(pos) if channel == "b" else 10
            w.append_one("x", "k", False, b"\x00\x00", b"m" * size)
        w.sync(n - 1)


def run(cfg: Config, keys: KeyInventory, *ranges: tuple[str, int, int]) -> None:
    """One black run's sink (a fresh one, as each run builds) sealing one micro-batch."""
    sink = BatchSink(cfg, sealer(cfg, keys))
    sink(Batch(*ranges), 1)
    sink.drain()


def test_a_channel_not_read_in_a_run_keeps_its_hint(keys: KeyInventory, short_tmp: Path) -> None:
    cfg = make_cfg(keys, short_tmp)
    spool(cfg, "a", 10)
    spool(cfg, "b", 1000)
    state = Path(cfg.black.state_dir)
    run(cfg, keys, ("a", 0, 5), ("b", 0, 200))
    first = read_hint(state)
    assert set(first) == {"a", "b"}
    run(cfg, keys, ("a", 5, 10))  # b is quiet in this run
    assert read_hint(state)["b"] == first["b"], "b's hint was dropped"

    # b's next run: its first batch is sized from the hint, within black.max_batch_bytes
    reader: Any = object.__new__(SpoolStreamReader)  # as Spark's runner builds it, minus Spark
    reader.cfg, reader.channels, reader.target, reader.hold = cfg, ["a", "b"], None, True
    reader._planned, reader._lagging, reader._empty_at, reader._shipped = False, set(), {}, {}
    reader.target = {"a": 10, "b": 1000}
    end = reader.latestOffset({"a": 10, "b": 200}, ReadMaxRows(10**6))["b"]
    planned = sum(body_size(pos) for pos in range(200, end))
    assert planned <= BUDGET, f"b's first batch: {end - 200} rows, {planned} bytes"


def test_a_channel_no_longer_configured_loses_its_hint(keys: KeyInventory, short_tmp: Path) -> None:
    cfg = make_cfg(keys, short_tmp)
    spool(cfg, "a", 5)
    state = Path(cfg.black.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    (state / "read-hint.json").write_text('{"avg_row_bytes": {"gone": 5.0, "b": 7.0}}')
    run(cfg, keys, ("a", 0, 5))
    assert set(read_hint(state)) == {"a", "b"}


def test_a_read_hint_that_cannot_be_written_does_not_fail_a_sealed_batch(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """The hint is written after the batch's bundles are shipped and journaled: its failure
    (a full state disk, EIO, something in its place) failed the batch, so the query stopped
    and the run exited non-zero over a sizing hint. It is logged; the batch stands."""
    cfg = make_cfg(keys, short_tmp)
    spool(cfg, "a", 5)
    state = Path(cfg.black.state_dir)
    (state / "read-hint.json").mkdir(parents=True)  # the fault: the hint cannot be replaced
    run(cfg, keys, ("a", 0, 5))
    assert (state / "read-hint.json").is_dir()  # the case: it was not written
    assert StateStore(state).load("a").last_seq == 4
