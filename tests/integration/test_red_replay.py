"""Red, replay: real Delta `messages` tables replayed into a real red RabbitMQ vhost.

Rows are built with the wire row builder (``build_rows``) plus red's columns and appended the
way the landing does (``RedTables.append`` with ``("diode-red", land_seq)``). Consumers on red
use the bridge AMQP client, which hands out the raw property bytes as the broker sent them.
The pure pieces (confirm window, batch planning, id header splice) get property tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.amqp.client import Connection, Delivery
from bridge.black.management import ManagementClient
from bridge.config import Config, config_from_dict
from bridge.errors import AmqpClosed, StateError
from bridge.metrics import REGISTRY
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.properties import (
    ByteArray,
    Float32,
    Float64,
    Int8,
    Int64,
    Properties,
    Timestamp,
    UInt16,
    decode_properties,
    encode_properties,
    field_table,
)
from bridge.protocol.rows import build_rows
from bridge.red import replay as rp
from bridge.red import sequence as sq
from bridge.red.approvals import Approvals
from bridge.red.landing import STATE_FILE
from bridge.red.replay import ConfirmWindow, Replayer, plan_upper, with_id_header
from bridge.red.report import replay_status as report_replay_status
from bridge.red.tables import RedTables
from tests.conftest import MGMT, Vhost
from tests.support import json_lines
from tests.unit.test_protocol_properties import canon, properties

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
RICH = encode_properties(
    Properties(
        content_type="application/octet-stream",
        headers=field_table(
            {
                "kind": "h",
                "f32": Float32(1.1),
                "f64": Float64(-0.0),
                "dec": Decimal("3.14"),
                "i8": Int8(-3),
                "u16": UInt16(65535),
                "i64": Int64(-(2**63)),
                "bytes": ByteArray(b"\x00\xff"),
                "when": Timestamp(1_700_000_000),
                "nested": {"a": [1, "two", None, True]},
            }
        ),
        delivery_mode=2,
        priority=7,
        correlation_id="corr",
        message_id="mid",
        timestamp=1_700_000_001,
        app_id="black-app",
    )
)
PLAIN = encode_properties(Properties(delivery_mode=1))


# ---------------------------------------------------------------------------- helpers
def make_cfg(tmp: Path, url: str, approved: Sequence[str] = (), **replay: Any) -> Config:
    return config_from_dict(
        {
            "channels": [{"name": "c1", "encrypt": False}],
            "red": {
                "state_dir": str(tmp / "state"),
                "tables_dir": str(tmp / "tables"),
                "replay": {"amqp_url": url, "approved": list(approved), "poll_seconds": 0.05,
                           **replay},
            },
        },
        base=tmp,
        environ={},
    )  # fmt: skip


def rows(
    channel: str,
    seqs: Sequence[int],
    decl: ExchangeDecl,
    *,
    props: bytes = PLAIN,
    routing_key: str = "rk",
    body_size: int = 0,
) -> pa.RecordBatch:
    """Wire rows of ``decl.name``; each body starts with ``<channel>:<seq>``."""
    pad = b"." * body_size
    bodies = [f"{channel}:{s}".encode() + pad for s in seqs]
    n = len(seqs)
    return build_rows(
        channel, list(seqs), [decl.name] * n, [routing_key] * n, [False] * n, [props] * n,
        bodies, {decl.name: decl},
    )  # fmt: skip


def land(
    tables: RedTables, land_seq: int, *batches: pa.RecordBatch, landed_at: datetime = NOW
) -> None:
    """Append ``batches`` to ``messages`` as landing ``land_seq`` does."""
    parts = []
    for b in batches:
        t = pa.Table.from_batches([b])
        n = t.num_rows
        t = t.append_column("bundle_seq", pa.array([land_seq] * n, pa.int64()))
        t = t.append_column("bundle_id", pa.array([f"b{land_seq}"] * n))
        t = t.append_column("land_seq", pa.array([land_seq] * n, pa.int64()))
        t = t.append_column("landed_at", pa.array([landed_at] * n, pa.timestamp("us", tz="UTC")))
        t = t.append_column("landed_date", pa.array([landed_at.date()] * n, pa.date32()))
        parts.append(t)
    assert tables.append("messages", pa.concat_tables(parts), app_id="diode-red", version=land_seq)


def body_id(d: Delivery) -> tuple[str, int]:
    ch, _, rest = d.body.partition(b":")
    return ch.decode(), int(rest.split(b".")[0])


class Consumer:
    """A server-named queue on red bound to ``exchange``; deliveries with raw properties."""

    def __init__(self, url: str, exchange: str, key: str = "#", args: Any = None, **qargs: Any):
        self.conn = Connection.open(url, client_name="test-consumer")
        self.ch = self.conn.channel()
        self.queue = self.ch.queue_declare("", exclusive=True, **qargs).queue
        self.ch.queue_bind(self.queue, exchange, key, args)
        self.got: list[Delivery] = []
        self._consuming = False

    def start(self) -> None:
        if not self._consuming:
            self.ch.basic_qos(5000)
            self.ch.basic_consume(self.queue, no_ack=True)
            self._consuming = True

    def collect(self, n: int, timeout: float = 20.0) -> list[Delivery]:
        self.start()
        deadline = time.monotonic() + timeout
        while len(self.got) < n and time.monotonic() < deadline:
            self.got += self.conn.poll(0.2).deliveries
        return self.got

    def quiet(self, seconds: float = 0.3) -> list[Delivery]:
        """Whatever else arrives within ``seconds``."""
        self.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.got += self.conn.poll(0.05).deliveries
        return self.got

    def depth(self) -> int:
        return self.ch.queue_depth(self.queue)

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def admin(red_vhost: Vhost) -> Iterator[Connection]:
    c = Connection.open(red_vhost.amqp_url, client_name="test-admin")
    yield c
    c.close()


def exists(url: str, name: str) -> bool:
    with Connection.open(url) as c:
        try:
            c.channel().exchange_declare(name, passive=True)
            return True
        except AmqpClosed as e:
            assert e.reply_code == 404
            return False


def no_forward_skips(order: list[tuple[str, int]], delivered: list[tuple[str, int]]) -> None:
    """At-least-once and in order: every row arrives, and after any delivery the next one is at
    most the following row (a restart may go back, never jump ahead)."""
    index = {k: i for i, k in enumerate(order)}
    seen = [index[k] for k in delivered]
    assert set(seen) == set(range(len(order)))
    assert seen[0] == 0
    jumps = [(a, b) for a, b in zip(seen, seen[1:], strict=False) if b > a + 1]
    assert not jumps, f"skipped ahead: {jumps[:5]}"


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---------------------------------------------------------------------------- pure pieces
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 30), st.data())
def test_confirm_window_yields_exactly_the_acked_prefix(n: int, data: Any) -> None:
    w = ConfirmWindow()
    first = data.draw(st.integers(1, 1000))
    for i in range(n):
        w.sent(first + i, (1, "c", i))
    outcome: dict[int, bool] = {}
    popped: list[Any] = []
    while len(outcome) < n:
        tag = data.draw(st.integers(first, first + n - 1))
        multiple = data.draw(st.booleans())
        ack = data.draw(st.integers(0, 9)) > 0
        settled = w.confirm(tag, multiple, ack)
        newly = [
            t for t in range(first, (tag if multiple else first - 1) + 1) if t not in outcome
        ] + ([tag] if not multiple and tag not in outcome else [])
        for t in newly:
            outcome[t] = ack
        assert settled == len(newly)
        assert w.pending == n - len(outcome)
        popped += w.pop_acked()
        prefix = 0
        while prefix < n and outcome.get(first + prefix) is True:
            prefix += 1
        assert popped == [(1, "c", i) for i in range(prefix)]
        assert w.head_nacked == (outcome.get(first + prefix) is False)
        assert w.nacked == (False in outcome.values())
    assert w.clear() == 0 and len(w) == 0 and not w.nacked


_files = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 5), st.integers(0, 50)).map(
        lambda t: (t[0], t[0] + t[1], t[2])
    ),
    max_size=12,
)


@settings(max_examples=500, deadline=None)
@given(_files, st.integers(0, 40), st.integers(1, 100))
def test_plan_upper_takes_the_fewest_commits_that_make_a_batch(
    files: list[tuple[int, int, int]], lo: int, batch: int
) -> None:
    """A file's rows count as spread over its land_seq span: a compacted file spanning many
    commits is read a few commits at a time, not whole."""
    hi = plan_upper(files, lo, batch)
    live = [f for f in files if f[1] >= lo and f[2] > 0]
    if not live:
        assert hi is None
        return
    top = max(f[1] for f in live)
    assert hi is not None and lo <= hi <= top

    def est(upto: int) -> float:
        return sum(
            n * (min(upto, mx) - max(mn, lo) + 1) / (mx - mn + 1)
            for mn, mx, n in live
            if upto >= max(mn, lo)
        )

    assert est(hi) >= min(batch, est(top)) - 1e-6
    if hi > lo:
        assert est(hi - 1) < batch  # one commit less would not have made the batch


def test_plan_upper_splits_a_compacted_file() -> None:
    assert plan_upper([(1, 100, 50_000)], 1, 1000) == 2  # 500 rows per commit
    assert plan_upper([(1, 100, 50_000)], 51, 1000) == 52
    assert plan_upper([(1, 100, 50_000), (101, 101, 10)], 100, 10_000) == 101
    assert plan_upper([(5, 5, 9_000)], 1, 10) == 5  # one commit is read whole


def _key(k: Any) -> bytes:
    return k.encode() if isinstance(k, str) else k


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(properties, st.sampled_from(["x-diode-id", "dup", "k"]), st.text(max_size=12))
def test_id_header_adds_one_header_and_keeps_every_other_byte(
    p: Properties, name: str, value: str
) -> None:
    raw = encode_properties(p)
    out = with_id_header(raw, name, value)
    got = decode_properties(out)
    assert got.headers is not None
    kept = tuple(e for e in (p.headers or ()) if _key(e[0]) != name.encode())
    assert canon(got.headers[:-1]) == canon(kept)
    assert got.headers[-1] == (name, ("S", value))
    assert canon(replace(got, headers=None)) == canon(replace(p, headers=None))
    if len(kept) == len(p.headers or ()):  # nothing replaced: every old byte is kept
        without = got.headers[:-1] if p.headers is not None else None
        assert encode_properties(replace(got, headers=without)) == raw


def test_id_header_refuses_property_bytes_that_do_not_decode() -> None:
    with pytest.raises(rp.ProtocolError):
        with_id_header(b"\x20\x00\x00\x00\x00\x05\x01kZ", "x-id", "c1:1")  # unknown type Z


# ---------------------------------------------------------------------------- the broker
pytestmark_broker = pytest.mark.broker


@pytestmark_broker
def test_exchanges_are_declared_as_landed_and_messages_replay_byte_for_byte(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    decls = [
        ExchangeDecl("x.fanout", "fanout", True, False, False, {"alternate-exchange": "ae"}),
        ExchangeDecl("x.topic", "topic", True, False, False, {"x-note": "t", "x-n": 5}),
        ExchangeDecl("x.headers", "headers", False, False, False, {}),
        ExchangeDecl("x.direct", "direct", False, True, False, {"x-flag": True}),
    ]
    keys = {"x.fanout": "", "x.topic": "#", "x.headers": "", "x.direct": "rk"}
    bind_args = {"x.headers": {"x-match": "any", "kind": "h"}}
    url = red_vhost.amqp_url
    cfg = make_cfg(tmp_path, url, [d.name for d in decls])
    # landing 1: one row each; nothing is bound on red yet, so only the declarations matter
    land(tables, 1, *[rows("c1", [i], d, props=RICH) for i, d in enumerate(decls)])
    s1 = Replayer(cfg).run(until_caught_up=True, timeout=30)
    assert s1.caught_up and s1.confirmed == 4 and not s1.errors, s1
    on_red = {d.name: d for d in ManagementClient(MGMT, "guest", "guest").list_exchanges(
        red_vhost.name)}  # fmt: skip
    for d in decls:
        assert on_red[d.name] == d
    consumers = {d.name: Consumer(url, d.name, keys[d.name], bind_args.get(d.name)) for d in decls}
    try:
        # landing 2 and 3: two channels, interleaved, rich properties
        land(tables, 2, *[rows("c1", range(10, 60), d, props=RICH) for d in decls])
        third = [rows("c2", range(0, 30), d, props=RICH) for d in decls]
        land(tables, 3, *third, *[rows("c1", range(60, 70), d, props=RICH) for d in decls])
        s2 = Replayer(cfg).run(until_caught_up=True, timeout=30)
        assert s2.confirmed == 4 * 90 and not s2.errors
        # (land_seq, channel, seq) order: landing 2, then landing 3 with c1 before c2
        want = [("c1", s) for s in range(10, 70)] + [("c2", s) for s in range(30)]
        for d in decls:
            got = consumers[d.name].collect(90)
            assert [body_id(m) for m in got] == want, d.name
            assert all(m.properties_raw == RICH for m in got)
            assert all(m.routing_key == "rk" and m.exchange == d.name for m in got)
            assert consumers[d.name].quiet(0.2) == got  # exactly once when nothing failed
        # replayed events: one per exchange and channel with the ranges confirmed
        ev = [e for e in s2.events if e["event"] == "replayed" and e["exchange"] == "x.topic"]
        assert {(e["channel"], e["seq_first"], e["seq_last"]) for e in ev} == {
            ("c1", 10, 69), ("c2", 0, 29)}  # fmt: skip
        assert json.loads(ev[0]["detail"])["rows"] in (60, 30)
        progress = json.loads((tmp_path / "state" / rp.PROGRESS_FILE).read_text())
        assert progress["exchanges"]["x.fanout"]["land_seq"] == 3
        assert (progress["exchanges"]["x.fanout"]["channel"],
                progress["exchanges"]["x.fanout"]["seq"]) == ("c2", 29)  # fmt: skip
        assert metric("bridge_red_replay_confirmed_total", exchange="x.headers") >= 91
    finally:
        for c in consumers.values():
            c.close()


@pytestmark_broker
def test_unapproved_exchange_stays_landed_and_approving_replays_its_history(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    url = red_vhost.amqp_url
    a = ExchangeDecl("a", "fanout", True)
    b = ExchangeDecl("b", "fanout", True)
    for name in ("a", "b"):  # made by an operator, as the rows say (so queues can bind first)
        admin.channel().exchange_declare(name, "fanout", durable=True)
    ca, cb = Consumer(url, "a", ""), Consumer(url, "b", "")
    land(tables, 1, rows("c1", range(0, 20), a), rows("c1", range(20, 50), b))
    land(tables, 2, rows("c1", range(50, 60), b))
    cfg = make_cfg(tmp_path, url, ["a"])
    try:
        r = Replayer(cfg)
        s = r.run(until_caught_up=True, timeout=30)
        assert s.confirmed == 20 and set(s.exchanges) == {"a"}
        assert [body_id(m)[1] for m in ca.collect(20)] == list(range(20))
        assert cb.quiet(0.3) == [] and cb.depth() == 0
        status = r.status()
        assert status["unapproved_waiting"] == {"b": 40}
        assert status["exchanges"]["a"]["lag_rows"] == 0
        assert metric("bridge_red_replay_lag_rows", exchange="b") == 40
        # approval at run time: the next pass replays b's whole history, in order
        assert Approvals.load(tmp_path / "state").approve("b", "ops", "checked") == 1
        s = Replayer(cfg).run(until_caught_up=True, timeout=30)
        assert s.confirmed == 40 and set(s.exchanges) == {"b"}  # a: nothing new
        assert [body_id(m)[1] for m in cb.collect(40)] == list(range(20, 60))
        assert ca.quiet(0.2) and len(ca.got) == 20
        assert metric("bridge_red_replay_lag_rows", exchange="b") == 0
    finally:
        ca.close()
        cb.close()


@pytestmark_broker
def test_revoking_stops_new_publishes_and_one_publisher_per_state_dir(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    url = red_vhost.amqp_url
    x = ExchangeDecl("x", "fanout", False)
    land(tables, 1, rows("c1", range(5), x))
    state = tmp_path / "state"
    Approvals.load(state).approve("x", "ops")
    cfg = make_cfg(tmp_path, url)
    with Replayer(cfg) as r:
        assert r.step().confirmed == 5
        with pytest.raises(StateError, match="replay publisher"):
            Replayer(cfg).step()
        Approvals.load(state).revoke("x", "ops")
        land(tables, 2, rows("c1", range(5, 9), x))
        res = r.step()
        assert res.published == 0 and res.caught_up
        assert r.status()["unapproved_waiting"] == {"x": 4}
        Approvals.load(state).approve("x", "ops")  # approved again: resumes, no repeats
        assert r.step().confirmed == 4
    assert json.loads((state / rp.PROGRESS_FILE).read_text())["exchanges"]["x"]["seq"] == 8


@pytestmark_broker
def test_graceful_stop_then_a_new_publisher_continues_exactly(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    url = red_vhost.amqp_url
    x = ExchangeDecl("g", "topic", True)
    for ls in range(1, 6):
        land(tables, ls, rows("c1", range(ls * 100, ls * 100 + 100), x),
             rows("c2", range(ls * 50, ls * 50 + 50), x))  # fmt: skip
    cfg = make_cfg(tmp_path, url, ["g"], batch_rows=120)
    r = Replayer(cfg)
    assert r.step().confirmed == 150  # the first landing commit only
    r.step()
    r.close()
    order = sorted(
        [(ls, "c1", s) for ls in range(1, 6) for s in range(ls * 100, ls * 100 + 100)]
        + [(ls, "c2", s) for ls in range(1, 6) for s in range(ls * 50, ls * 50 + 50)]
    )
    c = Consumer(url, "g")
    try:
        s = Replayer(cfg).run(until_caught_up=True, timeout=30)
        assert s.confirmed == 750 - 300
        got = [body_id(m) for m in c.collect(450)]
        assert got == [(ch, sq) for _, ch, sq in order[300:]]
    finally:
        c.close()


KILLED_RUN = """
import json, sys
from pathlib import Path
from bridge.config import config_from_dict
from bridge.red.replay import Replayer
cfg = config_from_dict(json.loads(sys.argv[1]), base=Path("."), environ={})
sink_path = sys.argv[2] if len(sys.argv) > 2 else None


