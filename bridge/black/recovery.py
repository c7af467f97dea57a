"""Black, recovery: before a run, ship what Spark committed but black never delivered.

The sink seals batch N while Spark reads batch N+1, so Spark may have committed spool positions
whose bundle a crash interrupted. Spark would re-read them only when new data makes it plan
another batch; on a quiet channel they would wait. So at start-up black compares the last
committed positions in the checkpoint's offset log (``offsets/<id>`` of the newest
``commits/<id>``) with its journal and seals the difference itself, from the spool, through
the same sealer. The spool still holds them: segments are released only once shipped.

Its TAIL may not say so: TAIL is not fsynced, and after a power loss it can lag positions Spark
already committed (or, when the disk lost fsynced data, lead what the segments hold). Only the
spool's writer repairs that, when it opens the spool, and the taps start after this pass. So
before reading a channel's spool, recovery runs that same repair (``SpoolWriter.repair``) when
no tap holds the spool's LOCK; a tap that holds it repaired the spool when it opened it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from bridge.black.catalog import load_catalog
from bridge.black.seal import BundleSealer, ShippedBundle
from bridge.black.spool import SpoolWriter, writer_settings
from bridge.black.spool_read import read_tail
from bridge.black.spool_rows import read_rows
from bridge.black.state import StateStore
from bridge.config import Config
from bridge.errors import ConfigError, SpoolFull, StateError
from bridge.logs import get_logger, log_event
from bridge.spark import FOREIGN_CHECKPOINT

__all__ = ["committed_offsets", "recover_committed", "repair_spool"]

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
    except (OSError, IndexError, ValueError) as e:
        raise StateError(
            f"cannot read Spark's offset log {path} ({e}); the checkpoint is damaged: restore it, "
            "or delete it (black's journal then decides where to start)"
        ) from None
    if not isinstance(offsets, dict) or not all(
        type(v) is int and v >= 0 for v in offsets.values()
    ):
        shown = json.dumps(offsets)[:200]
        raise ConfigError(
            f"black.checkpoint_dir {checkpoint_dir} {FOREIGN_CHECKPOINT} (offset {shown} in "
            f"{path}, not {{channel: position}}): point black.checkpoint_dir at an empty "
            "directory, the black job's alone (a new checkpoint starts from the journal)"
        )
    return {str(k): v for k, v in offsets.items()}


def repair_spool(cfg: Config, channel: str) -> None:
    """The repair a tap's open makes (partial batch cut, lost positions recorded, TAIL
    rewritten from the segments), on ``channel``'s spool if no tap holds it. A disk too full
    to record lost positions is logged and left to the tap (it tries again at its open)."""
    root = Path(cfg.black.spool_dir)
    tail = read_tail(root / channel)
    try:
        w = SpoolWriter.repair(root, channel, **writer_settings(cfg.black.spool))
    except SpoolFull as e:
        log_event(log, 30, f"spool not repaired before recovery: {e}", channel=channel)
        return
    if w is not None and tail is not None and tail < w.durable_end - w.damaged:
        log_event(
            log, 30, "spool TAIL was behind its segments (a power loss): rewritten before "
            "recovery", channel=channel, tail_was=tail, durable_end=w.durable_end,
        )  # fmt: skip


def recover_committed(cfg: Config, sealer: BundleSealer, store: StateStore) -> list[ShippedBundle]:
    """Seal positions that Spark committed beyond black's journal; returns the bundles shipped.

    Each spool it reads is repaired first (``repair_spool``), as its tap would at start."""
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
        repair_spool(cfg, ch.name)
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
