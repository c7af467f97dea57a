"""Red, intake: the Spark Python streaming data source "diode_inbox": verified inbox files.

The driver side (``latestOffset``) takes settled files out of ``inbox/`` into
``work_dir/intake/`` under a durable, strictly increasing *ordinal* (bridge.red.intake);
offsets are ``{"next": ordinal}`` and live in Spark's checkpoint, so a replayed micro-batch
covers exactly the same files. inotify (bridge.red.watch) tells when the inbox changed, so an
idle inbox is not listed on every trigger and a closed file is taken before its settle time.

The executor side (``read``) verifies and decrypts each file of its partition
(bridge.red.verify): one verdict row per file, with the path of the verified plaintext. The
landing sink (bridge.red.landing) judges sequences and lands rows on the driver.

Options: ``config`` (path of the diode TOML), ``parallelism`` (partitions per batch).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
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

from bridge.config import Config, load_config
from bridge.logs import get_logger, log_event, setup_logging
from bridge.red.evidence import Evidence
from bridge.red.intake import Intake
from bridge.red.layout import intent_path
from bridge.red.verify import VERDICT_SCHEMA, VerifyContext, verify_file
from bridge.red.watch import InboxWatcher

__all__ = ["InboxDataSource", "InboxStreamReader", "SOURCE_SCHEMA", "FileBatch", "make_intake"]

log = get_logger("bridge.red.source")

SOURCE_SCHEMA = pa.schema([pa.field("ordinal", pa.int64(), nullable=False), *VERDICT_SCHEMA])
"""One row per file: its intake ordinal, then the verdict (bridge.red.verify)."""


@dataclass(frozen=True)
class FileBatch(InputPartition):
    """One Spark task: intake files ``(ordinal, name)`` to verify."""

    files: tuple[tuple[int, str], ...]


def make_intake(cfg: Config) -> Intake:
    """The inbox intake of ``cfg`` (both the source and the job use the same one)."""
    r = cfg.red
    return Intake(
        Path(r.inbox),
        Path(r.work_dir),
        Evidence(Path(r.processed_dir), Path(r.quarantine_dir)),
        r.settle_seconds,
    )


def intake_dir(cfg: Config) -> Path:
    return Path(cfg.red.work_dir) / "intake"


class InboxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans intake ordinal ranges; executors verify the files."""

    def __init__(self, options: dict[str, str]) -> None:
        if not logging.getLogger("bridge").handlers:  # Spark's source runner process
            setup_logging()
        self.config_path = options.get("config", "")
        self.cfg: Config = load_config(self.config_path or None)
        self.parallelism = max(1, int(options.get("parallelism", "2")))
        self.ctx = VerifyContext.from_config(self.cfg)
        self.target: int | None = None
        self._intake: Intake | None = None
        self._watcher: InboxWatcher | None = None
        self._last_scan = 0.0
        self._waiting = 0
        self._orphans_checked = False

    # -- driver -------------------------------------------------------------------------------
    def _get_intake(self) -> Intake:
        if self._intake is None:
            self._intake = make_intake(self.cfg)
        return self._intake

    def _scan(self, *, force: bool = False) -> None:
        """Take settled files into intake when the inbox changed (or every red.trigger_seconds)."""
        intake = self._get_intake()
        if self._watcher is None:
            self._watcher = InboxWatcher(Path(self.cfg.red.inbox))
            self._watcher.start()
            force = True
        now = time.monotonic()
        changed = self._watcher.wait(0)
        if not (
            force
            or changed
            or self._waiting
            or now - self._last_scan >= self.cfg.red.trigger_seconds
        ):
            return
        res = intake.scan(time.time(), self._watcher.closed_names())
        self._last_scan = now
        self._waiting = res.waiting
        if res.taken or res.quarantined:
            log_event(
                log, 20, "inbox scanned", taken=len(res.taken),
                quarantined=len(res.quarantined), waiting=res.waiting, hidden=res.hidden,
            )  # fmt: skip

    def _pending(self) -> list[tuple[int, str]]:
        return [(t.ordinal, t.name) for t in self._get_intake().pending()]

    def initialOffset(self) -> dict[str, int]:
        pending = self._pending()
        return {"next": pending[0][0] if pending else self._get_intake().next_ordinal()}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.cfg.red.max_files_per_batch)

    def prepareForTriggerAvailableNow(self) -> None:
        """Take what is complete now; wait at most one settle time for files still settling."""
        deadline = time.monotonic() + self.cfg.red.settle_seconds + 0.5
        self._scan(force=True)
        while self._waiting and time.monotonic() < deadline:
            time.sleep(min(0.2, self.cfg.red.settle_seconds or 0.2))
            self._scan(force=True)
        self.target = self._get_intake().next_ordinal()

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        s = int(start.get("next", 0))
        if self.target is None:
            self._scan()
        self._take_back_orphans(s)
        ordinals = [o for o, _ in self._pending() if o >= s]
        if self.target is not None:
            ordinals = [o for o in ordinals if o < self.target]
        if not ordinals:
            return {"next": s}
        cap = len(ordinals)
        if isinstance(limit, ReadMaxRows):
            cap = max(1, limit.max_rows)
        elif not isinstance(limit, ReadAllAvailable):
            cap = self.cfg.red.max_files_per_batch
        chosen = ordinals[:cap]
        budget, total = self.cfg.red.max_batch_bytes, 0
        names = dict(self._pending())
        for i, o in enumerate(chosen):
            try:
                total += (intake_dir(self.cfg) / f"{o:012d}.{names[o]}").stat().st_size
            except OSError:
                continue
            if total > budget and i > 0:
                chosen = chosen[:i]
                break
        return {"next": chosen[-1] + 1}

    def _take_back_orphans(self, start: int) -> None:
        """Once per reader: intake files below ``start`` (what Spark has committed) that no
        landing journal holds were never landed — a landing's intent was lost (the state dir
        restored from a copy, or the file deleted by hand). They are renumbered above
        ``start`` and land like new files; nothing is lost in Spark's checkpoint."""
        if self._orphans_checked:
            return
        held = self._held_by_intent()
        if held is None:
            return  # the journal's intent cannot be read now: ask again at the next poll
        intake = self._get_intake()
        # listed after the intent was read: a landing moves its files before it removes its
        # intent, and Spark plans no batch (so no new intent) while it asks this
        orphans = [t for t in intake.pending() if t.ordinal < start and t.ordinal not in held]
        taken = intake.renumber(orphans)
        self._orphans_checked = True
        if taken:
            log_event(
                log, 40, "intake files below Spark's committed offset were never landed (a "
                "landing journal was lost): taken again under new ordinals",
                files=len(taken), names=[t.name for t in taken][:20],
            )  # fmt: skip
            if self.target is not None:  # an available-now run lands them too
                self.target = intake.next_ordinal()

    def _held_by_intent(self) -> set[int] | None:
        """Intake ordinals the landing journal's intent will still move (empty without an
        intent; None when it cannot be read now)."""
        try:
            doc = json.loads(intent_path(self.cfg.red.state_dir).read_bytes())
            return {int(m["ordinal"]) for m in doc.get("moves", [])}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        s, e = int(start.get("next", 0)), int(end.get("next", 0))
        files = [(o, n) for o, n in self._pending() if s <= o < e]
        if not files:
            return []
        k = min(self.parallelism, len(files))
        return [FileBatch(tuple(files[i::k])) for i in range(k)]

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the landing moves each file to processed/ or quarantine/."""

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    # -- executors ----------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, FileBatch)
        base = intake_dir(self.cfg)
        for ordinal, name in partition.files:
            path = base / f"{ordinal:012d}.{name}"
            if not path.exists():  # landed by an earlier attempt of this batch
                continue
            verdict = verify_file(path, name, self.ctx)
            row = {"ordinal": ordinal, **verdict.to_row()}
            yield pa.RecordBatch.from_pylist([row], schema=SOURCE_SCHEMA)


class InboxDataSource(DataSource):
    """``spark.readStream.format("diode_inbox").option("config", path).load()``."""

    @classmethod
    def name(cls) -> str:
        return "diode_inbox"

    def schema(self) -> StructType:
        from pyspark.sql.pandas.types import from_arrow_schema

        return from_arrow_schema(SOURCE_SCHEMA, prefer_timestamp_ntz=False)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return InboxStreamReader(dict(self.options))
