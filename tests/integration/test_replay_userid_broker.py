"""Red, replay: a landed `user-id` the replay user may not publish, and stopped exchanges.

A producer on black publishes as its own user with ``user-id`` set (the black broker accepts
that: it is the connection's user); red's replay user is another one. RabbitMQ refuses such a
publish (406, channel closed) unless the replay user has the ``impersonator`` tag. The replay
used to stop the exchange at that row for good (retried every minute, failing the same way)
and still say ``caught_up: true``. Now: with the tag the bytes go out as landed; without it the
row is skipped, audited (``replay_failed`` kind ``user_id``) and the exchange goes on; a
stopped exchange is never "caught up" (the CLI exits 1 naming it).

Users are made with ``rabbitmqctl add_user`` (permissions on the test's own vhosts only) and
deleted afterwards; nothing broker-wide is changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bridge.amqp.client import Connection
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.properties import Properties, decode_properties, encode_properties
from bridge.protocol.properties import field_table as ft
from bridge.red.replay import Replayer, load_progress, read_live
from bridge.red.tables import RedTables
from tests.conftest import AMQP_HOST, Vhost
from tests.integration.test_red_replay import (
    Consumer,
    body_id,
    land,
    make_cfg,
    metric,
    rows,
)

pytestmark = pytest.mark.broker

UID_X = ExchangeDecl("x.uid", "fanout", True)
GOOD_X = ExchangeDecl("x.good", "fanout", True)


def _ctl(*args: str) -> None:
    try:
        out = subprocess.run(
            ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"test users need rabbitmqctl on the broker's host: {e}")
    if out.returncode:
        if args[0] == "add_user":
            pytest.skip(f"rabbitmqctl add_user failed here: {out.stderr.strip()}")
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {out.stderr.strip() or out.stdout}")


@contextmanager
def broker_user(
    vhost: str, *tags: str, write: str = ".*", prefix: str = "diode-test-uid"
) -> Iterator[tuple[str, str]]:
    """A user of our own with permissions on ``vhost`` only (``write``: its write pattern) and
    ``tags``; yields its name and AMQP URL, deleted afterwards."""
    name, password = f"{prefix}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    _ctl("add_user", name, password)
    try:
        _ctl("set_permissions", "-p", vhost, name, ".*", write, ".*")
        _ctl("set_user_tags", name, *tags)
        q = urllib.parse.quote(vhost, safe="")
        yield name, f"amqp://{name}:{password}@{AMQP_HOST}:5672/{q}"
    finally:
        _ctl("delete_user", name)


@pytest.fixture
def alice_props(black_vhost: Vhost) -> bytes:
    """Property bytes as black's broker delivered them: published by user alice with
    user-id alice (its own name, so the black broker took it)."""
    with broker_user(black_vhost.name, prefix="diode-test-alice") as (alice, url):
        admin = Connection.open(black_vhost.amqp_url, client_name="test-black-admin")
        try:
            ch = admin.channel()
            q = ch.queue_declare("", exclusive=True).queue
            producer = Connection.open(url, client_name="test-alice")
            try:
                props = Properties(headers=ft({"k": "v"}), delivery_mode=2, user_id=alice)
                pch = producer.channel()
                pch.confirm_select()
                pch.publish("", q, encode_properties(props), b"from alice")
                while not producer.poll(0.2).confirms:
                    pass
            finally:
                producer.close()
            ch.basic_consume(q, no_ack=True)
            got = []
            while not got:
                got = admin.poll(0.2).deliveries
        finally:
            admin.close()
    raw = got[0].properties_raw
    assert decode_properties(raw).user_id == alice
    return raw


def _land_scenario(tables: RedTables, alice: bytes, relay: str) -> bytes:
    """x.uid: seq 0 plain, 1 alice's user-id, 2 plain, 3 the replay user's own user-id;
    x.good: 20 plain rows. Returns the property bytes of seq 3."""
    own = encode_properties(Properties(delivery_mode=2, user_id=relay))
    land(
        tables, 1, rows("c1", [0], UID_X), rows("c1", [1], UID_X, props=alice),
        rows("c1", [2], UID_X), rows("c1", [3], UID_X, props=own), rows("c2", range(20), GOOD_X),
    )  # fmt: skip
    return own


def _declare(url: str) -> None:
    admin = Connection.open(url, client_name="test-red-admin")
    try:
        for x in (UID_X, GOOD_X):
            admin.channel().exchange_declare(x.name, x.type, durable=True)
    finally:
        admin.close()


@pytest.mark.parametrize("probe", ["probed", "probe-refused"])
def test_without_impersonator_another_users_user_id_is_skipped_and_audited_not_stalled(
    tmp_path: Path,
    tables: RedTables,
    red_vhost: Vhost,
    alice_props: bytes,
    probe: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The replay user lacks the tag. ``probed``: the start probe finds out, the row is never
    sent. ``probe-refused``: the user may not write amq.default, so the probe cannot tell; the
    broker's refusal of the row itself switches the connection to skipping. Either way the row
    is skipped (still landed) and audited naming channel, seq and the fix, the rest of its
    exchange and the other exchange are confirmed, and nothing is retried."""
    write = ".*" if probe == "probed" else r"^(?!amq\.default$).*"
    caplog.set_level("INFO", logger="bridge.red.replay")
    _declare(red_vhost.amqp_url)
    with broker_user(red_vhost.name, write=write) as (relay, url):
        own = _land_scenario(tables, alice_props, relay)
        cu, cg = Consumer(red_vhost.amqp_url, UID_X.name), Consumer(red_vhost.amqp_url, GOOD_X.name)
        cfg = make_cfg(tmp_path, url, [UID_X.name, GOOD_X.name])
        before = metric("bridge_red_replay_errors_total", exchange=UID_X.name, kind="user_id")
        try:
            s = Replayer(cfg, retry_seconds=3600).run(until_caught_up=True, timeout=60)
            (ev,) = [e for e in s.events if e["event"] == "replay_failed"]
            assert json.loads(ev["detail"])["kind"] == "user_id", ev  # not a stopped exchange
            assert s.caught_up and not s.stopped, s.to_json()
            assert (ev["exchange"], ev["channel"], ev["seq_first"], ev["seq_last"]) == (
                UID_X.name, "c1", 1, 1)  # fmt: skip
            detail = json.loads(ev["detail"])
            assert (detail["kind"], detail["rows"], detail["land_seq"]) == ("user_id", 1, 1)
            reason = ev["reason"]
            assert "seq 1" in reason and "skipped" in reason and "still landed" in reason
            assert "user-id property is 'diode-test-alice-" in reason and repr(relay) in reason
            assert f"rabbitmqctl set_user_tags {relay} impersonator" in reason, reason
            assert s.skipped == {"user_id": 1} and s.to_json()["skipped"] == {"user_id": 1}
            assert metric("bridge_red_replay_errors_total", exchange=UID_X.name,
                          kind="user_id") == before + 1  # fmt: skip
            got = cu.collect(3)
            got = cu.quiet(0.3)
            assert sorted({body_id(m)[1] for m in got}) == [0, 2, 3]  # 0 again after a refusal
            (mine,) = [m for m in got if body_id(m)[1] == 3]
            assert mine.properties_raw == own  # its own user-id: published byte for byte
            assert len(cg.collect(20)) == 20
            assert load_progress(tmp_path / "state")[UID_X.name].seq == 3
            assert read_live(tmp_path / "state")["may_impersonate"] is False
            said = [r.getMessage() for r in caplog.records]
            refused = [m for m in said if "refused a publish for its user-id" in m]
            if probe == "probed":  # known before publishing: the row was never sent
                assert any("may not publish another user's user-id" in m for m in said), said
                assert not refused, said
            else:  # unknown at start; the broker's refusal of row 1 told
                assert any("found at the first row carrying one" in m for m in said), said
                assert len(refused) == 1, said
            again = Replayer(cfg).run(until_caught_up=True, timeout=20)
            assert again.caught_up and again.published == 0 and not again.events, again
        finally:
            cu.close()
            cg.close()


