"""Red, replay: `diode red declare` declares landed exchanges on the red broker as black had
them, publishing nothing, so that queues are bound before the replay's first publish and
nothing comes back unroutable. Real broker (a red vhost), real Delta tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.amqp.client import Connection
from bridge.cli import cli
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.rows import build_rows
from bridge.red.replay import Replayer
from bridge.red.replay_declare import declare_exchanges, landed_declarations
from bridge.red.tables import RedTables
from tests.conftest import Vhost
from tests.integration.test_red_replay import PLAIN, Consumer, land, make_cfg, rows

pytestmark = pytest.mark.broker


def _config_file(tmp: Path, url: str) -> Path:
    p = tmp / "red.toml"
    p.write_text(
        f"""
[[channels]]
name = "c1"
encrypt = false

[red]
state_dir = "{tmp / "state"}"
tables_dir = "{tmp / "tables"}"

[red.replay]
amqp_url = "{url}"
"""
    )
    p.chmod(0o600)
    return p


def test_declared_first_then_bound_then_approved_nothing_is_unroutable(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    url = red_vhost.amqp_url
    orders = ExchangeDecl("orders", "topic", True, False, False, {"alternate-exchange": "ae"})
    land(tables, 1, rows("c1", range(5), orders))
    land(tables, 2, rows("c1", range(5, 12), orders))
    found = landed_declarations(tmp_path / "tables" / "messages")
    assert found["orders"][:4] == ("topic", True, False, False)
    got = CliRunner().invoke(
        cli, ["red", "declare", "--config", str(_config_file(tmp_path, url)), "--json"]
    )
    assert got.exit_code == 0, got.output
    (rep,) = json.loads(got.output)
    assert rep["exchange"] == "orders" and rep["outcome"] == "declared" and rep["type"] == "topic"
    # the operator binds a queue now, before anything is published, then approves
    c = Consumer(url, "orders", "#")
    try:
        s = Replayer(make_cfg(tmp_path, url, ["orders"])).run(until_caught_up=True, timeout=30)
        assert s.caught_up and s.to_json()["unroutable"] == 0, s.to_json()
        assert len(c.collect(12)) == 12
    finally:
        c.close()


def test_each_kind_of_exchange_gets_its_own_outcome(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    url = red_vhost.amqp_url
    with Connection.open(url) as admin:
        admin.channel().exchange_declare("clash", "topic", durable=True)  # red has another type
    land(
        tables, 1,
        rows("c1", [0], ExchangeDecl("clash", "fanout", True)),
        rows("c1", [1], ExchangeDecl("inner", "topic", True, False, True)),
        rows("c1", [2], ExchangeDecl("weird", "x-no-such-type", True)),
        rows("c1", [3], ExchangeDecl("amq.topic", "topic", True)),
        rows("c1", [4], ExchangeDecl("amq.nowhere", "topic", True)),
        rows("c1", [6], ExchangeDecl("fine", "direct", True)),
    )  # fmt: skip
    land(tables, 2, build_rows("c1", [7], ["mystery"], ["rk"], [False], [PLAIN], [b"x"], {}))
    land(tables, 3, rows("c1", [8], ExchangeDecl("fine", "topic", True)))  # the last one wins
    messages = tmp_path / "tables" / "messages"
    named = declare_exchanges(messages, url, ["fine", "clash", "never-landed"])
    done = {d.exchange: d for d in named}
    assert set(done) == {"fine", "clash", "never-landed"}  # only those named
    assert done["never-landed"].outcome == "not_landed"
    everything = {d.exchange: d for d in declare_exchanges(messages, url)}
    outcome = {n: d.outcome for n, d in everything.items()}
    assert outcome == {
        "clash": "refused", "inner": "declared", "weird": "refused", "amq.topic": "exists",
        "amq.nowhere": "refused", "fine": "declared", "mystery": "refused",
    }, everything  # fmt: skip
    assert "406" in everything["clash"].why and "another type" in everything["clash"].why
    assert "503" in everything["weird"].why  # the connection was closed: the rest went on
    assert "internal" in everything["inner"].why
    assert everything["fine"].decl is not None and everything["fine"].decl[0] == "topic"
    assert "did not know its type" in everything["mystery"].why
    with Connection.open(url) as c:  # declared for real, as landed
        c.channel().exchange_declare("fine", "direct", durable=True, passive=True)
        c.channel().exchange_declare("inner", "topic", passive=True)
