"""Unit: `diode quarantine list / show` over quarantine folders laid out as bridge.red.evidence
lays them out (real files in a temp dir; the red job's own quarantine is covered in
tests/integration/test_red_pipeline.py)."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pytest

from bridge.config import Config, config_from_dict
from bridge.red.quarantine import (
    QuarantineError,
    list_quarantined,
    quarantine_summary,
    show_quarantined,
)


def _cfg(tmp: Path) -> Config:
    return config_from_dict(
        {"channels": [{"name": "c", "encrypt": False}], "red": {"quarantine_dir": "q"}},
        base=tmp,
        environ={},
    )


def _put(tmp: Path, day: str, name: str, reason: str | None, at: str = "") -> Path:
    d = tmp / "q" / day
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(b"evidence " + name.encode())
    if reason is not None:
        rec = {"reason": reason, "original_name": name, "at": at, "detail": {"why": "because"}}
        (d / f"{name}.reason.json").write_text(json.dumps(rec))
    return d / name


def test_list_orders_by_day_then_time_and_never_leaves_a_file_out(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _put(tmp_path, "2026-11-23", "b.dbundle", "crypto", at="2026-11-23T10:00:00+00:00")
    _put(tmp_path, "2026-11-23", "a.dbundle", "signature", at="2026-11-23T11:00:00+00:00")
    _put(tmp_path, "2026-11-24", "c.dbundle", None)  # crash before its reason file
    bad = _put(tmp_path, "2026-11-24", "d.dbundle", "x")
    (bad.parent / "d.dbundle.reason.json").write_text("[1, 2")  # damaged
    (tmp_path / "q" / "2026-11-24" / ".x.reason.json.tmp").write_text("{}")  # a temp: not listed
    (tmp_path / "q" / "not-a-day").mkdir()
    entries = list_quarantined(cfg)
    assert [(e["day"], e["stored_as"], e["reason"]) for e in entries] == [
        ("2026-11-23", "b.dbundle", "crypto"),
        ("2026-11-23", "a.dbundle", "signature"),
        ("2026-11-24", "c.dbundle", "no_reason_file"),
        ("2026-11-24", "d.dbundle", "unreadable_reason_file"),
    ]
    assert quarantine_summary(entries)["total"] == 4
    assert [e["stored_as"] for e in list_quarantined(cfg, reason="crypto")] == ["b.dbundle"]
    assert len(list_quarantined(cfg, since=date(2026, 11, 24))) == 2
    assert list_quarantined(_cfg(tmp_path / "empty")) == []


def test_show_finds_one_file_and_refuses_names_that_are_not_stored_names(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _put(tmp_path, "2026-11-23", "a.dbundle", "crypto")
    _put(tmp_path, "2026-11-24", "a.dbundle", "signature")
    with pytest.raises(QuarantineError, match="on 2 days"):
        show_quarantined(cfg, "a.dbundle", audit=False)
    shown = show_quarantined(cfg, "2026-11-24/a.dbundle", audit=False)
    assert shown["reason"] == "signature" and shown["record"]["detail"] == {"why": "because"}
    for name in ("..", ".", "", "2026-11-24/..", "../q/2026-11-24/a.dbundle",
                 "a.dbundle.reason.json", "x/y/a.dbundle"):  # fmt: skip
        with pytest.raises(QuarantineError):
            show_quarantined(cfg, name, audit=False)
    with pytest.raises(QuarantineError, match="not in the quarantine"):
        show_quarantined(cfg, "nope.dbundle", audit=False)


def test_a_reason_file_whose_file_was_re_injected_is_still_listed_and_shown(
    tmp_path: Path,
) -> None:
    """Runbook §12.2 keeps the reason file when the file goes back into the inbox: list and
    show still give that verdict, marked ``file_gone``, counted apart from files present."""
    cfg = _cfg(tmp_path)
    first = _put(tmp_path, "2026-11-22", "a.dbundle", "unpinned_signer", at="2026-11-22T08:00")
    first.unlink()  # mv back into the inbox
    _put(tmp_path, "2026-11-23", "a.dbundle", "conflict", at="2026-11-23T08:00")
    pending = _put(tmp_path, "2026-11-23", "d", "not_regular_file", at="2026-11-23T09:00")
    rec = json.loads(pending.with_name("d.reason.json").read_text())
    pending.with_name("d.reason.json").write_text(json.dumps({**rec, "pending_move": "1:2:3"}))
    pending.unlink()  # a crash before the rename, and no inbox entry has that mark (any more)
    entries = list_quarantined(cfg)
    assert [
        (e["day"], e["stored_as"], e["reason"], e.get("file_gone", False)) for e in entries
    ] == [  # fmt: skip
        ("2026-11-22", "a.dbundle", "unpinned_signer", True),
        ("2026-11-23", "a.dbundle", "conflict", False),
        ("2026-11-23", "d", "not_regular_file", True),
    ]
    assert entries[0]["why"].startswith("[file gone") and entries[0]["why"].endswith("because")
    assert entries[2]["pending_move"] is False, entries[2]
    assert entries[2]["why"].startswith("[file gone, move abandoned"), entries[2]
    assert quarantine_summary(entries) == {
        "total": 1, "by_reason": {"conflict": 1}, "file_gone": 2}  # fmt: skip
    shown = show_quarantined(cfg, "2026-11-22/a.dbundle", audit=False)
    assert shown["file_gone"] is True and shown["record"]["reason"] == "unpinned_signer"
    assert shown["sha256_now"] is None and shown["unchanged"] is None
    # without a day, the file present wins over a reason file kept from an earlier verdict
    assert show_quarantined(cfg, "a.dbundle", audit=False)["reason"] == "conflict"


def test_original_name_is_the_name_it_arrived_under(tmp_path: Path) -> None:
    """``stored_as`` is the name in the quarantine, ``original_name`` the one the file arrived
    under; an intake record written before that was kept (its ``original_name`` the safe
    name) is shown with the name its ``detail.raw_hex`` gives, printable."""
    from bridge.red.evidence import safe_name

    cfg = _cfg(tmp_path)
    for raw in (b"notes.txt", b"caf\xe9\x1b[2J.dbundle"):
        stored = safe_name(raw)
        p = _put(tmp_path, "2026-11-23", stored, None)
        detail = {"raw_name": ascii(raw), "raw_hex": raw.hex(), "why": "not ASCII"}
        rec = {"reason": "bad_name", "original_name": stored, "at": "", "detail": detail}
        (p.parent / f"{stored}.reason.json").write_text(json.dumps(rec))
    _put(tmp_path, "2026-11-23", "ok.dbundle", "crypto")  # no raw_hex: the record's name
    got = {e["stored_as"]: e["original_name"] for e in list_quarantined(cfg)}
    assert got == {
        safe_name(b"notes.txt"): "notes.txt",
        safe_name(b"caf\xe9\x1b[2J.dbundle"): "caf\\xe9\\x1b[2J.dbundle",
        "ok.dbundle": "ok.dbundle",
    }
    shown = show_quarantined(cfg, safe_name(b"notes.txt"), audit=False)
    assert shown["original_name"] == "notes.txt"
    assert shown["record"]["original_name"] == safe_name(b"notes.txt")  # the evidence as is
