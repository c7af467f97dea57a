"""Unit: the demo's count of duplicate keys and its summary table."""

from __future__ import annotations

import pyarrow as pa

from bridge.demo.summary import key_counts, summary_table


def test_duplicates_are_rows_beyond_one_per_key() -> None:
    keys = pa.table({"channel": ["a", "a", "b", "a"], "seq": [1, 2, 1, 2]})
    assert key_counts(keys) == (4, 3)
    assert key_counts(keys.slice(0, 0)) == (0, 0)


def test_the_table_shows_each_stage_and_the_account() -> None:
    s = {
        "published": 18004, "publish_seconds": 1.27, "sealed": 18004, "black_seconds": 13.94,
        "transport": "file", "files_crossed": 7, "landed": 18004, "red_seconds": 3.79,
        "replayed": 18004, "replay_seconds": 1.65, "received_on_red": 18000, "bundles": 4,
        "lost": 4, "duplicates": 0, "quarantined": 1, "ok": False, "workdir": "/w",
        "tables": "/w/red/delta",
    }  # fmt: skip
    text = summary_table(s)
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "count", "seconds", "per", "s"]
    assert " ".join(lines[3].split()) == "sealed into bundles 18,004 13.94 1,292"
    assert " ".join(lines[4].split()) == "crossed the diode (file) 7 files"
    assert "bundles 4 · lost 4 · duplicates 0 · quarantined 1 · NOT OK" in text
