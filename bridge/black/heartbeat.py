"""Black, heartbeat: a signed sequence manifest per channel every N seconds, even when idle.

Red uses it to notice a missing *last* bundle (the heartbeat names the last bundle seq
shipped) and a dead link (heartbeats stop). Heartbeats are protected like the channel's
bundles (signed, and encrypted unless the channel opted out) and dropped into the same
outbox under ``<channel>.<heartbeat seq>.dheartbeat``; they are not archived.

Heartbeat seqs count up in ``state_dir/heartbeat-<channel>.json``. Without a readable one (a
new install, a lost or damaged file) they start from the time in tenths of a second, above
any seq red can have heard (seqs may skip, protocol §9); a new seq never names a heartbeat
of the channel still in the outbox, nor falls below one.

The hourly pruning of the archive a continuous job does runs in a thread of its own (pruning a
very large archive must not hold up heartbeats), and never deletes a bundle a channel's
journal holds as pending (:func:`prune_unless_pending`).

Between the runs of a scheduled job, ``diode black heartbeat`` (:mod:`bridge.black.beat_cmd`)
writes the same heartbeats with this writer, one channel at a time under black's run lock.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bridge.black.state import StateStore
from bridge.black.tap import status_path
from bridge.config import ChannelConfig, Config
from bridge.crypto.gpg import Gpg
from bridge.diode.file_drop import Outbox
from bridge.errors import BundleNameError, ManifestError, StateError
from bridge.fsutil import atomic_write_bytes
from bridge.logs import get_logger, log_event
from bridge.metrics import BLACK
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import Manifest
from bridge.protocol.naming import bundle_name, heartbeat_name, parse_heartbeat_name

__all__ = [
    "ArchivePruneLoop",
    "BEAT_SEAL_SECONDS",
    "HeartbeatLoop",
    "HeartbeatWriter",
    "JOB_LOCK_WAIT_SECONDS",
    "heartbeat_seq_path",
    "pending_bundle_names",
    "prune_logged",
    "prune_unless_pending",
    "read_heartbeat_seq",
    "run_every",
]

log = get_logger("bridge.black.heartbeat")
PRUNE_EVERY_SECONDS = 3600.0
BEAT_SEAL_SECONDS = 20.0
"""``diode black heartbeat`` kills a gpg call sealing a heartbeat (a few hundred bytes: it
takes milliseconds) after this long: the longest it holds black's run lock for one beat."""
JOB_LOCK_WAIT_SECONDS = 2 * BEAT_SEAL_SECONDS
"""How long a starting black job waits for black's run lock (``state_dir/black.lock``): long
enough for a ``diode black heartbeat`` beat holding it to end, short enough that a second
job is refused soon."""


def heartbeat_seq_path(state_dir: Path, channel: str) -> Path:
    """``state_dir/heartbeat-<channel>.json``: the last heartbeat seq written for a channel."""
    return Path(state_dir) / f"heartbeat-{channel}.json"


