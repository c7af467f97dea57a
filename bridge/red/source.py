"""Red, intake: the Spark Python streaming data source "diode_inbox": verified inbox files.

The driver side (``latestOffset``) takes settled files out of ``inbox/`` into
``work_dir/intake/`` under a durable, strictly increasing *ordinal* (bridge.red.intake);
offsets are ``{"next": ordinal}`` and live in Spark's checkpoint, so a replayed micro-batch
covers exactly the same files. inotify (bridge.red.watch) tells when the inbox changed, so an
idle inbox is not listed on every trigger and a closed file is taken before its settle time.

The executor side (``read``) verifies and decrypts each file of its partition
(bridge.red.verify): one verdict row per file, with the path of the verified plaintext. The
landing sink (bridge.red.landing) judges sequences and lands rows on the driver.

Some files cannot be judged *now*, and wait in intake instead of stopping red or being
quarantined:

* a bundle whose plaintext may need more than ``work_dir/plain`` has free now (keeping
  ``PLAIN_RESERVE_BYTES``; bridge.red.verify: ``plain_need``, ``plain_room``): gpg writes
  the plaintext before it checks the signature, so opening it would fill the disk. It is not
  planned while it does not fit (files behind it that fit are planned first: it is renumbered
  behind them), with a warning every minute; it is planned once there is room;
* a file that changed since it was planned (a mover still writing in place after the settle
  time), found by ``read`` before verifying it, or after a reject: no verdict on it now.

Such a file (and one ``partitions`` or ``read`` found no room for after all) is left in intake
without a row; at the next poll the reader takes it again under a new ordinal, and plans it
once it has not changed for ``red.settle_seconds`` (at least 1 s).

Spark's committed offset is never below ``work_dir/intake/NEXT``: the first poll raises NEXT to
it (a NEXT lost with ``work_dir`` would otherwise hand out ordinals Spark has gone past, and
nothing would ever be planned again).

Options: ``config`` (path of the diode TOML), ``parallelism`` (partitions per batch).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
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
from bridge.errors import ConfigError
from bridge.logs import ensure_logging, get_logger, log_event
from bridge.red.evidence import Evidence
from bridge.red.intake import Intake, Taken
from bridge.red.layout import INTAKE_DIR, intent_path
from bridge.red.verify import (
    VERDICT_SCHEMA,
    NoRoomNow,
    PlainRoom,
    VerifyContext,
    plain_need,
    plain_room,
    same_file_system,
    verify_file,
)
from bridge.red.watch import InboxWatcher
from bridge.spark import FOREIGN_CHECKPOINT

__all__ = ["InboxDataSource", "InboxStreamReader", "SOURCE_SCHEMA", "FileBatch", "make_intake"]

log = get_logger("bridge.red.source")

SOURCE_SCHEMA = pa.schema([pa.field("ordinal", pa.int64(), nullable=False), *VERDICT_SCHEMA])
"""One row per file: its intake ordinal, then the verdict (bridge.red.verify)."""


ROOM_LOG_SECONDS = 60.0
"""A file waiting for room is logged (warning) at most this often."""
TAKEN_BACK_SETTLE_MIN = 1.0
"""A file taken back into intake waits at least this long unchanged before it is planned."""

PlannedFile = tuple[int, str, int, int]
"""``(ordinal, name, size, mtime_ns)``: an intake file and what it was when planned."""


def _offset_next(offset: object, cfg: Config) -> int:
    """The ``next`` ordinal of an offset of this source (``{"next": int}``, from Spark's
    checkpoint); a ConfigError when the checkpoint was written by another query (a rate
    source's ``0``, black's ``{"channel": seq}``), which Spark hands over as it found it."""
    if isinstance(offset, dict) and set(offset) == {"next"}:
        value = offset["next"]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    shown = json.dumps(offset, default=str)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    raise ConfigError(
        f"red.checkpoint_dir {cfg.red.checkpoint_dir} {FOREIGN_CHECKPOINT} (offset {shown}, "
        'not {"next": N}): point red.checkpoint_dir at an empty directory, the red job\'s '
        "alone (a new checkpoint starts at the files still waiting in intake)"
    )


@dataclass(frozen=True)
class FileBatch(InputPartition):
    """One Spark task: intake files to verify, with what each was when planned."""

    files: tuple[PlannedFile, ...]


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
    return Path(cfg.red.work_dir) / INTAKE_DIR


class InboxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans intake ordinal ranges; executors verify the files."""

    def __init__(self, options: dict[str, str]) -> None:
        ensure_logging()  # Spark's source runner process
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
        self._next_checked = False
        self._planned: tuple[int, int] | None = None
        """The ordinal range of the last ``partitions`` (its files left in intake are taken
        again once Spark has gone past it)."""
        self._settling: dict[str, tuple[tuple[int, int], float]] = {}
        """Files taken again: name -> ((size, mtime_ns), since when it is so)."""
        self._room_logged: dict[str, float] = {}

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
                left=res.left,
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
        s = _offset_next(start, self.cfg)
        self._catch_up_next(s)
        if self.target is None:
            self._scan()
        self._take_back_orphans(s)
        self._take_back_left(s)
        files = [t for t in self._get_intake().pending() if t.ordinal >= s]
        if self.target is not None:
            files = [t for t in files if t.ordinal < self.target]
        if not files:
            return {"next": s}
        cap = len(files)
        if isinstance(limit, ReadMaxRows):
            cap = max(1, limit.max_rows)
        elif not isinstance(limit, ReadAllAvailable):
            cap = self.cfg.red.max_files_per_batch
        chosen = self._choose(files, cap)
        return {"next": chosen[-1].ordinal + 1} if chosen else {"next": s}

    def _choose(self, files: list[Taken], cap: int) -> list[Taken]:
        """The next batch: files in ordinal order, at most ``cap`` of them and
        ``red.max_batch_bytes`` (at least one file), whose plaintexts fit in ``plain_dir``
        together. Files at the head that cannot be verified now (no room, still changing)
        are skipped; when files behind them are chosen, they are renumbered behind those."""
        rooms = self._rooms()
        now = time.monotonic()
        self._forget_gone(files)
        budget, total, planned = self.cfg.red.max_batch_bytes, 0, 0
        chosen: list[Taken] = []
        skipped: list[Taken] = []
        for t in files:
            if len(chosen) >= cap:
                break
            room = rooms(t)
            need = 0 if room is None else plain_need(t.name, t.size, self.ctx, room)
            ready = self._unchanged(t, now) and (room is None or room.fits(need, planned=planned))
            if not ready:
                if chosen:
                    break  # the next batch
                if room is not None and not room.fits(need):
                    self._log_waiting_for_room(t, need, room, now)
                skipped.append(t)
                continue
            if chosen and total + t.size > budget:
                break
            chosen.append(t)
            total += t.size
            planned += need
            self._settling.pop(t.name, None)
            self._room_logged.pop(t.name, None)
        if chosen and skipped:  # ordinals are planned as ranges: move them past the batch
            self._get_intake().renumber(skipped)
        return chosen

    def _rooms(self) -> Callable[[Taken], PlainRoom | None]:
        """The room in ``plain_dir``'s file system now for each intake file: less its own
        size when intake shares that file system (None: cannot tell; executors check)."""
        d = Path(self.ctx.plain_dir)
        d = d if d.is_dir() else d.parent
        try:
            room = plain_room(d)
        except OSError:
            return lambda _t: None
        if not same_file_system(intake_dir(self.cfg), d):
            return lambda _t: room
        return lambda t: room.beside(t.size)

    def _unchanged(self, t: Taken, now: float) -> bool:
        """False while a file taken again (``_take_back_left``) keeps changing, and until it
        has not changed for ``red.settle_seconds`` (at least ``TAKEN_BACK_SETTLE_MIN``)."""
        entry = self._settling.get(t.name)
        if entry is None:
            return True
        sig = (t.size, t.mtime_ns)
        if entry[0] != sig:
            self._settling[t.name] = (sig, now)
            return False
        return now - entry[1] >= max(self.cfg.red.settle_seconds, TAKEN_BACK_SETTLE_MIN)

    def _forget_gone(self, files: list[Taken]) -> None:
        names = {t.name for t in files}
        for d in (self._settling, self._room_logged):
            for name in [n for n in d if n not in names]:
                del d[name]

    def _log_waiting_for_room(self, t: Taken, need: int, room: PlainRoom, now: float) -> None:
        last = self._room_logged.get(t.name)
        if last is not None and now - last < ROOM_LOG_SECONDS:
            return
        self._room_logged[t.name] = now
        log_event(
            log, 30, "intake file waits for room: its plaintext may need more than "
            f"{self.ctx.plain_dir} has free; it is verified once there is room (free space in "
            "red.work_dir's file system, or lower red.max_plain_bytes)",
            file_name=t.name, ordinal=t.ordinal, need=need, free=room.free,
            reserve=room.reserve(need),
        )  # fmt: skip

    def _catch_up_next(self, start: int) -> None:
        """Once per reader: NEXT at least Spark's committed offset ``start``."""
        if self._next_checked:
            return
        was = self._get_intake().raise_next(start)
        self._next_checked = True
        if was is not None:
            log_event(
                log, 30, "intake counter NEXT was below Spark's committed offset (NEXT lost or "
                "restored from an old copy?): raised to it, so no file gets an ordinal Spark "
                "has gone past", next_was=was, next=start,
                counter=str(intake_dir(self.cfg) / "NEXT"),
            )  # fmt: skip

    def _take_back_orphans(self, start: int) -> None:
        """Once per reader: intake files below ``start`` (what Spark has committed) that no
        landing journal holds were never landed — a landing's intent was lost (the state dir
        restored from a copy, or the file deleted by hand), or the previous reader left them
        unjudged (``_take_back_left``). They are renumbered above ``start`` and land like new
        files; nothing is lost in Spark's checkpoint."""
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
                "landing journal was lost, or the last run left them unjudged: no room for "
                "their plaintext, or still changing): taken again under new ordinals",
                files=len(taken), names=[t.name for t in taken][:20],
            )  # fmt: skip
            if self.target is not None:  # an available-now run lands them too
                self.target = intake.next_ordinal()

    def _take_back_left(self, start: int) -> None:
        """Once Spark has gone past the last planned range: its files still in intake that
        no landing holds were left unjudged on purpose (``partitions`` or ``read`` found no
        room for them now, or they changed since planned). They are taken again under new
        ordinals, and planned once they stop changing."""
        if self._planned is None or start < self._planned[1]:
            return
        first, end = self._planned
        held = self._held_by_intent()
        if held is None:
            return  # the journal's intent cannot be read now: ask again at the next poll
        self._planned = None
        intake = self._get_intake()
        left = [t for t in intake.pending() if first <= t.ordinal < end and t.ordinal not in held]
        taken = intake.renumber(left)
        now = time.monotonic()
        for t in taken:
            self._settling[t.name] = ((t.size, t.mtime_ns), now)
        if taken:
            log_event(
                log, 30, "intake files the last batch left unjudged (no room for their "
                "plaintext now, or changed since planned) are taken again under new ordinals",
                files=len(taken), names=[t.name for t in taken][:20],
            )  # fmt: skip

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
        s, e = _offset_next(start, self.cfg), _offset_next(end, self.cfg)
        self._planned = (s, e)
        files = [t for t in self._get_intake().pending() if s <= t.ordinal < e]
        rooms = self._rooms()
        keep: list[Taken] = []
        planned = 0
        for t in files:
            room = rooms(t)
            need = 0 if room is None else plain_need(t.name, t.size, self.ctx, room)
            if room is not None and not room.fits(need, planned=planned):
                # less room than when planned (or a batch replayed after a restart): left in
                # intake, taken again at the next poll, instead of failing the job
                self._log_waiting_for_room(t, need, room, time.monotonic())
                continue
            keep.append(t)
            planned += need
        if not keep:
            return []
        k = min(self.parallelism, len(keep))
        return [
            FileBatch(tuple((t.ordinal, t.name, t.size, t.mtime_ns) for t in keep[i::k]))
            for i in range(k)
        ]

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the landing moves each file to processed/ or quarantine/."""

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    # -- executors ----------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, FileBatch)
        ensure_logging()  # an executor's Python worker: its records with their ids
        base = intake_dir(self.cfg)
        for ordinal, name, size, mtime_ns in partition.files:
            path = base / f"{ordinal:012d}.{name}"
            if not path.exists():  # landed by an earlier attempt of this batch
                continue
            if _changed(path, size, mtime_ns):
                _leave(name, ordinal, "it changed since it was planned (still being written?)")
                continue
            try:
                verdict = verify_file(path, name, self.ctx)
            except NoRoomNow as e:
                _leave(name, ordinal, str(e))
                continue
            if not verdict.ok and _changed(path, size, mtime_ns):
                # a mover writing in place after the settle time: a half-written file is no
                # verdict, and quarantining it would move the inode the mover still writes
                _leave(name, ordinal, f"rejected ({verdict.reason}) while it changed")
                continue
            row = {"ordinal": ordinal, **verdict.to_row()}
            yield pa.RecordBatch.from_pylist([row], schema=SOURCE_SCHEMA)


def _changed(path: Path, size: int, mtime_ns: int) -> bool:
    """Whether the intake file is no longer what was planned (gone counts as unchanged)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_size, st.st_mtime_ns) != (size, mtime_ns)


def _leave(name: str, ordinal: int, why: str) -> None:
    log_event(
        log, 30, "intake file left unjudged for now: the reader takes it again at its next "
        "poll", file_name=name, ordinal=ordinal, why=why,
    )  # fmt: skip


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
