"""Diode, UDP (test link): the lossy relay on real sockets, seen from a raw receiver.

Each impairment is asserted twice: by the relay's counters and by what a plain socket behind
it actually gets. The last test checks the benchmark's veth + nftables loss path, when root.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

from bridge.diode.udp_relay import Impairment, Relay
from bridge.diode.udp_socket import set_rcvbuf

REPO = Path(__file__).resolve().parents[2]
SIZE = 200  # datagram bytes: 8-byte sequence number + filler


def _datagram(seq: int, size: int = SIZE) -> bytes:
    head = seq.to_bytes(8, "big")
    return head + (head * (size // 8 + 1))[: size - 8]


class Sink:
    """A raw receiver on 127.0.0.1: keeps every datagram in arrival order."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        set_rcvbuf(self.sock, 16 << 20)  # forced past rmem_max when root, as the receiver does
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]

    def drain(self, expect: int, quiet: float = 0.5) -> list[bytes]:
        """Everything received until `expect` datagrams came and then `quiet` s of silence."""
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                got.append(self.sock.recv(65536))
            except TimeoutError:
                if len(got) >= expect:
                    break
        self.sock.settimeout(quiet)
        while True:
            try:
                got.append(self.sock.recv(65536))
            except TimeoutError:
                return got


@contextmanager
def relay_to(sink: Sink, imp: Impairment) -> Iterator[Relay]:
    relay = Relay(("127.0.0.1", 0), sink.address, imp)
    stop = threading.Event()
    t = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    t.start()
    try:
        yield relay
    finally:
        stop.set()
        t.join(5)
        relay.close()
        sink.sock.close()


def send_paced(relay: Relay, datagrams: list[bytes]) -> None:
    """Send all, never more than 500 ahead of the relay, so no socket buffer ever overflows."""
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for i, d in enumerate(datagrams):
            out.sendto(d, relay.address)
            if i % 500 == 499:
                deadline = time.monotonic() + 10
                while relay.counters["received"] < i + 1 and time.monotonic() < deadline:
                    time.sleep(0.001)
    finally:
        out.close()
    deadline = time.monotonic() + 10
    while relay.counters["received"] < len(datagrams) and time.monotonic() < deadline:
        time.sleep(0.005)


def _seq(d: bytes) -> int:
    return int.from_bytes(d[:8], "big")


def test_zero_impairment_forwards_every_datagram_byte_identical_and_in_order() -> None:
    sent = [os.urandom(n) for n in (1, 7, 512, 1400, 1472, 8000, *range(100, 1500, 7))]
    sink = Sink()
    with relay_to(sink, Impairment(seed=1)) as relay:
        send_paced(relay, sent)
        got = sink.drain(len(sent))
    assert got == sent
    c = relay.counters
    assert c["received"] == c["forwarded"] == len(sent)
    assert sum(v for k, v in c.items() if k not in ("received", "forwarded")) == 0


def test_random_loss_rate_matches_counters_and_the_receiver() -> None:
    n = 20_000
    sent = [_datagram(i) for i in range(n)]
    sink = Sink()
    with relay_to(sink, Impairment(loss=0.05, seed=7)) as relay:
        send_paced(relay, sent)
        got = sink.drain(int(n * 0.9))
    c = relay.counters
    assert c["received"] == n
    # 5% of 20k: mean 1000, sd ~31; +-5 sd
    assert 845 < c["dropped_random"] < 1155, c
    assert c["dropped_burst"] == 0
    assert len(got) == c["forwarded"] == n - c["dropped_random"]
    seqs = [_seq(d) for d in got]
    assert seqs == sorted(set(seqs))  # loss only: no reordering, no copies
    assert all(d == _datagram(_seq(d)) for d in got)


def test_burst_loss_takes_runs_of_consecutive_datagrams() -> None:
    n = 20_000
    sent = [_datagram(i) for i in range(n)]
    sink = Sink()
    with relay_to(sink, Impairment(burst_loss=0.05, burst_mean=10, burst_max=10, seed=3)) as r:
        send_paced(r, sent)
        got = sink.drain(int(n * 0.9))
    seen = {_seq(d) for d in got}
    runs, run = [], 0
    for i in range(n):
        if i in seen:
            if run:
                runs.append(run)
            run = 0
        else:
            run += 1
    if run:
        runs.append(run)
    assert sum(runs) == r.counters["dropped_burst"] == n - len(got)
    assert runs and all(x % 10 == 0 for x in runs), runs[:20]  # bursts of exactly 10 (may touch)


