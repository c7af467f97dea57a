"""Diode, UDP (black): datagrams of one size leave in one sendmsg with UDP GSO, or one by one.

UDP generic segmentation offload (Linux >= 4.18, ``UDP_SEGMENT``) hands the kernel up to 64
datagrams of the same size as one message (here one iovec per datagram: the datagrams are
handed over where they were sealed, never copied into a batch buffer); it cuts them apart (in
the NIC, or in software just before the device), so the wire carries exactly the datagrams a
``sendto`` per datagram would, for a fraction of the system calls. Where the kernel or the
device refuses it, the batcher says so once and sends datagram by datagram from then on.

Datagrams leave with don't-fragment set: one that no longer fits the route (its MTU lowered
while the sender runs) is refused by the kernel and stops the sender with the route's MTU and
the fix, instead of crossing as IP fragments that many diodes drop.
"""

from __future__ import annotations

import errno
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from bridge.diode.udp_socket import route_mtu, set_dont_fragment
from bridge.errors import TransportError
from bridge.logs import get_logger, log_event
from bridge.protocol.datagram import MAX_DATAGRAM, ip_udp_header_len

__all__ = ["UDP_SEGMENT", "MAX_SEGMENTS", "DatagramBatcher"]

log = get_logger("bridge.diode.udp_batch")

UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
"""Linux's socket option (Python 3.11's socket module lacks the constant)."""
MAX_SEGMENTS = 64
"""Datagrams per GSO send: the kernel's UDP_MAX_SEGMENTS on every release that has GSO."""
_RETRY = (errno.ENOBUFS, errno.EAGAIN, errno.ECONNREFUSED)
"""The kernel's queue is full (or an ICMP error of an earlier datagram): wait, never drop."""
_NO_GSO = (errno.EINVAL, errno.EIO, errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EMSGSIZE)
"""What a kernel or device without (usable) UDP GSO answers a segmented send."""


class DatagramBatcher:
    """Collects sealed datagrams (references, not copies: one iovec each) and sends them when
    the size changes, the batch is full, or the caller flushes.

    ``pace(nbytes)`` is called before each send (the token bucket: it sleeps and returns the
    seconds waited); ``on_sent()`` after each, so the caller can finish what the send carried.
    A datagram handed over must not change until it is sent (``flush``, or the next
    ``room`` / ``add`` that flushes).
    """

    __slots__ = (
        "sock",
        "dest",
        "ipv6",
        "gso",
        "max_bytes",
        "pace",
        "on_sent",
        "_iov",
        "_bytes",
        "_seg",
        "_count",
        "sends",
        "gso_sends",
    )

    def __init__(
        self,
        sock: socket.socket,
        dest: tuple[str, int],
        *,
        gso: bool,
        max_bytes: int,
        pace: Callable[[int], float],
        on_sent: Callable[[], None],
    ) -> None:
        self.sock, self.dest, self.gso = sock, dest, gso
        self.ipv6 = sock.family == socket.AF_INET6
        set_dont_fragment(sock, ipv6=self.ipv6)
        self.max_bytes = max(1, min(max_bytes, MAX_DATAGRAM))
        self.pace, self.on_sent = pace, on_sent
        self._iov: list[bytes | memoryview] = []
        self._bytes = 0
        self._seg = 0
        self._count = 0
        self.sends = 0
        """System calls that sent datagrams."""
        self.gso_sends = 0
        """Of those, segmented sends (more than one datagram each)."""

    def _room(self, size: int) -> float:
        """Flush first unless a datagram of ``size`` bytes joins the current batch."""
        if self._count and (
            size != self._seg
            or self._count >= MAX_SEGMENTS
            or self._bytes + size > self.max_bytes
            or not self.gso
        ):
            return self.flush()
        return 0.0

    def room(self, size: int) -> tuple[int, float]:
        """Black, send stage: how many datagrams of ``size`` bytes may join the batch now (at
        least one), after the flush that makes room for them if one is due (its seconds
        paced are the second value)."""
        waited = self._room(size)
        if not self.gso:
            return 1, waited
        fit = min(MAX_SEGMENTS - self._count, (self.max_bytes - self._bytes) // size)
        return max(1, fit), waited

    def extend(self, datagrams: list[memoryview], size: int) -> None:
        """Black, send stage: add sealed datagrams of ``size`` bytes each, no more than
        ``room(size)`` allowed just before."""
        self._iov.extend(datagrams)
        self._count += len(datagrams)
        self._bytes += len(datagrams) * size
        self._seg = size

    def add(self, datagram: bytes) -> float:
        """Add a datagram sealed elsewhere (a link heartbeat)."""
        n = len(datagram)
        waited = self._room(n)
        self._iov.append(datagram)
        self._bytes += n
        self._seg = n
        self._count += 1
        return waited

    def flush(self) -> float:
        """Send what is collected (after the pace's wait, which is returned)."""
        if not self._count:
            return 0.0
        iov, seg, count = self._iov, self._seg, self._count
        waited = self.pace(self._bytes)
        if count > 1 and self.gso and not self._send_gso(iov, seg):
            self.gso = False
        if count == 1 or not self.gso:
            for datagram in iov:
                self._send_one(datagram)
        self._iov = []
        self._bytes = self._count = 0
        self.on_sent()
        return waited

    def _send_gso(self, iov: list[bytes | memoryview], seg: int) -> bool:
        """One segmented send; False when GSO is refused (nothing of it was sent)."""
        cmsg = [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", seg))]
        try:
            self._retrying(self.sock.sendmsg, iov, cmsg, 0, self.dest)
        except OSError as e:
            self._refuse_if_too_big(seg, e)
            if e.errno in _NO_GSO:
                log_event(log, 30, "UDP GSO refused by the kernel or device: sending "
                          "datagram by datagram from now on", destination=self._where(),
                          error=str(e), fix='udp.send.gso = "off" skips the probe')  # fmt: skip
                return False
            raise TransportError(f"sendmsg to {self._where()} failed: {e}") from None
        self.gso_sends += 1
        return True

    def _send_one(self, data: bytes | memoryview) -> None:
        try:
            self._retrying(self.sock.sendto, data, self.dest)
        except OSError as e:
            self._refuse_if_too_big(len(data), e)
            raise TransportError(f"sendto {self._where()} failed: {e}") from None

    def _refuse_if_too_big(self, size: int, e: OSError) -> None:
        """TransportError naming the route's MTU when a send of ``size``-byte datagrams failed
        because they no longer fit the route (don't-fragment is set); nothing else."""
        if e.errno not in (errno.EMSGSIZE, errno.EINVAL):
            return
        mtu = route_mtu(self.dest, ipv6=self.ipv6)
        if mtu is None or size + ip_udp_header_len(ipv6=self.ipv6) <= mtu:
            return
        raise TransportError(
            f"datagrams of {size} bytes no longer fit the route to {self._where()}: its MTU is "
            f"now {mtu} (`ip route get {self.dest[0]}`), lower than udp.mtu; nothing left as "
            f"IP fragments (don't-fragment is set). Set udp.mtu = {mtu} on both sides and "
            f"restart (the file in flight was not journaled sent: it goes again), or restore "
            f"the route's MTU"
        ) from None

    def _retrying(self, send: Callable[..., int], *args: Any) -> None:
        """One send system call, repeated while the kernel's queue is full; other errors
        propagate."""
        while True:
            try:
                send(*args)
                self.sends += 1
                return
            except OSError as e:
                if e.errno not in _RETRY:
                    raise
                time.sleep(0.001)

    def _where(self) -> str:
        return f"{self.dest[0]}:{self.dest[1]} (udp.send.destination)"
