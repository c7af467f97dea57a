"""UDP, black: batched sends on real loopback sockets. With GSO the receiver still gets every
datagram on its own, byte-identical and in order; where the kernel refuses GSO (a socket
without UDP checksums, SO_NO_CHECK) the batcher falls back to one send per datagram and loses
nothing; a receiver with UDP GRO gets coalesced buffers and cuts them apart."""

from __future__ import annotations

import logging
import os
import socket
import struct

import pytest

from bridge.diode.udp_batch import MAX_SEGMENTS, DatagramBatcher
from bridge.diode.udp_receiver import UDP_GRO, _segment_size
from bridge.errors import TransportError
from bridge.protocol.datagram import (
    DatagramCodec,
    LinkHeartbeat,
    ObjectHeader,
    ObjectKind,
    Symbol,
    symbol_size_for,
)
from tests.support import lo_route

SO_NO_CHECK = 11
CODEC = DatagramCodec(bytes(range(32)))


def header(channel: str, t: int) -> ObjectHeader:
    return ObjectHeader(1, ObjectKind.BUNDLE, channel, 7, t * 200, bytes(32), t, 128)


def receiver(*, gro: bool = False) -> socket.socket:
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    if gro:
        r.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    r.bind(("127.0.0.1", 0))
    r.settimeout(2)
    return r


def sender() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    return s


class Calls:
    def __init__(self) -> None:
        self.paced: list[int] = []
        self.sent = 0

    def pace(self, n: int) -> float:
        self.paced.append(n)
        return 0.0

    def on_sent(self) -> None:
        self.sent += 1


def batcher(s: socket.socket, dest: tuple[str, int], calls: Calls, **kw: object) -> DatagramBatcher:
    args: dict[str, object] = {"gso": True, "max_bytes": 65_507} | kw
    return DatagramBatcher(
        s,
        dest,
        pace=calls.pace,
        on_sent=calls.on_sent,
        **args,  # type: ignore[arg-type]
    )


