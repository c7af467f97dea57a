"""Red, job: wire inbox intake + Spark source "diode_inbox" + landing sink into one run.

red inbox/ --intake (settled files)--> source "diode_inbox" --executors: verify+decrypt-->
verdict rows --Landing (driver)--> Delta messages / bundles / audit + processed/ quarantine/

``available-now`` lands what is complete in the inbox and stops (schedulers);
``continuous`` keeps landing, woken by inotify, and reports silent links on a timer.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field
from itertools import combinations, permutations
from pathlib import Path
from typing import Any, Literal

from bridge.config import Config
from bridge.crypto.keys import decryption_gpg
from bridge.errors import ConfigError, DiodeError
from bridge.fsutil import durable_mkdir, exclusive_lock, write_refusal
from bridge.logs import get_logger, log_event
from bridge.red.evidence import Evidence
from bridge.red.landing import LOCK_FILE, Landing, LandingResult
from bridge.red.layout import RED_DIR_KEYS, WALKED_DIR_KEYS
from bridge.red.source import InboxDataSource
from bridge.red.tables import RedTables, resolve_engine
from bridge.spark import config_error_in, spark_path

__all__ = [
    "RedRun", "RedSummary", "run_red", "check_red_config", "check_red_places", "Trigger",
    "open_tables", "open_landing",
]  # fmt: skip

log = get_logger("bridge.red.job")
Trigger = Literal["available-now", "continuous"]
POLL_SECONDS = 0.5
"""Continuous runs ask the source this often; an idle inbox costs one inotify check."""


@dataclass
class RedSummary:
    """What one red run did. ``rejected`` is every file refused this run, whoever refused it
    (the intake, before Spark: ``quarantined_at_intake``; or verification), the increase of
    ``bridge_red_files_rejected_total``; conflicts are counted apart (``conflicts``). Every
    refused file and every conflict is in the quarantine (``diode red status``:
    ``quarantine.by_reason``)."""

    batches: int = 0
    seconds: float = 0.0
    recovered: int = 0
    totals: LandingResult = field(default_factory=LandingResult)

    def to_json(self) -> dict[str, Any]:
        t = self.totals
        return {
            "batches": self.batches,
            "files": t.files,
            "bundles_landed": t.bundles_landed,
            "messages_landed": t.messages_landed,
            "duplicates": t.duplicates,
            "conflicts": t.conflicts,
            **t.refusals(),  # rejected (all), quarantined_at_intake: as the "landed" log line
            "heartbeats": t.heartbeats,
            "transport_gap_objects": t.transport_gap_objects,  # events count records (rows)
            "events": dict(sorted(t.events.items())),
            "land_seq": t.land_seq,
            "recovered_landings": self.recovered,
            "seconds": round(self.seconds, 3),
            "msg_per_s": round(t.messages_landed / self.seconds, 1) if self.seconds else None,
        }


def check_red_config(cfg: Config) -> None:
    """Fail fast, before Spark starts, on anything the operator must fix."""
    if cfg.source is None:
        raise ConfigError("the red job needs a config file (the Spark source reads it): --config")
    check_red_places(cfg)  # before anything is created in a wrong place
    decryption_gpg(cfg)  # keys present, pinned signers imported, passphrase works
    r = cfg.red
    for key in RED_DIR_KEYS:
        _make_red_dir(key, Path(getattr(r, key)))
    if Path(r.inbox).stat().st_dev != Path(r.work_dir).stat().st_dev:
        raise ConfigError(
            f"red.work_dir {r.work_dir} is not on the file system of red.inbox {r.inbox}: files "
            "are taken by an atomic rename; put work_dir beside the inbox"
        )


def _red_places(cfg: Config) -> list[tuple[str, Path]]:
    """``(config key, path)`` of red's directories (``RED_DIR_KEYS``), the inbox first."""
    return [(f"red.{key}", Path(getattr(cfg.red, key))) for key in RED_DIR_KEYS]


def _kept_out_of_inbox(cfg: Config) -> list[tuple[str, Path]]:
    """What else red (or its UDP receiver) keeps on disk, which the intake would take if it
    were in the inbox."""
    r = cfg.red
    out = [("red.gnupg_home", Path(r.gnupg_home))]
    if r.passphrase_file is not None:
        out.append(("red.passphrase_file", Path(r.passphrase_file)))
    if cfg.udp is not None:
        out.append(("udp.receive.spool_dir", Path(cfg.udp.receive.spool_dir)))
    return out


