"""Red, landing invariants (mutation review), no Spark: real gpg and real Delta tables. A bundle
whose message seqs overlap seqs already landed lands only its new seqs: ``messages`` holds
each ``(channel, seq)`` once."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from tests.red_factory import (
    RedKeys,
    kill_agents,
    land_bundles,
    make_bundle,
    make_rows,
    red_config,
)

pytestmark = [pytest.mark.gpg]


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    root = Path(os.path.realpath("/tmp")) / f"inv{os.getpid()}"
    root.mkdir(exist_ok=True)
    try:
        yield RedKeys.create(root)
    finally:
        kill_agents(root)
        shutil.rmtree(root, ignore_errors=True)


def _table(cfg: Any, name: str) -> list[dict[str, Any]]:
    return DeltaTable(str(Path(cfg.red.tables_dir) / name)).to_pyarrow_table().to_pylist()


def test_a_bundle_overlapping_landed_seqs_lands_each_seq_once(
    keys: RedKeys, tmp_path: Path
) -> None:
    cfg = red_config(tmp_path, keys, {"orders": True})
    made = tmp_path / "made"
    made.mkdir()
    b1 = make_bundle(made, keys, "orders", 1, make_rows("orders", range(0, 10)), None)
    # black re-sealed with other boundaries (a crash, a reset journal): seqs 5..9 come again
    b2 = make_bundle(made, keys, "orders", 2, make_rows("orders", range(5, 15)), b1.sha256)
    done = land_bundles(cfg, (b1, b2))
    assert sum(r.bundles_landed for r in done) == 2, done
    msgs = _table(cfg, "messages")
    keys_ = sorted((m["channel"], m["seq"]) for m in msgs)
    assert keys_ == [("orders", s) for s in range(15)], keys_
    # the repeated seqs are b1's rows, audited as skipped (never silent)
    assert {m["seq"]: m["bundle_seq"] for m in msgs if 5 <= m["seq"] <= 9} == dict.fromkeys(
        range(5, 10), 1
    )
    skipped = [a for a in _table(cfg, "audit") if a["event"] == "overlap_skipped"]
    assert [(a["seq_first"], a["seq_last"]) for a in skipped] == [(5, 9)], skipped
