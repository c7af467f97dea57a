"""Diode, UDP (both sides): a large receive buffer, forced past rmem_max when we may; what the
kernel dropped for want of room in it; the MTU of the route to the diode; don't-fragment."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator

__all__ = [
    "SO_RCVBUFFORCE",
    "SocketDrops",
    "route_mtu",
    "route_source",
    "set_dont_fragment",
    "set_rcvbuf",
]

SO_RCVBUFFORCE: int | None = getattr(
    socket, "SO_RCVBUFFORCE", 33 if sys.platform.startswith("linux") else None
)
"""Python 3.11's socket module lacks the constant; Linux's value is 33."""


_LINUX = sys.platform.startswith("linux")
_IP_MTU: int | None = getattr(socket, "IP_MTU", 14 if _LINUX else None)
_IPV6_MTU: int | None = getattr(socket, "IPV6_MTU", 24 if _LINUX else None)
"""Python's socket module lacks IP_MTU; Linux's values (getsockopt of a connected socket)."""
_IP_MTU_DISCOVER: int | None = getattr(socket, "IP_MTU_DISCOVER", 10 if _LINUX else None)
_IPV6_MTU_DISCOVER: int | None = getattr(socket, "IPV6_MTU_DISCOVER", 23 if _LINUX else None)
_PMTUDISC_DO = 2
"""Linux's ``IP_PMTUDISC_DO`` / ``IPV6_PMTUDISC_DO``: set DF, never fragment locally."""


def set_dont_fragment(sock: socket.socket, *, ipv6: bool) -> bool:
    """Send with don't-fragment: a datagram larger than the route's MTU is refused by
    ``sendto`` (EMSGSIZE) instead of leaving as IP fragments, which many diodes drop whole.
    False where the option does not exist (not Linux)."""
    opt = _IPV6_MTU_DISCOVER if ipv6 else _IP_MTU_DISCOVER
    if opt is None:
        return False
    sock.setsockopt(socket.IPPROTO_IPV6 if ipv6 else socket.IPPROTO_IP, opt, _PMTUDISC_DO)
    return True


def route_mtu(dest: tuple[str, int], *, ipv6: bool) -> int | None:
    """The MTU of the kernel's route to ``dest`` (a connected probe socket's IP_MTU), or None
    where it cannot be asked (no route yet, not Linux): what a datagram must fit in to leave
    this host unfragmented."""
    opt = _IPV6_MTU if ipv6 else _IP_MTU
    if opt is None:
        return None
    with _route_probe(dest, ipv6=ipv6) as s:
        try:
            return int(s.getsockopt(socket.IPPROTO_IPV6 if ipv6 else socket.IPPROTO_IP, opt))
        except OSError:
            return None


def route_source(dest: tuple[str, int], *, ipv6: bool) -> str | None:
    """The local address the kernel's route to ``dest`` sends from (a connected probe socket's
    own address), or None without a route: what the sender binds to, so that its socket is
    not open on every interface."""
    with _route_probe(dest, ipv6=ipv6) as s:
        try:
            host = str(s.getsockname()[0])
        except OSError:
            return None
    return None if host in ("0.0.0.0", "::") else host


@contextlib.contextmanager
def _route_probe(dest: tuple[str, int], *, ipv6: bool) -> Iterator[socket.socket]:
    """A UDP socket connected to ``dest`` (nothing is sent: the kernel only picks the route);
    unconnected where there is no route, so that what is asked of it answers OSError/None."""
    with socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(dest)
        except OSError:
            s.close()  # every later question fails: no route
        yield s


def set_rcvbuf(sock: socket.socket, want: int) -> int:
    """Ask for ``want`` bytes (forced as root / CAP_NET_ADMIN, else up to net.core.rmem_max);
    returns what the kernel granted (its doubled bookkeeping halved)."""
    for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
        if opt is None:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, want)
            break
        except OSError:
            continue
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2


class SocketDrops:
    """Datagrams the kernel dropped on one socket because its receive buffer was full: the
    ``drops`` column of ``/proc/net/udp`` (``udp6``) on the socket's line, found by inode.
    Read a few times a second at most (the file lists every UDP socket of the namespace), never
    per datagram. Where the kernel does not tell, ``since_start`` is None."""

    def __init__(self, sock: socket.socket) -> None:
        self.inode = str(os.fstat(sock.fileno()).st_ino)
        self.table = "/proc/net/udp6" if sock.family == socket.AF_INET6 else "/proc/net/udp"
        self.base = self.total()

    def total(self) -> int | None:
        """The socket's drop counter now (since it was created), or None."""
        try:
            with open(self.table, encoding="ascii") as f:
                next(f, None)  # the column names
                for line in f:
                    cols = line.split()
                    if len(cols) >= 13 and cols[9] == self.inode:
                        return int(cols[12])
        except (OSError, ValueError):
            return None
        return None

    def since_start(self) -> int | None:
        """Drops since this object was made (None: unknown)."""
        now = self.total()
        if now is None or self.base is None:
            return None
        return now - self.base
