"""Black, drain: the Spark Python streaming data source "diode_spool": black's spool by position.

The tap (bridge.black.tap) drains each channel's mirror queue into the channel's spool; this
source plans what each micro-batch covers. Offsets are ``{channel: next spool position}`` and
live in Spark's checkpoint; positions are gapless and a record's position is its message
``seq``, so a replayed micro-batch covers exactly the same messages.

A micro-batch holds one row per channel, ``(channel, start, end)``: the spool positions
``[start, end)`` it covers. The sink reads those records from the spool itself
(memory-mapped, zero-copy) and seals them: message bodies never take the detour through the
JVM and back, which cost more than gpg itself for large messages. The spool is on black's
own disk, where the driver runs (DESIGN §8: one black host per link).

The per-batch read limit is the smaller of ``max_messages_per_batch`` and ``max_batch_bytes``
divided by the average row size black measured on earlier batches (``read-hint.json`` in the
state dir, each channel's from its last sealed batch, whichever run that was), so memory stays
flat under any backlog.

Options: ``config`` (path of the diode TOML, read on the driver), ``channels``
(comma-separated, default: all configured), ``hold`` (``false``: a processing-time query cuts
whatever is pending at each trigger instead of collecting until a bundle is worth cutting;
scheduled runs drain that way).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from bridge.black.chunking import ROW_OVERHEAD_BYTES
from bridge.black.spool import SpoolReader
from bridge.black.state import StateStore
from bridge.config import Config, load_config
from bridge.errors import ConfigError
from bridge.fsutil import atomic_write_bytes
from bridge.logs import ensure_logging, get_logger, log_event
from bridge.spark import FOREIGN_CHECKPOINT

__all__ = [
    "SpoolDataSource",
    "SpoolStreamReader",
    "READ_HINT_FILE",
    "RANGE_SCHEMA",
    "SpoolRange",
    "read_hint",
    "save_read_hint",
]

log = get_logger("bridge.black.source")

READ_HINT_FILE = "read-hint.json"
FIRST_BATCH_PROBE = 2000
"""Read limit when no message size is known at all (the size probe found nothing)."""
SIZE_PROBE_ROWS = 64


RANGE_SCHEMA = pa.schema(
    [
        pa.field("channel", pa.string(), nullable=False),
        pa.field("start", pa.int64(), nullable=False),
        pa.field("end", pa.int64(), nullable=False),
    ]
)
"""One row per channel and micro-batch: spool positions ``[start, end)``."""


@dataclass(frozen=True)
class SpoolRange(InputPartition):
    """One Spark task: positions ``[start, end)`` of one channel's spool."""

    channel: str
    start: int
    end: int


