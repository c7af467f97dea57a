"""Integration: red maintenance beside a running red job, on real delta-rs tables and a real
state lock: the ledger is never compacted under a running job, bad retention touches nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltalake import DeltaTable

from bridge.config import Config, load_config
from bridge.errors import ConfigError
from bridge.fsutil import durable_mkdir, exclusive_lock
from bridge.red import schema as rs
from bridge.red.job import open_tables
from bridge.red.layout import LOCK_FILE
from bridge.red.maintain import maintain_tables
from bridge.red.tables import RedTables
from tests.integration.test_cli_red_ops import CONFIG
from tests.integration.test_red_tables import ledger


def setup(tmp_path: Path) -> tuple[Config, RedTables]:
    p = tmp_path / "diode.toml"
    p.write_text(CONFIG)
    cfg = load_config(p)
    tables = open_tables(cfg)
    tables.ensure()
    for v in range(1, 5):  # a file per landing, as red writes them
        tables.append("bundles", rs.bundles_rows([ledger(v)]), app_id="diode-red", version=v)
    return cfg, tables


def versions(tables: RedTables) -> dict[str, int]:
    return {n: DeltaTable(str(tables.path(n))).version() for n in ("messages", "bundles", "audit")}


@pytest.mark.parametrize("hours", [float("nan"), float("inf"), 167.01, 24.0, -1.0])
def test_a_retention_below_168_h_or_not_finite_touches_no_table(
    tmp_path: Path, hours: float
) -> None:
    cfg, tables = setup(tmp_path)
    before = versions(tables)
    with pytest.raises(ConfigError, match=r"--vacuum-hours .*at least 168.*no table was touched"):
        maintain_tables(cfg, tables, ["messages", "bundles", "audit"], hours)
    assert versions(tables) == before  # the reviewer's run had compacted messages first


def test_the_ledger_is_not_compacted_while_a_red_job_holds_the_state_lock(
    tmp_path: Path,
) -> None:
    """A chain-status update swaps ledger files in an unchecked commit: a compaction between
    it would leave two landed rows for one bundle. So while the job runs: skipped, said so."""
    cfg, tables = setup(tmp_path)
    state = durable_mkdir(Path(cfg.red.state_dir))
    before = versions(tables)
    with exclusive_lock(state / LOCK_FILE, what="red run (the test's)"):
        out = maintain_tables(cfg, tables, ["bundles", "audit"], None)
    assert "a red job holds" in out["bundles"]["skipped"]
    assert versions(tables)["bundles"] == before["bundles"]
    assert "skipped" not in out["audit"] and "files_after" in out["audit"]  # appended-only: on
    out = maintain_tables(cfg, tables, ["bundles"], None)  # the job stopped: compacted
    assert out["bundles"]["files_before"] == 4 and out["bundles"]["files_after"] == 1
    landed = tables.read("bundles").column("bundle_seq").to_pylist()
    assert sorted(landed) == [1, 2, 3, 4]
