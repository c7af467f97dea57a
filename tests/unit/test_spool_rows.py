"""Black, drain: spool records whose property bytes do not decode become flagged rows."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from bridge.black.spool import SpoolWriter
from bridge.black.spool_rows import read_rows, source_schema
from bridge.errors import ProtocolError
from bridge.protocol.properties import (
    NO_PROPERTIES,
    Properties,
    decode_properties,
    encode_properties,
)

# the headers flag, then a table of 5 bytes: key "a", an unknown field type "Z", truncated
BAD = b"\x20\x00" + b"\x00\x00\x00\x05" + b"\x01a" + b"Z"
GOOD = encode_properties(Properties(message_id="m-1", delivery_mode=2))


def rows(spool: Path, n: int) -> list[dict[str, object]]:
    return [r for b in read_rows(spool, "c", 0, n, {}) for r in b.to_pylist()]


def test_undecodable_rows_are_flagged_and_travel_exact(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError):
        decode_properties(BAD)
    with SpoolWriter.open(tmp_path, "c", min_free_bytes=0) as w:
        w.append_one("ex", "rk", False, GOOD, b"a")
        w.append_one("ex", "rk", False, BAD, b"b")
        w.append_lost("ex", "rk", "maxlen", dead_letter=b"\xff" * 16)  # not a message
        w.append_one("ex", "rk", False, NO_PROPERTIES, b"d")
        w.sync(-1)
    got = rows(tmp_path, 4)
    assert [r["undecodable"] for r in got] == [False, True, False, False]
    assert got[1]["properties_raw"] == BAD and got[1]["headers_typed"] is None
    assert got[0]["message_id"] == "m-1"
    assert source_schema().field("undecodable").type == pa.bool_()


def test_a_batch_without_undecodable_rows_flags_none(tmp_path: Path) -> None:
    with SpoolWriter.open(tmp_path, "c", min_free_bytes=0) as w:
        w.append_one("ex", "rk", False, GOOD, b"a")
        w.append_one("ex", "rk", True, NO_PROPERTIES, b"b")
        w.sync(-1)
    batches = list(read_rows(tmp_path, "c", 0, 2, {}))
    assert [b.column("undecodable").null_count for b in batches] == [2]