def read_heartbeat_seq(state_dir: Path, channel: str) -> int | None:
    """The last heartbeat seq written for ``channel``; None if its file is missing. StateError
    naming the file if it cannot be read or holds no seq (nothing is coerced)."""
    p = heartbeat_seq_path(state_dir, channel)
    try:
        doc = json.loads(p.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StateError(f"heartbeat seq file {p} is unreadable ({e})") from None
    seq = doc.get("heartbeat_seq") if isinstance(doc, dict) else None
    if type(seq) is not int or seq < 0:
        raise StateError(
            f"heartbeat seq file {p} is unreadable (no integer heartbeat_seq >= 0 in it)"
        )
    return seq


def _heartbeat_seq_of(name: str, channel: str) -> int | None:
    """The heartbeat seq of ``name`` if it is a heartbeat of ``channel`` (else None)."""
    try:
        h = parse_heartbeat_name(name)
    except BundleNameError:
        return None
    return h.heartbeat_seq if h.channel == channel else None


def pending_bundle_names(store: StateStore) -> set[str]:
    """File names of the bundles the journals in ``store`` hold as pending (every journal of
    the state dir, also of channels no longer configured). StateError if one is unreadable:
    then nothing may be pruned."""
    names: set[str] = set()
    for channel in store.channels():
        st = store.load(channel)
        if st.pending is None:
            continue
        try:
            m = Manifest.from_json(str(st.pending["manifest"]).encode())
            names.add(bundle_name(m.channel, m.bundle_seq, m.bundle_id))
        except (KeyError, TypeError, ManifestError) as e:
            raise StateError(
                f"black state {store.path(channel)}: its pending bundle is unreadable ({e}); "
                "the archive is not pruned until it is restored from backup"
            ) from None
    return names


def prune_unless_pending(outbox: Outbox, store: StateStore, *, now: float | None = None) -> int:
    """Prune the archive to its retention, keeping every bundle a journal holds as pending.

    No channel lock is needed: the journal is read as last committed (it is replaced
    atomically), a bundle journaled as pending after that read was archived moments ago, and
    the retention is at least an hour (``black.archive_retention_days``), so it is not old
    enough to go. Returns how many bundles were deleted.
    """
    return outbox.prune_archive(now=now, keep=pending_bundle_names(store))


def prune_logged(outbox: Outbox, store: StateStore) -> int:
    """:func:`prune_unless_pending`; a failure (a folder black may not change, an unreadable
    journal) is logged and retried at the next prune, never raised: pruning is housekeeping,
    and what the run shipped is shipped. Returns how many bundles were deleted."""
    try:
        removed = prune_unless_pending(outbox, store)
    except (OSError, StateError) as e:
        log_event(log, 40, f"archive pruning failed (tried again at the next prune): {e}")
        return 0
    if removed:
        log_event(log, 20, "archive pruned", removed=removed)
    return removed


class HeartbeatWriter:
    """Writes one heartbeat file for a channel.

    ``interval``: the period the heartbeats declare (``interval_seconds``; default
    ``black.heartbeat_seconds``), the one they are written at.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        store: StateStore,
        gpg: Gpg,
        outbox: Outbox,
        interval: float | None = None,
    ) -> None:
        self.cfg, self.store, self.gpg, self.outbox = cfg, store, gpg, outbox
        self.interval = float(cfg.black.heartbeat_seconds if interval is None else interval)
        self._lock = threading.Lock()

    def _seq_path(self, channel: str) -> Path:
        return heartbeat_seq_path(self.store.dir, channel)

    def last_seq(self, channel: str) -> int:
        """The last heartbeat seq written for ``channel`` (0: none yet); StateError if its
        file is unreadable."""
        return read_heartbeat_seq(self.store.dir, channel) or 0

    def _ran_before(self, channel: str, last_bundle_seq: int) -> bool:
        """Whether black's state shows ``channel`` ran here before (a journal, a tap status
        file, a shipped bundle): then a missing seq file was lost, not never written."""
        return (
            last_bundle_seq > 0
            or self.store.path(channel).exists()
            or status_path(self.cfg, channel).exists()
        )

    def _next_seq(self, channel: str, last_bundle_seq: int) -> tuple[int, int | None]:
        """(the next heartbeat seq, the saved one it follows: None when its file is missing
        or unreadable).

        Without a readable file (a new install, a lost file, a backup restored without it, a
        damaged file) red may have heard seqs far above 1 — also on an idle channel, which
        ships heartbeats only — and would take every new heartbeat as replayed: seqs start
        from the time in tenths of a second, above any seq a period of 0.1 s or more can have
        reached (heartbeat seqs may skip, protocol §9); a warning says so unless this is a new
        channel. The seq is also above every heartbeat of the channel still in the outbox."""
        try:
            last, why = read_heartbeat_seq(self.store.dir, channel), ""
        except StateError as e:
            last, why = None, str(e)
        if last is not None:
            return self._above_outbox(channel, last + 1, scan=False), last
        seq = self._above_outbox(channel, int(time.time() * 10), scan=True)
        if why or self._ran_before(channel, last_bundle_seq):
            log_event(log, 30, "heartbeat seq file missing or unreadable while black ran "
                      "before: heartbeat seqs continue from the time (tenths of a second) so "
                      f"red takes them as new{f' ({why})' if why else ''}",
                      channel=channel, path=str(self._seq_path(channel)), heartbeat_seq=seq,
                      last_bundle_seq=last_bundle_seq)  # fmt: skip
        return seq, None

    def _above_outbox(self, channel: str, seq: int, *, scan: bool) -> int:
        """``seq``, or one above the channel's highest heartbeat still in its outbox when that
        is not below ``seq`` (a name is never written over, and red never gets a lower seq
        after a higher one). The outbox is listed with ``scan``, or when ``seq``'s name is
        taken (a seq file restored from an older backup, a clock stepped back)."""
        folder = self.outbox.dir_for(channel)
        if not scan and not (folder / heartbeat_name(channel, seq)).exists():
            return seq
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return seq
        return max([seq, *(s + 1 for n in names if (s := _heartbeat_seq_of(n, channel)))])

    def _save_seq(self, channel: str, seq: int) -> None:
        atomic_write_bytes(self._seq_path(channel), json.dumps({"heartbeat_seq": seq}).encode())

    def _give_back(self, channel: str, last: int | None) -> None:
        """Put the seq file back as it was before a heartbeat that never reached the outbox
        (none, or damaged: gone, so the next heartbeat starts from the time again)."""
        if last is None:
            self._seq_path(channel).unlink(missing_ok=True)
        else:
            self._save_seq(channel, last)

    def beat(self, channel: ChannelConfig) -> str:
        """Write the next heartbeat of ``channel``; its seq is given back if writing fails.

        (A kill -9 or a failed rename after saving the seq can still skip one heartbeat seq:
        never a reused one.) It never waits for the sealer: the journal is read as last
        committed (it is replaced atomically), and the heartbeat seq lives in its own file, so
        heartbeats keep their period while a channel seals a large batch.
        """
        with self._lock:
            st = self.store.load(channel.name)
            seq, last = self._next_seq(channel.name, st.last_bundle_seq)
            hb = Heartbeat(
                format=1,
                channel=channel.name,
                bridge_id=self.cfg.link.bridge_id,
                heartbeat_seq=seq,
                last_bundle_seq=st.last_bundle_seq or None,
                last_seq=st.last_seq if st.last_seq >= 0 else None,
                black_time=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                interval_seconds=self.interval,
                counters=dict(st.counters),
            )
            self._save_seq(channel.name, seq)
            name = heartbeat_name(channel.name, hb.heartbeat_seq)
            try:
                data = self.gpg.seal_bytes(
                    hb.to_json(),
                    signer=self.cfg.black.signing_key,
                    recipients=channel.recipients,
                    encrypt=channel.encrypt,
                    hide_recipients=self.cfg.black.bundle.hide_recipients,
                )
                staged = self.outbox.stage_bytes(name, data)  # in the staging dir, fsynced
            except BaseException:  # nothing reached the outbox: the seq is given back
                self._give_back(channel.name, last)
                raise
            # from the rename on, the seq is never given back (the mover may take the file at
            # once, so its absence proves nothing); a failed rename only skips a seq
            self.outbox.publish(staged, name, channel=channel.name)
        BLACK.heartbeats_sent.labels(channel.name).inc()
        log_event(
            log,
            10,
            "heartbeat",
            channel=channel.name,
            heartbeat_seq=hb.heartbeat_seq,
            last_bundle_seq=hb.last_bundle_seq,
        )
        return name

    def beat_logged(self, channel: ChannelConfig) -> str | Exception:
        """:meth:`beat`; a failure is logged and returned, never raised (never fatal)."""
        try:
            return self.beat(channel)
        except Exception as e:  # noqa: BLE001 - a failed heartbeat is logged, never fatal
            log_event(log, 40, f"heartbeat failed: {e}", channel=channel.name)
            return e

    def beat_all(self) -> None:
        for ch in self.cfg.channels:
            self.beat_logged(ch)


def run_every(interval: float, stop: threading.Event, work: Callable[[], object]) -> None:
    """``work()`` now, then every ``interval`` seconds until ``stop`` is set: a fixed cadence
    (the time ``work`` takes is not added to it)."""
    due = time.monotonic()
    while not stop.is_set():
        work()
        due += interval
        stop.wait(max(0.0, due - time.monotonic()))


class ArchivePruneLoop(threading.Thread):
    """Daemon thread: :func:`prune_unless_pending` every ``interval`` seconds (the first one an
    interval after the start) until stopped. A thread of its own: a prune of a very large
    archive never holds up heartbeats."""

    def __init__(self, outbox: Outbox, store: StateStore, interval: float | None = None) -> None:
        super().__init__(name="diode-archive-prune", daemon=True)
        self.outbox, self.store = outbox, store
        self.interval = PRUNE_EVERY_SECONDS if interval is None else interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            prune_logged(self.outbox, self.store)  # the archive kept within its retention

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


class HeartbeatLoop(threading.Thread):
    """Daemon thread: ``beat_all`` every ``heartbeat_seconds`` until stopped; with an
    ``outbox``, an :class:`ArchivePruneLoop` beside it (on the writer's journal) prunes the
    archive every hour."""

    def __init__(
        self, writer: HeartbeatWriter, interval: float, outbox: Outbox | None = None
    ) -> None:
        super().__init__(name="diode-heartbeat", daemon=True)
        self.writer, self.interval, self.outbox = writer, interval, outbox
        self.pruner = ArchivePruneLoop(outbox, writer.store) if outbox is not None else None
        self._stop_event = threading.Event()

    def start(self) -> None:
        super().start()
        if self.pruner is not None:
            self.pruner.start()

    def run(self) -> None:
        run_every(self.interval, self._stop_event, self.writer.beat_all)

    def stop(self) -> None:
        self._stop_event.set()
        if self.pruner is not None and self.pruner.is_alive():
            self.pruner.stop()
        self.join(timeout=30)
