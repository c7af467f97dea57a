"""Red, replay approvals: which exchanges the replay publisher may publish (durable, revisioned).

The DMZ rule (DESIGN §3.8): landed traffic is replayed into red RabbitMQ only for exchanges an
operator approved, in the configuration (``red.replay.approved``) or at run time with
``diode approve EXCHANGE`` / ``diode approve --revoke EXCHANGE``. Run-time approvals live in
``state_dir/approvals.json``::

    {"format": 1, "revision": 3,
     "approved": {"orders": {"revision": 1, "by": "ops", "note": "...", "at": "..."}},
     "history": [{"revision": 1, "action": "approve", "exchange": "orders", ...}, ...]}

Every effective change gets the next revision number and a history entry; approving what is
approved already (or revoking what is not) changes nothing. Changes are made under an
exclusive lock (``approvals.lock``) on the file read fresh, and written temp + fsync + rename,
so concurrent ``diode approve`` calls never lose one another. The replay publisher reads the
file at every pass, so approvals take effect without a restart; approving an exchange replays
its whole landed history (its replay progress starts empty).

``approve_exchanges`` (the CLI) also writes ``approved`` / ``revoked`` rows into the audit
table with the Delta application transaction ``("diode-approve", revision)``, catching up on
any change whose audit row is missing (a crash between the two writes). It changes the file
and writes the audit rows under one hold of ``approvals.lock``, so two runs never write the
same rows, and numbers new changes above the audit's newest ``diode-approve`` version: after
the file was lost or restored from an older backup, new changes still get audit rows (the
file's revision jumps ahead instead of restarting at 1).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from bridge.config import Config
from bridge.errors import ConfigError, StateError
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock
from bridge.logs import get_logger, log_event, operator_name
from bridge.protocol.exchange import check_exchange_name

__all__ = [
    "landed_exchanges",
    "APP_ID",
    "APPROVALS_FILE",
    "Approvals",
    "Change",
    "approve_exchanges",
    "audited_revision",
    "check_exchange_name",
    "effective_approved",
    "sync_audit",
]

log = get_logger("bridge.red.approvals")

APP_ID = "diode-approve"
"""Delta application id of the approval audit rows (version = approvals revision)."""
APPROVALS_FILE = "approvals.json"
LOCK_FILE = "approvals.lock"
FORMAT = 1
_LOCK_WAIT = 30.0  # seconds a `diode approve` waits for another one to finish

Action = Literal["approve", "revoke"]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Change:
    """One effective change of the approvals: revision, what, which exchange, who, why, when."""

    revision: int
    action: Action
    exchange: str
    by: str
    note: str
    at: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any, where: Path) -> Change:
        try:
            action = d["action"]
            if action not in ("approve", "revoke"):
                raise ValueError(f"unknown action {action!r}")
            return cls(
                revision=int(d["revision"]),
                action=action,
                exchange=check_exchange_name(d["exchange"]),
                by=str(d["by"]),
                note=str(d["note"]),
                at=str(d["at"]),
            )
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise StateError(
                f"approvals file {where}: a history entry is malformed ({e})"
            ) from None


class Approvals:
    """The run-time approvals of one red ``state_dir`` (see the module docstring)."""

    def __init__(
        self, state_dir: Path, revision: int = 0, history: list[Change] | None = None
    ) -> None:
        self.state_dir = Path(state_dir)
        self.revision = revision
        self.history: list[Change] = list(history or [])
        self._approved = _replay(self.history)

    @property
    def path(self) -> Path:
        """The approvals file."""
        return self.state_dir / APPROVALS_FILE

    def __repr__(self) -> str:
        return f"Approvals({str(self.state_dir)!r}, revision={self.revision})"

    # -- reading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, state_dir: Path) -> Approvals:
        """The approvals saved in ``state_dir`` (none yet: empty, revision 0)."""
        state_dir = Path(state_dir)
        path = state_dir / APPROVALS_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(state_dir)
        return cls._parse(state_dir, path, data)

    @classmethod
    def _parse(cls, state_dir: Path, path: Path, data: bytes) -> Approvals:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"not an approvals file of format {FORMAT}")
            revision = int(doc["revision"])
            raw_history = doc["history"]
            if not isinstance(raw_history, list):
                raise ValueError("history is not a list")
        except (ValueError, KeyError, TypeError) as e:
            raise StateError(
                f"approvals file {path} is unreadable ({e}); restore it from backup or fix it "
                "by hand (until then nothing approved at run time is replayed)"
            ) from None
        history = [Change.from_json(d, path) for d in raw_history]
        revs = [c.revision for c in history]
        if revs != sorted(set(revs)) or (revs and revs[-1] != revision):
            raise StateError(
                f"approvals file {path}: revisions {revs[-5:]} are not increasing up to the "
                f"file's revision {revision}; restore it from backup"
            )
        return cls(state_dir, revision, history)

    def approved(self) -> set[str]:
        """Exchanges approved at run time (the configuration's list is not included)."""
        return set(self._approved)

    def approval(self, name: str) -> Change | None:
        """The change that approved ``name`` if it is approved now, else None."""
        return self._approved.get(name)

    def changes_since(self, revision: int) -> list[Change]:
        """History entries newer than ``revision``, oldest first."""
        return [c for c in self.history if c.revision > revision]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "revision": self.revision,
            "approved": {
                n: {k: v for k, v in c.to_json().items() if k not in ("action", "exchange")}
                for n, c in sorted(self._approved.items())
            },
            "history": [c.to_json() for c in self.history],
        }

    # -- changing ----------------------------------------------------------------------------
    def approve(self, name: str, by: str, note: str = "") -> int:
        """Approve ``name`` for replay; returns the revision of its approval (unchanged when it
        was approved already)."""
        return self.change("approve", name, by, note)[0]

    def revoke(self, name: str, by: str, note: str = "") -> int:
        """Stop replaying ``name``; returns the revision of the revocation (the current
        revision when it was not approved)."""
        return self.change("revoke", name, by, note)[0]

    def change(self, action: Action, name: str, by: str, note: str = "") -> tuple[int, bool]:
        """Apply ``action`` to ``name``: (revision, whether this call changed anything).
        Not audited: :func:`approve_exchanges` (``diode approve``) also numbers above the
        audit's ``diode-approve`` version and writes the audit rows."""
        check_exchange_name(name)
        with self.locked():
            return self._apply(action, name, by, note, 0)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold ``approvals.lock`` with the file read fresh: nothing changes it meanwhile."""
        durable_mkdir(self.state_dir)
        with exclusive_lock(
            self.state_dir / LOCK_FILE,
            what=f"changing the replay approvals in {self.state_dir}",
            timeout=_LOCK_WAIT,
            hint="another `diode approve` is running; retry once it finished",
        ):
            fresh = Approvals.load(self.state_dir)
            self.revision, self.history = fresh.revision, fresh.history
            self._approved = fresh._approved
            yield

    def _apply(self, action: Action, name: str, by: str, note: str, floor: int) -> tuple[int, bool]:
        """``change`` for a holder of :meth:`locked`; a new revision is above ``floor`` too."""
        current = self._approved.get(name)
        if (action == "approve") == (current is not None):
            return (current.revision if current is not None else self.revision), False
        revision = max(self.revision, floor) + 1
        if floor > self.revision:
            log_event(log, 30, "approvals revision continues above the audit's",
                      path=str(self.path), file_revision=self.revision, audit_revision=floor,
                      revision=revision)  # fmt: skip
        change = Change(revision, action, name, str(by), str(note), _now())
        self.history.append(change)
        self.revision = change.revision
        self._approved = _replay(self.history)
        data = json.dumps(self.to_json(), indent=1, sort_keys=True).encode() + b"\n"
        atomic_write_bytes(self.path, data)
        log_event(log, 20, f"exchange {action}d for replay", exchange=name,
                  revision=change.revision, by=change.by, note=note)  # fmt: skip
        return change.revision, True


def _replay(history: list[Change]) -> dict[str, Change]:
    approved: dict[str, Change] = {}
    for c in history:
        if c.action == "approve":
            approved[c.exchange] = c
        else:
            approved.pop(c.exchange, None)
    return approved


def effective_approved(cfg: Config) -> set[str]:
    """What the replay publisher may publish: ``red.replay.approved`` ∪ run-time approvals."""
    return set(cfg.red.replay.approved) | Approvals.load(Path(cfg.red.state_dir)).approved()


# -- audit ------------------------------------------------------------------------------------


def _audit_event(c: Change) -> dict[str, Any]:
    return {
        "event": "approved" if c.action == "approve" else "revoked",
        "exchange": c.exchange,
        "reason": c.note or None,
        "detail": json.dumps({"revision": c.revision, "by": c.by}, sort_keys=True),
        "at": datetime.fromisoformat(c.at.replace("Z", "+00:00")),
    }


def audited_revision(tables_dir: Path) -> int | None:
    """The audit table's newest ``diode-approve`` version (0: none yet); None before the table
    exists (the red job creates it)."""
    from deltalake import DeltaTable

    from bridge.red.tables import RedTables

    tables = RedTables(Path(tables_dir), "delta-rs")
    if not DeltaTable.is_deltatable(str(tables.path("audit"))):
        return None
    return max(tables.txn_version("audit", APP_ID), 0)


def _audit_floor(tables_dir: Path) -> tuple[int, str | None]:
    """(the audited revision new changes must exceed, why it could not be read or None)."""
    try:
        return audited_revision(tables_dir) or 0, None
    except Exception as e:  # the approval still holds; sync_audit reports the same problem
        why = (
            f"the audit table in {tables_dir} is not readable ({type(e).__name__}: {e}): new "
            f"revisions may repeat audited ones; check the audit's {APP_ID} rows"
        )
        log_event(log, 30, "approvals: audited revision not read", tables_dir=str(tables_dir),
                  error=str(e))  # fmt: skip
        return 0, why


def _behind_audit(approvals: Approvals, audited: int) -> str | None:
    """Why the approvals file is suspect when its revision is below the audit's, else None."""
    if approvals.revision >= audited:
        return None
    return (
        f"approvals file {approvals.path} is at revision {approvals.revision} but the audit "
        f"table holds {APP_ID} revision {audited}: the file was lost or restored from an "
        f"older backup, so changes {approvals.revision + 1}..{audited} are missing from it "
        "(a revocation among them no longer holds); compare the approvals with the audit's "
        "approved / revoked rows and approve or revoke again; new changes are numbered above "
        f"{audited}"
    )


