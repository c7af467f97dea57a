"""The UDP receiver's gap reasons, as the documents list them (protocol §12.3 rule 5, red-tables
``transport_gap``, runbook §20.4), against what the receiver writes: each reason driven through
the real reassembler into ``gaps.jsonl``, and the receiver's source read for any reason those
paths would miss."""

from __future__ import annotations

import ast
import hashlib
import os
import re
import time
from pathlib import Path

import pytest

from bridge.diode import udp_receiver, udp_spool
from bridge.diode.link_status import read_gap_records
from bridge.diode.udp_fec import block_count, block_plan, encode_block
from bridge.diode.udp_sender import envelope_prefix
from bridge.diode.udp_spool import Reassembler, verify_and_read_name
from bridge.protocol.datagram import ObjectHeader, ObjectKind, Symbol
from tests.support import REPO

T, K = 64, 8
DOCS = REPO / "docs"


# ---------------------------------------------------------------------- what the docs say
def _ticked(text: str) -> set[str]:
    """The backticked words of ``text``, parenthesised remarks left out."""
    return set(re.findall(r"`([^`]+)`", re.sub(r"\([^()]*\)", "", text)))


def _between(text: str, start: str, end: str, where: str) -> str:
    i = text.find(start)
    j = text.find(end, i + len(start))
    assert i >= 0 and j >= 0, f"{where}: no text between {start!r} and {end!r}: reworded?"
    return text[i + len(start) : j]


def protocol_reasons() -> set[str]:
    """Docs, protocol §12.3 rule 5: the reasons its list names."""
    text = (DOCS / "protocol.md").read_text()
    rule = _between(text, "### 12.3 Receiver rules", "\n6. ", "protocol.md §12.3")
    m = re.search(r"`reason` is (?:exactly )?one of:?(.*?)While the", rule, re.S)
    assert m, "protocol.md §12.3 rule 5: no '`reason` is one of … While the …': reworded?"
    return _ticked(m.group(1))


def red_tables_reasons() -> set[str]:
    """Docs, red-tables §3.1: the reasons the ``transport_gap`` row names."""
    row = next(
        (ln for ln in (DOCS / "red-tables.md").read_text().splitlines()
         if ln.startswith("| `transport_gap` |")),
        None,
    )  # fmt: skip
    assert row is not None, "red-tables.md: no `transport_gap` row in the events table"
    listed = _between(row, "`reason` = the receiver's", "runbook §20.4", "red-tables transport_gap")
    return set(re.findall(r"`([^`]+)`", listed))


def runbook_reasons() -> set[str]:
    """Docs, runbook §20.4: the first column of its reason table."""
    text = (DOCS / "runbook.md").read_text()
    section = _between(text, "### 20.4 Gaps", "\n### ", "runbook.md §20.4")
    rows = re.findall(r"^\| `([a-z_]+)` \|", section, re.M)
    assert rows, "runbook.md §20.4: no reason table"
    return set(rows)


# ---------------------------------------------------------------------- what the receiver writes
def _header(oid: int, env: bytes, digest: bytes | None = None) -> ObjectHeader:
    digest = digest or hashlib.sha256(env).digest()
    return ObjectHeader(oid, ObjectKind.BUNDLE, "u1", oid + 1, len(env), digest, T, K)


def _symbols(epoch: int, h: ObjectHeader, env: bytes) -> list[Symbol]:
    out: list[Symbol] = []
    for b in range(block_count(h.length, h.symbol_size, h.block_symbols)):
        p = block_plan(h.length, h.symbol_size, h.block_symbols, b)
        for esi, payload in encode_block(env[p.offset : p.offset + p.length], T, 1, 0):
            out.append(Symbol(epoch, len(out), h, b, esi, payload))
    return out


def _env(name: str = "u1.000000000001.0123456789abcdef0123456789abcdef.dbundle") -> bytes:
    return envelope_prefix(name) + os.urandom(2 * T * K)


def _reassembler(
    root: Path, *, max_object_bytes: int = 1 << 30, max_open_objects: int = 16
) -> Reassembler:
    return Reassembler(root, max_object_bytes=max_object_bytes, max_open_objects=max_open_objects)


def _refused_on_delivery(root: Path, env: bytes, digest: bytes | None = None) -> None:
    """Red, UDP receive: a rebuilt object checked as the delivery thread checks it, given up
    with the reason the check returns (``UdpReceiver._give_up``)."""
    ra = _reassembler(root)
    for s in _symbols(3, _header(1, env, digest), env):
        ra.add(s, 1.0)
    d = ra.ready.popleft()
    checked = verify_and_read_name(d)
    assert isinstance(checked, str), f"{root}: object was deliverable: {checked}"
    ra.fail(d, checked)


