"""Diode, UDP (tests, benchmarks, demo): a lossy one-way relay standing in for the diode.

It never parses a datagram: it forwards each one from ``--listen`` to ``--forward`` unless
its impairments decide otherwise — random loss, loss in bursts (Gilbert-Elliott), reordering,
duplication and single-bit corruption. Counters go to stdout as one JSON line when it stops
(SIGTERM / SIGINT) and every ``--report-seconds``.

Burst model: two states. In *good* nothing is lost by it; in *bad* every datagram is lost.
Bad -> good with probability ``1 / burst_mean`` per datagram (bursts last ``burst_mean`` on
average, geometrically). ``burst_max`` caps a burst's length (``burst_mean = burst_max = 50``
gives bursts of exactly 50, two touching now and then; ``burst_max < burst_mean`` gives bursts
of exactly ``burst_max``). Good -> bad with ``p = r / (L * (1 - r) + r)``, ``L`` the mean
length of the bursts as capped (``burst_length``), so that the long-run fraction lost in
bursts is ``r = burst_loss`` under any cap.

Reordering: a datagram held back is sent once ``reorder_depth`` more datagrams have arrived
(at most that many overtake it, fewer when some of them are lost or held back too), when the
relay is idle, or when it stops: a delay bounded by the depth at any reorder fraction, and
never a loss (``released_at_stop`` counts those the stop sent).

Bad input never stops it: an empty datagram is forwarded as is (there is no bit to flip), and a
send the kernel refuses is counted (``send_errors``), not raised. A bad address or impairment
is refused at start, naming it; once bound it prints one ``{"msg": "relay listening", ...}``
line (with the seed, drawn when none is given, so a run can be repeated).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bridge.diode.udp_socket import set_rcvbuf

__all__ = ["MAX_REORDER_DEPTH", "Impairment", "LossModel", "Relay", "burst_length", "main"]

MAX_REORDER_DEPTH = 10_000
"""At most this many + 1 datagrams are held back at once: the relay's memory stays bounded."""


@dataclass(frozen=True)
class Impairment:
    """What the relay does to the datagrams it forwards (fractions in 0..1)."""

    loss: float = 0.0
    burst_loss: float = 0.0
    burst_mean: float = 4.0
    burst_max: int | None = None
    reorder: float = 0.0
    reorder_depth: int = 8
    duplicate: float = 0.0
    corrupt: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("loss", "burst_loss", "reorder", "duplicate", "corrupt"):
            v = getattr(self, name)
            if not 0 <= v < 1:  # NaN fails this too
                raise ValueError(f"relay {name} must be a fraction in [0, 1), got {v}")
        if not (math.isfinite(self.burst_mean) and self.burst_mean >= 1):
            raise ValueError(f"relay burst_mean must be a number >= 1, got {self.burst_mean}")
        if self.burst_max is not None and self.burst_max < 1:
            raise ValueError(f"relay burst_max must be >= 1 (or unset), got {self.burst_max}")
        if not 1 <= self.reorder_depth <= MAX_REORDER_DEPTH:
            raise ValueError(
                f"relay reorder_depth must be from 1 to {MAX_REORDER_DEPTH}, got "
                f"{self.reorder_depth}"
            )


def burst_length(mean: float, most: int | None) -> float:
    """The mean length of the bursts the model makes: ``mean`` (geometric) cut at ``most``
    (a cut burst is shorter: ``(1 - (1 - 1/mean)^most) * mean``), ``most`` when ``mean >=
    most`` (bursts of exactly ``most``). The entry probability is taken from it, so the
    long-run fraction lost in bursts is ``burst_loss`` whatever the cap."""
    if most is None:
        return mean
    if mean >= most:
        return float(max(most, 1))  # the datagram that starts a burst is lost even at 0
    return (1.0 - (1.0 - 1.0 / mean) ** most) * mean


