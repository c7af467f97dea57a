"""Red, job summary: a red run counts every file it refused, the intake's refusals included,
as `bridge_red_files_rejected_total` and `diode red status` do (bridge.red.job RedSummary)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from bridge.config import load_config
from bridge.metrics import REGISTRY
from bridge.red.job import RedRun, RedSummary
from bridge.red.landing import LandingResult
from bridge.red.report import red_status
from tests.red_factory import RedKeys, kill_agents, write_red_toml

HEX = "0123456789abcdef" * 2


def _rejected_total() -> dict[str, float]:
    """``bridge_red_files_rejected_total`` per reason, in this process's registry."""
    out: dict[str, float] = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == "bridge_red_files_rejected_total":
                out[s.labels["reason"]] = s.value
    return out


def test_summary_counts_the_intakes_refusals_as_rejected() -> None:
    """Pure accounting: a landing's verdict refusals plus the intake's ``quarantined``."""
    t = LandingResult(files=3, rejected=1, conflicts=1,
                      events={"rejected": 1, "quarantined": 2, "conflict": 1})  # fmt: skip
    doc = RedSummary(totals=t).to_json()
    assert (doc["rejected"], doc["quarantined_at_intake"], doc["conflicts"]) == (3, 2, 1)
    assert doc["events"]["quarantined"] == 2 and doc["events"]["rejected"] == 1
    clean = RedSummary(totals=LandingResult(files=2)).to_json()
    assert (clean["rejected"], clean["quarantined_at_intake"]) == (0, 0)


@pytest.mark.gpg
@pytest.mark.spark
@pytest.mark.slow
def test_a_run_reports_every_file_it_quarantined(spark: Any, tmp_path: Path) -> None:
    """One file refused by verification (garbage under a bundle name), one bad name and one
    symlink refused by the intake: the summary says 3 rejected (2 at the intake), as the
    Prometheus counter's increase and the quarantine in `diode red status` do."""
    root = Path(os.path.realpath("/tmp")) / f"rrs{os.getpid()}"
    root.mkdir(exist_ok=True)
    try:
        keys = RedKeys.create(root)
        cfg = load_config(write_red_toml(tmp_path, keys, {"orders": True}))
        inbox = Path(cfg.red.inbox)
        inbox.mkdir(parents=True, exist_ok=True)
        (tmp_path / "junk").write_bytes(b"not an OpenPGP message" * 10)
        os.replace(tmp_path / "junk", inbox / f"orders.000000000001.{HEX}.dbundle")
        (tmp_path / "notes").write_bytes(b"an operator's notes")
        os.replace(tmp_path / "notes", inbox / "notes.txt")
        (inbox / f"orders.000000000002.{HEX}.dbundle").symlink_to("/etc/passwd")
        before = _rejected_total()
        s = RedRun(cfg).run(spark, "available-now").to_json()
    finally:
        kill_agents(root)
        shutil.rmtree(root, ignore_errors=True)
    assert s["events"].get("rejected") == 1 and s["events"].get("quarantined") == 2, s
    assert s["rejected"] == 3 and s["quarantined_at_intake"] == 2, s
    after = _rejected_total()
    grew = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert sum(grew.values()) == s["rejected"], grew
    assert grew["bad_name"] == 1 and grew["not_regular_file"] == 1, grew
    quarantine = red_status(cfg)["quarantine"]
    assert quarantine["total"] == s["rejected"] + s["conflicts"] == 3, quarantine
    assert quarantine["by_reason"] == {k: int(v) for k, v in sorted(grew.items())}, quarantine
    assert list(inbox.iterdir()) == []
