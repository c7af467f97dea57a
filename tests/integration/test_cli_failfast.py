"""Integration: misconfiguration fails fast through the real `diode` CLI with a message that
says how to fix it (unknown key, missing recipient key, unreachable broker, a config holding
secrets that others can read, an AMQP URL the tap would refuse, a refused red broker, a metrics
port in use, a missing GnuPG home, bad log settings, an outbox black cannot write, a refused
management login), exit 2 for configuration errors.

"Fast" is proven by order, not by a stopwatch: every run has a poisoned ``JAVA_HOME``, so a
command that started Spark before checking its config would die of the Java gateway instead of
printing the expected message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
import requests

from bridge.amqp.client import Connection
from bridge.black.management import ManagementClient
from bridge.crypto.keys import init_keys
from bridge.errors import ManagementApiError
from tests.conftest import AUTH, MGMT, Vhost
from tests.unit.test_black_dirs import refused_dir

pytestmark = [pytest.mark.gpg]

DIODE = [sys.executable, "-m", "bridge.cli"]
NO_JAVA = "/nonexistent/diode-test-no-java"
SPARK_STARTED = ("JAVA_GATEWAY", "Java gateway", NO_JAVA)
"""What the output holds if a command reached ``get_spark`` (the JVM cannot start)."""


def _cfg(
    work: Path,
    black: str,
    recipients: list[str],
    amqp: str,
    extra: str = "",
    home: str = "keys/black",
    mgmt: str = "http://127.0.0.1:9",
) -> Path:
    p = work / "d.toml"
    p.write_text(
        f'[link]\nblack_signers = ["{black}"]\n'
        f'[[channels]]\nname = "c1"\nrecipients = {json.dumps(recipients)}\n'
        f'[black]\namqp_url = "{amqp}"\ngnupg_home = "{home}"\nsigning_key = "{black}"\n'
        f'management_url = "{mgmt}"\n{extra}'
    )
    p.chmod(0o600)  # it holds secrets (the AMQP password): only its owner may read it
    return p


def _run(
    *args: str,
    timeout: float = 120,
    env_extra: dict[str, str] | None = None,
    log_format: tuple[str, ...] = ("--log-format", "text"),
) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIODE__", "DIODE_CONFIG"))}
    env = {k: v for k, v in env.items() if k not in ("DIODE_LOG_LEVEL", "DIODE_LOG_FORMAT")}
    env["JAVA_HOME"] = NO_JAVA
    env.update(env_extra or {})
    r = subprocess.run(
        [*DIODE, *log_format, *args],
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang guard, not a measurement
        check=False,
        env=env,
    )
    out = r.stdout + r.stderr
    assert not any(s in out for s in SPARK_STARTED), f"{args} started Spark first:\n{out}"
    assert "Traceback" not in out, out
    return r.returncode, out


def test_unknown_key(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        list(inv.red_fprs.values()),
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        extra="trigger_second = 5\n",
    )
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code == 2, out
        assert "black.trigger_second" in out and "unknown key" in out, out
        assert "diode.example.toml" in out, out


def test_removed_stream_keys_are_rejected(short_tmp: Path) -> None:
    """Keys of the stream-queue design are gone: a config still holding one is an error."""
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        list(inv.red_fprs.values()),
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        extra='stream_prefix = "diode."\nread_partitions = 2\n',
    )
    code, out = _run("check", "--config", str(p))
    assert code == 2, out
    assert "unknown key" in out, out
    assert "black.stream_prefix" in out or "black.read_partitions" in out, out


def test_missing_recipient_key(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    stranger = "ABCDEF0123456789ABCDEF0123456789ABCDEF01"
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        [*inv.red_fprs.values(), stranger],
        "amqp://guest:guest@127.0.0.1:5672/%2F",
    )
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code != 0
        assert stranger in out and "c1" in out and "import" in out, out
    # nothing of the run was set up: it stopped before the mirror, the spool and Spark
    assert not (short_tmp / "black" / "checkpoint").exists()
    assert not (short_tmp / "black" / "spool").exists()


def test_unreachable_broker(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp, inv.black_fpr, list(inv.red_fprs.values()), "amqp://guest:s3cret@127.0.0.1:1/%2F"
    )
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"], ["mirror"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code != 0, out
        assert "127.0.0.1:1" in out and "amqp_url" in out, out
        assert "s3cret" not in out, "credentials must never be printed"
    assert not (short_tmp / "black" / "checkpoint").exists()


def test_config_with_secrets_readable_by_others(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        list(inv.red_fprs.values()),
        "amqp://guest:s3cret@127.0.0.1:5672/%2F",
    )
    p.chmod(0o644)
    code, out = _run("check", "--config", str(p))
    assert code == 1, out
    assert "chmod 600" in out and str(p) in out and "black.amqp_url" in out, out
    assert "s3cret" not in out, "credentials must never be printed"


def test_udp_commands_fail_fast_with_a_fix(short_tmp: Path) -> None:
    base = '[[channels]]\nname = "u1"\nencrypt = false\ntransport = "udp"\n[udp]\nkey_file = "k"\n'
    p = short_tmp / "u.toml"
    p.write_text(base)
    for cmd in (["udp", "send"], ["udp", "receive"]):
        code, out = _run(*cmd, "--config", str(p), "--timeout", "1")
        assert code == 2 and "diode udp keygen" in out, out
    key = short_tmp / "k"
    code, out = _run("udp", "keygen", "--out", str(key))
    assert code == 0 and key.stat().st_mode & 0o077 == 0, out
    key.chmod(0o640)
    code, out = _run("udp", "receive", "--config", str(p), "--timeout", "1")
    assert code == 2 and "chmod 600" in out, out
    key.chmod(0o600)
    p.write_text(base + '[udp.receive]\nbind = "0.0.0.0:47100"\n')
    code, out = _run("udp", "receive", "--config", str(p), "--timeout", "1")
    assert code == 2 and "every interface" in out, out
    p.write_text(base.replace('transport = "udp"', 'transport = "file"'))
    code, out = _run("udp", "send", "--config", str(p), "--timeout", "1")
    assert code == 2 and 'no channel has transport = "udp"' in out, out


GUEST = "amqp://guest:guest@127.0.0.1:5672/%2F"


# ---------------------------------------------------------------------------- A: red replay
def _red_cfg(work: Path, url: str) -> Path:
    p = work / "r.toml"
    p.write_text(
        '[[channels]]\nname = "c1"\nencrypt = false\n'
        f'[red]\ndelta_engine = "delta-rs"\n[red.replay]\namqp_url = "{url}"\n'
        'approved = ["x.orders"]\npoll_seconds = 0.1\n'
    )
    p.chmod(0o600)
    return p


def test_red_replay_refused_login_or_vhost_exits_2_with_the_fix(
    short_tmp: Path, red_vhost: Vhost
) -> None:
    wrong_pw = red_vhost.amqp_url.replace("guest:guest@", "guest:n0t-it@")
    code, out = _run("red", "replay", "--config", str(_red_cfg(short_tmp, wrong_pw)),
                     "--until-caught-up", "--timeout", "8")  # fmt: skip
    assert code == 2, out
    assert "red.replay.amqp_url" in out and "ACCESS_REFUSED" in out and "password" in out, out
    assert "n0t-it" not in out, "credentials must never be printed"
    no_vhost = red_vhost.amqp_url.rsplit("/", 1)[0] + "/no-such-vhost-" + red_vhost.name[-6:]
    code, out = _run(
        "red", "replay", "--config", str(_red_cfg(short_tmp, no_vhost)), "--timeout", "8"
    )
    assert code == 2, out
    assert "red.replay.amqp_url" in out and "create the vhost" in out, out


def test_red_replay_until_caught_up_that_did_not_catch_up_exits_1(short_tmp: Path) -> None:
    """A broker that is merely down is retried (logged at warning); a run asked to catch up
    that ends before it did is a failure for the scheduler that started it."""
    from bridge.protocol.exchange import ExchangeDecl
    from bridge.protocol.rows import build_rows
    from bridge.red.tables import RedTables

    tables = RedTables(short_tmp / "red" / "tables", "delta-rs")
    tables.ensure()
    decl = ExchangeDecl("x.orders", "topic")
    batch = build_rows("c1", [1], ["x.orders"], ["rk"], [False], [b"\x00\x00"], [b"m"],
                       {"x.orders": decl})  # fmt: skip
    t = pa.Table.from_batches([batch])
    now = datetime.now(UTC)
    for name, col in (
        ("bundle_seq", pa.array([1], pa.int64())),
        ("bundle_id", pa.array(["b1"])),
        ("land_seq", pa.array([1], pa.int64())),
        ("landed_at", pa.array([now], pa.timestamp("us", tz="UTC"))),
        ("landed_date", pa.array([now.date()], pa.date32())),
    ):
        t = t.append_column(name, col)
    assert tables.append("messages", t, app_id="diode-red", version=1)
    p = _red_cfg(short_tmp, "amqp://guest:guest@127.0.0.1:1/%2F")
    code, out = _run("red", "replay", "--config", str(p), "--until-caught-up", "--timeout", "2")
    assert code == 1, out
    assert '"caught_up": false' in out and "did not catch up (--timeout 2 s passed)" in out, out
    assert "WARNING" in out and "keeps retrying" in out and "127.0.0.1:1" in out, out


# ---------------------------------------------------------------------------- E: URL and places
@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("amqp://guest:s3cret@127.0.0.1:5672/%2F?heartbeat=30", "query parameters"),
        ("http://guest:s3cret@127.0.0.1:5672/%2F", "scheme 'http'"),
    ],
)
def test_check_and_black_run_refuse_an_amqp_url_the_tap_refuses(
    short_tmp: Path, url: str, words: str
) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), url, "discover = false\n")
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code == 2, out
        assert "black.amqp_url" in out and words in out, out
        assert "s3cret" not in out, "credentials must never be printed"
    assert not (short_tmp / "black").exists(), "black run created its directories first"


def test_check_refuses_staging_or_linked_archive_on_another_file_system(short_tmp: Path) -> None:
    if os.stat("/dev/shm").st_dev == os.stat(short_tmp).st_dev:
        pytest.skip("/dev/shm is not another file system here")
    inv = init_keys(short_tmp / "keys")
    other = Path(tempfile.mkdtemp(prefix="dt", dir="/dev/shm"))
    try:
        base = "discover = false\n"
        p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), GUEST,
                 base + f'staging_dir = "{other}/staging"\n')  # fmt: skip
        code, out = _run("check", "--config", str(p))
        assert code == 2, out
        assert "black.staging_dir" in out and "file system" in out, out
        p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), GUEST,
                 base + f'archive_mode = "link"\narchive = "{other}/archive"\n')  # fmt: skip
        code, out = _run("check", "--config", str(p))
        assert code == 2, out
        assert 'archive_mode = "link"' in out and "another file system" in out, out
        assert not (other / "staging").exists() and not (other / "archive").exists()
        p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), GUEST, base)
        code, out = _run("check", "--config", str(p))
        assert code == 0, out
    finally:
        shutil.rmtree(other, ignore_errors=True)


# ---------------------------------------------------------------------------- F: metrics port
METRICS_COMMANDS = [
    ["black", "run"],
    ["red", "run"],
    ["red", "replay"],
    ["udp", "send"],
    ["udp", "receive"],
]


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_a_metrics_port_out_of_range_is_refused_at_option_parsing(
    short_tmp: Path, port: str
) -> None:
    for cmd in METRICS_COMMANDS:
        code, out = _run(*cmd, "--config", str(short_tmp / "none.toml"), "--metrics-port", port)
        assert code == 2, (cmd, out)
        assert "--metrics-port" in out and "1<=x<=65535" in out, (cmd, out)


def test_a_metrics_port_in_use_fails_before_black_run_changes_the_broker(
    short_tmp: Path, black_vhost: Vhost
) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), black_vhost.amqp_url,
             "discover = false\n")  # fmt: skip
    red = _red_cfg(short_tmp, GUEST)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        for cmd, cfg in ((["black", "run", "--trigger", "available-now"], p),
                         (["red", "replay", "--until-caught-up"], red)):  # fmt: skip
            code, out = _run(*cmd, "--config", str(cfg), "--metrics-port", port)
            assert code == 2, (cmd, out)
            assert f"--metrics-port {port}" in out and "another process" in out, (cmd, out)
    mc = ManagementClient(black_vhost.management_url, "guest", "guest")
    try:
        with pytest.raises(ManagementApiError, match="does not exist"):
            mc.queue_info(black_vhost.name, "diode.mirror.c1")  # not declared
    finally:
        mc.close()
    assert not (short_tmp / "black").exists(), "black run created its directories first"


# ---------------------------------------------------------------------------- G: passphrase env
def test_keys_init_never_echoes_a_passphrase_given_as_the_variable_name(short_tmp: Path) -> None:
    home = short_tmp / "home"
    code, out = _run("keys", "init", "--side", "black", "--home", str(home),
                     "--passphrase-env", "hunter2 is my secret")  # fmt: skip
    assert code == 2, out
    assert "hunter2" not in out and "--passphrase-env" in out and "NAME" in out, out
    assert not home.exists()


# ---------------------------------------------------------------------------- H: log settings
def test_bad_log_level_or_format_exits_2_with_the_accepted_values(short_tmp: Path) -> None:
    code, out = _run("--log-level", "BOGUS", "udp", "status", "--config", "x.toml")
    assert code == 2 and "--log-level = 'BOGUS'" in out and "DEBUG, INFO, WARNING" in out, out
    code, out = _run("udp", "status", "--config", "x.toml", log_format=(),
                     env_extra={"DIODE_LOG_LEVEL": "verbose"})  # fmt: skip
    assert code == 2 and "DIODE_LOG_LEVEL = 'verbose'" in out and "ERROR" in out, out
    code, out = _run("udp", "status", "--config", "x.toml", log_format=(),
                     env_extra={"DIODE_LOG_FORMAT": "xml"})  # fmt: skip
    assert code == 2 and "DIODE_LOG_FORMAT = 'xml'" in out and "json, text" in out, out


# ---------------------------------------------------------------------------- I: keys, exit 2
def test_check_reports_a_missing_gnupg_home_without_creating_it(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), GUEST,
             "discover = false\n", home="keys/nowhere")  # fmt: skip
    for cmd in (["check"], ["keys", "check", "--side", "black"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code == 2, (cmd, out)
        assert "black.gnupg_home" in out and "does not exist" in out, out
        assert "diode keys init --side black" in out, out
        assert not (short_tmp / "keys" / "nowhere").exists(), f"{cmd} created the GnuPG home"


def test_missing_or_unusable_keys_are_configuration_errors(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    stranger = "ABCDEF0123456789ABCDEF0123456789ABCDEF01"
    p = _cfg(short_tmp, inv.black_fpr, [*inv.red_fprs.values(), stranger], GUEST,
             "discover = false\n")  # fmt: skip
    code, out = _run("check", "--config", str(p))
    assert code == 2 and stranger in out, out
    # the red home holds no black signing key: black's key is missing there
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), GUEST,
             "discover = false\n", home="keys/red")  # fmt: skip
    for cmd in (["check"], ["keys", "check", "--side", "black"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code == 2, (cmd, out)
        assert inv.black_fpr in out, out


# ---------------------------------------------------------------------------- J: relay help
def test_udp_relay_help_shows_the_relays_options() -> None:
    for flag in ("--help", "-h"):
        code, out = _run("udp", "relay", flag)
        assert code == 0, out
        assert "--listen" in out and "--forward" in out and "--loss" in out, out


def test_red_replay_service_stops_gracefully_on_sigterm(short_tmp: Path) -> None:
    """systemd stops a service with SIGTERM: the publisher finishes its pass, prints its
    summary and exits 0 (it died with 143 and no summary)."""
    from bridge.red.tables import RedTables

    RedTables(short_tmp / "red" / "tables", "delta-rs").ensure()
    p = _red_cfg(short_tmp, "amqp://guest:guest@127.0.0.1:1/%2F")  # down: it keeps retrying
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIODE__", "DIODE_CONFIG"))}
    log = short_tmp / "stderr.txt"
    with open(log, "w") as err_file:  # noqa: PTH123
        proc = subprocess.Popen(
            [*DIODE, "--log-format", "text", "red", "replay", "--config", str(p)],
            stdout=subprocess.PIPE, stderr=err_file, text=True, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while "keeps retrying" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        time.sleep(1.5)  # past the start-up warning: publishing passes (retrying) have begun
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["caught_up"] is False, out


# ---------------------------------------------------------------------------- K: writable, login
def test_check_and_black_run_refuse_an_outbox_black_cannot_write_before_any_drain(
    short_tmp: Path, black_vhost: Vhost
) -> None:
    """It was found only when the first bundle failed to seal, after the taps had drained the
    broker into the spool and Spark had started (exit 1, no fix)."""
    inv = init_keys(short_tmp / "keys")
    outbox = short_tmp / "outbox"
    outbox.mkdir()
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), black_vhost.amqp_url,
             f'discover = false\noutbox = "{outbox}"\n')  # fmt: skip
    with refused_dir(outbox) as why:
        for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
            code, out = _run(*cmd, "--config", str(p))
            assert code == 2, (cmd, out)
            assert f"black.outbox {outbox} is not writable by the user running black" in out, out
            assert f"(uid {os.getuid()}; {why}" in out, out
            assert "give that user write access (e.g. the mover's group, mode 0770)" in out, out
    assert not (short_tmp / "black").exists(), "no tap ran, nothing was spooled"


@pytest.fixture
def mgmt_user(black_vhost: Vhost) -> Iterator[tuple[str, str]]:
    """A management user of this test's own ('monitoring' tag, no permissions), deleted
    afterwards."""
    user, password = f"diode-test-mgmt-{black_vhost.name[-10:]}", "right-pw"
    url = f"{MGMT}/api/users/{user}"
    requests.put(
        url, auth=AUTH, json={"password": password, "tags": "monitoring"}, timeout=10
    ).raise_for_status()
    try:
        yield user, password
    finally:
        requests.delete(url, auth=AUTH, timeout=10)


def test_a_refused_management_login_exits_2_naming_the_environment_override(
    short_tmp: Path, black_vhost: Vhost, mgmt_user: tuple[str, str]
) -> None:
    user, password = mgmt_user
    inv = init_keys(short_tmp / "keys")
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), black_vhost.amqp_url,
             f'management_user = "{user}"\n', mgmt=MGMT)  # fmt: skip
    wrong = {"DIODE__BLACK__MANAGEMENT_PASSWORD": "n0t-the-pw"}
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
        code, out = _run(*cmd, "--config", str(p), env_extra=wrong)
        assert code == 2, (cmd, out)
        assert f"refused user {user!r} (401: 'Login failed')" in out, out
        assert "black.management_password (config file or DIODE__BLACK__MANAGEMENT_PASSWORD)" in out
        assert "n0t-the-pw" not in out, "credentials must never be printed"
    # the right password, but no permissions on the vhost: the run's exchange listing is refused
    code, out = _run("black", "run", "--trigger", "available-now", "--config", str(p),
                     env_extra={"DIODE__BLACK__MANAGEMENT_PASSWORD": password})  # fmt: skip
    assert code == 2, out
    assert "not authorised to access virtual host" in out and "set_permissions" in out, out


def test_check_warns_of_a_named_exchange_that_does_not_exist_and_an_unbound_direct_one(
    short_tmp: Path, black_vhost: Vhost
) -> None:
    """`diode check` said ok for a channel naming an exchange the vhost lacks (a typo); only
    `diode mirror` said it was skipped. It now warns (exit 0: the producer may declare it
    later, and the running mirror picks it up)."""
    inv = init_keys(short_tmp / "keys")
    conn = Connection.open(black_vhost.amqp_url)
    try:
        conn.channel().exchange_declare("op.orders", "topic", durable=True)
        conn.channel().exchange_declare("op.direct", "direct", durable=True)
    finally:
        conn.close()
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), black_vhost.amqp_url,
             mgmt=MGMT)  # fmt: skip
    text = p.read_text().replace(
        'name = "c1"\n', 'name = "c1"\nexchanges = ["op.orders", "op.orderz", "op.direct"]\n'
    )
    p.write_text(text)
    code, out = _run("check", "--config", str(p))
    assert code == 0, out
    assert "'op.orderz': named in channels[c1] but not found in the vhost" in out, out
    assert "direct exchange 'op.direct' is not mirrored" in out, out
    assert "op.orders" not in out.replace("op.orderz", ""), out  # mirrored: nothing to say


def test_check_never_warns_about_blacks_own_dead_letter_exchange(
    short_tmp: Path, black_vhost: Vhost
) -> None:
    """After the first `diode mirror` (or run) black's dead-letter exchange, a direct one, is in
    the vhost: `diode check` told to list its routing keys for every channel that mirrors all
    exchanges, though black never mirrors it (`diode mirror` left it out)."""
    inv = init_keys(short_tmp / "keys")
    conn = Connection.open(black_vhost.amqp_url)
    try:
        conn.channel().exchange_declare("diode.mirror.dead-letter", "direct", durable=True)
    finally:
        conn.close()
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), black_vhost.amqp_url,
             mgmt=MGMT)  # fmt: skip
    code, out = _run("check", "--config", str(p))
    assert code == 0, out
    assert "RabbitMQ" in out  # the case: the check listed the vhost's exchanges
    assert "dead-letter" not in out, out


def test_a_refused_amqp_login_names_the_environment_override(short_tmp: Path) -> None:
    """The AMQP URL may come from DIODE__BLACK__AMQP_URL: the refusal says so (the file may be
    right while the environment overrides it)."""
    inv = init_keys(short_tmp / "keys")
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()),
             "amqp://guest:guest@127.0.0.1:5672/%2F", "discover = false\n")  # fmt: skip
    wrong = {"DIODE__BLACK__AMQP_URL": '"amqp://guest:n0t-it@127.0.0.1:5672/%2F"'}
    code, out = _run("check", "--config", str(p), env_extra=wrong)
    assert code == 2, out
    assert "refused the login" in out and "(config file or DIODE__BLACK__AMQP_URL)" in out, out
    assert "n0t-it" not in out, "credentials must never be printed"
