"""Red, landing: the "landed" log lines count refusals as the run summary does (bridge.red.job
RedSummary): ``rejected`` is every file refused, the intake's included, and
``quarantined_at_intake`` the intake's part; summed over a run's lines they give the summary's.

No Spark: the real intake, real gpg verification and real Delta tables, driven as the red job
drives them (a batch of verdicts, then the tick that audits the intake's quarantines)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.red.job import RedSummary, open_landing
from bridge.red.landing import LandingResult
from bridge.red.source import make_intake
from bridge.red.verify import VerifyContext, verify_file
from tests.red_factory import RedKeys, red_config, temp_red_keys

pytestmark = [pytest.mark.gpg]

HEX = "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    with temp_red_keys("rsl") as k:
        yield k


def test_landed_lines_add_up_to_the_run_summary(
    keys: RedKeys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One bundle-named file verification refuses, one bad name the intake refuses: the
    summary says 2 rejected (1 at the intake). The old lines said ``rejected=1`` (the
    verification's) and nothing at all for the intake's, whose landing had no verified file."""
    cfg = red_config(tmp_path, keys, red={"settle_seconds": 0})
    landing = open_landing(cfg)
    intake = make_intake(cfg)  # makes the inbox
    inbox = Path(cfg.red.inbox)
    (inbox / f"orders.000000000001.{HEX}.dbundle").write_bytes(b"not OpenPGP" * 10)
    (inbox / "notes.txt").write_bytes(b"an operator's notes")
    scan = intake.scan(0.0)
    assert (len(scan.taken), len(scan.quarantined)) == (1, 1), scan
    ctx = VerifyContext.from_config(cfg, environ={})
    rows = [{"ordinal": t.ordinal, **verify_file(t.path, t.name, ctx).to_row()} for t in scan.taken]
    total = LandingResult()
    with caplog.at_level(logging.INFO, logger="bridge.red.landing"):
        landing.submit(rows)
        for res in landing.drain(close=True):
            total.add(res)
        total.add(landing.tick())
    summary = RedSummary(totals=total).to_json()
    assert (summary["rejected"], summary["quarantined_at_intake"]) == (2, 1), summary
    lines = [r for r in caplog.records if r.getMessage() == "landed"]
    fields = ("files", "rejected", "quarantined_at_intake")  # log_event's extra fields
    got = [tuple(getattr(r, k, None) for k in fields) for r in lines]
    assert got == [(1, 1, 0), (0, 1, 1)], got
    assert sum(r.__dict__["rejected"] for r in lines) == summary["rejected"]
