"""Red, replay: the landed ``messages`` table read per exchange, in landing order."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from bridge.red.replay_plan import FileStat, plan_upper
from bridge.red.replay_state import Key

__all__ = ["COLUMNS", "PUBLISHED", "MessagesTable", "lag_rows"]

COLUMNS = [
    "land_seq", "channel", "seq", "exchange_type", "exchange_durable", "exchange_auto_delete",
    "exchange_internal", "exchange_arguments", "routing_key", "properties_raw", "body",
    "landed_at",
]  # fmt: skip
PUBLISHED = COLUMNS[:-1]
"""What a replayed message is made of (``landed_at`` only serves the hold-back)."""
_ORDER = [("land_seq", "ascending"), ("channel", "ascending"), ("seq", "ascending")]
_f = pads.field


def _sorted(table: pa.Table) -> pa.Table:
    order = pc.sort_indices(table.select(["land_seq", "channel", "seq"]), sort_keys=_ORDER)
    if order.equals(pa.array(range(len(order)), order.type)):
        return table
    return table.take(order)


class MessagesTable:
    """The red job's ``messages`` Delta table, opened once and refreshed incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._dt: Any = None

    def reset(self) -> None:
        """Forget the open table (after a read failed): it is opened afresh next time."""
        self._dt = None

    def _table(self) -> Any:
        from deltalake import DeltaTable

        if self._dt is None:
            if not DeltaTable.is_deltatable(str(self.path)):
                return None
            self._dt = DeltaTable(str(self.path))
        else:
            self._dt.update_incremental()
        return self._dt

    def _dataset(self) -> pads.Dataset:
        return self._table().to_pyarrow_dataset()

    def stats(self) -> dict[str, list[FileStat]] | None:
        """Per exchange, ``(min land_seq, max land_seq, rows)`` of each data file (-1 when the
        log has no statistics); None when the table does not exist yet."""
        dt = self._table()
        if dt is None:
            return None
        actions = pa.table(dt.get_add_actions(flatten=True))
        names = set(actions.column_names)
        n = actions.num_rows
        if "partition.exchange" not in names:  # not partitioned by exchange: read the column
            return self._stats_by_reading()
        part = actions.column("partition.exchange").to_pylist()
        rows = actions.column("num_records").to_pylist() if "num_records" in names else [0] * n
        mins = actions.column("min.land_seq").to_pylist() if "min.land_seq" in names else [None] * n
        maxs = actions.column("max.land_seq").to_pylist() if "max.land_seq" in names else [None] * n
        out: dict[str, list[FileStat]] = {}
        for x, r, mn, mx in zip(part, rows, mins, maxs, strict=True):
            if x is None:
                continue
            if mn is None or mx is None or r is None:
                out.setdefault(x, []).append((-1, -1, int(r or 0)))
            else:
                out.setdefault(x, []).append((int(mn), int(mx), int(r)))
        return out

    def _stats_by_reading(self) -> dict[str, list[FileStat]]:
        t = self._dataset().to_table(columns=["exchange", "land_seq"])
        g = t.group_by(["exchange", "land_seq"]).aggregate([("land_seq", "count")])
        out: dict[str, list[FileStat]] = {}
        for x, ls, c in zip(
            g["exchange"].to_pylist(), g["land_seq"].to_pylist(), g["land_seq_count"].to_pylist(),
            strict=True,
        ):  # fmt: skip
            out.setdefault(x, []).append((ls, ls, c))
        return out

    def read(
        self,
        exchange: str,
        cursor: Key,
        files: list[FileStat],
        lo: int,
        batch_rows: int,
        judged: int | None,
    ) -> tuple[pa.Table | None, int | None]:
        """The next batch of ``exchange``: its rows after ``cursor`` from landing ``lo`` on,
        about ``batch_rows`` of them, never past landing ``judged`` (later landings are not
        in the landing's state yet: their holes unknown); sorted, with its last landing."""
        ds = self._dataset()
        base = _f("exchange") == exchange
        if not files or any(f[0] < 0 for f in files):  # no statistics: count land_seq values
            files = self._counts(ds, base, lo)
        hi = plan_upper(files, lo, batch_rows)
        if judged is not None and hi is not None and hi > judged:
            hi = judged
        if hi is None or hi < lo:
            return None, None
        land, channel, seq = cursor
        after = (_f("land_seq") > land) | (
            (_f("land_seq") == land)
            & ((_f("channel") > channel) | ((_f("channel") == channel) & (_f("seq") > seq)))
        )
        flt = base & (_f("land_seq") >= lo) & (_f("land_seq") <= hi) & after
        return _sorted(ds.to_table(columns=COLUMNS, filter=flt)), hi

    def fillers(
        self, exchange: str, below: dict[str, int], after: int, judged: int
    ) -> pa.Table | None:
        """Rows of ``exchange`` landed after landing ``after`` up to ``judged`` whose seq is
        below ``below[channel]``: late bundles that fill a gap; sorted, None if there are none."""
        cond = None
        for ch, mx in below.items():
            c = (_f("channel") == ch) & (_f("seq") < mx)
            cond = c if cond is None else cond | c
        if cond is None:
            return None
        flt = (_f("exchange") == exchange) & (_f("land_seq") > after) & (
            _f("land_seq") <= judged) & cond  # fmt: skip
        ds = self._dataset()
        if not ds.to_table(columns=["seq"], filter=flt).num_rows:
            return None
        return _sorted(ds.to_table(columns=COLUMNS, filter=flt))

    @staticmethod
    def _counts(ds: pads.Dataset, base: pads.Expression, lo: int) -> list[FileStat]:
        col = ds.to_table(columns=["land_seq"], filter=base & (_f("land_seq") >= lo))["land_seq"]
        vc = pc.value_counts(col)
        values = vc.field("values").to_pylist()
        counts = vc.field("counts").to_pylist()
        return [(v, v, c) for v, c in zip(values, counts, strict=True)]


def lag_rows(stats: dict[str, list[FileStat]] | None, exchange: str, after: int) -> int | None:
    """Rows of ``exchange`` in landings after ``after``, estimated from the file statistics
    (a file that straddles it counted in proportion); None when the table does not exist."""
    if stats is None:
        return None
    total = 0.0
    for mn, mx, n in stats.get(exchange, []):
        if mn < 0:
            total += n  # no statistics: counted whole
        elif mx > after:
            total += n if mn > after else n * (mx - after) / (mx - mn + 1)
    return math.ceil(total)
