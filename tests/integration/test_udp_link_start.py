"""Demo, diode: the UDP link's receiver and relay processes start, fail and die cleanly — a
relay that cannot listen is an error however slowly it starts, and a demo killed -9 leaves no
process of the link running on its ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.config import Config, load_config
from bridge.demo import udp_link
from bridge.demo.run import write_demo_config
from bridge.demo.udp_link import UdpLink, free_udp_port, udp_config_toml
from bridge.diode.udp_key import generate_key_file
from bridge.errors import TransportError
from tests.support import REPO

DEAD_MGMT = "http://127.0.0.1:9"


def demo_config(work: Path, relay_port: int, loss_percent: float = 2) -> Config:
    """The demo's own config, UDP section included (nothing in it reaches a broker here)."""
    work.mkdir(parents=True, exist_ok=True)
    generate_key_file(work / "keys" / "udp.key")
    path = write_demo_config(
        work,
        black_fpr="A" * 40,
        red_fprs=["B" * 40],
        amqp_url="amqp://guest:guest@127.0.0.1:5672/unused",
        mgmt=DEAD_MGMT,
        red_amqp_url="amqp://guest:guest@127.0.0.1:5672/unused-red",
        transport="udp",
        udp_section=udp_config_toml(relay_port, free_udp_port(), loss_percent=loss_percent),
    )
    return load_config(path, environ={})


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own child: reap it, else it lingers as a zombie
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every process a UdpLink starts in this test; any still running at the end is killed."""
    procs: list[subprocess.Popen[bytes]] = []
    spawn = UdpLink._spawn

    def recording(self: UdpLink, name: str, argv: list[str]) -> None:
        spawn(self, name, argv)
        procs.append(self.procs[name])

    monkeypatch.setattr(UdpLink, "_spawn", recording)
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_relay_slow_to_fail_on_a_port_in_use_fails_the_start_naming_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """On a loaded machine a relay takes longer than half a second to start. The link took a
    relay that had not exited after 0.5 s as started: one that then failed to bind went
    unnoticed (the demo sent into nothing and waited minutes). Now the link waits for the
    relay to say it listens, or to exit: the port in use is the error, named."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    cfg = demo_config(tmp_path / "demo", port)
    cli = udp_link._cli

    def slow(*args: str) -> list[str]:
        argv = cli(*args)
        if "relay" in args:  # python -c CODE ...: the relay starts 1.5 s late
            argv[2] = "import time; time.sleep(1.5)\n" + argv[2]
        return argv

    monkeypatch.setattr(udp_link, "_cli", slow)
    link = UdpLink(cfg, port, 2.0)
    try:
        with pytest.raises(TransportError, match="relay did not start") as err:
            link.start()
    finally:
        taken.close()
    assert f"cannot listen on 127.0.0.1:{port}" in str(err.value), err.value
    assert [p.args for p in spawned if p.poll() is None] == [], "left running"
    assert len(spawned) == 2 and spawned[-1].returncode == 2  # the relay, refused


_DEMO = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from bridge.config import load_config
from bridge.demo.udp_link import UdpLink
cfg = load_config(Path({cfg!r}), environ={{}})
link = UdpLink(cfg, {port}, 2.0)
link.start()
print(json.dumps({{k: p.pid for k, p in link.procs.items()}}), flush=True)
time.sleep(600)
"""


def test_a_demo_killed_outright_leaves_no_link_process_running(tmp_path: Path) -> None:
    """kill -9 of the demo runs no ``finally``: its receiver and relay ran on forever, bound
    to their ports. Now each is told (SIGTERM) when the demo dies, and stops as on a stop."""
    port = free_udp_port()
    cfg = demo_config(tmp_path / "demo", port)
    assert cfg.source is not None
    code = _DEMO.format(repo=str(REPO), cfg=str(cfg.source), port=port)
    demo = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    pids: dict[str, int] = {}
    try:
        assert demo.stdout is not None
        line = demo.stdout.readline()
        assert line, f"the demo stand-in did not start the link (exit {demo.wait(60)})"
        pids = json.loads(line)
        assert set(pids) == {"receiver", "relay"}
        for pid in pids.values():
            os.kill(pid, 0)  # both run
        demo.send_signal(signal.SIGKILL)
        demo.wait(30)
        left = {name: pid for name, pid in pids.items() if not _gone(pid, 60)}
        assert left == {}, f"still running after the demo was killed: {left}"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    relay_log = (Path(cfg.udp.receive.spool_dir).parent / "relay.log").read_text()  # type: ignore[union-attr]
    assert '"released_at_stop"' in relay_log, relay_log  # it stopped as on SIGTERM: summary
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", port))  # the relay's port is free again
