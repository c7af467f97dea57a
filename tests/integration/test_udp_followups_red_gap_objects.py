"""Integration: red audits the UDP receiver's gap records one row a record, and counts the
objects they stand for: an ``unseen`` range record and a summary record (the records the disk
refused beyond the 1000 held whole) each name how many (``objects``). The records are the real
receiver's (its Reassembler, a real gaps.jsonl), landed through the real Landing and Delta."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bridge.config import Config
from bridge.diode.link_status import gap_objects, read_gap_records
from bridge.diode.udp_spool import Reassembler
from bridge.protocol.datagram import ObjectHeader, ObjectKind, Symbol
from bridge.red.job import open_landing
from bridge.red.landing import LandingResult
from tests.integration.test_red_transport_gaps import _config

EPOCH_UNSEEN, EPOCH_REFUSED = 1795416026359094799, 1795416026359094800
REFUSED = 1007
"""Objects refused as too large while the disk refuses their records: 1000 held whole, 7
counted in one summary record."""


def _symbol(epoch: int, oid: int, length: int) -> Symbol:
    h = ObjectHeader(oid, ObjectKind.BUNDLE, "u1", oid + 1, length, os.urandom(32), 256, 16)
    return Symbol(epoch, oid, h, 0, 0, bytes(256))


def _receiver_records(spool: Path) -> None:
    """The receiver's own records in ``spool/gaps.jsonl``: one ``unseen`` range of 5 ids (1-5:
    ids 0 and 6 arrived, they never did), then ``REFUSED`` too-large objects whose records the
    disk refused at first (gaps.jsonl a folder), written once it takes them: 1000 whole and a
    summary record counting the 7 beyond."""
    ra = Reassembler(spool, max_object_bytes=4096, max_open_objects=8)
    ra.add(_symbol(EPOCH_UNSEEN, 0, 4096), time.monotonic())
    ra.add(_symbol(EPOCH_UNSEEN, 6, 4096), time.monotonic())
    assert ra.report_unseen(time.time() + 60, 1.0) == 5
    gaps, aside = spool / "gaps.jsonl", spool / "gaps.jsonl.aside"
    gaps.rename(aside)
    gaps.mkdir()  # the journal cannot be written: the records are held, then summarized
    for oid in range(REFUSED):
        ra.add(_symbol(EPOCH_REFUSED, oid, 8192), time.monotonic())
    assert ra.pending_gaps()
    gaps.rmdir()
    aside.rename(gaps)
    assert ra.write_gaps() == 0
    ra.wait_trash(10)


def _transport_rows(cfg: Config) -> list[dict[str, Any]]:
    dt = DeltaTable(str(Path(cfg.red.tables_dir) / "audit"))
    rows = dt.to_pyarrow_table().to_pylist()
    return [r for r in rows if r["event"] == "transport_gap"]


def test_range_and_summary_records_count_their_objects_one_audit_row_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _config(tmp_path)
    spool = Path(cfg.udp.receive.spool_dir)  # type: ignore[union-attr]
    landing = open_landing(cfg)
    landing.tick()  # the first tick starts watching the channel
    _receiver_records(spool)
    records = read_gap_records(spool)
    summaries = [r for r in records if r.get("summary")]
    assert [r["reason"] for r in records[:2]] == ["unseen", "too_large"]
    assert len(records) == 1 + 1000 + 1 and len(summaries) == 1
    assert summaries[0]["objects"] == REFUSED - 1000
    assert gap_objects(records) == 5 + REFUSED  # what `diode status` counts

    with caplog.at_level(logging.WARNING, logger="bridge.red.landing"):
        res = landing.tick()
    assert res.events == {"transport_gap": 1002}  # audit events: one row a record
    assert res.transport_gap_objects == 5 + REFUSED  # objects lost: 5 unseen, 1007 refused
    (line,) = [r for r in caplog.records if "transport gaps audited" in r.getMessage()]
    assert line.__dict__["records"] == 1002 and line.__dict__["objects"] == 5 + REFUSED
    assert line.__dict__["objects_by_reason"] == {"too_large": REFUSED, "unseen": 5}

    rows = _transport_rows(cfg)
    assert len(rows) == 1002
    details = [json.loads(r["detail"]) for r in rows]
    (unseen,) = [d for d in details if d["reason"] == "unseen"]
    assert (unseen["object_id"], unseen["object_id_last"], unseen["objects"]) == (1, 5, 5)
    (summary,) = [d for d in details if d.get("summary")]
    assert summary["objects"] == 7 and summary["reason"] == "too_large"

    total = LandingResult()  # a run's totals add the objects up as the events
    total.add(res)
    total.add(res)
    assert total.transport_gap_objects == 2 * (5 + REFUSED)
    assert total.events == {"transport_gap": 2004}

    nothing = landing.tick()  # nothing new: no row, no object
    assert nothing.events == {} and nothing.transport_gap_objects == 0
