"""Integration: Spark's checkpoint behind black's journal — a replayed micro-batch names spool
positions the tap has released already (real spool, real sealer, real gpg; no Spark).

The window: black sealed a batch, then the job died before Spark wrote its commit (kill -9
after the sealer finished, or a power loss rolling back Spark's un-fsynced checkpoint). At the
restart the tap deletes the closed segments the journal covers, and Spark replays from its
checkpoint. Proves: the sink reads a replayed range only after the journal's ``last_seq``
(a range wholly below it is skipped, one that straddles it is clipped) and ships the new
positions once; the source's size probe (no read hint yet) starts after the journal too, and
the range it plans is sealed. Every bundle in the outbox is opened with the red key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import ReadMaxRows

from bridge.black.catalog import default_catalog_path, save_catalog
from bridge.black.chunking import ROW_OVERHEAD_BYTES
from bridge.black.seal import BundleSealer
from bridge.black.sink import BatchSink
from bridge.black.source import RANGE_SCHEMA, READ_HINT_FILE, SpoolStreamReader
from bridge.black.spool import SpoolReader, SpoolWriter
from bridge.black.spool_rows import read_rows, source_schema
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory
from bridge.diode.file_drop import Outbox
from bridge.errors import SpoolGapError
from bridge.protocol.bundle import sha256_hex, unpack_bundle
from bridge.protocol.exchange import ExchangeDecl
from tests.support import key_inventory

pytestmark = pytest.mark.gpg

CHANNEL = "c"
CATALOG = {"x": ExchangeDecl("x", "topic", durable=True)}


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    with key_inventory("replay-test") as inv:
        yield inv


def make_cfg(keys: KeyInventory, base: Path, **black: Any) -> Config:
    cfg = config_from_dict(
        {
            "link": {"bridge_id": "replay-test", "black_signers": [keys.black_fpr]},
            "channels": [{"name": CHANNEL, "recipients": list(keys.red_fprs.values())}],
            "black": {
                "gnupg_home": str(keys.black_home),
                "signing_key": keys.black_fpr,
                "outbox": "outbox",
                "archive": "archive",
                "state_dir": "state",
                "checkpoint_dir": "checkpoint",
                "spool_dir": "spool",
                "bundle": {"max_rows": 50},
                **black,
            },
            "red": {"gnupg_home": str(keys.red_home), "inbox": "inbox"},
        },
        base=base,
        environ={},
    )
    save_catalog(default_catalog_path(cfg.black), CATALOG)  # as the mirror keeps it
    return cfg


def sealer(cfg: Config, keys: KeyInventory) -> BundleSealer:
    return BundleSealer(
        cfg,
        store=StateStore(Path(cfg.black.state_dir)),
        gpg=Gpg(keys.black_home),
        outbox=Outbox.from_config(cfg),
    )


def journal_last_seq(cfg: Config) -> int:
    return StateStore(Path(cfg.black.state_dir)).load(CHANNEL).last_seq


def tap_spools(cfg: Config, n: int, body: bytes = b"m") -> range:
    """The tap appends ``n`` deliveries and acks them (``acked_through``: the last one)."""
    with SpoolWriter.open(Path(cfg.black.spool_dir), CHANNEL, min_free_bytes=0) as w:
        start = w.next_pos
        for _ in range(n):
            w.append_one("x", "k", False, b"\x00\x00", body)
        w.sync(start + n - 1)
    return range(start, start + n)


def tap_restarts(cfg: Config) -> int:
    """A tap starting: it closes the last segment and releases what the journal covers."""
    with SpoolWriter.open(Path(cfg.black.spool_dir), CHANNEL, min_free_bytes=0) as w:
        return w.release_through(journal_last_seq(cfg))


def assert_released(cfg: Config, start: int, end: int) -> None:
    """The case: positions [start, end) are no longer in the spool."""
    with pytest.raises(SpoolGapError, match="no longer"):
        list(SpoolReader(Path(cfg.black.spool_dir), CHANNEL).read(start, end))


class Batch:
    """What ``foreachBatch`` hands the sink: only ``toArrow`` is used."""

    def __init__(self, start: int, end: int) -> None:
        self.table = pa.table(
            {"channel": [CHANNEL], "start": [start], "end": [end]}, schema=RANGE_SCHEMA
        )

    def toArrow(self) -> pa.Table:  # noqa: N802 - Spark's name
        return self.table


def outbox_seqs(cfg: Config, keys: KeyInventory) -> list[tuple[int, list[int]]]:
    """(bundle seq, message seqs) of every bundle in the outbox, opened with the red key, in
    order; each links to the previous plaintext, and none declares a gap."""
    red = Gpg(keys.red_home)
    out = []
    prev: str | None = None
    for p in sorted(Path(cfg.black.outbox).glob("*.dbundle")):
        plain, _ = red.open_bytes(p.read_bytes(), pinned_signers=[keys.black_fpr])
        manifest, rows = unpack_bundle(plain)
        assert manifest.prev_sha256 == prev and manifest.gaps == ()
        prev = sha256_hex(plain)
        out.append((manifest.bundle_seq, rows.column("seq").to_pylist()))
    return out


@pytest.mark.parametrize(
    "replayed",
    [
        pytest.param([(0, 10), (10, 15)], id="wholly-below-then-next"),
        pytest.param([(5, 15)], id="straddling"),
    ],
)
def test_sink_skips_replayed_positions_the_journal_covers(
    keys: KeyInventory, short_tmp: Path, replayed: list[tuple[int, int]]
) -> None:
    cfg = make_cfg(keys, short_tmp)
    tap_spools(cfg, 10)
    sink = BatchSink(cfg, sealer(cfg, keys))
    sink(Batch(0, 10), 0)
    sink.drain()
    assert journal_last_seq(cfg) == 9  # sealed; Spark died before its commit: it replays [0, 10)

    # restart: the tap releases what the journal covers, and spools new messages
    assert tap_restarts(cfg) > 0
    assert_released(cfg, 0, 10)
    tap_spools(cfg, 5)

    sink = BatchSink(cfg, sealer(cfg, keys))
    for batch_id, (a, b) in enumerate(replayed, start=1):
        sink(Batch(a, b), batch_id)
    sink.drain()  # SealingFailed if a replayed range was read from the spool as it is
    assert sink.totals.batches == len(replayed)
    assert (sink.totals.messages, sink.totals.bundles, sink.totals.lost) == (5, 1, 0)
    assert journal_last_seq(cfg) == 14
    assert outbox_seqs(cfg, keys) == [(1, list(range(10))), (2, list(range(10, 15)))]


def test_source_size_probe_starts_after_the_journal(keys: KeyInventory, short_tmp: Path) -> None:
    """No read hint yet (the job died after the first batch was sealed, before the sink wrote
    the hint and Spark its commit): the first plan sizes real messages, and those it reads must
    be after the journal; the range it plans, from the checkpoint, is then sealed by the sink."""
    cfg = make_cfg(keys, short_tmp)
    tap_spools(cfg, 10)
    table = pa.Table.from_batches(
        list(read_rows(Path(cfg.black.spool_dir), CHANNEL, 0, 10, CATALOG)),
        schema=source_schema(),
    )
    assert [b.bundle_seq for b in sealer(cfg, keys).seal_rows(cfg.channel(CHANNEL), table)] == [1]
    assert tap_restarts(cfg) > 0
    assert_released(cfg, 0, 10)
    tap_spools(cfg, 5, body=b"z" * 1000)
    assert not (Path(cfg.black.state_dir) / READ_HINT_FILE).exists()

    reader: Any = object.__new__(SpoolStreamReader)  # as Spark's runner builds it, minus Spark
    reader.cfg, reader.channels, reader.target, reader.hold = cfg, [CHANNEL], None, True
    reader._planned, reader._lagging, reader._empty_at = False, set(), {}
    reader._shipped = {}
    hint: dict[str, float] = {}
    reader._cap(CHANNEL, hint, 0, 15)  # checkpoint at 0, journal at 9, spool tail at 15
    assert hint[CHANNEL] == 1.5 * (1000 + ROW_OVERHEAD_BYTES)  # sized from positions 10..14
    end = reader.latestOffset({CHANNEL: 0}, ReadMaxRows(1000))
    assert end == {CHANNEL: 15}
    (part,) = reader.partitions({CHANNEL: 0}, end)
    assert (part.start, part.end) == (0, 15)  # the checkpoint is behind: not moved up

    sink = BatchSink(cfg, sealer(cfg, keys))
    sink(Batch(part.start, part.end), 1)
    sink.drain()
    assert journal_last_seq(cfg) == 14
    assert outbox_seqs(cfg, keys) == [(1, list(range(10))), (2, list(range(10, 15)))]


def test_a_checkpoint_far_behind_the_journal_is_one_batch_not_many_empty_ones(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """A checkpoint restored from an old backup, 40 positions behind the journal, with batches
    of at most 5 messages: the first plan reaches past the journal at once (the sink skips the
    shipped part unread) instead of 8 batches the sink finds empty."""
    cfg = make_cfg(keys, short_tmp, max_messages_per_batch=5)
    tap_spools(cfg, 40)
    table = pa.Table.from_batches(
        list(read_rows(Path(cfg.black.spool_dir), CHANNEL, 0, 40, CATALOG)),
        schema=source_schema(),
    )
    sealer(cfg, keys).seal_rows(cfg.channel(CHANNEL), table)
    assert journal_last_seq(cfg) == 39
    tap_restarts(cfg)
    tap_spools(cfg, 3)  # 40..42 new

    reader: Any = object.__new__(SpoolStreamReader)
    reader.cfg, reader.channels, reader.target, reader.hold = cfg, [CHANNEL], None, False
    reader._planned, reader._lagging, reader._empty_at = False, set(), {}
    reader._shipped = {}
    end = reader.latestOffset({CHANNEL: 0}, ReadMaxRows(5))
    assert end == {CHANNEL: 43}, end  # 40 + at most 5, capped by the tail
    (part,) = reader.partitions({CHANNEL: 0}, end)
    sink = BatchSink(cfg, sealer(cfg, keys))
    sink(Batch(part.start, part.end), 1)
    sink.drain()
    assert journal_last_seq(cfg) == 42 and sink.totals.messages == 3
    # later plans start from Spark's offset (past the floor): capped as before
    tap_spools(cfg, 12)  # 43..54
    assert reader.latestOffset({CHANNEL: 43}, ReadMaxRows(5)) == {CHANNEL: 48}
