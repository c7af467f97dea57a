"""Integration: red operator commands as an operator runs them — `diode approve` / `diode
revoke` (the CLI in a subprocess, the real approvals file and the real audit Delta table; no
broker), `diode red maintain` (compaction of real small files; with the Spark engine, a real
Spark without the Delta jars) and `diode red publish`, the replay publisher's other name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bridge.config import load_config
from bridge.red.job import open_tables

REPO = Path(__file__).resolve().parents[2]
CONFIG = """[[channels]]
name = "orders"
encrypt = false

[red]
state_dir = "red/state"
tables_dir = "red/delta"
delta_engine = "delta-rs"
"""


def diode(cfg: Path, *args: str) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "--log-level", "WARNING", *args, "--config",
         str(cfg)],
        capture_output=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def test_revoke_is_approve_revoke_and_both_are_audited(tmp_path: Path) -> None:
    cfg = tmp_path / "diode.toml"
    cfg.write_text(CONFIG)
    open_tables(load_config(cfg)).ensure()  # what the first red run does
    first = diode(cfg, "approve", "orders", "sensors", "--note", "first light")
    assert first["approved"] == ["orders", "sensors"] and first["action"] == "approve"
    gone = diode(cfg, "revoke", "sensors", "--note", "not needed on red")
    assert gone["action"] == "revoke" and gone["approved"] == ["orders"]
    assert [c["exchange"] for c in gone["changed"]] == ["sensors"]
    again = diode(cfg, "revoke", "sensors")
    assert again["changed"] == [] and again["unchanged"] == ["sensors"]
    audit = DeltaTable(str(tmp_path / "red" / "delta" / "audit")).to_pyarrow_table(
        columns=["event", "exchange"]
    )
    events = sorted(zip(audit["event"].to_pylist(), audit["exchange"].to_pylist(), strict=True))
    assert events == [("approved", "orders"), ("approved", "sensors"), ("revoked", "sensors")]


def test_red_maintain_compacts_the_small_files_of_each_table(tmp_path: Path) -> None:
    cfg = tmp_path / "diode.toml"
    cfg.write_text(CONFIG)
    open_tables(load_config(cfg)).ensure()
    for name in ("a", "b", "c", "d"):  # each approval is its own audit commit: a small file each
        diode(cfg, "approve", name)
    audit = tmp_path / "red" / "delta" / "audit"
    before = DeltaTable(str(audit))
    rows = sorted(before.to_pyarrow_table(columns=["event_id"])["event_id"].to_pylist())
    assert len(before.file_uris()) >= 4

    out = diode(cfg, "red", "maintain")
    assert set(out) == {"messages", "bundles", "audit"}
    stats = out["audit"]
    assert stats["engine"] == "delta-rs" and stats["files_before"] == len(before.file_uris())
    assert stats["files_after"] < stats["files_before"] and stats["version"] > before.version()
    after = DeltaTable(str(audit))
    assert sorted(after.to_pyarrow_table(columns=["event_id"])["event_id"].to_pylist()) == rows
    assert len(after.file_uris()) == stats["files_after"]


@pytest.mark.spark
def test_red_maintain_with_the_spark_engine_needs_delta_on_spark(tmp_path: Path) -> None:
    """Engine "spark" starts a real Spark session for the SQL commands; here it has no Delta
    jars, so the command fails fast saying how to fix it (not "no Spark session")."""
    cfg = tmp_path / "diode.toml"
    cfg.write_text(CONFIG.replace('delta_engine = "delta-rs"', 'delta_engine = "spark"'))
    r = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "--log-level", "WARNING", "red", "maintain",
         "--table", "audit", "--config", str(cfg)],
        capture_output=True, timeout=300, check=False, cwd=REPO,
    )  # fmt: skip
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, err[-2000:]
    assert "Delta Lake is not set up on Spark (missing: class io.delta.tables.DeltaTable" in err
    assert "--conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension" in err
    assert 'red.delta_engine = "delta-rs"' in err


def test_red_publish_is_the_replay_publisher() -> None:
    from bridge.cli import red

    assert red.get_command(None, "publish") is red.get_command(None, "replay")  # type: ignore[arg-type]
    r = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "red", "publish", "--help"],
        capture_output=True, timeout=60, check=False, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0 and b"--until-caught-up" in r.stdout


@pytest.mark.parametrize("hours", ["nan", "24"])
def test_red_maintain_refuses_a_short_retention_before_touching_a_table(
    tmp_path: Path, hours: str
) -> None:
    cfg = tmp_path / "diode.toml"
    cfg.write_text(CONFIG)
    open_tables(load_config(cfg)).ensure()
    diode(cfg, "approve", "a")
    audit = tmp_path / "red" / "delta" / "audit"
    before = DeltaTable(str(audit)).version()
    r = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "--log-level", "WARNING", "red", "maintain",
         "--vacuum-hours", hours, "--config", str(cfg)],
        capture_output=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, err[-2000:]
    assert "at least 168" in err and "Traceback" not in err, err[-2000:]
    assert DeltaTable(str(audit)).version() == before
