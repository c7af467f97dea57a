"""UDP sender, black, on a real socket: the hot loop (blocks stamped at once, datagrams
numbered and tagged a GSO batch at a time, one heap entry per block) puts on the wire exactly
the datagrams the one-at-a-time ``seal`` gives, numbered without a gap, two datagram sizes
mixed; and its interpreter work per datagram stays small (Python calls counted: CPU seconds
are too noisy to assert on a shared machine)."""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import pytest

from bridge.config import config_from_dict
from bridge.diode.udp_sender import run_sender
from bridge.protocol.datagram import LinkHeartbeat, Symbol, symbol_size_for
from tests.integration.test_udp_send import Env, bundle
from tests.integration.test_udp_send import env as env  # noqa: F401 - the sender fixture

LONG = "a-much-longer-channel"


@pytest.mark.parametrize("workers", [0, 1])
def test_the_wire_carries_what_seal_gives_numbered_without_a_gap(env: Env, workers: int) -> None:
    assert symbol_size_for(1500, "u1") != symbol_size_for(1500, LONG)  # two datagram sizes
    data = env.data(encode_workers=workers, rate_bytes_per_second=1_000_000_000)
    data["channels"].append({"name": LONG, "encrypt": False, "transport": "udp"})
    files: dict[str, bytes] = {}
    for seq in range(1, 7):  # small files of both channels: their blocks interleave
        for channel in ("u1", LONG):
            files[bundle(channel, seq)] = os.urandom(seq * 9_000)
    for name, body in files.items():
        (env.outbox / name).write_bytes(body)

    summary = run_sender(config_from_dict(data, base=env.tmp, environ={}), until_idle=True,
                         timeout=60)  # fmt: skip
    heard = env.listener.quiet()
    raw = [b for _, b in env.listener.raw]
    assert summary.files_sent == len(files) and summary.datagrams == len(heard.symbols())
    packets = [d.packet for _, d in heard.items]
    assert packets == list(range(packets[0], packets[0] + len(packets)))  # each once, in order
    sizes = set()
    for wire, (_, d) in zip(raw, heard.items, strict=True):
        if isinstance(d, Symbol):
            sizes.add(len(wire))
            assert wire == env.listener.codec.seal_symbol(d.epoch, d.packet, d.obj, d.block,
                                                          d.esi, d.payload)  # fmt: skip
        else:
            assert isinstance(d, LinkHeartbeat)
    assert len(sizes) == 2
    assert heard.files() == files


def _python_calls(env: Env, n_files: int) -> tuple[int, int]:
    """Python function calls made by a whole run of the sender over ``n_files`` new files of
    1 MB (in this thread; the inotify watcher's are not counted), and its datagrams."""
    for i in range(n_files):
        (env.outbox / bundle("u1", 1000 * n_files + i)).write_bytes(os.urandom(1_000_000))
    cfg = env.cfg(block_symbols=128, encode_workers=0, rate_bytes_per_second=1_000_000_000)
    calls = 0

    def count(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        summary = run_sender(cfg, until_idle=True, timeout=60)
    finally:
        sys.setprofile(None)
    assert summary.files_sent == n_files
    return calls, summary.datagrams


def test_the_interpreter_work_per_datagram_is_small(env: Env) -> None:
    """What 4 MB more cost, per datagram more: about one Python call (the per-block and
    per-batch ones shared out); it was about 7 when each datagram was popped from a heap of
    every symbol, sealed through three calls and copied into the batch."""
    _python_calls(env, 2)  # first imports (numpy where blocks are stamped) not counted
    calls1, dg1 = _python_calls(env, 1)
    calls5, dg5 = _python_calls(env, 5)
    per_datagram = (calls5 - calls1) / (dg5 - dg1)
    assert per_datagram < 2.5, f"{per_datagram:.2f} Python calls per datagram"
