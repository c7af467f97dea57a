"""Red, landing: ``messages.inexact`` per row on real gpg and real Delta tables, no Spark: the
reason of the manifest's ``inexact`` range holding the row's seq (null: exact) for every reason,
at and across bundle edges, with overlap skips; exactly once through duplicates and re-applied
landings; a ``messages`` table an earlier build created gets the column at start, keeps its rows
(null there) and stays readable by replay, compaction and filters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from deltalake import DeltaTable

from bridge.config import Config
from bridge.protocol.manifest import Gap
from bridge.red import schema as rs
from bridge.red.job import open_landing
from bridge.red.landing import LandingError
from bridge.red.replay_state import START
from bridge.red.replay_table import PUBLISHED, MessagesTable
from bridge.red.tables import RedTables
from tests.red_factory import (
    BundleMade,
    RedKeys,
    land_bundles,
    make_bundle,
    make_rows,
    red_config,
    temp_red_keys,
)

pytestmark = [pytest.mark.gpg]

Q, N, P = "quorum-reencoded", "non-utf8-name", "possible-duplicate"


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    with temp_red_keys("inx") as k:
        yield k


def _chain(made: Path, keys: RedKeys) -> list[BundleMade]:
    """Four bundles of channel "orders" whose manifests mark rows inexact: every reason, ranges
    at a bundle's first and last row, a range black split across two bundles (8..11), a
    whole bundle in another exchange, and a bundle overlapping landed seqs (22..24 skipped)."""
    spec: list[tuple[range, str, list[Gap]]] = [
        (range(0, 10), "orders", [Gap(0, 0, Q), Gap(3, 4, N), Gap(8, 9, P)]),
        (range(10, 20), "orders", [Gap(10, 11, P), Gap(15, 15, Q)]),
        (range(20, 25), "billing", [Gap(20, 24, N)]),
        (range(22, 30), "billing", [Gap(23, 26, Q)]),
    ]
    out: list[BundleMade] = []
    for i, (seqs, exchange, inexact) in enumerate(spec, start=1):
        rows = make_rows("orders", seqs, exchange)
        prev = out[-1].sha256 if out else None
        out.append(make_bundle(made, keys, "orders", i, rows, prev, inexact=inexact))
    return out


EXPECTED: dict[int, str | None] = {
    **dict.fromkeys(range(30)),
    0: Q, 3: N, 4: N, 8: P, 9: P, 10: P, 11: P, 15: Q,
    **dict.fromkeys(range(20, 25), N),  # 22..24: bundle 3's rows; bundle 4's were skipped
    25: Q, 26: Q,
}  # fmt: skip


def _messages(cfg: Config, columns: list[str] | None = None) -> list[dict[str, Any]]:
    path = Path(cfg.red.tables_dir) / "messages"
    return sorted(
        DeltaTable(str(path)).to_pyarrow_table(columns=columns).to_pylist(),
        key=lambda r: r["seq"],
    )


def _inexact(cfg: Config) -> dict[int, str | None]:
    got = _messages(cfg, ["seq", "inexact", "bundle_seq"])
    assert len(got) == len({r["seq"] for r in got}), "a seq landed twice"
    return {r["seq"]: r["inexact"] for r in got}


def test_each_row_carries_the_reason_of_its_inexact_range(keys: RedKeys, tmp_path: Path) -> None:
    cfg = red_config(tmp_path, keys)
    b = _chain(tmp_path / "made", keys)
    assert sum(r.bundles_landed for r in land_bundles(cfg, b[:2])) == 2
    assert sum(r.bundles_landed for r in land_bundles(cfg, b[2:])) == 2
    assert _inexact(cfg) == EXPECTED
    rows = _messages(cfg, ["seq", "bundle_seq"])
    assert {r["seq"]: r["bundle_seq"] for r in rows if 22 <= r["seq"] <= 26} == {
        22: 3, 23: 3, 24: 3, 25: 4, 26: 4
    }  # fmt: skip
    ledger = DeltaTable(str(Path(cfg.red.tables_dir) / "bundles")).to_pyarrow_table().to_pylist()
    kept = {r["bundle_seq"]: r["inexact"] for r in ledger if r["status"] == "landed"}
    assert json.loads(kept[1]) == [g.to_dict() for g in b[0].manifest.inexact]  # still there

    # a re-run (every file again): duplicates, nothing lands twice
    again = land_bundles(cfg, b)
    assert sum(r.duplicates for r in again) == 4 and sum(r.messages_landed for r in again) == 0
    assert _inexact(cfg) == EXPECTED

    # a consumer wanting byte-exact rows only: a filter on the column (file statistics too)
    exact = RedTables(Path(cfg.red.tables_dir), "delta-rs").read(
        "messages", columns=["seq"], filter=pads.field("inexact").is_null()
    )
    assert sorted(exact.column("seq").to_pylist()) == [s for s, v in EXPECTED.items() if v is None]


@pytest.mark.parametrize("fails", ["messages", "audit"])
def test_a_landing_reapplied_after_a_failure_lands_each_row_once_with_its_reason(
    keys: RedKeys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """The apply fails before the messages commit, or after it (the audit append): the restart
    re-applies the journaled intent, whose rows take their reasons from the held plaintext."""
    cfg = red_config(tmp_path, keys)
    b = _chain(tmp_path / "made", keys)
    real = RedTables.append

    def failing(self: RedTables, name: str, data: Any, **kw: Any) -> bool:
        if name == fails:
            raise OSError(5, f"I/O error (injected in the {name} append)")
        return real(self, name, data, **kw)

    monkeypatch.setattr(RedTables, "append", failing)
    with pytest.raises(LandingError, match="injected"):
        land_bundles(cfg, b)
    held = _messages(cfg, ["seq"]) if fails == "audit" else []
    assert len(held) == (30 if fails == "audit" else 0)  # seqs 0..29 (22..24 once)
    monkeypatch.setattr(RedTables, "append", real)
    open_landing(cfg)  # the restart finishes the landing from the journal
    assert _inexact(cfg) == EXPECTED
    assert {r["land_seq"] for r in _messages(cfg, ["seq", "land_seq"])} == {1}


def _earlier_build(mp: pytest.MonkeyPatch) -> None:
    """``messages`` as a build before the ``inexact`` column created and wrote it."""
    old = pa.schema([f for f in rs.messages_schema() if f.name != "inexact"])
    mp.setattr(rs, "messages_schema", lambda: old)
    mp.setitem(rs._SCHEMAS, "messages", lambda: old)


def test_a_messages_table_without_the_column_gets_it_and_keeps_its_rows(
    keys: RedKeys, tmp_path: Path
) -> None:
    cfg = red_config(tmp_path, keys)
    b = _chain(tmp_path / "made", keys)
    path = Path(cfg.red.tables_dir) / "messages"
    with pytest.MonkeyPatch.context() as mp:
        _earlier_build(mp)
        land_bundles(cfg, b[:2])
    dt = DeltaTable(str(path))
    assert "inexact" not in [f.name for f in dt.schema().fields]
    before = dt.version()

    land_bundles(cfg, b[2:])  # this build: start adds the column, then lands
    dt = DeltaTable(str(path))
    assert [f.name for f in dt.schema().fields] == rs.messages_schema().names
    ops = [h["operation"] for h in dt.history()]  # newest first: added before the landing
    assert ops == ["WRITE", "ADD COLUMN", "WRITE", "CREATE TABLE"], ops
    proto = dt.protocol()
    assert (proto.min_reader_version, proto.min_writer_version) == (1, 2), proto
    assert not proto.reader_features and not proto.writer_features
    assert dt.transaction_version("diode-red") == 2
    want = {s: (v if s >= 20 else None) for s, v in EXPECTED.items()}  # earlier rows: null
    assert _inexact(cfg) == want

    tables = RedTables(Path(cfg.red.tables_dir), "delta-rs")
    tables.ensure()  # the column is there now: no commit
    assert DeltaTable(str(path)).version() == before + 2
    flagged = tables.read("messages", columns=["seq"], filter=pads.field("inexact") == N)
    assert sorted(flagged.column("seq").to_pylist()) == list(range(20, 25))

    # replay reads old and new files alike, and publishes the wire bytes as they came
    mt = MessagesTable(path)
    stats = mt.stats()
    assert stats is not None
    sent = {r["seq"]: r for r in pa.concat_tables(x.rows for x in b).to_pylist()}
    for exchange in ("orders", "billing"):
        got, _ = mt.read(exchange, START, stats[exchange], 0, 1000, None)
        assert got is not None and "inexact" not in got.column_names
        for r in got.to_pylist():
            assert {k: r[k] for k in PUBLISHED if k in sent[r["seq"]]} == {
                k: sent[r["seq"]][k] for k in PUBLISHED if k in sent[r["seq"]]
            }

    tables.maintain("messages")  # compaction rewrites old and new files into one schema
    assert _inexact(cfg) == want