class LossModel:
    """Decides per datagram: lost at random, lost in a burst, or kept (pure, seeded)."""

    __slots__ = ("_rng", "_loss", "_p_enter", "_p_leave", "_max", "_bad", "_run")

    def __init__(self, imp: Impairment, rng: random.Random) -> None:
        self._rng = rng
        self._loss = imp.loss
        r = imp.burst_loss
        self._p_leave = 1.0 / imp.burst_mean
        self._max = imp.burst_max
        if self._max is not None and imp.burst_mean >= self._max:
            self._p_leave = 0.0  # fixed-length bursts: only burst_max ends one
        length = burst_length(imp.burst_mean, imp.burst_max)
        self._p_enter = r / (length * (1.0 - r) + r) if r > 0 else 0.0
        self._bad = False
        self._run = 0

    def decide(self) -> str | None:
        """None to keep the datagram, else the reason it is lost ("random" or "burst")."""
        rnd = self._rng.random
        if self._bad:
            self._run += 1
            if rnd() < self._p_leave or (self._max is not None and self._run >= self._max):
                self._bad = False
            return "burst"
        if self._p_enter and rnd() < self._p_enter:
            self._bad = True
            self._run = 1
            if rnd() < self._p_leave or self._max == 1:
                self._bad = False
            return "burst"
        if self._loss and rnd() < self._loss:
            return "random"
        return None


