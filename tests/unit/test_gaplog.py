"""Unit: black's gap log (``gaps-<channel>.jsonl``) — a torn last line left by a power loss
never swallows the record appended after it, and an append that fails part way leaves
nothing behind. Real files; the failing append runs in a real process whose file size limit
(RLIMIT_FSIZE) makes the kernel write only part of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bridge.black.gaplog import append_gaps, gap_log_path, read_gaps
from bridge.protocol.manifest import Gap

REPO = Path(__file__).resolve().parents[2]
CH = "c1"


def ranges(state: Path) -> list[tuple[str, int, int, int, str]]:
    return [
        (g["kind"], g["bundle_seq"], g["first_seq"], g["last_seq"], g["reason"])
        for g in read_gaps(state, CH)
    ]


def test_a_torn_last_line_does_not_swallow_the_record_appended_after_it(tmp_path: Path) -> None:
    append_gaps(tmp_path, CH, 4, (Gap(10, 12, "maxlen"),))
    log = gap_log_path(tmp_path, CH)
    whole = log.read_bytes()
    # a power loss while bundle 5's line was appended: a prefix of it reached the disk
    append_gaps(tmp_path, CH, 5, (Gap(20, 29, "expired"),))
    torn = log.read_bytes()[len(whole) : len(whole) + 30]
    log.write_bytes(whole + torn)
    assert b"\n" not in torn, "the last line must be torn"
    assert ranges(tmp_path) == [("lost", 4, 10, 12, "maxlen")]
    # the restart finishes bundle 5 and its commit appends the same record again
    append_gaps(tmp_path, CH, 5, (Gap(20, 29, "expired"),))
    append_gaps(tmp_path, CH, 6, (Gap(31, 31, "possible-duplicate"),), kind="inexact")
    assert ranges(tmp_path) == [
        ("lost", 4, 10, 12, "maxlen"),
        ("lost", 5, 20, 29, "expired"),
        ("inexact", 6, 31, 31, "possible-duplicate"),
    ]
    lines = log.read_bytes().split(b"\n")
    assert lines[:2] == [whole.rstrip(b"\n"), torn]  # the fragment stays on a line of its own
    assert len(lines) == 5 and lines[-1] == b""  # bundle 4, torn, 5 again, 6, the last newline


PARTIAL = r"""
import errno, os, resource, signal, sys
from pathlib import Path
from bridge.black.gaplog import append_gaps, gap_log_path
from bridge.protocol.manifest import Gap

state = Path(sys.argv[1])
size = gap_log_path(state, "c1").stat().st_size
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal past the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 25, size + 25))
gaps = tuple(Gap(100 + 10 * i, 105 + 10 * i, "maxlen") for i in range(5))
try:
    append_gaps(state, "c1", 7, gaps)
except OSError as e:
    print("failed", errno.errorcode[e.errno], flush=True)
else:
    print("appended", flush=True)
"""


def test_an_append_that_fails_part_way_leaves_nothing(tmp_path: Path) -> None:
    append_gaps(tmp_path, CH, 4, (Gap(10, 12, "maxlen"),))
    log = gap_log_path(tmp_path, CH)
    before = log.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", PARTIAL, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    # the kernel took 25 bytes of the append, then refused the rest (past the size limit)
    assert r.stdout.split() == ["failed", "EFBIG"]
    assert log.read_bytes() == before, "no part of the failed append may stay"
    append_gaps(tmp_path, CH, 7, (Gap(100, 105, "maxlen"),))  # the retry after the restart
    assert ranges(tmp_path) == [("lost", 4, 10, 12, "maxlen"), ("lost", 7, 100, 105, "maxlen")]
    assert log.read_bytes().count(b"\n") == 2


def test_lines_that_are_json_but_not_gap_records_are_skipped_and_counted(tmp_path: Path) -> None:
    """Valid JSON that is not a record (null, an array) or has seqs that are not integers
    crashed ``diode gaps``, or was coerced ("5" read as 5). Each is skipped like a torn line,
    counted, and named in a warning; the good records around them are all kept."""
    from tests.support import captured_logs

    append_gaps(tmp_path, CH, 4, (Gap(10, 12, "maxlen"),))
    log = gap_log_path(tmp_path, CH)
    good = {"kind": "lost", "bundle_seq": 5, "first_seq": 20, "last_seq": 29, "reason": "x"}
    bad = [
        b"null",
        b"[1, 2]",
        b'"a string"',
        b'{"kind": "lost", "bundle_seq": "5", "first_seq": 20, "last_seq": 29}',
        b'{"kind": "lost", "bundle_seq": 5, "first_seq": 20.5, "last_seq": 29}',
        b'{"kind": "lost", "bundle_seq": 5, "first_seq": true, "last_seq": 29}',
        b'{"kind": "lost", "bundle_seq": 5, "first_seq": 20}',
        b'{"kind": 1, "bundle_seq": 5, "first_seq": 20, "last_seq": 29}',
        b'{"kind": "lost", "bundle_seq": 5, "first_seq": 30, "last_seq": 29}',
        b'{"kind": "lo',  # torn
    ]
    with log.open("ab") as f:
        f.write(b"\n".join(bad) + b"\n")
    append_gaps(tmp_path, CH, 6, (Gap(31, 31, "possible-duplicate"),), kind="inexact")
    with log.open("ab") as f:
        f.write(json.dumps(good).encode() + b"\n")
    with captured_logs("bridge.black.gaplog") as logs:
        assert ranges(tmp_path) == [
            ("lost", 4, 10, 12, "maxlen"),
            ("lost", 5, 20, 29, "x"),
            ("inexact", 6, 31, 31, "possible-duplicate"),
        ]
    from bridge.black.gaplog import read_gap_log  # here: the old reader crashed above

    skipped = read_gap_log(tmp_path, CH).skipped
    assert sorted(skipped) == list(range(2, 12))  # line 1 is bundle 4's, 12 and 13 good
    assert skipped[2] == "not a JSON object (a JSON null)"
    assert skipped[3] == "not a JSON object (a JSON array)"
    assert skipped[4] == "not a JSON object (a JSON string)"
    assert skipped[5] == "bundle_seq not an integer >= 0"  # "5": never coerced
    assert skipped[6] == skipped[7] == "first_seq not an integer >= 0"  # 20.5, true
    assert skipped[8] == "last_seq not an integer >= 0"  # missing
    assert skipped[9] == "kind is not a string"
    assert skipped[10] == "first_seq above last_seq"
    assert skipped[11].startswith("not JSON")
    warned = [r.getMessage() for r in logs if r.levelname == "WARNING"]
    assert len(warned) == 1 and str(log) in warned[0] and "10 line(s)" in warned[0]
    assert "line 2: not a JSON object (a JSON null)" in warned[0]
