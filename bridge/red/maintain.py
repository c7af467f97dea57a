"""Red, maintenance: compact and vacuum the red Delta tables safely beside a running red job.

``diode red maintain`` runs here. Every argument is checked before any table is touched. The
ledger (``bundles``) is compacted only while no red job holds ``state_dir/red.lock``: the job's
chain-status updates swap ledger files in a commit delta-rs does not check for conflicts, so a
compaction committed in between would leave both the compacted and the rewritten rows (two
``landed`` rows for one bundle). ``messages`` and ``audit`` are only ever appended to while red
runs, so they are compacted at any time; a compaction that loses a commit race to an append is
tried again.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from deltalake.exceptions import CommitFailedError

from bridge.config import Config
from bridge.errors import ConfigError, StateError
from bridge.fsutil import exclusive_lock
from bridge.logs import get_logger, log_event
from bridge.red.layout import LOCK_FILE
from bridge.red.tables import MIN_SAFE_VACUUM_HOURS, RedTables

__all__ = ["TABLES", "check_vacuum_hours", "maintain_tables"]

log = get_logger("bridge.red.maintain")

TABLES = ("messages", "bundles", "audit")
COMMIT_TRIES = 4
"""Attempts of one table's maintenance that lose a commit race (another writer committed)."""


def check_vacuum_hours(hours: float | None) -> None:
    """ConfigError unless ``hours`` is None or a finite retention of at least 168 h."""
    if hours is None:
        return
    if not math.isfinite(hours) or hours < MIN_SAFE_VACUUM_HOURS:
        raise ConfigError(
            f"--vacuum-hours {hours}: give at least {MIN_SAFE_VACUUM_HOURS:.0f} (7 days, the "
            "tables' delta.deletedFileRetentionDuration). A shorter retention deletes files a "
            "reader still on an older snapshot needs (the replay publisher between polls, a "
            "Spark stream, a notebook); no table was touched"
        )


def maintain_tables(
    cfg: Config, tables: RedTables, names: list[str], vacuum_hours: float | None
) -> dict[str, Any]:
    """Compact (and vacuum, ``vacuum_hours``) each of ``names``; returns the stats per table.
    ``bundles`` is skipped, saying so in its stats and a warning, while a red job runs."""
    check_vacuum_hours(vacuum_hours)
    for n in names:
        if n not in TABLES:
            raise ConfigError(f"red table {n!r}: give one of {', '.join(TABLES)}")
    out: dict[str, Any] = {}
    for name in names:
        if name != "bundles":
            out[name] = _with_retries(tables, name, vacuum_hours)
            continue
        lock = Path(cfg.red.state_dir) / LOCK_FILE
        try:
            with exclusive_lock(lock, what="red maintain (bundles)"):
                out[name] = _with_retries(tables, name, vacuum_hours)
        except StateError:
            why = (
                f"a red job holds {lock}: its chain-status updates cannot be made safe against "
                "a compaction of the ledger; run `diode red maintain --table bundles` while the "
                "red job is stopped or between scheduled runs"
            )
            log_event(log, 30, "ledger not compacted: the red job is running", lock=str(lock))
            out[name] = {"table": name, "skipped": why}
    return out


def _with_retries(tables: RedTables, name: str, vacuum_hours: float | None) -> dict[str, Any]:
    for attempt in range(1, COMMIT_TRIES + 1):
        try:
            return tables.maintain(name, optimize=True, vacuum_hours=vacuum_hours)
        except CommitFailedError as e:
            if attempt == COMMIT_TRIES:
                raise
            log_event(
                log, 30, "table maintenance lost a commit race: trying again", table=name,
                attempt=attempt, error=str(e)[:300],
            )  # fmt: skip
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")