@dataclass
class Relay:
    """One socket in, one out; a tight loop in the calling thread."""

    listen: tuple[str, int]
    forward: tuple[str, int]
    imp: Impairment = field(default_factory=Impairment)
    rcvbuf: int = 8 << 20
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Resolve both addresses and bind; ValueError naming the address when one is bad."""
        if self.rcvbuf < 65_536:
            raise ValueError(f"relay socket buffers must be >= 65536 bytes, got {self.rcvbuf}")
        self.counters = dict.fromkeys(
            (
                "received",
                "forwarded",
                "dropped_random",
                "dropped_burst",
                "reordered",
                "duplicated",
                "corrupted",
                "released_at_stop",
                "send_errors",
            ),
            0,
        )
        in_family, listen = _resolve(self.listen, "listen")
        out_family, self._dest = _resolve(self.forward, "forward")
        if self._dest[1] == 0:
            raise ValueError(f"relay cannot forward to port 0 ({_show(self.forward)})")
        self.sock = socket.socket(in_family, socket.SOCK_DGRAM)
        try:
            set_rcvbuf(self.sock, self.rcvbuf)
            self.sock.bind(listen)
            if self.sock.getsockname()[:2] == self._dest[:2]:
                raise ValueError(f"relay would forward to itself ({_show(self.forward)})")
            self.sock.settimeout(0.2)
            self.out = socket.socket(out_family, socket.SOCK_DGRAM)
        except OSError as e:
            self.sock.close()
            why = f"relay cannot listen on {_show(self.listen)}: {e.strerror or e}"
            raise OSError(e.errno, why) from e
        except BaseException:
            self.sock.close()
            raise
        self.out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.rcvbuf)

    @property
    def address(self) -> tuple[str, int]:
        return tuple(self.sock.getsockname()[:2])  # type: ignore[return-value]

    def run(self, stop: threading.Event | None = None) -> dict[str, int]:
        stop = stop or threading.Event()
        imp, c = self.imp, self.counters
        rng = random.Random(imp.seed)
        model = LossModel(imp, rng)
        rnd = rng.random
        held: deque[tuple[int, bytes]] = deque()  # (sent when this many have arrived, data)
        buf = bytearray(65536)
        view = memoryview(buf)
        recv_into, send = self.sock.recv_into, self._send
        while not stop.is_set():
            try:
                n = recv_into(buf)
            except TimeoutError:
                while held:  # idle: let held-back datagrams go
                    send(held.popleft()[1])
                continue
            c["received"] += 1
            while held and held[0][0] <= c["received"]:  # due: `depth` more have arrived
                send(held.popleft()[1])
            why = model.decide()
            if why is not None:
                c["dropped_" + why] += 1
                continue
            data = bytes(view[:n])
            if imp.corrupt and n and rnd() < imp.corrupt:  # an empty datagram has no bit
                bit = rng.randrange(n * 8)
                flipped = bytearray(data)
                flipped[bit // 8] ^= 1 << (bit % 8)
                data = bytes(flipped)
                c["corrupted"] += 1
            if imp.reorder and rnd() < imp.reorder:
                held.append((c["received"] + imp.reorder_depth + 1, data))
                c["reordered"] += 1
                continue
            send(data)
            if imp.duplicate and rnd() < imp.duplicate:
                if send(data):
                    c["duplicated"] += 1
        self._release_at_stop(held)
        return dict(c)

    def _send(self, data: bytes) -> bool:
        """Forward one datagram; a send the kernel refuses (no route, no buffer, a firewall)
        is counted in ``send_errors`` and lost, as on a wire: the relay goes on."""
        try:
            self.out.sendto(data, self._dest)
        except OSError:
            self.counters["send_errors"] += 1
            return False
        self.counters["forwarded"] += 1
        return True

    def _release_at_stop(self, held: deque[tuple[int, bytes]]) -> None:
        """Send what is still held back: a stop must not turn reordering into loss."""
        c = self.counters
        while held:
            if self._send(held.popleft()[1]):
                c["released_at_stop"] += 1

    def close(self) -> None:
        self.sock.close()
        self.out.close()


def _show(addr: tuple[str, int]) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(addr: tuple[str, int], what: str) -> tuple[socket.AddressFamily, Any]:
    """The address family and socket address of ``addr``, resolved once (never per datagram);
    ValueError naming it when it cannot be."""
    host, port = addr
    if not 0 <= port <= 65535:
        raise ValueError(f"relay {what} port must be 0-65535, got {_show(addr)}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"relay {what} address {_show(addr)} does not resolve: {e}") from e
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            return family, sockaddr
    raise ValueError(f"relay {what} address {_show(addr)} is neither IPv4 nor IPv6")


def _addr(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (port 0-65535), got {value!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    """`diode udp relay`: percentages on the command line; counters as JSON on stdout."""
    ap = argparse.ArgumentParser(prog="diode udp relay", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=_addr, required=True, help="HOST:PORT to receive on")
    ap.add_argument("--forward", type=_addr, required=True, help="HOST:PORT to send to")
    ap.add_argument("--loss", type=float, default=0.0, help="%% lost at random")
    ap.add_argument("--burst-loss", type=float, default=0.0, help="%% lost in bursts")
    ap.add_argument("--burst-mean", type=float, default=4.0, help="mean burst length")
    ap.add_argument("--burst-max", type=int, default=None,
                    help="longest burst (below --burst-mean: bursts of exactly this; the loss "
                    "stays --burst-loss)")  # fmt: skip
    ap.add_argument("--reorder", type=float, default=0.0, help="%% held back and sent later")
    ap.add_argument("--reorder-depth", type=int, default=8,
                    help="held back while N more arrive")  # fmt: skip
    ap.add_argument("--duplicate", type=float, default=0.0, help="%% sent twice")
    ap.add_argument("--corrupt", type=float, default=0.0, help="%% with one bit flipped")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--rcvbuf-bytes", type=int, default=8 << 20,
                    help="socket buffers: larger ones ride out longer stalls")  # fmt: skip
    ap.add_argument("--report-seconds", type=float, default=0.0, help="also print every N s")
    a = ap.parse_args(argv)
    for opt in ("loss", "burst_loss", "reorder", "duplicate", "corrupt"):  # given in percent
        v = getattr(a, opt)
        if not 0 <= v < 100:  # NaN fails this too
            flag = "--" + opt.replace("_", "-")
            print(f"error: relay: {flag} {v:g}: give a percentage in [0, 100)", file=sys.stderr)
            return 2
    try:
        imp = Impairment(
            loss=a.loss / 100,
            burst_loss=a.burst_loss / 100,
            burst_mean=a.burst_mean,
            burst_max=a.burst_max,
            reorder=a.reorder / 100,
            reorder_depth=a.reorder_depth,
            duplicate=a.duplicate / 100,
            corrupt=a.corrupt / 100,
            seed=random.SystemRandom().randrange(1 << 63) if a.seed is None else a.seed,
        )
        relay = Relay(a.listen, a.forward, imp, rcvbuf=a.rcvbuf_bytes)
    except (ValueError, OSError) as e:
        print(f"error: relay: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    listening = {"msg": "relay listening", "listen": _show(relay.address), "pid": os.getpid()}
    _print({**listening, "forward": _show(a.forward), "seed": imp.seed})
    reporter = None
    if a.report_seconds > 0:

        def report() -> None:
            while not stop.wait(a.report_seconds):
                _print(relay.counters)

        reporter = threading.Thread(target=report, daemon=True)
        reporter.start()
    started = time.monotonic()
    counters = relay.run(stop)
    relay.close()
    if reporter is not None:
        reporter.join(5)  # its last line is out before the summary: never two on one line
    _print({**counters, "seconds": round(time.monotonic() - started, 3)})
    return 0


def _print(doc: dict[str, Any]) -> None:
    print(json.dumps(doc, sort_keys=True), flush=True)