def test_with_impersonator_the_user_id_is_replayed_byte_for_byte(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, alice_props: bytes
) -> None:
    _declare(red_vhost.amqp_url)
    with broker_user(red_vhost.name, "impersonator") as (relay, url):
        own = _land_scenario(tables, alice_props, relay)
        cu = Consumer(red_vhost.amqp_url, UID_X.name)
        cfg = make_cfg(tmp_path, url, [UID_X.name, GOOD_X.name])
        try:
            s = Replayer(cfg, retry_seconds=3600).run(until_caught_up=True, timeout=60)
            assert s.caught_up and s.confirmed == 24 and not s.errors and not s.skipped, s
            got = {body_id(m)[1]: m for m in cu.collect(4)}
            assert sorted(got) == [0, 1, 2, 3]
            assert got[1].properties_raw == alice_props and got[3].properties_raw == own
            assert decode_properties(got[1].properties_raw).user_id != relay
            assert read_live(tmp_path / "state")["may_impersonate"] is True
        finally:
            cu.close()


def _stopped_scenario(tmp_path: Path, tables: RedTables, red_vhost: Vhost) -> None:
    """'clash' exists on red as a topic exchange but landed as fanout: its declaration is
    refused (406), so it stops; 'ok' replays."""
    admin = Connection.open(red_vhost.amqp_url, client_name="test-red-admin")
    try:
        admin.channel().exchange_declare("clash", "topic", durable=True)
    finally:
        admin.close()
    land(tables, 1, rows("c1", range(5), ExchangeDecl("clash", "fanout", True)),
         rows("c2", range(10), ExchangeDecl("ok", "fanout", True)))  # fmt: skip


