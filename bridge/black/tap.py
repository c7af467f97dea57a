"""Black, tap: drain one channel's mirror queue into its spool; ack only what is durable.

    mirror queue ─deliveries─> [group: N messages or T seconds] ─> spool.sync (fsync)
                                                                   └─> basic.ack multiple
    dead queue ─dead letters (overflow, expiry)─> lost records (their seqs become gaps)

Exactly once into the spool, whatever crashes:

* a delivery is acked only after the spool holds it durably (``SpoolWriter.sync``), so a
  crash before the fsync loses nothing: the broker redelivers it;
* a crash after the fsync but before the broker applied the ack makes the broker redeliver
  messages the spool already holds. Every ack is followed by a round trip on the same AMQP
  channel (``request_sync``) whose answer proves the broker applied it; the spool records the
  last position proven acked in each batch it writes (``acked_through``). At start, the
  records after that position are the only ones that can come back: a redelivered message
  equal to one of them (same exchange, routing key, properties, body) is skipped and counted.
  When several of them are byte-identical, a redelivery may also be a twin the broker had not
  delivered yet (their acks applied): it is kept and marked ``possible-duplicate``, never
  skipped. A twin of a *single* record after that position still cannot be told from its
  redelivery and is skipped (a producer sent the same bytes twice within one group).

The tap pauses when the spool is full (quota or file system): it stops acking, waits for the
proofs of the acks it sent, drops what is not durable and closes its connection, so the
backlog waits in the mirror queue, not in the tap's memory. It reconnects by itself when the
group that did not fit would. Segments are released once black's journal says the
bundles holding them are durably in the outbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bridge.amqp.client import Connection, Delivery
from bridge.black.plan import dead_queue_name, mirror_queue_name
from bridge.black.spool import SpoolWriter, fingerprint
from bridge.black.state import StateStore
from bridge.config import Config
from bridge.errors import (
    AmqpAccessRefused,
    AmqpConnectionError,
    BrokerError,
    ConfigError,
    DiodeError,
    ProtocolError,
    SpoolFull,
    StateError,
)
from bridge.faults import crash_point
from bridge.fsutil import atomic_write_bytes
from bridge.logs import get_logger, log_event
from bridge.protocol.properties import decode_properties, encode_properties

__all__ = ["Tap", "TapStatus", "tap_status", "DELIVERY_COUNT_HEADER"]

log = get_logger("bridge.black.tap")

NON_UTF8_NAME = "non-utf8-name"
"""Why a spooled message is not byte-exact: its exchange or routing key bytes were not UTF-8
(stored with U+FFFD; the row schema keeps names as text)."""
REENCODED = "quorum-reencoded"
"""Why a spooled message is not byte-exact: a quorum queue re-encoded its header table."""
POSSIBLE_DUPLICATE = "possible-duplicate"
"""Why a spooled message may not be exactly once: a redelivery after a crash that equals
several spooled records byte for byte may be one of them (its ack not applied) or a twin the
producer sent (theirs applied). Kept, never skipped: a duplicate, not a silent loss."""
DELIVERY_COUNT_HEADER = "x-delivery-count"
"""Added by quorum queues to every redelivery: stripped so redelivered values stay unchanged."""
RELEASE_EVERY_S = 2.0
STATUS_EVERY_S = 1.0
RETRY_FULL_S = 1.0
MAX_BACKOFF_S = 30.0
PARENT_ENV = "DIODE_TAP_PARENT"
"""Set by the black job to its pid for the taps it starts: a tap stops once it is gone."""
PARENT_CHECK_S = 0.5
PROOF_WAIT_S = 30.0
"""Pausing on a full spool: how long the tap waits for the proofs of the acks it sent."""
SPOOL_LOST = "spool_lost"
MAX_LOST_SPOOL = 10_000_000
IDLE_RECORD_S = 1.0


@dataclass
class TapStatus:
    """What a tap tells ``diode status`` and the job (``state_dir/tap-<channel>.json``); the
    job exports it as metrics (a tap process serves none of its own)."""

    channel: str
    pid: int = 0
    durable_end: int = 0
    acked_through: int = -1
    paused: str | None = None
    idle: bool = False
    spool_bytes: int = 0
    updated: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


def status_path(cfg: Config, channel: str) -> Path:
    return Path(cfg.black.state_dir) / f"tap-{channel}.json"


def tap_status(cfg: Config, channel: str) -> TapStatus | None:
    """The last status the channel's tap wrote, None if it never ran."""
    try:
        d = json.loads(status_path(cfg, channel).read_text())
        return TapStatus(**d)
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _header(props_raw: bytes, name: str) -> Any:
    """Value of top-level header ``name`` (None if absent or undecodable)."""
    try:
        props = decode_properties(props_raw)
    except ProtocolError:
        return None
    for key, (_tag, value) in props.headers or ():
        k = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        if k == name:
            return value
    return None


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return "" if v is None else str(v)