def send_mixed(b: DatagramBatcher) -> list[bytes]:
    """150 symbols of one channel, a heartbeat, 10 of a channel with another datagram size."""
    expect: list[bytes] = []
    packet = 0
    for channel, n in (("alpha", 150), ("a-much-longer-channel", 10)):
        t = symbol_size_for(1500, channel)
        sealer = CODEC.symbol_sealer(5, header(channel, t))
        for i in range(n):
            payload = os.urandom(t)
            b.add(sealer.seal(packet, i // 128, i, payload))
            expect.append(sealer.seal(packet, i // 128, i, payload))
            packet += 1
        hb = CODEC.seal_heartbeat(LinkHeartbeat(5, packet, 1.0, 2.0, {}, {}))
        b.add(hb)
        expect.append(hb)
        packet += 1
    b.flush()
    return expect


def drain(r: socket.socket, n: int) -> list[bytes]:
    return [r.recv(65535) for _ in range(n)]


def test_gso_batches_arrive_as_the_same_datagrams_in_order() -> None:
    r, s, calls = receiver(), sender(), Calls()
    with r, s:
        b = batcher(s, r.getsockname(), calls)
        expect = send_mixed(b)
        got = drain(r, len(expect))
        assert got == expect
        assert b.gso, "the kernel refused GSO on loopback"
        # 150 + 1 + 10 + 1 datagrams: 3 full batches and the rest, never a send per datagram
        assert b.gso_sends >= 3 and b.sends <= 8, (b.sends, b.gso_sends)
        assert sum(calls.paced) == sum(map(len, expect)) and calls.sent == b.sends
        assert isinstance(CODEC.open(got[0]), Symbol)


def test_a_batch_never_exceeds_its_byte_cap_or_the_segment_limit() -> None:
    r, s, calls = receiver(), sender(), Calls()
    with r, s:
        b = batcher(s, r.getsockname(), calls, max_bytes=10_000)
        expect = send_mixed(b)
        assert drain(r, len(expect)) == expect
        assert max(calls.paced) <= 10_000
    assert MAX_SEGMENTS == 64


def test_kernel_refusing_gso_falls_back_to_one_send_per_datagram(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, s, calls = receiver(), sender(), Calls()
    s.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)  # GSO needs UDP checksums: EINVAL
    with r, s, caplog.at_level(logging.WARNING, logger="bridge.diode.udp_batch"):
        b = batcher(s, r.getsockname(), calls)
        expect = send_mixed(b)
        assert drain(r, len(expect)) == expect
        assert not b.gso and b.gso_sends == 0 and b.sends == len(expect)
        assert "UDP GSO refused" in caplog.text  # the fallback fired, and said so once
        assert caplog.text.count("UDP GSO refused") == 1


def test_gso_off_sends_datagram_by_datagram() -> None:
    r, s, calls = receiver(), sender(), Calls()
    with r, s:
        b = batcher(s, r.getsockname(), calls, gso=False)
        expect = send_mixed(b)
        assert drain(r, len(expect)) == expect
        assert b.gso_sends == 0 and b.sends == len(expect)


def test_a_gro_receiver_gets_coalesced_buffers_that_cut_back_into_the_datagrams() -> None:
    r, s, calls = receiver(gro=True), sender(), Calls()
    with r, s:
        b = batcher(s, r.getsockname(), calls)
        expect = send_mixed(b)
        got: list[bytes] = []
        coalesced = 0
        while len(got) < len(expect):
            buf = bytearray(1 << 18)
            n, anc, _, _ = r.recvmsg_into([buf], socket.CMSG_SPACE(4))
            seg = _segment_size(anc) or n
            coalesced += seg < n
            got += [bytes(buf[o : min(o + seg, n)]) for o in range(0, n, seg)]
        assert got == expect
        assert coalesced >= 1, "loopback delivered no coalesced buffer"


def test_segment_size_reads_the_gro_control_message() -> None:
    assert _segment_size([(socket.SOL_UDP, UDP_GRO, struct.pack("=i", 1472))]) == 1472
    assert _segment_size([(socket.SOL_IP, 8, b"\0" * 4)]) == 0
    assert _segment_size([]) == 0


@pytest.mark.parametrize("gso", [True, False])
def test_a_route_mtu_lowered_mid_run_stops_the_sender_and_nothing_leaves_fragmented(
    gso: bool,
) -> None:
    """Datagrams sized for MTU 1500; the route's MTU drops to 1280 while the sender runs.
    Don't-fragment is set, so the kernel refuses them (without it they left as IP fragments,
    which many diodes drop): the batcher stops with the route's MTU and the fix, and the
    receiver never gets a fragment-reassembled datagram after the drop."""
    addr = "127.0.0.78"
    with lo_route(addr, 1500) as route:
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        r.bind((addr, 0))
        r.settimeout(0.5)
        s, calls = sender(), Calls()
        with r, s:
            b = batcher(s, r.getsockname(), calls, gso=gso)
            t = symbol_size_for(1500, "alpha")
            sealer = CODEC.symbol_sealer(5, header("alpha", t))
            for i in range(4):
                b.add(sealer.seal(i, 0, i, os.urandom(t)))
            b.flush()
            assert len(drain(r, 4)) == 4  # fits the route: sent whole
            route.mtu(1280)
            with pytest.raises(TransportError) as err:  # without GSO, at the second symbol
                for i in range(4, 8):
                    b.add(sealer.seal(i, 0, i, os.urandom(t)))
                b.flush()
            text = str(err.value)
            assert f"datagrams of {sealer.size} bytes no longer fit the route" in text, text
            assert "MTU is now 1280" in text and "Set udp.mtu = 1280 on both sides" in text
            with pytest.raises(TimeoutError):
                r.recv(65535)  # nothing of the refused batch arrived, fragmented or not
