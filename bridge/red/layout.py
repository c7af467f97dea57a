"""Red, state: the names of the landing's files in ``red.state_dir`` (job, source, reports)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["STATE_FILE", "LOCK_FILE", "JOURNAL_DIR", "INTENT_FILE", "intent_path"]

STATE_FILE = "red-state.json"
LOCK_FILE = "red.lock"
"""``state_dir/red.lock``: held by the one process that lands (a red job, or an operator
command applying a request while no job runs)."""
JOURNAL_DIR = "landing"
"""``state_dir/landing/``: the landing's journal."""
INTENT_FILE = "intent.json"
"""The journal's intent: the landing judged and not yet wholly applied."""


def intent_path(state_dir: str | Path) -> Path:
    """Where the landing journals its intent (its source process reads it without importing
    the Delta side)."""
    return Path(state_dir) / JOURNAL_DIR / INTENT_FILE
