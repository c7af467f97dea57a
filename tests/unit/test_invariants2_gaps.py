"""`diode gaps` on black, and the replay hold-back (mutation review, wave 2): the ranges the gap
log holds are shown with their exact message counts, a line written before kinds existed is a
loss; a hole an operator wrote off entirely holds nothing, one written off in part still holds."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge import views
from bridge.black.gaplog import append_gaps, read_gaps
from bridge.protocol.manifest import Gap
from bridge.red import sequence as sq
from bridge.red.holdback import GapView, Hole

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)


def _rows(view: Any) -> dict[str, list[str]]:
    """The ``seq ranges`` table's rows by their seqs cell."""
    c = views.make_console(record=True, width=220)
    views.print_views([view], console=c)
    out: dict[str, list[str]] = {}
    for line in c.export_text().splitlines():
        cells = [x.strip() for x in line.replace("┃", "│").split("│")[1:-1]]
        if len(cells) == 6 and cells[0] == "ops":
            out[cells[1]] = cells
    return out


def test_black_gaps_counts_each_range_s_messages_exactly(tmp_path: Path) -> None:
    append_gaps(tmp_path, "ops", 4, (Gap(10, 12, "maxlen"), Gap(30, 30, "maxlen")))
    append_gaps(tmp_path, "ops", 5, (Gap(100, 199, "ttl"),), kind="inexact")
    ranges = read_gaps(tmp_path, "ops")
    assert [(r["first_seq"], r["last_seq"]) for r in ranges] == [(10, 12), (30, 30), (100, 199)]
    gaps = {"ops": {"lost": {"maxlen": 4}, "inexact": {"ttl": 100}, "ranges": ranges}}
    rows = _rows(views.black_gaps_view(gaps))
    assert rows["10-12"][2] == "3"
    assert rows["30"][2] == "1"
    assert rows["100-199"][2:5] == ["100", "inexact", "ttl"]


def _facts(n: int, first: int, last: int) -> sq.BundleFacts:
    return sq.BundleFacts("c1", n, f"id{n}", f"{n:064x}", None, last - first + 1, first, last)


def _state() -> sq.SequenceState:
    """Bundles 1 and 4 landed: 2..3 missing, the rows of 4 (seqs 30..39) above the hole."""
    s = sq.SequenceState()
    for n, a, b in ((1, 0, 9), (4, 30, 39)):
        sq.admit(s, _facts(n, a, b), T0)
    return s


def test_a_hole_written_off_entirely_holds_nothing_one_written_off_in_part_still_holds() -> None:
    s = _state()
    assert GapView.from_state(2, s).holes == {"c1": (Hole(2, 3, 30),)}
    part = _state()
    sq.write_off(part, "c1", 2, 2, "INC-7 bundle 2 pruned on black", T0)
    assert GapView.from_state(2, part).holes == {"c1": (Hole(2, 3, 30),)}  # 3 may still come
    whole = _state()
    sq.write_off(whole, "c1", 2, 3, "INC-7 black pruned both", T0)
    view = GapView.from_state(2, whole)
    assert view.holes == {}
    assert view.blocking("c1", 35, -1) is None


def test_a_gap_line_written_before_kinds_existed_is_a_loss(tmp_path: Path) -> None:
    line = '{"bundle_seq": 3, "first_seq": 40, "last_seq": 41, "reason": "maxlen"}\n'
    (tmp_path / "gaps-ops.jsonl").write_text(line)
    append_gaps(tmp_path, "ops", 4, (Gap(40, 41, "ttl"),), kind="inexact")
    ranges = read_gaps(tmp_path, "ops")
    assert [(r["kind"], r["bundle_seq"], r["reason"]) for r in ranges] == [
        ("lost", 3, "maxlen"), ("inexact", 4, "ttl")]  # fmt: skip
