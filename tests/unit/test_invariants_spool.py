"""Black, spool invariants (mutation review): release frees only shipped segments (the spool's
own check and the tap's, which releases what the journal says was shipped), and a batch is
fsynced before TAIL says it is durable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bridge.black import spool as spool_mod
from bridge.black.spool import SpoolReader, SpoolWriter
from bridge.black.spool_read import TAIL_FILE, read_tail
from bridge.black.state import StateStore
from bridge.black.tap import Tap
from bridge.config import config_from_dict

CH = "orders"


def _open(root: Path, **kw: Any) -> SpoolWriter:
    kw.setdefault("min_free_bytes", 0)
    return SpoolWriter.open(root, CH, **kw)


def _append(w: SpoolWriter, n: int) -> None:
    first = w.next_pos
    w.append(
        ["x"] * n,
        [f"rk.{first + i}" for i in range(n)],
        [False] * n,
        [b"\x80\x00"] * n,
        [f"body {first + i}".encode() for i in range(n)],
    )


def test_release_keeps_a_segment_that_still_holds_unshipped_records(tmp_path: Path) -> None:
    """Shipped through 5, acked through 11, segments [0,4) [4,8) [8,12): only [0,4) may go.
    [4,8) holds 6 and 7, which no bundle holds yet: freeing it would lose them."""
    with _open(tmp_path, segment_bytes=1) as w:
        for _ in range(3):
            _append(w, 4)
            w.sync(11)  # every ack proven: only the shipped position limits the release
        assert w.acked_through == 11
        assert w.release_through(5) > 0
        reader = SpoolReader(tmp_path, CH)
        assert reader.first_pos() == 4, "a segment with unshipped records was released"
        got = [r for b in reader.read(6, 8) for r in b.column("body").to_pylist()]
        assert got == [b"body 6", b"body 7"]
        # once 7 is shipped, [4,8) goes too
        assert w.release_through(7) > 0
        assert SpoolReader(tmp_path, CH).first_pos() == 8


def test_a_batch_is_fsynced_before_tail_says_it_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TAIL is trusted by readers (the black source) without an fsync of its own: the segment
    bytes it covers must have been fsynced before it moves. Recorded with a spy around the
    real os.fsync and TAIL write (both still run)."""
    events: list[tuple[str, int]] = []
    real_fsync = os.fsync
    seg_path = os.path.realpath(tmp_path / CH / spool_mod.segment_name(0))

    def spy_fsync(fd: int) -> None:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        events.append(("fsync_segment" if name == seg_path else "fsync_other", -1))
        real_fsync(fd)

    with _open(tmp_path) as w:
        real_tail = w._write_tail

        def spy_tail() -> None:
            real_tail()
            events.append(("tail", read_tail(tmp_path / CH) or -1))

        monkeypatch.setattr(spool_mod.os, "fsync", spy_fsync)
        monkeypatch.setattr(w, "_write_tail", spy_tail)
        _append(w, 3)
        assert w.sync(-1) == 3
    tails = [i for i, (k, _) in enumerate(events) if k == "tail"]
    assert tails and events[tails[0]][1] == 3, events
    before = [k for k, _ in events[: tails[0]]]
    assert "fsync_segment" in before, f"TAIL moved to 3 before the segment was fsynced: {events}"
    assert (tmp_path / CH / TAIL_FILE).exists()


def test_the_tap_releases_only_through_the_journals_last_shipped_seq(tmp_path: Path) -> None:
    """The journal says seqs through 2 are in a bundle; the first segment is [0,4): position 3
    is in no bundle yet, so the segment stays (released once 3 is shipped)."""
    cfg = config_from_dict(
        {
            "black": {"state_dir": str(tmp_path / "state"), "spool_dir": str(tmp_path / "spool")},
            "channels": [{"name": CH, "encrypt": False}],
        },
        base=tmp_path,
        environ={},
    )
    tap = Tap(cfg, CH)
    store = StateStore(tmp_path / "state")
    with SpoolWriter.open(tmp_path / "spool", CH, min_free_bytes=0, segment_bytes=1) as w:
        for _ in range(3):
            _append(w, 4)
            w.sync(11)
        st = store.load(CH)
        st.last_seq = 2
        store.save(st)
        tap._release(w)
        assert SpoolReader(tmp_path / "spool", CH).first_pos() == 0, "unshipped seq 3 released"
        st.last_seq = 3
        store.save(st)
        tap._release(w)
        assert SpoolReader(tmp_path / "spool", CH).first_pos() == 4
