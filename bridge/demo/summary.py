"""Demo, summary: account for every message from what red holds, and render the run as a table.

The figures come from the evidence, not from the jobs' own counters: unique ``(channel, seq)``
keys in the red ``messages`` Delta table, rows beyond one per key, and the files in red's
quarantine (``bridge.red.quarantine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from bridge.config import Config
from bridge.red.job import open_tables
from bridge.red.quarantine import list_quarantined

__all__ = ["RedAccount", "red_account", "key_counts", "summary_table"]


@dataclass(frozen=True)
class RedAccount:
    """What red holds after a run."""

    rows: int
    """Rows of the ``messages`` table."""
    unique: int
    """Distinct ``(channel, seq)`` among them."""
    quarantined: int
    """Files in red's quarantine (as `diode quarantine list` lists them)."""

    @property
    def duplicates(self) -> int:
        """Rows of ``messages`` beyond one per ``(channel, seq)`` (exactly once: 0)."""
        return self.rows - self.unique


def key_counts(keys: pa.Table) -> tuple[int, int]:
    """Rows and distinct ``(channel, seq)`` of a table holding those two columns."""
    if not keys.num_rows:
        return 0, 0
    return keys.num_rows, keys.group_by(["channel", "seq"]).aggregate([]).num_rows


def red_account(cfg: Config) -> RedAccount:
    """Count the ``messages`` table's rows and unique keys, and red's quarantined files."""
    rows, unique = key_counts(open_tables(cfg).read("messages", columns=["channel", "seq"]))
    quarantined = sum(1 for e in list_quarantined(cfg) if not e.get("file_gone"))
    return RedAccount(rows, unique, quarantined)


def _n(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else ("" if v is None else str(v))


def _rate(count: Any, seconds: Any) -> str:
    if not isinstance(count, int) or not seconds:
        return ""
    return f"{count / float(seconds):,.0f}"


def summary_table(s: dict[str, Any]) -> str:
    """The demo's summary as a plain-text table (one stage a line), then the account line."""
    rows = [
        ("published on black", s.get("published"), s.get("publish_seconds")),
        ("sealed into bundles", s.get("sealed"), s.get("black_seconds")),
        (f"crossed the diode ({s.get('transport')})", s.get("files_crossed"), None),
        ("landed in Delta", s.get("landed"), s.get("red_seconds")),
        ("replayed (confirmed)", s.get("replayed"), s.get("replay_seconds")),
        ("received on red", s.get("received_on_red"), None),
    ]
    out = [f"{'stage':<30} {'count':>12} {'seconds':>9} {'per s':>10}", "-" * 64]
    for label, count, secs in rows:
        unit = " files" if label.startswith("crossed") else ""
        out.append(
            f"{label:<30} {_n(count) + unit:>12} {_n(secs):>9} "
            f"{_rate(count, secs) if not unit else '':>10}"
        )
    out.append("-" * 64)
    out.append(
        "bundles {b} · lost {lost} · duplicates {dup} · quarantined {q} · {verdict}".format(
            b=_n(s.get("bundles")),
            lost=_n(s.get("lost")),
            dup=_n(s.get("duplicates")),
            q=_n(s.get("quarantined")),
            verdict="ok" if s.get("ok") else "NOT OK",
        )
    )
    out.append("seconds include each stage's start-up (Spark's, in the first job)")
    out.append(f"workdir {s.get('workdir')}  (tables: {s.get('tables')})")
    return "\n".join(out)
