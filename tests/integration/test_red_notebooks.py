"""Red, notebooks: red_arrivals / red_audit run as scripts over small real Delta tables made
here (every case the notebooks show); test_demo runs them again over the demo's own output."""

from __future__ import annotations

import importlib
import json
import runpy
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from bridge.protocol.headers import headers_to_typed_json
from bridge.protocol.schema import PROPERTY_COLUMNS, row_schema

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NOW = datetime.now(UTC).replace(microsecond=0)
TS = pa.timestamp("us", tz="UTC")


# ------------------------------------------------------------------ schemas (tables brief)


def _local_schemas() -> tuple[pa.Schema, pa.Schema, pa.Schema]:
    """The table schemas as the tables brief specifies them (used until schema.py exists)."""
    s, i64 = pa.string(), pa.int64()
    messages = pa.schema(
        [
            *row_schema(2),
            pa.field("bundle_seq", i64, False),
            pa.field("bundle_id", s, False),
            pa.field("land_seq", i64, False),
            pa.field("landed_at", TS, False),
            pa.field("landed_date", pa.date32(), False),
        ]
    )
    req = {"channel", "bundle_seq", "file_name", "status", "chain_status", "received_at"}
    req |= {"land_seq"}
    bundles_cols: list[tuple[str, pa.DataType]] = [
        ("channel", s), ("bundle_seq", i64), ("bundle_id", s), ("file_name", s), ("status", s),
        ("reason", s), ("signer_fpr", s), ("encrypted", pa.bool_()), ("rows", i64),
        ("first_seq", i64), ("last_seq", i64), ("coverage_first", i64), ("coverage_last", i64),
        ("gaps", s), ("inexact", s), ("plaintext_sha256", s), ("prev_sha256", s),
        ("chain_status", s), ("bridge_id", s), ("created_at", TS), ("received_at", TS),
        ("landed_at", TS), ("land_seq", i64), ("file_bytes", i64),
    ]  # fmt: skip
    bundles = pa.schema([pa.field(n, t, n not in req) for n, t in bundles_cols])
    areq = {"event_id", "at", "event", "app_id", "version", "event_date"}
    audit_cols: list[tuple[str, pa.DataType]] = [
        ("event_id", s), ("at", TS), ("event", s), ("channel", s), ("bundle_seq", i64),
        ("file_name", s), ("seq_first", i64), ("seq_last", i64), ("exchange", s), ("reason", s),
        ("detail", s), ("app_id", s), ("version", i64), ("event_date", pa.date32()),
    ]  # fmt: skip
    audit = pa.schema([pa.field(n, t, n not in areq) for n, t in audit_cols])
    return messages, bundles, audit


def _schemas() -> tuple[pa.Schema, pa.Schema, pa.Schema]:
    try:
        rs: Any = importlib.import_module("bridge.red.schema")
    except ImportError:
        return _local_schemas()
    return rs.messages_schema(), rs.bundles_schema(), rs.audit_schema()


# ------------------------------------------------------------------------- fixture data
# alpha: bundles 1 (seq 0-9), 2 (10-19, declares 20-21 lost), 4 (30-39) landed; 3 never came
#        (open gap); a second, different bundle 2 (conflict); bundle 5 quarantined.
# beta:  bundles 1 (0-4), 3 (10-14) landed, then 2 (5-9) late (gap opened and closed);
#        bundle 1 arrived twice (duplicate). One very old message (outside the lookback).
# alpha again: bundles 5..6 announced by a heartbeat (5's file was refused), written off by an
#        operator; 6 landed after all (gap_closed, reason written_off).
# gamma: bundles 2..4 missing, 3 came late, then the channel was retired (2 and 4 written off).
# Plus an unnamed junk file rejected, a special file quarantined by the intake, replay of
# `orders` (two channels) and `events`, and an approval.

EXCHANGES = ("orders", "events", "metrics")
BUNDLES = {  # (channel, bundle_seq) -> (first_seq, last_seq, coverage_last, land_seq, chain)
    ("alpha", 1): (0, 9, 9, 1, "first"),
    ("alpha", 2): (10, 19, 21, 1, "verified"),
    ("alpha", 4): (30, 39, 39, 2, "pending"),
    ("beta", 1): (0, 4, 4, 1, "first"),
    ("beta", 3): (10, 14, 14, 2, "verified"),
    ("beta", 2): (5, 9, 9, 3, "verified"),
}