def _utf8(name: str) -> tuple[str, bool]:
    """``name`` as storable text; True if its wire bytes were not UTF-8 (U+FFFD instead)."""
    try:
        name.encode("utf-8")
        return name, False
    except UnicodeEncodeError:  # the client hands non-UTF-8 bytes over as surrogate escapes
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), True


def _text_names(exchange: str, routing_key: str) -> tuple[str, str, bool]:
    ex, a = _utf8(exchange)
    rk, b = _utf8(routing_key)
    return ex, rk, a or b


def _key_text(k: bytes | str) -> str:
    return k.decode("utf-8", "replace") if isinstance(k, bytes) else k


def strip_delivery_count(props_raw: bytes) -> bytes:
    """``props_raw`` without the broker-added ``x-delivery-count`` header (quorum redeliveries)."""
    try:
        props = decode_properties(props_raw)
    except ProtocolError:
        return props_raw
    if not props.headers:
        return props_raw
    kept = tuple((k, v) for k, v in props.headers if _key_text(k) != DELIVERY_COUNT_HEADER)
    if len(kept) == len(props.headers):
        return props_raw
    return encode_properties(dataclasses.replace(props, headers=kept or None))


def order_free(props_raw: bytes) -> bytes:
    """``props_raw`` with header keys sorted: how a quorum queue re-encodes a redelivery's table
    (when it adds x-delivery-count), so a first delivery and its redelivery compare equal."""
    try:
        props = decode_properties(props_raw)
    except ProtocolError:
        return props_raw
    if not props.headers:
        return props_raw
    table = tuple(sorted(props.headers, key=lambda kv: _key_text(kv[0])))
    return encode_properties(dataclasses.replace(props, headers=table))


