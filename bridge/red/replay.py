"""Red, replay: tail the `messages` Delta table and publish approved exchanges into red RabbitMQ.

A separate process (``diode red replay``); the landing never waits for it (DESIGN §3.8).

* **What**: rows of ``tables_dir/messages`` whose exchange is approved
  (``red.replay.approved`` ∪ ``diode approve``, see :mod:`bridge.red.approvals`). Other
  exchanges stay landed; their waiting rows are counted (status, ``bridge_red_replay_lag_rows``).
* **Order**: per exchange by ``(land_seq, channel, seq)`` — the landing commit that wrote a row,
  then the message identity. ``land_seq`` only grows, so new rows always sort after old ones.
* **How much**: a batch is every row of the exchange in the landing commits
  ``[lo, hi]``, ``hi`` the smallest commit that brings about ``batch_rows`` rows (fewer when
  rows of the size read last would pass ``batch_bytes``; 1000 for an exchange's first batch),
  estimated from the per-file row counts and ``land_seq`` min/max of the Delta log, a file's
  rows spread over its span (a compacted file is read a few commits at a time; no data read to
  plan; a table without statistics falls back to reading the ``land_seq`` column). One commit
  is never split. The table is refreshed at every pass.
* **Checked**: a row the broker cannot take (routing key over 255 bytes as landed, property
  bytes that do not parse, a content header over ``frame_max``; :mod:`replay_check`) is never
  sent: it is skipped, stays landed, and is reported once (``replay_failed`` kind ``bad_row``,
  ``bridge_red_replay_errors_total{kind="bad_row"}``, error log).
* **user-id**: RabbitMQ refuses (406, channel closed) a publish whose ``user-id`` property is
  not the publishing user's name unless that user has the ``impersonator`` tag, read at login.
  Each connection finds out first (:meth:`Replayer._probe_impersonation`: on a connection of
  its own, one publish with another user-id to the default exchange, routed nowhere).
  Without the tag, a row carrying another user's user-id is skipped like a ``bad_row`` (kind
  ``user_id``: the event names channel, seq and the fix), never published with other bytes
  and never stopping its exchange. A probe that cannot tell (e.g. no write on
  ``amq.default``) leaves it unknown: rows are published, and the first one refused for its
  user-id switches the connection to skipping.
* **Routed**: publishes are ``mandatory``; messages the broker returns (no binding on red) are
  counted (``bridge_red_replay_unroutable_total``), logged and audited per channel and seq
  range (``replay_failed`` kind ``unroutable``); the progress goes past them (the broker took
  them).
* **Read ahead**: rows of a late bundle published ahead of their key as fillers are kept
  (in memory until the cursor passes them; once confirmed, in the saved progress's ``ahead``)
  and never published again when the replay reaches them.
* **Exact**: each exchange is declared as its row says (type, durable, auto-delete, internal,
  arguments encoded from the typed JSON) before its first publish on a connection, and again
  when a row's declaration differs; ``properties_raw`` and the body are published byte for
  byte with the routing key as landed. With ``red.replay.id_header`` set, one header
  ``"<channel>:<seq>"`` is spliced into the property bytes, every other byte unchanged.
* **Confirmed**: one AMQP channel per exchange with publisher confirms; at most
  ``in_flight`` publishes unconfirmed in all. Progress per exchange (the last ``(land_seq,
  channel, seq)`` of the *confirmed prefix*) is saved in ``state_dir/replay-progress.json``
  (temp, fsync, rename) at most every second and at the end of every pass. A nack rewinds the
  exchange to its progress and republishes (at-least-once, in order); after
  ``MAX_NACK_RETRIES`` rewinds at the same row the exchange is stopped (``replay_failed``) and
  retried ``retry_seconds`` later.
* **Refusals**: a declaration the broker refuses (406: the exchange exists with another type
  or arguments), an internal exchange (clients cannot publish to it), a row whose exchange type
  black did not know (``unknown``: published only if the exchange already exists on red), a
  channel the broker closes: the exchange stops with a ``replay_failed`` event, the others go
  on; it is retried later without repeating the event. A stopped exchange is not caught up:
  ``run(until_caught_up=True)`` ends once every exchange is caught up or stopped, with
  ``caught_up`` False and the stopped exchanges (and why) in the summary's ``stopped``.
* **Broker down**: logged, reconnect with back-off 1 s .. 30 s (reset only once a publish is
  confirmed again), resume from the saved progress. When the broker closes the connection
  while publishes are unconfirmed, those exchanges are published one row at a time, each
  confirmed before the next, up to where they were; a row the broker closes the connection for
  ``MAX_CONNECTION_DEATHS`` times alone stops its exchange (``replay_failed`` kind
  ``connection``), the others go on.

Events (``replayed`` ranges, ``replay_failed``, ``replay_gap_passed``,
``replayed_out_of_order``) are dicts with the audit keys ``event, exchange, channel, seq_first,
seq_last, reason, detail`` (detail: JSON text); ``step`` and ``run`` return them and hand them
to ``sink`` when one is given (:func:`audit_sink` writes them to the audit table with the
application id ``diode-replay``) at the end of every pass and when closing.

* **Never skipped unaudited**: every progress save holds the events the sink has not taken
  yet, in the same atomic write (``replayed`` ranges in the exchange's ``unaudited``, the
  others in its ``unaudited_events``). An event exists before the progress can pass its rows
  (a skipped row's when it is read, a gap's when it is passed; returned rows are counted and
  the progress is not saved past them until their events exist, at the pass end), so a saved
  progress past a skipped, returned or gap-passed row holds its event until a sink took it: a
  sink still failing at close, or a kill -9 between a save and the sink, loses none. The next
  start emits them first (returned again, written before anything else); a save after the
  sink took them forgets them (a kill in between writes them twice: never fewer). The
  progress is never held back instead: that would republish every row after the first
  unaudited one at a restart, for as long as the audit table is down. Bounded: ``replayed``
  ranges fold per channel; beyond ``UNSUNK_CAP`` other events, the oldest fold into one per
  (event, exchange, channel, kind) that counts them (``folded``, ``rows``, the seq span: its
  first seq is still the first row skipped, for ``diode red rewind --skipped``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import DeltaError
from prometheus_client import Counter, Gauge

from bridge.amqp.client import Channel, Connection, Returned, parse_url
from bridge.config import Config
from bridge.errors import (
    AmqpAccessRefused,
    AmqpClosed,
    AmqpInterrupted,
    BrokerError,
    DiodeError,
    ProtocolError,
    StateError,
)
from bridge.faults import crash_point
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock
from bridge.logs import get_logger, log_event
from bridge.metrics import REGISTRY
from bridge.protocol.header_splice import with_id_header
from bridge.protocol.manifest import format_utc
from bridge.protocol.properties import Properties, encode_properties
from bridge.protocol.rows import UNKNOWN_EXCHANGE_TYPE
from bridge.red import replay_state
from bridge.red.approvals import Approvals
from bridge.red.holdback import GapView, HoldSince, out_of_order, plan_release, publish_order
from bridge.red.landing import STATE_FILE, read_saved_state
from bridge.red.replay_check import impersonation_fix, name_problem, row_problem, user_id_problem
from bridge.red.replay_declare import Decl, declare_as_landed
from bridge.red.replay_plan import FileStat, plan_upper
from bridge.red.replay_results import ReplaySummary, StepResult, bound_events
from bridge.red.replay_state import (
    AHEAD_MAX,
    FORMAT,
    LIVE_FILE,
    PROGRESS_FILE,
    START,
    Key,
    Progress,
    load_progress,
    now_text,
    read_live,
    save_progress,
)
from bridge.red.replay_table import PUBLISHED, MessagesTable, lag_rows
from bridge.red.replay_window import ConfirmWindow

__all__ = [
    "APP_ID",
    "LIVE_FILE",
    "PROGRESS_FILE",
    "ConfirmWindow",
    "Progress",
    "ReplaySummary",
    "Replayer",
    "StepResult",
    "audit_sink",
    "load_progress",
    "plan_upper",
    "read_live",
    "with_id_header",
]

log = get_logger("bridge.red.replay")

APP_ID = "diode-replay"
"""Delta application id of the replay publisher's audit rows."""
LOCK_FILE = "replay.lock"
MAX_NACK_RETRIES = 3
"""Rewinds at the same row after broker nacks before the exchange is stopped."""
FIRST_BATCH_ROWS = 1000
"""Rows of an exchange's first batch, before the size of its rows is known (batch_bytes)."""
MAX_CONNECTION_DEATHS = 2
"""Connection closes by the broker while only one suspect row was unconfirmed before its
exchange is stopped."""
RETRY_SECONDS = 60.0
"""A stopped exchange is tried again after this long (no new event if it fails the same way)."""
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0
SAVE_EVERY = 1.0  # seconds between progress saves while publishing
REPLAYED_EVERY = 60.0  # seconds between `replayed` events of an exchange still catching up
UNSUNK_CAP = 10_000  # events other than `replayed` kept whole while the audit sink fails
DRAIN_SECONDS = 30.0  # how long a pass waits for outstanding confirms
PUBLISH_CHUNK = 128  # messages per socket write
CLOSE_DRAIN_SECONDS = 5.0
HEARTBEAT = 30
PROBE_WAIT = 5.0
"""Seconds a new connection waits for the impersonation probe's answer before publishing."""
PROBE_USER_ID = "diode-replay-impersonation-probe"
"""The user-id of the probe publish (never the replay user's own name, see
_probe_impersonation)."""
USER_ID_REFUSED = "user_id property"
"""In the reply text of the broker's 406 for a user-id its publisher may not set."""