def test_duplicates_arrive_twice_and_are_counted() -> None:
    n = 4000
    sent = [_datagram(i) for i in range(n)]
    sink = Sink()
    with relay_to(sink, Impairment(duplicate=0.05, seed=5)) as relay:
        send_paced(relay, sent)
        got = sink.drain(n)
    c = relay.counters
    twice = len(got) - len(set(got))
    assert 100 < c["duplicated"] < 300, c
    assert twice == c["duplicated"]
    assert c["forwarded"] == n + c["duplicated"] == len(got)
    assert set(got) == set(sent)


def test_corruption_flips_exactly_one_bit_and_is_counted() -> None:
    n = 4000
    sent = [_datagram(i) for i in range(n)]
    originals = {int.from_bytes(d, "big") for d in sent}
    sink = Sink()
    with relay_to(sink, Impairment(corrupt=0.05, seed=9)) as relay:
        send_paced(relay, sent)
        got = sink.drain(n)
    c = relay.counters
    assert len(got) == n == c["forwarded"]
    bad = [d for d in got if int.from_bytes(d, "big") not in originals]
    assert 100 < c["corrupted"] < 300, c
    assert len(bad) == c["corrupted"]
    for d in bad:
        v = int.from_bytes(d, "big")
        assert len(d) == SIZE
        assert min((v ^ o).bit_count() for o in originals) == 1


def test_reordered_datagrams_arrive_after_later_ones_and_none_is_lost() -> None:
    n, depth = 4000, 8
    sent = [_datagram(i) for i in range(n)]
    sink = Sink()
    with relay_to(sink, Impairment(reorder=0.05, reorder_depth=depth, seed=4)) as relay:
        send_paced(relay, sent)
        got = sink.drain(n)
    c = relay.counters
    assert sorted(got) == sorted(sent)  # nothing lost, nothing doubled
    late, behind, top = 0, [], -1
    for pos, d in enumerate(got):
        s = _seq(d)
        if s < top:
            late += 1
            behind.append(sum(1 for e in got[:pos] if _seq(e) > s))
        top = max(top, s)
    assert 100 < c["reordered"] < 300, c
    # held back ones released when the sender went quiet are not late: at most a few at the end
    assert c["reordered"] - 3 <= late <= c["reordered"]
    assert min(behind) >= 1 and max(behind) >= depth


def _overtaken_by(got: list[bytes]) -> list[int]:
    """For each datagram that arrived after a later one: how many later ones came first."""
    seen: list[int] = []
    out = []
    for d in got:
        s = _seq(d)
        ahead = len(seen) - bisect.bisect_right(seen, s)
        if ahead:
            out.append(ahead)
        bisect.insort(seen, s)
    return out


def test_heavy_reordering_delays_a_datagram_behind_at_most_depth_others() -> None:
    """30% held back behind 8: more are held than one release per forward could let go (the
    delay used to grow with every datagram); each one now leaves once 8 more arrived."""
    n, depth = 4000, 8
    sent = [_datagram(i) for i in range(n)]
    sink = Sink()
    with relay_to(sink, Impairment(reorder=0.3, reorder_depth=depth, seed=12)) as relay:
        send_paced(relay, sent)
        got = sink.drain(n)
    c = relay.counters
    assert sorted(got) == sorted(sent) and c["forwarded"] == n
    assert 1000 < c["reordered"] < 1400, c
    behind = _overtaken_by(got)
    assert len(behind) > 900 and max(behind) == depth, (len(behind), max(behind))


def test_datagrams_held_back_when_the_relay_stops_are_sent_not_lost() -> None:
    """Stopped while datagrams keep coming (never idle, so nothing was let go for that),
    the relay sends what it still holds back and counts it."""
    sink = Sink()
    relay = Relay(("127.0.0.1", 0), sink.address, Impairment(reorder=0.5, reorder_depth=64, seed=8))
    stop, done = threading.Event(), threading.Event()
    t = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    t.start()
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def flood() -> None:
        i = 0
        while not done.is_set():
            out.sendto(_datagram(i), relay.address)
            i += 1
            if i % 100 == 0:
                time.sleep(0.001)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 10
        while relay.counters["received"] < 3000:
            assert time.monotonic() < deadline, relay.counters
            time.sleep(0.01)
        stop.set()  # while the flood goes on
        t.join(5)
        assert not t.is_alive()
        done.set()
        sender.join(5)
        c = dict(relay.counters)
        got = sink.drain(c["forwarded"])
    finally:
        done.set()
        stop.set()
        out.close()
        relay.close()
        sink.sock.close()
    assert c["released_at_stop"] > 0, c  # the stop found datagrams held back
    assert c["forwarded"] == c["received"] == len(got), c
    assert len({_seq(d) for d in got}) == len(got)