def sink(events):  # the audit table's stand-in: each batch durable before the call returns
    with open(sink_path, "a") as f:
        f.writelines(json.dumps(e) + "\\n" for e in events)
        f.flush()
        __import__("os").fsync(f.fileno())


Replayer(cfg, sink=sink if sink_path else None).run()
"""


@pytestmark_broker
def test_kill_9_mid_run_resumes_without_skipping(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    url = red_vhost.amqp_url
    x = ExchangeDecl("k", "fanout", True)
    for ls in range(1, 5):
        land(tables, ls, rows("c1", range(ls * 5000, ls * 5000 + 5000), x, body_size=200),
             rows("c0", range(ls * 1000, ls * 1000 + 1000), x))  # fmt: skip
    order = sorted(
        [(ls, "c1", s) for ls in range(1, 5) for s in range(ls * 5000, ls * 5000 + 5000)]
        + [(ls, "c0", s) for ls in range(1, 5) for s in range(ls * 1000, ls * 1000 + 1000)]
    )
    admin.channel().exchange_declare("k", "fanout", durable=True)  # as the rows say
    c = Consumer(url, "k", "")  # bound before anything is published: sees every publish
    spec = {
        "channels": [{"name": "c1", "encrypt": False}],
        "red": {
            "state_dir": str(tmp_path / "state"),
            "tables_dir": str(tmp_path / "tables"),
            "replay": {"amqp_url": url, "approved": ["k"], "in_flight": 64, "batch_rows": 3000},
        },
    }
    progress = tmp_path / "state" / rp.PROGRESS_FILE
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    audit = tmp_path / "audit.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, json.dumps(spec), str(audit)], env=env
    )
    try:
        deadline = time.monotonic() + 60
        confirmed = 0
        while confirmed < 3000:
            assert proc.poll() is None and time.monotonic() < deadline
            if progress.exists():
                confirmed = json.loads(progress.read_text())["exchanges"]["k"]["confirmed_rows"]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        saved = json.loads(progress.read_text())["exchanges"]["k"]
        assert 3000 <= saved["confirmed_rows"] < len(order)  # killed mid-way
        sunk: list[dict[str, Any]] = []
        s = Replayer(make_cfg(tmp_path, url, ["k"]), sink=sunk.extend).run(
            until_caught_up=True, timeout=60
        )
        assert s.caught_up and not s.errors
        c.collect(len(order), timeout=60)
        no_forward_skips([(ch, sq) for _, ch, sq in order], [body_id(m) for m in c.quiet()])
        assert len(c.got) - len(order) <= 64 + 3000  # duplicates: what was unsaved at the kill
        # the audit trail lost nothing to the kill: every row is in some `replayed` event, the
        # killed run's confirmed-but-unaudited ranges emitted by the next run
        events = (json_lines(audit) if audit.exists() else []) + sunk
        covered = {ch: set() for ch in ("c0", "c1")}
        for e in events:
            if e["event"] == "replayed":
                covered[e["channel"]].update(range(e["seq_first"], e["seq_last"] + 1))
        assert covered == {ch: {sq for _, c_, sq in order if c_ == ch} for ch in covered}
    finally:
        if proc.poll() is None:
            proc.kill()
        c.close()


@pytestmark_broker
def test_refused_declarations_internal_and_unknown_exchanges_fail_alone(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    url = red_vhost.amqp_url
    admin.channel().exchange_declare("clash", "topic", durable=True)  # red has it as a topic
    admin.channel().exchange_declare("ok", "fanout", durable=True)  # as landed: queues can bind
    ok = ExchangeDecl("ok", "fanout", True)
    clash = ExchangeDecl("clash", "fanout", True)
    internal = ExchangeDecl("inner", "topic", True, False, True)
    weird = ExchangeDecl("weird", "x-no-such-type", True)
    land(
        tables, 1, rows("c1", range(10), ok), rows("c1", range(10, 15), clash),
        rows("c1", range(15, 18), internal), rows("c1", [18, 19], weird),
    )  # fmt: skip
    # black's rows say "unknown" when its catalog did not know the exchange
    land(tables, 2, build_rows("c1", [20], ["mystery"], ["rk"], [False], [PLAIN], [b"c1:20"], {}))
    land(tables, 3, rows("c1", range(21, 30), ok))
    c = Consumer(url, "ok", "")
    cfg = make_cfg(tmp_path, url, ["ok", "clash", "inner", "mystery", "weird"])
    try:
        sunk: list[dict[str, Any]] = []
        r = Replayer(cfg, sink=sunk.extend)
        s = r.run(until_caught_up=True, timeout=30)
        want = [("c1", i) for i in [*range(10), *range(21, 30)]]
        no_forward_skips(want, [body_id(m) for m in c.collect(19)])
        failed = {e["exchange"]: e for e in s.events if e["event"] == "replay_failed"}
        assert set(failed) == {"clash", "inner", "mystery", "weird"}
        reason = failed["clash"]["reason"]
        assert "406" in reason and "PRECONDITION_FAILED" in reason and "'clash'" in reason
        assert (failed["clash"]["channel"], failed["clash"]["seq_first"]) == ("c1", 10)
        assert json.loads(failed["inner"]["detail"])["kind"] == "internal"
        assert "internal" in failed["inner"]["reason"]
        assert json.loads(failed["mystery"]["detail"])["kind"] == "unknown_type"
        assert "503" in failed["weird"]["reason"]  # refused by closing the whole connection
        assert sunk == s.events  # the sink saw the same events
        assert exists(url, "inner")  # declared as landed (internal), nothing published
        assert metric("bridge_red_replay_errors_total", exchange="clash", kind="declare") >= 1
        status = Replayer(cfg).status()
        assert status["exchanges"]["clash"]["lag_rows"] == 5
        assert status["exchanges"]["ok"]["lag_rows"] == 0
    finally:
        c.close()


@pytestmark_broker
def test_unknown_type_publishes_once_the_exchange_exists_on_red(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    url = red_vhost.amqp_url
    land(tables, 1, build_rows("c1", [1, 2], ["mystery"] * 2, ["rk"] * 2, [False] * 2,
                               [PLAIN] * 2, [b"c1:1", b"c1:2"], {}))  # fmt: skip
    cfg = make_cfg(tmp_path, url, ["mystery"])
    s = Replayer(cfg, retry_seconds=0.0).run(until_caught_up=True, timeout=20)
    (ev,) = [e for e in s.events if e["event"] == "replay_failed"]
    assert json.loads(ev["detail"])["kind"] == "unknown_type" and "declare it" in ev["reason"]
    assert s.confirmed == 0 and not exists(url, "mystery")
    admin.channel().exchange_declare("mystery", "fanout")  # the operator declares it on red
    c = Consumer(url, "mystery", "")
    try:
        s = Replayer(cfg).run(until_caught_up=True, timeout=20)
        assert s.confirmed == 2 and not s.errors
        assert [body_id(m) for m in c.collect(2)] == [("c1", 1), ("c1", 2)]
    finally:
        c.close()


@pytestmark_broker
def test_builtin_amq_exchanges_are_published_to_never_declared(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    """Rows can come from amq.* exchanges (black may mirror amq.topic): the broker refuses to
    declare that prefix, so red only checks the exchange exists and publishes to it. One that
    does not exist (amq.nothing) stops that exchange alone."""
    url = red_vhost.amqp_url
    topic = ExchangeDecl("amq.topic", "topic", True)
    land(tables, 1, rows("c1", range(5), topic))
    land(tables, 2, rows("c1", range(5, 7), ExchangeDecl("amq.nothing", "topic", True)))
    c = Consumer(url, "amq.topic", "#")
    cfg = make_cfg(tmp_path, url, ["amq.topic", "amq.nothing"])
    try:
        s = Replayer(cfg).run(until_caught_up=True, timeout=30)
        assert [body_id(m) for m in c.collect(5)] == [("c1", i) for i in range(5)]
        (failed,) = [e for e in s.events if e["event"] == "replay_failed"]
        assert failed["exchange"] == "amq.nothing" and "never declared" in failed["reason"]
        assert not exists(url, "amq.nothing")
    finally:
        c.close()


@pytestmark_broker
def test_nacks_are_republished_then_the_exchange_stops_and_others_go_on(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    url = red_vhost.amqp_url
    full, fine = ExchangeDecl("full", "fanout", False), ExchangeDecl("fine", "fanout", False)
    admin.channel().exchange_declare("full", "fanout")
    # a queue that refuses messages beyond 3: the broker nacks those publishes
    q = f"small-{uuid.uuid4().hex[:6]}"
    admin.channel().queue_declare(q, arguments={"x-max-length": 3, "x-overflow": "reject-publish"})
    admin.channel().queue_bind(q, "full", "")
    land(tables, 1, rows("c1", range(10), full), rows("c1", range(10, 30), fine))
    cfg = make_cfg(tmp_path, url, ["full", "fine"], in_flight=4)
    r = Replayer(cfg, retry_seconds=0.0)
    s = r.run(until_caught_up=True, timeout=30)
    failed = [e for e in s.events if e["event"] == "replay_failed"]
    failed = [e for e in failed if json.loads(e["detail"])["kind"] != "unroutable"]  # "fine"
    assert [e["exchange"] for e in failed] == ["full"]
    assert json.loads(failed[0]["detail"])["kind"] == "nack" and "nacked" in failed[0]["reason"]
    assert s.exchanges["fine"]["confirmed"] == 20
    assert s.exchanges["full"]["confirmed"] == 3  # the queue took 3, then refused
    assert s.exchanges["full"]["published"] > 3 + rp.MAX_NACK_RETRIES  # republished
    prog = json.loads((tmp_path / "state" / rp.PROGRESS_FILE).read_text())["exchanges"]
    assert (prog["full"]["seq"], prog["fine"]["seq"]) == (2, 29)
    # room again: the stopped exchange is retried and finishes, in order from where it stopped
    drained = Connection.open(url)
    try:
        ch = drained.channel()
        ch.basic_consume(q, no_ack=True)
        got: list[Delivery] = []
        while len(got) < 3:
            got += drained.poll(0.2).deliveries
        assert [body_id(m)[1] for m in got] == [0, 1, 2]
        cfg2 = make_cfg(tmp_path, url, ["full", "fine"], in_flight=2)
        s = Replayer(cfg2).run(until_caught_up=True, timeout=30)
        while len(got) < 10:
            got += drained.poll(0.2).deliveries
        assert [body_id(m)[1] for m in got][3:] == list(range(3, 10)) and not s.errors
    finally:
        drained.close()


@pytestmark_broker
def test_id_header_adds_exactly_one_header(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    url = red_vhost.amqp_url
    x = ExchangeDecl("ids", "fanout", True)
    land(tables, 1, rows("c1", range(3), x, props=RICH), rows("c2", [7], x, props=PLAIN))
    cfg = make_cfg(tmp_path, url, ["ids"], id_header="x-diode-id")
    Replayer(cfg).run(until_caught_up=True, timeout=5)  # declares the exchange
    c = Consumer(url, "ids", "")
    land(tables, 2, rows("c1", range(3, 5), x, props=RICH), rows("c2", [8], x, props=PLAIN))
    try:
        Replayer(cfg).run(until_caught_up=True, timeout=20)
        got = c.collect(3)
        assert [body_id(m) for m in got] == [("c1", 3), ("c1", 4), ("c2", 8)]
        for m in got:
            ch, seq = body_id(m)
            src = RICH if ch == "c1" else PLAIN
            assert m.properties_raw == with_id_header(src, "x-diode-id", f"{ch}:{seq}")
            before, after = decode_properties(src), decode_properties(m.properties_raw)
            assert after.headers is not None
            assert after.headers[-1] == ("x-diode-id", ("S", f"{ch}:{seq}"))
            assert canon(after.headers[:-1]) == canon(before.headers or ())
            assert canon(replace(after, headers=None)) == canon(replace(before, headers=None))
    finally:
        c.close()


@pytestmark_broker
def test_broker_down_and_lost_connections_are_survived(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    from tests.integration.test_amqp_client import Relay, url_of

    x = ExchangeDecl("r", "fanout", True)
    for ls in range(1, 4):
        land(tables, ls, rows("c1", range(ls * 1000, ls * 1000 + 1000), x))
    with_dead = make_cfg(tmp_path, "amqp://guest:guest@127.0.0.1:1/%2F", ["r"])
    s = Replayer(with_dead).run(until_caught_up=True, timeout=1.5)
    assert not s.caught_up and s.confirmed == 0
    assert any("unreachable" in e for e in s.errors) and "guest:guest" not in str(s.errors)
    relay = Relay()
    c: Consumer | None = None
    cfg = make_cfg(tmp_path, url_of(red_vhost.name, "127.0.0.1", relay.port), ["r"],
                   batch_rows=1000)  # fmt: skip
    r = Replayer(cfg)
    try:
        assert r.step().confirmed == 1000  # declares r
        c = Consumer(red_vhost.amqp_url, "r", "")
        relay.sever()
        res = r.step()
        assert res.error and res.confirmed == 0
        t0 = time.monotonic()
        while not (res := r.step()).caught_up:
            assert time.monotonic() - t0 < 30, res
            time.sleep(0.1)
        assert time.monotonic() - t0 >= 0.5  # backed off before reconnecting
        c.collect(2000)
        got = [body_id(m)[1] for m in c.quiet()]
        assert got == list(range(2000, 4000))
    finally:
        r.close()
        relay.stopped.set()
        if c:
            c.close()


@pytestmark_broker
def test_a_login_refused_after_a_good_start_is_an_error_with_its_own_metric(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, caplog: pytest.LogCaptureFixture
) -> None:
    """The publisher's password is changed on the red broker while it runs: it keeps retrying
    (a service: the fix may come on the broker's side), but says so as an error naming
    red.replay.amqp_url, counted apart from a broker that is down."""
    import requests

    from tests.integration.test_amqp_client import Relay

    user = f"diode-test-{uuid.uuid4().hex[:8]}"
    api = f"{MGMT}/api"
    vq = urllib.parse.quote(red_vhost.name, safe="")
    auth = ("guest", "guest")
    requests.put(f"{api}/users/{user}", json={"password": "one", "tags": ""}, auth=auth,
                 timeout=10).raise_for_status()  # fmt: skip
    relay = Relay()
    r: Replayer | None = None
    try:
        everything = {"configure": ".*", "write": ".*", "read": ".*"}
        requests.put(
            f"{api}/permissions/{vq}/{user}", auth=auth, timeout=10, json=everything
        ).raise_for_status()
        x = ExchangeDecl("r", "fanout", True)
        land(tables, 1, rows("c1", range(10), x))
        url = f"amqp://{user}:one@127.0.0.1:{relay.port}/{vq}"
        r = Replayer(make_cfg(tmp_path, url, ["r"]))
        assert r.step().confirmed == 10
        refused = ("bridge_red_replay_errors_total", {"exchange": "", "kind": "login_refused"})
        before = REGISTRY.get_sample_value(*refused) or 0.0
        requests.put(f"{api}/users/{user}", json={"password": "two", "tags": ""}, auth=auth,
                     timeout=10).raise_for_status()  # fmt: skip
        relay.sever()
        land(tables, 2, rows("c1", range(10, 20), x))
        caplog.set_level("WARNING", logger="bridge.red.replay")
        t0 = time.monotonic()
        while (REGISTRY.get_sample_value(*refused) or 0.0) == before:
            assert time.monotonic() - t0 < 30, "the refused login was never counted"
            assert r.step().confirmed == 0
            time.sleep(0.1)
        errors = [x for x in caplog.records if x.levelname == "ERROR"]
        assert errors and "refused the login" in errors[0].getMessage(), caplog.records
        assert "red.replay.amqp_url" in errors[0].getMessage()
    finally:
        if r is not None:
            r.close()
        relay.stopped.set()
        requests.delete(f"{api}/users/{user}", auth=auth, timeout=10)


@pytestmark_broker
def test_a_broker_alarm_is_reported_and_a_stop_ends_a_publish_the_broker_blocked(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, caplog: pytest.LogCaptureFixture
) -> None:
    """A memory alarm on red: the broker blocks the publisher and reads nothing more, so a
    publish of large rows waits in the client's send. That wait had no end: SIGTERM set the
    stop event and nothing looked at it. Now the block is reported (log, gauge, live status)
    and a stop ends the run at once; the rows are published after the alarm, none skipped."""
    import threading

    from tests.conftest import raised_memory_alarm

    x = ExchangeDecl("big", "fanout", True)
    land(tables, 1, rows("c1", range(40), x, body_size=1_000_000))  # 40 MB: past every buffer
    cfg = make_cfg(tmp_path, red_vhost.amqp_url, ["big"])
    caplog.set_level("INFO", logger="bridge.red.replay")
    live = Path(cfg.red.state_dir) / rp.LIVE_FILE
    stop = threading.Event()
    out: list[Any] = []
    with raised_memory_alarm():
        t = threading.Thread(target=lambda: out.append(Replayer(cfg).run(stop=stop)))
        t.start()
        t0 = time.monotonic()
        while not (live.exists() and json.loads(live.read_text()).get("broker_blocked")):
            assert time.monotonic() - t0 < 60 and t.is_alive(), "the block was never reported"
            time.sleep(0.1)
        assert metric("bridge_red_replay_broker_blocked") == 1
        time.sleep(1.0)  # the run is in the blocked send now, or waiting for confirms
        stop.set()
        t.join(20)
        assert not t.is_alive(), "a stop did not end a replay blocked by the broker's alarm"
    assert out and out[0].confirmed == 0
    said = [r.getMessage() for r in caplog.records]
    assert any("blocked the replay's connection" in m and r.levelname == "ERROR"
               for m, r in zip(said, caplog.records, strict=True)), said  # fmt: skip
    assert any("stopped while the red broker read nothing" in m for m in said), said
    assert not json.loads(live.read_text())["running"]
    c = Consumer(red_vhost.amqp_url, "big", "")
    try:
        s = Replayer(cfg).run(until_caught_up=True, timeout=60)
        assert s.confirmed == 40
        assert sorted(body_id(m)[1] for m in c.collect(40)) == list(range(40))
    finally:
        c.close()
    assert metric("bridge_red_replay_broker_blocked") == 0


@pytestmark_broker
def test_audit_sink_writes_replay_events_with_their_own_app_id(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    x = ExchangeDecl("au", "fanout", False)
    # a queue bound on red: nothing is returned (unroutable returns have a test of their own;
    # when they reach the sink in its own commit depends on timing)
    admin.channel().exchange_declare("au", "fanout")
    admin.channel().queue_declare("au-q")
    admin.channel().queue_bind("au-q", "au", "")
    land(tables, 1, rows("c1", range(4), x))
    cfg = make_cfg(tmp_path, red_vhost.amqp_url, ["au"])
    Replayer(cfg, sink=rp.audit_sink(cfg)).run(until_caught_up=True, timeout=20)
    land(tables, 2, rows("c1", range(4, 6), x))
    Replayer(cfg, sink=rp.audit_sink(cfg)).run(until_caught_up=True, timeout=20)
    dt = DeltaTable(str(tables.path("audit")))
    assert dt.transaction_version(rp.APP_ID) == 2
    got = sorted(
        (r["event"], r["exchange"], r["channel"], r["seq_first"], r["seq_last"])
        for r in dt.to_pyarrow_table().to_pylist()
    )
    assert got == [("replayed", "au", "c1", 0, 3), ("replayed", "au", "c1", 4, 5)]


@pytestmark_broker
def test_missing_empty_and_unreadable_tables_do_not_stop_the_publisher(
    tmp_path: Path, red_vhost: Vhost
) -> None:
    cfg = make_cfg(tmp_path, red_vhost.amqp_url, ["t"])
    s = Replayer(cfg).run(until_caught_up=True, timeout=10)  # the red job has not run yet
    assert s.caught_up and s.confirmed == 0 and "no messages table" in s.errors[0]
    tables = RedTables(tmp_path / "tables", "delta-rs")
    tables.ensure()
    s = Replayer(cfg).run(until_caught_up=True, timeout=10)  # created, still empty
    assert s.caught_up and not s.errors
    land(tables, 1, rows("c1", range(3), ExchangeDecl("t", "fanout", False)))
    for f in (tmp_path / "tables" / "messages").rglob("*.parquet"):
        f.unlink()  # a data file lost under the table
    s = Replayer(cfg).run(until_caught_up=True, timeout=1.0)
    assert not s.caught_up and s.confirmed == 0
    assert any("unreadable" in e for e in s.errors), s.errors


# ---------------------------------------------------------------------------- hold-back
def save_state(tmp: Path, land_seq: int, bundles: Sequence[tuple[int, int, int]]) -> None:
    """The landing's state after ``land_seq``: bundles ``(bundle_seq, first, last)`` of c1."""
    state = sq.SequenceState()
    for n, a, b in bundles:
        facts = sq.BundleFacts("c1", n, f"id{n}", f"{n:064x}", None, b - a + 1, a, b)
        sq.admit(state, facts, NOW)
    doc = {"land_seq": land_seq, "sequence": state.to_json(), "udp_gaps_offset": 0}
    (tmp / "state").mkdir(exist_ok=True)
    (tmp / "state" / STATE_FILE).write_text(json.dumps(doc))


HOLD_X = ExchangeDecl("x.hold", "fanout", True, False, False, {})


def hold_consumer(admin: Connection, url: str) -> Consumer:
    admin.channel().exchange_declare(HOLD_X.name, "fanout", durable=True)
    return Consumer(url, HOLD_X.name)


def events_of(res: Any, kind: str) -> list[dict[str, Any]]:
    return [e for e in res.events if e["event"] == kind]


def with_gap(
    tmp: Path, tables: RedTables, admin: Connection, url: str, hold: float
) -> tuple[Config, Consumer, datetime]:
    """c1's bundles 1 (seqs 0-9) and 3 (20-29) landed just now, bundle 2 (10-19) missing; a
    consumer bound to the exchange on red."""
    cfg = make_cfg(tmp, url, [HOLD_X.name], gap_hold_seconds=hold)
    now = datetime.now(UTC)
    consumer = hold_consumer(admin, url)
    land(tables, 1, rows("c1", range(0, 10), HOLD_X), landed_at=now)
    land(tables, 2, rows("c1", range(20, 30), HOLD_X), landed_at=now)
    save_state(tmp, 2, [(1, 0, 9), (3, 20, 29)])
    return cfg, consumer, now


@pytestmark_broker
def test_replay_holds_an_exchange_at_a_gap_until_the_missing_bundle_lands(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    cfg, consumer, now = with_gap(tmp_path, tables, admin, red_vhost.amqp_url, hold=120)
    try:
        with Replayer(cfg) as r:
            s1 = r.step()
            assert (s1.confirmed, s1.held, s1.caught_up) == (10, 1, False), s1
            held = r.status()["exchanges"][HOLD_X.name]["held"]
            assert (held["channel"], held["seq"], held["first_bundle_seq"]) == ("c1", 20, 2)
            assert metric("bridge_red_replay_held_exchanges") == 1
            # `diode red status` runs in another process: it reads what the replay wrote
            outside = report_replay_status(cfg)
            assert outside["exchanges"][HOLD_X.name]["held"] == held
            assert outside["live"]["running"] and outside["live"]["pid"] == os.getpid()
            assert outside["live"]["age_seconds"] < 60
            assert r.step().published == 0  # still waiting
            land(tables, 3, rows("c1", range(10, 20), HOLD_X), landed_at=now)
            assert r.step().published == 0  # landed, but the state does not know it yet
            save_state(tmp_path, 3, [(1, 0, 9), (3, 20, 29), (2, 10, 19)])
            s4 = r.step()
            assert (s4.confirmed, s4.held) == (20, 0), s4
            s5 = r.step()
            assert (s5.published, s5.caught_up) == (0, True), s5
            assert not events_of(s4, "replay_gap_passed")
            assert not events_of(s4, "replayed_out_of_order")
        got = consumer.collect(30)
        assert [body_id(m)[1] for m in consumer.quiet(0.3)] == list(range(30)), got
        progress = rp.load_progress(tmp_path / "state")[HOLD_X.name]
        assert progress.key == (3, "c1", 19) and progress.high == {"c1": 29}
        after = report_replay_status(cfg)  # closed: no longer running, nothing held
        assert not after["live"]["running"] and after["exchanges"][HOLD_X.name]["held"] is None
        # what another process reads is not trusted: odd entries, or a writer gone silent
        live = tmp_path / "state" / rp.LIVE_FILE
        live.write_text(json.dumps({"running": True, "exchanges": {HOLD_X.name: 1, "y": []}}))
        odd = report_replay_status(cfg)["exchanges"]
        assert odd[HOLD_X.name]["held"] is None and odd["y"]["in_flight"] == 0
        live.write_text(json.dumps({"running": True, "exchanges": {HOLD_X.name: {"held": 1}}}))
        os.utime(live, (time.time() - 60, time.time() - 60))  # a replay killed -9 a minute ago
        stale = report_replay_status(cfg)
        assert stale["live"]["stale"] and stale["exchanges"][HOLD_X.name]["held"] is None
        again = Replayer(cfg).run(until_caught_up=True, timeout=20)
        assert again.caught_up and again.published == 0
    finally:
        consumer.close()


@pytestmark_broker
def test_replay_goes_past_a_gap_after_the_hold_and_audits_late_rows_out_of_order(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    cfg, consumer, now = with_gap(tmp_path, tables, admin, red_vhost.amqp_url, hold=1.0)
    passed_before = metric("bridge_red_replay_gaps_passed_total", exchange=HOLD_X.name)
    late_before = metric("bridge_red_replay_out_of_order_total", exchange=HOLD_X.name)
    try:
        with Replayer(cfg) as r:
            assert r.step().held == 1
            time.sleep(max(0.0, (now - datetime.now(UTC)).total_seconds() + 1.05))
            s2 = r.step()
            assert (s2.confirmed, s2.held) == (10, 0), s2
            (ev,) = events_of(s2, "replay_gap_passed")
            assert (ev["channel"], ev["seq_first"], ev["reason"]) == ("c1", 20, "hold_expired")
            detail = json.loads(ev["detail"])
            assert (detail["first_bundle_seq"], detail["last_bundle_seq"]) == (2, 2)
            assert detail["held_seconds"] >= 1.0
            land(tables, 3, rows("c1", range(10, 20), HOLD_X), landed_at=datetime.now(UTC))
            save_state(tmp_path, 3, [(1, 0, 9), (3, 20, 29), (2, 10, 19)])
            s3 = r.step()
            assert s3.confirmed == 10, s3
            (late,) = events_of(s3, "replayed_out_of_order")
            assert (late["channel"], late["seq_first"], late["seq_last"]) == ("c1", 10, 19)
            assert json.loads(late["detail"]) == {"rows": 10, "behind_seq": 29}
        got = [body_id(m)[1] for m in consumer.collect(30)]
        assert got == [*range(10), *range(20, 30), *range(10, 20)]
        assert metric("bridge_red_replay_gaps_passed_total", exchange=HOLD_X.name) == (
            passed_before + 1)  # fmt: skip
        assert metric("bridge_red_replay_out_of_order_total", exchange=HOLD_X.name) == (
            late_before + 10)  # fmt: skip
        saved = rp.load_progress(tmp_path / "state")[HOLD_X.name]
        assert saved.passed == {"c1": 20} and saved.high == {"c1": 29}
        again = Replayer(cfg).run(until_caught_up=True, timeout=20)
        assert again.caught_up and again.published == 0 and not again.events
    finally:
        consumer.close()


@pytestmark_broker
@pytest.mark.parametrize("tail", [True, False], ids=["more-after", "filler-last"])
def test_a_replay_behind_the_landing_publishes_a_late_bundle_in_seq_order(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection, tail: bool
) -> None:
    """Bundle 2 landed after bundle 3 (a resend) before the replay read either: batches of one
    landing each, so bundle 2's rows are read ahead as fillers, published once, in seq order.
    With nothing landed after them, the progress still moves over them (no republish)."""
    url = red_vhost.amqp_url
    cfg = make_cfg(tmp_path, url, [HOLD_X.name], batch_rows=10)
    consumer = hold_consumer(admin, url)
    land(tables, 1, rows("c1", range(0, 10), HOLD_X))
    land(tables, 2, rows("c1", range(20, 30), HOLD_X))
    land(tables, 3, rows("c1", range(10, 20), HOLD_X))
    bundles = [(1, 0, 9), (3, 20, 29), (2, 10, 19)]
    n, last = 30, (3, "c1", 19)
    if tail:
        land(tables, 4, rows("c1", range(30, 35), HOLD_X))
        bundles.append((4, 30, 34))
        n, last = 35, (4, "c1", 34)
    save_state(tmp_path, len(bundles), bundles)
    try:
        s = Replayer(cfg).run(until_caught_up=True, timeout=30)
        assert s.caught_up and s.confirmed == n and not s.errors, s
        assert not [e for e in s.events if e["event"] != "replayed"]
        got = [body_id(m)[1] for m in consumer.collect(n)]
        assert [body_id(m)[1] for m in consumer.quiet(0.3)] == list(range(n)), got
        assert rp.load_progress(tmp_path / "state")[HOLD_X.name].key == last
        again = Replayer(cfg).run(until_caught_up=True, timeout=20)
        assert again.caught_up and again.published == 0
    finally:
        consumer.close()


# ---------------------------------------------------------------------------- review fixes
def save_bundles(tmp: Path, land_seq: int, bundles: Sequence[tuple[int, int, int]]) -> None:
    """``save_state`` with each bundle admitted just now (rows landed now are still held)."""
    state = sq.SequenceState()
    now = datetime.now(UTC)
    for n, a, b in bundles:
        sq.admit(state, sq.BundleFacts("c1", n, f"id{n}", f"{n:064x}", None, b - a + 1, a, b), now)
    doc = {"land_seq": land_seq, "sequence": state.to_json(), "udp_gaps_offset": 0}
    (tmp / "state").mkdir(exist_ok=True)
    (tmp / "state" / STATE_FILE).write_text(json.dumps(doc))


@pytestmark_broker
@pytest.mark.parametrize("cut", ["hold", "restart"])
def test_rows_read_ahead_are_published_once_when_the_batch_is_cut_or_the_publisher_restarts(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection, cut: str
) -> None:
    """Bundle 2 (seqs 5-9) lands late: its rows are read ahead as fillers and published before
    10-14. They are not published again when the replay reads them in key order later: not when
    that batch is cut by the hold-back (bundle 4 missing), not after a graceful restart."""
    url = red_vhost.amqp_url
    cfg = make_cfg(tmp_path, url, [HOLD_X.name], gap_hold_seconds=3600, batch_rows=5)
    consumer = hold_consumer(admin, url)
    now = datetime.now(UTC)
    bundles = [(1, 0, 4), (3, 10, 14)]
    land(tables, 1, rows("c1", range(0, 5), HOLD_X), landed_at=now)
    land(tables, 2, rows("c1", range(10, 15), HOLD_X), landed_at=now)
    save_bundles(tmp_path, 2, bundles)
    try:
        r = Replayer(cfg)
        assert r.step().confirmed == 5  # held at 10: bundle 2 missing
        if cut == "hold":  # bundle 2 comes late with bundle 5; bundle 4 still missing
            bundles += [(2, 5, 9), (5, 20, 24)]
            land(tables, 3, rows("c1", range(5, 10), HOLD_X), rows("c1", range(20, 25), HOLD_X),
                 landed_at=now)  # fmt: skip
            save_bundles(tmp_path, 3, bundles)
            assert r.step().confirmed == 10  # 5-9 read ahead, then 10-14
            assert r.step().published == 0  # landing 3: 5-9 done, 20-24 held
            land(tables, 4, rows("c1", range(15, 20), HOLD_X), landed_at=now)
            bundles.append((4, 15, 19))
            save_bundles(tmp_path, 4, bundles)
            n, last = 25, (4, "c1", 19)
        else:
            bundles.append((2, 5, 9))
            land(tables, 3, rows("c1", range(5, 10), HOLD_X), landed_at=now)
            save_bundles(tmp_path, 3, bundles)
            assert r.step().confirmed == 10
            r.close()  # graceful stop: what was published ahead is in the saved progress
            saved = json.loads((tmp_path / "state" / rp.PROGRESS_FILE).read_text())
            assert saved["exchanges"][HOLD_X.name]["ahead"] == [[3, "c1", 5, 9]]
            r = Replayer(cfg)
            n, last = 15, (3, "c1", 9)
        s = r.run(until_caught_up=True, timeout=20)
        assert s.caught_up and not s.errors, s
        assert not [e for e in s.events if e["event"] != "replayed"], s.events
        consumer.collect(n)
        assert [body_id(m)[1] for m in consumer.quiet(0.5)] == list(range(n))
        progress = rp.load_progress(tmp_path / "state")[HOLD_X.name]
        assert progress.key == last and not progress.ahead  # passed: forgotten
    finally:
        consumer.close()


BAD_ROWS = {
    # black lands non-UTF-8 name bytes as U+FFFD (3 bytes): a legal 100-byte key becomes 300
    "long_routing_key": ("\ufffd" * 100, PLAIN, "routing key is 300 bytes"),
    "truncated_properties": ("rk", b"\x80\x00\x10abc", "property bytes do not parse"),
    "continuation_flag": ("rk", b"\x00\x01\x00\x00", "continuation flag"),
    "bad_header_table": ("rk", b"\x20\x00\x00\x00\x00\x03\x01kS", "property bytes do not parse"),
    "over_frame_max": (
        "rk",
        encode_properties(Properties(headers=field_table({"blob": "x" * 140_000}))),
        "exceeds the red broker's frame_max",
    ),
}


@pytestmark_broker
@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_a_row_the_broker_cannot_take_is_skipped_and_reported_and_the_rest_goes_on(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection, kind: str
) -> None:
    """Such a row used to crash the publisher at every start (routing key) or make the broker
    close the connection at every publish (properties): nothing else was ever confirmed."""
    url = red_vhost.amqp_url
    rk, props, why = BAD_ROWS[kind]
    bad, good = ExchangeDecl("bad.x", "fanout", True), ExchangeDecl("good.x", "fanout", True)
    for x in (bad, good):
        admin.channel().exchange_declare(x.name, "fanout", durable=True)
    cb, cg = Consumer(url, bad.name), Consumer(url, good.name)
    land(tables, 1, rows("c1", [0], bad), rows("c1", [1], bad, props=props, routing_key=rk),
         rows("c1", [2], bad), rows("c2", range(50), good))  # fmt: skip
    cfg = make_cfg(tmp_path, url, [bad.name, good.name])
    before = metric("bridge_red_replay_errors_total", exchange=bad.name, kind="bad_row")
    try:
        s = Replayer(cfg).run(until_caught_up=True, timeout=20)
        assert s.caught_up and s.confirmed == 52, s
        (ev,) = [e for e in s.events if e["event"] == "replay_failed"]
        assert (ev["exchange"], ev["channel"], ev["seq_first"], ev["seq_last"]) == (
            bad.name, "c1", 1, 1)  # fmt: skip
        assert json.loads(ev["detail"])["kind"] == "bad_row" and why in ev["reason"]
        assert "seq 1" in ev["reason"] and "skipped" in ev["reason"]
        assert metric("bridge_red_replay_errors_total", exchange=bad.name, kind="bad_row") == (
            before + 1)  # fmt: skip
        cb.collect(2)
        assert [body_id(m)[1] for m in cb.quiet(0.3)] == [0, 2]
        assert len(cg.collect(50)) == 50
        assert rp.load_progress(tmp_path / "state")[bad.name].seq == 2
        again = Replayer(cfg).run(until_caught_up=True, timeout=10)
        assert again.caught_up and again.published == 0 and not again.events
    finally:
        cb.close()
        cg.close()


@pytestmark_broker
def test_a_row_that_makes_the_broker_close_the_connection_stops_only_its_exchange(
    tmp_path: Path,
    tables: RedTables,
    red_vhost: Vhost,
    admin: Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row the checks let through but the broker refuses at connection level (simulated by
    disabling the pure pre-publish check): the publisher backs off (no reconnect every second),
    finds the row by publishing the suspects one row at a time, stops that exchange with a
    `replay_failed` naming the row, and every other exchange is confirmed."""
    monkeypatch.setattr(rp, "row_problem", lambda *a, **k: None, raising=False)
    url = red_vhost.amqp_url
    bad, good = ExchangeDecl("a.bad", "fanout", True), ExchangeDecl("b.good", "fanout", True)
    for x in (bad, good):
        admin.channel().exchange_declare(x.name, "fanout", durable=True)
    cg = Consumer(url, good.name)
    land(tables, 1, rows("c1", [0], bad), rows("c1", [1], bad, props=b"\x80\x00\x10abc"),
         rows("c1", [2], bad), rows("c2", range(50), good))  # fmt: skip
    cfg = make_cfg(tmp_path, url, [bad.name, good.name])
    lost = metric("bridge_red_replay_errors_total", exchange="", kind="connection")
    try:
        s = Replayer(cfg, retry_seconds=3600).run(until_caught_up=True, timeout=30)
        assert not s.caught_up and list(s.stopped) == [bad.name], s  # stopped is not caught up
        (ev,) = [e for e in s.events if e["event"] == "replay_failed" and e["seq_first"] == 1]
        assert (ev["exchange"], ev["channel"], ev["seq_first"]) == (bad.name, "c1", 1)
        assert json.loads(ev["detail"])["kind"] == "connection"
        assert s.exchanges[good.name]["confirmed"] == 50
        assert len(cg.collect(50)) == 50
        closes = metric("bridge_red_replay_errors_total", exchange="", kind="connection") - lost
        assert closes <= rp.MAX_CONNECTION_DEATHS + 1, closes  # no reconnect loop
        assert s.seconds >= 2.5  # backed off 1 s, then 2 s: kept until a publish is confirmed
        assert rp.load_progress(tmp_path / "state")[bad.name].seq == 0
    finally:
        cg.close()


@pytestmark_broker
def test_unroutable_publishes_are_counted_and_audited_never_silent(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, admin: Connection
) -> None:
    """An approved exchange whose rows no binding on red routes: the broker takes (confirms)
    and drops them. The publisher publishes mandatory, reads the returns and reports them
    (audit `replay_failed` kind `unroutable` with the seq range, metric, log); progress goes
    past them."""
    url = red_vhost.amqp_url
    nobody, some = ExchangeDecl("unbound", "direct", True), ExchangeDecl("half", "direct", True)
    admin.channel().exchange_declare(some.name, "direct", durable=True)
    c = Consumer(url, some.name, "a")
    land(tables, 1, rows("c1", range(0, 100), nobody), rows("c2", range(0, 5), some,
         routing_key="a"), rows("c2", range(5, 10), some, routing_key="b"))  # fmt: skip
    land(tables, 2, rows("c2", range(10, 12), some, routing_key="a"))
    cfg = make_cfg(tmp_path, url, [nobody.name, some.name], in_flight=7)
    before = metric("bridge_red_replay_unroutable_total", exchange=nobody.name)
    try:
        s = Replayer(cfg).run(until_caught_up=True, timeout=20)
        assert s.caught_up and s.confirmed == 112 and not s.errors and s.unroutable == 105, s
        failed = [e for e in s.events if e["event"] == "replay_failed"]
        details = [json.loads(e["detail"]) for e in failed]
        assert {d["kind"] for d in details} == {"unroutable"}
        assert all("312 NO_ROUTE" in d["reply"] for d in details)
        # one event per pass that saw returns: how the returns fall into passes is timing
        got: dict[str, list[Any]] = {}
        for e, d in zip(failed, details, strict=True):
            g = got.setdefault(e["exchange"], [e["channel"], e["seq_first"], e["seq_last"], 0])
            assert g[0] == e["channel"]
            g[1], g[2] = min(g[1], e["seq_first"]), max(g[2], e["seq_last"])
            g[3] += d["rows"]
        assert got == {nobody.name: ["c1", 0, 99, 100], some.name: ["c2", 5, 9, 5]}
        assert metric("bridge_red_replay_unroutable_total", exchange=nobody.name) == before + 100
        assert [body_id(m)[1] for m in c.collect(7)] == [0, 1, 2, 3, 4, 10, 11]
        assert rp.load_progress(tmp_path / "state")[nobody.name].seq == 99
    finally:
        c.close()


CRASHED_AFTER_SAVE = KILLED_RUN.replace(
    "Replayer(cfg, sink=sink if sink_path else None).run()",
    "import bridge.red.replay as rp\n"
    "rp.SAVE_EVERY = 0.0  # save at every chance: the first one is the crash\n"
    "Replayer(cfg, sink=sink).run(until_caught_up=True, timeout=60)",
)


def crash_after_save(tmp_path: Path, spec: dict[str, Any]) -> Path:
    """Run a replay of ``spec`` in a child killed -9 right after its first progress save
    (crash point ``red.replay_after_save``), asserting the crash hit that window; returns the
    file the child's audit sink wrote to."""
    audit, mark = tmp_path / "audit.jsonl", tmp_path / "crash.mark"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "DIODE_CRASH_AT": "red.replay_after_save", "DIODE_CRASH_MARK": str(mark)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", CRASHED_AFTER_SAVE, json.dumps(spec), str(audit)],
        env=env, timeout=120, check=False, start_new_session=True,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL and mark.read_text().split() == [
        "red.replay_after_save"
    ]  # the crash hit the window it names
    return audit


@pytestmark_broker
def test_a_crash_just_after_a_progress_save_loses_no_unroutable_audit(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost
) -> None:
    """Progress is saved past returned (unroutable) rows only once their `replay_failed`
    events reached the audit: killed right after a save, every unroutable row is still
    audited by the killed run or the next one, never skipped unaudited."""
    url = red_vhost.amqp_url
    nobody = ExchangeDecl("unbound", "direct", True)
    land(tables, 1, rows("c1", range(2000), nobody))
    spec = {
        "channels": [{"name": "c1", "encrypt": False}],
        "red": {
            "state_dir": str(tmp_path / "state"),
            "tables_dir": str(tmp_path / "tables"),
            "replay": {"amqp_url": url, "approved": ["unbound"], "in_flight": 64},
        },
    }
    audit = crash_after_save(tmp_path, spec)
    saved = rp.load_progress(tmp_path / "state")["unbound"].seq
    assert saved >= 0  # the progress went past some unroutable rows before the crash
    sunk: list[dict[str, Any]] = []
    s = Replayer(make_cfg(tmp_path, url, ["unbound"]), sink=sunk.extend).run(
        until_caught_up=True, timeout=60
    )
    assert s.caught_up, s
    covered: set[int] = set()
    for e in (json_lines(audit) if audit.exists() else []) + sunk:
        if e["event"] == "replay_failed" and json.loads(e["detail"])["kind"] == "unroutable":
            covered.update(range(e["seq_first"], e["seq_last"] + 1))
    assert set(range(saved + 1)) <= covered, sorted(set(range(saved + 1)) - covered)[:10]
    assert covered == set(range(2000))


@pytestmark_broker
def test_a_compacted_file_is_read_in_batches_of_batch_rows(
    tmp_path: Path, tables: RedTables, red_vhost: Vhost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`diode red maintain` compacts many landings into one file: a batch is still about
    `batch_rows` rows (not the whole file), and `batch_bytes` bounds it by size."""
    x = ExchangeDecl("compact", "fanout", True)
    for ls in range(1, 41):
        land(tables, ls, rows("c1", range((ls - 1) * 50, ls * 50), x, body_size=2000))
    tables.maintain("messages")
    assert DeltaTable(str(tables.path("messages"))).get_add_actions(flatten=True).num_rows == 1
    seen: list[int] = []
    real = rp.MessagesTable.read

    def counting(self: Any, *a: Any, **k: Any) -> Any:  # a spy: the real read, counted
        b, hi = real(self, *a, **k)
        if b is not None:
            seen.append(b.num_rows)
        return b, hi

    monkeypatch.setattr(rp.MessagesTable, "read", counting)
    cfg = make_cfg(tmp_path, red_vhost.amqp_url, [x.name], batch_rows=200)
    s = Replayer(cfg).run(until_caught_up=True, timeout=30)
    assert s.caught_up and s.confirmed == 2000, s
    assert sum(seen) == 2000 and max(seen) <= 250, seen
    seen.clear()
    (tmp_path / "state" / rp.PROGRESS_FILE).unlink()
    tiny = make_cfg(tmp_path, red_vhost.amqp_url, [x.name], batch_rows=2000,
                    batch_bytes=1024 * 1024)  # fmt: skip
    s = Replayer(tiny).run(until_caught_up=True, timeout=30)
    assert s.caught_up and s.confirmed == 2000, s
    assert max(seen[1:]) <= 600, seen  # ~2 KB rows: 1 MiB is about 500 of them