def sync_audit(tables_dir: Path, approvals: Approvals) -> int:
    """Write the audit rows of every change the audit table lacks, in one commit
    ``("diode-approve", newest revision)``; returns how many were written. Nothing (0) when
    the audit table does not exist yet (the red job creates it; a later call catches up).
    Call it holding ``approvals.locked()``: two unlocked calls may both write the same rows.
    Warns when the audit holds a newer revision than the file (the file was lost or restored)."""
    from bridge.red.schema import audit_rows
    from bridge.red.tables import RedTables

    have = audited_revision(tables_dir)
    if have is None:
        return 0
    behind = _behind_audit(approvals, have)
    if behind is not None:
        log_event(log, 30, behind, path=str(approvals.path), file_revision=approvals.revision,
                  audit_revision=have)  # fmt: skip
    missing = approvals.changes_since(have)
    if not missing:
        return 0
    version = missing[-1].revision
    rows = audit_rows([_audit_event(c) for c in missing], APP_ID, version, datetime.now(UTC))
    tables = RedTables(Path(tables_dir), "delta-rs")
    return len(missing) if tables.append("audit", rows, app_id=APP_ID, version=version) else 0


def approve_exchanges(
    cfg: Config,
    names: list[str],
    *,
    revoke: bool = False,
    note: str = "",
    by: str | None = None,
) -> dict[str, Any]:
    """`diode approve [--revoke] NAME...`: change the approvals and audit them, under one hold
    of ``approvals.lock``; returns a report."""
    for name in names:
        check_exchange_name(name)
    who = by or operator_name()
    action: Action = "revoke" if revoke else "approve"
    tables_dir = Path(cfg.red.tables_dir)
    approvals = Approvals(Path(cfg.red.state_dir))
    changed: list[dict[str, Any]] = []
    unchanged: list[str] = []
    warnings: list[str] = []
    with approvals.locked():
        floor, unreadable = _audit_floor(tables_dir)
        behind = _behind_audit(approvals, floor)  # before the changes lift the revision
        for name in names:
            rev, did = approvals._apply(action, name, who, note, floor)
            if did:
                changed.append({"exchange": name, "revision": rev})
            else:
                unchanged.append(name)
        audited = _sync_or_defer(tables_dir, approvals)
    warnings += [w for w in (unreadable, behind) if w is not None]
    configured = set(cfg.red.replay.approved)
    if not revoke:
        warnings += _not_landed(tables_dir, [c["exchange"] for c in changed])
    if revoke:
        for name in sorted(configured & set(names)):
            warnings.append(
                f"exchange {name!r} stays approved: it is listed in red.replay.approved of the "
                "configuration; remove it there and restart the replay publisher"
            )
    return {
        "action": action,
        "revision": approvals.revision,
        "changed": changed,
        "unchanged": unchanged,
        "approved": sorted(configured | approvals.approved()),
        "approved_in_config": sorted(configured),
        "warnings": warnings,
        "audit_rows_written": audited,
    }


