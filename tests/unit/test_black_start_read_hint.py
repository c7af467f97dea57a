"""Black, read hint: ``read-hint.json`` keeps the hint of a channel a run did not read (it sizes
that channel's first batch of its next run), drops channels no longer configured, and a damaged
file is no hint at all, never an error (the source then sizes a few real messages). Real files."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from bridge.black.source import READ_HINT_FILE, read_hint, save_read_hint
from bridge.fsutil import FILE_MODE


def test_a_channel_not_measured_now_keeps_its_hint(tmp_path: Path) -> None:
    save_read_hint(tmp_path, {"a": 100.0, "b": 5000.0}, ["a", "b"])
    save_read_hint(tmp_path, {"a": 120.0}, ["a", "b"])  # a run that read "a" only
    assert read_hint(tmp_path) == {"a": 120.0, "b": 5000.0}
    f = tmp_path / READ_HINT_FILE
    assert stat.S_IMODE(f.stat().st_mode) == FILE_MODE
    assert [p.name for p in tmp_path.iterdir()] == [READ_HINT_FILE], "no temp file left"


def test_a_channel_no_longer_configured_loses_its_hint(tmp_path: Path) -> None:
    save_read_hint(tmp_path, {"a": 100.0, "gone": 9.0}, ["a", "gone"])
    save_read_hint(tmp_path, {"a": 110.0}, ["a"])
    assert json.loads((tmp_path / READ_HINT_FILE).read_text()) == {"avg_row_bytes": {"a": 110.0}}


@pytest.mark.parametrize(
    "damaged", ["{not json", '{"avg_row_bytes": {"b": null}}', '{"avg_row_bytes": [1]}', "[]"]
)
def test_a_damaged_hint_is_no_hint_and_is_replaced(tmp_path: Path, damaged: str) -> None:
    (tmp_path / READ_HINT_FILE).write_text(damaged)
    assert read_hint(tmp_path) == {}
    save_read_hint(tmp_path, {"a": 100.0}, ["a", "b"])
    assert read_hint(tmp_path) == {"a": 100.0}