def read_hint(state_dir: Path) -> dict[str, float]:
    """Black, drain: channel -> average row bytes measured on its last sealed batch; {} when
    ``read-hint.json`` is missing or unreadable (the source then sizes a few real messages)."""
    p = Path(state_dir) / READ_HINT_FILE
    try:
        d = json.loads(p.read_text())
        return {str(k): float(v) for k, v in d.get("avg_row_bytes", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def save_read_hint(
    state_dir: Path, measured: Mapping[str, float], channels: Collection[str]
) -> None:
    """Black, seal: write ``read-hint.json`` (temp, fsync, rename): ``measured`` (channel ->
    average row bytes of its last sealed batch) over the hints of the other ``channels`` kept
    from earlier runs, so a channel this run did not read keeps its own for its next first
    batch (without it, that batch is sized from a few messages and can be many times
    ``black.max_batch_bytes``); a hint of a channel no longer configured goes."""
    hint = {ch: v for ch, v in read_hint(state_dir).items() if ch in channels}
    hint.update(measured)
    atomic_write_bytes(
        Path(state_dir) / READ_HINT_FILE, json.dumps({"avg_row_bytes": hint}).encode()
    )


class SpoolStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans position ranges per channel; the sink reads them from the spool."""

    hold = True
    """Processing-time queries collect until a bundle is worth cutting (option ``hold``)."""

    def __init__(self, options: dict[str, str]) -> None:
        ensure_logging()  # Spark's source runner process
        self.config_path = options.get("config", "")
        self.cfg: Config = load_config(self.config_path or None)
        names = [c.strip() for c in options.get("channels", "").split(",") if c.strip()]
        self.channels = names or [c.name for c in self.cfg.channels]
        for n in self.channels:
            self.cfg.channel(n)  # ConfigError for unknown names
        self.target: dict[str, int] | None = None
        self.hold = options.get("hold", "true").strip().lower() != "false"
        self._planned = False  # partitions() not called yet in this run
        self._lagging: set[str] = set()
        self._empty_at: dict[str, float] = {}
        """channel -> when a plan last found nothing pending: every message pending now arrived
        after that, so ``now - _empty_at`` bounds the age of the oldest one."""
        self._shipped: dict[str, int] = {}
        """channel -> the journal's next seq when this run first planned it (``_floor``)."""

    # -- driver -------------------------------------------------------------------------------
    def _spool(self, channel: str) -> SpoolReader:
        return SpoolReader(Path(self.cfg.black.spool_dir), channel)

    def _tail(self, channel: str) -> int:
        return self._spool(channel).durable_end()

    def _floor(self, channel: str) -> int:
        """The first position not yet shipped when this run first planned ``channel`` (the
        journal's ``last_seq + 1``): a batch is sized from there, so a checkpoint far behind
        the journal (restored from a backup) is one batch, not many the sink finds empty."""
        if channel not in self._shipped:
            store = StateStore(self.cfg.black.state_dir)
            self._shipped[channel] = store.load(channel).last_seq + 1
        return self._shipped[channel]

    def initialOffset(self) -> dict[str, int]:
        store = StateStore(self.cfg.black.state_dir)
        return {ch: store.load(ch).last_seq + 1 for ch in self.channels}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.cfg.black.max_messages_per_batch * len(self.channels))

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {ch: self._tail(ch) for ch in self.channels}

    def _cap(self, channel: str, hint: dict[str, float], start: int, tail: int) -> int:
        b = self.cfg.black
        avg = hint.get(channel)
        if avg is None:
            # the probe starts after the journal: a checkpoint behind it (a replay) starts at
            # positions the tap may have released already (the sink skips them too)
            start = max(start, StateStore(self.cfg.black.state_dir).load(channel).last_seq + 1)
        if avg is None and tail > start:  # no batch seen yet: size a few real messages
            end = min(tail, start + SIZE_PROBE_ROWS)
            sizes = [
                int(pa.compute.sum(pa.compute.binary_length(x.column("body"))).as_py() or 0)
                + ROW_OVERHEAD_BYTES * x.num_rows
                for x in self._spool(channel).read(start, end)
            ]
            avg = 1.5 * sum(sizes) / max(end - start, 1)
            hint[channel] = avg
        if avg is None:
            return min(b.max_messages_per_batch, FIRST_BATCH_PROBE)
        return max(1, min(b.max_messages_per_batch, int(b.max_batch_bytes // max(avg, 1.0))))

    def _checked(self, offset: object) -> dict[str, int]:
        """An offset of this source from Spark's checkpoint (channel -> next spool position);
        a ConfigError when another query wrote the checkpoint (a rate source's ``0``): Spark
        hands it over as it found it."""
        if isinstance(offset, dict) and all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in offset.items()
        ):
            return offset
        shown = json.dumps(offset, default=str)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise ConfigError(
            f"black.checkpoint_dir {self.cfg.black.checkpoint_dir} {FOREIGN_CHECKPOINT} "
            f"(offset {shown}, not {{channel: position}}): point black.checkpoint_dir at an "
            "empty directory, the black job's alone (a new checkpoint starts from the journal)"
        )

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        start = self._checked(start)
        hint = read_hint(self.cfg.black.state_dir)
        init = None
        out: dict[str, int] = {}
        for ch in self.channels:
            if ch in start:
                s = int(start[ch])
            else:  # a channel added to the config after the query started
                init = init or self.initialOffset()
                s = init[ch]
            planned_at = time.monotonic()  # before the tail is read: nothing after it is counted
            tail = self.target[ch] if self.target is not None else self._tail(ch)
            if tail < s:
                # TAIL is written after each fsync but not itself fsynced: after a power loss
                # it can lag until the tap reopens the spool and rewrites it. The tap, not the
                # source, refuses a spool that really ends before the shipped seq.
                if ch not in self._lagging:
                    log_event(
                        log, 30, "spool tail behind the shipped seq: waiting for the tap",
                        channel=ch, spool_end=tail, next_seq=s,
                    )  # fmt: skip
                    self._lagging.add(ch)
                out[ch] = s
                continue
            self._lagging.discard(ch)
            base = max(s, self._floor(ch))  # below it: shipped, the sink skips it unread
            end = tail
            capped = False
            if not isinstance(limit, ReadAllAvailable) and end > base:
                cap = self._cap(ch, hint, base, end)
                capped = end > base + cap
                end = min(end, base + cap)
            if (
                self.target is None
                and self.hold
                and end > base
                and not capped
                and self._hold(ch, base, end, hint)
            ):
                end = s
            elif end == tail:
                self._empty_at[ch] = planned_at  # what arrives next is younger than that
            else:
                self._empty_at.pop(ch, None)  # the rest is older than that: unknown age
            out[ch] = end
        return out

    def _hold(self, channel: str, start: int, end: int, hint: dict[str, float]) -> bool:
        """Continuous runs: keep collecting until a bundle is worth cutting — max_rows or
        max_bytes reached, or its first message would pass ``bundle.max_age_seconds`` before
        the next trigger. Its age is bounded by the last plan that found the channel empty;
        unknown (a backlog at start) counts as old."""
        b = self.cfg.black
        n = end - start
        est = n * hint.get(channel, float(ROW_OVERHEAD_BYTES))
        if n >= b.bundle.max_rows or est >= b.bundle.max_bytes:
            return False
        empty_at = self._empty_at.get(channel)
        if empty_at is None:
            return False
        age = time.monotonic() - empty_at
        return age + b.trigger_seconds <= b.bundle.max_age_seconds

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        start, end = self._checked(start), self._checked(end)
        start = self._from_journal(start) if not self._planned else start
        self._planned = True
        init: dict[str, int] | None = None
        parts: list[InputPartition] = []
        for ch in self.channels:
            if ch in start:
                s = int(start[ch])
            else:
                init = init or self.initialOffset()
                s = init[ch]
            e = int(end.get(ch, s))
            if e > s:
                parts.append(SpoolRange(ch, s, e))
        return parts

    def _from_journal(self, start: dict[str, int]) -> dict[str, int]:
        """First batch of a run: start where the journal says shipping stopped.

        The checkpoint can be ahead of the journal (the sink seals in the background, so a
        crash can hit after Spark committed a batch that was not yet shipped). Re-reading
        those offsets is harmless: the sealer drops what the journal already covers.
        """
        store = StateStore(self.cfg.black.state_dir)
        out = dict(start)
        for ch in self.channels:
            shipped = store.load(ch).last_seq + 1
            if ch in out and shipped < int(out[ch]):
                log_event(
                    log,
                    30,
                    "re-reading positions committed by Spark but not shipped",
                    channel=ch,
                    first_seq=shipped,
                    last_seq=int(out[ch]) - 1,
                )
                out[ch] = shipped
        return out

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the tap releases spool segments once black's journal covers them."""

    def stop(self) -> None:
        """No driver-side connection is held between calls."""

    # -- executors ----------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SpoolRange)
        yield pa.RecordBatch.from_pydict(
            {"channel": [partition.channel], "start": [partition.start], "end": [partition.end]},
            schema=RANGE_SCHEMA,
        )


class SpoolDataSource(DataSource):
    """``spark.readStream.format("diode_spool").option("config", path).load()``."""

    @classmethod
    def name(cls) -> str:
        return "diode_spool"

    def schema(self) -> StructType:
        from pyspark.sql.pandas.types import from_arrow_schema

        return from_arrow_schema(RANGE_SCHEMA, prefer_timestamp_ntz=False)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return SpoolStreamReader(dict(self.options))
