"""`diode resend` on a real outbox and archive (mutation review, wave 2): a range outside the
bundle seqs 1..MAX_SEQ (or empty) is refused, naming it, and re-drops nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.diode.file_drop import Outbox
from bridge.errors import TransportError
from bridge.protocol.naming import MAX_SEQ, bundle_name

CHANNEL = "ops"


@pytest.mark.parametrize(("first", "last"), [(0, 3), (0, 0), (1, MAX_SEQ + 1), (3, 2)])
def test_a_range_outside_the_bundle_seqs_is_refused_and_re_drops_nothing(
    tmp_path: Path, first: int, last: int
) -> None:
    ob = Outbox(tmp_path / "outbox", tmp_path / "archive", retention_days=1)
    adir = tmp_path / "archive" / CHANNEL
    adir.mkdir(parents=True)
    name = bundle_name(CHANNEL, 1, f"{1:032x}")
    (adir / name).write_bytes(b"sealed 1")
    with pytest.raises(TransportError, match=rf"resend range {first}\.\.{last} of channel"):
        ob.resend(CHANNEL, first, last)
    assert not (ob.dir_for(CHANNEL) / name).exists()
    assert ob.resend(CHANNEL, 1, 2).missing == [(2, 2)]  # the same outbox works in range