def landed_exchanges(tables_dir: Path) -> set[str] | None:
    """The exchanges with rows in ``messages`` (its partition values, from the Delta log: no
    data file is read); None when the table does not exist yet."""
    from deltalake import DeltaTable

    path = Path(tables_dir) / "messages"
    if not DeltaTable.is_deltatable(str(path)):
        return None
    return {str(p.get("exchange") or "") for p in DeltaTable(str(path)).partitions()}


def _not_landed(tables_dir: Path, names: list[str]) -> list[str]:
    """A warning per newly approved name no landed row has (a typo goes unnoticed otherwise:
    the approval waits, silently, for rows that never come)."""
    if not names:
        return []
    try:
        landed = landed_exchanges(tables_dir)
    except Exception as e:  # noqa: BLE001 - a warning only; the approval stands
        return [f"landed exchanges not read ({type(e).__name__}: {e}): names not checked"]
    if landed is None:
        return [f"nothing has landed yet in {tables_dir}: approved names not checked"]
    shown = ", ".join(repr(x) for x in sorted(landed)[:20]) or "none"
    more = f" and {len(landed) - 20} more" if len(landed) > 20 else ""
    return [
        f"exchange {n!r} has no landed row (landed: {shown}{more}): a typo? It stays approved; "
        f"revoke it with `diode approve --revoke {n}` if so"
        for n in names
        if n not in landed
    ]


def _sync_or_defer(tables_dir: Path, approvals: Approvals) -> int | str:
    """``sync_audit``, or why it failed (the approvals are durable; the next call retries)."""
    try:
        return sync_audit(tables_dir, approvals)
    except Exception as e:
        log_event(log, 30, "approval not audited yet", tables_dir=str(tables_dir),
                  revision=approvals.revision, error=str(e))  # fmt: skip
        return f"not written ({type(e).__name__}: {e}); the next `diode approve` retries"
