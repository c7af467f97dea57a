"""UDP receiver's spool (mutation review, wave 2): an object journaled delivered whose folder a
kill left in the spool is removed at the restart, never delivered a second time."""

from __future__ import annotations

import os
from pathlib import Path

from bridge.diode.udp_spool import deliver, delivery_tmp_dir, verify_and_read_name
from tests.unit.test_udp_reassembly import NAME, envelope, feed, header, reassembler, symbols

T = 64
K = 8


def test_a_delivered_object_left_in_the_spool_by_a_kill_is_not_delivered_again(
    tmp_path: Path,
) -> None:
    spool, inbox = tmp_path / "spool", tmp_path / "inbox"
    inbox.mkdir()
    body = os.urandom(T * K * 2)
    env = envelope(body)
    ra = reassembler(spool)
    feed(ra, symbols(3, header(21, env), env))
    (d,) = ra.ready
    checked = verify_and_read_name(d)
    assert not isinstance(checked, str)
    name, offset = checked
    final, outcome = deliver(d, name, offset, delivery_tmp_dir(spool, inbox), inbox)
    assert (final, outcome) == (NAME, "delivered")
    ra.journal_delivered(d, final)  # in done.jsonl; killed before its folder was removed
    assert d.path.is_dir()
    del ra
    (inbox / NAME).unlink()  # red took the file (processed) meanwhile
    ra2 = reassembler(spool)
    ra2.recover(1.0)
    assert not ra2.ready and not ra2.open  # nothing to deliver again
    assert ra2.wait_trash(10) and not d.path.exists()  # the leftover folder is removed
    feed(ra2, symbols(3, header(21, env), env)[:1])
    assert ra2.dropped == {"late": 1} and not ra2.ready
    assert list(inbox.iterdir()) == []