def _at(land_seq: int) -> datetime:
    return NOW - timedelta(minutes=10 - 3 * land_seq)


def _message(channel: str, seq: int, bundle_seq: int, land_seq: int) -> dict[str, Any]:
    landed = _at(land_seq)
    row: dict[str, Any] = dict.fromkeys(PROPERTY_COLUMNS)
    kind = "order" if seq % 2 else "event"
    headers: tuple[tuple[str, tuple[str, Any]], ...] = (("x-kind", ("S", kind)), ("n", ("I", seq)))
    row |= {
        "channel": channel,
        "seq": seq,
        "exchange": EXCHANGES[seq % 3],
        "exchange_type": "topic",
        "exchange_durable": True,
        "exchange_auto_delete": False,
        "exchange_internal": False,
        "routing_key": f"rk.{seq % 4}",
        "redelivered": False,
        "properties_raw": b"\x00\x00",
        "delivery_mode": 2,
        # messages with an even seq carry the AMQP timestamp, 2 s before red lands them
        "timestamp": int(landed.timestamp()) - 2 if seq % 2 == 0 else None,
        "headers_typed": headers_to_typed_json(headers),
        "headers": {"x-kind": kind, "n": str(seq)},
        "body": f"body {channel} {seq}".encode(),
        "bundle_seq": bundle_seq,
        "bundle_id": f"{channel}-{bundle_seq}",
        "land_seq": land_seq,
        "landed_at": landed,
        "landed_date": landed.date(),
    }
    return row


def _messages() -> list[dict[str, Any]]:
    rows = [
        _message(ch, seq, n, land)
        for (ch, n), (a, b, _, land, _) in BUNDLES.items()
        for seq in range(a, b + 1)
    ]
    old = _message("beta", 100, 50, 1)
    old |= {"exchange": "ancient", "landed_at": NOW - timedelta(days=30)}
    old["landed_date"] = old["landed_at"].date()
    return [*rows, old]


def _ledger(channel: str, n: int, status: str, **kw: Any) -> dict[str, Any]:
    a, b, cov_last, land, chain = BUNDLES.get((channel, n), (None, None, None, 3, "n/a"))
    landed = status == "landed"
    row = {
        "channel": channel,
        "bundle_seq": n,
        "bundle_id": f"{channel}-{n}",
        "file_name": f"{channel}.{n:012d}.bundle",
        "status": status,
        "encrypted": False,
        "rows": None if a is None or b is None else b - a + 1,
        "first_seq": a,
        "last_seq": b,
        "coverage_first": a,
        "coverage_last": cov_last,
        "plaintext_sha256": f"sha-{channel}-{n}",
        "prev_sha256": None if n == 1 else f"sha-{channel}-{n - 1}",
        "chain_status": chain if landed else "n/a",
        "created_at": _at(land) - timedelta(seconds=20),
        "received_at": _at(land) - timedelta(seconds=5),
        "landed_at": _at(land) if landed else None,
        "land_seq": land,
        "file_bytes": 4096 * n,
    }
    return row | kw


def _bundles() -> list[dict[str, Any]]:
    rows = [_ledger(ch, n, "landed") for ch, n in BUNDLES]
    rows.append(_ledger("beta", 1, "duplicate", land_seq=3))
    rows.append(_ledger("alpha", 2, "conflict", reason="conflict", plaintext_sha256="other"))
    rows.append(_ledger("alpha", 5, "quarantined", reason="signature"))
    return rows


def _replayed(channel: str, exchange: str, first: int, last: int) -> int:
    """The fixture's messages of ``exchange`` on ``channel`` with seqs first..last."""
    return sum(
        m["channel"] == channel and m["exchange"] == exchange and first <= m["seq"] <= last
        for m in _messages()
    )


REPLAYED = {  # (channel, exchange, seq_first, seq_last) -> detail.rows, as replay.py counts
    k: _replayed(*k) for k in (("alpha", "orders", 0, 9), ("beta", "orders", 0, 14),
                               ("alpha", "events", 1, 19))
}  # fmt: skip


