"""Red, replay rewind: move an exchange's saved replay progress back (``diode red rewind``).

The replay publisher (:mod:`bridge.red.replay`) resumes each exchange after its saved progress
(``state_dir/replay-progress.json``, :class:`~bridge.red.replay_state.Progress`). A rewind puts
that progress *just before* a chosen row, so the next replay pass publishes every row of the
exchange from that row on again, in the replay's usual order (at-least-once: rows published
before go out again; consumers de-duplicate on ``red.replay.id_header``). The row is:

* ``to_seq``: the landed row ``(channel, seq)`` of the exchange;
* ``since``: the first row (replay order) landed at or after a time (``landed_at``);
* ``skipped``: the first row (replay order) in the seq ranges of the ``replay_failed`` events
  of kind ``user_id`` or ``bad_row`` the replay audited for the exchange after its last
  ``replay_rewound`` event (ordered by the ``diode-replay`` audit version), or ever.

What becomes of the rest of :class:`Progress` (a rewind never lets the replay skip a row):

* ``ahead`` (rows confirmed ahead of the progress, which the replay would not publish again):
  those after the rewind point are forgotten, so they are published again too;
* ``high`` (per channel, the highest seq confirmed: rows published below it are audited
  ``replayed_out_of_order``): lowered to the highest seq of the rows the replay is now past
  (at or before the new progress, or kept ahead), never raised; a channel with none is
  dropped. Republished rows are not reported out of order for having gone out before;
* ``passed`` (per channel, the highest gap the hold-back went past) is kept: the replay does
  not hold again at a gap it already went past (holding delays rows, it never skips them);
* ``unaudited`` (confirmed rows owed a ``replayed`` event), ``unaudited_events`` (other events
  the audit sink had not taken: ``--skipped`` counts its skipped rows too) and
  ``confirmed_rows`` are kept.

It holds the replay's own lock (``state_dir/replay.lock``) while it reads, rewinds and saves
(temp, fsync, rename, as the replay saves), so it is refused while a replay publisher runs;
its ``replay_rewound`` audit event is saved with the progress, then written through the
replay's audit sink (application id ``diode-replay``) in one commit with the exchange's events
still waiting there (``_save_audited``). A dry run takes no lock and changes nothing.
"""

from __future__ import annotations

import contextlib
import json
from bisect import bisect_right
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from deltalake import DeltaTable

from bridge.config import Config
from bridge.errors import ConfigError, DiodeError
from bridge.fsutil import exclusive_lock, lock_held
from bridge.logs import get_logger, log_event, operator_name
from bridge.red.approvals import Approvals
from bridge.red.replay import APP_ID, LOCK_FILE, audit_sink
from bridge.red.replay_state import (
    Key,
    Progress,
    load_progress,
    now_text,
    save_progress,
)
from bridge.red.tables import RedTables

__all__ = [
    "REWOUND",
    "SKIPPED_KINDS",
    "Rewind",
    "Target",
    "after_key",
    "plan_rewind",
    "rewind_exchange",
]

log = get_logger("bridge.red.replay_rewind")
REWOUND = "replay_rewound"
"""The audit event of a rewind (application id ``diode-replay``, as the replay's own)."""
SKIPPED_KINDS = ("user_id", "bad_row")
"""``replay_failed`` kinds of rows the replay skipped (still landed) that ``--skipped`` finds."""
_KEY_COLUMNS = ["land_seq", "channel", "seq"]
_ORDER = [(c, "ascending") for c in _KEY_COLUMNS]
_f = pads.field


def after_key(key: Key) -> pads.Expression:
    """Rows that sort after ``key`` in replay order ``(land_seq, channel, seq)``."""
    land, channel, seq = key
    return (_f("land_seq") > land) | (
        (_f("land_seq") == land)
        & ((_f("channel") > channel) | ((_f("channel") == channel) & (_f("seq") > seq)))
    )


def _key_json(key: Key) -> dict[str, Any]:
    return {"land_seq": key[0], "channel": key[1], "seq": key[2]}


def _key_text(key: Key) -> str:
    return f"land_seq {key[0]} channel {key[1]!r} seq {key[2]}"


