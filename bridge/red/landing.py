"""Red, landing: verdicts -> sequence checks -> Delta (exactly once) -> evidence moves.

Every micro-batch (and every batch of timer events, e.g. a silent link) becomes one *landing*
numbered ``land_seq``, strictly increasing. A landing is first written down as an intent
(``state_dir/landing/intent.json``, fsynced, plaintexts moved beside it), then applied:

1. ``messages``, ``bundles`` and ``audit`` appends, each carrying the Delta application
   transaction ``("diode-red", land_seq)`` and skipped when the table already has it (each
   commit is fsynced before the append returns: bridge.red.tables);
2. chain status updates of ledger rows whose missing neighbour just arrived (idempotent);
3. evidence moves (intake -> processed/ or quarantine/ with a reason file);
4. the sequence state after the landing, saved with ``land_seq`` and the last landing each
   table holds; the intent is removed.

A crash anywhere is finished at start-up by applying the intent again: every step is
idempotent, so ``messages`` holds each ``(channel, seq)`` exactly once. Start-up refuses a
state older than the tables, and tables older than the state (a table that lost commits).

The red job *pipelines* (``submit``): a micro-batch is judged and its intent journaled in the
sink, then applied by a background thread while Spark verifies the next batch on the
executors. Spark may commit a batch whose landing is still being applied; the journaled intent
is what makes that safe (a crash there is finished at start-up like any other). Whatever
touches the state or the journal (the next ``submit``, ``tick``, ``recover``, ``drain``) first
waits for the landing in flight; one that failed fails every later call: the job stops, and
its restart finishes the landing from the journal.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bridge.config import Config
from bridge.diode.link_status import gap_objects, read_new_gap_records
from bridge.errors import DiodeError, StateError
from bridge.faults import crash_point, slow_point
from bridge.fsutil import atomic_write_bytes, durable_mkdir, fsync_dir
from bridge.logs import get_logger, log_event
from bridge.metrics import RED
from bridge.protocol.manifest import MANIFEST_KEY, Manifest, parse_utc
from bridge.red import schema as rs
from bridge.red import sequence as sq
from bridge.red.evidence import Evidence
from bridge.red.layout import (
    AUDIT_PENDING_DIR,
    INTAKE_DIR,
    INTENT_FILE,
    JOURNAL_DIR,
    LOCK_FILE,
    STATE_FILE,
)
from bridge.red.tables import RedTables
from bridge.red.verify import Verdict, sweep_plain_dir

__all__ = [
    "APP_ID",
    "LOCK_FILE",
    "Landing",
    "LandingError",
    "LandingResult",
    "SavedState",
    "read_saved_state",
]

log = get_logger("bridge.red.landing")

APP_ID = "diode-red"
REQUESTS_DIR = "requests"
"""``work_dir/requests/*.json``: operator requests the landing applies at its next tick."""
_CHAIN_EVENTS = {
    "chain_verified": "verified",
    "chain_broken": "broken",
    "chain_unverifiable": "unverifiable",
}
"""Sequence events that set a landed bundle's ``bundles.chain_status``."""
READ_BATCH_ROWS = 16_384


def _seq_of(doc: dict[str, Any], key: str) -> int:
    """``doc[key]`` as a bundle seq: a JSON integer, nothing that merely converts to one."""
    v = doc[key]
    if type(v) is not int:
        raise ValueError(f"{key} must be an integer, not {v!r}")
    return v


class LandingError(DiodeError):
    """A landing could not be applied (Delta or the file system failed); retry is safe."""

    retryable = True


@dataclass
class LandingResult:
    land_seq: int | None = None
    files: int = 0
    bundles_landed: int = 0
    messages_landed: int = 0
    duplicates: int = 0
    conflicts: int = 0
    rejected: int = 0
    """Files verification refused; :meth:`refusals` adds the intake's."""
    heartbeats: int = 0
    events: dict[str, int] = field(default_factory=dict)
    transport_gap_objects: int = 0
    """Objects the UDP receiver's gap records audited here stand for (``events`` counts the
    ``transport_gap`` rows, one a record): an ``unseen`` range or a summary record names how
    many (``objects``), any other record is one."""

    def refusals(self) -> dict[str, int]:
        """Red, landing: files refused, whoever refused them: ``rejected`` (verification's and
        the intake's, as ``bridge_red_files_rejected_total`` counts them) and
        ``quarantined_at_intake`` (the intake's own: the ``quarantined`` audit events)."""
        at_intake = self.events.get("quarantined", 0)
        return {"rejected": self.rejected + at_intake, "quarantined_at_intake": at_intake}

    def add(self, other: LandingResult) -> None:
        for k in (
            "files",
            "bundles_landed",
            "messages_landed",
            "duplicates",
            "conflicts",
            "rejected",
            "heartbeats",
            "transport_gap_objects",
        ):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.events.items():
            self.events[k] = self.events.get(k, 0) + v
        self.land_seq = other.land_seq if other.land_seq is not None else self.land_seq


def _iso(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat()


def _ts(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _event_row(ev: sq.Event, at: datetime) -> dict[str, Any]:
    return {
        "event": ev.kind,
        "at": at,
        "channel": ev.channel,
        "bundle_seq": ev.bundle_seq,
        "seq_first": ev.seq_first,
        "seq_last": ev.seq_last,
        "reason": ev.reason,
        "detail": json.dumps(ev.detail, sort_keys=True) if ev.detail else None,
    }


def _range_index(seq: pa.Array, ranges: Sequence[Sequence[int]]) -> pa.Array:
    """Per value of ``seq``, the index in ``ranges`` (inclusive ``(first, last)`` seq ranges,
    sorted and disjoint: manifest ``inexact``, skip ranges) of the range holding it; null
    when none does."""
    if not ranges:
        return pa.nulls(len(seq), pa.int64())
    s = seq.to_numpy(zero_copy_only=False)
    firsts = np.array([r[0] for r in ranges], np.int64)
    lasts = np.array([r[1] for r in ranges], np.int64)
    i = np.searchsorted(firsts, s, side="right") - 1
    inside = (i >= 0) & (s <= lasts[np.maximum(i, 0)])
    return pa.array(i, pa.int64(), mask=~inside)


def _manifest_of(f: pq.ParquetFile, plain: dict[str, Any]) -> Manifest:
    """The manifest the held plaintext of an intent's ``plain`` carries (Parquet key-value
    metadata); LandingError when it is not the bundle the landing judged."""
    raw = (f.metadata.metadata or {}).get(MANIFEST_KEY)
    m = None if raw is None else Manifest.from_json(raw)
    if m is None or m.bundle_id != plain["bundle_id"]:
        raise LandingError(
            f"held plaintext {plain['path']} of bundle {plain['channel']}/"
            f"{plain['bundle_seq']} (id {plain['bundle_id']}) carries "
            f"{'no manifest' if m is None else f'the manifest of bundle id {m.bundle_id}'}: it "
            "was replaced after it was judged. Do not delete anything; ask for help"
        )
    return m


def _sorted_rows(verdicts: pa.Table | list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = verdicts.to_pylist() if isinstance(verdicts, pa.Table) else list(verdicts)
    rows.sort(key=lambda r: int(r["ordinal"]))
    return rows


_QUARANTINE_KEYS = frozenset({"raw_name", "raw_name_hex", "stored_as", "reason"})
"""What an intake quarantine record must hold to be audited (bridge.red.intake)."""


def _json_files(d: Path) -> list[tuple[Path, Any, OSError | ValueError | None]]:
    """``(path, parsed document, None)`` of each ``d/*.json`` by name, or ``(path, None,
    error)`` for one that cannot be read (OSError) or parsed (ValueError)."""
    out: list[tuple[Path, Any, OSError | ValueError | None]] = []
    for p in sorted(d.glob("*.json")) if d.exists() else []:
        try:
            out.append((p, json.loads(p.read_bytes()), None))
        except (OSError, ValueError) as e:
            out.append((p, None, e))
    return out


@dataclass(frozen=True)
class SavedState:
    """``state_dir/red-state.json``: what the last landing left."""

    land_seq: int
    sequence: sq.SequenceState
    udp_gaps_offset: int
    saved_at: str | None
    tables: dict[str, int] = field(default_factory=dict)
    """The last landing (``diode-red`` app transaction version) each table held after it;
    empty in a state saved before this was recorded."""


def read_saved_state(state_dir: Path) -> SavedState | None:
    """The red state saved after the last landing (None before the first); LandingError when
    the file is not JSON (StateError when its sequence state is malformed)."""
    p = Path(state_dir) / STATE_FILE
    try:
        doc = json.loads(p.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise LandingError(
            f"red state {p} is unreadable ({e}); restore it from backup — red cannot "
            "check sequences without it"
        ) from None
    return SavedState(
        int(doc["land_seq"]),
        sq.SequenceState.from_json(doc["sequence"]),
        int(doc.get("udp_gaps_offset", 0)),
        doc.get("saved_at"),
        {str(k): int(v) for k, v in doc.get("tables", {}).items()},
    )


class Landing:
    """The driver-side sink of the red job: owns the sequence state and the journal."""

    def __init__(self, cfg: Config, tables: RedTables, evidence: Evidence) -> None:
        self.cfg = cfg
        r = cfg.red
        self.tables = tables
        self.evidence = evidence
        self.state_dir = durable_mkdir(Path(r.state_dir))
        self.journal_dir = durable_mkdir(self.state_dir / JOURNAL_DIR)
        self.work_dir = durable_mkdir(Path(r.work_dir))
        self.intake_dir = durable_mkdir(self.work_dir / INTAKE_DIR)
        self.plain_dir = durable_mkdir(self.work_dir / "plain")
        self.hold_dir = durable_mkdir(self.work_dir / "landing")
        self.lock = threading.RLock()
        self.udp_gaps_offset = 0
        """Bytes of the UDP receiver's gaps.jsonl already audited (saved with the state)."""
        self.table_seqs: dict[str, int] = {}
        """The last landing each table holds (saved with the state, checked at start)."""
        self.land_seq, self.state = self._load_state()
        self.channels = [c.name for c in cfg.channels]
        self.udp_spool = Path(cfg.udp.receive.spool_dir) if cfg.udp is not None else None
        self._inflight: threading.Thread | None = None
        """The background thread applying the last submitted landing (``submit``)."""
        self._finished: list[LandingResult] = []
        """Results of submitted landings applied since ``submit``/``drain`` last returned them."""
        self._failed: BaseException | None = None
        """Set when a landing failed: every later call raises it."""
        self._closed = False
        """``drain(close=True)`` was called: ``submit`` refuses."""
        self._margin_warned: dict[str, float] = {}
        """Per channel, the heartbeat period last warned about (``silence_margin``)."""

    # -- state ---------------------------------------------------------------------------------
    def _load_state(self) -> tuple[int, sq.SequenceState]:
        saved = read_saved_state(self.state_dir)
        if saved is None:
            self.udp_gaps_offset, self.table_seqs = 0, {}
            return 0, sq.SequenceState()
        self.udp_gaps_offset, self.table_seqs = saved.udp_gaps_offset, dict(saved.tables)
        return saved.land_seq, saved.sequence

    def _save_state(self, land_seq: int, state_json: dict[str, Any], udp_gaps_offset: int) -> None:
        doc = {
            "land_seq": land_seq,
            "sequence": state_json,
            "udp_gaps_offset": udp_gaps_offset,
            "saved_at": _iso(datetime.now(UTC)),
            "tables": dict(sorted(self.table_seqs.items())),
        }
        atomic_write_bytes(self.state_dir / STATE_FILE, json.dumps(doc, sort_keys=True).encode())

    # -- start-up ------------------------------------------------------------------------------
    def recover(self) -> int:
        """Finish an interrupted landing; sweep temp plaintexts. Returns landings re-applied."""
        with self.lock:
            self._wait()
            self.tables.ensure()
            redone = 0
            intent_path = self.journal_dir / INTENT_FILE
            if intent_path.exists():
                intent = json.loads(intent_path.read_bytes())
                n = int(intent["land_seq"])
                if n > self.land_seq:
                    log_event(log, 30, "finishing an interrupted landing", land_seq=n)
                    self._apply(intent)
                    self.land_seq, self.state = self._load_state()
                    redone = 1
                else:
                    intent_path.unlink()
            self._check_state_vs_tables()
            swept = sweep_plain_dir(self.plain_dir)
            for d in self.hold_dir.iterdir():
                if d.name.isdigit() and int(d.name) <= self.land_seq:
                    shutil.rmtree(d, ignore_errors=True)
            if swept:
                log_event(log, 20, "swept temporary plaintexts left by a crash", files=swept)
            RED.land_seq.set(self.land_seq)
            return redone

    def _check_state_vs_tables(self) -> None:
        """Refuse to run on a state older than the tables (restored from backup, or lost):
        new landings would reuse land_seqs the tables hold, and Delta would skip their rows.
        Refuse tables older than the state too (a commit lost, a table restored or recreated):
        the files of the landings they miss are in processed/ already, and a resend of those
        bundles would be judged a duplicate: their rows would never land."""
        for name in ("messages", "bundles", "audit"):
            v = self.tables.txn_version(name, APP_ID)
            had = self.table_seqs.get(name, -1)
            if v < had:
                raise LandingError(
                    f"table {name!r} holds landing {v} but the state "
                    f"{self.state_dir / STATE_FILE} recorded landing {had} in it: the table "
                    "lost commits (restored from an older backup, recreated, or a power loss "
                    "on storage that ignores fsync). Do not delete anything: restore the table "
                    "from a backup at least as new as the state, or ask for help"
                )
            if v > self.land_seq:
                raise LandingError(
                    f"red state {self.state_dir / STATE_FILE} says landing {self.land_seq} but "
                    f"table {name!r} already holds landing {v}: the state is older than the "
                    "tables (restored or lost). Do not delete anything; see the runbook "
                    "('red state behind the tables') to rebuild the state before restarting"
                )

    # -- one micro-batch -----------------------------------------------------------------------
    def _lookup(self, channel: str, bundle_seq: int) -> str | None:
        return self.tables.landed_sha256(channel, bundle_seq)

    def submit(self, verdicts: pa.Table | list[dict[str, Any]]) -> list[LandingResult]:
        """Judge one micro-batch and journal its intent now, then apply it in a background
        thread (the caller, Spark's sink, returns and Spark verifies the next batch meanwhile).
        Waits for the landing in flight first. Returns the landings whose apply finished since
        the last call (``drain`` returns the last one)."""
        rows = _sorted_rows(verdicts)
        with self.lock:
            if self._inflight is not None and self._inflight.is_alive():
                crash_point("red.apply_in_flight")  # Spark committed the batch being applied
            self._wait()
            if self._closed:
                raise LandingError(
                    "the red run is stopping: this micro-batch is not landed now; its files "
                    "stay in intake for the next run"
                )
            intent, res = self._judge(rows)
            if intent is not None:
                t = threading.Thread(
                    target=self._apply_landing, args=(intent, res),
                    name=f"red-landing-{intent['land_seq']}", daemon=False,
                )  # fmt: skip
                self._inflight = t
                t.start()
            return self._take_finished()

    def drain(self, *, close: bool = False) -> list[LandingResult]:
        """Wait for the landing in flight; the results not yet returned by ``submit``. Raises
        the LandingError of a background landing that failed. ``close``: refuse any later
        ``submit`` (a run that is stopping must not start an apply it will not wait for)."""
        with self.lock:
            self._closed = self._closed or close
            self._wait()
            return self._take_finished()

    def _take_finished(self) -> list[LandingResult]:
        done, self._finished = self._finished, []
        return done

    def _apply_landing(self, intent: dict[str, Any], res: LandingResult) -> None:
        """Apply a judged landing (in the background for ``submit``). A failure is kept for the
        next caller: the in-memory state is already past the landing, so nothing may be
        judged on top of it until a restart finishes it from the journal."""
        try:
            slow_point("red.apply")
            res.messages_landed = self._apply_or_fail(intent)
        except BaseException:  # kept in self._failed: the next caller raises it
            return
        self._count(res)
        self._finished.append(res)

    def _apply_or_fail(self, intent: dict[str, Any]) -> int:
        """``_apply``; a failure is kept in ``_failed`` (every later call raises it) and
        raised: nothing may be judged or ticked on top of a journaled landing not applied."""
        try:
            return self._apply(intent)
        except BaseException as e:
            n = intent["land_seq"]
            self._failed = (
                e
                if isinstance(e, DiodeError)
                else LandingError(f"landing {n} failed: {type(e).__name__}: {e}")
            )
            log_event(log, 50, "landing failed: red stops landing; a restart finishes it from "
                      "the journal", land_seq=n, error=str(e))  # fmt: skip
            if not isinstance(e, Exception):
                raise  # Ctrl-C, exit: as they are (the landing stays failed all the same)
            raise self._failed from None

    def _wait(self) -> None:
        """Join the landing in flight (hold ``self.lock``); raise if one ever failed."""
        if self._inflight is not None:
            self._inflight.join()  # the handle is dropped only once the apply has ended
            self._inflight = None
        if self._failed is not None:
            raise self._failed

    def _no_unapplied_intent(self) -> None:
        """Refuse to journal a landing over one that was never applied (belt and braces: every
        path applies or fails sticky first)."""
        path = self.journal_dir / INTENT_FILE
        if path.exists():
            raise LandingError(
                f"{path} still holds a landing that was not applied; stop and restart the red "
                "job: it is finished at start (never delete it)"
            )

    def _judge(self, rows: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, LandingResult]:
        """Judge verdict rows against the sequence state and journal the landing's intent
        (fsynced). The in-memory state moves to the landing's: the next batch is judged
        against it while this one is applied."""
        res = LandingResult()
        if not rows:
            return None, res
        self._no_unapplied_intent()  # before any plaintext is moved under a land_seq
        n = self.land_seq + 1
        now = datetime.now(UTC)
        state = sq.SequenceState.from_json(self.state.to_json())
        hold = durable_mkdir(self.hold_dir / str(n))
        moves: list[dict[str, Any]] = []
        plains: list[dict[str, Any]] = []
        ledger: list[dict[str, Any]] = []
        audit: list[dict[str, Any]] = []
        chain_updates: list[list[Any]] = []

        def emit(kind: str, **kw: Any) -> None:
            row = {"event": kind, "at": now, **kw}
            if isinstance(row.get("detail"), dict):
                row["detail"] = json.dumps(row["detail"], sort_keys=True)
            audit.append(row)
            res.events[kind] = res.events.get(kind, 0) + 1

        for r in rows:
            ordinal = int(r["ordinal"])
            v = Verdict.from_row({k: val for k, val in r.items() if k != "ordinal"})
            src = self.intake_dir / f"{ordinal:012d}.{v.name}"
            received = self._received_at(src, now)
            res.files += 1
            base = {"channel": v.channel, "file_name": v.name}
            emit("received", **base, detail={"bytes": v.file_bytes, "kind": v.kind})
            if v.status != "ok":
                res.rejected += 1
                reason = v.reason or "rejected"
                RED.files_rejected.labels(reason).inc()
                emit("rejected", **base, bundle_seq=v.seq if v.kind == "bundle" else None,
                     reason=reason, detail={"why": v.detail})  # fmt: skip
                if v.kind == "bundle" and v.channel is not None and v.seq is not None:
                    ledger.append(self._ledger_row(v, None, "quarantined", reason, received, n))
                moves.append(self._move(src, v.name, "quarantine", reason, v.detail, ordinal))
                self._drop_plain(v)
                continue
            if v.kind == "heartbeat":
                res.heartbeats += 1
                hb = sq.HeartbeatFacts.from_json(v.heartbeat_json or "{}")
                emit("heartbeat", **base, detail=json.loads(v.heartbeat_json or "{}"))
                for ev in sq.heartbeat(state, hb, now):
                    audit.append(_event_row(ev, now))
                    res.events[ev.kind] = res.events.get(ev.kind, 0) + 1
                self._check_silence_margin(hb)
                moves.append(self._move(src, v.name, "processed", None, None, ordinal))
                continue
            manifest = Manifest.from_json(v.manifest_json or "{}")
            facts = sq.BundleFacts.from_manifest(manifest, v.plaintext_sha256 or "")
            verdict = sq.classify(state, facts, self._lookup)
            if verdict == "duplicate":
                res.duplicates += 1
                emit("duplicate", **base, bundle_seq=v.seq, detail={"sha256": facts.sha256})
                ledger.append(self._ledger_row(v, manifest, "duplicate", None, received, n))
                moves.append(self._move(src, v.name, "processed", None, None, ordinal))
                self._drop_plain(v)
                continue
            if verdict == "conflict":
                res.conflicts += 1
                RED.conflicts.labels(facts.channel).inc()
                why = (
                    f"bundle {facts.channel}/{facts.bundle_seq} already landed with another "
                    f"plaintext: this one ({facts.sha256[:16]}…) is a forgery or black's journal "
                    "was reset or restored (runbook: conflicts)"
                )
                log_event(
                    log, 40, "CONFLICT: different bundle under a landed seq",
                    channel=facts.channel, bundle_seq=facts.bundle_seq, file=v.name,
                )  # fmt: skip
                emit("conflict", **base, bundle_seq=v.seq, reason="conflict", detail={"why": why})
                ledger.append(self._ledger_row(v, manifest, "conflict", "conflict", received, n))
                moves.append(self._move(src, v.name, "quarantine", "conflict", why, ordinal))
                self._drop_plain(v)
                continue
            adm = sq.admit(state, facts, now)
            chain = "first" if facts.bundle_seq == 1 and facts.prev_sha256 is None else "pending"
            for ev in adm.events:
                audit.append(_event_row(ev, now))
                res.events[ev.kind] = res.events.get(ev.kind, 0) + 1
                if ev.kind in _CHAIN_EVENTS:
                    status = _CHAIN_EVENTS[ev.kind]
                    if ev.bundle_seq == facts.bundle_seq:
                        chain = status if chain != "broken" else chain
                    elif ev.bundle_seq is not None:
                        chain_updates.append([facts.channel, ev.bundle_seq, status])
            if facts.bundle_seq == 1 and facts.prev_sha256 is not None:
                chain = "broken"
            ledger.append(self._ledger_row(v, manifest, "landed", None, received, n, chain))
            held = hold / f"{ordinal:012d}.parquet"
            if v.plaintext_path:
                os.replace(v.plaintext_path, held)
            plains.append(
                {
                    "path": str(held),
                    "channel": facts.channel,
                    "bundle_seq": facts.bundle_seq,
                    "bundle_id": manifest.bundle_id,
                    "skip": [list(x) for x in adm.skip],
                    "rows": manifest.rows,
                }
            )
            emit("landed", **base, bundle_seq=v.seq, seq_first=manifest.first_seq,
                 seq_last=manifest.last_seq, detail={"rows": manifest.rows})  # fmt: skip
            res.bundles_landed += 1
            moves.append(self._move(src, v.name, "processed", None, None, ordinal))
        fsync_dir(hold)
        intent = {
            "land_seq": n,
            "at": _iso(now),
            "plains": plains,
            "ledger": [self._jsonable(x) for x in ledger],
            "audit": [self._jsonable(x) for x in audit],
            "chain_updates": chain_updates,
            "moves": moves,
            "state_after": state.to_json(),
        }
        atomic_write_bytes(self.journal_dir / INTENT_FILE, json.dumps(intent).encode())
        crash_point("red.after_intent")
        res.land_seq = n
        self.land_seq, self.state = n, state
        return intent, res

    def _check_silence_margin(self, hb: sq.HeartbeatFacts) -> None:
        """Warn (once per channel and period) when red.link_silent_seconds is too short for
        the heartbeat period black declares: false link_silent alarms otherwise."""
        if self._margin_warned.get(hb.channel) == hb.interval_seconds:
            return
        why = sq.silence_margin(hb.channel, hb.interval_seconds, self.cfg.red.link_silent_seconds)
        if why is not None:
            self._margin_warned[hb.channel] = hb.interval_seconds
            log_event(log, 30, why, channel=hb.channel, interval_seconds=hb.interval_seconds,
                      link_silent_seconds=self.cfg.red.link_silent_seconds)  # fmt: skip

    def tick(self, now: datetime | None = None) -> LandingResult:
        """Timer events (a silent link), the intake's own quarantines and the UDP receiver's
        gap records: audited as a landing of their own when there are any."""
        with self.lock:
            self._wait()
            now = now or datetime.now(UTC)
            state = sq.SequenceState.from_json(self.state.to_json())
            events: list[sq.Event] = []
            requests, asked = self._requests()
            for doc, path in zip(requests, asked, strict=True):  # first: a retired channel
                events += self._request(state, doc, path, now)  # is no longer watched
            events += sq.tick(state, now, self.cfg.red.link_silent_seconds, self.channels)
            res = LandingResult()
            pending, consumed = self._intake_quarantines()
            consumed += asked
            transport, udp_offset, lost = self._transport_gaps(now)
            if (
                not events
                and not pending
                and not asked
                and not transport
                and udp_offset == self.udp_gaps_offset
                and state.to_json() == self.state.to_json()
            ):
                return res
            n = self.land_seq + 1
            audit = [self._jsonable(_event_row(ev, now)) for ev in events]
            audit += transport
            if transport:
                res.events["transport_gap"] = len(transport)  # audit rows: one a record
                res.transport_gap_objects = sum(lost.values())
            for doc in pending:
                RED.files_rejected.labels(doc["reason"]).inc()
                res.events["quarantined"] = res.events.get("quarantined", 0) + 1
                audit.append(
                    {
                        "event": "quarantined",
                        "at": doc.get("at") or _iso(now),
                        "file_name": Path(doc["stored_as"]).name,
                        "reason": doc["reason"],
                        "detail": json.dumps(
                            {"raw_name": doc["raw_name"], "raw_name_hex": doc["raw_name_hex"],
                             "stored_as": doc["stored_as"]}, sort_keys=True,
                        ),
                    }
                )  # fmt: skip
            intent = {
                "land_seq": n,
                "at": _iso(now),
                "plains": [],
                "ledger": [],
                "audit": audit,
                "chain_updates": [
                    [ev.channel, ev.bundle_seq, _CHAIN_EVENTS[ev.kind]]
                    for ev in events
                    if ev.kind in _CHAIN_EVENTS and ev.bundle_seq is not None
                ],  # a write-off makes the link into the bundle above it unverifiable
                "moves": [],
                "consumed": consumed,
                "state_after": state.to_json(),
                "udp_gaps_offset": udp_offset,
            }
            self._no_unapplied_intent()
            atomic_write_bytes(self.journal_dir / INTENT_FILE, json.dumps(intent).encode())
            self._apply_or_fail(intent)
            self.land_seq, self.state, self.udp_gaps_offset = n, state, udp_offset
            for ev in events:
                res.events[ev.kind] = res.events.get(ev.kind, 0) + 1
            res.land_seq = n
            self._count(res)
            if transport:
                log_event(log, 30, "UDP transport gaps audited: objects the link lost",
                          land_seq=n, records=len(transport),
                          objects=res.transport_gap_objects,
                          objects_by_reason=dict(sorted(lost.items())))  # fmt: skip
            return res

    # -- pieces --------------------------------------------------------------------------------
    def _transport_gaps(self, now: datetime) -> tuple[list[dict[str, Any]], int, dict[str, int]]:
        """Red, landing (tick): audit rows for the UDP receiver's gap records since the last
        tick (its ``gaps.jsonl``, read from the offset saved with the state: each record audited
        once, one row a record), the offset after them, and the objects they stand for by
        reason (``gap_objects``: a range or summary record counts its ``objects``). Every field
        is checked: the file is local, but what it says about channels and seqs came off the
        wire."""
        if self.udp_spool is None:
            return [], self.udp_gaps_offset, {}
        try:
            records, offset, restarted = read_new_gap_records(self.udp_spool, self.udp_gaps_offset)
        except OSError as e:
            log_event(log, 40, "UDP gap records unreadable: retried at the next tick",
                      path=str(self.udp_spool / "gaps.jsonl"), error=str(e))  # fmt: skip
            return [], self.udp_gaps_offset, {}
        if restarted:
            log_event(log, 30, "UDP gap records file is not the one audited so far (shorter, "
                      "or no record ends where red stopped): the receiver's spool was "
                      "replaced; reading it from the start",
                      path=str(self.udp_spool / "gaps.jsonl"),
                      audited_bytes=self.udp_gaps_offset)  # fmt: skip
        rows: list[dict[str, Any]] = []
        lost: dict[str, int] = {}
        for rec in records:
            ch = rec.get("channel")
            channel = ch if isinstance(ch, str) and ch in self.channels else None
            seq = rec.get("seq")
            is_bundle = rec.get("kind") == "bundle" and type(seq) is int and seq > 0
            reason = rec.get("reason")
            why = reason[:64] if isinstance(reason, str) else "unknown"
            lost[why] = lost.get(why, 0) + gap_objects([rec])
            t = rec.get("time")
            ok_time = isinstance(t, int | float) and 0 < t < 1e11
            at = datetime.fromtimestamp(float(t), UTC) if ok_time else now  # type: ignore[arg-type]
            rows.append(
                {
                    "event": "transport_gap",
                    "at": _iso(at),
                    "channel": channel,
                    "bundle_seq": seq if is_bundle and channel is not None else None,
                    "file_name": None,
                    "seq_first": None,
                    "seq_last": None,
                    "reason": why,
                    "detail": json.dumps(rec, sort_keys=True, default=str),
                }
            )
        return rows, offset, lost

    def _requests(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Operator requests (``diode red write-off``, ``diode red retire``) queued in
        ``work_dir/requests/``; an unreadable one is logged and audited as refused."""
        docs, paths = [], []
        for p, doc, error in _json_files(self.work_dir / REQUESTS_DIR):
            if error is None and not isinstance(doc, dict):  # JSON, but not a request
                doc, error = None, ValueError(f"not a JSON object: {type(doc).__name__}")
            if error is not None:
                log_event(log, 40, "operator request unreadable: ignored", path=str(p),
                          error=str(error))  # fmt: skip
            docs.append({"unreadable": str(error)} if doc is None else doc)
            paths.append(str(p))
        return docs, paths

    def _request(
        self, state: sq.SequenceState, doc: dict[str, Any], path: str, now: datetime
    ) -> list[sq.Event]:
        """Apply one operator request to ``state``; a refused one is logged and audited
        (``request_refused``, with the reason), and changes nothing."""
        kind = doc.get("kind")
        try:
            note = str(doc.get("note", ""))
            if "unreadable" in doc and kind is None:
                raise StateError(f"request file unreadable: {doc['unreadable']}")
            if kind == "write_off":
                first, last = _seq_of(doc, "first_bundle_seq"), _seq_of(doc, "last_bundle_seq")
                events = sq.write_off(state, str(doc["channel"]), first, last, note, now)
            elif kind == "retire":
                events = sq.retire(state, str(doc["channel"]), note, now, self.channels)
            else:
                raise StateError(f"unknown request kind {kind!r} (known: write_off, retire)")
        except (StateError, KeyError, TypeError, ValueError) as e:
            log_event(log, 40, "operator request refused", path=path, error=str(e))
            ch = doc.get("channel")
            detail = {"request": Path(path).name, "kind": kind, "error": str(e), "doc": doc}
            return [sq.Event("request_refused", ch if isinstance(ch, str) else "",
                             reason=str(kind)[:64], detail=detail)]  # fmt: skip
        if kind == "write_off":
            log_event(log, 30, "transit gap written off by an operator", channel=doc["channel"],
                      first_bundle_seq=doc["first_bundle_seq"],
                      last_bundle_seq=doc["last_bundle_seq"], note=note)  # fmt: skip
        else:
            log_event(log, 30, "channel retired by an operator", channel=doc["channel"],
                      gaps_written_off=sum(e.kind == "gap_written_off" for e in events),
                      note=note)  # fmt: skip
        return events

    def _intake_quarantines(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Files the intake quarantined on its own (bad names, links, ...): to be audited. A
        record that cannot be read is set aside (``.unreadable``) with an error log: the file
        it names is in quarantine with its reason file anyway."""
        found: list[tuple[Path, dict[str, Any]]] = []
        for p, doc, error in _json_files(self.work_dir / AUDIT_PENDING_DIR):
            if error is None and isinstance(doc, dict) and _QUARANTINE_KEYS <= doc.keys():
                found.append((p, doc))
                continue
            if isinstance(error, OSError):  # this host's trouble (EMFILE, EACCES): read next tick
                log_event(log, 30, "intake quarantine record not readable now: retried",
                          path=str(p), error=str(error))  # fmt: skip
                continue
            why = str(error) if error else f"not a record with {sorted(_QUARANTINE_KEYS)}"
            log_event(log, 40, "intake quarantine record unreadable: set aside, not audited",
                      path=str(p), error=why)  # fmt: skip
            with contextlib.suppress(OSError):
                os.replace(p, p.with_name(p.name + ".unreadable"))
        return [doc for _, doc in found], [str(p) for p, _ in found]

    @staticmethod
    def _received_at(src: Path, now: datetime) -> datetime:
        try:
            return datetime.fromtimestamp(src.lstat().st_ctime, UTC)
        except OSError:
            return now

    @staticmethod
    def _drop_plain(v: Verdict) -> None:
        if v.plaintext_path:
            Path(v.plaintext_path).unlink(missing_ok=True)

    @staticmethod
    def _move(
        src: Path, name: str, to: str, reason: str | None, detail: str | None, ordinal: int
    ) -> dict[str, Any]:
        return {
            "src": str(src),
            "name": name,
            "to": to,
            "reason": reason,
            "detail": detail,
            "ordinal": ordinal,
        }

    @staticmethod
    def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
        return {k: (_iso(v) if isinstance(v, datetime) else v) for k, v in row.items()}

    def _ledger_row(
        self,
        v: Verdict,
        m: Manifest | None,
        status: str,
        reason: str | None,
        received: datetime,
        n: int,
        chain: str = "pending",
    ) -> dict[str, Any]:
        row: dict[str, Any] = {
            "channel": v.channel,
            "bundle_seq": v.seq,
            "bundle_id": v.bundle_id,
            "file_name": v.name,
            "status": status,
            "reason": reason or (v.reason if status == "quarantined" else None),
            "signer_fpr": v.signer_fpr,
            "encrypted": v.encrypted,
            "plaintext_sha256": v.plaintext_sha256,
            "chain_status": chain if status == "landed" else rs.CHAIN_NOT_LANDED,
            "received_at": received,
            "landed_at": datetime.now(UTC) if status == "landed" else None,
            "land_seq": n,
            "file_bytes": v.file_bytes,
        }
        if m is not None:
            cov = sq.BundleFacts.from_manifest(m, v.plaintext_sha256 or "").coverage
            row.update(
                rows=m.rows,
                first_seq=m.first_seq,
                last_seq=m.last_seq,
                coverage_first=cov[0] if cov else None,
                coverage_last=cov[1] if cov else None,
                gaps=json.dumps([g.to_dict() for g in m.gaps]) if m.gaps else None,
                inexact=json.dumps(m.to_dict().get("inexact"))
                if m.to_dict().get("inexact")
                else None,
                prev_sha256=m.prev_sha256,
                bridge_id=m.bridge_id,
                created_at=parse_utc(m.created_at),
            )
        return row

    def _messages(self, intent: dict[str, Any]) -> tuple[pa.RecordBatchReader, list[int]]:
        """A streaming reader of the landing's message rows (skip ranges removed), each with
        the reason of the manifest's ``inexact`` range holding its seq (null: exact). The
        ranges are read from the held plaintext's own manifest (verified when judged), so an
        intent journaled by an earlier build lands them too."""
        schema = rs.messages_schema()
        at = datetime.fromisoformat(intent["at"])
        land_seq = int(intent["land_seq"])
        counted = [0]

        def batches() -> Iterator[pa.RecordBatch]:
            for p in intent["plains"]:
                f = pq.ParquetFile(p["path"])
                inexact = _manifest_of(f, p).inexact
                spans = [(r.first_seq, r.last_seq) for r in inexact]
                reasons = pa.array([r.reason for r in inexact], pa.string())
                for b in f.iter_batches(batch_size=READ_BATCH_ROWS):
                    if p["skip"]:
                        b = b.filter(_range_index(b.column("seq"), p["skip"]).is_null())
                    k = b.num_rows
                    if not k:
                        continue
                    cols = {name: b.column(name) for name in b.schema.names}
                    cols["inexact"] = reasons.take(_range_index(b.column("seq"), spans))
                    cols["bundle_seq"] = pa.array([p["bundle_seq"]] * k, pa.int64())
                    cols["bundle_id"] = pa.array([p["bundle_id"]] * k, pa.string())
                    cols["land_seq"] = pa.array([land_seq] * k, pa.int64())
                    cols["landed_at"] = pa.array([at] * k, pa.timestamp("us", tz="UTC"))
                    cols["landed_date"] = pa.array([at.date()] * k, pa.date32())
                    counted[0] += k
                    yield pa.RecordBatch.from_arrays(
                        [cols[f.name].cast(f.type) for f in schema], schema=schema
                    )

        return pa.RecordBatchReader.from_batches(schema, batches()), counted

    def _apply(self, intent: dict[str, Any]) -> int:
        """Apply an intent; every step is idempotent. Returns message rows written now."""
        n = int(intent["land_seq"])
        at = datetime.fromisoformat(intent["at"])
        written = 0
        held: dict[str, int] = {}  # the last landing each table written to holds now

        def append(name: str, data: Any) -> bool:
            done = self.tables.append(name, data, app_id=APP_ID, version=n)
            held[name] = n if done else self.tables.txn_version(name, APP_ID)
            return done

        try:
            if intent["plains"]:
                reader, counted = self._messages(intent)
                if append("messages", reader):
                    written = counted[0]
                crash_point("red.after_messages")
            if intent["ledger"]:
                rows = [
                    {k: (_ts(v) if k in ("received_at", "landed_at", "created_at") else v)
                     for k, v in r.items()}
                    for r in intent["ledger"]
                ]  # fmt: skip
                append("bundles", rs.bundles_rows(rows))
            if intent["audit"]:
                events = [{**e, "at": _ts(e["at"])} for e in intent["audit"]]
                append("audit", rs.audit_rows(events, APP_ID, n, at))
            crash_point("red.after_tables")
            for channel, bundle_seq, status in intent["chain_updates"]:
                self.tables.set_chain_status(channel, int(bundle_seq), status)
        except DiodeError:
            raise
        except Exception as e:  # delta-rs / arrow / OS: the intent stays, retry is safe
            raise LandingError(f"landing {n} failed: {type(e).__name__}: {e}") from e
        for mv in intent["moves"]:
            src = Path(mv["src"])
            if not src.exists() and not src.is_symlink():
                continue  # moved by an earlier attempt
            if mv["to"] == "processed":
                self.evidence.processed(src, mv["name"], at)
            else:
                self.evidence.quarantine(
                    src, mv["name"], mv["reason"] or "rejected", {"why": mv["detail"]}, at
                )
        crash_point("red.after_moves")
        for p in intent.get("consumed", []):
            Path(p).unlink(missing_ok=True)
        for name, v in held.items():
            self.table_seqs[name] = max(v, self.table_seqs.get(name, -1))
        self._save_state(
            n, intent["state_after"], int(intent.get("udp_gaps_offset", self.udp_gaps_offset))
        )
        (self.journal_dir / INTENT_FILE).unlink(missing_ok=True)
        hold = self.hold_dir / str(n)
        if hold.exists():
            shutil.rmtree(hold, ignore_errors=True)
        return written

    def _count(self, res: LandingResult) -> None:
        RED.land_seq.set(self.land_seq)
        RED.files_processed.inc(res.files)
        RED.bundles_landed.inc(res.bundles_landed)
        RED.messages_landed.inc(res.messages_landed)
        RED.duplicates.inc(res.duplicates)
        for kind, k in res.events.items():
            RED.events.labels(kind).inc(k)
        for ch, cs in self.state.channels.items():
            RED.open_gaps.labels(ch).set(len(cs.gaps))
            RED.contiguous_bundle_seq.labels(ch).set(sq.accounted(cs))  # written off counts
            RED.known_bundle_seq.labels(ch).set(cs.known)
            RED.link_silent.labels(ch).set(1 if cs.silent else 0)
            if cs.heartbeat is not None:
                with contextlib.suppress(ValueError):  # a hand-edited state: no gauge, no crash
                    at = parse_utc(cs.heartbeat.received_at).timestamp()
                    RED.heartbeat_received.labels(ch).set(at)
        refused = res.refusals()  # as the run summary counts them
        if res.files or refused["rejected"]:
            log_event(
                log, 20, "landed", land_seq=res.land_seq, files=res.files,
                bundles=res.bundles_landed, messages=res.messages_landed,
                duplicates=res.duplicates, conflicts=res.conflicts, **refused,
            )  # fmt: skip