def _audit() -> list[dict[str, Any]]:
    def ev(event: str, land: int, **kw: Any) -> dict[str, Any]:
        d = kw.pop("detail", None)
        return {"event": event, "at": _at(land), "detail": json.dumps(d) if d else None, **kw}

    evs = [
        ev("landed", land, channel=ch, bundle_seq=n, seq_first=a, seq_last=b)
        for (ch, n), (a, b, _, land, _) in BUNDLES.items()
    ]
    evs += [
        ev("gap_declared", 1, channel="alpha", bundle_seq=2, seq_first=20, seq_last=21,
           reason="maxlen", detail={"count": 2}),
        ev("gap_opened", 2, channel="alpha", seq_first=22, seq_last=29, reason="transit",
           detail={"first_bundle_seq": 3, "last_bundle_seq": 3}),
        ev("gap_opened", 2, channel="beta", seq_first=5, seq_last=9, reason="transit",
           detail={"first_bundle_seq": 2, "last_bundle_seq": 2}),
        ev("gap_closed", 3, channel="beta", bundle_seq=2, seq_first=5, seq_last=9,
           reason="transit", detail={"first_bundle_seq": 2, "last_bundle_seq": 2,
                                     "gap_first_bundle_seq": 2, "gap_last_bundle_seq": 2}),
        ev("duplicate", 3, channel="beta", bundle_seq=1),
        ev("conflict", 3, channel="alpha", bundle_seq=2, reason="conflict"),
        ev("rejected", 3, channel="alpha", bundle_seq=5, reason="signature"),
        ev("rejected", 3, file_name="junk.bin", reason="bad_name"),
        ev("quarantined", 3, file_name="000000000007.fifo", reason="not_regular_file"),
        # alpha 5..6: announced, written off, 6 lands after all
        ev("missing_last_bundle", 3, channel="alpha", reason="transit",
           detail={"first_bundle_seq": 5, "last_bundle_seq": 6, "heartbeat_seq": 4}),
        ev("gap_opened", 3, channel="alpha", reason="transit",
           detail={"first_bundle_seq": 5, "last_bundle_seq": 6}),
        ev("gap_written_off", 3, channel="alpha", reason="operator",
           detail={"first_bundle_seq": 5, "last_bundle_seq": 6, "note": "gone (by op)"}),
        ev("gap_closed", 3, channel="alpha", bundle_seq=6, reason="written_off",
           detail={"first_bundle_seq": 6, "last_bundle_seq": 6, "gap_first_bundle_seq": 5,
                   "gap_last_bundle_seq": 6}),
        # gamma 2..4: 3 late, then retired (a gap_written_off per open gap, then the retirement)
        ev("gap_opened", 1, channel="gamma", reason="transit",
           detail={"first_bundle_seq": 2, "last_bundle_seq": 4}),
        ev("gap_closed", 2, channel="gamma", bundle_seq=3, reason="transit",
           detail={"first_bundle_seq": 3, "last_bundle_seq": 3, "gap_first_bundle_seq": 2,
                   "gap_last_bundle_seq": 4}),
        ev("gap_written_off", 3, channel="gamma", reason="operator",
           detail={"first_bundle_seq": 2, "last_bundle_seq": 2, "note": "retired (by op)"}),
        ev("gap_written_off", 3, channel="gamma", reason="operator",
           detail={"first_bundle_seq": 4, "last_bundle_seq": 4, "note": "retired (by op)"}),
        ev("channel_retired", 3, channel="gamma", reason="operator",
           detail={"note": "retired (by op)", "gaps_written_off": [[2, 2], [4, 4]]}),
        ev("approved", 3, exchange="orders"),
        # seqs are per channel, shared by every exchange: a range spans other exchanges' rows
        *(ev("replayed", 3, channel=ch, exchange=ex, seq_first=a, seq_last=b,
             detail={"rows": REPLAYED[ch, ex, a, b]}) for ch, ex, a, b in REPLAYED),
        ev("replay_failed", 3, channel="alpha", exchange="events", seq_first=1, seq_last=1,
           reason="nack"),
        ev("replay_failed", 3, channel="beta", exchange="metrics", seq_first=2, seq_last=8,
           reason="no route", detail={"kind": "unroutable", "rows": 3}),
    ]  # fmt: skip
    for i, e in enumerate(evs):
        e |= {"event_id": f"diode-red:{i}:0", "app_id": "diode-red", "version": i}
        e["event_date"] = e["at"].date()
    return evs


