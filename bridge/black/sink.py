"""Black, seal: the foreachBatch sink — one micro-batch of spool ranges -> sealed bundles.

    foreachBatch(df, id) ── ranges (channel, start, end) ──> [queue, 1 deep]
        ──> sealing thread: spool records -> rows (row schema v2) -> bundles ──> outbox

Sealing batch N overlaps reading batch N+1. That is safe because black's journal, not Spark's
checkpoint, decides what is shipped: when Spark has committed a batch that the sealing thread
had not finished (a crash), the next run ships it before the query starts
(:mod:`bridge.black.recovery`) and the source's first batch also starts at the journal
(``SpoolStreamReader.partitions``). When the checkpoint is *behind* the journal instead (a
kill after the sealer shipped a batch Spark had not committed yet, or a power loss rolling the
checkpoint back), the replayed batch names positions the tap may already have released: the
sink reads only positions after the journal's ``last_seq`` and skips a range left empty. A
sealing failure stops the query at the next batch and is raised by ``drain``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from bridge.black.catalog import load_catalog
from bridge.black.chunking import row_size_estimate
from bridge.black.seal import BundleSealer, ShippedBundle
from bridge.black.source import save_read_hint
from bridge.black.spool_rows import read_rows, source_schema
from bridge.black.state import StateStore
from bridge.config import Config
from bridge.errors import DiodeError
from bridge.fsutil import os_error_text
from bridge.logs import get_logger, log_event

__all__ = ["BatchSink", "BatchResult", "SealingFailed", "Totals"]

log = get_logger("bridge.black.sink")


class SealingFailed(DiodeError):
    """The sealing thread failed; the query must stop (the journal keeps what was shipped)."""


@dataclass
class Totals:
    """Running totals of a run (per-batch results are not kept: memory stays flat)."""

    batches: int = 0
    messages: int = 0
    bundles: int = 0
    lost: int = 0
    first_began: float | None = None
    last_ended: float = 0.0

    def add(self, r: BatchResult) -> None:
        self.batches += 1
        self.messages += sum(b.rows for b in r.bundles)
        self.bundles += len(r.bundles)
        self.lost += sum(g.last_seq - g.first_seq + 1 for b in r.bundles for g in b.gaps)
        if r.rows:
            if self.first_began is None:
                self.first_began = r.began
            self.last_ended = r.ended


@dataclass
class BatchResult:
    batch_id: int
    rows: int
    bundles: list[ShippedBundle] = field(default_factory=list)
    began: float = 0.0
    """time.monotonic() when Spark handed the batch over (its read starts then)."""
    ended: float = 0.0
    """time.monotonic() when its last bundle was durably in the outbox."""


class BatchSink:
    """Callable for ``writeStream.foreachBatch``; runs in the driver's Python process."""

    def __init__(self, cfg: Config, sealer: BundleSealer, *, overlap: bool = True) -> None:
        self.cfg = cfg
        self.sealer = sealer
        self.overlap = overlap
        self.totals = Totals()
        self.health_checks: list[Callable[[], BaseException | None]] = []
        """Called before each batch; an error returned stops the query (e.g. a dead mirror)."""
        self._avg: dict[str, float] = {}
        self._queue: queue.Queue[tuple[pa.Table, int, float, float] | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._sealing: tuple[str, int, int] | None = None
        """The channel and spool positions [a, b) being sealed now (named when it fails)."""
        self._failed_at = ""
        self._thread: threading.Thread | None = None
        self.handed = 0
        """Batches Spark has handed over (each is collected, then sealed: ``totals.batches``)."""
        self._journal = StateStore(Path(cfg.black.state_dir))

    def busy(self) -> bool:
        """A batch handed over is still being collected or sealed (never after a failure)."""
        return self._error is None and self.handed > self.totals.batches

    def failure(self) -> BaseException | None:
        """Why the query must stop now: sealing failed, or a health check (a dead tap, a
        failed mirror) says so. The job polls this: Spark calls the sink only when there is a
        next batch, and after such a failure there may never be one."""
        if self._error is not None:
            return self._error
        for check in self.health_checks:
            err = check()
            if err is not None:
                return err
        return None

    # -- Spark side ---------------------------------------------------------------------------
    def __call__(self, df: Any, batch_id: int) -> None:
        self._raise_if_failed()
        err = self.failure()  # a health check (the sealing error was raised just above)
        if err is not None:
            raise SealingFailed(f"stopping the black job: {err}") from err
        self.handed += 1
        t0 = time.monotonic()
        table: pa.Table = df.toArrow()
        collect = time.monotonic() - t0
        if not self.overlap:
            self._seal(table, batch_id, collect, t0)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="diode-sealer", daemon=True)
            self._thread.start()
        self._queue.put((table, batch_id, collect, t0))  # blocks while the previous batch seals

    def drain(self) -> None:
        """Wait until every collected batch is sealed; raise if sealing failed."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_if_failed()

    # -- sealing thread -----------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise SealingFailed(
                f"sealing failed, stopping{self._failed_at}: {self._error}"
            ) from self._error

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drop: nothing after a failure may ship out of order
            try:
                self._seal(*item)
            except BaseException as e:  # noqa: BLE001 - reported through drain/next batch
                self._failed_at = (
                    ""
                    if self._sealing is None
                    else (
                        f" (channel {self._sealing[0]!r}, spool positions "
                        f"{self._sealing[1]}..{self._sealing[2] - 1})"
                    )
                )
                log_event(log, 50, f"sealing failed{self._failed_at}: {e}", batch_id=item[1])
                self._error = e

    def _seal(self, table: pa.Table, batch_id: int, collect: float, began: float) -> None:
        t0 = time.monotonic()
        res = self.process(table, batch_id)
        res.began, res.ended = began, time.monotonic()
        self.totals.add(res)
        log_event(
            log,
            20,
            "micro-batch timing",
            batch_id=batch_id,
            rows=res.rows,
            collect_seconds=round(collect, 3),
            seal_seconds=round(time.monotonic() - t0, 3),
        )

    def process(self, ranges: pa.Table, batch_id: int) -> BatchResult:
        """Seal the spool ranges of one micro-batch (one row per channel: start, end).

        Each range is read from the first position after the journal's ``last_seq``: what the
        journal covers is shipped, and the tap may have released it from the spool already (a
        batch Spark replays from a checkpoint behind the journal). A range left empty is
        skipped. Only the sealer, called from here, advances the journal, so nothing after it
        is released while the range is read.
        """
        self._sealing = None
        spans: dict[str, tuple[int, int]] = {}
        for ch, a, b in zip(
            ranges.column("channel").to_pylist(),
            ranges.column("start").to_pylist(),
            ranges.column("end").to_pylist(),
            strict=True,
        ):
            a = max(int(a), self._journal.load(ch).last_seq + 1)
            if a < int(b):
                spans[ch] = (a, int(b))
        res = BatchResult(batch_id=batch_id, rows=sum(b - a for a, b in spans.values()))
        catalog = load_catalog(Path(self.cfg.black.state_dir) / "exchanges.json")
        for ch in self.cfg.channels:
            if ch.name not in spans:
                continue
            a, b = spans[ch.name]
            self._sealing = (ch.name, a, b)
            batches = list(read_rows(Path(self.cfg.black.spool_dir), ch.name, a, b, catalog))
            sub = pa.Table.from_batches(batches, schema=source_schema())
            if not len(sub):
                continue
            self._avg[ch.name] = float(row_size_estimate(sub).mean())
            res.bundles.extend(self.sealer.seal_rows(ch, sub))
        self._sealing = None
        if self._avg:  # other channels keep the hints of earlier runs
            names = [c.name for c in self.cfg.channels]
            try:
                save_read_hint(Path(self.cfg.black.state_dir), self._avg, names)
            except OSError as e:  # a sizing hint: the batch is sealed and shipped whatever
                log_event(log, 30, "read hint not saved (the next run's first batch is sized "
                          "from a few messages)", error=os_error_text(e))  # fmt: skip
        log_event(
            log,
            20,
            "micro-batch sealed",
            batch_id=batch_id,
            rows=res.rows,
            bundles=[b.name for b in res.bundles],
        )
        return res
