"""Red, state: the names of the landing's files in ``red.state_dir`` and ``red.work_dir``."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "STATE_FILE", "LOCK_FILE", "JOURNAL_DIR", "INTENT_FILE", "AUDIT_PENDING_DIR",
    "INTAKE_DIR", "RED_DIR_KEYS",
    "WALKED_DIR_KEYS", "intent_path",
]  # fmt: skip

RED_DIR_KEYS = (
    "inbox", "work_dir", "processed_dir", "quarantine_dir", "state_dir", "checkpoint_dir",
    "tables_dir",
)  # fmt: skip
"""The ``[red]`` directories a red job creates and writes (bridge.red.job: checked at start).
Each is red's alone: no two are the same directory, none is inside the inbox, nor the inbox
inside one of them."""
WALKED_DIR_KEYS = ("work_dir", "processed_dir", "quarantine_dir")
"""Red directories red manages as a whole, so no other red directory may be inside one:
``work_dir`` (its ``plain/`` is swept of ``*.parquet`` at start, its ``landing/`` hold folders
deleted), ``processed_dir`` and ``quarantine_dir`` (every file in them is counted and listed
as evidence, by day folder)."""

STATE_FILE = "red-state.json"
LOCK_FILE = "red.lock"
"""``state_dir/red.lock``: held by the one process that lands (a red job, or an operator
command applying a request while no job runs)."""
JOURNAL_DIR = "landing"
"""``state_dir/landing/``: the landing's journal."""
INTENT_FILE = "intent.json"
"""The journal's intent: the landing judged and not yet wholly applied."""
INTAKE_DIR = "intake"
"""``work_dir/intake/``: where the intake moves the files it takes from the inbox, until they
land or are quarantined."""
AUDIT_PENDING_DIR = "audit-pending"
"""``work_dir/audit-pending/``: one JSON record per file the intake quarantined itself, written
before the inbox entry goes, until the landing audits it (``quarantined``)."""


def intent_path(state_dir: str | Path) -> Path:
    """Where the landing journals its intent (its source process reads it without importing
    the Delta side)."""
    return Path(state_dir) / JOURNAL_DIR / INTENT_FILE
