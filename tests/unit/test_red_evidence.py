"""Red, evidence: safe names, processed/ and quarantine/ moves that never overwrite."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.protocol.naming import parse_bundle_name
from bridge.red.evidence import (
    PENDING_KEY,
    REASON_SUFFIX,
    SAFE_NAME_RE,
    Evidence,
    safe_name,
    sha256_regular,
    shown_name,
)

AT = datetime(2024, 5, 6, 23, 59, 59, tzinfo=UTC)
DAY = "2024-05-06"
BUNDLE = "default.000000000001." + "ab" * 16 + ".dbundle"


@pytest.fixture
def ev(tmp_path: Path) -> Evidence:
    e = Evidence(tmp_path / "processed", tmp_path / "quarantine")
    e.ensure_dirs()
    return e


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# -- safe_name --------------------------------------------------------------------------------
@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_safe_name_always_safe(raw: bytes) -> None:
    name = safe_name(raw)
    assert SAFE_NAME_RE.fullmatch(name), name
    assert len(name) <= 100 and not name.startswith(".")
    assert name.endswith("-" + hashlib.sha256(raw).hexdigest()[:16])
    with pytest.raises(Exception):  # noqa: B017 - a safe name is never a wire name
        parse_bundle_name(name)


@settings(max_examples=50, deadline=None)
@given(st.sets(st.binary(min_size=0, max_size=40), min_size=2, max_size=200))
def test_safe_name_injective(raws: set[bytes]) -> None:
    assert len({safe_name(r) for r in raws}) == len(raws)


def test_safe_name_examples() -> None:
    assert safe_name(b"../x.dbundle").startswith("_x.dbundle-")
    assert safe_name(b"a/b").startswith("a_b-")
    assert safe_name(b"\xff\xfe.dbundle").startswith("__.dbundle-")
    assert safe_name(b"").startswith("file-")
    assert safe_name(b"...") != safe_name(b"..")
    # names that differ only in unsafe bytes still differ
    assert safe_name(b"a/b") != safe_name(b"a\\b")


# -- processed --------------------------------------------------------------------------------
def test_processed_moves_by_day_and_never_overwrites(ev: Evidence, tmp_path: Path) -> None:
    first = ev.processed(_file(tmp_path / "in1", b"one"), BUNDLE, AT)
    second = ev.processed(_file(tmp_path / "in2", b"two"), BUNDLE, AT)
    third = ev.processed(_file(tmp_path / "in3", b"three"), BUNDLE, AT)
    day = tmp_path / "processed" / DAY
    assert (first, second, third) == (day / BUNDLE, day / f"{BUNDLE}.1", day / f"{BUNDLE}.2")
    assert [(day / n).read_bytes() for n in (BUNDLE, f"{BUNDLE}.1", f"{BUNDLE}.2")] == [
        b"one",
        b"two",
        b"three",
    ]
    assert not (tmp_path / "in1").exists() and not (tmp_path / "in2").exists()


def test_processed_uses_utc_day(ev: Evidence, tmp_path: Path) -> None:
    from datetime import timedelta, timezone

    local = datetime(2024, 5, 7, 1, 0, tzinfo=timezone(timedelta(hours=2)))  # 23:00 UTC on 6th
    dst = ev.processed(_file(tmp_path / "in", b"x"), BUNDLE, local)
    assert dst is not None and dst.parent.name == DAY


def test_processed_src_gone_returns_none(ev: Evidence, tmp_path: Path) -> None:
    assert ev.processed(tmp_path / "missing", BUNDLE, AT) is None


def test_processed_resumes_after_crash_between_link_and_unlink(
    ev: Evidence, tmp_path: Path
) -> None:
    src = _file(tmp_path / "in", b"data")
    day = tmp_path / "processed" / DAY
    day.mkdir()
    os.link(src, day / BUNDLE)  # what an interrupted call left behind
    dst = ev.processed(src, BUNDLE, AT)
    assert dst == day / BUNDLE
    assert sorted(p.name for p in day.iterdir()) == [BUNDLE]
    assert not src.exists()


@pytest.mark.parametrize("kind", ["processed", "quarantine"])
def test_a_retry_after_midnight_reuses_the_earlier_days_link(
    ev: Evidence, tmp_path: Path, kind: str
) -> None:
    """A crash between the link and the source's drop, retried after midnight UTC: the file
    stays where the first attempt put it (yesterday), not placed a second time today."""
    src = _file(tmp_path / "in", b"data")
    root = tmp_path / kind
    (root / DAY).mkdir(exist_ok=True)
    (root / DAY / BUNDLE).write_bytes(b"another file of that name")
    os.link(src, root / DAY / f"{BUNDLE}.1")  # what the interrupted call left behind
    later = AT + timedelta(seconds=2)  # the next UTC day
    if kind == "processed":
        dst = ev.processed(src, BUNDLE, later)
    else:
        dst = ev.quarantine(src, BUNDLE, "malformed", {}, later)
    assert dst == root / DAY / f"{BUNDLE}.1" and not src.exists()
    next_day = root / "2024-05-07"
    assert not next_day.exists() or list(next_day.iterdir()) == []
    if kind == "quarantine":
        reason = json.loads(dst.with_name(dst.name + REASON_SUFFIX).read_text())
        assert reason["stored_as"] == dst.name


def test_a_file_linked_elsewhere_is_placed_as_usual(ev: Evidence, tmp_path: Path) -> None:
    """A source with another link outside the evidence folders (a mover's own copy) is not
    mistaken for an interrupted move."""
    src = _file(tmp_path / "in", b"data")
    os.link(src, tmp_path / "movers-copy")
    dst = ev.processed(src, BUNDLE, AT)
    assert dst == tmp_path / "processed" / DAY / BUNDLE and not src.exists()
    assert (tmp_path / "movers-copy").read_bytes() == b"data"


def test_processed_unsafe_name_is_made_safe(ev: Evidence, tmp_path: Path) -> None:
    dst = ev.processed(_file(tmp_path / "in", b"x"), "../../etc/passwd", AT)
    assert dst is not None and dst.parent == tmp_path / "processed" / DAY
    assert SAFE_NAME_RE.fullmatch(dst.name)


# -- quarantine -------------------------------------------------------------------------------
def test_quarantine_writes_reason_file(ev: Evidence, tmp_path: Path) -> None:
    data = b"not a bundle" * 100
    dst = ev.quarantine(_file(tmp_path / "in", data), BUNDLE, "signature", {"why": "bad"}, AT)
    assert dst == tmp_path / "quarantine" / DAY / BUNDLE
    assert dst.read_bytes() == data
    reason = json.loads(dst.with_name(BUNDLE + REASON_SUFFIX).read_text())
    assert reason["reason"] == "signature"
    assert reason["detail"] == {"why": "bad"}
    assert reason["original_name"] == BUNDLE
    assert reason["stored_as"] == BUNDLE
    assert reason["size"] == len(data)
    assert reason["sha256"] == hashlib.sha256(data).hexdigest()
    assert reason["file_type"] == "regular"
    assert reason["at"].startswith("2024-05-06T23:59:59")


def test_quarantine_same_name_twice_keeps_both(ev: Evidence, tmp_path: Path) -> None:
    name = safe_name(b"../x.dbundle")
    a = ev.quarantine(_file(tmp_path / "a", b"A"), name, "bad_name", {}, AT)
    b = ev.quarantine(_file(tmp_path / "b", b"B"), name, "bad_name", {}, AT)
    assert a is not None and b is not None and a != b
    assert (a.read_bytes(), b.read_bytes()) == (b"A", b"B")
    for p, data in ((a, b"A"), (b, b"B")):
        reason = json.loads(p.with_name(p.name + REASON_SUFFIX).read_text())
        assert reason["sha256"] == hashlib.sha256(data).hexdigest()
        assert reason["stored_as"] == p.name


def test_quarantine_resumes_after_crash_before_reason(ev: Evidence, tmp_path: Path) -> None:
    src = _file(tmp_path / "in", b"data")
    day = tmp_path / "quarantine" / DAY
    day.mkdir()
    os.link(src, day / BUNDLE)  # linked, then crashed before the reason file
    dst = ev.quarantine(src, BUNDLE, "malformed", {}, AT)
    assert dst == day / BUNDLE
    assert sorted(p.name for p in day.iterdir()) == [BUNDLE, BUNDLE + REASON_SUFFIX]
    assert not src.exists()


def test_quarantine_symlink_moves_the_link_only(ev: Evidence, tmp_path: Path) -> None:
    secret = _file(tmp_path / "secret", b"top secret")
    link = tmp_path / "link"
    link.symlink_to(secret)
    dst = ev.quarantine(link, "link", "not_regular_file", {}, AT)
    assert dst is not None and dst.is_symlink() and os.readlink(dst) == str(secret)
    assert secret.read_bytes() == b"top secret" and not link.is_symlink()
    reason = json.loads(dst.with_name(dst.name + REASON_SUFFIX).read_text())
    assert reason["file_type"] == "symlink" and reason["sha256"] is None
    assert str(secret) in reason["link_target"]


def test_quarantine_directory_and_fifo(ev: Evidence, tmp_path: Path) -> None:
    d = tmp_path / "adir"
    d.mkdir()
    (d / "inner").write_bytes(b"x")
    fifo = tmp_path / "afifo"
    os.mkfifo(fifo)
    dd = ev.quarantine(d, "adir", "not_regular_file", {}, AT)
    dd2 = ev.quarantine(_mkdir(tmp_path / "adir2"), "adir", "not_regular_file", {}, AT)
    df = ev.quarantine(fifo, "afifo", "not_regular_file", {}, AT)
    assert dd is not None and (dd / "inner").read_bytes() == b"x"
    assert dd2 is not None and dd2.name == "adir.1" and dd2.is_dir()
    assert df is not None and df.exists() and not fifo.exists()
    kinds = [
        json.loads(p.with_name(p.name + REASON_SUFFIX).read_text())["file_type"] for p in (dd, df)
    ]
    assert kinds == ["directory", "fifo"]


class _Interrupted(Exception):
    """Stands for a crash right after the audit record, before the entry moves."""


def _interrupt(dst: Path) -> None:
    raise _Interrupted(str(dst))


@pytest.mark.parametrize("later", [AT, AT + timedelta(seconds=2)], ids=["same_day", "next_day"])
def test_a_renamed_entry_is_recorded_before_the_rename_and_resumed(
    ev: Evidence, tmp_path: Path, later: datetime
) -> None:
    """An entry that cannot be linked (a directory) gets its reason file and record first; a
    crash before the rename leaves the name reserved, and the next call (that day or the
    next) renames into it: one entry, one reason file, the record written for the same path."""
    d = _mkdir(tmp_path / "adir")
    (tmp_path / "quarantine" / DAY).mkdir()
    _mkdir(tmp_path / "quarantine" / DAY / "adir")  # another entry holds the plain name
    with pytest.raises(_Interrupted) as hit:
        ev.quarantine(d, "adir", "not_regular_file", {}, AT, placed=_interrupt)
    reserved = tmp_path / "quarantine" / DAY / "adir.1"
    assert str(hit.value) == str(reserved)  # the crash hit the window: record before rename
    assert d.is_dir() and not reserved.exists()
    assert reserved.with_name("adir.1" + REASON_SUFFIX).exists()

    seen: list[Path] = []
    dst = ev.quarantine(d, "adir", "not_regular_file", {}, later, placed=seen.append)
    assert dst == reserved and seen == [reserved] and reserved.is_dir() and not d.exists()
    entries = sorted(
        str(p.relative_to(tmp_path / "quarantine"))
        for p in (tmp_path / "quarantine").rglob("*")
        if p.parent.parent == tmp_path / "quarantine"
    )
    assert entries == [
        f"{DAY}/adir",
        f"{DAY}/adir.1",
        f"{DAY}/adir.1{REASON_SUFFIX}",
    ]
    reason = json.loads(reserved.with_name("adir.1" + REASON_SUFFIX).read_text())
    assert reason["stored_as"] == "adir.1" and reason["file_type"] == "directory"


@pytest.mark.parametrize("kind", ["directory", "regular"])
def test_a_name_reserved_by_another_entry_is_not_taken(
    ev: Evidence, tmp_path: Path, kind: str
) -> None:
    """A reason file without its entry (another entry's interrupted rename) keeps its name,
    whether the newcomer is renamed (a directory) or hard-linked (a file)."""
    day = tmp_path / "quarantine" / DAY
    day.mkdir()
    other = {"inode": "1:1", "reason": "not_regular_file"}
    (day / ("adir" + REASON_SUFFIX)).write_text(json.dumps(other))
    src = _mkdir(tmp_path / "adir") if kind == "directory" else _file(tmp_path / "adir", b"x")
    dst = ev.quarantine(src, "adir", "not_regular_file", {}, AT)
    assert dst == day / "adir.1"
    assert json.loads((day / ("adir" + REASON_SUFFIX)).read_text()) == other


def _mkdir(p: Path) -> Path:
    p.mkdir()
    return p


def test_sha256_regular_reads_only_regular_files_and_never_hides_a_read_error(
    short_tmp: Path,
) -> None:
    """A regular file is hashed; a symlink, fifo, socket, directory or missing name gives None
    (never read, never blocking); a regular file that cannot be read raises instead of passing
    for "not a file" (``quarantine show`` reports the error)."""
    f = short_tmp / "b.gpg"
    f.write_bytes(b"evidence")
    assert sha256_regular(f) == hashlib.sha256(b"evidence").hexdigest()
    (short_tmp / "link").symlink_to(f)
    os.mkfifo(short_tmp / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:  # opening a socket file answers ENXIO
        sock.bind(str(short_tmp / "sock"))
        for other in ("link", "fifo", "sock", "missing", "."):
            assert sha256_regular(short_tmp / other) is None, other
    with pytest.raises(OSError) as e:  # a regular file whose read fails (EIO)
        sha256_regular(Path("/proc/self/mem"))
    assert e.value.errno == errno.EIO


def _reason_of(dst: Path) -> dict[str, object]:
    rec = json.loads(dst.with_name(dst.name + REASON_SUFFIX).read_text())
    assert isinstance(rec, dict)
    return rec


@pytest.mark.parametrize("kind", ["regular", "directory"])
@pytest.mark.parametrize("days", [0, 7], ids=["same_day", "a_week_later"])
def test_a_re_injected_file_quarantined_again_gets_its_own_place_and_reason(
    ev: Evidence, tmp_path: Path, kind: str, days: int
) -> None:
    """Runbook §12.2: the operator moves a quarantined file back into the inbox (``mv``: same
    inode) and keeps its reason file. Refused again, it gets its own name under the day of
    the second verdict with its own reason file; the first reason file stays as it was."""
    inbox = _mkdir(tmp_path / "inbox")
    src = inbox / BUNDLE
    _mkdir(src) if kind == "directory" else _file(src, b"forged-or-unpinned")
    at1 = AT - timedelta(hours=2)
    first = ev.quarantine(src, BUNDLE, "unpinned_signer", {"why": "first"}, at1)
    assert first == tmp_path / "quarantine" / DAY / BUNDLE
    kept = first.with_name(BUNDLE + REASON_SUFFIX).read_bytes()
    assert PENDING_KEY not in _reason_of(first)  # the move completed: nothing reserved
    os.rename(first, src)  # re-injected, the reason file kept as evidence

    later = at1 + timedelta(days=days, hours=1)
    second = ev.quarantine(src, BUNDLE, "conflict", {"why": "second"}, later)
    day2 = tmp_path / "quarantine" / later.strftime("%Y-%m-%d")
    assert second == day2 / (BUNDLE if days else f"{BUNDLE}.1")
    assert os.path.lexists(second) and not os.path.lexists(src)
    assert first.with_name(BUNDLE + REASON_SUFFIX).read_bytes() == kept  # intact
    rec = _reason_of(second)
    assert (rec["reason"], rec["stored_as"], rec["at"]) == (
        "conflict", second.name, later.isoformat())  # fmt: skip
    assert PENDING_KEY not in rec


def test_a_reservation_is_not_honoured_once_its_entry_moved(ev: Evidence, tmp_path: Path) -> None:
    """A crash after the rename but before the reservation was cleared leaves ``pending_move``
    in the reason file. Once the entry has been moved since (re-injected), the mark no longer
    matches it (a rename changes the ctime): the file is placed anew, the old record kept."""
    inbox = _mkdir(tmp_path / "inbox")
    src = _mkdir(inbox / "adir")
    before = os.lstat(src)
    time.sleep(0.05)  # ctime ticks are coarse: the renames below must change it
    first = ev.quarantine(src, "adir", "not_regular_file", {}, AT)
    assert first is not None
    rf = first.with_name("adir" + REASON_SUFFIX)
    rec = {
        **_reason_of(first),
        PENDING_KEY: f"{before.st_dev}:{before.st_ino}:{before.st_ctime_ns}",
    }
    rf.write_text(json.dumps(rec))  # as if the crash came before the mark was cleared
    time.sleep(0.05)
    os.rename(first, src)  # re-injected
    second = ev.quarantine(src, "adir", "not_regular_file", {"why": "again"}, AT)
    assert second == first.with_name("adir.1") and second.is_dir()
    assert json.loads(rf.read_text()) == rec
    assert _reason_of(second)["detail"] == {"why": "again"}


def test_a_reason_file_is_never_replaced(ev: Evidence, tmp_path: Path) -> None:
    """A reason file whose entry is gone keeps its name, even for an entry with its inode."""
    day = _mkdir(tmp_path / "quarantine" / DAY)
    src = _file(tmp_path / "in", b"x")
    st = os.lstat(src)
    other = {"inode": f"{st.st_dev}:{st.st_ino}", "reason": "crypto", "stored_as": BUNDLE}
    (day / (BUNDLE + REASON_SUFFIX)).write_text(json.dumps(other))
    dst = ev.quarantine(src, BUNDLE, "malformed", {}, AT)
    assert dst == day / f"{BUNDLE}.1"
    assert json.loads((day / (BUNDLE + REASON_SUFFIX)).read_text()) == other


# -- shown_name: a name as it arrived, printable ----------------------------------------------
@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (b"notes.txt", "notes.txt"),
        (BUNDLE.encode(), BUNDLE),
        ("café x.dbundle".encode(), "café x.dbundle"),  # printable UTF-8 and a space: kept
        (b"caf\xe9", "caf\\xe9"),  # not UTF-8: the byte, escaped
        (b"a\x1b[31mred\x07\n\t\x7f", "a\\x1b[31mred\\x07\\x0a\\x09\\x7f"),  # controls
        ("\u202eevil\u200b".encode(), "\\u202eevil\\u200b"),  # bidi override, zero width
        ("x\u0085\u2028\U000e0001".encode(), "x\\u0085\\u2028\\U000e0001"),
        (b"<b>x<\\b>&amp;", "<b>x<\\\\b>&amp;"),  # a backslash doubled; markup is plain text
        (b"\xc2\x85", "\\u0085"),  # U+0085 (a C1 control) is not the byte 0x85 ...
        (b"\x85", "\\x85"),  # ... which is shown as \x85
    ],
)
def test_shown_name_escapes_what_is_not_printable(raw: bytes, shown: str) -> None:
    assert shown_name(raw) == shown


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=255))
def test_shown_name_is_printable_and_one_to_one(raw: bytes) -> None:
    shown = shown_name(raw)
    assert shown.isprintable(), shown
    back = json.loads(json.dumps({"n": shown}))["n"]
    assert back == shown
    # unambiguous: the escapes read back to the very bytes
    assert _unshow(shown) == raw


def _unshow(shown: str) -> bytes:
    """Inverse of shown_name (test only)."""
    out = bytearray()
    i = 0
    while i < len(shown):
        ch = shown[i]
        if ch != "\\":
            out += ch.encode()
            i += 1
            continue
        kind = shown[i + 1]
        if kind == "\\":
            out += b"\\"
            i += 2
        elif kind == "x":
            out.append(int(shown[i + 2 : i + 4], 16))
            i += 4
        else:
            n = 4 if kind == "u" else 8
            out += chr(int(shown[i + 2 : i + 2 + n], 16)).encode("utf-8", "surrogatepass")
            i += 2 + n
    return bytes(out)


def test_quarantine_records_the_name_it_arrived_under(ev: Evidence, tmp_path: Path) -> None:
    stored = safe_name(b"notes.txt")
    dst = ev.quarantine(
        _file(tmp_path / "in", b"x"), stored, "bad_name", {}, AT, original_name="notes.txt"
    )
    assert dst is not None and dst.name == stored
    reason = json.loads(dst.with_name(stored + REASON_SUFFIX).read_text())
    assert (reason["original_name"], reason["stored_as"]) == ("notes.txt", stored)
