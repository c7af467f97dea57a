"""Diode, UDP (red): the kernel's count of datagrams a full receive buffer dropped, on a real
loopback socket."""

from __future__ import annotations

import socket

import pytest

from bridge.diode.udp_socket import SocketDrops


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_datagrams_a_full_receive_buffer_dropped_are_counted_for_that_socket(
    family: socket.AddressFamily, host: str
) -> None:
    try:
        rx = socket.socket(family, socket.SOCK_DGRAM)
        rx.bind((host, 0))
    except OSError as e:
        pytest.skip(f"no {host} here: {e}")
    other = socket.socket(family, socket.SOCK_DGRAM)  # its drops must not count
    other.bind((host, 0))
    tx = socket.socket(family, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel's minimum
        drops, others = SocketDrops(rx), SocketDrops(other)
        assert drops.since_start() == 0
        for _ in range(500):  # nobody reads: the buffer fills after a few
            tx.sendto(b"x" * 1000, rx.getsockname()[:2])
        got = drops.since_start()
        assert got is not None and 400 <= got < 500
        rx.setblocking(False)
        taken = 0
        while True:
            try:
                rx.recv(2048)
            except BlockingIOError:
                break
            taken += 1
        assert taken + got == 500  # every datagram: read, or counted as dropped
        assert others.since_start() == 0
    finally:
        for s in (rx, other, tx):
            s.close()