def test_a_stopped_exchange_is_not_caught_up_and_the_cli_exits_1_naming_it(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    """The run still ends once the rest is confirmed (it does not wait for the retry), but
    says which exchange is stopped and why; it used to say caught_up: true and exit 0."""
    _stopped_scenario(tmp_path, tables, red_vhost)
    cfg = make_cfg(tmp_path, red_vhost.amqp_url, ["clash", "ok"])
    s = Replayer(cfg, retry_seconds=3600).run(until_caught_up=True, timeout=120)
    assert not s.caught_up and s.seconds < 120, s.to_json()  # ended as settled, not timed out
    assert list(s.stopped) == ["clash"] and "406" in s.stopped["clash"], s.stopped
    assert s.exchanges["ok"]["confirmed"] == 10
    out = s.to_json()
    assert out["caught_up"] is False and "clash" in out["stopped"]

    conf = tmp_path / "r.toml"
    conf.write_text(
        '[[channels]]\nname = "c1"\nencrypt = false\n'
        f'[red]\ndelta_engine = "delta-rs"\nstate_dir = "{tmp_path / "state"}"\n'
        f'tables_dir = "{tmp_path / "tables"}"\n[red.replay]\namqp_url = "{red_vhost.amqp_url}"\n'
        'approved = ["clash", "ok"]\npoll_seconds = 0.1\n'
    )
    conf.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIODE__", "DIODE_CONFIG"))}
    r = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "--log-format", "text", "red", "replay",
         "--config", str(conf), "--until-caught-up", "--timeout", "120"],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["caught_up"] is False and "406" in summary["stopped"]["clash"], summary
    assert "error: the replay did not catch up (exchange 'clash' is stopped:" in r.stderr
    assert "PRECONDITION_FAILED" in r.stderr and "§15.3" in r.stderr, r.stderr