# ------------------------------------------------------------------ veth + nftables (root)
def _bench_udp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_udp", REPO / "benchmarks" / "udp.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod


_COUNT = """
import socket, sys, json
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
from bridge.diode.udp_socket import set_rcvbuf
set_rcvbuf(s, 16 << 20)
s.bind((sys.argv[1], int(sys.argv[2]))); s.settimeout(1.0); n = 0
print("ready", flush=True)
while True:
    try:
        s.recv(65536); n += 1
    except TimeoutError:
        if n: break
print(json.dumps({"n": n}), flush=True)
"""

_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dest = (sys.argv[1], int(sys.argv[2])); data = bytes(1400)
for i in range(int(sys.argv[3])):
    s.sendto(data, dest)
    if i % 200 == 199: time.sleep(0.001)
"""


_SEND_GSO = """
import socket, struct, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dest = (sys.argv[1], int(sys.argv[2])); seg = [(socket.SOL_UDP, 103, struct.pack("=H", 1400))]
data = bytes(1400 * 40)
for i in range(int(sys.argv[3]) // 40):
    s.sendmsg([data], seg, 0, dest)
    if i % 5 == 4: time.sleep(0.001)
"""


@pytest.mark.slow
@pytest.mark.parametrize("gso", [False, True], ids=["sendto", "gso-batches"])
def test_netns_nftables_loss_drops_the_configured_fraction(gso: bool) -> None:
    """Loss is per datagram, also when the sender hands the kernel GSO batches of 40 (the
    benchmark cuts them apart before the veth; otherwise a batch would be lost whole)."""
    bench = _bench_udp()
    why = bench.netns_unavailable()
    if why is not None:
        pytest.skip(f"netns path unavailable: {why}")
    n = 20_000
    ns = bench.Netns(1500)
    try:
        ns.set_loss(10_000)  # 10%
        recv = subprocess.Popen(
            [*ns.prefix(ns.r), sys.executable, "-c", _COUNT, ns.r_addr, "9000"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert recv.stdout is not None
        recv.stdout.readline()
        subprocess.run(
            [*ns.prefix(ns.s), sys.executable, "-c", _SEND_GSO if gso else _SEND, ns.r_addr,
             "9000", str(n)],
            check=True, timeout=60,
        )  # fmt: skip
        got = json.loads(recv.communicate(timeout=30)[0].strip().splitlines()[-1])["n"]
        dropped = ns.dropped()
    finally:
        ns.close()
    assert got + dropped == n
    assert 1800 < dropped < 2200  # 10% of 20k, sd ~42
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns.s not in left and ns.r not in left


# ------------------------------------------------------------------ bad input, bad config
def _relay_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from bridge.cli import main; main()", "udp", "relay", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_an_empty_datagram_under_corruption_is_forwarded_and_the_relay_goes_on() -> None:
    """Corruption flips a bit of the datagram: an empty one has none. It killed the relay
    (``randrange(0)``); now it passes unchanged and the datagrams after it still flow."""
    sink = Sink()
    sent = [b"", _datagram(1), b"", _datagram(2), b""]
    with relay_to(sink, Impairment(corrupt=0.9, seed=1)) as relay:
        send_paced(relay, sent)
        got = sink.drain(len(sent))
        thread_alive = relay.counters["received"] == len(sent)
    c = relay.counters
    assert thread_alive and c["forwarded"] == len(sent), c
    assert got.count(b"") == 3 and len(got) == len(sent)
    assert c["corrupted"] >= 1, c  # corruption did fire, on the non-empty ones


def test_a_send_the_kernel_refuses_is_counted_and_the_relay_goes_on() -> None:
    """Forwarding to the broadcast address without SO_BROADCAST: every sendto fails (EACCES).
    The relay counts each as a send error and keeps receiving; it used to die on the first."""
    relay = Relay(("127.0.0.1", 0), ("255.255.255.255", 9), Impairment(seed=1))
    stop = threading.Event()
    t = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    t.start()
    try:
        send_paced(relay, [_datagram(i) for i in range(50)])
        assert t.is_alive()
    finally:
        stop.set()
        t.join(5)
        relay.close()
    c = relay.counters
    assert c["received"] == 50 and c["send_errors"] == 50 and c["forwarded"] == 0, c


def test_listen_on_ipv6_forward_to_ipv4_and_by_name() -> None:
    """Each side's address family is its own, and a name is resolved once at start (the
    relay used the listen side's family for both and died on its first datagram)."""
    sink = Sink()
    forward = ("localhost", sink.address[1])
    relay = Relay(("::1", 0), forward, Impairment(seed=1))
    stop = threading.Event()
    t = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    t.start()
    out = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        sent = [_datagram(i) for i in range(20)]
        for d in sent:
            out.sendto(d, relay.address)
        got = sink.drain(len(sent))
        assert t.is_alive()
    finally:
        stop.set()
        t.join(5)
        out.close()
        relay.close()
        sink.sock.close()
    assert got == sent


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--listen", "127.0.0.1:70000", "--forward", "127.0.0.1:9"], "127.0.0.1:70000"),
        (["--listen", "127.0.0.1:0", "--forward", "no-such-host.invalid:9"],
         "no-such-host.invalid:9"),
        (["--listen", "127.0.0.1:0", "--forward", "127.0.0.1:0"], "127.0.0.1:0"),
        (["--listen", "127.0.0.1:0", "--forward", "127.0.0.1:9", "--burst-loss", "5",
          "--burst-mean", "nan"], "burst_mean"),
        (["--listen", "127.0.0.1:0", "--forward", "127.0.0.1:9", "--burst-max", "0"],
         "burst_max"),
        (["--listen", "127.0.0.1:0", "--forward", "127.0.0.1:9", "--reorder-depth",
          "100000000"], "reorder_depth"),
        (["--listen", "127.0.0.1:0", "--forward", "127.0.0.1:9", "--loss", "150"],
         "--loss 150: give a percentage in [0, 100)"),
        (["--listen", "127.0.0.1:0", "--forward", "127.0.0.1:9", "--burst-loss", "-1"],
         "--burst-loss -1: give a percentage in [0, 100)"),
    ],
)  # fmt: skip
def test_a_bad_address_or_impairment_is_refused_at_start_naming_it(
    args: list[str], named: str
) -> None:
    """Refused before anything is forwarded, exit 2, no traceback, the culprit named (these
    started, then died on their first datagram, or with a traceback, or ran on silently)."""
    r = _relay_cli(*args, timeout=20)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and named in r.stderr, r.stderr