@dataclass(frozen=True)
class Target:
    """Which row a rewind goes back to: exactly one of them."""

    to_seq: tuple[str, int] | None = None
    since: datetime | None = None
    skipped: bool = False

    @classmethod
    def from_options(cls, to_seq: str | None, since: str | None, skipped: bool) -> Target:
        """From the command's options; ConfigError unless exactly one is given and valid."""
        if (to_seq is not None) + (since is not None) + skipped != 1:
            raise ConfigError(
                "give exactly one of --to-seq CHANNEL:SEQ, --since ISO-TIME or --skipped"
            )
        if to_seq is not None:
            channel, sep, seq = to_seq.rpartition(":")
            if not sep or not channel or not seq.strip().isdigit():
                raise ConfigError(
                    f"--to-seq {to_seq!r}: expected CHANNEL:SEQ, e.g. eu-west:1500 (a message seq "
                    "of that channel, as the replay_failed and replayed events name it)"
                )
            return cls(to_seq=(channel, int(seq)))
        if since is not None:
            try:
                when = datetime.fromisoformat(since)
            except ValueError:
                when = None
            if when is None or when.tzinfo is None:
                raise ConfigError(
                    f"--since {since!r}: expected an ISO time with its zone, e.g. "
                    "2026-05-01T12:00:00Z or 2026-05-01T14:00:00+02:00"
                )
            return cls(since=when.astimezone(UTC))
        return cls(skipped=True)

    def to_json(self) -> dict[str, Any]:
        if self.to_seq is not None:
            return {"to_seq": f"{self.to_seq[0]}:{self.to_seq[1]}"}
        if self.since is not None:
            return {"since": self.since.isoformat().replace("+00:00", "Z")}
        return {"skipped": True}


