"""Integration: RabbitMQ (fanout/topic/headers/direct) -> mirror queue -> tap -> spool -> black
Spark job -> bundles, taken by a greedy mover the moment they appear, read back with the plain
gpg command line and pyarrow alone (no bridge code on the reading side, except the property
codec to compare decoded values)."""

from __future__ import annotations

import decimal
import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pika
import pyarrow.parquet as pq
import pytest

import bridge.black.job as job_module
from bridge.black.job import BlackRun
from bridge.black.state import StateStore
from bridge.config import load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import init_keys
from bridge.protocol.headers import typed_json_to_headers
from bridge.protocol.properties import (
    ByteArray,
    Float32,
    Float64,
    Int8,
    Int16,
    Int64,
    LongString,
    Properties,
    Timestamp,
    UInt8,
    UInt16,
    UInt32,
    decode_properties,
    encode_properties,
    field_table,
)
from tests.mover import greedy_mover  # noqa: F401 - the fixture
from tests.support import AMQP_PROPERTIES, foreign_checkpoint, gpg_open_cli, publish_confirmed

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

EXCHANGES = [("fan", "fanout"), ("top", "topic"), ("hdr", "headers"), ("dir", "direct")]


def write_config(work: Path, amqp_url: str, black_fpr: str, red: list[str], **bundle: Any) -> Path:
    extra = "\n".join(f"{k} = {v}" for k, v in bundle.items())
    (work / "diode.toml").write_text(
        f"""
[link]
bridge_id = "it-black"
black_signers = ["{black_fpr}"]

[[channels]]
name = "main"
exchanges = ["*"]
recipients = [{", ".join(f'"{r}"' for r in red)}]
[channels.direct_routing_keys]
"dir" = ["k1", "k2"]

[black]
amqp_url = "{amqp_url}"
gnupg_home = "keys/black"
signing_key = "{black_fpr}"
trigger_seconds = 1.0
heartbeat_seconds = 2.0
max_messages_per_batch = 1500

[black.bundle]
{extra}
"""
    )
    return work / "diode.toml"


