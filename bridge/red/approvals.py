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
any change whose audit row is missing (a crash between the two writes).
"""

from __future__ import annotations

import getpass
import json
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from bridge.config import Config
from bridge.errors import ConfigError, StateError
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock
from bridge.logs import get_logger, log_event
from bridge.protocol.exchange import check_exchange_name

__all__ = [
    "APP_ID",
    "APPROVALS_FILE",
    "Approvals",
    "Change",
    "approve_exchanges",
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
        """Apply ``action`` to ``name``: (revision, whether this call changed anything)."""
        check_exchange_name(name)
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
            current = self._approved.get(name)
            if (action == "approve") == (current is not None):
                return (current.revision if current is not None else self.revision), False
            change = Change(self.revision + 1, action, name, str(by), str(note), _now())
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


def sync_audit(tables_dir: Path, approvals: Approvals) -> int:
    """Write the audit rows of every change the audit table lacks, in one commit
    ``("diode-approve", newest revision)``; returns how many were written. Nothing (0) when
    the audit table does not exist yet (the red job creates it; a later call catches up)."""
    from deltalake import DeltaTable

    from bridge.red.schema import audit_rows
    from bridge.red.tables import RedTables

    tables = RedTables(Path(tables_dir), "delta-rs")
    if not DeltaTable.is_deltatable(str(tables.path("audit"))):
        return 0
    have = tables.txn_version("audit", APP_ID)
    missing = approvals.changes_since(have)
    if not missing:
        return 0
    version = missing[-1].revision
    rows = audit_rows([_audit_event(c) for c in missing], APP_ID, version, datetime.now(UTC))
    return len(missing) if tables.append("audit", rows, app_id=APP_ID, version=version) else 0


def approve_exchanges(
    cfg: Config,
    names: list[str],
    *,
    revoke: bool = False,
    note: str = "",
    by: str | None = None,
) -> dict[str, Any]:
    """`diode approve [--revoke] NAME...`: change the approvals, audit them; returns a report."""
    for name in names:
        check_exchange_name(name)
    who = by or _who()
    approvals = Approvals.load(Path(cfg.red.state_dir))
    changed: list[dict[str, Any]] = []
    unchanged: list[str] = []
    for name in names:
        rev, did = approvals.change("revoke" if revoke else "approve", name, who, note)
        if did:
            changed.append({"exchange": name, "revision": rev})
        else:
            unchanged.append(name)
    configured = set(cfg.red.replay.approved)
    warnings = []
    if revoke:
        for name in sorted(configured & set(names)):
            warnings.append(
                f"exchange {name!r} stays approved: it is listed in red.replay.approved of the "
                "configuration; remove it there and restart the replay publisher"
            )
    try:
        audited: int | str = sync_audit(Path(cfg.red.tables_dir), approvals)
    except Exception as e:  # the approval itself is durable; the next call catches up
        log_event(log, 30, "approval not audited yet", error=str(e))
        audited = f"not written ({type(e).__name__}: {e}); the next `diode approve` retries"
    return {
        "action": "revoke" if revoke else "approve",
        "revision": approvals.revision,
        "changed": changed,
        "unchanged": unchanged,
        "approved": sorted(configured | approvals.approved()),
        "approved_in_config": sorted(configured),
        "warnings": warnings,
        "audit_rows_written": audited,
    }


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return user
