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
* dead letters are handled the same way: their lost record keeps the dead letter's fingerprint,
  and ``acked_through`` counts only once the acks on *both* AMQP channels (mirror queue, dead
  queue) are proven; a redelivered dead letter equal to a lost record after it is skipped,
  so a loss is recorded once (``dead_redelivered_skipped``).
* after a restart or reconnect, a channel that may still redeliver such records proves
  nothing until it has *caught up*: every record it could redeliver came back, or it
  delivered a message that is none of them while no other consumer held its queue (the
  broker redelivers returned messages first), or its queue was empty with no consumer. The
  two channels' deliveries are not ordered with each other: the other channel's traffic
  proves nothing for it (``AckProofs``). A channel still behind is looked at again every
  ``RECHECK_S`` (``Tap._recheck``), so neither another consumer that has gone since the tap
  connected nor a queue whose records will never come back (the broker applied their acks
  before the crash) and that gets no new message — typically the dead queue — holds
  ``acked_through`` until the spool is full.

A delivery from an exchange the channel denies (one bound into a mirrored exchange, or the
default exchange) is dropped: never spooled, not even as a dead letter's lost record, acked
with its group once what precedes it is durable, counted ``denied`` and logged.

The tap pauses when the spool is full (quota or file system): it stops acking, waits for the
proofs of the acks it sent, drops what is not durable and closes its connection, so the
backlog waits in the mirror queue, not in the tap's memory. It reconnects by itself when the
group that did not fit would. Segments are released once black's journal says the
bundles holding them are durably in the outbox; one that cannot be deleted is logged and
counted (``release_refused``) and the tap goes on: its spool then fills up to the pause. While
it waits it retries what a full disk may have refused (recording ``acked_through``, closing
the current segment). Records after ``acked_through`` are never released; if they are what
keeps the spool full (acks whose proof never came: a crash or a broker that went quiet), the
paused tap *settles* them: it proves the broker holds none of them, as a channel that caught
up does, before it lets go of its connection — or, failing that, every ``PROOF_RETRY_S`` on a
short connection of its own. That one takes as few messages as it can (a quorum queue counts
every message handed back toward its delivery limit): none from a queue that owes nothing or
has another consumer, else one at a time until the first that is not such a redelivery, the
only one it hands back.

Crash points (bridge.faults): ``tap.after_sync`` (a group durable, nothing acked),
``tap.before_dead_ack`` (durable, the mirror queue's ack sent, the dead queue's not) and
``tap.after_ack`` (both acks sent, not yet proven).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bridge.amqp.client import Channel, Connection, Delivery
from bridge.black.broker import check_amqp_url
from bridge.black.plan import dead_queue_name, denied, mirror_queue_name
from bridge.black.spool import DEAD_LETTER_BYTES, SpoolWriter, fingerprint, writer_settings
from bridge.black.state import StateStore
from bridge.black.tap_delivery import (
    DELIVERY_COUNT_HEADER,
    as_text,
    death_of,
    field_of,
    headers_of,
    order_free,
    reordered,
    strip_delivery_count,
    text_names,
)
from bridge.black.tap_proofs import AckProofs
from bridge.config import Config, load_config
from bridge.errors import (
    AmqpAccessRefused,
    AmqpConnectionError,
    BrokerError,
    ConfigError,
    DiodeError,
    SpoolFull,
    StateError,
)
from bridge.faults import crash_point, slow_point
from bridge.fsutil import atomic_write_bytes, os_error_text
from bridge.logs import Recurring, get_logger, log_event

__all__ = ["Tap", "TapStatus", "tap_status", "read_tap_status", "DELIVERY_COUNT_HEADER"]

log = get_logger("bridge.black.tap")

NON_UTF8_NAME = "non-utf8-name"
"""Why a spooled message is not byte-exact: its exchange or routing key bytes were not UTF-8
(stored with U+FFFD; the row schema keeps names as text)."""
REENCODED = "quorum-reencoded"
"""Why a spooled message may not be byte-exact: a quorum queue re-encoded the header table of
a redelivery, sorting its keys (marked only when it had two keys or more: ``reordered``)."""
DENIED = "denied"
"""Counter of deliveries from an exchange the channel denies (one bound into a mirrored
exchange): acked once the group around them is durable, never spooled."""
DENIAL_CACHE = 10_000
"""How many exchange names the tap remembers the denial of (the cache is cleared when full)."""
DENIED_LOG_S = 60.0
"""How often at most the tap logs the denied deliveries it dropped (per channel, by exchange)."""
POSSIBLE_DUPLICATE = "possible-duplicate"
"""Why a spooled message may not be exactly once: a redelivery after a crash that equals
several spooled records byte for byte may be one of them (its ack not applied) or a twin the
producer sent (theirs applied). Kept, never skipped: a duplicate, not a silent loss."""
RELEASE_REFUSED = "release_refused"
"""Counter of the tap's tries to delete shipped spool segments that were refused (``_release``):
it grows while the spool cannot shrink."""
RELEASE_EVERY_S = 2.0
STATUS_EVERY_S = 1.0
RETRY_FULL_S = 1.0
MAX_BACKOFF_S = 30.0
PARENT_ENV = "DIODE_TAP_PARENT"
"""Set by the black job to its pid for the taps it starts: a tap stops once it is gone."""
REASON_FD_ENV = "DIODE_TAP_REASON_FD"
"""Set by the black job to a pipe's write end for the taps it starts: a tap that stops on an
error writes why there, so that the job's own error carries it (``report_reason``)."""
STATUS_LOG_S = 60.0
"""How often at most the tap warns that its status file cannot be written."""
PARENT_CHECK_S = 0.5
PROOF_WAIT_S = 30.0
"""Pausing on a full spool: how long the tap waits for the proofs of the acks it sent."""
PROOF_RETRY_S = 30.0
"""Paused, with acks never proven holding records the spool cannot release: how often the tap
reconnects to settle them."""
SETTLE_QUIET_S = 0.3
"""Settling: consumers cancelled, how long no delivery must arrive before the tap looks at the
queues."""
RECHECK_S = 5.0
"""Running, with an AMQP channel still behind (``AckProofs``): how often the tap looks again
whether its queue can still redeliver (``Tap._recheck``)."""
DRAINED_HOLD_S = 70.0
"""How long a queue must stay empty with no consumer, read at every recheck, before nothing
can come back from it: twice the AMQP heartbeat (30 s) and a margin. A connection the broker
has not found dead yet may hold messages no count shows (a consumer it cancelled)."""
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