@pytest.fixture(scope="module")
def diode_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("red-notebooks")
    tables = root / "tables"
    ms, bs, aus = _schemas()
    write_deltalake(
        tables / "messages",
        pa.Table.from_pylist(_messages(), schema=ms),
        partition_by=["exchange", "landed_date"],
    )
    write_deltalake(tables / "bundles", pa.Table.from_pylist(_bundles(), schema=bs))
    write_deltalake(
        tables / "audit", pa.Table.from_pylist(_audit(), schema=aus), partition_by=["event_date"]
    )
    cfg = root / "diode.toml"
    cfg.write_text(
        '[[channels]]\nname = "alpha"\nencrypt = false\n'
        '[[channels]]\nname = "beta"\nencrypt = false\n'
        f'[red]\ntables_dir = "{tables}"\n'
    )
    yield cfg


def run_notebook(
    name: str,
    cfg: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
    **init: Any,
) -> dict[str, Any]:
    """Execute notebook ``name`` as a script; its globals afterwards."""
    for var in ("DIODE_TABLES", "DIODE_LOOKBACK_DAYS", "DIODE_CHANNEL", "DIODE_SEQ"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    for k, v in {"DIODE_CONFIG": str(cfg), "MPLBACKEND": "Agg", **(env or {})}.items():
        monkeypatch.setenv(k, v)
    import matplotlib.pyplot as plt

    try:
        return runpy.run_path(str(NOTEBOOKS / name), init_globals=init, run_name="__main__")
    finally:
        plt.close("all")


# ------------------------------------------------------------------------------ tests


def test_arrivals_notebook(diode_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = run_notebook("red_arrivals.py", diode_config, monkeypatch)
    assert ns["ENGINE"] == "delta-rs"
    assert set(ns["per_minute"].columns) == set(EXCHANGES)  # "ancient" is outside the window
    assert int(ns["per_minute"].to_numpy().sum()) == len(_messages()) - 1
    lat = ns["latency"]
    assert lat.loc["bundle created -> landed", "n"] == len(BUNDLES)
    assert lat.loc["bundle created -> landed", "p50"] == pytest.approx(20.0)
    assert lat.loc["bundle received -> landed", "max"] == pytest.approx(5.0)
    stamped = lat.loc["message timestamp -> landed"]
    recent = [m for m in _messages() if m["timestamp"] is not None and m["exchange"] in EXCHANGES]
    assert stamped["n"] == len(recent) and stamped["p50"] == stamped["max"] == pytest.approx(2.0)
    contig = ns["contiguity"].set_index("channel")
    assert contig.loc["alpha", "missing_bundles"] == [(3, 3)]
    assert contig.loc["alpha", "message_holes"] == [(22, 29)]
    assert contig.loc["beta", "missing_bundles"] == [] and contig.loc["beta", "landed"] == 3
    assert ns["top_exchanges"].sum() == len(_messages()) - 1
    assert set(ns["bundle_sizes"].index.get_level_values("status")) == {
        "landed", "duplicate", "conflict", "quarantined"
    }  # fmt: skip
    assert ns["KEY"] in {"x-kind", "n"} and not ns["by_header"].empty
    msg = ns["message"]
    assert len(msg) == 1 and (ns["CHANNEL"], ns["SEQ"]) == (msg.channel[0], msg.seq[0])
    assert ns["carrier"].bundle_seq.tolist() == [msg.bundle_seq[0]]


def test_arrivals_lookback_and_lookup(diode_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"DIODE_LOOKBACK_DAYS": "0", "DIODE_CHANNEL": "beta", "DIODE_SEQ": "100"}
    ns = run_notebook("red_arrivals.py", diode_config, monkeypatch, env)
    assert "ancient" in ns["per_minute"].columns  # 0 = everything, the 30-day-old row too
    assert ns["message"].exchange.tolist() == ["ancient"]
    assert ns["message"].headers[0] == {"x-kind": "event", "n": "100"}
    assert ns["carrier"].empty  # its bundle is not in the ledger


def test_audit_notebook(diode_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a Spark session without the Delta jars must fall back to delta-rs
    ns = run_notebook("red_audit.py", diode_config, monkeypatch, spark=object())
    assert ns["ENGINE"] == "delta-rs"
    assert ns["events_per_minute"].to_numpy().sum() == len(_audit())
    gaps = ns["gaps"].set_index(["channel", "bundle_seqs"])
    cols = ["status", "arrived_late", "written_off", "still_missing", "via_heartbeat"]
    assert gaps[cols].to_dict("index") == {
        ("alpha", "3..3"): dict(zip(cols, ["open", 0, 0, [(3, 3)], False], strict=True)),
        ("alpha", "5..6"): dict(zip(cols, ["written off", 1, 1, [], True], strict=True)),
        ("beta", "2..2"): dict(zip(cols, ["closed", 1, 0, [], False], strict=True)),
        ("gamma", "2..4"): dict(zip(cols, ["retired", 1, 2, [], False], strict=True)),
    }
    assert gaps.loc[("alpha", "3..3"), "message_seqs"] == "22..29"
    assert gaps.loc[("gamma", "2..4"), "written_off_at"] == _at(3)
    assert ns["open_gaps"].bundle_seqs.tolist() == ["3..3"]
    summary = ns["gap_summary"]
    assert summary.still_missing.to_dict() == {"alpha": 1, "beta": 0, "gamma": 0}
    assert summary.written_off.to_dict() == {"alpha": 1, "beta": 0, "gamma": 2}
    assert summary.open.to_dict() == {"alpha": 1, "beta": 0, "gamma": 0}
    # the chart ends at what is still missing: a written-off bundle landing is not taken off twice
    assert ns["steps"].groupby("channel").delta.sum().to_dict() == summary.still_missing.to_dict()
    declared = ns["declared"]
    assert declared[["seq_first", "seq_last", "reason", "messages"]].values.tolist() == [
        [20, 21, "maxlen", 2]
    ]
    # each refused file once, from audit (alpha 5 has a ledger row too: not counted again)
    assert ns["rejections"].to_dict() == {
        ("conflict", "conflict", "alpha"): 1,
        ("quarantined", "not_regular_file", "?"): 1,
        ("rejected", "bad_name", "?"): 1,
        ("rejected", "signature", "alpha"): 1,
    }
    assert sorted(ns["alarms"].event) == ["conflict", "replay_failed", "replay_failed"]
    conflicts = ns["conflicts"]
    assert conflicts[["bundle_seq", "plaintext_sha256", "plaintext_sha256_landed"]].values.tolist()[
        0
    ] == [2, "other", "sha-alpha-2"]
    assert ns["chain_problems"][["channel", "bundle_seq"]].values.tolist() == [["alpha", 4]]
    assert ns["chain"].loc["beta", "verified"] == 2
    rx = ns["replay_by_exchange"]
    # rows from detail.rows, not seq_last - seq_first + 1 (which would give 10 + 15 and 19)
    orders = [m for m in _messages() if m["exchange"] == "orders" and m["seq"] <= 14]
    orders = [m for m in orders if m["channel"] == "beta" or m["seq"] <= 9]
    assert rx.loc["orders", "rows_replayed"] == len(orders) == 9
    assert rx.loc["events", "rows_replayed"] == 7 and rx.loc["metrics", "rows_replayed"] == 0
    assert rx.loc["orders", "replayed_events"] == 2 and rx.loc["orders", "approved"] == 1
    assert rx.loc["events", "replay_failed"] == 1 and rx.loc["events", "rows_skipped"] == 0
    assert rx.loc["metrics", "rows_skipped"] == 3


def test_notebooks_share_one_engine_cell() -> None:
    cells = [(NOTEBOOKS / n).read_text().split("# COMMAND ----------")[1] for n in
             ("red_arrivals.py", "red_audit.py")]  # fmt: skip
    assert "def table(" in cells[0] and cells[0] == cells[1]
