"""Scenario: kill -9 the black Spark job mid-run, twice, then finish; nothing lost, nothing twice.

Real broker vhost, real gpg, real Spark in a subprocess (``spark_jobs/black_drain.py``), killed
with SIGKILL on its whole process group (the JVM included). The first kill lands once bundles
are flowing; the second one is aimed at the journal's crash window (a ``pending`` bundle sealed
but not yet delivered), else at a random moment. An ``available-now`` run then drains the rest.

The outbox is then checked with independent tools only — the ``gpg`` command line and
``pyarrow.parquet`` — against what was published: bundle seqs gapless per channel (a re-delivered
bundle must be byte-identical), the hash chain intact, message seqs gapless and each once,
every published message present once with exchange, routing key, body, properties and headers
equal, in publish order, and no gaps.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.black.mirror import Mirror
from bridge.black.streams import stream_bounds
from bridge.config import Config, load_config
from bridge.crypto.keys import init_keys
from bridge.demo.run import write_demo_config
from bridge.demo.traffic import DEMO_EXCHANGES, Published, declare_exchanges, publish_mix
from tests.support import (
    AMQP_PROPERTIES,
    BlackJob,
    bundle_files,
    gpg_open_cli,
    read_plain_bundle,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

CHANNEL = "default"
FIRST_BATCH = 8000
SECOND_BATCH = 2000
PROPS = AMQP_PROPERTIES
EXCHANGE_TYPES = {x.name: x.type for x in DEMO_EXCHANGES}


# --------------------------------------------------------------------------- the job


def read_state(cfg: Config) -> dict[str, Any] | None:
    p = Path(cfg.black.state_dir) / f"channel-{CHANNEL}.json"
    try:
        return json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None  # not written yet (it is replaced atomically, never torn)


def kill_in_crash_window(job: BlackJob, cfg: Config, timeout: float) -> str:
    """SIGKILL the job while the journal holds a pending bundle (sealed, not yet delivered).

    Falls back to a random moment once ``timeout`` passes; returns which it was.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.running():
        st = read_state(cfg)
        if st is not None and st.get("pending"):
            job.kill()
            return f"pending bundle {json.loads(st['pending']['manifest'])['bundle_seq']}"
        time.sleep(0.002)
    time.sleep(random.uniform(0.0, 1.5))
    job.kill()
    return "random moment"


# --------------------------------------------------------------------------- independent reading


def _typed(tagged: list[Any]) -> Any:
    """Decode one value of the typed JSON (DESIGN §3.1 / headers.py), independently."""
    tag, v = tagged
    if tag == "S":
        return ("str", v)
    if tag == "x":
        return ("bytes", base64.b64decode(v))
    if tag == "t":
        return ("bool", v)
    if tag in ("I", "l"):
        return ("int", v)
    if tag == "T":
        return ("datetime", dt.datetime.fromtimestamp(v, tz=dt.UTC))
    if tag == "V":
        return ("none", None)
    if tag == "F":
        return ("table", [(k, _typed(x)) for k, x in v.items()])  # AMQP order kept
    if tag == "A":
        return ("array", [_typed(x) for x in v])
    raise AssertionError(f"unexpected typed-JSON tag {tag!r} in a demo message")


def _published(v: Any) -> Any:
    """The same shape for what the demo publisher handed to pika."""
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, int):
        return ("int", v)
    if isinstance(v, str):
        return ("str", v)
    if isinstance(v, bytes):
        return ("bytes", v)
    if isinstance(v, dt.datetime):
        return ("datetime", v.astimezone(dt.UTC))
    if v is None:
        return ("none", None)
    if isinstance(v, dict):
        return ("table", [(k, _published(x)) for k, x in v.items()])
    if isinstance(v, list):
        return ("array", [_published(x) for x in v])
    raise AssertionError(f"unexpected header value {v!r}")