def driven_reasons(tmp_path: Path) -> dict[str, str]:
    """Red, UDP receive: every way the receiver gives an object up (or finds ids no datagram
    came for), each driven in a spool of its own; the reason each wrote, by path."""
    out: dict[str, str] = {}

    def record(path: str, root: Path) -> None:
        gaps = read_gap_records(root)
        assert len(gaps) == 1, f"{path}: expected one gap record in {root}, got {gaps}"
        out[path] = str(gaps[0]["reason"])

    root = tmp_path / "idle"  # symbols stop coming before the object is whole
    ra, env = _reassembler(root), _env()
    for s in _symbols(1, _header(1, env), env)[:3]:
        ra.add(s, 1.0)
    assert ra.expire_idle(100.0, 30.0) == 1
    record("idle", root)

    root = tmp_path / "evict"  # more objects open than allowed
    ra = _reassembler(root, max_open_objects=1)
    for oid in (1, 2):
        env = _env(f"u1.{oid:012d}.0123456789abcdef0123456789abcdef.dbundle")
        for s in _symbols(1, _header(oid, env), env)[:2]:
            ra.add(s, float(oid))
    record("evict", root)

    root = tmp_path / "big"  # announces more than max_object_bytes
    ra, env = _reassembler(root, max_object_bytes=T), _env()
    ra.add(_symbols(1, _header(1, env), env)[0], 1.0)
    record("big", root)

    root = tmp_path / "digest"
    _refused_on_delivery(root, _env(), digest=hashlib.sha256(b"other").digest())
    record("digest", root)

    root = tmp_path / "name"
    _refused_on_delivery(root, _env(".hidden"))
    record("name", root)

    root = tmp_path / "disk"  # a spool write refused (what the receive loop does on OSError)
    ra, env = _reassembler(root), _env()
    syms = _symbols(1, _header(1, env), env)
    ra.add(syms[0], 1.0)
    ra.give_up(1, syms[0].obj, OSError(28, "No space left on device"))
    record("disk", root)

    root = tmp_path / "unseen"  # ids 0 and 2 arrive, 1 never does
    ra = _reassembler(root)
    for oid in (0, 2):
        env = _env(f"u1.{oid:012d}.0123456789abcdef0123456789abcdef.dbundle")
        ra.add(_symbols(5, _header(oid, env), env)[0], 1.0)
    assert ra.report_unseen(time.time() + 60.0, 30.0) == 1
    record("unseen", root)
    return out


# ---------------------------------------------------------------------- what the source can write
_REASON_ARG = {"gap": 1, "_expire": 1, "_evict_oldest": 0, "fail": 1, "_give_up": 2}
"""Receiver functions that take a gap reason, and the position of that argument."""
_FORWARDED = {"reason", "checked"}
"""Names a reason is passed on under: a parameter of a function above, or the refusal
``verify_and_read_name`` returned (its string returns are collected too)."""


def source_reasons() -> set[str]:
    """Red, UDP receive: every gap reason the receiver's source passes as a literal, or
    returns from ``verify_and_read_name``; fails on a reason passed any other way."""
    found: set[str] = set()
    for mod in (udp_spool, udp_receiver):
        path = Path(str(mod.__file__))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "verify_and_read_name":
                for r in ast.walk(node):
                    if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant):
                        found.add(str(r.value.value))
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name not in _REASON_ARG:
                continue
            kw = [k.value for k in node.keywords if k.arg == "reason"]
            pos = _REASON_ARG[name]
            args = kw or node.args[pos : pos + 1]
            assert args, f"{path}:{node.lineno}: {name}() called without its reason"
            arg = args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
            else:
                assert isinstance(arg, ast.Name) and arg.id in _FORWARDED, (
                    f"{path}:{node.lineno}: {name}() gets its reason as "
                    f"{ast.unparse(arg)!r}, which this test cannot follow: pass a literal, "
                    "or add the name to _FORWARDED with where its values come from"
                )
    return found


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The reasons the receiver wrote, every path driven once."""
    driven = driven_reasons(tmp_path_factory.mktemp("gaps"))
    assert driven == {
        "idle": "timeout",
        "evict": "evicted",
        "big": "too_large",
        "digest": "digest_mismatch",
        "name": "bad_name",
        "disk": "spool_error",
        "unseen": "unseen",
    }
    return set(driven.values())


def test_the_source_writes_no_reason_the_driven_paths_miss(written: set[str]) -> None:
    """A reason added to the receiver fails here until a path above drives it (and the
    documents below list it)."""
    assert source_reasons() == written


def test_protocol_lists_exactly_the_reasons_the_receiver_writes(written: set[str]) -> None:
    assert protocol_reasons() == written


def test_red_tables_lists_exactly_the_reasons_the_receiver_writes(written: set[str]) -> None:
    assert red_tables_reasons() == written


def test_runbook_lists_exactly_the_reasons_the_receiver_writes(written: set[str]) -> None:
    assert runbook_reasons() == written
