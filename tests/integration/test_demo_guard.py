"""Integration: `diode demo` never deletes a vhost it did not create and refuses bad options
before it starts anything (bridge.demo.run, bridge.demo.udp_link).

The demo deletes and re-creates its vhosts. It refuses ``/`` always (before the broker is even
asked) and an existing vhost that lacks the tag the demo gives the vhosts it creates; the tests
create their own throw-away vhosts on the real broker (untagged, with a queue in them that must
survive) and delete them afterwards. Option checks run before any file, key, vhost or process
exists, and a UDP link that fails to start stops the process it had started.

Safety: the command-line runs have a JAVA_HOME that does not exist and, except where the vhost
check needs the broker, reach the management API only through an HTTP proxy nothing answers; so
a demo that did not refuse in time fails at the management API or at Spark: it can never touch
the shared broker's ``/``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from bridge.black.management import ManagementClient
from bridge.errors import ConfigError, TransportError
from tests.conftest import AUTH, MGMT

pytestmark = [pytest.mark.broker]

REPO = Path(__file__).resolve().parents[2]
DEAD_MGMT = "http://127.0.0.1:9"
"""A management URL nothing answers: a demo that reaches the broker fails there, harmlessly."""


def _q(v: str) -> str:
    return urllib.parse.quote(v, safe="")


def vhost_info(name: str) -> dict | None:  # type: ignore[type-arg]
    r = requests.get(f"{MGMT}/api/vhosts/{_q(name)}", auth=AUTH, timeout=30)
    return None if r.status_code == 404 else r.json()


def queue_exists(vhost: str, queue: str) -> bool:
    r = requests.get(f"{MGMT}/api/queues/{_q(vhost)}/{_q(queue)}", auth=AUTH, timeout=30)
    return r.status_code == 200


def make_vhost_with_queue(name: str, queue: str = "keep-me") -> None:
    """A vhost as someone else would create it (no demo tag), holding a durable queue."""
    ManagementClient(MGMT, *AUTH).put_vhost(name)
    r = requests.put(
        f"{MGMT}/api/queues/{_q(name)}/{_q(queue)}", auth=AUTH, json={"durable": True}, timeout=30
    )
    assert r.status_code in (201, 204), r.text


@pytest.fixture
def base_vhost() -> Iterator[str]:
    """A fresh vhost name; it and its red twin are deleted afterwards (whoever created them)."""
    name = f"diode-test-guard-{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        mc = ManagementClient(MGMT, *AUTH, timeout=60)
        mc.delete_vhost(name)
        mc.delete_vhost(f"{name}-red")
        mc.close()


def _own_processes(marker: str) -> list[int]:
    """Pids of processes whose command line or config mentions ``marker`` (our workdir)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            pids.append(int(d.name))
    return pids