def check_message(row: dict[str, Any], sent: tuple[str, str, Any, bytes], seq: int) -> None:
    ex, rk, props, body = sent
    where = f"seq {seq}"
    assert row["exchange"] == ex, where
    assert row["exchange_type"] == EXCHANGE_TYPES[ex], where
    assert row["routing_key"] == rk, where
    assert row["body"] == body, where
    for name in PROPS:
        assert row[name] == getattr(props, name), f"{where}: property {name}"
    if props.headers is None:
        assert row["headers_typed"] is None, f"{where}: headers"
        return
    got = dict(_typed(["F", json.loads(row["headers_typed"])])[1])
    want = dict(_published(props.headers)[1])
    # RabbitMQ 3.10 streams store AMQP 0-9-1 messages as AMQP 1.0: header keys come back
    # sorted, and nested-table / array values are dropped by the broker (measured with plain
    # pika against a classic queue; see the report). Black can only seal what it receives, so
    # here: every scalar header exactly, containers equal when the broker kept them.
    assert set(got) <= set(want), f"{where}: headers black never received: {set(got) - set(want)}"
    for k, v in want.items():
        if v[0] in ("table", "array") and k not in got:
            continue
        assert got.get(k) == v, f"{where}: header {k!r}"


# --------------------------------------------------------------------------- the scenario