_UNREADABLE: dict[Path, Recurring] = {}
"""Tap status files found unreadable (``tap_status``), each warned of once a minute."""


def status_path(cfg: Config, channel: str) -> Path:
    return Path(cfg.black.state_dir) / f"tap-{channel}.json"


def read_tap_status(cfg: Config, channel: str) -> TapStatus | None:
    """The last status the channel's tap wrote, None if it never ran; StateError naming the
    file when it is there but damaged or cannot be read (a directory, another owner, EIO)."""
    p = status_path(cfg, channel)
    try:
        return TapStatus(**json.loads(p.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise StateError(f"tap status file {p}: {e}") from None
    except OSError as e:
        raise StateError(
            f"tap status file {p} cannot be read ({os_error_text(e)}): make it "
            "a file the user running black can read and write, or remove it (the tap writes "
            "it anew)"
        ) from None


def tap_status(cfg: Config, channel: str) -> TapStatus | None:
    """The last status the channel's tap wrote, None if it never ran, or if its file is
    damaged or unreadable: for what only informs (metrics, reports), so that is logged (once a
    minute while it lasts) and the caller goes on without it. The tap's own check for a lost
    spool reads it strictly (:func:`read_tap_status`)."""
    p = status_path(cfg, channel)
    try:
        st = read_tap_status(cfg, channel)
    except StateError as e:
        if _UNREADABLE.setdefault(p, Recurring()).due(str(e)):
            log_event(
                log, 30, f"{e}. Until then its channel's tap metrics are not exported, and its "
                "tap does not start (it cannot tell whether its spool was lost)",
                channel=channel,
            )  # fmt: skip
        return None
    if _UNREADABLE.pop(p, None) is not None:
        log_event(log, 20, "tap status file readable again", channel=channel, path=str(p))
    return st


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
        self._dead_candidates: Counter[bytes] = Counter()
        self._dead_ambiguous: set[bytes] = set()
        self._tags: tuple[str, str] = ("", "")
        self._consuming = False
        self._budget: int | None = None  # until_empty: deliveries the backlog held at start
        self._taken = 0
        # counted once what they count is durable (records) or acked (skips); a group a full
        # spool hands back is counted as ``handed_back`` instead, and again when it returns
        self._group_records: Counter[str] = Counter()
        self._group_skips: Counter[str] = Counter()
        self._skip_tags: list[tuple[int, int]] = []  # (AMQP channel, tag) skipped, not acked
        self._group_denied: Counter[str] = Counter()  # exchange -> denied deliveries, unacked
        self._denied_unlogged: Counter[str] = Counter()  # acked, not logged yet
        self._denied_logged_at: float | None = None
        self._denial: dict[str, bool] = {}  # exchange name -> whether the channel denies it
        # settling acks never proven (see the module doc), per connection:
        self._alone: set[int] = set()  # AMQP channels whose consumer is its queue's only one
        self._fresh: set[int] = set()  # AMQP channels that delivered a message not spooled yet
        self._drained: set[int] = set()  # AMQP channels whose queue was seen unable to redeliver
        self._empty_since: dict[int, float] = {}  # AMQP channel -> first of its empty readings
        self._unsettled = False  # a delivery while paused may be a redelivery: settle nothing
        self._status_refused = Recurring()  # the status file refused (warned once a minute)
        self._release_refused = Recurring()  # a shipped segment could not be deleted

    def stop(self) -> None:
        self._stop.set()

    # -- main loop --------------------------------------------------------------------------
    def run(self) -> TapStatus:
        self.status.pid = os.getpid()
        shipped = self.store.load(self.channel).last_seq
        spool = SpoolWriter.open(
            Path(self.cfg.black.spool_dir),
            self.channel,
            **writer_settings(self.cfg.black.spool),
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
                    self._wait_for_room(spool, e.full, e.need, e.confirmed)
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
            self._log_denied(force=True)
            self._write_status(spool, force=True)
        return self.status

    def _account_lost_spool(self, spool: SpoolWriter) -> None:
        """A spool that ends before what this tap last made durable was lost or restored from
        an older copy: the positions in between were acked to the broker and are gone. They
        become lost records (reason ``spool_lost``), so red sees a gap, not silence. A status
        file that cannot be read tells nothing: the tap refuses to start (a guess either way
        could hide a loss), naming the file and the fix."""
        try:
            last = read_tap_status(self.cfg, self.channel)
        except StateError as e:
            raise ConfigError(
                f"channel {self.channel!r}: {e}. The tap reads it at start to tell whether its "
                "spool was lost (acked messages that never shipped must be recorded as a gap), "
                "and does not start without it. If the spool was neither lost nor restored from "
                "a backup, remove the file and start black again; otherwise see "
                "docs/runbook.md §7.1 ('spool lost') first"
            ) from None
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

    def _await_proofs(
        self, conn: Connection, chans: tuple[Channel, Channel], proofs: AckProofs
    ) -> None:
        """Before the tap lets go of its connection: collect the answers proving the acks it
        sent were applied (they queue behind the deliveries already on the wire), so the
        spool can release what they cover. Deliveries read meanwhile are not taken (the
        broker requeues them when the connection closes); a redelivery of a spooled record
        among them is acked."""
        deadline = time.monotonic() + PROOF_WAIT_S
        while proofs.owed and time.monotonic() < deadline and not self._stop.is_set():
            events = conn.poll(0.2)
            for d in events.deliveries:
                self._while_paused(d, chans, proofs)
            for token in events.syncs:
                proofs.answered(token)

    def _while_paused(self, d: Delivery, chans: tuple[Channel, Channel], proofs: AckProofs) -> None:
        """A delivery that arrives while the tap pauses: a redelivery of a spooled record is
        acked (it is durable; its proof is asked for), anything else is handed back."""
        chan = chans[0] if d.channel == chans[0].number else chans[1]
        dead = chan is chans[1]
        seen = self._spooled(d, dead, self._kept(d))
        if seen is None or seen == POSSIBLE_DUPLICATE:
            self._bump("handed_back")  # the broker requeues it when the connection closes
            if seen is not None:
                self._unsettled = True  # it may be a record's redelivery
            elif d.consumer_tag in self._tags and not (  # not one a cancelled consumer had
                d.redelivered  # been sent, nor a denied message a crash handed back
                and self._is_denied(self._death(d)[0] if dead else d.exchange)
            ):
                self._fresh.add(chan.number)
            return
        chan.ack(d.delivery_tag)
        proofs.sent(chan.number, chan.request_sync(), proofs.proven[chan.number])
        self._bump("dead_redelivered_skipped" if dead else "redelivered_skipped")

    def _settle(
        self,
        conn: Connection,
        chans: tuple[Channel, Channel],
        proofs: AckProofs,
        spool: SpoolWriter,
    ) -> str | None:
        """Paused with records the broker may still redeliver (acks of an earlier connection
        never proven: a crash, a broker gone quiet): prove it holds none of them, so that the
        spool can release them. A channel that is not behind (``AckProofs``) owes none; one
        behind must have caught up (``_caught_up``: the broker redelivers returned messages
        before any other), or its queue hold nothing and have no consumer once the tap's
        consumers are cancelled: either way it redelivered every one it still had — and the
        tap acked each. Then one more sync per channel proves all of them. Anything doubtful
        (another consumer, a redelivery equal to several records handed back) settles
        nothing: the tap tries again later (``PROOF_RETRY_S``). Returns why it could not, or
        None."""
        main, dead = chans
        if self._consuming:
            self._cancel(main, dead)
        self._pump_paused(conn, chans, proofs, lambda: False)
        if self._unsettled:
            return "a redelivery equal to several spooled records was handed back"
        for chan, queue in ((main, self.queue), (dead, self.dead_queue)):
            if self._caught_up(chan.number, chan is dead, proofs):
                continue
            info = chan.queue_declare(queue, passive=True)
            if info.message_count or info.consumer_count:
                return (
                    f"{queue!r} may still redeliver spooled records: it holds "
                    f"{info.message_count} messages and has {info.consumer_count} consumers"
                )
        end = spool.durable_end - 1
        for chan in chans:
            proofs.sent(chan.number, chan.request_sync(), end, caught_up=True)
        self._await_proofs(conn, chans, proofs)
        if proofs.through < end:
            return "the broker did not answer"
        log_event(
            log, 30, "acks the broker never proved are settled: their records can be released",
            channel=self.channel, acked_through=end,
        )  # fmt: skip
        return None

    def _pause(
        self, conn: Connection, chans: tuple[Channel, Channel], spool: SpoolWriter,
        proofs: AckProofs, e: SpoolFull, handed: int,
    ) -> int:  # fmt: skip
        """The spool is full: hand back what is not durable (stop acking), collect the proofs
        of the acks sent, settle records a crash left unproven, and let the spool release
        what is proven. Returns the position proven acked."""
        log_event(log, 40, f"tap paused: {e}", channel=self.channel)
        self.status.paused = str(e)
        spool.discard_pending()  # never acked: the broker redelivers them
        self._group_records.clear()
        # the group's redeliveries of spooled records are durable: ack them, not hand them back
        for chan in chans:
            tags = [tag for number, tag in self._skip_tags if number == chan.number]
            for tag in tags:
                chan.ack(tag)
            if tags:
                proofs.sent(chan.number, chan.request_sync(), proofs.proven[chan.number])
        self._bump("handed_back", handed - len(self._skip_tags))
        self._skip_tags.clear()
        self._count_group()  # the skips
        self._write_status(spool, force=True)
        self._await_proofs(conn, chans, proofs)
        if proofs.through < spool.durable_end - 1 and not proofs.owed:
            self._log_unsettled(self._settle(conn, chans, proofs, spool), proofs)
        spool.make_releasable(proofs.through)  # a full disk may refuse: retried while waiting
        return proofs.through

    def _wait_for_room(
        self, spool: SpoolWriter, full: SpoolFull, need: int, confirmed: int
    ) -> None:
        """Paused on a full spool, disconnected: release shipped segments until the group
        that did not fit (``need`` bytes) would. Retries what a full disk refused (recording
        ``confirmed``, closing the current segment) until it succeeded; settles records whose
        acks were never proven every ``PROOF_RETRY_S`` if they are what keeps the spool full."""
        settle_at = time.monotonic() + PROOF_RETRY_S
        releasable = False  # make_releasable(confirmed) done: only shipping frees more now
        while not self._stop.is_set():
            self._stop.wait(RETRY_FULL_S)
            self._release(spool)  # black may have shipped meanwhile: room comes back
            if not releasable and spool.make_releasable(confirmed):
                releasable = True
                self._release(spool)
            self._write_status(spool)
            if spool.room_for(need) is None:
                break
            if time.monotonic() >= settle_at and self._unproven_hold_room(spool):
                log_event(
                    log, 30, "tap settling acks the broker never proved: their records keep the "
                    "spool full", channel=self.channel, acked_through=spool.acked_through,
                )  # fmt: skip
                proven = self._resettle(spool)
                if proven > confirmed:
                    confirmed, releasable = proven, False
                settle_at = time.monotonic() + PROOF_RETRY_S
        else:
            return
        log_event(log, 30, "tap resumed: the spool has room again", channel=self.channel,
                  paused_for=str(full)[:200])  # fmt: skip
        self.status.paused = None
        self._write_status(spool, force=True)

    def _resettle(self, spool: SpoolWriter) -> int:
        """Paused and disconnected: settle records whose acks were never proven (``_settle``)
        on a connection of its own that takes as few messages as it can — a quorum queue
        counts each one handed back toward its delivery limit. A channel that is not behind
        consumes nothing; one behind consumes one message at a time (prefetch 1: a redelivery
        of a spooled record is acked, and the next comes) until it caught up, so the first
        message that is none of them is the only one handed back; and if its queue has
        another consumer, nothing is consumed (that message would prove nothing). Returns the
        position proven acked."""
        self._load_candidates(spool)
        proven = spool.acked_through
        try:
            conn = Connection.open(
                self.cfg.black.amqp_url.get_secret_value(), client_name=f"diode-tap-{self.channel}"
            )
            try:
                main, dead = conn.channel(), conn.channel()
                for chan in (main, dead):
                    chan.basic_qos(1)
                proofs = AckProofs(proven, (main.number, dead.number), self._connected(main, dead))
                why = self._catch_up(conn, (main, dead), proofs)
                if why is None:
                    why = self._settle(conn, (main, dead), proofs, spool)
                self._log_unsettled(why, proofs)
                proven = proofs.through
            finally:
                self._consuming = False
                conn.close()  # what it did not ack goes back to the queues
        except AmqpAccessRefused as e:
            raise ConfigError(str(e)) from None
        except (OSError, BrokerError) as e:
            if not getattr(e, "retryable", True):
                raise
            log_event(log, 30, f"settling acks the broker never proved failed: {e}",
                      channel=self.channel, retry_in_s=PROOF_RETRY_S)  # fmt: skip
        return proven

    def _catch_up(
        self, conn: Connection, chans: tuple[Channel, Channel], proofs: AckProofs
    ) -> str | None:
        """Settling on a connection of its own (``_resettle``): consume the queues of the
        channels behind, prefetch 1, until each caught up or went quiet (then ``_settle``
        looks at the queue). Returns why settling cannot succeed now (nothing consumed), or
        None."""
        main, dead = chans
        queues = ((main, self.queue), (dead, self.dead_queue))
        for chan, queue in queues:
            if chan.number in proofs.behind and chan.number not in self._alone:
                return f"another consumer held {queue!r} when the tap connected"
        self._tags = (
            main.basic_consume(self.queue) if main.number in proofs.behind else "",
            dead.basic_consume(self.dead_queue) if dead.number in proofs.behind else "",
        )
        self._consuming = any(self._tags)
        self._pump_paused(
            conn,
            chans,
            proofs,
            lambda: (
                self._unsettled
                or all(self._caught_up(c.number, c is dead, proofs) for c in chans)
                or self._stop.is_set()
            ),
        )
        return None

    def _pump_paused(
        self,
        conn: Connection,
        chans: tuple[Channel, Channel],
        proofs: AckProofs,
        done: Callable[[], bool],
    ) -> None:
        """Paused: take deliveries (``_while_paused``) and proofs until ``done()``, or no
        delivery for ``SETTLE_QUIET_S``, or ``PROOF_WAIT_S`` in all."""
        quiet = time.monotonic()
        deadline = quiet + PROOF_WAIT_S
        while (
            not done() and time.monotonic() - quiet < SETTLE_QUIET_S and time.monotonic() < deadline
        ):
            events = conn.poll(0.1)
            for d in events.deliveries:
                quiet = time.monotonic()
                self._while_paused(d, chans, proofs)
            for token in events.syncs:
                proofs.answered(token)

    def _log_unsettled(self, why: str | None, proofs: AckProofs) -> None:
        if why is not None:
            log_event(
                log, 20, f"spooled records whose acks were never proven stay unreleased: {why}",
                channel=self.channel, acked_through=proofs.through, retry_in_s=PROOF_RETRY_S,
            )  # fmt: skip

    def _unproven_hold_room(self, spool: SpoolWriter) -> bool:
        """Shipped records stay in the spool because their acks were never proven."""
        shipped = self.store.load(self.channel).last_seq
        return spool.acked_through < min(shipped, spool.durable_end - 1)

    def _sync_after_loss(self, spool: SpoolWriter) -> None:
        self._group_skips.clear()  # never acked: they come again, and are counted then
        self._group_denied.clear()
        self._skip_tags.clear()
        if not spool.pending:
            return
        try:
            spool.sync(spool.acked_through)
        except SpoolFull:
            spool.discard_pending()  # never acked: the broker redelivers them
            self._group_records.clear()
            return
        self._count_group()

    def _count_group(self) -> None:
        """The group's records are durable (and its deliveries acked): count them."""
        self._skip_tags.clear()
        for counts in (self._group_records, self._group_skips):
            for name, n in counts.items():
                self._bump(name, n)
            counts.clear()
        self._denied_unlogged.update(self._group_denied)
        self._group_denied.clear()
        self._log_denied()

    def _load_candidates(self, spool: SpoolWriter) -> None:
        """Records the broker may redeliver: after the last position proven acked. A content
        that more than one of them share is ambiguous: the broker may have applied the ack of
        some of its records and redeliver a twin the spool does not hold yet. Lost records of
        dead letters carry the dead letter's fingerprint: their redeliveries likewise."""
        self._candidates.clear()
        self._ambiguous.clear()
        self._dead_candidates.clear()
        self._dead_ambiguous.clear()
        tail = spool.records_after(spool.acked_through)
        if not len(tail):
            return
        d = tail.to_pydict()
        for i in range(len(tail)):
            props = d["properties_raw"][i]
            if d["kind"][i] != 0:
                if len(props) == DEAD_LETTER_BYTES:
                    self._dead_candidates[props] += 1
                continue
            if self.quorum:
                props = order_free(props)
            self._candidates[
                fingerprint(d["exchange"][i], d["routing_key"][i], props, d["body"][i])
            ] += 1
        self._ambiguous.update(fp for fp, n in self._candidates.items() if n > 1)
        self._dead_ambiguous.update(fp for fp, n in self._dead_candidates.items() if n > 1)
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
            behind = self._connected(main, dead)
            self._consume(main, dead)
            self._loop(conn, main, dead, spool, behind)
        finally:
            self._consuming = False
            conn.close()

    def _connected(self, main: Channel, dead: Channel) -> set[int]:
        """A new connection, before it consumes: which queues have no other consumer
        (``_alone``) and which AMQP channels are *behind* (see ``AckProofs``): those that may
        still redeliver records after ``acked_through``. A channel is not, if the spool holds
        none it could redeliver, or if its queue is empty with no consumer: nothing held back
        can come any more."""
        self._fresh.clear()
        self._drained.clear()
        self._empty_since.clear()
        self._unsettled = False
        self._alone.clear()
        behind = set()
        for chan, queue, candidates in (
            (main, self.queue, self._candidates),
            (dead, self.dead_queue, self._dead_candidates),
        ):
            info = main.queue_declare(queue, passive=True)
            if info.consumer_count == 0:
                self._alone.add(chan.number)
            if candidates and (info.message_count or info.consumer_count):
                behind.add(chan.number)
        return behind

    def _caught_up(self, chan: int, dead: bool, proofs: AckProofs) -> bool:
        """AMQP channel ``chan`` (``dead``: the dead queue's) is not behind, or it delivered
        every redelivery it owed: each record it could redeliver was recognised (none left,
        none ambiguous), or — the only consumer of its queue since its consumer began — it
        delivered a message that is none of them (the broker redelivers returned messages
        first), or its queue was seen empty with no consumer (``_recheck``)."""
        if (
            chan not in proofs.behind
            or chan in self._drained
            or (chan in self._fresh and chan in self._alone)
        ):
            return True
        candidates, ambiguous = (
            (self._dead_candidates, self._dead_ambiguous)
            if dead
            else (self._candidates, self._ambiguous)
        )
        return not ambiguous and not any(n > 0 for n in candidates.values())

    def _recheck(
        self, chans: tuple[Channel, Channel], unacked: tuple[bool, bool], proofs: AckProofs,
        now: float,
    ) -> None:  # fmt: skip
        """Running (not ``until_empty``): look again at each channel still behind that holds
        no unacked delivery. If its queue has no consumer but the tap's, the other one has
        gone (its messages back in the queue): the tap's consumer is cancelled (what the
        broker sent before cancel-ok is read by the next poll) and, once those deliveries are
        acked, a new one starts (``_consume_again``): the queue's only consumer, so its first
        delivery that is no spooled record proves it caught up (the broker redelivers returned
        messages first). If the queue then reads empty with no consumer, at every recheck for
        ``DRAINED_HOLD_S``, nothing can come back (a record's ack the broker applied before a
        crash, its proof never recorded, leaves nothing to wait for): it is *drained*, proven
        by its next sync (``_prove_drained``)."""
        for i, (chan, queue) in enumerate(((chans[0], self.queue), (chans[1], self.dead_queue))):
            n = chan.number
            if self._caught_up(n, i == 1, proofs) or not self._tags[i] or unacked[i]:
                continue
            if chan.queue_declare(queue, passive=True).consumer_count != 1:
                self._empty_since.pop(n, None)
                log_event(log, 10, "another consumer still holds a queue that could redeliver "
                          "spooled records", channel=self.channel, queue=queue)  # fmt: skip
                continue
            chan.basic_cancel(self._tags[i])
            self._tags = (self._tags[0], "") if i else ("", self._tags[1])
            if n not in self._alone:
                self._alone.add(n)
                self._fresh.discard(n)  # only the next consumer's deliveries count
                log_event(
                    log, 20, "the other consumer of a queue that could still redeliver spooled "
                    "records has gone: the tap is its only consumer now", channel=self.channel,
                    queue=queue, acked_through=proofs.through,
                )  # fmt: skip
            info = chan.queue_declare(queue, passive=True)
            if info.message_count or info.consumer_count:
                self._empty_since.pop(n, None)
            elif now - self._empty_since.setdefault(n, now) >= DRAINED_HOLD_S:
                self._drained.add(n)
                log_event(
                    log, 20, "a queue that could still redeliver spooled records is empty with "
                    "no consumer: none can come back", channel=self.channel, queue=queue,
                    acked_through=proofs.through, empty_for_s=round(now - self._empty_since[n]),
                )  # fmt: skip

    def _consume_again(self, chans: tuple[Channel, Channel], unacked: tuple[bool, bool]) -> None:
        """A consumer ``_recheck`` cancelled: once the deliveries it had been sent are acked
        (so that no more than a prefetch window is ever unacked), a new one starts."""
        for i, (chan, queue) in enumerate(((chans[0], self.queue), (chans[1], self.dead_queue))):
            if not self._tags[i] and not unacked[i]:
                tag = chan.basic_consume(queue)
                self._tags = (self._tags[0], tag) if i else (tag, self._tags[1])

    def _prove_drained(
        self, chan: Channel, unacked: bool, proofs: AckProofs, spool: SpoolWriter
    ) -> None:
        """A drained channel (``_recheck``) with nothing unacked and no proof on its way: ask
        for the one that proves it caught up (its acks all sent before it)."""
        n = chan.number
        if n in proofs.behind and n in self._drained and not unacked and n not in proofs.latest:
            proofs.sent(n, chan.request_sync(), spool.durable_end - 1, caught_up=True)

    def _consume(self, main: Any, dead: Any) -> None:
        self._tags = (main.basic_consume(self.queue), dead.basic_consume(self.dead_queue))
        self._consuming = True

    def _cancel(self, main: Any, dead: Any) -> None:
        """Stop the consumers; deliveries the broker sent before cancel-ok still arrive."""
        for chan, tag in zip((main, dead), self._tags, strict=True):
            if tag:
                chan.basic_cancel(tag)
        self._consuming = False

    def _loop(
        self, conn: Connection, main: Channel, dead: Channel, spool: SpoolWriter, behind: set[int]
    ) -> None:
        tap = self.cfg.black.tap
        last_main = last_dead = 0  # highest delivery tag received, per AMQP channel
        acked_main = acked_dead = 0
        proofs = AckProofs(spool.acked_through, (main.number, dead.number), behind)
        first_unsynced: float | None = None
        next_release = time.monotonic() + RELEASE_EVERY_S
        recheck_at = time.monotonic() + RECHECK_S
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
                    self._take(spool, d)
                elif d.channel == dead.number:
                    last_dead = d.delivery_tag
                    self._take_dead(spool, d)
            for token in events.syncs:
                proofs.answered(token)
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
                    durable = spool.sync(proofs.through) if spool.pending else spool.durable_end
                except SpoolFull as e:
                    need = spool.pending_bytes
                    handed = last_main - acked_main + last_dead - acked_dead
                    confirmed = self._pause(conn, (main, dead), spool, proofs, e, handed)
                    if self.until_empty:
                        # a scheduled run: nothing will be shipped until the taps end, so stop
                        # here; what is not durable was never acked and stays in the broker
                        log_event(
                            log, 30, "spool full: this run seals what the spool holds; the rest "
                            "waits in the broker for the next run", channel=self.channel,
                        )  # fmt: skip
                        return
                    # hand what is not durable back to the broker and wait for room without
                    # holding a prefetch window of messages here (up to prefetch x their size)
                    raise _Paused(e, need, confirmed) from None
                self._count_group()
                if self.status.paused:  # it had reconnected to settle acks never proven
                    log_event(log, 30, "tap resumed: the spool has room again",
                              channel=self.channel)  # fmt: skip
                    self.status.paused = None
                    self._write_status(spool, force=True)
                crash_point("tap.after_sync")
                slow_point("tap.after_sync")  # tests: a drain slow enough to be interrupted
                if last_main > acked_main:
                    main.ack(last_main, multiple=True)
                    acked_main = last_main
                    caught_up = self._caught_up(main.number, False, proofs)
                    proofs.sent(main.number, main.request_sync(), durable - 1, caught_up=caught_up)
                else:
                    proofs.nothing_owed(main.number, durable - 1)
                if last_dead > acked_dead:
                    crash_point("tap.before_dead_ack")
                    dead.ack(last_dead, multiple=True)
                    acked_dead = last_dead
                    caught_up = self._caught_up(dead.number, True, proofs)
                    proofs.sent(dead.number, dead.request_sync(), durable - 1, caught_up=caught_up)
                else:
                    proofs.nothing_owed(dead.number, durable - 1)
                crash_point("tap.after_ack")
                first_unsynced = None
            confirmed = proofs.through
            if (
                not unacked
                and spool.pending == 0
                and confirmed > spool.acked_through
                and now - quiet_since >= IDLE_RECORD_S
            ):
                # quiet: record what the broker confirmed (tiny batch); a full disk refusing
                # it costs nothing but a later release: tried again on the next quiet pass
                with contextlib.suppress(SpoolFull):
                    spool.sync(confirmed)
            held = (last_main > acked_main, last_dead > acked_dead)
            self._prove_drained(main, held[0], proofs, spool)
            self._prove_drained(dead, held[1], proofs, spool)
            if not self.until_empty:  # a scheduled run cancels and consumes on its own
                self._consume_again((main, dead), held)
                if now >= recheck_at:
                    if proofs.behind:
                        self._recheck((main, dead), held, proofs, now)
                    recheck_at = now + RECHECK_S
            if now >= next_release:
                self._release(spool)
                next_release = now + RELEASE_EVERY_S
            self._write_status(spool)
            if (
                self.until_empty
                and not unacked
                and spool.pending == 0
                and not proofs.owed
                and self._budget is not None
                and self._taken >= self._budget
                and self._budget > 0
            ):
                break  # the backlog found at start is durable; newer traffic waits for next run
            if (
                self.until_empty
                and not unacked
                and spool.pending == 0
                and not proofs.owed
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
        if proofs.through > spool.acked_through and not spool.pending:
            # record the last proven ack: the next run releases more (a full disk: it does not)
            with contextlib.suppress(SpoolFull):
                spool.sync(proofs.through)
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
    def _spooled(self, d: Delivery, dead: bool, props: bytes) -> str | None:
        """Whether delivery ``d`` is a redelivery of a record the spool holds after
        ``acked_through``: ``"skip"`` (it is; the record is used up), ``POSSIBLE_DUPLICATE``
        (it may be: several records are equal to it) or None (it is not)."""
        if not d.redelivered:
            return None
        candidates, ambiguous = (
            (self._dead_candidates, self._dead_ambiguous)
            if dead
            else (self._candidates, self._ambiguous)
        )
        if not candidates:
            return None
        fp = self._fingerprint(d, props)
        if candidates[fp] <= 0:
            return None
        candidates[fp] -= 1
        return POSSIBLE_DUPLICATE if fp in ambiguous else "skip"

    def _kept(self, d: Delivery) -> bytes:
        """``d``'s property bytes as the spool keeps them (a quorum redelivery's
        ``x-delivery-count`` removed)."""
        if self.quorum and d.redelivered:
            return strip_delivery_count(d.properties_raw)
        return d.properties_raw

    def _fingerprint(self, d: Delivery, props: bytes) -> bytes:
        """``d``'s identity as the spool remembers it: its names as the spool stores them
        (``text_names``: bytes that are not UTF-8 become U+FFFD), its kept property bytes
        (``_kept``; a quorum queue's header order ignored)."""
        exchange, rk, _ = text_names(d.exchange, d.routing_key)
        return fingerprint(exchange, rk, order_free(props) if self.quorum else props, d.body)

    def _take(self, spool: SpoolWriter, d: Delivery) -> None:
        props = d.properties_raw
        note = None
        if d.redelivered:
            if self.quorum:
                stripped = strip_delivery_count(props)
                if stripped != props:
                    # the broker re-encoded the header table (keys sorted) to add its count:
                    # the values are exact, their order may not be (two keys or more).
                    # Counted, never silent.
                    props = stripped
                    note = REENCODED if reordered(stripped) else None
            seen = self._spooled(d, False, props)  # props: the kept bytes, count stripped
            if seen == "skip":
                self._group_skips["redelivered_skipped"] += 1
                self._skip_tags.append((d.channel, d.delivery_tag))
                return
            if seen == POSSIBLE_DUPLICATE:
                # byte-identical messages: this may be a twin, not the spooled one. Kept
                # (never lost) and marked: red sees it may duplicate an earlier seq. A pause
                # may hand it back unspooled: then nothing on this connection is settled
                note = POSSIBLE_DUPLICATE
                self._unsettled = True
        if self._denied(d, d.exchange, fresh=note != POSSIBLE_DUPLICATE):
            return
        if note != POSSIBLE_DUPLICATE and d.consumer_tag in self._tags:
            self._fresh.add(d.channel)
        exchange, rk = d.exchange, d.routing_key
        if not (exchange.isascii() and rk.isascii()):
            exchange, rk, renamed = text_names(exchange, rk)
            if renamed and note != POSSIBLE_DUPLICATE:  # one reason a row: the weightier
                note = NON_UTF8_NAME
        spool.append_one(exchange, rk, d.redelivered, props, d.body, note)
        self._group_records["delivered"] += 1
        if note is not None:
            self._group_records[f"inexact_{note}"] += 1

    def _take_dead(self, spool: SpoolWriter, d: Delivery) -> None:
        """A dead letter: the mirror queue dropped a message. Recorded as lost, with the
        original exchange and routing key (``x-death``), once: a redelivery of a dead letter
        already recorded (a crash before its ack) is skipped."""
        props = self._kept(d)
        seen = self._spooled(d, True, props)
        if seen == "skip":
            self._group_skips["dead_redelivered_skipped"] += 1
            self._skip_tags.append((d.channel, d.delivery_tag))
            return
        if seen == POSSIBLE_DUPLICATE:
            # a pause may hand it back unspooled: then nothing on this connection is settled
            self._unsettled = True
        exchange, rk, reason = self._death(d)
        if self._denied(d, exchange, fresh=seen is None):  # not even its names are carried
            return
        if seen == POSSIBLE_DUPLICATE:
            # equal to several recorded dead letters: record it again rather than risk
            # leaving a loss out (the count may then be too high, never too low)
            self._group_records["dead_possible_duplicate"] += 1
        elif d.consumer_tag in self._tags:
            self._fresh.add(d.channel)
        spool.append_lost(exchange, rk, reason, dead_letter=self._fingerprint(d, props))
        self._group_records[f"lost_{reason}"] += 1
        log_event(
            log, 40, "the broker dropped a message from the mirror queue: recorded as a gap",
            channel=self.channel, reason=reason, exchange=exchange, routing_key=rk,
            pos=spool.next_pos - 1,
        )  # fmt: skip

    def _death(self, d: Delivery) -> tuple[str, str, str]:
        """A dead letter's original exchange and routing key (as storable text) and reason."""
        headers = headers_of(d.properties_raw)  # decoded once for every field read below
        death = death_of(headers, self.queue)
        exchange, rk, reason = death if death is not None else ("", d.routing_key, "")
        exchange = exchange or as_text(field_of(headers, "x-first-death-exchange"))
        reason = reason or as_text(field_of(headers, "x-first-death-reason")) or "dead-lettered"
        exchange, rk, _ = text_names(exchange, rk)
        return exchange, rk, reason

    def _is_denied(self, exchange: str) -> bool:
        """The channel denies ``exchange`` (its name as delivered, or as storable text)."""
        is_denied = self._denial.get(exchange)
        if is_denied is None:
            if len(self._denial) >= DENIAL_CACHE:
                self._denial.clear()
            ch = self.cfg.channel(self.channel)
            text = text_names(exchange, "")[0]
            is_denied = self._denial[exchange] = denied(ch, exchange) or denied(ch, text)
        return is_denied

    def _denied(self, d: Delivery, exchange: str, *, fresh: bool) -> bool:
        """Whether ``d`` comes from an exchange the channel denies (reaching the mirror queue
        through an exchange-to-exchange binding into a mirrored one, or published to it
        through the default exchange): then it is dropped — never spooled, acked with its
        group once what precedes it is durable (``multiple``: never ahead of a record), and
        counted (``DENIED``) once acked. ``fresh``: it is no spooled record's redelivery;
        only a first delivery then proves its AMQP channel caught up — a denied message a
        crash handed back sits among the records it may still redeliver."""
        if not self._is_denied(exchange):
            return False
        if fresh and not d.redelivered and d.consumer_tag in self._tags:
            self._fresh.add(d.channel)
        self._group_skips[DENIED] += 1
        self._group_denied[text_names(exchange, "")[0]] += 1
        self._skip_tags.append((d.channel, d.delivery_tag))
        return True

    def _log_denied(self, *, force: bool = False) -> None:
        """Warn of the denied deliveries acked since the last warning, by exchange; at most
        every ``DENIED_LOG_S`` (``force``: now)."""
        now = time.monotonic()
        if not self._denied_unlogged or (
            not force
            and self._denied_logged_at is not None
            and now - self._denied_logged_at < DENIED_LOG_S
        ):
            return
        for exchange, n in sorted(self._denied_unlogged.items()):
            log_event(
                log, 30, "deliveries from an exchange the channel denies were dropped, not "
                "spooled (an exchange-to-exchange binding into a mirrored exchange?)",
                channel=self.channel, exchange=exchange, count=n,
            )  # fmt: skip
        self._denied_unlogged.clear()
        self._denied_logged_at = now

    def _bump(self, name: str, n: int = 1) -> None:
        self.status.counters[name] = self.status.counters.get(name, 0) + n

    # -- housekeeping -----------------------------------------------------------------------
    def _release(self, spool: SpoolWriter) -> None:
        """Delete the spool segments black shipped. One that cannot be deleted is logged
        (once a minute while it lasts) and counted (``RELEASE_REFUSED``), never raised: what it
        holds is shipped, and a spool that stops shrinking pauses the tap at its quota or
        ``min_free_bytes`` like any full spool — the backlog waits in the broker."""
        shipped = self.store.load(self.channel).last_seq
        if shipped < 0:
            return
        try:
            freed = spool.release_through(shipped)
        except DiodeError as e:  # a segment that cannot be deleted (release_refused)
            self._bump(RELEASE_REFUSED)
            if self._release_refused.due(str(e)):
                log_event(log, 40, str(e), channel=self.channel, through_pos=shipped)
            return
        if self._release_refused.over():
            log_event(log, 30, "shipped spool segments can be deleted again",
                      channel=self.channel, through_pos=shipped, bytes=freed)  # fmt: skip
        elif freed:
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
        path = status_path(self.cfg, self.channel)
        try:
            atomic_write_bytes(path, json.dumps(asdict(self.status)).encode())
        except OSError as e:
            self._status_not_written(path, e)
            return
        if self._status_refused.over():
            log_event(log, 30, "tap status file written again", channel=self.channel,
                      path=str(path))  # fmt: skip

    def _status_not_written(self, path: Path, e: OSError) -> None:
        """Black, tap: the status file was refused (a full disk, permissions). It only informs
        (``diode status``, the job's metrics): the tap goes on, warning at most every
        ``STATUS_LOG_S`` while it is refused, and the status ages (``tap_status_age``)."""
        why = f"{e.strerror or e} (errno {e.errno})"
        if not self._status_refused.due(why):
            return
        log_event(
            log, 30, f"tap status file not written: {why}; the tap goes on (its status in "
            "`diode status` and the metrics grows old). Free space on, or give black write "
            "access to, black.state_dir", channel=self.channel, path=str(path),
        )  # fmt: skip


class _Paused(Exception):
    """The spool is full: the tap drops its connection and waits for room."""

    def __init__(self, full: SpoolFull, need: int, confirmed: int) -> None:
        super().__init__(str(full))
        self.full = full
        self.need = need
        self.confirmed = confirmed


def _watch_parent(tap: Tap, parent: int) -> None:
    """Stop ``tap`` (gracefully: what it holds is synced, the rest redelivered) once the black
    job that started it is gone, killed or not: a tap left running would hold the spool lock
    against the job's next taps, on the old configuration."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    log_event(log, 30, "the black job that started this tap is gone: stopping",
              channel=tap.channel, parent_pid=parent)  # fmt: skip
    tap.stop()


def report_reason(reason: str) -> None:
    """Black, tap: hand why this tap stops to the job that started it (``REASON_FD_ENV``, a
    pipe the job reads once the tap exited), once; nothing without that job."""
    fd = os.environ.pop(REASON_FD_ENV, "")  # closed below: its number may be reused after
    if not fd.isdigit():
        return
    with contextlib.suppress(OSError):  # the job is gone, or this is no pipe of its
        try:
            os.write(int(fd), reason.encode(errors="replace")[:8192])
        finally:
            os.close(int(fd))


@contextlib.contextmanager
def _reported(channel: str) -> Iterator[None]:
    """Black, tap: an error that stops this tap is logged and handed to the job that started
    it (``report_reason``), then raised."""
    try:
        yield
    except DiodeError as e:
        log_event(log, 50, f"tap stopped: {e}", channel=channel)
        report_reason(str(e))
        raise
    except Exception as e:  # a bug or a library's own error: its traceback follows
        report_reason(f"{type(e).__name__}: {e}")
        raise


def tap_main(config_path: Path | None, channel: str, *, until_empty: bool = False) -> TapStatus:
    """Black, tap: ``diode black tap``: load the config, check its broker URL, ``run_tap``. An
    error before the tap runs (a config file edited since the job started, a channel gone
    from it) reaches the job like one while it runs, with its reason (``report_reason``)."""
    with _reported(channel):
        cfg = load_config(config_path)
        check_amqp_url(cfg.black.amqp_url.get_secret_value())
    return run_tap(cfg, channel, until_empty=until_empty)


def run_tap(cfg: Config, channel: str, *, until_empty: bool = False) -> TapStatus:
    """Run a tap in this process until SIGTERM / SIGINT (or an empty queue with until_empty).
    An error that stops it is logged and handed to the job that started it (``report_reason``),
    one in building it too (a channel the config no longer has)."""
    with _reported(channel):
        tap = Tap(cfg, channel, until_empty=until_empty)

        def _stop(_sig: int, _frame: Any) -> None:
            tap.stop()

        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, _stop)
        parent = os.environ.get(PARENT_ENV, "")
        if parent.isdigit():
            threading.Thread(target=_watch_parent, args=(tap, int(parent)), daemon=True).start()
        return tap.run()
