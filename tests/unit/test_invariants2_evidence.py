"""Red, evidence (mutation review, wave 2): a quarantine reason file is never written over —
not by a retry of an interrupted quarantine, not when another entry's reason file appears
between the free-name check and the link or the rename (another red process, an operator)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

import bridge.red.evidence as evidence
from bridge.red.evidence import REASON_SUFFIX, Evidence

AT = datetime(2024, 5, 6, 12, 0, 0, tzinfo=UTC)
DAY = "2024-05-06"
BUNDLE = "default.000000000001." + "ab" * 16 + ".dbundle"
OTHER = {"reason": "crypto", "stored_as": BUNDLE, "original_name": "someone-else"}


@pytest.fixture
def ev(tmp_path: Path) -> Evidence:
    e = Evidence(tmp_path / "processed", tmp_path / "quarantine")
    e.ensure_dirs()
    return e


def test_a_retried_quarantine_keeps_the_first_reason_file(ev: Evidence, tmp_path: Path) -> None:
    """Killed after the link and its reason file, before the source was unlinked: the retry
    (with another verdict) finishes the move and leaves the first record as it was."""
    src = tmp_path / "in"
    src.write_bytes(b"data")
    day = tmp_path / "quarantine" / DAY
    day.mkdir()
    os.link(src, day / BUNDLE)
    first = {"reason": "signature", "stored_as": BUNDLE, "detail": {"why": "first verdict"}}
    (day / (BUNDLE + REASON_SUFFIX)).write_text(json.dumps(first))
    dst = ev.quarantine(src, BUNDLE, "malformed", {"why": "second verdict"}, AT)
    assert dst == day / BUNDLE and not src.exists()
    assert json.loads((day / (BUNDLE + REASON_SUFFIX)).read_text()) == first


def _race(monkeypatch: pytest.MonkeyPatch, day: Path) -> list[Path]:
    """Another entry's reason file for ``BUNDLE`` is created just before this quarantine
    creates its own (the window between its free-name check and its link or rename)."""
    real = evidence._create_new
    raced: list[Path] = []

    def create_new(path: Path, data: bytes) -> bool:
        if path.name == BUNDLE + REASON_SUFFIX and not raced:
            path.write_text(json.dumps(OTHER))
            raced.append(path)
        return real(path, data)

    monkeypatch.setattr(evidence, "_create_new", create_new)
    return raced


def test_a_reason_file_that_appears_before_the_link_is_kept_and_the_name_left(
    ev: Evidence, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    day = tmp_path / "quarantine" / DAY
    day.mkdir()
    raced = _race(monkeypatch, day)
    src = tmp_path / "in"
    src.write_bytes(b"data")
    dst = ev.quarantine(src, BUNDLE, "malformed", {"why": "mine"}, AT)
    assert raced, "the race was not injected"
    assert dst == day / f"{BUNDLE}.1"
    assert not os.path.lexists(day / BUNDLE)  # the link made meanwhile was undone
    assert json.loads((day / (BUNDLE + REASON_SUFFIX)).read_text()) == OTHER
    mine = json.loads((day / f"{BUNDLE}.1{REASON_SUFFIX}").read_text())
    assert mine["reason"] == "malformed" and mine["stored_as"] == f"{BUNDLE}.1"


def test_a_reason_file_that_appears_before_a_rename_is_kept_and_the_name_left(
    ev: Evidence, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    day = tmp_path / "quarantine" / DAY
    day.mkdir()
    raced = _race(monkeypatch, day)
    src = tmp_path / "adir"  # a folder is renamed, never linked
    src.mkdir()
    dst = ev.quarantine(src, BUNDLE, "not_regular_file", {}, AT)
    assert raced, "the race was not injected"
    assert dst == day / f"{BUNDLE}.1" and dst.is_dir()
    assert not os.path.lexists(day / BUNDLE)
    assert json.loads((day / (BUNDLE + REASON_SUFFIX)).read_text()) == OTHER
    mine = json.loads((day / f"{BUNDLE}.1{REASON_SUFFIX}").read_text())
    assert mine["reason"] == "not_regular_file"
