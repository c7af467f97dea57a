"""Red, replay rewind: `diode red rewind` moves an exchange's replay progress back.

Real Delta tables (rows appended as the landing does, ``test_red_replay.land``), the real replay
publisher into a real red vhost with its real audit sink, the command as an operator runs it
(in a process of its own against a running publisher and for the first rewind, in this one
otherwise). What is checked on a real queue: after a rewind the replay publishes again, byte
for byte and in order, exactly the rows from the rewind point on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from deltalake import DeltaTable

from bridge.amqp.client import Connection, Delivery
from bridge.cli import cli
from bridge.protocol.exchange import ExchangeDecl
from bridge.red import replay as rp
from bridge.red.replay import Replayer, audit_sink, load_progress
from bridge.red.tables import RedTables
from tests.conftest import Vhost
from tests.integration.test_red_replay import (
    HOLD_X,
    NOW,
    RICH,
    Consumer,
    body_id,
    hold_consumer,
    land,
    make_cfg,
    rows,
    save_bundles,
)
from tests.integration.test_replay_userid_broker import (  # noqa: F401 - fixtures
    GOOD_X,
    UID_X,
    _ctl,
    _declare,
    _land_scenario,
    alice_props,
    broker_user,
)

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[2]
RW_X = ExchangeDecl("x.rw", "topic", True)


@pytest.fixture
def admin(red_vhost: Vhost) -> Iterator[Connection]:
    c = Connection.open(red_vhost.amqp_url, client_name="test-admin")
    yield c
    c.close()


def conf_file(tmp: Path, url: str, approved: list[str]) -> Path:
    conf = tmp / "r.toml"
    conf.write_text(
        '[[channels]]\nname = "c1"\nencrypt = false\n'
        f'[red]\ndelta_engine = "delta-rs"\nstate_dir = "{tmp / "state"}"\n'
        f'tables_dir = "{tmp / "tables"}"\n[red.replay]\namqp_url = "{url}"\n'
        f"approved = {json.dumps(approved)}\n"
    )
    conf.chmod(0o600)  # it holds a password
    return conf


def rewind(
    conf: Path, *args: str, code: int = 0, process: bool = False
) -> tuple[dict[str, Any] | None, str]:
    """``diode red rewind``: its JSON report (exit 0) and stderr; in a process of its own with
    ``process`` (as an operator runs it), else in this one (faster)."""
    argv = ["--log-level", "WARNING", "red", "rewind", "--config", str(conf), *args]
    if process:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DIODE__", "DIODE_"))}
        r = subprocess.run(
            [sys.executable, "-m", "bridge.cli", *argv], capture_output=True, text=True,
            timeout=120, check=False, cwd=REPO, env=env,
        )  # fmt: skip
        got, out, err = r.returncode, r.stdout, r.stderr
    else:
        res = CliRunner().invoke(cli, argv)
        got, out, err = res.exit_code, res.stdout, res.stderr
    assert got == code, out + err
    return (json.loads(out) if code == 0 else None), err


def audit_of(tmp: Path, event: str) -> list[dict[str, Any]]:
    t = DeltaTable(str(tmp / "tables" / "audit")).to_pyarrow_table()
    return [r for r in t.to_pylist() if r["event"] == event]


def replay_version(tmp: Path) -> int | None:
    return DeltaTable(str(tmp / "tables" / "audit")).transaction_version(rp.APP_ID)


def same_bytes(a: list[Delivery], b: list[Delivery]) -> None:
    assert [(m.routing_key, m.properties_raw, m.body) for m in a] == [
        (m.routing_key, m.properties_raw, m.body) for m in b
    ]


def test_to_seq_and_since_republish_byte_for_byte_in_order_refused_while_the_replay_runs(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    url = red_vhost.amqp_url
    admin.channel().exchange_declare(RW_X.name, "topic", durable=True)
    consumer = Consumer(url, RW_X.name)
    later = NOW + timedelta(hours=1)
    land(tables, 1, rows("c1", range(0, 10), RW_X, props=RICH), rows("c2", range(0, 5), RW_X))
    land(tables, 2, rows("c1", range(10, 20), RW_X, props=RICH))
    land(tables, 3, rows("c1", range(20, 25), RW_X), rows("c2", range(5, 10), RW_X),
         landed_at=later)  # fmt: skip
    order = (
        [("c1", s) for s in range(0, 10)] + [("c2", s) for s in range(0, 5)]
        + [("c1", s) for s in range(10, 25)] + [("c2", s) for s in range(5, 10)]
    )  # fmt: skip
    cfg = make_cfg(tmp_path, url, [RW_X.name], id_header="x-diode-id")
    conf = conf_file(tmp_path, url, [RW_X.name])
    progress_file = tmp_path / "state" / rp.PROGRESS_FILE
    try:
        r = Replayer(cfg, sink=audit_sink(cfg))
        try:
            assert r.step().confirmed == 35
            first = list(consumer.collect(35))
            assert [body_id(m) for m in first] == order
            # the publisher holds its lock: refused, nothing changed; a dry run still answers
            saved = progress_file.read_bytes()
            _, err = rewind(conf, "--exchange", RW_X.name, "--to-seq", "c1:12", code=1,
                            process=True)  # fmt: skip
            assert "replay.lock" in err and "stop it first" in err, err
            assert progress_file.read_bytes() == saved
            dry, _ = rewind(conf, "--exchange", RW_X.name, "--to-seq", "c1:12", "--dry-run")
            assert dry is not None and dry["replay_running"] is True, dry
        finally:
            r.close()
        saved, version = progress_file.read_bytes(), replay_version(tmp_path)
        dry, _ = rewind(conf, "--exchange", RW_X.name, "--to-seq", "c1:12", "--dry-run")
        assert dry is not None and (dry["dry_run"], dry["rewound"]) == (True, False), dry
        assert dry["from"] == {"land_seq": 3, "channel": "c2", "seq": 9}
        assert dry["to"] == {"land_seq": 2, "channel": "c1", "seq": 11}
        assert dry["first_row"] == {"land_seq": 2, "channel": "c1", "seq": 12}
        assert dry["rows"] == 18 and dry["replay_running"] is False, dry
        assert "red.replay.id_header would let them" in dry["note"], dry  # off in this config
        assert progress_file.read_bytes() == saved and replay_version(tmp_path) == version

        out, _ = rewind(conf, "--exchange", RW_X.name, "--to-seq", "c1:12", "--reason", "T-42",
                        process=True)  # fmt: skip
        assert out is not None and out["rewound"] and out["audit_rows_written"] == 1, out
        p = load_progress(tmp_path / "state")[RW_X.name]
        assert p.key == (2, "c1", 11) and p.high == {"c1": 11, "c2": 4} and not p.ahead
        (ev,) = audit_of(tmp_path, "replay_rewound")
        assert (ev["exchange"], ev["channel"], ev["seq_first"], ev["reason"]) == (
            RW_X.name, "c1", 12, "T-42")  # fmt: skip
        assert ev["app_id"] == rp.APP_ID and ev["version"] == version + 1
        detail = json.loads(ev["detail"])
        assert detail["from"]["land_seq"] == 3 and detail["to"]["seq"] == 11
        assert detail["rows"] == 18 and detail["to_seq"] == "c1:12" and detail["by"]

        s = Replayer(cfg, sink=audit_sink(cfg)).run(until_caught_up=True, timeout=30)
        assert s.caught_up and s.confirmed == 18, s
        assert {e["event"] for e in s.events} == {"replayed"}  # not out of order
        again = consumer.collect(35 + 18)[35:]
        same_bytes(again, first[12 + 5 :])  # c1 12.. in landing 2, then landing 3
        assert consumer.quiet(0.3)[35 + 18 :] == []

        # --since: back to the first row landed at or after it (landing 3)
        out, _ = rewind(conf, "--exchange", RW_X.name, "--since",
                        (later - timedelta(minutes=1)).isoformat())  # fmt: skip
        assert out is not None and out["first_row"] == {"land_seq": 3, "channel": "c1", "seq": 20}
        assert out["rows"] == 10
        s = Replayer(cfg).run(until_caught_up=True, timeout=30)
        assert s.caught_up and s.confirmed == 10, s
        same_bytes(consumer.collect(63)[53:], first[25:])

        # nothing to rewind (exit 0), an unknown exchange and a row that never landed (exit 2)
        land(tables, 4, rows("c1", range(25, 27), RW_X))  # not replayed yet
        none, _ = rewind(conf, "--exchange", RW_X.name, "--to-seq", "c1:26")
        assert none is not None and not none["rewound"] and "anyway" in none["note"], none
        none, _ = rewind(conf, "--exchange", RW_X.name, "--skipped")
        assert none is not None and not none["rewound"] and "nothing to rewind" in none["note"]
        future = datetime.now(UTC) + timedelta(days=1)
        none, _ = rewind(conf, "--exchange", RW_X.name, "--since", future.isoformat())
        assert none is not None and not none["rewound"] and "nothing to rewind" in none["note"]
        _, err = rewind(conf, "--exchange", "x.nope", "--skipped", code=2)
        assert "unknown exchange 'x.nope'" in err and "x.rw" in err, err
        _, err = rewind(conf, "--exchange", RW_X.name, "--to-seq", "c1:999", code=2)
        assert "no landed row channel 'c1' seq 999" in err, err
        _, err = rewind(conf, "--exchange", RW_X.name, "--to-seq", "x.rw:12", code=2)
        assert "the channel, not the exchange" in err and "'c1', 'c2'" in err, err
        _, err = rewind(conf, "--exchange", RW_X.name, "--since", "2026-01-01T00:00", code=2)
        assert "with its zone" in err, err
        _, err = rewind(conf, "--exchange", RW_X.name, "--skipped", "--to-seq", "c1:1", code=2)
        assert "exactly one of" in err, err
        assert len(audit_of(tmp_path, "replay_rewound")) == 2
    finally:
        consumer.close()


def test_rows_confirmed_ahead_are_published_again_and_not_reported_out_of_order(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    """Bundle 2 (seqs 5-9) landed late: published ahead of its key as a filler, it is in the
    saved progress's ``ahead``. Rewound to seq 10, the replay publishes 5-14 again in seq order:
    ``ahead`` forgotten (or 5-9 would be skipped), ``high`` lowered (or 5-13 would be reported
    out of order)."""
    url = red_vhost.amqp_url
    cfg = make_cfg(tmp_path, url, [HOLD_X.name], gap_hold_seconds=3600, batch_rows=5)
    conf = conf_file(tmp_path, url, [HOLD_X.name])
    consumer = hold_consumer(admin, url)
    now = datetime.now(UTC)
    land(tables, 1, rows("c1", range(0, 5), HOLD_X), landed_at=now)
    land(tables, 2, rows("c1", range(10, 15), HOLD_X), landed_at=now)
    save_bundles(tmp_path, 2, [(1, 0, 4), (3, 10, 14)])
    try:
        r = Replayer(cfg)
        assert r.step().confirmed == 5  # held at 10: bundle 2 missing
        land(tables, 3, rows("c1", range(5, 10), HOLD_X), landed_at=now)
        save_bundles(tmp_path, 3, [(1, 0, 4), (3, 10, 14), (2, 5, 9)])
        assert r.step().confirmed == 10
        r.close()
        before = load_progress(tmp_path / "state")[HOLD_X.name]
        assert before.key == (2, "c1", 14) and len(before.ahead) == 5, before
        first = list(consumer.collect(15))
        assert [body_id(m)[1] for m in first] == list(range(15))

        out, _ = rewind(conf, "--exchange", HOLD_X.name, "--to-seq", "c1:10")
        assert out is not None and out["rewound"], out
        assert (out["rows_behind_progress"], out["ahead_forgotten"], out["rows"]) == (5, 5, 10)
        p = load_progress(tmp_path / "state")[HOLD_X.name]
        assert p.key == (2, "c1", 9) and not p.ahead and p.high == {"c1": 4}, p
        assert p.passed == before.passed and p.confirmed_rows == before.confirmed_rows

        s = Replayer(cfg).run(until_caught_up=True, timeout=30)
        assert s.caught_up and s.confirmed == 10 and not s.errors, s
        assert {e["event"] for e in s.events} == {"replayed"}, s.events
        again = consumer.collect(25)[15:]
        assert [body_id(m)[1] for m in again] == list(range(5, 15))
        same_bytes(again, first[5:])
        assert load_progress(tmp_path / "state")[HOLD_X.name].key == (3, "c1", 9)
    finally:
        consumer.close()


def test_skipped_republishes_the_user_id_rows_once_the_tag_is_granted(
    tmp_path: Path,
    tables: RedTables,
    red_vhost: Vhost,
    alice_props: bytes,  # noqa: F811
) -> None:
    """The replay user lacked the impersonator tag: alice's row (seq 1) was skipped and
    audited. The tag granted, ``--skipped`` rewinds to just before it: seq 1 goes out byte for
    byte, then 2-6 again; the other exchange is untouched. A second ``--skipped`` finds no skip
    since that rewind."""
    _declare(red_vhost.amqp_url)
    conf = conf_file(tmp_path, red_vhost.amqp_url, [UID_X.name, GOOD_X.name])
    with broker_user(red_vhost.name) as (relay, url):
        _land_scenario(tables, alice_props, relay)
        land(tables, 2, rows("c1", range(4, 7), UID_X))
        cu, cg = Consumer(red_vhost.amqp_url, UID_X.name), Consumer(red_vhost.amqp_url, GOOD_X.name)
        cfg = make_cfg(tmp_path, url, [UID_X.name, GOOD_X.name])
        try:
            s = Replayer(cfg, sink=audit_sink(cfg), retry_seconds=3600).run(
                until_caught_up=True, timeout=60
            )
            assert s.caught_up and s.skipped == {"user_id": 1}, s.to_json()
            cu.collect(6)
            first = {body_id(m)[1]: m for m in cu.quiet(0.3)}
            assert sorted(first) == [0, 2, 3, 4, 5, 6]
            assert len(cg.collect(20)) == 20
            (skip,) = audit_of(tmp_path, "replay_failed")
            assert json.loads(skip["detail"])["kind"] == "user_id"

            _ctl("set_user_tags", relay, "impersonator")
            dry, _ = rewind(conf, "--exchange", UID_X.name, "--skipped", "--dry-run")
            assert dry is not None and not dry["rewound"] and dry["skipped_events"] == 1, dry
            out, _ = rewind(conf, "--exchange", UID_X.name, "--skipped", "--reason", "tag set")
            assert out is not None and out["rewound"], out
            assert out["first_row"] == {"land_seq": 1, "channel": "c1", "seq": 1}
            assert out["to"] == {"land_seq": 1, "channel": "c1", "seq": 0} and out["rows"] == 6

            s = Replayer(cfg, sink=audit_sink(cfg), retry_seconds=3600).run(
                until_caught_up=True, timeout=60
            )
            assert s.caught_up and s.confirmed == 6 and not s.skipped, s.to_json()
            cu.collect(12)
            again = cu.quiet(0.3)[6:]
            assert [body_id(m)[1] for m in again] == [1, 2, 3, 4, 5, 6]
            assert again[0].properties_raw == alice_props  # as landed, byte for byte
            same_bytes(again[1:], [first[n] for n in range(2, 7)])
            assert len(cg.quiet(0.2)) == 20  # not rewound: nothing again

            none, _ = rewind(conf, "--exchange", UID_X.name, "--skipped")
            assert none is not None and not none["rewound"], none
            assert "since its last rewind" in none["note"], none
            (ev,) = audit_of(tmp_path, "replay_rewound")
            assert (ev["exchange"], ev["reason"]) == (UID_X.name, "tag set")
            assert json.loads(ev["detail"])["skipped"] is True
        finally:
            cu.close()
            cg.close()