def test_a_port_in_use_is_refused_naming_the_address() -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        r = _relay_cli("--listen", f"127.0.0.1:{port}", "--forward", "127.0.0.1:9", timeout=20)
    finally:
        taken.close()
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr


def test_the_cli_says_when_it_listens_with_the_seed_and_a_seed_repeats_the_run() -> None:
    """The first line tells where it listens and which seed it drew; the same seed on the
    same datagrams gives the same output (loss, bursts, corruption, duplication and
    reordering alike)."""
    sink = Sink()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from bridge.cli import main; main()", "udp", "relay",
         "--listen", "127.0.0.1:0", "--forward", f"127.0.0.1:{sink.address[1]}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the relay printed nothing within 30 s of starting"
        first = json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        sink.sock.close()
    assert first["msg"] == "relay listening" and first["listen"].startswith("127.0.0.1:")
    assert isinstance(first["seed"], int) and first["pid"] == proc.pid
    summary = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0 and "msg" not in summary and summary["received"] == 0

    imp = Impairment(loss=0.05, burst_loss=0.05, reorder=0.05, duplicate=0.05, corrupt=0.05,
                     seed=first["seed"])  # fmt: skip
    runs = []
    for _ in range(2):
        sink = Sink()
        sent = [_datagram(i) for i in range(3000)]
        with relay_to(sink, imp) as relay:
            send_paced(relay, sent)
            runs.append((sink.drain(int(len(sent) * 0.8)), dict(relay.counters)))
    (a, ca), (b, cb) = runs
    assert min(ca[k] for k in ("dropped_random", "dropped_burst", "corrupted", "duplicated",
                               "reordered")) > 0, ca  # fmt: skip
    # the same decisions, so the same counters and datagrams; only when a held-back one goes
    # may differ (an idle relay lets them go, and idleness is timing)
    assert ca == cb and sorted(a) == sorted(b)