def _user_id_refused(e: AmqpClosed) -> bool:
    """Whether the broker closed a channel for a user-id its publisher may not set."""
    return e.reply_code == 406 and USER_ID_REFUSED in e.reply_text


# -- metrics ----------------------------------------------------------------------------------
class _Metrics:
    def __init__(self) -> None:
        self.published = Counter(
            "bridge_red_replay_published",
            "Messages published to the red broker (republished ones counted again)",
            ["exchange"],
            registry=REGISTRY,
        )
        self.confirmed = Counter(
            "bridge_red_replay_confirmed",
            "Messages the red broker confirmed in order (progress advanced over them)",
            ["exchange"],
            registry=REGISTRY,
        )
        self.errors = Counter(
            "bridge_red_replay_errors",
            "Replay failures by kind (declare, internal, unknown_type, bad_arguments, nack, "
            "channel_closed, connection, bad_name, bad_row and user_id: one per row skipped); "
            "exchange '' for the connection",
            ["exchange", "kind"],
            registry=REGISTRY,
        )
        self.unroutable = Counter(
            "bridge_red_replay_unroutable",
            "Messages the red broker returned as unroutable (no binding matched on red: the "
            "broker confirmed and dropped them); progress went past them",
            ["exchange"],
            registry=REGISTRY,
        )
        self.out_of_order = Counter(
            "bridge_red_replay_out_of_order",
            "Messages published below a seq of their channel already published to the exchange "
            "(they landed after the hold-back went past their gap)",
            ["exchange"],
            registry=REGISTRY,
        )
        self.gaps_passed = Counter(
            "bridge_red_replay_gaps_passed",
            "Times an exchange went past an open gap after holding it gap_hold_seconds",
            ["exchange"],
            registry=REGISTRY,
        )
        self.held = Gauge(
            "bridge_red_replay_held_exchanges",
            "Approved exchanges waiting (hold-back) for an open gap below their next row",
            registry=REGISTRY,
        )
        self.broker_blocked = Gauge(
            "bridge_red_replay_broker_blocked",
            "1 while the red broker blocks the replay's connection (connection.blocked: a "
            "memory or disk alarm; nothing is published until it clears)",
            registry=REGISTRY,
        )
        self.lag = Gauge(
            "bridge_red_replay_lag_rows",
            "Rows landed in later landing commits than the exchange's replay progress (from the "
            "Delta log); for an exchange not approved: every landed row",
            ["exchange"],
            registry=REGISTRY,
        )


METRICS = _Metrics()


# -- per exchange -----------------------------------------------------------------------------


@dataclass
class _Lane:
    """One approved exchange on the current connection."""

    name: str
    progress: Progress
    cursor: Key = START  # last row published (or the progress after a rewind)
    read_through: int = -1  # every row of land_seq <= this was read and published
    channel: Channel | None = None
    declared: Decl | None = None
    window: ConfirmWindow = field(default_factory=ConfirmWindow)
    blocked: str | None = None
    blocked_kind: str = ""
    retry_at: float = 0.0
    reported: str | None = None  # reason of the last replay_failed event (not repeated)
    rewinds: int = 0  # rewinds after nacks at the current progress
    retired: bool = False  # approval revoked: no new publishes
    caught_up: bool = False
    no_id_header: int = 0  # rows published without the id header (undecodable properties)
    replayed: dict[str, list[int]] = field(default_factory=dict)
    replayed_since: float = field(default_factory=time.monotonic)
    high: dict[str, int] = field(default_factory=dict)  # per channel, highest seq published
    # fillers published ahead of their key, kept until the cursor passes them
    early: set[Key] = field(default_factory=set)
    held: dict[str, Any] | None = None  # the row the exchange waits at (hold-back), for status
    bad: set[Key] = field(default_factory=set)  # rows skipped as unpublishable (reported once)
    tables_ok: dict[bytes, None] = field(default_factory=dict)  # header tables that decode
    unroutable: dict[str, list[int]] = field(default_factory=dict)  # [first, last, rows]
    unroutable_why: str = ""
    suspect_until: Key | None = None  # publishes up to here were unconfirmed when the broker
    # closed the connection: published one at a time until confirmed (who kills it?)
    deaths: int = 0  # connection closes while only this lane's head publish was unconfirmed
    row_bytes: float = 0.0  # in-memory bytes per row of the last batch read (0: none yet)

    def rewind(self) -> int:
        """Back to the confirmed prefix; returns how many publishes were still pending."""
        self.cursor = self.progress.key
        self.read_through = -1
        self.caught_up = False
        self.high = dict(self.progress.high)
        self.early = set(self.progress.ahead)  # confirmed ahead: not published again
        return self.window.clear()

    def forget_passed(self) -> None:
        """Drop fillers the cursor passed (never read again) and skipped rows the progress
        passed (never read again, even after a rewind)."""
        if self.early:
            cursor = self.cursor
            self.early = {k for k in self.early if k > cursor}
        if self.bad:
            key = self.progress.key
            self.bad = {k for k in self.bad if k > key}


class _Stop(Exception):
    """Internal: the deadline passed or the stop event was set while waiting."""


class _TableError(Exception):
    """Internal: the `messages` table could not be read this pass (retried the next one)."""


_TABLE_ERRORS = (OSError, pa.ArrowException, DeltaError)