@dataclass(frozen=True)
class Rewind:
    """A rewind of one exchange: its progress before and after, the first row published
    again, and how many rows go out again (``rows`` between the two progresses, ``ahead``
    confirmed ahead of the old one and forgotten)."""

    exchange: str
    target: Target
    before: Progress
    after: Progress
    first: Key
    rows: int
    ahead: int
    found: dict[str, Any]
    """How the first row was found (for ``--skipped``: the audit events it read)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "exchange": self.exchange,
            **self.target.to_json(),
            "from": _key_json(self.before.key),
            "to": _key_json(self.after.key),
            "first_row": _key_json(self.first),
            "rows": self.rows + self.ahead,
            "rows_behind_progress": self.rows,
            "ahead_forgotten": self.ahead,
            **self.found,
        }


class _Nothing(Exception):
    """Internal: nothing to rewind (exit 0); the message says why."""


def _tables(cfg: Config, *names: str) -> RedTables:
    """The red tables, ConfigError unless tables ``names`` exist."""
    tables = RedTables(Path(cfg.red.tables_dir), "delta-rs")
    for name in names:
        path = tables.path(name)
        if not DeltaTable.is_deltatable(str(path)):
            raise ConfigError(
                f"no {name} table at {path} (the red job creates it): nothing landed to rewind; "
                "check red.tables_dir"
            )
    return tables


def _first(table: pa.Table) -> Key | None:
    """The first row of ``table`` in replay order, or None when it is empty."""
    if not table.num_rows:
        return None
    i = pc.sort_indices(table.select(_KEY_COLUMNS), sort_keys=_ORDER)[0].as_py()
    row = table.select(_KEY_COLUMNS).slice(i, 1).to_pylist()[0]
    return (int(row["land_seq"]), str(row["channel"]), int(row["seq"]))


def _first_at_seq(tables: RedTables, exchange: str, channel: str, seq: int) -> Key:
    got = tables.read(
        "messages",
        columns=_KEY_COLUMNS,
        filter=(_f("exchange") == exchange) & (_f("channel") == channel) & (_f("seq") == seq),
    )
    key = _first(got)
    if key is None:
        landed = tables.read("messages", columns=["channel"], filter=_f("exchange") == exchange)
        channels = sorted(set(landed["channel"].to_pylist()))
        raise ConfigError(
            f"exchange {exchange!r} has no landed row channel {channel!r} seq {seq}: check "
            "--to-seq (CHANNEL:SEQ of a row of this exchange: the channel, not the exchange; "
            f"channels with rows of it: {', '.join(map(repr, channels)) or 'none'}; "
            "`replayed` and `replay_failed` audit events name the seqs)"
        )
    return key


def _first_since(tables: RedTables, exchange: str, since: datetime) -> Key:
    at = pa.scalar(since, pa.timestamp("us", tz="UTC"))
    got = tables.read(
        "messages",
        columns=_KEY_COLUMNS,
        filter=(_f("exchange") == exchange) & (_f("landed_at") >= at),
    )
    key = _first(got)
    if key is None:
        raise _Nothing(
            f"no row of exchange {exchange!r} landed at or after {since.isoformat()}: nothing "
            "to rewind"
        )
    return key


def _skipped_ranges(
    tables: RedTables, exchange: str, pending: list[dict[str, Any]]
) -> tuple[dict[str, list[list[int]]], dict[str, Any]]:
    """Per channel, the merged seq ranges of ``exchange``'s rows audited as skipped since its
    last rewind, or skipped with their events still waiting in the progress for the audit
    sink (``pending``: its ``unaudited_events``); and what was read (events, the last
    rewind's audit version)."""
    got = tables.read(
        "audit",
        columns=["event", "channel", "seq_first", "seq_last", "detail", "version"],
        filter=(_f("exchange") == exchange)
        & (_f("app_id") == APP_ID)
        & _f("event").isin(["replay_failed", REWOUND]),
    ).to_pylist()
    last = max((r["version"] for r in got if r["event"] == REWOUND), default=0)
    got += [{**e, "version": last + 1} for e in pending]  # after any rewind: not written yet
    ranges: dict[str, list[list[int]]] = {}
    events = 0
    for r in got:
        if r["event"] != "replay_failed" or r["version"] <= last:
            continue
        try:
            kind = json.loads(r["detail"] or "{}").get("kind")
        except ValueError:
            continue
        if kind not in SKIPPED_KINDS or r["channel"] is None or r["seq_first"] is None:
            continue
        last_seq = r["seq_last"] if r["seq_last"] is not None else r["seq_first"]
        ranges.setdefault(r["channel"], []).append([int(r["seq_first"]), int(last_seq)])
        events += 1
    since = f"since its last rewind (audit version {last} of {APP_ID})" if last else "ever"
    if not ranges:
        raise _Nothing(
            f"no row of exchange {exchange!r} was audited as skipped (replay_failed kind "
            f"{' or '.join(SKIPPED_KINDS)}) {since}: nothing to rewind"
        )
    merged: dict[str, list[list[int]]] = {}
    for channel, rs in ranges.items():
        out = merged[channel] = []
        for a, b in sorted(rs):
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return merged, {"skipped_events": events, "since_audit_version": last}


def _first_skipped(
    tables: RedTables, exchange: str, ranges: dict[str, list[list[int]]]
) -> Key | None:
    """The first row (replay order) of ``exchange`` within ``ranges``."""
    cond = None
    for channel, rs in ranges.items():
        c = (_f("channel") == channel) & (_f("seq") >= rs[0][0]) & (_f("seq") <= rs[-1][1])
        cond = c if cond is None else cond | c
    assert cond is not None
    got = tables.read("messages", columns=_KEY_COLUMNS, filter=(_f("exchange") == exchange) & cond)
    starts = {channel: [a for a, _ in rs] for channel, rs in ranges.items()}
    keep = []
    for channel, seq in zip(got["channel"].to_pylist(), got["seq"].to_pylist(), strict=True):
        i = bisect_right(starts[channel], seq) - 1  # rows between two ranges were not skipped
        keep.append(i >= 0 and seq <= ranges[channel][i][1])
    return _first(got.filter(pa.array(keep, pa.bool_())))


def _rewound(old: Progress, to: Key, ahead: set[Key], below: pa.Table) -> Progress:
    """``old`` moved back to ``to``, keeping ``ahead``; ``high`` lowered to the highest seq per
    channel of ``below`` (the rows at or before ``to``) and ``ahead``."""
    top: dict[str, int] = {}
    if below.num_rows:
        g = below.group_by("channel").aggregate([("seq", "max")])
        top = dict(zip(g["channel"].to_pylist(), g["seq_max"].to_pylist(), strict=True))
    for _, channel, seq in ahead:
        top[channel] = max(top.get(channel, -1), seq)
    high = {c: min(h, top[c]) for c, h in old.high.items() if c in top}
    return replace(
        old,
        land_seq=to[0],
        channel=to[1],
        seq=to[2],
        updated_at=now_text(),
        high=high,
        passed=dict(old.passed),
        unaudited={c: list(v) for c, v in old.unaudited.items()},
        ahead=ahead,
    )


def plan_rewind(
    cfg: Config, exchange: str, target: Target, progress: dict[str, Progress]
) -> Rewind | str:
    """The rewind of ``exchange`` to ``target`` given the saved ``progress``, or why there is
    nothing to rewind. ConfigError for an exchange no row has landed for and no progress names,
    or a ``to_seq`` row that has not landed."""
    tables = _tables(cfg, "messages", "audit")  # a rewind is audited: checked before it
    path = tables.path("messages")
    old = progress.get(exchange)
    if old is None:
        landed = tables.read("messages", columns=["seq"], filter=_f("exchange") == exchange)
        if not landed.num_rows:
            known = ", ".join(repr(n) for n in sorted(progress)) or "none"
            raise ConfigError(
                f"unknown exchange {exchange!r}: no row of it has landed in {path} and the "
                f"replay has no progress for it (exchanges with progress: {known}); check "
                "--exchange (names are exact)"
            )
        return (
            f"nothing to rewind: exchange {exchange!r} has no replay progress yet (never "
            "replayed): once approved, the replay publishes its whole landed history"
        )
    found: dict[str, Any] = {}
    try:
        if target.to_seq is not None:
            first = _first_at_seq(tables, exchange, *target.to_seq)
        elif target.since is not None:
            first = _first_since(tables, exchange, target.since)
        else:
            ranges, found = _skipped_ranges(tables, exchange, old.unaudited_events)
            got = _first_skipped(tables, exchange, ranges)
            if got is None:
                raise _Nothing(
                    f"the rows of exchange {exchange!r} audited as skipped ({ranges}) are no "
                    f"longer in {path}: nothing to rewind"
                )
            first = got
    except _Nothing as e:
        return str(e)
    to = (first[0], first[1], first[2] - 1)  # just before it: the replay publishes rows after
    new_key = min(old.key, to)
    ahead = {k for k in old.ahead if k <= to}  # later ones are published again
    if new_key == old.key and ahead == old.ahead:
        return (
            f"nothing to rewind: the first row to publish again ({_key_text(first)}) is after "
            f"exchange {exchange!r}'s replay progress ({_key_text(old.key)}) and was not "
            "published ahead of it: the replay publishes it anyway"
        )
    seen = tables.read(
        "messages",
        columns=_KEY_COLUMNS,
        filter=(_f("exchange") == exchange) & (_f("land_seq") <= old.land_seq),
    )
    below = seen.filter(~after_key(new_key))
    rows = seen.filter(after_key(new_key) & ~after_key(old.key)).num_rows
    after = _rewound(old, new_key, ahead, below)
    return Rewind(exchange, target, old, after, first, rows, len(old.ahead) - len(ahead), found)


def _approved(cfg: Config, exchange: str) -> bool | None:
    try:
        return (
            exchange
            in set(cfg.red.replay.approved) | Approvals.load(Path(cfg.red.state_dir)).approved()
        )
    except DiodeError:  # only shown; the replay reports unreadable approvals
        return None


def _event(plan: Rewind, reason: str | None) -> dict[str, Any]:
    """``plan``'s ``replay_rewound`` audit event."""
    detail = {**{k: v for k, v in plan.to_json().items() if k != "exchange"}, "by": operator_name()}
    return {
        "event": REWOUND,
        "exchange": plan.exchange,
        "channel": plan.first[1],
        "seq_first": plan.first[2],
        "reason": reason,
        "detail": json.dumps(detail, sort_keys=True),
    }


def _save_audited(
    cfg: Config, progress: dict[str, Progress], plan: Rewind, reason: str | None
) -> bool:
    """Save ``plan``'s progress with its ``replay_rewound`` event, then write the event and the
    exchange's events still waiting for the audit sink in one commit (one version: ``--skipped``
    counts only events of later versions, so the skips this rewind republishes are not counted
    again), then save the progress without them. True if written; False when the audit table
    refused: the events stay in the progress, and the replay writes them first, in one commit,
    at its next start (a kill in between writes them twice, never loses them)."""
    state_dir = Path(cfg.red.state_dir)
    events = [*plan.after.unaudited_events, _event(plan, reason)]
    progress[plan.exchange] = replace(plan.after, unaudited_events=events)
    save_progress(state_dir, progress)
    try:
        audit_sink(cfg)(events)
    except Exception as e:  # noqa: BLE001 - kept in the progress: the replay writes them
        log_event(log, 40, "replay_rewound audit row not written now: kept in the replay "
                  "progress, the replay writes it first at its next start",
                  exchange=plan.exchange, error=f"{type(e).__name__}: {e}")  # fmt: skip
        return False
    progress[plan.exchange] = replace(plan.after, unaudited_events=[])
    save_progress(state_dir, progress)
    return True


def rewind_exchange(
    cfg: Config,
    exchange: str,
    target: Target,
    *,
    reason: str | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Rewind ``exchange``'s replay progress to just before ``target``'s row (see the module
    docstring) and audit it; with ``dry_run`` only say what that would do. Returns the report
    (``rewound`` False with a ``note`` when there is nothing to rewind). StateError while a
    replay publisher runs (it holds ``state_dir/replay.lock``), or when the audit row could not
    be written after the progress was saved."""
    state_dir = Path(cfg.red.state_dir)
    if not state_dir.is_dir():
        raise ConfigError(
            f"red.state_dir {state_dir} does not exist: the replay never ran with this config "
            "(check --config / red.state_dir)"
        )
    lock = state_dir / LOCK_FILE
    held = contextlib.ExitStack()
    if not dry_run:
        held.enter_context(
            exclusive_lock(
                lock,
                what=f"diode red rewind of exchange {exchange!r}",
                hint="the replay publisher is running (it holds this lock): stop it first "
                "(`systemctl stop diode-red-replay`, or wait for a scheduled "
                "`diode red replay --until-caught-up` to end), rewind, then start it again",
            )
        )
    with held:
        progress = load_progress(state_dir)
        plan = plan_rewind(cfg, exchange, target, progress)
        out: dict[str, Any] = {"exchange": exchange, "dry_run": dry_run, "rewound": False}
        if isinstance(plan, str):
            return {**out, "note": plan}
        out.update(plan.to_json())
        out["approved"] = _approved(cfg, exchange)
        old_key = plan.before.key
        republish = (
            f"the replay publishes {plan.rows + plan.ahead} row(s) of exchange {exchange!r} "
            f"again, from {_key_text(plan.first)} up to where it was ({_key_text(old_key)}), "
            "in its usual order, then goes on as before (at-least-once: "
            + (
                f"consumers de-duplicate on the {cfg.red.replay.id_header} header)"
                if cfg.red.replay.id_header
                else "consumers get those rows twice; red.replay.id_header would let them "
                "de-duplicate)"
            )
        ) + ("" if out["approved"] is not False else "; the exchange is not approved: that "
             "happens once it is")  # fmt: skip
        if dry_run:
            running = lock_held(lock)
            out["replay_running"] = running
            out["note"] = f"dry run, nothing changed: after a rewind {republish}" + (
                f"; the replay publisher runs now ({lock}): stop it before rewinding"
                if running
                else ""
            )
            return out
        # under the lock: no replay writes its audit rows before this one (their versions
        # order them: `--skipped` reads what came after the last rewind)
        written = _save_audited(cfg, progress, plan, reason)
        out["rewound"] = True
    out["audit_rows_written"] = 1 if written else 0
    out["note"] = f"rewound: {republish}" + (
        ""
        if written
        else "; its replay_rewound audit row could not be written now (see the "
        "log): it is kept in the replay progress and the replay writes it first at its next start"
    )
    return out