def test_kill_9_black_job_twice_loses_and_duplicates_nothing(
    black_vhost: Any, short_tmp: Path
) -> None:
    t0 = time.monotonic()
    work = short_tmp / "w"
    work.mkdir()
    inv = init_keys(work / "keys", red_names=("red", "red-audit"), bridge_id="demo-black")
    red_fprs = list(inv.red_fprs.values())
    declare_exchanges(black_vhost.amqp_url)
    cfg_path = write_demo_config(
        work,
        black_fpr=inv.black_fpr,
        red_fprs=red_fprs,
        amqp_url=black_vhost.amqp_url,
        mgmt=black_vhost.management_url,
    )
    text = cfg_path.read_text()
    for old, new in (
        ("trigger_seconds = 2.0", "trigger_seconds = 1.0\nmax_messages_per_batch = 1500"),
        ("heartbeat_seconds = 5.0", "heartbeat_seconds = 3.0"),
        ("max_rows = 5000\n", "max_rows = 500\n"),
    ):
        assert old in text, f"demo config changed: {old!r} not found"
        text = text.replace(old, new)
    cfg_path.write_text(text)
    cfg = load_config(cfg_path, environ={})
    assert cfg.black.bundle.max_rows == 500 and cfg.black.max_messages_per_batch == 1500
    outbox = Path(cfg.black.outbox)

    Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json").sync()
    sent = publish_mix(black_vhost.amqp_url, FIRST_BATCH, keep=True, big_every=0)
    wait_for(lambda: stream_bounds(cfg, CHANNEL)[1] >= sent.count, 60, "the stream to hold batch 1")

    jobs: list[BlackJob] = []
    kills: list[str] = []
    try:
        # run 1: continuous, killed once bundles flow
        job = BlackJob(cfg_path, "continuous", work, tag="job1")
        jobs.append(job)
        wait_for(lambda: len(bundle_files(outbox)) >= 2, 90, "2 bundles in the outbox", job)
        job.kill()
        kills.append(f"after {len(bundle_files(outbox))} bundles")

        # more traffic while black is down
        more = publish_mix(black_vhost.amqp_url, SECOND_BATCH, keep=True, big_every=0, seed=11)
        sent = Published(count=sent.count + more.count, messages=sent.messages + more.messages)

        # run 2: continuous again, killed inside the crash window (or at a random moment)
        job = BlackJob(cfg_path, "continuous", work, tag="job2")
        jobs.append(job)
        n_before = len(bundle_files(outbox))
        wait_for(
            lambda: len(bundle_files(outbox)) > n_before,
            90,
            "a new bundle after restart",
            job,
            poll=0.01,
        )
        kills.append(kill_in_crash_window(job, cfg, timeout=20))
        st = read_state(cfg)
        interrupted = st["pending"] if st and st.get("pending") else None

        # run 3: available-now drains everything and exits
        job = BlackJob(cfg_path, "available-now", work, tag="job3")
        jobs.append(job)
        rc = job.wait(timeout=max(30.0, 170 - (time.monotonic() - t0)))
        assert rc == 0, f"available-now run failed ({rc}):\n{job.tail()}"
        lines = [x for x in job.stdout_path.read_text().splitlines() if x.startswith('{"batches"')]
        assert lines, f"no summary printed:\n{job.tail()}"
        summary = json.loads(lines[-1])
        assert summary["lost"] == 0, summary
    finally:
        for j in jobs:
            if j.running():
                j.kill()
    leftovers = sorted(p.name for p in outbox.iterdir() if p.name.startswith("."))
    print(
        f"kills: {kills}; interrupted: {bool(interrupted)}; bundles: "
        f"{len(bundle_files(outbox))}; hidden leftovers: {leftovers}; "
        f"{time.monotonic() - t0:.1f}s"
    )

    # ---- read the outbox back with the gpg CLI and pyarrow.parquet only
    by_seq: dict[int, list[tuple[str, dict[str, Any], list[dict[str, Any]]]]] = {}
    for p in bundle_files(outbox):
        assert p.stat().st_size <= cfg.black.bundle.max_file_bytes
        plain = gpg_open_cli(inv.red_home, p, inv.black_fpr)
        manifest, rows = read_plain_bundle(plain)
        channel, seq_txt, bundle_id, suffix = p.name.split(".")
        assert (channel, int(seq_txt), bundle_id, suffix) == (
            manifest["channel"],
            manifest["bundle_seq"],
            manifest["bundle_id"],
            "dbundle",
        ), f"{p.name}: name and manifest disagree"
        by_seq.setdefault(manifest["bundle_seq"], []).append(
            (hashlib.sha256(plain).hexdigest(), manifest, rows)
        )

    # bundle seqs 1..N gapless; a re-delivered bundle is byte-identical
    assert sorted(by_seq) == list(range(1, len(by_seq) + 1)), sorted(by_seq)
    chain: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = []
    for bseq in sorted(by_seq):
        copies = by_seq[bseq]
        assert len({sha for sha, _, _ in copies}) == 1, f"bundle {bseq} delivered with 2 contents"
        chain.append(copies[0])

    # the bundle the kill interrupted (if the journal still held it) was finished unchanged
    if interrupted is not None:
        want = json.loads(interrupted["manifest"])
        sha, m, _ = chain[want["bundle_seq"] - 1]
        assert m == want, "the interrupted bundle was re-created with another manifest"
        assert sha == interrupted["sha256"], "the interrupted bundle is not byte-identical"

    # hash chain, manifests agree with rows, no gaps
    prev: str | None = None
    rows_all: list[dict[str, Any]] = []
    for sha, m, rows in chain:
        assert m["format"] == 1 and m["channel"] == CHANNEL and m["bridge_id"] == "demo-black"
        assert m["prev_sha256"] == prev, f"hash chain broken at bundle {m['bundle_seq']}"
        assert m["gaps"] == [], f"bundle {m['bundle_seq']} reports gaps {m['gaps']}"
        assert m["rows"] == len(rows) and 0 < len(rows) <= 500
        assert (m["first_seq"], m["last_seq"]) == (rows[0]["seq"], rows[-1]["seq"])
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["exchange"]] = counts.get(r["exchange"], 0) + 1
            assert r["channel"] == CHANNEL
        assert m["exchanges"] == counts
        prev = sha
        rows_all.extend(rows)

    # message seqs gapless 0..M-1, each exactly once, stream offsets strictly increasing
    seqs = [r["seq"] for r in rows_all]
    assert seqs == list(range(len(seqs))), "message seqs are not gapless / unique / ordered"
    offsets = [r["stream_offset"] for r in rows_all]
    assert all(b > a for a, b in zip(offsets, offsets[1:], strict=False))

    # every published message once, in publish order, field by field
    assert len(rows_all) == sent.count == len(sent.messages), (
        f"{len(rows_all)} messages sealed, {sent.count} published"
    )
    for row, msg in zip(rows_all, sent.messages, strict=True):
        check_message(row, msg, row["seq"])
    assert time.monotonic() - t0 < 180