def declare(url: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    for name, kind in EXCHANGES:
        ch.exchange_declare(name, kind, durable=True)
    conn.close()


def every_type(i: int) -> Any:
    """A header table with every AMQP 0-9-1 field type, nested, in a fixed key order."""
    return field_table(
        {
            "i32": i, "i8": Int8(-(i % 128)), "u8": UInt8(i % 256), "i16": Int16(-i),
            "u16": UInt16(i % 65536), "u32": UInt32(2**32 - 1 - i), "i64": Int64(-(2**40) - i),
            "f": Float32(1.5), "d": Float64(i / 7), "dec": decimal.Decimal("-12.340"),
            "s": f"é{i}", "S": LongString(b"\xff\x00 not utf-8"),
            "x": ByteArray(bytes([i % 256, 0])),
            "t": Timestamp(1_700_000_000 + i), "ok": bool(i % 2), "v": None,
            "nest": {"arr": [1, "x", {"deep": ByteArray(b"\x00")}, [Float32(-0.0)]]},
        }
    )  # fmt: skip


def props_for(i: int) -> Properties:
    return Properties(
        content_type="application/octet-stream" if i % 3 else None,
        content_encoding="gzip" if i % 5 == 0 else None,
        headers=None if i % 4 == 1 else every_type(i),
        delivery_mode=1 + i % 2,
        priority=i % 10 if i % 4 == 0 else None,
        correlation_id=f"c{i}" if i % 2 else None,
        reply_to="r" if i % 6 == 0 else None,
        expiration="600000" if i % 8 == 0 else None,
        message_id=f"m{i}",
        timestamp=1_700_000_000 + i if i % 3 == 0 else None,
        type="t" if i % 9 == 0 else None,
        user_id="guest" if i % 10 == 0 else None,
        app_id="it" if i % 11 == 0 else None,
    )


def publish(url: str, n: int) -> list[tuple[str, str, bytes, bytes]]:
    """Publish with the bridge's client (raw property bytes, confirms); returns what was sent."""
    sent = []
    for i in range(n):
        name, kind = EXCHANGES[i % 4]
        rk = {"fanout": "", "topic": f"a.b{i % 7}", "headers": "x", "direct": f"k{1 + i % 2}"}[kind]
        raw = encode_properties(props_for(i))
        body = bytes([i % 256]) * (i % 2000) if i % 13 else b""
        sent.append((name, rk, raw, body))
    unmirrored = ("dir", "not-configured", b"\x00\x00", b"x")  # not mirrored, by design
    publish_confirmed(url, [*sent, unmirrored])
    return sent


def read_bundles(folder: Path, red_home: Path, black_fpr: str) -> list[tuple[dict, Any, str]]:
    out = []
    for f in sorted(folder.glob("*.dbundle")):
        plain = gpg_open_cli(red_home, f, black_fpr)
        pf = pq.ParquetFile(io.BytesIO(plain))
        manifest = json.loads(pf.metadata.metadata[b"diode.manifest"])
        out.append((manifest, pf.read(), hashlib.sha256(plain).hexdigest()))
    return out


def black_run(black_vhost: Any, work: Path) -> tuple[Any, BlackRun]:
    """Keys, the config and the exchanges of a fresh black under ``work``, and its job."""
    inv = init_keys(work / "keys", red_names=("red",))
    cfg = load_config(
        write_config(work, black_vhost.amqp_url, inv.black_fpr, list(inv.red_fprs.values()))
    )
    declare(black_vhost.amqp_url)
    return cfg, BlackRun(cfg)


def record_queries(run: BlackRun) -> list[str]:
    """The trigger of every query ``run`` starts, in order."""
    started: list[str] = []
    start = run.start_query

    def recording(spark: Any, trigger: Any, **kw: Any) -> Any:
        started.append(trigger)
        return start(spark, trigger, **kw)

    run.start_query = recording  # type: ignore[method-assign]
    return started


def test_every_message_once_and_identical(  # type: ignore[no-untyped-def]
    black_vhost,
    short_tmp: Path,
    spark,
    greedy_mover,  # noqa: F811
) -> None:
    inv = init_keys(short_tmp / "keys", red_names=("red", "audit"))
    cfg_path = write_config(
        short_tmp, black_vhost.amqp_url, inv.black_fpr, list(inv.red_fprs.values()), max_rows=700
    )
    cfg = load_config(cfg_path)
    declare(black_vhost.amqp_url)
    run = BlackRun(cfg)
    report = run.mirror.sync()
    assert "main" in str(report)
    n = 4000
    sent = publish(black_vhost.amqp_url, n)

    # a pika producer sending a decimal header keeps its connection (a stream mirror closed it)
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    pch = conn.channel()
    pch.confirm_delivery()
    dec = pika.BasicProperties(headers={"price": decimal.Decimal("9.99")})
    pch.basic_publish("fan", "", b"decimal", dec)
    pch.basic_publish("fan", "", b"after", pika.BasicProperties())
    assert conn.is_open and pch.is_open
    conn.close()

    mover = greedy_mover(cfg.black.outbox)
    queries = record_queries(run)
    summary = run.run(spark, "available-now", timeout=300)
    assert summary.messages == n + 2 and summary.lost == 0
    assert queries == ["drain"], "a scheduled run seals with one query while the taps drain"
    mover.stop()
    taken = mover.validate(Gpg(inv.red_home), [inv.black_fpr])
    assert taken.bundles and taken.heartbeats, "the mover only ever saw whole, valid files"

    bundles = read_bundles(mover.dst, inv.red_home, inv.black_fpr)
    assert [m["bundle_seq"] for m, _, _ in bundles] == list(range(1, len(bundles) + 1))
    prev = None
    rows: list[dict[str, Any]] = []
    for m, table, sha in bundles:
        assert m["format"] == 1 and m["schema_version"] == 2 and m["channel"] == "main"
        assert m["prev_sha256"] == prev, f"hash chain broken at bundle {m['bundle_seq']}"
        assert m["gaps"] == [] and m["rows"] == table.num_rows <= 700
        seqs = table.column("seq").to_pylist()
        assert seqs == sorted(seqs) and (m["first_seq"], m["last_seq"]) == (seqs[0], seqs[-1])
        prev = sha
        rows.extend(table.to_pylist())

    assert [r["seq"] for r in rows] == list(range(n + 2)), "seqs gapless, each message once"
    types = dict(EXCHANGES)
    for r, (name, rk, raw, body) in zip(rows, sent, strict=False):
        assert (r["exchange"], r["routing_key"], r["body"]) == (name, rk, body)
        assert r["exchange_type"] == types[name] and r["exchange_durable"] is True
        assert r["properties_raw"] == raw, f"property bytes changed at seq {r['seq']}"
        want = decode_properties(raw)
        for f in AMQP_PROPERTIES:
            assert r[f] == getattr(want, f), (f, r["seq"])
        got = None if r["headers_typed"] is None else typed_json_to_headers(r["headers_typed"])
        assert got == want.headers, r["seq"]
        if want.headers:
            assert dict(r["headers"])["s"] == f"é{r['seq']}"  # queryable rendering
    tail = rows[n:]
    assert [r["body"] for r in tail] == [b"decimal", b"after"]
    assert decode_properties(tail[0]["properties_raw"]).headers == (
        ("price", ("D", decimal.Decimal("9.99"))),
    )

    hbs = sorted(mover.dst.glob("*.dheartbeat"))
    hb = json.loads(gpg_open_cli(inv.red_home, hbs[-1], inv.black_fpr))
    assert hb["last_bundle_seq"] == len(bundles) and hb["last_seq"] == n + 1

    # a second run with nothing new ships nothing, and the archive holds every bundle; its
    # heartbeats keep their period while it syncs the mirror at start (slowed down here, as on
    # a broker with thousands of exchanges)
    second = BlackRun(cfg)
    real_sync, outbox = second.mirror.sync, Path(cfg.black.outbox)
    before = {p.name for p in outbox.glob("*.dheartbeat")}
    during: list[str] = []

    def slow_sync() -> Any:
        time.sleep(2.5)  # > heartbeat_seconds
        during.extend(p.name for p in outbox.glob("*.dheartbeat") if p.name not in before)
        return real_sync()

    second.mirror.sync = slow_sync  # type: ignore[method-assign]
    again = second.run(spark, "available-now", timeout=120)
    assert during, "no heartbeat while the mirror synced"
    assert again.bundles == 0
    assert sorted(p.name for p in (cfg.black.archive / "main").iterdir()) == sorted(
        p.name for p in mover.dst.glob("*.dbundle")
    )


def test_a_drain_query_idle_short_of_the_spool_end_leaves_the_rest_to_an_available_now_query(
    black_vhost: Any, short_tmp: Path, spark: Any, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The drain query never sees the journal reach the spool's end (forced): after
    DRAIN_IDLE_TRIGGERS idle triggers an availableNow query seals the rest, once."""
    cfg, run = black_run(black_vhost, short_tmp)
    run.mirror.sync()
    publish(black_vhost.amqp_url, 300)
    monkeypatch.setattr(job_module, "DRAIN_TRIGGER_SECONDS", 0.2)
    monkeypatch.setattr(BlackRun, "_caught_up", lambda self: False)  # the forced fault
    queries = record_queries(run)
    with caplog.at_level("WARNING", logger="bridge.black.job"):
        summary = run.run(spark, "available-now", timeout=300)
    assert queries == ["drain", "available-now"]
    assert any("drain query idle" in r.getMessage() for r in caplog.records), "fault fired"
    assert summary.messages == 300 and summary.lost == 0
    assert StateStore(cfg.black.state_dir).load("main").last_seq == 299


def test_a_sealing_failure_on_the_last_batch_ends_a_scheduled_run_at_once(
    black_vhost: Any, short_tmp: Path, spark: Any
) -> None:
    """Sealing fails on the run's last batch (the archive cannot take the bundle): Spark never
    hands the sink another batch, so the error must be seen without one. The run raises at
    once; it hung until its timeout (for ever without one), holding black.lock and sending
    heartbeats, so nothing told red or the scheduler."""
    from bridge.black.sink import SealingFailed

    cfg, run = black_run(black_vhost, short_tmp)
    run.mirror.sync()
    publish(black_vhost.amqp_url, 10)
    archive = short_tmp / "black" / "archive"
    archive.mkdir(parents=True, exist_ok=True)
    (archive / "main").write_text("not a directory")  # the fault
    t0 = time.monotonic()
    with pytest.raises(
        SealingFailed, match=r"channel .main., spool positions 0\.\.9.*not a directory"
    ):
        run.run(spark, "available-now", timeout=150)
    assert time.monotonic() - t0 < 60, "the failure was seen only at the run's timeout"
    assert StateStore(cfg.black.state_dir).load("main").last_seq == -1  # nothing shipped


def test_an_archive_prune_that_fails_at_the_end_of_a_run_does_not_fail_the_run(
    black_vhost: Any, short_tmp: Path, spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The prune at the end of a run was unguarded: an old bundle black may not delete (the
    archive folder of a retired channel, restored immutable or under another owner) failed a
    run whose bundles were all sealed and shipped, and a scheduler took it for a failed run.
    It is logged and tried again at the next prune, like the continuous job's."""
    from tests.unit.test_black_dirs import refused_dir

    cfg, run = black_run(black_vhost, short_tmp)
    run.mirror.sync()
    publish(black_vhost.amqp_url, 10)
    retired = short_tmp / "black" / "archive" / "retired"
    retired.mkdir(parents=True)
    old = retired / "retired.000000000001.0123456789abcdef.bundle"
    old.write_bytes(b"an old bundle")
    os.utime(old, (0, 0))  # far beyond the retention
    with refused_dir(retired), caplog.at_level("ERROR", logger="bridge.black.heartbeat"):
        summary = run.run(spark, "available-now", timeout=300)
        assert old.exists()  # the case: the prune could not delete it
    assert summary.messages == 10 and summary.lost == 0
    assert any("archive pruning failed" in r.getMessage() for r in caplog.records)
    assert StateStore(cfg.black.state_dir).load("main").last_seq == 9


def test_a_checkpoint_of_another_query_is_a_configuration_error(
    black_vhost: Any, short_tmp: Path, spark: Any
) -> None:
    """black.checkpoint_dir shared with another query (here a rate source's, offset ``0``):
    the source raised ``TypeError: argument of type 'int' is not iterable`` inside the
    query. (Red's ``{"next": N}`` reads as a channel "next" not configured: the run starts
    from the journal, as it should.)"""
    from bridge.black.source import SpoolStreamReader
    from bridge.errors import ConfigError

    cfg, run = black_run(black_vhost, short_tmp)
    reader = SpoolStreamReader({"config": str(cfg.source), "channels": "main"})
    for foreign in (0, {"main": "5"}, {"main": True}, {"main": -1}, [1]):
        with pytest.raises(ConfigError, match="holds another query's checkpoint"):
            reader.latestOffset(foreign, None)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="point black.checkpoint_dir at an empty"):
            reader.partitions(foreign, {"main": 1})  # type: ignore[arg-type]
    foreign_checkpoint(spark, cfg.black.checkpoint_dir)
    with pytest.raises(ConfigError, match=r"holds another query's checkpoint \(offset 0"):
        run.run(spark, "available-now", timeout=120)  # seen by the recovery, before the query
    shutil.rmtree(Path(cfg.black.checkpoint_dir) / "commits")  # nothing committed: the query
    run.mirror.sync()
    publish(black_vhost.amqp_url, 5)  # (with nothing to drain, the run ends before it plans)
    with pytest.raises(ConfigError, match=r"holds another query's checkpoint \(offset 0"):
        BlackRun(cfg).run(spark, "available-now", timeout=120)  # ... sees it, in the source


def test_a_tap_stopped_by_a_configuration_error_ends_a_continuous_run(
    black_vhost: Any, short_tmp: Path, spark: Any
) -> None:
    """The broker refuses the tap (permissions revoked) and the tap exits on a configuration
    error: nothing reaches the spool, so Spark hands the sink no batch to check health on. The
    run must end with that error (systemd restarts on failure); it ran on for ever with no tap,
    heartbeating, and exited 0 when stopped."""
    import threading
    import urllib.parse

    import requests

    from bridge.errors import ConfigError

    cfg, run = black_run(black_vhost, short_tmp)
    api, auth = f"{black_vhost.management_url}/api", ("guest", "guest")
    vq = urllib.parse.quote(black_vhost.name, safe="")
    raised: list[BaseException] = []

    def go() -> None:
        try:
            run.run(spark, "continuous", timeout=150)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not requests.get(f"{api}/vhosts/{vq}/connections", auth=auth, timeout=10).json():
            assert time.monotonic() < deadline and t.is_alive(), "the tap never connected"
            time.sleep(0.3)
        requests.delete(f"{api}/permissions/{vq}/guest", auth=auth, timeout=10)  # the fault
        for c in requests.get(f"{api}/vhosts/{vq}/connections", auth=auth, timeout=10).json():
            requests.delete(f"{api}/connections/{urllib.parse.quote(c['name'], safe='')}",
                            auth=auth, timeout=10)  # fmt: skip
        t0 = time.monotonic()
        t.join(120)
        assert not t.is_alive(), "the run went on without its tap"
        assert time.monotonic() - t0 < 60
    finally:
        everything = {"configure": ".*", "write": ".*", "read": ".*"}
        requests.put(f"{api}/permissions/{vq}/guest", json=everything, auth=auth, timeout=10)
        t.join(150)
    assert len(raised) == 1 and isinstance(raised[0], ConfigError), raised  # exit 2
    assert "the tap of channel 'main' stopped on a configuration error" in str(raised[0])