class Tap:
    """Drains one channel; ``run()`` until ``stop()`` (or, with ``until_empty``, an empty queue)."""

    def __init__(self, cfg: Config, channel: str, *, until_empty: bool = False) -> None:
        self.cfg = cfg
        self.channel = cfg.channel(channel).name
        self.until_empty = until_empty
        self.queue = mirror_queue_name(cfg.black, self.channel)
        self.dead_queue = dead_queue_name(cfg.black, self.channel)
        self.quorum = cfg.black.mirror_queue_type == "quorum"
        self.store = StateStore(Path(cfg.black.state_dir))
        self.status = TapStatus(channel=self.channel)
        self._stop = threading.Event()
        self._candidates: Counter[bytes] = Counter()
        self._ambiguous: set[bytes] = set()
        self._tags: tuple[str, str] = ("", "")
        self._budget: int | None = None  # until_empty: deliveries the backlog held at start
        self._taken = 0

    def stop(self) -> None:
        self._stop.set()

    # -- main loop --------------------------------------------------------------------------
    def run(self) -> TapStatus:
        self.status.pid = os.getpid()
        sp = self.cfg.black.spool
        shipped = self.store.load(self.channel).last_seq
        spool = SpoolWriter.open(
            Path(self.cfg.black.spool_dir),
            self.channel,
            segment_bytes=sp.segment_bytes,
            segment_max_age_s=sp.segment_max_age_seconds,
            max_bytes=sp.max_bytes,
            min_free_bytes=sp.min_free_bytes,
            first_pos=shipped + 1,  # a new spool (or one moved aside) continues after shipped
        )
        try:
            if spool.next_pos <= shipped:
                raise StateError(
                    f"channel {self.channel!r}: the spool in {self.cfg.black.spool_dir} ends at "
                    f"position {spool.next_pos} but black already shipped up to seq {shipped}: "
                    "it was restored from an older backup. Move it aside (the tap then starts a "
                    "new spool after the shipped seq; nothing shipped is lost) — see "
                    "docs/runbook.md, 'spool lost'"
                )
            self._account_lost_spool(spool)
            backoff = 0.5
            while not self._stop.is_set():
                self._load_candidates(spool)
                self._release(spool)
                try:
                    self._drain(spool)
                    break
                except _Paused as e:
                    # the connection is closed: every unacked delivery went back to the queue
                    # (the backlog waits in the broker, not in this process's memory)
                    self._wait_for_room(spool, e.full, e.need)
                    continue
                except AmqpAccessRefused as e:
                    raise ConfigError(str(e)) from None
                except (OSError, BrokerError) as e:
                    if not getattr(e, "retryable", True):
                        raise
                    # every unacked delivery goes back to the queue and comes again marked
                    # redelivered: make what we hold durable, it is recognised from the tail
                    self._sync_after_loss(spool)
                    self._bump("reconnects")
                    log_event(
                        log, 30, f"broker connection lost, reconnecting: {e}",
                        channel=self.channel, retry_in_s=backoff,
                    )  # fmt: skip
                    self._write_status(spool, force=True)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
        finally:
            spool.close()
            self._write_status(spool, force=True)
        return self.status

    def _account_lost_spool(self, spool: SpoolWriter) -> None:
        """A spool that ends before what this tap last made durable was lost or restored from
        an older copy: the positions in between were acked to the broker and are gone. They
        become lost records (reason ``spool_lost``), so red sees a gap, not silence."""
        last = tap_status(self.cfg, self.channel)
        if last is None or last.durable_end <= spool.next_pos:
            return
        n = last.durable_end - spool.next_pos
        if n > MAX_LOST_SPOOL:
            raise StateError(
                f"channel {self.channel!r}: the spool ends at {spool.next_pos} but the tap had "
                f"made {last.durable_end} durable ({n} positions gone): too many to record one "
                "by one. Check the spool directory and tap-*.json; see docs/runbook.md, "
                "'spool lost'"
            )
        log_event(
            log, 50, "spool lost: acked messages that never shipped recorded as a gap",
            channel=self.channel, first_seq=spool.next_pos, last_seq=last.durable_end - 1,
        )  # fmt: skip
        spool.append_lost("", "", SPOOL_LOST, n)
        spool.sync(spool.acked_through)
        self._bump(f"lost_{SPOOL_LOST}", n)

    def _await_proofs(self, conn: Connection, syncs: dict[Any, int], confirmed: int) -> int:
        """Before the tap lets go of its connection: collect the answers proving the acks it
        sent were applied (they queue behind the deliveries already on the wire), so the
        spool can release what they cover. Deliveries read meanwhile are dropped unacked:
        the broker requeues them when the connection closes."""
        deadline = time.monotonic() + PROOF_WAIT_S
        while syncs and time.monotonic() < deadline and not self._stop.is_set():
            for token in conn.poll(0.2).syncs:
                confirmed = max(confirmed, syncs.pop(token, confirmed))
        return confirmed

    def _wait_for_room(self, spool: SpoolWriter, full: SpoolFull, need: int) -> None:
        """Paused on a full spool, disconnected: release shipped segments until the group
        that did not fit (``need`` bytes) would."""
        while not self._stop.is_set():
            self._stop.wait(RETRY_FULL_S)
            self._release(spool)  # black may have shipped meanwhile: room comes back
            self._write_status(spool)
            if spool.room_for(need) is None:
                break
        else:
            return
        log_event(log, 30, "tap resumed: the spool has room again", channel=self.channel,
                  paused_for=str(full)[:200])  # fmt: skip
        self.status.paused = None
        self._write_status(spool, force=True)

    def _sync_after_loss(self, spool: SpoolWriter) -> None:
        if not spool.pending:
            return
        try:
            spool.sync(spool.acked_through)
        except SpoolFull:
            spool.discard_pending()  # never acked: the broker redelivers them

    def _load_candidates(self, spool: SpoolWriter) -> None:
        """Records the broker may redeliver: after the last position proven acked. A content
        that more than one of them share is ambiguous: the broker may have applied the ack of
        some of its records and redeliver a twin the spool does not hold yet."""
        self._candidates.clear()
        self._ambiguous.clear()
        tail = spool.records_after(spool.acked_through)
        if not len(tail):
            return
        d = tail.to_pydict()
        for i in range(len(tail)):
            if d["kind"][i] != 0:
                continue
            props = d["properties_raw"][i]
            if self.quorum:
                props = order_free(props)
            self._candidates[
                fingerprint(d["exchange"][i], d["routing_key"][i], props, d["body"][i])
            ] += 1
        self._ambiguous.update(fp for fp, n in self._candidates.items() if n > 1)
        log_event(
            log, 20, "spooled records a crash may have left unacked: redeliveries of them skipped",
            channel=self.channel, first_pos=spool.acked_through + 1, records=len(tail),
        )  # fmt: skip

    def _drain(self, spool: SpoolWriter) -> None:
        tap = self.cfg.black.tap
        conn = Connection.open(
            self.cfg.black.amqp_url.get_secret_value(), client_name=f"diode-tap-{self.channel}"
        )
        try:
            main = conn.channel()
            main.basic_qos(tap.prefetch)
            dead = conn.channel()
            dead.basic_qos(tap.prefetch)
            if self.until_empty and self._budget is None:
                # a scheduled run drains the backlog it found, not producers that never pause
                self._budget = self._backlog(main)
            self._consume(main, dead)
            self._loop(conn, main, dead, spool)
        finally:
            conn.close()

    def _consume(self, main: Any, dead: Any) -> None:
        self._tags = (main.basic_consume(self.queue), dead.basic_consume(self.dead_queue))

    def _cancel(self, main: Any, dead: Any) -> None:
        """Stop both consumers; deliveries the broker sent before cancel-ok still arrive."""
        main.basic_cancel(self._tags[0])
        dead.basic_cancel(self._tags[1])

    def _loop(self, conn: Connection, main: Any, dead: Any, spool: SpoolWriter) -> None:
        tap = self.cfg.black.tap
        c = self.status.counters
        last_main = last_dead = 0  # highest delivery tag received, per AMQP channel
        acked_main = acked_dead = 0
        syncs: dict[Any, int] = {}  # sync token -> position proven acked once it completes
        confirmed = spool.acked_through
        first_unsynced: float | None = None
        next_release = time.monotonic() + RELEASE_EVERY_S
        quiet_since = time.monotonic()
        cancelled = False  # until_empty: consumers stopped to see the queues settle
        while not self._stop.is_set():
            now = time.monotonic()
            wait = (
                tap.group_seconds
                if first_unsynced is None
                else max(0.0, first_unsynced + tap.group_seconds - now)
            )
            events = conn.poll(min(wait, 0.5))
            self._taken += len(events.deliveries)
            for d in events.deliveries:
                if d.channel == main.number:
                    last_main = d.delivery_tag
                    c["delivered"] = c.get("delivered", 0) + 1
                    self._take(spool, d)
                elif d.channel == dead.number:
                    last_dead = d.delivery_tag
                    self._take_dead(spool, d)
            for token in events.syncs:
                confirmed = max(confirmed, syncs.pop(token, confirmed))
            for cancel in events.cancels:  # queue deleted, or a node went down: consume afresh
                raise AmqpConnectionError(
                    f"the broker cancelled consumer {cancel.consumer_tag!r} of channel "
                    f"{self.channel!r} (its mirror queue was deleted or moved): reconnecting"
                )
            now = time.monotonic()
            if events.deliveries:
                quiet_since = now
                if first_unsynced is None:
                    first_unsynced = now
            unacked = last_main > acked_main or last_dead > acked_dead
            due = (
                spool.pending >= tap.group_messages
                or spool.pending_bytes >= tap.group_bytes
                or (first_unsynced is not None and now - first_unsynced >= tap.group_seconds)
            )
            if unacked and due:
                try:
                    durable = spool.sync(confirmed) if spool.pending else spool.durable_end
                except SpoolFull as e:
                    log_event(log, 40, f"tap paused: {e}", channel=self.channel)  # the loop ends
                    self.status.paused = str(e)
                    self._write_status(spool, force=True)
                    if self.until_empty:
                        # a scheduled run: nothing will be shipped until the taps end, so stop
                        # here; what is not durable was never acked and stays in the broker
                        spool.discard_pending()
                        log_event(
                            log, 30, "spool full: this run seals what the spool holds; the rest "
                            "waits in the broker for the next run", channel=self.channel,
                        )  # fmt: skip
                        return
                    # hand what is not durable back to the broker and wait for room without
                    # holding a prefetch window of messages here (up to prefetch x their size)
                    need = spool.pending_bytes
                    spool.discard_pending()
                    confirmed = self._await_proofs(conn, syncs, confirmed)
                    if confirmed > spool.acked_through:
                        with contextlib.suppress(SpoolFull, OSError):  # a full disk: next time
                            spool.sync(confirmed)  # no records: what it frees is releasable
                    raise _Paused(e, need) from None
                crash_point("tap.after_sync")
                if last_main > acked_main:
                    main.ack(last_main, multiple=True)
                    acked_main = last_main
                    syncs[main.request_sync()] = durable - 1
                if last_dead > acked_dead:
                    dead.ack(last_dead, multiple=True)
                    acked_dead = last_dead
                    syncs[dead.request_sync()] = durable - 1
                crash_point("tap.after_ack")
                first_unsynced = None
            if (
                not unacked
                and spool.pending == 0
                and confirmed > spool.acked_through
                and now - quiet_since >= IDLE_RECORD_S
            ):
                spool.sync(confirmed)  # quiet: record what the broker confirmed (tiny batch)
            if now >= next_release:
                self._release(spool)
                next_release = now + RELEASE_EVERY_S
            self._write_status(spool)
            if (
                self.until_empty
                and not unacked
                and spool.pending == 0
                and not syncs
                and self._budget is not None
                and self._taken >= self._budget
                and self._budget > 0
            ):
                break  # the backlog found at start is durable; newer traffic waits for next run
            if (
                self.until_empty
                and not unacked
                and spool.pending == 0
                and not syncs
                and now - quiet_since >= 0.2
            ):
                # Empty means: nothing ready, no other consumer (a dead tap's unacked messages
                # are requeued asynchronously by quorum queues) and nothing still on its way to
                # us — so stop consuming, take what the broker had sent before cancel-ok, and
                # only then trust the ready counts.
                if not cancelled:
                    if self._queues_empty(main):
                        self._cancel(main, dead)
                        cancelled = True
                elif not events.deliveries:
                    if self._queues_empty(main):
                        break
                    self._consume(main, dead)  # more came: go on draining
                    cancelled = False
        if confirmed > spool.acked_through and not spool.pending:
            spool.sync(confirmed)  # record the last proven ack: the next run releases more
        self.status.idle = True

    def _backlog(self, chan: Any, settle_s: float = 30.0) -> int:
        """Messages waiting in both queues, once no other consumer holds any: the unacked
        deliveries of a tap that died are requeued when the broker drops its consumer."""
        deadline = time.monotonic() + settle_s
        while True:
            infos = [chan.queue_declare(q, passive=True) for q in (self.queue, self.dead_queue)]
            if all(i.consumer_count == 0 for i in infos) or time.monotonic() >= deadline:
                return sum(i.message_count for i in infos)
            self._stop.wait(0.1)

    def _queues_empty(self, chan: Any) -> bool:
        """Nothing ready in either queue, and no other consumer: a consumer that died (an
        earlier tap) holds unacked messages until the broker has requeued them — a quorum
        queue does that asynchronously, so its ready count alone can read 0 too early."""
        for q in (self.queue, self.dead_queue):
            info = chan.queue_declare(q, passive=True)
            if info.message_count or info.consumer_count > 1:
                return False
        return True

    # -- deliveries -------------------------------------------------------------------------
    def _take(self, spool: SpoolWriter, d: Delivery) -> None:
        props = d.properties_raw
        note = None
        if d.redelivered:
            if self.quorum:
                stripped = strip_delivery_count(props)
                if stripped != props:
                    # the broker re-encoded the header table (keys sorted) to add its count:
                    # the values are exact, their order may not be. Counted, never silent.
                    props, note = stripped, REENCODED
            if self._candidates:
                key = order_free(props) if self.quorum else props
                fp = fingerprint(d.exchange, d.routing_key, key, d.body)
                if self._candidates[fp] > 0:
                    self._candidates[fp] -= 1
                    if fp not in self._ambiguous:
                        self._bump("redelivered_skipped")
                        return
                    # byte-identical messages: this may be a twin, not the spooled one. Kept
                    # (never lost) and marked: red sees it may duplicate an earlier seq
                    note = POSSIBLE_DUPLICATE
        exchange, rk = d.exchange, d.routing_key
        if not (exchange.isascii() and rk.isascii()):
            exchange, rk, renamed = _text_names(exchange, rk)
            if renamed and note != POSSIBLE_DUPLICATE:  # one reason a row: the weightier
                note = NON_UTF8_NAME
        spool.append_one(exchange, rk, d.redelivered, props, d.body, note)
        if note is not None:
            self._bump(f"inexact_{note}")

    def _take_dead(self, spool: SpoolWriter, d: Delivery) -> None:
        reason = _text(_header(d.properties_raw, "x-first-death-reason")) or "dead-lettered"
        exchange = _text(_header(d.properties_raw, "x-first-death-exchange"))
        exchange, rk, _ = _text_names(exchange, d.routing_key)
        spool.append_lost(exchange, rk, reason)
        self._bump(f"lost_{reason}")
        log_event(
            log, 40, "the broker dropped a message from the mirror queue: recorded as a gap",
            channel=self.channel, reason=reason, exchange=exchange, pos=spool.next_pos - 1,
        )  # fmt: skip

    def _bump(self, name: str, n: int = 1) -> None:
        self.status.counters[name] = self.status.counters.get(name, 0) + n

    # -- housekeeping -----------------------------------------------------------------------
    def _release(self, spool: SpoolWriter) -> None:
        shipped = self.store.load(self.channel).last_seq
        if shipped >= 0:
            freed = spool.release_through(shipped)
            if freed:
                log_event(
                    log, 10, "spool segments released", channel=self.channel,
                    through_pos=shipped, bytes=freed,
                )  # fmt: skip

    def _write_status(self, spool: SpoolWriter, *, force: bool = False) -> None:
        now = time.time()
        if not force and now - self.status.updated < STATUS_EVERY_S:
            return
        self.status.durable_end = spool.durable_end
        self.status.acked_through = spool.acked_through
        self.status.updated = now
        self.status.spool_bytes = spool.used_bytes()
        atomic_write_bytes(
            status_path(self.cfg, self.channel), json.dumps(asdict(self.status)).encode()
        )


class _Paused(Exception):
    """The spool is full: the tap drops its connection and waits for room."""

    def __init__(self, full: SpoolFull, need: int) -> None:
        super().__init__(str(full))
        self.full = full
        self.need = need


def _watch_parent(tap: Tap, parent: int) -> None:
    """Stop ``tap`` (gracefully: what it holds is synced, the rest redelivered) once the black
    job that started it is gone, killed or not: a tap left running would hold the spool lock
    against the job's next taps, on the old configuration."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    log_event(log, 30, "the black job that started this tap is gone: stopping",
              channel=tap.channel, parent_pid=parent)  # fmt: skip
    tap.stop()


def run_tap(cfg: Config, channel: str, *, until_empty: bool = False) -> TapStatus:
    """Run a tap in this process until SIGTERM / SIGINT (or an empty queue with until_empty)."""
    tap = Tap(cfg, channel, until_empty=until_empty)

    def _stop(_sig: int, _frame: Any) -> None:
        tap.stop()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _stop)
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        threading.Thread(target=_watch_parent, args=(tap, int(parent)), daemon=True).start()
    try:
        return tap.run()
    except DiodeError as e:
        log_event(log, 50, f"tap stopped: {e}", channel=channel)
        raise
