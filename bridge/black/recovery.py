"""Black, recovery: before a run, ship what Spark committed but black never delivered.

The sink seals batch N while Spark reads batch N+1, so Spark may have committed spool positions
whose bundle a crash interrupted. Spark would re-read them only when new data makes it plan
another batch; on a quiet channel they would wait. So at start-up black compares the last
committed positions in the checkpoint's offset log (``offsets/<id>`` of the newest
``commits/<id>``) with its journal and seals the difference itself, from the spool, through
the same sealer. The spool still holds them: segments are released only once shipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from bridge.black.catalog import load_catalog
from bridge.black.seal import BundleSealer, ShippedBundle
from bridge.black.spool_rows import read_rows
from bridge.black.state import StateStore
from bridge.config import Config
from bridge.errors import StateError
from bridge.logs import get_logger, log_event

__all__ = ["committed_offsets", "recover_committed"]

log = get_logger("bridge.black.recovery")


def committed_offsets(checkpoint_dir: Path) -> dict[str, int] | None:
    """``{channel: end offset}`` of the newest committed micro-batch, None before the first."""
    commits = Path(checkpoint_dir) / "commits"
    if not commits.is_dir():
        return None
    ids = sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    if not ids:
        return None
    path = Path(checkpoint_dir) / "offsets" / str(ids[-1])
    try:
        lines = path.read_text().splitlines()
        # v1 / batch metadata / one offset per source: this query has exactly one source
        offsets = json.loads(lines[2])
        return {str(k): int(v) for k, v in offsets.items()}
    except (OSError, IndexError, ValueError, TypeError, AttributeError) as e:
        raise StateError(
            f"cannot read Spark's offset log {path} ({e}); the checkpoint is damaged: restore it, "
            "or delete it (black's journal then decides where to start)"
        ) from None


def recover_committed(cfg: Config, sealer: BundleSealer, store: StateStore) -> list[ShippedBundle]:
    """Seal positions that Spark committed beyond black's journal; returns the bundles shipped."""
    done = committed_offsets(Path(cfg.black.checkpoint_dir))
    if not done:
        return []
    shipped: list[ShippedBundle] = []
    step = cfg.black.max_messages_per_batch
    for ch in cfg.channels:
        end = done.get(ch.name)
        journal = store.load(ch.name)
        start = journal.last_seq + 1
        if end is None or start >= end:
            continue
        log_event(
            log,
            30,
            "shipping positions Spark committed but black had not delivered",
            channel=ch.name,
            first_seq=start,
            last_seq=end - 1,
        )
        decls = load_catalog(Path(cfg.black.state_dir) / "exchanges.json")
        # the first range must hold a pending bundle whole, or it cannot be re-created
        first_end = min(end, start + step)
        if journal.pending:
            m = json.loads(journal.pending["manifest"])
            covered = [m.get("last_seq") or -1, *(g["last_seq"] for g in m.get("gaps", []))]
            first_end = min(end, max(first_end, max(covered) + 1))
        bounds = [(start, first_end)]
        bounds += [(a, min(end, a + step)) for a in range(first_end, end, step)]
        spool = Path(cfg.black.spool_dir)
        for a, b in bounds:
            if a >= b:
                continue
            batches = list(read_rows(spool, ch.name, a, b, decls))
            if batches:
                shipped += sealer.seal_rows(ch, pa.Table.from_batches(batches))
    return shipped
