"""Diode, UDP (both sides): a large receive buffer, forced past rmem_max when we may."""

from __future__ import annotations

import socket
import sys

__all__ = ["SO_RCVBUFFORCE", "set_rcvbuf"]

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
