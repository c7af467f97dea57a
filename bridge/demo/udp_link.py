"""Demo, diode: the UDP link on one machine (receiver and lossy relay processes, sender in-line).

    black outbox --diode udp send--> relay (loss %) --> diode udp receive --> red inbox

The receiver and the relay run as their own processes (`diode udp receive`, `diode udp
relay`), as they would in the field; the sender runs until the outbox is empty, then the link
waits until every file it sent is in red's inbox or recorded as a gap. Each is started once
the one before it listens (a relay that cannot bind is an error at once, naming the port);
on Linux each gets SIGTERM when the thread that started it dies, so a demo killed outright
leaves neither running on its ports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.diode.link_status import gap_objects, read_gap_records
from bridge.errors import TransportError

__all__ = ["UdpLink", "free_udp_port", "last_json", "stop_process", "udp_config_toml"]


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def udp_config_toml(relay_port: int, receive_port: int, *, loss_percent: float) -> str:
    """The [udp] section of the demo's configuration (the sender aims at the relay)."""
    overhead = 0.1 if loss_percent <= 2 else 0.25
    return f"""
[udp]
key_file = "keys/udp.key"
mtu = 1500

[udp.send]
destination = "127.0.0.1:{relay_port}"
rate_bytes_per_second = 60000000
repair_overhead = {overhead}
heartbeat_seconds = 1.0
scan_seconds = 0.2
state_dir = "black/udp-send"

[udp.receive]
bind = "127.0.0.1:{receive_port}"
spool_dir = "red/udp-spool"
expire_seconds = 30.0
"""


START_SECONDS = 60.0
"""How long the receiver and the relay may take to listen (a loaded machine is slow)."""

_LAUNCH = """import os, sys
if sys.platform.startswith("linux"):
    import ctypes, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != {parent}:
        sys.exit("the demo that started this process is gone")
from bridge.cli import main
main()
"""


def _cli(*args: str) -> list[str]:
    """`diode ARGS` as a child that is sent SIGTERM when the thread that starts it dies (Linux
    ``PR_SET_PDEATHSIG``, kept across exec): a demo killed -9 leaves no process behind. Start
    it from a thread that outlives it (the demo's main thread)."""
    return [sys.executable, "-c", _LAUNCH.format(parent=os.getpid()), *args]


@dataclass
class UdpLink:
    """Receiver and relay processes of the demo; ``close`` stops them and reads their counters."""

    cfg: Config
    relay_port: int
    loss_percent: float
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def start(self) -> None:
        """Start the receiver, then the relay; if either fails to start, whatever was started
        is stopped before the error is raised."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        assert self.cfg.udp is not None and self.cfg.source is not None
        conf = str(self.cfg.source)
        recv = self.cfg.udp.receive
        logdir = Path(recv.spool_dir).parent
        logdir.mkdir(parents=True, exist_ok=True)
        self._spawn("receiver", _cli("--log-format", "json", "udp", "receive", "--config", conf))
        self._wait_started("receiver", lambda: (Path(recv.spool_dir) / "status.json").exists())
        relay = [
            "udp",
            "relay",
            "--listen",
            f"127.0.0.1:{self.relay_port}",
            "--forward",
            recv.bind,
            "--loss",
            str(self.loss_percent),
        ]
        self._spawn("relay", _cli(*relay))
        self._wait_started("relay", lambda: '"msg": "relay listening"' in self._tail("relay"))

    def _wait_started(self, name: str, listening: Callable[[], bool]) -> None:
        """Until ``listening()``; TransportError with the process's last output if it exits
        first or takes longer than START_SECONDS."""
        deadline = time.monotonic() + START_SECONDS
        while not listening():
            exited = self.procs[name].poll()
            if exited is not None or time.monotonic() > deadline:
                how = f"exited {exited}" if exited is not None else f"not within {START_SECONDS}s"
                raise TransportError(f"the UDP {name} did not start ({how}): {self._tail(name)}")
            time.sleep(0.05)

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.cfg.udp is not None
        log = Path(self.cfg.udp.receive.spool_dir).parent / f"{name}.log"
        self.logs[name] = log
        with open(log, "wb") as out:
            self.procs[name] = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
            )

    def _tail(self, name: str) -> str:
        try:
            return self.logs[name].read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def wait_delivered(self, names: list[str], timeout: float) -> dict[str, Any]:
        """Wait until each sent file name is in red's inbox (or taken by red) or a gap."""
        assert self.cfg.udp is not None
        inbox = Path(self.cfg.udp.receive.inbox or self.cfg.red.inbox)
        want = set(names)
        deadline = time.monotonic() + timeout
        while True:
            present = {p.name for p in inbox.iterdir()} if inbox.is_dir() else set()
            gaps = read_gap_records(Path(self.cfg.udp.receive.spool_dir))
            missing = want - present
            if not missing or time.monotonic() > deadline:
                return {"delivered": len(want & present), "missing": len(missing), "gaps": gaps}
            if len(missing) <= gap_objects(gaps):
                return {"delivered": len(want & present), "missing": len(missing), "gaps": gaps}
            time.sleep(0.2)

    def close(self) -> dict[str, Any]:
        """Stop relay and receiver (SIGTERM) and return the last JSON line each printed; a
        second call has nothing left to stop."""
        out: dict[str, Any] = {}
        for name in ("relay", "receiver"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            stop_process(proc)
            out[name] = last_json(self.logs[name])
        return out


def stop_process(proc: subprocess.Popen[Any], timeout: float = 30.0) -> int:
    """SIGTERM (the link's processes then print their summary), SIGKILL after ``timeout``
    seconds; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def last_json(path: Path) -> dict[str, Any]:
    """The last JSON line of a process log that is not a log record (a summary)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and "msg" not in doc and "event" not in doc:
                return doc
    return {}
