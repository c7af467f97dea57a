"""Black, job: wire mirror + taps + Spark spool source + sealing sink + heartbeats into one run.

RabbitMQ exchanges --mirror--> mirror queues --tap (one process per channel)--> spool
  --source "diode_spool"--> micro-batches --BatchSink (seal)--> outbox/ + archive/
  (+ heartbeats every N s)

``available-now`` runs one ``--until-empty`` tap per channel (each drains the backlog it finds)
and meanwhile one *drain* query seals the spool as it grows (a processing-time trigger of at
most ``DRAIN_TRIGGER_SECONDS``, no bundle held back for age); it stops once the taps have ended
and black's journal covers every channel's spool to its durable end. A new query costs ~1.5 s
of start-up and a Python source process of its own, so one query replaces the availableNow
query per round this job used to start. Should the journal not reach the spool's end while the
query idles, a last availableNow query seals what is left (the earlier behaviour).
``continuous`` keeps the taps running beside one query.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bridge.black.heartbeat import (
    JOB_LOCK_WAIT_SECONDS,
    HeartbeatLoop,
    HeartbeatWriter,
    prune_logged,
)
from bridge.black.mirror import Mirror, MirrorLoop
from bridge.black.recovery import recover_committed
from bridge.black.seal import BundleSealer
from bridge.black.sink import BatchSink, SealingFailed
from bridge.black.source import SpoolDataSource
from bridge.black.spool import SPOOL_DIR_MODE, SpoolReader, unwritable_spool_file
from bridge.black.state import LOCK_FILE, StateStore
from bridge.black.taps import TapSupervisor, UntilEmptyTaps
from bridge.config import Config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import signing_gpg
from bridge.diode.file_drop import (
    Outbox,
    cannot_create,
    default_staging,
    drop_dir_mode,
    not_writable,
)
from bridge.errors import ConfigError, DiodeError
from bridge.fsutil import DIR_MODE, durable_mkdir, exclusive_lock, write_refusal
from bridge.logs import get_logger, log_event
from bridge.spark import config_error_in, spark_path

__all__ = [
    "BlackRun",
    "BlackSummary",
    "run_black",
    "check_black_config",
    "check_black_writable",
    "make_black_dirs",
    "run_lock",
    "Trigger",
]

log = get_logger("bridge.black.job")
Trigger = Literal["available-now", "continuous"]
Stop = threading.Event | None
"""Set to end a run gracefully (SIGTERM); None: only its timeout or its end stop it."""
DRAIN_TRIGGER_SECONDS = 1.0
"""Scheduled runs: the drain query's trigger (at most; black.trigger_seconds if shorter)."""
DRAIN_IDLE_TRIGGERS = 5
"""Scheduled runs: triggers with no batch planned, collected or sealed, the taps ended and the
journal short of the spool's end, before a last availableNow query seals the rest."""


