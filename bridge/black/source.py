"""Black, drain: the Spark Python streaming data source "rabbitmq", reading stream queues by offset.

Offsets are ``{channel: next stream offset}`` and live in Spark's checkpoint; a replayed
micro-batch reads exactly the same offset range. Each channel's range is split into
``read_partitions`` ranges read in parallel by independent stream consumers. Message ``seq``
comes later, from black's journal (see bridge.black.numbering); rows carry their stream
offset. The per-batch read limit is the smaller of ``max_messages_per_batch``
and ``max_batch_bytes`` divided by the average row size black measured on earlier batches
(``read-hint.json`` in the state dir), so memory stays flat under any backlog.

Options: ``config`` (path of the diode TOML; read on the driver and on executors),
``channels`` (comma-separated, default: all configured).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from bridge.black.catalog import load_catalog
from bridge.black.chunking import ROW_OVERHEAD_BYTES
from bridge.black.plan import stream_queue_name
from bridge.black.state import StateStore
from bridge.black.streams import read_batches, read_range, stream_bounds
from bridge.config import Config, load_config
from bridge.errors import BrokerError, StateError
from bridge.logs import get_logger, log_event, setup_logging
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.schema import row_schema

__all__ = ["RabbitStreamDataSource", "RabbitStreamReader", "READ_HINT_FILE", "spark_row_schema"]

log = get_logger("bridge.black.source")

READ_HINT_FILE = "read-hint.json"
BATCH_ROWS = 8192
MIN_SPLIT = 5000
FIRST_BATCH_PROBE = 2000
"""Read limit when no message size is known at all (the size probe found nothing)."""


def spark_row_schema() -> StructType:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(row_schema(), prefer_timestamp_ntz=False)


@dataclass(frozen=True)
class StreamRange(InputPartition):
    """One Spark task: offsets ``[start, end)`` of one channel's stream queue."""

    channel: str
    queue: str
    start: int
    end: int
    catalog: dict[str, dict[str, Any]]


def read_hint(state_dir: Path) -> dict[str, float]:
    p = Path(state_dir) / READ_HINT_FILE
    try:
        d = json.loads(p.read_text())
        return {str(k): float(v) for k, v in d.get("avg_row_bytes", {}).items()}
    except (FileNotFoundError, ValueError, AttributeError):
        return {}


class RabbitStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Driver side plans offset ranges; executors read them with pika."""

    def __init__(self, options: dict[str, str]) -> None:
        if not logging.getLogger("bridge").handlers:  # Spark's source runner process
            setup_logging()
        self.config_path = options.get("config", "")
        self.cfg: Config = load_config(self.config_path or None)
        names = [c.strip() for c in options.get("channels", "").split(",") if c.strip()]
        self.channels = names or [c.name for c in self.cfg.channels]
        for n in self.channels:
            self.cfg.channel(n)  # ConfigError for unknown names
        self.target: dict[str, int] | None = None
        self._tails: dict[str, int] = {}
        self._planned = False  # partitions() not called yet in this run

    # -- driver -------------------------------------------------------------------------------
    def _tail(self, channel: str) -> int:
        tail = stream_bounds(self.cfg, channel)[1]
        self._tails[channel] = tail
        return tail

    def initialOffset(self) -> dict[str, int]:
        store = StateStore(self.cfg.black.state_dir)
        return {ch: store.load(ch).last_offset + 1 for ch in self.channels}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.cfg.black.max_messages_per_batch * len(self.channels))

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {ch: self._tail(ch) for ch in self.channels}

    def _cap(self, channel: str, hint: dict[str, float], start: int, tail: int) -> int:
        b = self.cfg.black
        avg = hint.get(channel)
        if avg is None and tail > start:  # no batch seen yet: size one real message
            url = b.amqp_url.get_secret_value()
            first = next(iter(read_range(url, stream_queue_name(b, channel), start, tail)), None)
            if first is not None:
                avg = float(len(first.body) + ROW_OVERHEAD_BYTES) * 1.5
                hint[channel] = avg
        if avg is None:
            return min(b.max_messages_per_batch, FIRST_BATCH_PROBE)
        return max(1, min(b.max_messages_per_batch, int(b.max_batch_bytes // max(avg, 1.0))))

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        hint = read_hint(self.cfg.black.state_dir)
        init = None
        out: dict[str, int] = {}
        for ch in self.channels:
            if ch in start:
                s = int(start[ch])
            else:  # a channel added to the config after the query started
                init = init or self.initialOffset()
                s = init[ch]
            known = self._tails.get(ch)
            if self.target is not None:
                tail = self.target[ch]
            else:
                if not isinstance(limit, ReadAllAvailable) and ch in hint and known is not None:
                    cap = self._cap(ch, hint, s, known)
                    if known >= s + cap:
                        # draining a backlog: the tail seen last time is still ahead of this
                        # whole batch, so skip the broker probe (0.2-0.9 s per trigger)
                        out[ch] = s + cap
                        continue
                try:
                    tail = self._tail(ch)
                except BrokerError as e:
                    # a broker blip must not kill a continuous query: no new data this trigger
                    log_event(
                        log, 30, f"stream tail unknown, retrying next trigger: {e}", channel=ch
                    )
                    out[ch] = s
                    continue
            if tail < s:
                raise StateError(
                    f"channel {ch!r}: stream {stream_queue_name(self.cfg.black, ch)!r} ends at "
                    f"offset {tail} but black already shipped up to offset {s - 1}: the stream "
                    "queue was deleted and re-created (its offsets restarted). Messages published "
                    "in between may be lost. To go on: stop black, set last_offset to -1 in "
                    f"{Path(self.cfg.black.state_dir) / f'channel-{ch}.json'} (seqs continue "
                    "from last_seq), delete the checkpoint dir, and restart"
                )
            end = tail
            if not isinstance(limit, ReadAllAvailable):
                end = min(end, s + self._cap(ch, hint, s, end))
            out[ch] = end
        return out

    def reportLatestOffset(self) -> dict[str, int] | None:
        """The tails seen by the last ``latestOffset`` (probing the broker again costs ~0.5 s)."""
        return dict(self._tails) or None

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        start = self._from_journal(start) if not self._planned else start
        self._planned = True
        catalog = {
            k: v.to_json()
            for k, v in load_catalog(Path(self.cfg.black.state_dir) / "exchanges.json").items()
        }
        init: dict[str, int] | None = None
        parts: list[InputPartition] = []
        for ch in self.channels:
            if ch in start:
                s = int(start[ch])
            else:
                init = init or self.initialOffset()
                s = init[ch]
            e = int(end.get(ch, s))
            if e <= s:
                continue
            n = e - s
            k = max(1, min(self.cfg.black.read_partitions, n // MIN_SPLIT))
            step = -(-n // k)
            q = stream_queue_name(self.cfg.black, ch)
            for a in range(s, e, step):
                parts.append(StreamRange(ch, q, a, min(e, a + step), catalog))
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
            shipped = store.load(ch).last_offset + 1
            if ch in out and shipped < int(out[ch]):
                log_event(
                    log,
                    30,
                    "re-reading offsets committed by Spark but not shipped",
                    channel=ch,
                    first_offset=shipped,
                    last_offset=int(out[ch]) - 1,
                )
                out[ch] = shipped
        return out

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to acknowledge: the stream keeps messages until its retention drops them."""

    def stop(self) -> None:
        """No driver-side connection is held between calls."""

    # -- executors ----------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, StreamRange)
        t0 = time.monotonic()
        if not logging.getLogger("bridge").handlers:  # an executor's Python worker
            setup_logging()
        catalog = {k: ExchangeDecl.from_json(v) for k, v in partition.catalog.items()}
        url = self.cfg.black.amqp_url.get_secret_value()
        yield from read_batches(
            url, partition.queue, partition.channel, partition.start, partition.end, catalog,
            batch_rows=BATCH_ROWS,
        )  # fmt: skip
        log_event(
            log,
            20,
            "stream range read",
            channel=partition.channel,
            start=partition.start,
            end=partition.end,
            seconds=round(time.monotonic() - t0, 3),
        )


class RabbitStreamDataSource(DataSource):
    """``spark.readStream.format("rabbitmq").option("config", path).load()``."""

    @classmethod
    def name(cls) -> str:
        return "rabbitmq"

    def schema(self) -> StructType:
        return spark_row_schema()

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return RabbitStreamReader(dict(self.options))