def run_demo_cli(workdir: Path, *args: str, reach_broker: bool = False) -> tuple[int, str]:
    """`diode demo --workdir workdir ARGS`. Spark cannot start (no Java) and, unless
    ``reach_broker``, the management API is behind a proxy nothing answers: a demo that did not
    refuse in time fails there, after at most the damage the test looks for."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DIODE__", "DIODE_CONFIG"))
        and k.lower() not in ("no_proxy", "http_proxy", "https_proxy", "all_proxy")
    }
    env.update(PYTHONPATH=str(REPO), JAVA_HOME="/nonexistent/diode-test-no-java")
    if not reach_broker:
        env.update(HTTP_PROXY="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")
    try:
        r = subprocess.run(
            [sys.executable, "-m", "bridge.cli", "--log-format", "text", "demo",
             "--workdir", str(workdir), *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    finally:
        for pid in _own_processes(str(workdir)):  # what a failed demo left running: ours
            os.kill(pid, signal.SIGKILL)
    return r.returncode, r.stdout + r.stderr


# -- vhosts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vhost", "red_vhost"), [("/", None), ("diode-test-guard-x", "/")], ids=["black", "red"]
)
def test_root_vhost_is_refused_before_anything_is_touched(
    tmp_path: Path, vhost: str, red_vhost: str | None
) -> None:
    from bridge.demo.run import run_demo

    work = tmp_path / "demo"
    with pytest.raises(ConfigError) as e:
        run_demo(work, 10, vhost=vhost, red_vhost=red_vhost, mgmt=DEAD_MGMT)
    msg = str(e.value)
    assert "'/': that is the broker's default vhost" in msg, msg
    assert "--vhost diode-demo" in msg, msg
    assert not work.exists(), "nothing may be created before the vhosts are checked"
    assert vhost_info("/") is not None


def test_cli_refuses_root_vhost_with_exit_2(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    code, out = run_demo_cli(work, "--vhost", "/", "--messages", "10")
    assert code == 2, out
    assert "Traceback" not in out and "'/': that is the broker's default vhost" in out, out
    assert not work.exists()


@pytest.mark.parametrize("existing", ["black", "red"])
def test_an_existing_vhost_the_demo_did_not_create_is_refused(
    tmp_path: Path, base_vhost: str, existing: str
) -> None:
    """Untagged ``<vhost>`` or ``<vhost>-red`` (its twin): refused with exit 2 before the demo
    creates, deletes or starts anything; the vhost and its queue are intact."""
    taken = base_vhost if existing == "black" else f"{base_vhost}-red"
    make_vhost_with_queue(taken)
    work = tmp_path / "demo"
    code, out = run_demo_cli(
        work, "--vhost", base_vhost, "--messages", "10", "--big-every", "0", reach_broker=True
    )
    assert code == 2, out
    assert "Traceback" not in out, out
    assert f"vhost '{taken}'" in out and "was not created by `diode demo`" in out, out
    assert f"--vhost {base_vhost}-2" in out and f"rabbitmqctl delete_vhost {taken}" in out, out
    if existing == "red":
        assert f"(the red twin of '{base_vhost}')" in out, out
        assert vhost_info(base_vhost) is None, "the black vhost was created anyway"
    assert queue_exists(taken, "keep-me"), "the demo deleted a vhost it did not create"
    assert not work.exists()


def test_demo_vhosts_are_tagged_and_only_those_are_recreated(base_vhost: str) -> None:
    from bridge.demo.run import DEMO_VHOST_TAG, recreate_demo_vhosts

    red = f"{base_vhost}-red"
    mc = ManagementClient(MGMT, *AUTH, timeout=60)
    try:
        recreate_demo_vhosts(mc, base_vhost, red)
        for v in (base_vhost, red):
            info = vhost_info(v)
            assert info is not None and DEMO_VHOST_TAG in info["tags"], info
        r = requests.put(
            f"{MGMT}/api/queues/{_q(base_vhost)}/old", auth=AUTH, json={"durable": True},
            timeout=30,
        )  # fmt: skip
        assert r.status_code in (201, 204)
        recreate_demo_vhosts(mc, base_vhost, red)  # its own vhosts: deleted and re-created
        assert not queue_exists(base_vhost, "old")
        assert DEMO_VHOST_TAG in (vhost_info(base_vhost) or {})["tags"]
        # the same name, re-created by someone else (untagged): refused, left alone
        mc.delete_vhost(red)
        make_vhost_with_queue(red)
        with pytest.raises(ConfigError, match="was not created by `diode demo`"):
            recreate_demo_vhosts(mc, base_vhost, red)
        assert queue_exists(red, "keep-me")
        assert vhost_info(base_vhost) is not None, "nothing deleted before the refusal"
    finally:
        mc.close()


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"messages": -5}, "--messages -5"),
        ({"messages": 0}, "--messages 0"),
        ({"big_every": -1}, "--big-every -1"),
        ({"transport": "udp", "loss_percent": 200.0}, "--loss 200.0"),
        ({"transport": "udp", "loss_percent": 100.0}, "--loss 100.0"),
        ({"transport": "udp", "loss_percent": -1.0}, "--loss -1.0"),
        ({"transport": "udp", "loss_percent": float("nan")}, "--loss nan"),
        ({"loss_percent": 2.0}, "--loss 2.0 needs --transport udp"),
        ({"transport": "tcp"}, "--transport tcp"),
        ({"port": 0}, "AMQP port 0"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(
    tmp_path: Path,
    kw: dict,
    needle: str,  # type: ignore[type-arg]
) -> None:
    from bridge.demo.run import run_demo

    work = tmp_path / "demo"
    args = {"messages": 10, **kw}
    with pytest.raises(ConfigError) as e:
        run_demo(work, args.pop("messages"), vhost="diode-test-guard-opts", mgmt=DEAD_MGMT, **args)
    assert needle in str(e.value), str(e.value)
    assert not work.exists()


@pytest.mark.parametrize(
    "args",
    [["--transport", "udp", "--loss", "200"], ["--messages", "-5"]],
    ids=["loss-200", "messages-negative"],
)
def test_cli_bad_options_exit_2_and_start_nothing(
    tmp_path: Path, base_vhost: str, args: list[str]
) -> None:
    work = tmp_path / "demo"
    code, out = run_demo_cli(work, "--vhost", base_vhost, *args)
    assert code == 2, out
    assert "Traceback" not in out and f"{args[-2]} {args[-1]}" in out, out
    assert not work.exists() and not _own_processes(str(work))


# -- the UDP link -------------------------------------------------------------------------------


def test_a_udp_link_that_fails_to_start_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay refuses its loss (here 200 %, past the demo's own check): the receiver the link
    had already started must not be left running."""
    from bridge.demo.udp_link import UdpLink, free_udp_port
    from tests.integration.test_udp_link_start import demo_config

    relay_port = free_udp_port()
    cfg = demo_config(tmp_path / "demo", relay_port, loss_percent=200)
    spawned: list[subprocess.Popen[bytes]] = []
    spawn = UdpLink._spawn

    def recording(self: UdpLink, name: str, argv: list[str]) -> None:
        spawn(self, name, argv)
        spawned.append(self.procs[name])

    monkeypatch.setattr(UdpLink, "_spawn", recording)
    link = UdpLink(cfg, relay_port, 200.0)
    try:
        with pytest.raises(TransportError, match="relay did not start"):
            link.start()
        assert [p.args[-1] for p in spawned][-1] == "200.0", "the relay was asked for 200 %"
        running = [p.args for p in spawned if p.poll() is None]
        assert running == [], f"left running after a failed start: {running}"
    finally:
        for p in spawned:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_workdir_the_demo_did_not_make_is_refused_and_left_alone(tmp_path: Path) -> None:
    """A real installation's directory (black/ state, keys/) is never taken as a demo's."""
    from bridge.demo.run import DEMO_WORKDIR_MARKER, check_demo_workdir, run_demo

    real = tmp_path / "site"
    (real / "black" / "state").mkdir(parents=True)
    (real / "black" / "state" / "channel-ops.json").write_text("{}")
    with pytest.raises(ConfigError, match="not made by `diode demo`"):
        run_demo(real, 10, vhost=f"diode-test-wd-{uuid.uuid4().hex[:8]}")
    assert (real / "black" / "state" / "channel-ops.json").read_text() == "{}"
    assert not (real / DEMO_WORKDIR_MARKER).exists()
    check_demo_workdir(tmp_path / "new")  # missing: fine
    (tmp_path / "empty").mkdir()
    check_demo_workdir(tmp_path / "empty")  # empty: fine
    (real / DEMO_WORKDIR_MARKER).touch()
    check_demo_workdir(real)  # an earlier demo's
