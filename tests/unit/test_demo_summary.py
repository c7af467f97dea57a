"""Unit: the demo's account of what red holds (duplicates, quarantine) and its summary table."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from bridge.demo.summary import key_counts, quarantined_files, summary_table


def test_the_account_counts_rows_beyond_one_per_key_and_every_quarantined_file(
    tmp_path: Path,
) -> None:
    keys = pa.table({"channel": ["a", "a", "b", "a"], "seq": [1, 2, 1, 2]})
    assert key_counts(keys) == (4, 3)
    assert key_counts(keys.slice(0, 0)) == (0, 0)
    day = tmp_path / "q" / "2026-11-24"
    day.mkdir(parents=True)
    for name in ("x.dbundle", "y.dbundle"):
        (day / name).write_bytes(b"junk")
        (day / f"{name}.reason.json").write_text("{}")
    assert quarantined_files(tmp_path / "q") == 2
    assert quarantined_files(tmp_path / "none") == 0


def test_the_table_shows_each_stage_and_the_account() -> None:
    s = {
        "published": 18004, "publish_seconds": 1.27, "sealed": 18004, "black_seconds": 13.94,
        "transport": "file", "files_crossed": 7, "landed": 18004, "red_seconds": 3.79,
        "replayed": 18004, "replay_seconds": 1.65, "received_on_red": 18000, "bundles": 4,
        "lost": 4, "duplicates": 0, "quarantined": 1, "ok": False, "workdir": "/w",
        "tables": "/w/red/tables",
    }  # fmt: skip
    text = summary_table(s)
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "count", "seconds", "per", "s"]
    assert " ".join(lines[3].split()) == "sealed into bundles 18,004 13.94 1,292"
    assert " ".join(lines[4].split()) == "crossed the diode (file) 7 files"
    assert "bundles 4 · lost 4 · duplicates 0 · quarantined 1 · NOT OK" in text
