"""Black, seal: the foreachBatch sink — one micro-batch of rows -> sealed bundles per channel."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from bridge.black.chunking import row_size_estimate
from bridge.black.mirror import stream_bounds
from bridge.black.seal import BundleSealer, ShippedBundle
from bridge.black.source import READ_HINT_FILE
from bridge.config import Config
from bridge.fsutil import atomic_write_bytes
from bridge.logs import get_logger, log_event

__all__ = ["BatchSink", "BatchResult"]

log = get_logger("bridge.black.sink")


@dataclass
class BatchResult:
    batch_id: int
    rows: int
    bundles: list[ShippedBundle] = field(default_factory=list)
    seconds: float = 0.0


class BatchSink:
    """Callable for ``writeStream.foreachBatch``; runs in the driver's Python process."""

    def __init__(self, cfg: Config, sealer: BundleSealer) -> None:
        self.cfg = cfg
        self.sealer = sealer
        self.results: list[BatchResult] = []
        self._avg: dict[str, float] = {}

    def __call__(self, df: Any, batch_id: int) -> None:
        t0 = time.monotonic()
        table: pa.Table = df.toArrow()
        t1 = time.monotonic()
        res = self.process(table, batch_id)
        res.seconds = time.monotonic() - t0
        log_event(
            log, 20, "micro-batch timing", batch_id=batch_id, rows=res.rows,
            collect_seconds=round(t1 - t0, 3), seal_seconds=round(res.seconds - (t1 - t0), 3),
        )

    def _first_retained(self, channel: str) -> Callable[[], int]:
        return lambda: stream_bounds(self.cfg, channel)[0]

    def process(self, table: pa.Table, batch_id: int) -> BatchResult:
        res = BatchResult(batch_id=batch_id, rows=len(table))
        for ch in self.cfg.channels:
            sub = table.filter(pc.equal(table.column("channel"), ch.name)) if len(table) else table
            if not len(sub):
                continue
            self._avg[ch.name] = float(row_size_estimate(sub).mean())
            res.bundles.extend(
                self.sealer.seal_rows(ch, sub, first_retained=self._first_retained(ch.name))
            )
        if self._avg:
            hint = Path(self.cfg.black.state_dir) / READ_HINT_FILE
            atomic_write_bytes(hint, json.dumps({"avg_row_bytes": self._avg}).encode())
        self.results.append(res)
        log_event(
            log, 20, "micro-batch sealed", batch_id=batch_id, rows=res.rows,
            bundles=[b.name for b in res.bundles],
        )
        return res