@dataclass
class BlackSummary:
    batches: int = 0
    messages: int = 0
    bundles: int = 0
    lost: int = 0
    seconds: float = 0.0
    recovered_bundles: int = 0
    """Bundles shipped at start-up for positions Spark had committed before a crash."""
    drain_seconds: float = 0.0
    """From the first micro-batch's read to the last bundle in the outbox (no query start-up)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "messages": self.messages,
            "bundles": self.bundles,
            "lost": self.lost,
            "recovered_bundles": self.recovered_bundles,
            "seconds": round(self.seconds, 3),
            "msg_per_s": round(self.messages / self.seconds, 1) if self.seconds else None,
            "drain_seconds": round(self.drain_seconds, 3),
            "drain_msg_per_s": round(self.messages / self.drain_seconds, 1)
            if self.drain_seconds
            else None,
        }


def check_black_config(cfg: Config, *, one_shot: bool = False) -> Gpg:
    """Fail fast, before Spark starts, on anything the operator must fix. ``one_shot`` (a
    check, not the job): a gpg-agent this call started is stopped, its cached passphrase
    with it."""
    if cfg.source is None:
        raise ConfigError(
            "the black job needs a config file (the Spark source reads it): pass --config"
        )
    if not cfg.black.signing_key:
        raise ConfigError(
            "black.signing_key is empty: run `diode keys init --side black` and paste the "
            "fingerprint it prints"
        )
    check_black_writable(cfg)  # `diode check` too: creates nothing
    # the key is there, usable, unlocked; no red secret key beside it; recipients can encrypt
    gpg = signing_gpg(cfg, one_shot=one_shot)
    for ch in cfg.channels:
        if not ch.encrypt:
            log_event(
                log,
                30,
                "channel opted out of encryption: bundles are signed plaintext",
                channel=ch.name,
            )
    return gpg


def _black_places(cfg: Config) -> list[tuple[str, Path, bool]]:
    """``(config key, directory, is a drop dir)`` of every directory black writes files in
    (the checkpoint dir too: Spark makes it, and writes, renames and removes files there)."""
    b = cfg.black
    outbox = Path(b.outbox)
    places = [("outbox", outbox, True)]
    if b.udp_outbox is not None:
        places.append(("udp_outbox", Path(b.udp_outbox), True))
    places += [
        ("staging_dir", Path(b.staging_dir) if b.staging_dir else default_staging(outbox), False),
        ("archive", Path(b.archive), False),
        ("state_dir", Path(b.state_dir), False),
        ("spool_dir", Path(b.spool_dir), False),
        ("checkpoint_dir", Path(b.checkpoint_dir), False),
    ]
    return places


def _channel_folders(cfg: Config) -> list[tuple[str, str, Path]]:
    """``(config key, channel, folder)`` of each channel's own folder black writes files in:
    ``<spool_dir>/<channel>`` (its tap) and ``<archive>/<channel>`` (the sealer)."""
    b = cfg.black
    roots = (("spool_dir", Path(b.spool_dir)), ("archive", Path(b.archive)))
    return [(key, ch.name, root / ch.name) for key, root in roots for ch in cfg.channels]


def _dir_mode(key: str) -> int:
    """The mode black makes ``black.<key>`` (and its channels' folders there) with."""
    return SPOOL_DIR_MODE if key == "spool_dir" else drop_dir_mode(key)


def check_black_writable(cfg: Config, *, probe_files: bool = False) -> None:
    """ConfigError (key, path, uid, fix) unless the user running black can create and remove
    files in the outbox, udp_outbox, staging, archive, state and spool dirs and in each
    channel's folder of the spool and the archive, found before the taps drain the broker and
    Spark starts, not when a tap or the first bundle fails.

    A directory not made yet counts as its nearest existing parent (where it would be made).
    Nothing visible is created in a drop dir, nor in a parent; ``probe_files``: the other
    directories that exist get a create-and-unlink probe (:func:`write_refusal`), else the
    same invisible probe as a drop dir (``diode check`` changes nothing on the host).
    """
    for key, path, drop in _black_places(cfg):
        d = _nearest_existing(path)
        if not d.is_dir():
            continue  # creating it fails, with its own message (a file in the way)
        refused = write_refusal(d, visible=probe_files and not drop and d == path)
        if refused is None:
            continue
        if d == path:
            raise ConfigError(not_writable(key, path, refused, mode=_dir_mode(key)))
        raise ConfigError(_cannot_make(key, path, d, refused))
    store = StateStore(Path(cfg.black.state_dir), create=False)
    for key, channel, folder in _channel_folders(cfg):
        _check_channel_folder(
            key, channel, folder, probe_files=probe_files, shipped=_shipped(store, channel)
        )


def _shipped(store: StateStore, channel: str) -> int | None:
    """The last seq ``channel``'s journal says black shipped (-1: none); None when the journal
    cannot be read (its own check says why): then every spool segment is checked."""
    try:
        return store.load(channel).last_seq
    except (OSError, DiodeError):
        return None


def _check_channel_folder(
    key: str, channel: str, folder: Path, *, probe_files: bool, shipped: int | None
) -> None:
    """Black, start: ConfigError unless black can write in ``channel``'s ``folder`` of
    ``black.<key>``, if it exists (else it is made in ``black.<key>``, checked before), and
    read each spool segment holding a position after ``shipped`` (its header)."""
    if not os.path.lexists(folder):
        return
    if not folder.is_dir():
        raise ConfigError(
            f"black.{key} {folder} is not a directory: black keeps channel {channel!r}'s "
            f"files in a folder of that name. Move {folder} out of black.{key} (black makes "
            "the folder)"
        )
    refused = write_refusal(folder, visible=probe_files)
    if refused is not None:
        msg = not_writable(key, folder, refused, mode=_dir_mode(key), channel=channel)
        raise ConfigError(msg)
    if key == "spool_dir":  # the tap opens LOCK, TAIL and the last segment for writing
        problem = unwritable_spool_file(folder.parent, channel, shipped=shipped)
        if problem is not None:
            raise ConfigError(problem)


def _nearest_existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (where it would be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _cannot_make(key: str, path: Path, parent: Path, e: OSError) -> str:
    """``black.<key>`` does not exist yet and its nearest existing ``parent`` refused (``e``)."""
    if e.errno == errno.EROFS:
        why = f"{parent} is on a read-only file system"
    else:
        why = (
            f"{parent} is not writable by the user running black (uid {os.getuid()}; {e.strerror})"
        )
    return cannot_create(key, path, why, _dir_mode(key))


def make_black_dirs(cfg: Config) -> None:
    """Create black's state and spool dirs, check that Spark can create the checkpoint dir and
    that black can write in every directory it writes files in (:func:`check_black_writable`,
    probing with real files where no mover looks), before Spark and the taps start: one that
    cannot be made or written is a ConfigError naming its key, not a traceback in a tap
    process, a Java stack trace from Spark, or a sealing failure once the broker is drained."""
    black = cfg.black
    for key, path in (("state_dir", black.state_dir), ("spool_dir", black.spool_dir)):
        mode = _dir_mode(key)
        try:
            durable_mkdir(Path(path), mode=mode)
        except OSError as e:
            raise ConfigError(cannot_create(key, path, e.strerror or str(e), mode)) from None
    ckpt = Path(black.checkpoint_dir)
    top = _nearest_existing(ckpt)
    if not top.is_dir():  # the others' durable_mkdir says so
        why = "Not a directory" if top != ckpt or top.exists() else "No such directory"
        raise ConfigError(cannot_create("checkpoint_dir", ckpt, f"{top}: {why}", DIR_MODE))
    check_black_writable(cfg, probe_files=True)


def run_lock(state_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Black's run lock (``state_dir/black.lock``), held for a job's whole run: waited for up
    to ``JOB_LOCK_WAIT_SECONDS``, the longest a ``diode black heartbeat`` beat holds it; a
    StateError then (another job runs on this journal: two would fork the bundle chain)."""
    return exclusive_lock(state_dir / LOCK_FILE, what="black run", timeout=JOB_LOCK_WAIT_SECONDS)


class BlackRun:
    """One black job: build with ``BlackRun(cfg)``, then ``run(...)``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.gpg = check_black_config(cfg)
        self.outbox = Outbox.from_config(cfg)  # refuses black's own dirs inside the outbox
        make_black_dirs(cfg)
        self.store = StateStore(Path(cfg.black.state_dir))
        self.sealer = BundleSealer(cfg, store=self.store, gpg=self.gpg, outbox=self.outbox)
        self.sink = BatchSink(cfg, self.sealer)
        self.mirror = Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json")
        self.heartbeats = HeartbeatWriter(cfg, store=self.store, gpg=self.gpg, outbox=self.outbox)
        self.taps: TapSupervisor | None = None

    def start_query(
        self,
        spark: Any,
        trigger: Trigger | Literal["drain"],
        *,
        query_name: str = "diode_black",
    ) -> Any:
        """``drain``: a processing-time query for scheduled runs that holds no bundle back."""
        spark.dataSource.register(SpoolDataSource)
        reader = spark.readStream.format("diode_spool").option("config", str(self.cfg.source))
        if trigger == "drain":
            reader = reader.option("hold", "false")
        w = (
            reader.load()
            .writeStream.foreachBatch(self.sink)
            .option("checkpointLocation", spark_path(self.cfg.black.checkpoint_dir))
            .queryName(query_name)
        )
        if trigger == "available-now":
            w = w.trigger(availableNow=True)
        elif trigger == "drain":
            w = w.trigger(processingTime=f"{int(self._drain_every() * 1000)} milliseconds")
        else:
            w = w.trigger(processingTime=f"{self.cfg.black.trigger_seconds} seconds")
        return w.start()

    def _drain_every(self) -> float:
        """The drain query's trigger: the configured one, at most ``DRAIN_TRIGGER_SECONDS``."""
        return min(DRAIN_TRIGGER_SECONDS, self.cfg.black.trigger_seconds)

    def _caught_up(self) -> bool:
        """Black's journal covers every channel's spool up to its durable end."""
        spool = Path(self.cfg.black.spool_dir)
        return all(
            self.store.load(ch.name).last_seq + 1 >= SpoolReader(spool, ch.name).durable_end()
            for ch in self.cfg.channels
        )

    def _drain(
        self, spark: Any, taps: UntilEmptyTaps, t0: float, timeout: float | None, stop: Stop
    ) -> bool:
        """Scheduled runs: one drain query while the taps drain; True once the taps have
        ended and the journal covers every spool (or the run was stopped), False to leave the
        rest to an availableNow query (the drain query idled ``DRAIN_IDLE_TRIGGERS`` triggers
        short of the end)."""
        query = self.start_query(spark, "drain")
        every = self._drain_every()
        seen, progressed = -1, time.monotonic()
        try:
            while not query.awaitTermination(min(every, 0.2)):  # the end is seen within 0.2 s
                now = time.monotonic()
                if _ended(t0, timeout, stop) or self.sink.failure() is not None:
                    return True  # as an availableNow run stopped by its timeout (or raises)
                if not taps.done():
                    continue
                if self._caught_up():
                    return True
                # idle: the query waits for a trigger or data and no batch is collected or
                # sealed (a query still starting, or a slow batch on a loaded host, is not)
                st = query.status
                waiting = str(st.get("message", "")).startswith("Waiting")
                working = self.sink.busy() or st.get("isTriggerActive") or not waiting
                if working or self.sink.handed != seen:
                    seen, progressed = self.sink.handed, now
                elif now - progressed >= DRAIN_IDLE_TRIGGERS * every:
                    log_event(log, 30, "drain query idle short of the spool's end: sealing "
                              "the rest with an availableNow query",
                              idle_seconds=round(now - progressed, 1))  # fmt: skip
                    return False
            return True  # the query stopped (a sealing failure): drain() below raises it
        finally:
            try:
                if query.isActive:
                    query.stop()
            finally:
                self.sink.drain()

    def _query(
        self, spark: Any, trigger: Trigger, t0: float, timeout: float | None, stop: Stop
    ) -> None:
        query = self.start_query(spark, trigger)
        failed: BaseException | None = None  # kept: the condition may clear while draining
        try:
            while True:
                try:
                    if query.awaitTermination(0.2):  # a stop is seen within 0.2 s
                        if trigger == "continuous" and not _ended(t0, timeout, stop):
                            failed = SealingFailed("the continuous black query ended by itself")
                        break
                except Exception:
                    failed = self.sink.failure()
                    if failed is None:
                        raise
                    break  # the sink stopped the query: its own error is raised below
                failed = self.sink.failure()
                if failed is not None or _ended(t0, timeout, stop):
                    break
        finally:
            try:
                if query.isActive:
                    query.stop()
            finally:
                self.sink.drain()  # every collected batch sealed (or the error raised)
        if failed is not None:
            _raise_unhealthy(failed)

    def run(
        self,
        spark: Any,
        trigger: Trigger = "available-now",
        *,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> BlackSummary:
        """Mirror, drain and seal. ``available-now`` stops when the backlog is sealed.

        ``timeout`` (seconds) or ``stop`` (set, e.g. on SIGTERM) end the run gracefully: the
        query stops, every batch it collected is sealed, the taps stop (what they made durable
        stays in the spool for the next run) and a final heartbeat is written.

        Holds an exclusive lock on the state dir for the whole run: two black jobs on one
        journal would fork the bundle chain.
        """
        with run_lock(Path(self.cfg.black.state_dir)):
            try:
                return self._run(spark, trigger, timeout, stop)
            except DiodeError:
                raise
            except Exception as e:  # a query's failure: the source refused another query's
                foreign = config_error_in(e)  # checkpoint (exit 2), or Spark's own error
                if foreign is not None:
                    raise foreign from None
                raise

    def _run(self, spark: Any, trigger: Trigger, timeout: float | None, stop: Stop) -> BlackSummary:
        t0 = time.monotonic()
        self.outbox.sweep_stale_temps()
        self.sink = BatchSink(self.cfg, self.sealer)  # a fresh sink: no stale error or results
        # heartbeats keep their period from the start: the mirror sync and the recovery of a
        # crash can take long on a big installation, and red must not think the link dead
        hb_loop = HeartbeatLoop(self.heartbeats, self.cfg.black.heartbeat_seconds, self.outbox)
        hb_loop.start()
        mirror_loop = MirrorLoop(self.mirror, self.cfg.black.discover_interval_seconds)
        taps: TapSupervisor | None = None
        scheduled: UntilEmptyTaps | None = None
        try:
            report = self.mirror.sync()  # declares queues + bindings; raises on misconfiguration
            log_event(log, 20, "mirror synced", report=str(report))
            recovered = recover_committed(self.cfg, self.sealer, self.store)
            if trigger == "continuous":
                mirror_loop.start()
                # a mirror that failed for good (permissions, arguments) must stop the job: new
                # exchanges would otherwise never reach the mirror queue, and black could not
                # tell
                self.sink.health_checks.append(lambda: mirror_loop.fatal)  # not a transient one
                taps = self.taps = TapSupervisor(self.cfg).start()
                self.sink.health_checks.append(lambda: taps.error if taps else None)
            else:
                scheduled = UntilEmptyTaps(self.cfg, timeout=timeout)
            if scheduled is None:
                self._query(spark, trigger, t0, timeout, stop)
            else:
                if not self._drain(spark, scheduled, t0, timeout, stop):
                    self._query(spark, "available-now", t0, timeout, stop)  # seals the rest
                if stop is None or not stop.is_set():  # stopped: the taps are stopped below
                    scheduled.finish()  # raises if a tap failed (what it spooled is sealed)
        finally:
            mirror_loop.stop()  # a no-op when it never started
            if taps is not None:
                taps.stop()
            if scheduled is not None:
                scheduled.stop()
            hb_loop.stop()
        self.heartbeats.beat_all()  # a final heartbeat names the last bundle sealed
        prune_logged(self.outbox, self.store)  # a pending bundle's copy stays
        s = BlackSummary(seconds=time.monotonic() - t0, recovered_bundles=len(recovered))
        if self.sink.totals.first_began is not None:
            s.drain_seconds = self.sink.totals.last_ended - self.sink.totals.first_began
        t = self.sink.totals
        s.batches, s.messages, s.bundles, s.lost = t.batches, t.messages, t.bundles, t.lost
        for b in recovered:
            s.messages += b.rows
            s.bundles += 1
            s.lost += sum(g.last_seq - g.first_seq + 1 for g in b.gaps)
        return s


def _raise_unhealthy(err: BaseException) -> None:
    """A dead tap or a failed mirror ends the run with its own error (a tap's configuration
    error exits 2), not with a clean summary."""
    if isinstance(err, DiodeError):
        raise err
    raise SealingFailed(f"stopping the black job: {err}") from err


def _ended(t0: float, timeout: float | None, stop: Stop) -> bool:
    """The run's timeout has passed or it was asked to stop."""
    return (stop is not None and stop.is_set()) or (
        timeout is not None and time.monotonic() - t0 >= timeout
    )


def run_black(
    cfg: Config, spark: Any, trigger: Trigger = "available-now", **kw: Any
) -> BlackSummary:
    return BlackRun(cfg).run(spark, trigger, **kw)
