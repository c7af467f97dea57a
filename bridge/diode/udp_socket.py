"""Diode, UDP (both sides): a large receive buffer, forced past rmem_max when we may; what the
kernel dropped for want of room in it."""

from __future__ import annotations

import os
import socket
import sys

__all__ = ["SO_RCVBUFFORCE", "SocketDrops", "set_rcvbuf"]

SO_RCVBUFFORCE: int | None = getattr(
    socket, "SO_RCVBUFFORCE", 33 if sys.platform.startswith("linux") else None
)
"""Python 3.11's socket module lacks the constant; Linux's value is 33."""


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