def _within(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or inside it (both resolved)."""
    return inner == outer or outer in inner.parents


def check_red_places(cfg: Config) -> None:
    """ConfigError (nothing is created or moved) if red's directories overlap where that breaks
    red: one inside the inbox (the intake takes every entry of the inbox as a file that crossed
    the diode: a folder there is quarantined as ``not_regular_file``, red's own work with it),
    the inbox inside one of them, two of them the same directory (their files would mix), or
    one inside a directory red manages as a whole (``WALKED_DIR_KEYS``)."""
    places = [(key, p, p.resolve()) for key, p in _red_places(cfg)]
    taken = [rp for _, _, rp in places]
    inbox_key, inbox, inbox_r = places[0]
    for key, p in [(k, p) for k, p, _ in places[1:]] + _kept_out_of_inbox(cfg):
        if _within(p.resolve(), inbox_r):
            where = "is" if p.resolve() == inbox_r else "is inside"
            raise ConfigError(
                f"{key} {p} {where} {inbox_key} {inbox}: red takes every entry of the inbox "
                "as a file that crossed the diode (a folder there is quarantined as "
                f"not_regular_file, with whatever red keeps in it). Set {key} to a path "
                f"outside {inbox_key}, e.g. {_beside(inbox, p, key, taken)}, and move its "
                "contents there"
            )
    for (key_a, a, ra), (key_b, b, rb) in combinations(places, 2):
        if ra == rb:
            raise ConfigError(
                f"{key_a} and {key_b} are the same directory {a}: each red directory needs its "
                "own (their files would mix: red sweeps, counts and locks each one as its own). "
                f"Set {key_b} to a directory of its own, e.g. {_beside(b, b, key_b, taken)}"
            )
    for (ko, o, ro), (ki, n, ri) in permutations(places, 2):  # ki inside ko?
        if ro not in ri.parents:
            continue
        if ki == inbox_key:
            raise ConfigError(
                f"{ki} {n} is inside {ko} {o}: the inbox is where the diode's mover (or `diode "
                f"udp receive`) writes, and {ko} is red's own. Set {ki} to a directory beside "
                f"it, e.g. {_beside(o, n, ki, taken)}, on the same file system"
            )
        if ko.removeprefix("red.") in WALKED_DIR_KEYS:
            raise ConfigError(
                f"{ki} {n} is inside {ko} {o}: red manages {ko} as a whole (work_dir's "
                "plaintexts are swept at start, every file of processed_dir and quarantine_dir "
                f"is counted as evidence). Set {ki} to a directory beside it, e.g. "
                f"{_beside(o, n, ki, taken)}, and move its contents there"
            )


def _beside(outer: Path, inner: Path, key: str, taken: list[Path]) -> Path:
    """A path for ``inner`` next to ``outer`` that overlaps none of red's directories."""
    default = key.rsplit(".", 1)[-1].removesuffix("_dir").removesuffix("_home")
    for name in (inner.name, default, f"red-{default}"):
        cand = outer.parent / name
        rc = cand.resolve()
        if not any(_within(rc, t) or _within(t, rc) for t in taken):
            return cand
    return outer.parent / f"red-{default}-2"


_NO_PROBE_FILE = frozenset({"inbox", "processed_dir", "quarantine_dir"})
"""Red dirs probed without a file appearing in them: the inbox (the mover or ``diode udp
receive`` writes there, and the intake takes every entry) and the evidence dirs (every file in
them is counted). They share work_dir's file system (checked), which gets a real file."""


def red_dir_refusal(key: str, d: Path) -> OSError | None:
    """Red, start-up: why red cannot create, rename and remove files in ``red.<key>`` ``d``,
    or None (``fsutil.write_refusal``: permissions, an immutable or append-only attribute, a
    read-only mount; a real file, created and removed, in red's own dirs)."""
    return write_refusal(d, visible=key not in _NO_PROBE_FILE)


def _make_red_dir(key: str, d: Path) -> None:
    """Red, start-up: create ``red.<key>`` (mode 750) and check that red can create, rename and
    remove files in it (:func:`red_dir_refusal`); a ConfigError naming the key, the path, the
    OS's reason and the fix otherwise, before Spark starts rather than mid-run."""
    try:
        durable_mkdir(d)
    except OSError as e:
        raise ConfigError(
            f"cannot create red.{key} {d}: {e.strerror or e}; create it (mode 750) for the "
            f"user running red, or point red.{key} elsewhere"
        ) from None
    refused = red_dir_refusal(key, d)
    if refused is not None:
        raise ConfigError(_not_writable(key, d, refused))


def _not_writable(key: str, d: Path, e: OSError) -> str:
    """Red, start-up: what to tell when ``red.<key>`` ``d`` refused red's files (``e``, from
    :func:`red_dir_refusal`): the key, the path, the uid, the reason and the fix."""
    if e.errno == errno.EROFS:
        return (
            f"red.{key} {d} is on a read-only file system: red writes there. Mount it "
            f"read-write, or point red.{key} to a writable directory"
        )
    if e.errno == errno.EPERM:
        return (
            f"red.{key} {d} refuses red's files (uid {os.getuid()}; {e.strerror}): red "
            "creates, renames and removes files there, which an immutable or append-only "
            f"attribute refuses even to root (lsattr -d {d}). Clear it (chattr -i -a {d}), or "
            f"point red.{key} elsewhere"
        )
    return (
        f"red.{key} {d} is not writable by the user running red (uid {os.getuid()}; "
        f"{e.strerror or e}): give that user write access (owner, mode 750), or point "
        f"red.{key} elsewhere"
    )


def open_tables(cfg: Config, spark: Any | None = None) -> RedTables:
    engine = resolve_engine(cfg.red.delta_engine, spark)
    return RedTables(Path(cfg.red.tables_dir), engine, spark)


def open_landing(cfg: Config) -> Landing:
    """The landing of ``cfg`` outside a Spark job (operator commands, tests), with an
    interrupted landing finished. Hold the red state lock while using it."""
    r = cfg.red
    landing = Landing(
        cfg, open_tables(cfg), Evidence(Path(r.processed_dir), Path(r.quarantine_dir))
    )
    landing.recover()
    return landing


class RedRun:
    """One red landing job: ``RedRun(cfg).run(spark, trigger)``."""

    def __init__(self, cfg: Config) -> None:
        check_red_config(cfg)
        self.cfg = cfg
        self.summary = RedSummary()
        self.landing: Landing | None = None
        self._error: BaseException | None = None

    def _sink(self, df: Any, batch_id: int) -> None:
        """Judge the batch and journal its landing; the landing is applied in the background
        while Spark verifies the next batch (bridge.red.landing: ``submit``)."""
        assert self.landing is not None
        table = df.toArrow()
        self.summary.batches += 1
        for res in self.landing.submit(table):
            self.summary.totals.add(res)

    def _end(self, query: Any, *, quiet: bool) -> None:
        """Stop the query, wait for the landing in flight and count it: the state lock is never
        released with a landing still being applied, and no micro-batch is landed after this
        (a sink call Spark makes while the query stops is refused: its files stay in intake).
        ``quiet``: another error is already the run's, so a failed landing is logged (it stays
        in the journal) instead of raised."""
        assert self.landing is not None
        try:
            if query.isActive:
                query.stop()
        except Exception as e:  # noqa: BLE001 - the landing state is safe either way
            log_event(log, 30, "stopping the red query failed", error=str(e))
        try:
            for res in self.landing.drain(close=True):
                self.summary.totals.add(res)
        except DiodeError as e:
            if not quiet:
                raise
            log_event(log, 40, "the landing in flight failed too", error=str(e))

    def start_query(self, spark: Any, trigger: Trigger) -> Any:
        spark.dataSource.register(InboxDataSource)
        df = (
            spark.readStream.format("diode_inbox")
            .option("config", str(self.cfg.source))
            .option("parallelism", str(spark.sparkContext.defaultParallelism))
            .load()
        )
        w = (
            df.writeStream.foreachBatch(self._sink)
            .option("checkpointLocation", spark_path(self.cfg.red.checkpoint_dir))
            .queryName("diode_red")
        )
        if trigger == "available-now":
            w = w.trigger(availableNow=True)
        else:
            every = min(POLL_SECONDS, self.cfg.red.trigger_seconds)
            w = w.trigger(processingTime=f"{int(every * 1000)} milliseconds")
        return w.start()

    def run(
        self,
        spark: Any,
        trigger: Trigger = "available-now",
        *,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> RedSummary:
        """Land what arrives. Holds the red state lock: two landers would fork the ledger."""
        state_dir = durable_mkdir(Path(self.cfg.red.state_dir))
        hint = (
            "another red job is landing from this state dir (two landers would fork the "
            "ledger); stop it first"
        )
        with exclusive_lock(state_dir / LOCK_FILE, what="red run", hint=hint):
            return self._run(spark, trigger, timeout, stop)

    def _run(
        self, spark: Any, trigger: Trigger, timeout: float | None, stop: threading.Event | None
    ) -> RedSummary:
        t0 = time.monotonic()
        r = self.cfg.red
        tables = open_tables(self.cfg, spark)
        evidence = Evidence(Path(r.processed_dir), Path(r.quarantine_dir))
        self.landing = Landing(self.cfg, tables, evidence)
        self.summary = RedSummary(recovered=self.landing.recover())
        log_event(log, 20, "red job starting", trigger=trigger, engine=tables.engine,
                  land_seq=self.landing.land_seq)  # fmt: skip
        query = self.start_query(spark, trigger)
        try:
            while True:
                try:
                    done = query.awaitTermination(1.0)
                except Exception:
                    if query.exception() is None:
                        raise
                    break  # the query failed: raised below as a DiodeError, with its cause
                if done:
                    break
                if trigger == "continuous":  # a scheduled run checks silence once, at its end
                    self.summary.totals.add(self.landing.tick())
                if stop is not None and stop.is_set():
                    break
                if timeout is not None and time.monotonic() - t0 >= timeout:
                    break
        except BaseException:  # Ctrl-C, a failed tick: that error is the one to report
            self._end(query, quiet=True)
            raise
        self._end(query, quiet=query.exception() is not None)
        exc = query.exception()
        if exc is not None:
            raise _query_error(exc)
        self.summary.totals.add(self.landing.tick())
        self.summary.seconds = time.monotonic() - t0
        return self.summary


def _query_error(exc: Any) -> DiodeError:
    """The red query's failure as the run's error: a ConfigError (exit 2) when the source
    refused a checkpoint written by another query, else ``red query failed: …``."""
    return config_error_in(exc) or DiodeError(f"red query failed: {exc}")


def run_red(cfg: Config, spark: Any, trigger: Trigger = "available-now", **kw: Any) -> RedSummary:
    return RedRun(cfg).run(spark, trigger, **kw)