# -- the publisher ----------------------------------------------------------------------------
class Replayer:
    """Replays approved exchanges of ``cfg.red.tables_dir/messages`` into ``red.replay.amqp_url``.

    ``step()`` makes one pass (returns a :class:`StepResult`); ``run()`` loops until stopped,
    timed out or, with ``until_caught_up``, until every approved row is confirmed or its
    exchange stopped. The instance holds ``state_dir/replay.lock`` from its first pass until
    ``close()`` (``run`` closes at its end): one publisher per state_dir.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        sink: Callable[[list[dict[str, Any]]], None] | None = None,
        client_name: str = "diode-red-replay",
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        r = cfg.red.replay
        self.cfg = cfg
        self.state_dir = Path(cfg.red.state_dir)
        self.table_path = Path(cfg.red.tables_dir) / "messages"
        self.in_flight = int(r.in_flight)
        self.batch_rows = int(r.batch_rows)
        self.batch_bytes = int(r.batch_bytes)
        self.poll_seconds = float(r.poll_seconds)
        self.id_header = r.id_header
        self.hold_us = round(r.gap_hold_seconds * 1e6)
        self.retry_seconds = retry_seconds
        self.client_name = client_name
        self.sink = sink
        self._url = r.amqp_url.get_secret_value()
        params = parse_url(self._url)
        self.where = params.where
        self._user = params.user
        # whether this connection may publish another user's user-id (None: not known)
        self._impersonate: bool | None = None
        self._impersonate_said: tuple[bool | None, str] | None = None  # logged once per change
        self._conn: Connection | None = None
        self._lanes: dict[str, _Lane] = {}
        self._by_channel: dict[int, _Lane] = {}
        self._progress: dict[str, Progress] = {}
        self._live_key, self._live_at = "", 0.0
        self._pending = 0  # publishes not yet settled, all exchanges
        self._lock: contextlib.ExitStack | None = None
        self._messages = MessagesTable(self.table_path)
        self._backoff = 0.0
        self._next_connect = 0.0
        self._dirty = False
        self._saved_at = 0.0
        self._events: list[dict[str, Any]] = []  # not yet returned by step / run / close
        self._unsunk: list[dict[str, Any]] = []  # not yet accepted by the sink
        self._unsunk_saved = True  # every event in _unsunk is in the saved progress file
        self._saved_events = False  # the saved file holds events the sink may have taken since
        self._result = StepResult()
        self._approved_error: str | None = None
        self._last: tuple[dict[str, list[FileStat]] | None, set[str]] = (None, set())
        self._view: GapView | None = None  # the landing's holes, read every pass
        self._view_error: str | None = None
        self._blocked: str | None = None  # the broker's connection.blocked reason, as reported
        self._waiting: tuple[float | None, threading.Event | None] = (None, None)
        # the hold-back's monotonic start per hole, per exchange (holdback.plan_release); not
        # on the lanes, which are rebuilt at every reconnect
        self._hold_since: dict[str, HoldSince] = {}

    def __repr__(self) -> str:
        return f"Replayer({str(self.table_path)!r} -> {self.where})"

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public --------------------------------------------------------------------------------
    def step(self, *, wait_confirms: bool = True) -> StepResult:
        """One pass over the approved exchanges: read each one's next batch, publish it; with
        ``wait_confirms`` wait (up to 30 s) for the confirms before saving progress."""
        return self._step(None, None, wait_confirms)

    def run(
        self,
        *,
        until_caught_up: bool = False,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> ReplaySummary:
        """Pass after pass until ``stop`` is set, ``timeout`` seconds passed or (with
        ``until_caught_up``) nothing approved is left to confirm; never raises for a broker
        that is down or refusing. Closes the instance at the end."""
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        summary = ReplaySummary()
        try:
            while not self._should_stop(deadline, stop):
                r = self._step(deadline, stop, False)
                summary.add(r)
                if r.settled and until_caught_up:  # caught up, or the rest stopped: say which
                    break
                if self._conn is None:  # no table yet, or the broker is unavailable
                    pause = self._next_connect - time.monotonic()
                    self._sleep(pause if pause > 0 else self.poll_seconds, deadline, stop)
                    continue
                if r.published == 0:
                    if self._pending:
                        summary.add(self._guarded_drain(deadline, stop, self.poll_seconds))
                    elif r.caught_up or r.error or r.held:
                        self._sleep(self.poll_seconds, deadline, stop)
                    else:  # a rewind or a retry is due: hardly a pause
                        self._sleep(min(self.poll_seconds, 0.01), deadline, stop)
        finally:
            summary.add(self._finish(), final=True)
            summary.seconds = time.monotonic() - t0
        return summary

    def close(self) -> StepResult:
        """Wait briefly for outstanding confirms, save progress, emit pending events, close the
        connection and release the lock; idempotent. Returns what the closing did."""
        return self._finish()

    def status(self) -> dict[str, Any]:
        """Per exchange: approved, progress, lag (rows in later landing commits), in flight,
        stopped (why); rows waiting per exchange not approved. Reads the Delta log only."""
        approved = self._approved()
        ours = self._lock is not None  # this is the running replay, or another process asks
        progress = dict(self._progress) if ours else self._load_progress_safe()
        live = self._live_doc() if ours else read_live(self.state_dir)
        stats = self._messages.stats()
        lanes = live.get("exchanges", {}) if isinstance(live.get("exchanges"), dict) else {}
        names = set(approved) | set(progress) | set(stats or {}) | set(lanes)
        out: dict[str, Any] = {}
        for name in sorted(names):
            lane = self._lanes.get(name)
            p = lane.progress if lane else progress.get(name)
            now = lanes.get(name)
            now = now if isinstance(now, dict) else {}  # the file is read, not trusted
            out[name] = {
                "approved": name in approved,
                "progress": _shown(p) if p else None,
                "lag_rows": lag_rows(stats, name, p.land_seq if p else -1),
                "in_flight": now.get("in_flight", 0),
                "stopped": now.get("stopped"),
                "held": now.get("held"),
            }
        return {
            "target": self.where,
            "live": {k: v for k, v in live.items() if k != "exchanges"},
            "connected": self._conn is not None and self._conn.is_open,
            "approved": sorted(approved),
            "approvals_error": self._approved_error,
            "exchanges": out,
            "unapproved_waiting": {
                n: d["lag_rows"] for n, d in out.items() if not d["approved"] and d["lag_rows"]
            },
        }

    # -- what the running replay shows other processes ----------------------------------------
    def _live_doc(self, *, closed: bool = False) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "written_at": now_text(),
            "pid": os.getpid(),
            "running": not closed,
            "connected": self._conn is not None and self._conn.is_open,
            "broker_blocked": self._blocked,
            "may_impersonate": self._impersonate,
            "exchanges": {
                name: {"held": lane.held, "stopped": lane.blocked, "in_flight": len(lane.window)}
                for name, lane in sorted(self._lanes.items())
            },
        }

    def _write_live(self, *, closed: bool = False) -> None:
        """Rewrite LIVE_FILE when a hold, a stop or the connection changed, or every LIVE_EVERY
        seconds (its ``written_at`` then tells a reader the replay is alive); never fails a
        pass."""
        doc = self._live_doc(closed=closed)
        key = json.dumps(  # in_flight moves every pass: it only refreshes with the period
            [doc["running"], doc["connected"], doc["broker_blocked"], doc["may_impersonate"],
             [(n, x["held"], x["stopped"]) for n, x in doc["exchanges"].items()]],
            default=str,
        )  # fmt: skip
        now = time.monotonic()
        if not closed and key == self._live_key and now - self._live_at < replay_state.LIVE_EVERY:
            return
        try:
            atomic_write_bytes(self.state_dir / LIVE_FILE, json.dumps(doc, indent=1).encode())
        except OSError as e:
            log_event(log, 30, "replay status file not written", error=str(e))
            return
        self._live_key, self._live_at = key, now

    # -- the pass ------------------------------------------------------------------------------
    def _step(self, deadline: float | None, stop: threading.Event | None, wait: bool) -> StepResult:
        t0 = time.monotonic()
        self._open()
        res = self._result = StepResult()
        approved = self._approved()
        missing = False
        try:
            stats = self._messages.stats()
            missing = stats is None
        except _TABLE_ERRORS as e:
            stats = None
            self._table_failed(e)
        self._sync_lanes(approved)
        self._update_lag(stats, approved)
        self._last = (stats, approved)
        self._view = self._gap_view()
        self._waiting = (deadline, stop)
        if stats is not None and self._connect(res):
            try:
                self._pass(stats, deadline, stop)
                if wait:
                    self._drain(deadline, stop, DRAIN_SECONDS)
            except _Stop:
                pass
            except AmqpInterrupted as e:  # stopping while a send waited for the broker
                log_event(log, 20, "stopped while the red broker read nothing of a publish "
                          f"({'blocked: ' + self._blocked if self._blocked else 'not reading'})"
                          "; the unconfirmed publishes are sent again at the next start",
                          target=self.where, error=str(e))  # fmt: skip
                self._drop_connection()
            except _TableError as e:
                res.error = str(e)
                stats = None  # not known to be caught up
            except BrokerError as e:
                self._lost(e)
        if (
            self._conn is not None
            and self._conn.is_open
            and not self._pending
            and not any(lane.suspect_until is not None for lane in self._lanes.values())
        ):
            self._backoff = 0.0  # connected and nothing unconfirmed: the link is healthy
        self._end_pass(force_save=True)
        res.stopped = self._stopped()
        if missing:
            res.error = f"no messages table at {self.table_path} yet (the red job creates it)"
            res.caught_up = res.settled = True  # nothing landed, nothing to replay
        elif stats is not None:
            res.settled = self._conn is not None and all(
                lane.retired
                or lane.blocked is not None
                or (lane.caught_up and not len(lane.window))
                for lane in self._lanes.values()
            )
            res.caught_up = res.settled and not res.stopped  # a stopped exchange is behind
        res.held = sum(1 for lane in self._lanes.values() if lane.held is not None)
        METRICS.held.set(res.held)
        self._write_live()
        res.events = self._take_events()
        res.seconds = time.monotonic() - t0
        return res

    def _pass(self, stats: dict[str, list[FileStat]], deadline: float | None, stop: Any) -> None:
        now = time.monotonic()
        lanes = [self._lanes[n] for n in sorted(self._lanes)]
        suspects = [lane for lane in lanes if lane.suspect_until is not None and not lane.retired
                    and (lane.blocked is None or now >= lane.retry_at)]  # fmt: skip
        if suspects:  # the broker closed the connection on one of them: find which, alone
            if self._ready(suspects[0], now):
                self._probe(suspects[0], stats.get(suspects[0].name, []), deadline, stop)
            self._pump(0.0)
            return
        for lane in lanes:
            self._check_stop(deadline, stop)
            if self._ready(lane, now):
                self._publish_lane(lane, stats.get(lane.name, []), deadline, stop)
        self._pump(0.0)

    def _ready(self, lane: _Lane, now: float) -> bool:
        """Whether ``lane`` may publish this pass (not revoked, not stopped until later, no
        nack to settle first); retries a stopped lane and rewinds after a nack."""
        if lane.retired:
            return False
        if lane.blocked is not None:
            if now < lane.retry_at:
                return False
            log_event(log, 20, "retrying a stopped exchange", exchange=lane.name,
                      reason=lane.blocked)  # fmt: skip
            lane.blocked = None
        if lane.window.nacked:
            if lane.window.pending:
                return False  # let the rest settle first, then rewind
            self._after_nack(lane)
            if lane.blocked is not None:
                return False
        return True

    def _probe(self, lane: _Lane, files: list[FileStat], deadline: float | None, stop: Any) -> None:
        """Publish ``lane`` one row at a time, each confirmed before the next, up to where it
        was when the broker closed the connection: if the broker closes it again, this row is
        the cause (:meth:`_lost`). The other exchanges wait meanwhile."""
        while lane.suspect_until is not None:
            self._check_stop(deadline, stop)
            if lane.progress.key >= lane.suspect_until:
                log_event(log, 20, "exchange confirmed again after the broker closed the "
                          "connection: publishing as usual", exchange=lane.name)  # fmt: skip
                lane.suspect_until = None
                return
            before = lane.progress.key
            self._publish_lane(lane, files, deadline, stop, limit=1)
            if lane.blocked is not None or lane.window.nacked:
                return
            if not len(lane.window):
                if lane.progress.key == before:  # held, caught up or waiting: nothing to find
                    lane.suspect_until = None
                continue
            self._drain(deadline, stop, DRAIN_SECONDS)
            if len(lane.window):
                return  # no confirm in time: the next pass goes on

    def _publish_lane(
        self,
        lane: _Lane,
        files: list[FileStat],
        deadline: float | None,
        stop: Any,
        *,
        limit: int | None = None,
    ) -> None:
        """Read ``lane``'s next batch and publish it (at most ``limit`` rows: a probe)."""
        why = name_problem(lane.name)
        if why is not None:
            self._block(lane, "bad_name", None, f"exchange {lane.name!r} cannot be replayed: {why}")
            return
        while True:
            lo = max(lane.cursor[0], lane.read_through + 1, 0)
            try:
                batch, hi = self._messages.read(
                    lane.name, lane.cursor, files, lo, self._batch_rows(lane),
                    self._view.land_seq if self._view is not None else None,
                )  # fmt: skip
            except _TABLE_ERRORS as e:
                self._table_failed(e)
                raise _TableError(self._result.error) from e
            if batch is None or hi is None:
                lane.caught_up = True
                lane.held = None
                return
            if batch.num_rows:
                lane.row_bytes = batch.nbytes / batch.num_rows
            last_read = self._last_key(batch)
            if lane.early:  # kept in lane.early until the cursor passes them (a cut batch
                batch = self._without_early(lane, batch)  # reads them again)
            if batch.num_rows:
                break
            lane.read_through = hi  # every row up to hi was published already: look further
            if last_read is not None and last_read > lane.cursor:  # all published as fillers
                lane.cursor = last_read
                lane.forget_passed()
                self._catch_up_progress(lane)
        lane.caught_up = False
        batch, whole = self._hold(lane, batch)
        if limit is not None and batch.num_rows > limit:
            batch, whole = batch.slice(0, limit), False
        if not batch.num_rows:
            return  # waiting at its first row for a gap to fill
        keyed = batch.num_rows
        keyed_last = self._last_key(batch)
        try:
            fill = self._fillers(lane, batch, hi) if limit is None else None
        except _TABLE_ERRORS as e:
            self._table_failed(e)
            raise _TableError(self._result.error) from e
        if fill is not None:
            batch = pa.concat_tables([batch, fill])
        cols = {name: batch.column(name).to_pylist() for name in PUBLISHED}
        keys = list(zip(cols["land_seq"], cols["channel"], cols["seq"], strict=True))
        order, marks = publish_order(cols["channel"], cols["seq"], keyed)
        mark_keys: list[Key] | None = None
        fill_keys: set[Key] = set(keys[keyed:])
        if marks != list(range(1, len(keys) + 1)):
            start = lane.cursor
            mark_keys = [keys[m - 1] if m else start for m in marks]
            cols = {name: [v[i] for i in order] for name, v in cols.items()}
            keys = [keys[i] for i in order]
        if self.id_header:
            cols["properties_raw"] = [
                self._with_id(lane, p, f"{k[1]}:{k[2]}")
                for p, k in zip(cols["properties_raw"], keys, strict=True)
            ]
        bad = self._unpublishable(lane, cols, keys)
        if bad:
            keep = [i for i in range(len(keys)) if i not in bad]
            cols = {name: [v[i] for i in keep] for name, v in cols.items()}
            keys = [keys[i] for i in keep]
            if mark_keys is not None:
                mark_keys = [mark_keys[i] for i in keep]
        decls = list(zip(
            cols["exchange_type"], cols["exchange_durable"], cols["exchange_auto_delete"],
            cols["exchange_internal"], cols["exchange_arguments"], strict=True,
        ))  # fmt: skip
        rks, props, bodies = cols["routing_key"], cols["properties_raw"], cols["body"]
        chans, seqs = cols["channel"], cols["seq"]
        name, window, cap = lane.name, lane.window, self.in_flight
        n = len(keys)
        published = i = 0
        try:
            while i < n:
                decl = decls[i]
                if decl != lane.declared and not self._declare(lane, decl, keys[i]):
                    return
                self._wait_window(cap, deadline, stop)
                ch = lane.channel
                if window.nacked or ch is None or lane.blocked is not None:
                    return  # rewind (nack) or failure: the next pass takes it from there
                j = min(n, i + cap - self._pending, i + PUBLISH_CHUNK)
                same = i + 1
                while same < j and decls[same] == decl:  # a chunk has one declaration
                    same += 1
                j = same
                chunk = list(zip(rks[i:j], props[i:j], bodies[i:j], strict=True))
                last = ch.publish_many(name, chunk, mandatory=True)
                chunk_marks = None if mark_keys is None else mark_keys[i:j]
                window.sent_many(
                    last - (j - i) + 1, keys[i:j], chunk_marks,
                    list(zip(rks[i:j], bodies[i:j], strict=True)),
                )  # fmt: skip
                self._pending += j - i
                published += j - i
                self._late(lane, out_of_order(chans[i:j], seqs[i:j], lane.high))
                if fill_keys:
                    lane.early.update(k for k in keys[i:j] if k in fill_keys)
                lane.cursor = keys[j - 1] if chunk_marks is None else chunk_marks[-1]
                i = j
            if keyed_last is not None and keyed_last > lane.cursor:  # skipped rows at the end
                lane.cursor = keyed_last
            if whole:
                lane.read_through = hi
                if last_read is not None and last_read > lane.cursor:  # fillers at the end
                    lane.cursor = last_read
            if whole or bad:
                self._catch_up_progress(lane)
        except AmqpClosed as e:
            if not e.channel:
                raise
            self._channel_closed(e)
        finally:
            lane.forget_passed()
            if published:
                METRICS.published.labels(name).inc(published)
                self._result._count(name, "published", published)

    def _batch_rows(self, lane: _Lane) -> int:
        """Rows to read next for ``lane``: ``batch_rows``, fewer when rows of the size read
        last would pass ``batch_bytes`` (``FIRST_BATCH_ROWS`` while the size is unknown)."""
        if lane.row_bytes <= 0:
            return min(self.batch_rows, FIRST_BATCH_ROWS)
        return max(1, min(self.batch_rows, int(self.batch_bytes / lane.row_bytes)))

    def _unpublishable(self, lane: _Lane, cols: dict[str, list[Any]], keys: list[Key]) -> set[int]:
        """Indices of rows the broker cannot take (see :mod:`bridge.red.replay_check`): skipped,
        each reported once as ``replay_failed`` kind ``bad_row``, or kind ``user_id`` for
        another user's user-id while this connection may not impersonate (they stay landed)."""
        assert self._conn is not None
        frame_max = self._conn.frame_max
        tables_ok = lane.tables_ok
        user = self._user if self._impersonate is False else None
        bad: set[int] = set()
        # (kind, channel, user-id reason) -> [first, last, rows, first reason, first land_seq]
        found: dict[tuple[str, str, str], list[Any]] = {}
        for i, (rk, props) in enumerate(zip(cols["routing_key"], cols["properties_raw"],
                                            strict=True)):  # fmt: skip
            kind, why = "bad_row", row_problem(rk, props, frame_max, tables_ok)
            if why is None and user is not None:
                kind, why = "user_id", user_id_problem(props, user)
            if why is None:
                continue
            bad.add(i)
            k = keys[i]
            if k in lane.bad:
                continue  # reported when first read (read again after a hold or a rewind)
            lane.bad.add(k)
            METRICS.errors.labels(lane.name, kind).inc()
            if kind == "bad_row":  # user_id rows are logged per run of them (one producer's)
                log_event(log, 40, "row cannot be published to the red broker: skipped (it "
                          "stays landed)", exchange=lane.name, land_seq=k[0], channel=k[1],
                          seq=k[2], reason=why)  # fmt: skip
            group = (kind, k[1], why if kind == "user_id" else "")
            f = found.get(group)
            if f is None:
                found[group] = [k[2], k[2], 1, why, k[0]]
            else:
                f[0], f[1], f[2] = min(f[0], k[2]), max(f[1], k[2]), f[2] + 1
        for (kind, channel, _), (first, last, rows, why, land_seq) in found.items():
            seqs = f"seq {first}" if first == last else f"seqs {first}..{last} ({rows} rows)"
            if kind == "user_id":
                log_event(log, 40, "rows carry another user's user-id and the replay user may "
                          "not publish it: skipped (they stay landed)", exchange=lane.name,
                          land_seq=land_seq, channel=channel, seq_first=first, seq_last=last,
                          rows=rows, reason=why)  # fmt: skip
            self._event(
                "replay_failed", lane.name, channel=channel, seq_first=first, seq_last=last,
                reason=f"channel {channel!r} {seqs} of exchange {lane.name!r} cannot be "
                f"published to the red broker and {'was' if rows == 1 else 'were'} skipped "
                f"(still landed): {why}",
                detail={"kind": kind, "rows": rows, "land_seq": land_seq},
            )  # fmt: skip
        return bad

    # -- hold-back (bridge.red.holdback) -------------------------------------------------------
    def _gap_view(self) -> GapView | None:
        """The landing's open holes and how far its state goes; None without a state file
        (tables not written by a red job: nothing is held)."""
        try:
            saved = read_saved_state(self.state_dir)
        except (OSError, KeyError, TypeError, ValueError, DiodeError) as e:
            path = self.state_dir / STATE_FILE
            msg = f"red state {path} unreadable ({e}): replaying without the gap hold-back"
            if msg != self._view_error:
                log_event(log, 40, msg)
            self._view_error = msg
            return None
        self._view_error = None
        return None if saved is None else GapView.from_state(saved.land_seq, saved.sequence)

    def _without_early(self, lane: _Lane, table: pa.Table) -> pa.Table:
        """``table`` without the rows published ahead of their key as fillers. They stay in
        ``lane.early`` until the cursor passes them (:meth:`_Lane.forget_passed`): a batch cut
        by the hold-back, a stop or a failure reads them again."""
        early = lane.early
        keep = [k not in early for k in self._keys_of(table)]
        return table if all(keep) else table.filter(pa.array(keep))

    def _hold(self, lane: _Lane, batch: pa.Table) -> tuple[pa.Table, bool]:
        """Cut ``batch`` at the first row above an open gap still within its hold; returns the
        rows to publish now and whether that is all of them."""
        view = self._view
        if view is None or not view.holes:
            lane.held = None
            return batch, True
        chans = batch.column("channel").to_pylist()
        if not any(c in view.holes for c in set(chans)):
            lane.held = None
            return batch, True
        seqs = batch.column("seq").to_pylist()
        landed = pc.cast(batch.column("landed_at"), pa.int64()).to_pylist()
        now_us = time.time_ns() // 1000
        rel = plan_release(
            chans, seqs, landed, view, lane.progress.passed, now_us, self.hold_us,
            since=self._hold_since.setdefault(lane.name, {}),
            mono_us=time.monotonic_ns() // 1000,
        )  # fmt: skip
        for p in rel.passed:
            self._dirty = True
            METRICS.gaps_passed.labels(lane.name).inc()
            detail = {
                "first_bundle_seq": p.hole.first_bundle_seq,
                "last_bundle_seq": p.hole.last_bundle_seq,
                "held_seconds": round(p.held_us / 1e6, 3),
            }
            log_event(log, 30, "replay went past an open gap after its hold-back",
                      exchange=lane.name, channel=p.channel, seq=p.seq, **detail)  # fmt: skip
            self._event("replay_gap_passed", lane.name, channel=p.channel, seq_first=p.seq,
                        seq_last=p.seq, reason="hold_expired", detail=detail)  # fmt: skip
        if rel.held is None:
            lane.held = None
            return batch, True
        _, ch, seq, hole, until = rel.held
        held = {
            "channel": ch,
            "seq": seq,
            "first_bundle_seq": hole.first_bundle_seq,
            "last_bundle_seq": hole.last_bundle_seq,
            "until": format_utc(datetime.fromtimestamp(until / 1e6, UTC)),
        }
        if lane.held is None or lane.held["first_bundle_seq"] != hole.first_bundle_seq:
            log_event(log, 20, "replay holds an exchange for an open gap", exchange=lane.name,
                      **held)  # fmt: skip
        lane.held = held
        return batch.slice(0, rel.count), False

    def _fillers(self, lane: _Lane, batch: pa.Table, hi: int) -> pa.Table | None:
        """Rows of this exchange landed after ``hi`` (but judged) with seqs below the batch's
        highest of their channel: a late bundle that fills a gap, published in seq order."""
        view = self._view
        if view is None or hi >= view.land_seq:
            return None
        top = batch.group_by("channel").aggregate([("seq", "max")])
        below = dict(zip(top["channel"].to_pylist(), top["seq_max"].to_pylist(), strict=True))
        table = self._messages.fillers(lane.name, below, hi, view.land_seq)
        if table is not None and lane.early:  # published as fillers by an earlier batch
            table = self._without_early(lane, table)
        return table if table is not None and table.num_rows else None

    def _catch_up_progress(self, lane: _Lane) -> None:
        """Every row up to the cursor was published (some ahead, as fillers); with nothing
        left unconfirmed, the progress may move there even without a confirm."""
        p = lane.progress
        if len(lane.window) or lane.cursor <= p.key:
            return
        p.land_seq, p.channel, p.seq = lane.cursor
        p.updated_at = None
        if p.ahead:
            self._confirmed_ahead(lane, [])
        self._progress[lane.name] = p
        self._dirty = True

    def _confirmed_ahead(self, lane: _Lane, ahead: list[Key]) -> None:
        """Remember ``ahead`` (rows confirmed before their key) in the progress, saved with it
        so a restart does not publish them again; forget what the progress key passed."""
        p = lane.progress
        key = p.key
        kept = {k for k in p.ahead if k > key}
        room = AHEAD_MAX - len(kept)
        if len(ahead) > room:
            log_event(log, 30, "too many rows confirmed ahead of the progress to remember: a "
                      "restart republishes them (duplicates, no loss)", exchange=lane.name,
                      rows=len(ahead) - max(room, 0), limit=AHEAD_MAX)  # fmt: skip
            ahead = ahead[: max(room, 0)]
        kept.update(ahead)
        p.ahead = kept

    @staticmethod
    def _last_key(table: pa.Table) -> Key | None:
        n = table.num_rows
        return Replayer._keys_of(table.slice(n - 1))[0] if n else None

    @staticmethod
    def _keys_of(table: pa.Table) -> list[Key]:
        return list(zip(table.column("land_seq").to_pylist(), table.column("channel").to_pylist(),
                        table.column("seq").to_pylist(), strict=True))  # fmt: skip

    def _late(self, lane: _Lane, found: dict[str, Any]) -> None:
        """Audit rows published below a seq of their channel already published."""
        for ch, o in found.items():
            METRICS.out_of_order.labels(lane.name).inc(o.rows)
            detail = {"rows": o.rows, "behind_seq": o.behind}
            log_event(log, 30, "replayed messages out of order (they landed after the hold-back "
                      "went past their gap)", exchange=lane.name, channel=ch, seq_first=o.first,
                      seq_last=o.last, **detail)  # fmt: skip
            self._event("replayed_out_of_order", lane.name, channel=ch, seq_first=o.first,
                        seq_last=o.last, reason="late", detail=detail)  # fmt: skip

    def _table_failed(self, e: BaseException) -> None:
        self._messages.reset()  # re-opened next pass
        msg = f"messages table at {self.table_path} unreadable this pass: {type(e).__name__}: {e}"
        log_event(log, 40, msg)
        self._result.error = msg

    def _with_id(self, lane: _Lane, props: bytes, value: str) -> bytes:
        try:
            return with_id_header(props, self.id_header, value)
        except ProtocolError as e:
            if not lane.no_id_header:
                log_event(log, 30, "property bytes do not decode: published without the id header",
                          exchange=lane.name, id=value, error=str(e))  # fmt: skip
            lane.no_id_header += 1
            return props

    # -- declarations ----------------------------------------------------------------------------
    def _check_builtin(self, lane: _Lane, decl: Decl, at: Key) -> bool:
        """An ``amq.*`` exchange is the broker's own: never declared (the broker refuses the
        reserved prefix), only checked to exist, then published to."""
        try:
            self._lane_channel(lane).exchange_declare(lane.name, decl[0], passive=True)
        except AmqpClosed as e:
            if not e.channel:
                raise
            self._block(
                lane, "declare", at,
                f"built-in exchange {lane.name!r} does not exist on red ({e.reply_code} "
                f"{e.reply_text}): amq.* names are the broker's own and are never declared",
            )  # fmt: skip
            return False
        lane.declared = decl
        log_event(log, 20, "built-in exchange: published to, not declared", exchange=lane.name)
        return True

    def _declare(self, lane: _Lane, decl: Decl, at: Key) -> bool:
        """Declare ``lane``'s exchange as ``decl`` says; False (exchange stopped) if refused."""
        xtype, durable, auto_delete, internal, arguments = decl
        ch = self._lane_channel(lane)
        what = _describe(lane.name, decl)
        if xtype == UNKNOWN_EXCHANGE_TYPE:
            try:
                ch.exchange_declare(lane.name, "direct", passive=True)
            except AmqpClosed as e:
                if not e.channel:
                    raise
                self._block(
                    lane, "unknown_type", at,
                    f"black did not know the type of exchange {lane.name!r} (not in its "
                    f"catalog) and it does not exist on red ({e.reply_code} {e.reply_text}): "
                    "declare it on the red broker to replay it",
                )  # fmt: skip
                return False
            log_event(log, 30, "exchange type unknown on black: publishing to the existing red "
                      "exchange", exchange=lane.name)  # fmt: skip
            lane.declared = decl
            return True
        if lane.name == "":  # the default exchange: always there, never declared or checked
            lane.declared = decl
            return True
        if lane.name.startswith("amq."):
            return self._check_builtin(lane, decl, at)
        try:
            declare_as_landed(ch, lane.name, decl)
        except ProtocolError as e:
            self._block(lane, "bad_arguments", at, f"{what}: arguments do not decode: {e}")
            return False
        except AmqpClosed as e:
            self._block(
                lane, "declare", at,
                f"the red broker refused to declare {what}: {e.reply_code} {e.reply_text}",
            )  # fmt: skip
            if not e.channel:  # e.g. 503 unknown exchange type closes the whole connection
                raise
            return False
        lane.declared = decl
        log_event(log, 20, "exchange declared", exchange=lane.name, type=xtype, durable=durable,
                  auto_delete=auto_delete, internal=internal, arguments=arguments)  # fmt: skip
        if internal:
            self._block(
                lane, "internal", at,
                f"{what} is internal: clients cannot publish to it (declared on red, its rows "
                "stay landed)",
            )  # fmt: skip
            return False
        return True

    def _lane_channel(self, lane: _Lane) -> Channel:
        ch = lane.channel
        if ch is not None and ch.is_open:
            return ch
        assert self._conn is not None
        ch = self._conn.channel()
        ch.confirm_select()
        lane.channel = ch
        lane.declared = None
        self._by_channel[ch.number] = lane
        return ch

    # -- confirms --------------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Read what the broker sent (waiting up to ``timeout``) and apply the confirms."""
        assert self._conn is not None
        try:
            ev = self._conn.poll(timeout)
        except AmqpClosed as e:
            if not e.channel:
                raise
            self._channel_closed(e)
            return
        finally:
            self._note_blocked()
        touched: dict[int, _Lane] = {}
        by_channel = self._by_channel
        for r in ev.returns:  # before the confirms: each return comes before its own confirm
            self._returned(by_channel.get(r.channel), r)
        for c in ev.confirms:
            lane = by_channel.get(c.channel)
            if lane is None:
                continue
            self._pending -= lane.window.confirm(c.delivery_tag, c.multiple, c.ack)
            touched[c.channel] = lane
        for lane in touched.values():
            self._advance(lane)
        if (
            self._dirty
            and time.monotonic() - self._saved_at >= SAVE_EVERY
            and not any(lane.unroutable for lane in self._lanes.values())
        ):  # unroutable counts are audited (pass end) before the progress goes past them
            self._save()

    def _advance(self, lane: _Lane) -> None:
        keys, mark = lane.window.pop_acked_marked()
        if not keys or mark is None:
            return
        n = len(keys)
        p = lane.progress
        p.land_seq, p.channel, p.seq = mark
        p.confirmed_rows += n
        p.updated_at = None  # set when saved
        ahead = [k for k in keys if k > mark]  # fillers confirmed before their key
        if ahead or p.ahead:
            self._confirmed_ahead(lane, ahead)
        self._progress[lane.name] = p
        self._dirty = True
        self._backoff = 0.0  # the broker takes publishes again: the next loss starts at 1 s
        lane.rewinds = 0
        lane.deaths = 0
        lane.reported = None  # a later failure is a new episode: reported again
        acc = lane.replayed
        high = p.high
        for land_seq, channel, seq in keys:
            if seq > high.get(channel, -1):
                high[channel] = seq
            a = acc.get(channel)
            if a is None:
                acc[channel] = [seq, seq, 1, land_seq, land_seq]
            else:
                if seq < a[0]:
                    a[0] = seq
                if seq > a[1]:
                    a[1] = seq
                a[2] += 1
                a[4] = land_seq
        METRICS.confirmed.labels(lane.name).inc(n)
        self._result._count(lane.name, "confirmed", n)
        self._catch_up_progress(lane)

    def _returned(self, lane: _Lane | None, r: Returned) -> None:
        """The broker returned a mandatory publish: no binding on red routes it. It was taken
        (and is confirmed), so the progress goes past it; counted, audited as ``replay_failed``
        kind ``unroutable`` per channel and seq range (:meth:`_flush_unroutable`), logged."""
        name = lane.name if lane is not None else r.exchange
        METRICS.unroutable.labels(name).inc()
        if lane is None:
            log_event(log, 30, "red broker returned a message of a channel no longer in use",
                      exchange=r.exchange, routing_key=r.routing_key,
                      reply=f"{r.reply_code} {r.reply_text}")  # fmt: skip
            return
        key = lane.window.returned(r.routing_key, r.body)
        channel, seq = (key[1], key[2]) if key is not None else ("", -1)
        if not lane.unroutable:
            log_event(log, 30, "red broker returned messages as unroutable: no binding on red "
                      "routes them (confirmed and dropped by the broker)", exchange=lane.name,
                      channel=channel, seq=seq, routing_key=r.routing_key,
                      reply=f"{r.reply_code} {r.reply_text}")  # fmt: skip
        lane.unroutable_why = f"{r.reply_code} {r.reply_text}"
        a = lane.unroutable.get(channel)
        if a is None:
            lane.unroutable[channel] = [seq, seq, 1]
        else:
            a[0], a[1], a[2] = min(a[0], seq), max(a[1], seq), a[2] + 1

    def _flush_unroutable(self, lane: _Lane) -> None:
        acc, lane.unroutable = lane.unroutable, {}
        for channel in sorted(acc):
            first, last, rows = acc[channel]
            log_event(log, 30, "messages replayed to an exchange were unroutable on red",
                      exchange=lane.name, channel=channel, seq_first=first, seq_last=last,
                      rows=rows, reply=lane.unroutable_why)  # fmt: skip
            self._event(
                "replay_failed", lane.name, channel=channel or None,
                seq_first=first if first >= 0 else None, seq_last=last if last >= 0 else None,
                reason=f"the red broker returned {rows} message(s) of channel {channel!r} "
                f"published to exchange {lane.name!r} ({lane.unroutable_why}): no queue on red "
                "is bound to receive them; the broker dropped them",
                detail={"kind": "unroutable", "rows": rows, "reply": lane.unroutable_why},
            )  # fmt: skip

    def _wait_window(self, cap: int, deadline: float | None, stop: Any) -> None:
        """Read confirms; while ``cap`` publishes are pending, wait for them."""
        self._pump(0.0)
        while self._pending >= cap:
            self._check_stop(deadline, stop)
            self._pump(0.5)

    def _drain(self, deadline: float | None, stop: Any, limit: float) -> None:
        """Wait up to ``limit`` seconds for every pending publish to be settled."""
        end = time.monotonic() + limit
        while self._pending > 0 and self._conn is not None:
            self._check_stop(deadline, stop)
            left = end - time.monotonic()
            if left <= 0:
                return
            self._pump(min(left, 0.5))

    def _guarded_drain(self, deadline: float | None, stop: Any, limit: float) -> StepResult:
        """Between passes: wait for confirms; returns what they confirmed."""
        t0 = time.monotonic()
        res = self._result = StepResult()
        try:
            self._drain(deadline, stop, limit)
        except _Stop:
            pass
        except BrokerError as e:
            self._lost(e)
        self._end_pass(force_save=False)
        res.events = self._take_events()
        res.seconds = time.monotonic() - t0
        res.caught_up = False
        res.stopped = self._stopped()
        return res

    def _stopped(self) -> dict[str, str]:
        """Red, replay: the approved exchanges stopped now (blocked until a retry), and why."""
        return {
            name: lane.blocked
            for name, lane in sorted(self._lanes.items())
            if lane.blocked is not None and not lane.retired
        }

    def _after_nack(self, lane: _Lane) -> None:
        """Every publish of ``lane`` is settled and one was nacked: rewind and republish."""
        self._pending -= lane.rewind()
        lane.rewinds += 1
        METRICS.errors.labels(lane.name, "nack").inc()
        key = lane.progress.key
        if lane.rewinds > MAX_NACK_RETRIES:
            self._block(
                lane, "nack", None,
                f"the red broker nacked publishes to exchange {lane.name!r} after land_seq "
                f"{key[0]} channel {key[1]!r} seq {key[2]} {MAX_NACK_RETRIES + 1} times "
                "(a queue bound to it refusing messages, e.g. x-overflow=reject-publish?)",
            )  # fmt: skip
            lane.rewinds = 0
            return
        log_event(log, 30, "broker nacked a publish: republishing from the confirmed progress",
                  exchange=lane.name, land_seq=key[0], channel=key[1], seq=key[2],
                  attempt=lane.rewinds)  # fmt: skip

    # -- failures --------------------------------------------------------------------------------
    def _reset_lane(self, lane: _Lane) -> None:
        """Close ``lane``'s channel and rewind it to its confirmed progress."""
        ch = lane.channel
        lane.channel = None
        lane.declared = None
        if ch is not None:
            self._by_channel.pop(ch.number, None)
            if ch.is_open:
                with contextlib.suppress(BrokerError):
                    ch.close()
        self._pending -= lane.rewind()

    def _block(self, lane: _Lane, kind: str, at: Key | None, reason: str) -> None:
        """Stop ``lane`` (its channel closed, rewound to its progress) until ``retry_at``."""
        self._reset_lane(lane)
        lane.blocked, lane.blocked_kind = reason, kind
        lane.retry_at = time.monotonic() + self.retry_seconds
        METRICS.errors.labels(lane.name, kind).inc()
        self._flush_replayed(lane)
        if lane.reported == reason:
            log_event(log, 10, "exchange still failing", exchange=lane.name, reason=reason)
            return
        lane.reported = reason
        log_event(log, 40, "replay of an exchange stopped", exchange=lane.name, kind=kind,
                  reason=reason, retry_seconds=self.retry_seconds)  # fmt: skip
        self._event(
            "replay_failed", lane.name,
            channel=at[1] if at else lane.progress.channel or None,
            seq_first=at[2] if at else None, seq_last=at[2] if at else None,
            reason=reason,
            detail={"kind": kind, "land_seq": at[0] if at else lane.progress.land_seq,
                    "retry_seconds": self.retry_seconds},
        )  # fmt: skip

    def _channel_closed(self, e: AmqpClosed) -> None:
        """The broker closed a lane's channel (e.g. its exchange was deleted on red)."""
        lane = self._by_channel.get(e.channel)
        if lane is None or lane.channel is None or lane.channel.is_open:
            return  # a channel already replaced
        if _user_id_refused(e) and self._impersonate is not False:
            # the probe could not tell: now known, and the next pass skips such rows
            self._impersonate = False
            self._say_impersonation(f"{e.reply_code} {e.reply_text}")
            self._reset_lane(lane)
            log_event(log, 30, "the red broker refused a publish for its user-id: this "
                      "connection may not impersonate, so rows carrying another user's user-id "
                      "are skipped from now on (kind user_id); republishing the exchange from "
                      "its confirmed progress", exchange=lane.name,
                      reply=f"{e.reply_code} {e.reply_text}")  # fmt: skip
            return
        self._block(
            lane, "channel_closed", None,
            f"the red broker closed the channel publishing to exchange {lane.name!r}: "
            f"{e.reply_code} {e.reply_text}",
        )  # fmt: skip

    def _lost(self, e: BrokerError) -> None:
        """The connection failed: forget everything unconfirmed, reconnect later (back-off
        doubling until a publish is confirmed again). If the broker closed it while publishes
        were unconfirmed, those exchanges are suspects: published one row at a time until
        they are confirmed again; a suspect's row the broker closes the connection for
        ``MAX_CONNECTION_DEATHS`` times stops its exchange (``replay_failed``, kind
        ``connection``)."""
        log_event(log, 30, "red broker connection lost: resuming from the confirmed progress "
                  "after reconnecting", target=self.where, error=str(e))  # fmt: skip
        METRICS.errors.labels("", "connection").inc()
        self._result.error = f"red broker at {self.where}: {e}"
        busy = [lane for lane in self._lanes.values() if len(lane.window)]
        closed = isinstance(e, AmqpClosed) and not e.channel and e.reply_code != 320
        culprit: tuple[_Lane, Key] | None = None
        if closed and len(busy) == 1 and busy[0].suspect_until is not None:  # a probe
            lane = busy[0]
            lane.deaths += 1
            if lane.deaths >= MAX_CONNECTION_DEATHS:
                culprit = (lane, lane.window.keys()[0])
        elif closed:
            for lane in busy:
                lane.suspect_until = max(lane.cursor, lane.suspect_until or START)
        self._drop_connection()
        self._schedule_reconnect()
        if culprit is not None:
            lane, at = culprit
            self._block(
                lane, "connection", at,
                f"the red broker closed the connection ({e}) {lane.deaths} times when exchange "
                f"{lane.name!r} was published channel {at[1]!r} seq {at[2]} (land_seq {at[0]}) "
                "alone: that row is refused (stopped, retried later; the other exchanges go on)",
            )  # fmt: skip

    def _interrupted(self) -> bool:
        """The connection's interrupt hook: a send waits for the broker to read (it blocked
        the connection for an alarm); say so, and give up the send once the run must stop."""
        self._note_blocked()
        return self._should_stop(*self._waiting)

    def _note_blocked(self) -> None:
        """Report the broker's connection.blocked / unblocked once each (log, gauge, live
        status): a publisher held by a memory or disk alarm is never silent."""
        now = self._conn.blocked if self._conn is not None else None
        if now == self._blocked:
            return
        if now is not None:
            log_event(log, 40, "the red broker blocked the replay's connection: nothing is "
                      "published until its memory or disk alarm clears (`rabbitmqctl status` "
                      "on the red broker lists alarms); waiting", target=self.where,
                      reason=now)  # fmt: skip
        else:
            log_event(log, 20, "the red broker unblocked the replay's connection",
                      target=self.where)  # fmt: skip
        self._blocked = now
        METRICS.broker_blocked.set(0 if now is None else 1)
        self._write_live()

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        self._by_channel.clear()
        self._note_blocked()
        for lane in self._lanes.values():
            lane.channel = None
            lane.declared = None
            self._pending -= lane.rewind()
        self._pending = 0

    def _schedule_reconnect(self) -> None:
        self._backoff = BACKOFF_FIRST if not self._backoff else min(2 * self._backoff, BACKOFF_MAX)
        self._next_connect = time.monotonic() + self._backoff

    def _connect(self, res: StepResult) -> bool:
        if self._conn is not None and self._conn.is_open:
            return True
        if self._conn is not None:
            self._drop_connection()
        wait = self._next_connect - time.monotonic()
        if wait > 0:
            res.error = f"red broker at {self.where} unavailable; next try in {wait:.1f}s"
            return False
        try:
            self._conn = Connection.open(
                self._url, client_name=self.client_name, heartbeat=HEARTBEAT
            )
            self._conn.interrupt = self._interrupted
        except BrokerError as e:
            refused = isinstance(e, AmqpAccessRefused)
            METRICS.errors.labels("", "login_refused" if refused else "connection").inc()
            self._schedule_reconnect()
            res.error = f"red broker at {self.where}: {e}"
            if refused:  # a password or permission changed under a running publisher
                log_event(log, 40, "red broker refused the login or the vhost: nothing is "
                          "published until red.replay.amqp_url's user, password and vhost are "
                          "accepted again (fix them on the broker, or fix the config and "
                          "restart); retrying", target=self.where, error=str(e),
                          retry_seconds=self._backoff)  # fmt: skip
            else:
                log_event(log, 30, "red broker unavailable", target=self.where, error=str(e),
                          retry_seconds=self._backoff)  # fmt: skip
            return False
        if self._backoff:  # kept until a publish is confirmed (a row may kill each connection)
            log_event(log, 20, "red broker connected again", target=self.where)
        self._impersonate, why = self._probe_impersonation()
        self._say_impersonation(why)
        return True

    def _probe_impersonation(self) -> tuple[bool | None, str]:
        """Red, replay connect: whether the replay user may publish another user's user-id
        (RabbitMQ's impersonator tag), and the broker's answer. On a connection of its own,
        opened just after the publisher's (the broker reads tags at login): one confirmed
        publish with user-id PROBE_USER_ID to the default exchange, routing key "" (no queue
        has that name: the broker drops it). An ack says yes; a 406 for the user-id says no.
        None when it cannot tell within PROBE_WAIT: another refusal (e.g. 403, no write on
        amq.default), no connection, a broker that blocks publishers (an alarm: on the
        publisher's own connection that would hold every later declare), a stop."""
        claimed = PROBE_USER_ID if self._user != PROBE_USER_ID else PROBE_USER_ID + "-2"
        try:
            conn = Connection.open(self._url, client_name=f"{self.client_name}-probe",
                                   heartbeat=0, connect_timeout=PROBE_WAIT,
                                   rpc_timeout=PROBE_WAIT)  # fmt: skip
        except BrokerError as e:
            return None, f"no probe connection: {e}"
        try:
            ch = conn.channel()
            ch.confirm_select()
            ch.publish("", "", encode_properties(Properties(user_id=claimed)), b"")
            end = time.monotonic() + PROBE_WAIT
            while conn.blocked is None and not self._should_stop(*self._waiting):
                if time.monotonic() >= end:
                    return None, f"no answer within {PROBE_WAIT:g}s"
                confirms = conn.poll(0.1).confirms
                if confirms:
                    if confirms[0].ack:
                        return True, "the probe publish was taken"
                    return None, "the probe publish was nacked"
            return None, f"not answered: {conn.blocked or 'stopping'}"
        except AmqpClosed as e:
            if e.channel and _user_id_refused(e):
                return False, f"{e.reply_code} {e.reply_text}"
            return None, f"{e.reply_code} {e.reply_text}"
        except BrokerError as e:
            return None, str(e)
        finally:
            conn.rpc_timeout = 1.0  # a broker that blocked it reads no close either
            conn.close()

    def _say_impersonation(self, why: str) -> None:
        """Red, replay connect: log what the probe found once per change (not per reconnect)."""
        said = (self._impersonate, why if self._impersonate is None else "")
        if said == self._impersonate_said:
            return
        self._impersonate_said = said
        user = self._user
        if self._impersonate is True:
            log_event(log, 20, "the replay user may publish other users' user-ids (impersonator "
                      "tag): user-id properties are replayed as landed", user=user,
                      target=self.where)  # fmt: skip
        elif self._impersonate is False:
            log_event(log, 20, "the replay user may not publish another user's user-id (no "
                      "impersonator tag on the red broker): rows carrying one are skipped, still "
                      "landed, each audited (replay_failed kind user_id); to replay them byte for "
                      f"byte, {impersonation_fix(user)}", user=user, target=self.where,
                      reply=why)  # fmt: skip
        else:  # e.g. write permission on the approved exchanges only (runbook §10)
            log_event(log, 20, "whether the replay user may publish another user's user-id is "
                      "found at the first row carrying one (the red broker refused the probe "
                      "publish to the default exchange): if the broker refuses that row, rows "
                      "carrying another user's user-id are skipped from then on (kind user_id); "
                      f"to replay them byte for byte, {impersonation_fix(user)}", user=user,
                      target=self.where, reply=why)  # fmt: skip

    # -- lanes, approvals, table -------------------------------------------------------------------
    def _open(self) -> None:
        if self._lock is not None:
            return
        durable_mkdir(self.state_dir)
        stack = contextlib.ExitStack()
        stack.enter_context(
            exclusive_lock(
                self.state_dir / LOCK_FILE,
                what=f"replay publisher of {self.state_dir}",
                hint="only one replay publisher may run per red state_dir; stop the other first",
            )
        )
        try:
            self._progress = load_progress(self.state_dir)
        except BaseException:
            stack.close()
            raise
        self._lock = stack
        self._restore_events()

    def _restore_events(self) -> None:
        """Events the last run saved with its progress because its sink had not taken them
        (``unaudited_events``): emitted again and written first, before this run's own."""
        saved = [e for p in self._progress.values() for e in p.unaudited_events]
        if not saved:
            return
        for p in self._progress.values():
            p.unaudited_events = []  # kept with the events not yet written, saved from there
        log_event(log, 20, "replay events the last run did not write to the audit table: "
                  "writing them first", events=len(saved),
                  progress=str(self.state_dir / PROGRESS_FILE))  # fmt: skip
        for ev in saved:
            self._emit(ev)
        self._unsunk_saved = self._saved_events = True
        self._sink()

    def _load_progress_safe(self) -> dict[str, Progress]:
        try:
            return load_progress(self.state_dir)
        except StateError:
            return {}

    def _approved(self) -> set[str]:
        configured = set(self.cfg.red.replay.approved)
        try:
            approved = configured | Approvals.load(self.state_dir).approved()
        except DiodeError as e:
            if self._approved_error != str(e):
                log_event(log, 40, "approvals unreadable: replaying configured exchanges only",
                          error=str(e))  # fmt: skip
            self._approved_error = str(e)
            return configured
        self._approved_error = None
        return approved

    def _sync_lanes(self, approved: set[str]) -> None:
        for name in approved:
            lane = self._lanes.get(name)
            if lane is None:
                p = self._progress.get(name) or Progress()
                # the lane's replayed ranges are the progress's own: saved with it
                self._lanes[name] = _Lane(
                    name, p, cursor=p.key, high=dict(p.high), replayed=p.unaudited,
                    early=set(p.ahead),
                )  # fmt: skip
            elif lane.retired:
                lane.retired = False
                log_event(log, 20, "exchange approved again", exchange=name)
        for name, lane in list(self._lanes.items()):
            if name in approved:
                continue
            if not lane.retired:
                lane.retired = True
                log_event(log, 20, "approval revoked: no new publishes", exchange=name)
            if not lane.window.pending:
                self._flush_replayed(lane)
                ch = lane.channel
                if ch is not None:
                    self._by_channel.pop(ch.number, None)
                    if ch.is_open:
                        with contextlib.suppress(BrokerError):
                            ch.close()
                self._pending -= lane.rewind()
                del self._lanes[name]

    def _update_lag(self, stats: dict[str, list[FileStat]] | None, approved: set[str]) -> None:
        if stats is None:
            return
        for name in set(stats) | approved:
            lane = self._lanes.get(name)
            p = lane.progress if lane else self._progress.get(name)
            lag = lag_rows(stats, name, p.land_seq if p else -1)
            METRICS.lag.labels(name).set(lag or 0)

    # -- events, progress, ending ---------------------------------------------------------------
    def _event(
        self,
        event: str,
        exchange: str,
        *,
        channel: str | None = None,
        seq_first: int | None = None,
        seq_last: int | None = None,
        reason: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        ev = {
            "event": event,
            "exchange": exchange,
            "channel": channel,
            "seq_first": seq_first,
            "seq_last": seq_last,
            "reason": reason,
            "detail": None if detail is None else json.dumps(detail, sort_keys=True),
        }
        self._emit(ev)

    def _emit(self, ev: dict[str, Any]) -> None:
        """Return ``ev`` from this step and hand it to the sink (kept until the sink takes it,
        saved with every progress meanwhile: :meth:`_with_unsunk`)."""
        self._events.append(ev)
        if self.sink is not None:
            self._unsunk.append(ev)
            self._unsunk_saved = False

    def _flush_replayed(self, lane: _Lane) -> None:
        if lane.unroutable:
            self._flush_unroutable(lane)
        acc = dict(lane.replayed)
        lane.replayed.clear()  # in place: it is the saved progress's ``unaudited`` too
        lane.replayed_since = time.monotonic()
        if acc:
            self._dirty = True  # the saved ``unaudited`` must forget them, or a restart repeats
        for channel in sorted(acc):
            first, last, rows, land_first, land_last = acc[channel]
            detail: dict[str, Any] = {
                "rows": rows, "land_seq_first": land_first, "land_seq_last": land_last,
            }  # fmt: skip
            if lane.no_id_header:
                detail["without_id_header"] = lane.no_id_header
            self._event(
                "replayed", lane.name, channel=channel, seq_first=first, seq_last=last,
                detail=detail,
            )  # fmt: skip
        lane.no_id_header = 0

    def _end_pass(self, *, force_save: bool) -> None:
        now = time.monotonic()
        for lane in self._lanes.values():
            if lane.unroutable:  # at every pass end: never left only in memory for long
                self._flush_unroutable(lane)
            if lane.replayed and (
                (lane.caught_up and not len(lane.window))
                or now - lane.replayed_since >= REPLAYED_EVERY
            ):
                self._flush_replayed(lane)
        self._sink()  # before the save that forgets the flushed ranges
        if self._dirty and (force_save or now - self._saved_at >= SAVE_EVERY):
            self._save()

    def _save(self) -> None:
        stamp = now_text()
        for p in self._progress.values():
            if p.updated_at is None:
                p.updated_at = stamp
        save_progress(self.state_dir, self._with_unsunk())
        self._unsunk_saved = True
        self._saved_events = any(e["event"] != "replayed" for e in self._unsunk)
        crash_point("red.replay_after_save")  # tests: what the saved progress went past
        self._dirty = False
        self._saved_at = time.monotonic()
        self._update_lag(*self._last)

    def _with_unsunk(self) -> dict[str, Progress]:
        """The progress to save with the events the sink has not taken yet: ``replayed`` ones
        go back into ``unaudited``, the others into ``unaudited_events`` (an exchange without
        progress gets one at the start for them), so a kill before they reach the audit table
        loses none: the next start writes them first."""
        if not self._unsunk:
            return self._progress
        out = {k: dataclasses.replace(p, unaudited={c: list(v) for c, v in p.unaudited.items()},
                                      unaudited_events=[])
               for k, p in self._progress.items()}  # fmt: skip
        for e in self._unsunk:
            p = out.setdefault(e["exchange"], Progress())
            if e["event"] != "replayed":
                p.unaudited_events.append(e)
                continue
            d = json.loads(e["detail"])
            r = [e["seq_first"], e["seq_last"], d["rows"], d["land_seq_first"], d["land_seq_last"]]
            a = p.unaudited.setdefault(e["channel"], r)
            if a is not r:
                a[0], a[1] = min(a[0], r[0]), max(a[1], r[1])
                a[2] += r[2]
                a[3], a[4] = min(a[3], r[3]), max(a[4], r[4])
        return out

    def _take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def _sink(self) -> None:
        """Hand the events not yet taken to the sink. If it fails they are kept (bounded:
        :func:`bound_events`), saved with the progress and tried again with the next ones, or
        first at the next start; once taken, the next save forgets them."""
        if self.sink is None or not self._unsunk:
            return
        batch = self._unsunk
        try:
            self.sink(list(batch))
        except Exception as e:  # the events stay in the results; retried with the next ones
            self._unsunk, folded = bound_events(batch, UNSUNK_CAP)
            if not self._unsunk_saved:
                self._dirty = True  # saved (at the latest when closing): a restart writes them
            log_event(log, 40, "replay events not written by the audit sink: kept in "
                      f"{self.state_dir / PROGRESS_FILE} with the progress, tried again with "
                      "the next events and first at the next start", events=len(batch),
                      kept=len(self._unsunk), folded=folded, error=str(e))  # fmt: skip
            return
        self._unsunk = []
        if self._saved_events:
            self._dirty = True  # the saved progress must forget them, or a restart repeats them

    def _finish(self) -> StepResult:
        res = self._result = StepResult()
        if self._lock is None:
            return res
        try:
            if self._conn is not None and self._pending:
                self._drain(None, None, CLOSE_DRAIN_SECONDS)
        except (BrokerError, _Stop) as e:
            log_event(log, 30, "confirms not all received before closing", error=str(e))
        for lane in self._lanes.values():
            self._flush_replayed(lane)
        try:
            self._sink()
            if self._dirty:
                self._save()
        finally:
            self._drop_connection()
            self._lanes.clear()
            self._write_live(closed=True)
            lock, self._lock = self._lock, None
            lock.close()
        res.events = self._take_events()
        return res

    # -- waiting ---------------------------------------------------------------------------------
    @staticmethod
    def _should_stop(deadline: float | None, stop: threading.Event | None) -> bool:
        return (stop is not None and stop.is_set()) or (
            deadline is not None and time.monotonic() >= deadline
        )

    def _check_stop(self, deadline: float | None, stop: threading.Event | None) -> None:
        if self._should_stop(deadline, stop):
            raise _Stop

    @staticmethod
    def _sleep(seconds: float, deadline: float | None, stop: threading.Event | None) -> None:
        if deadline is not None:
            seconds = min(seconds, deadline - time.monotonic())
        if seconds <= 0:
            return
        if stop is not None:
            stop.wait(seconds)
        else:
            time.sleep(seconds)


def _describe(name: str, decl: Decl) -> str:
    xtype, durable, auto_delete, internal, arguments = decl
    flags = [n for n, v in (("durable", durable), ("auto-delete", auto_delete),
                            ("internal", internal)) if v]  # fmt: skip
    return (
        f"exchange {name!r} (type {xtype}{', ' + ', '.join(flags) if flags else ''}, arguments "
        f"{arguments or '[]'})"
    )


# -- audit ------------------------------------------------------------------------------------
def _shown(p: Progress) -> dict[str, Any]:
    """A progress as a status shows it: the events waiting for the audit sink counted, not
    listed (up to ``UNSUNK_CAP``)."""
    out = p.to_json()
    if "unaudited_events" in out:
        out["unaudited_events"] = len(out["unaudited_events"])
    return out


_AUDIT_TRIES = 5
"""Versions ``audit_sink`` tries for one commit when another writer commits the one it read."""


def audit_sink(cfg: Config) -> Callable[[list[dict[str, Any]]], None]:
    """A ``sink`` that appends replay events to ``tables_dir/audit`` with the application
    transaction ``("diode-replay", n)``, ``n`` one more than the table's last (1 for the
    first). Raises (and the
    Replayer retries with its next events) while the audit table does not exist."""
    from bridge.red.schema import audit_rows
    from bridge.red.tables import RedTables

    tables = RedTables(Path(cfg.red.tables_dir), "delta-rs")

    def write(events: Sequence[dict[str, Any]]) -> None:
        if not events:
            return
        for _ in range(_AUDIT_TRIES):  # another writer took the version meanwhile: the next
            version = max(tables.txn_version("audit", APP_ID), 0) + 1
            rows = audit_rows(list(events), APP_ID, version, datetime.now(UTC))
            if tables.append("audit", rows, app_id=APP_ID, version=version):
                return
        raise StateError(
            f"replay audit events not written: {_AUDIT_TRIES} versions of {APP_ID} in "
            f"{tables.path('audit')} were taken by another writer as they were tried (two "
            "replay publishers on one tables_dir?); retried with the next events"
        )

    return write
