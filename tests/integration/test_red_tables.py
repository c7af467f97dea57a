"""Red, tables: the red Delta tables on real delta-rs tables (idempotent appends, reads, upkeep)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from bridge.errors import ConfigError, DiodeError
from bridge.red import schema as rs
from bridge.red import tables as red_tables
from bridge.red.tables import RedTables, resolve_engine

NOW = datetime(2026, 11, 22, 12, 0, 0, 123456, tzinfo=UTC)


def messages(
    n: int, *, first_seq: int = 1, land_seq: int = 1, body_bytes: int = 16, exchanges: int = 2
) -> pa.Table:
    """``n`` message rows of channel "orders" from ``first_seq``, spread over ``exchanges``."""
    seqs = list(range(first_seq, first_seq + n))
    blob = os.urandom(body_bytes * n)
    cols: dict[str, Any] = {
        "channel": ["orders"] * n,
        "seq": seqs,
        "exchange": [f"ex{i % exchanges}" for i in seqs],
        "exchange_type": ["topic"] * n,
        "exchange_durable": [True] * n,
        "exchange_auto_delete": [False] * n,
        "exchange_internal": [False] * n,
        "exchange_arguments": [None] * n,
        "routing_key": [f"rk.{i}" for i in seqs],
        "redelivered": [i % 7 == 0 for i in seqs],
        "properties_raw": [b"\x00\x00"] * n,
        "delivery_mode": [2] * n,
        "timestamp": [1_700_000_000 + i for i in seqs],
        "headers_typed": ['{"k": ["S", "v"]}'] * n,
        "headers": [[("k", f"v{i}")] for i in seqs],
        "body": [blob[k * body_bytes : (k + 1) * body_bytes] for k in range(n)],
        "bundle_seq": [1] * n,
        "bundle_id": ["b-1"] * n,
        "land_seq": [land_seq] * n,
        "landed_at": [NOW] * n,
        "landed_date": [NOW.date()] * n,
    }
    schema = rs.messages_schema()
    return pa.table({f.name: pa.array(cols.get(f.name, [None] * n), f.type) for f in schema})


def ledger(bundle_seq: int, status: str = "landed", **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "channel": "orders",
        "bundle_seq": bundle_seq,
        "bundle_id": f"b-{bundle_seq}",
        "file_name": f"orders.{bundle_seq:012d}.parquet.gpg",
        "status": status,
        "chain_status": "pending" if status == "landed" else "n/a",
        "plaintext_sha256": f"{bundle_seq:064x}",
        "received_at": NOW,
        "land_seq": bundle_seq,
    }
    row.update(kw)
    return row


def by_seq(t: pa.Table) -> pa.Table:
    return t.sort_by("seq")


# -- creation and protocol -------------------------------------------------------------------


def _has_ntz(t: pa.DataType) -> bool:
    if pa.types.is_timestamp(t) and t.tz is None:
        return True
    return any(_has_ntz(t.field(i).type) for i in range(t.num_fields))


def test_ensure_creates_low_protocol_tables_without_ntz(tables: RedTables) -> None:
    tables.ensure()  # a second time: nothing changes
    for name, parts in (
        ("messages", ["exchange", "landed_date"]),
        ("bundles", []),
        ("audit", ["event_date"]),
    ):
        dt = DeltaTable(str(tables.path(name)))
        assert dt.version() == 0, name
        assert list(dt.metadata().partition_columns) == parts
        proto = dt.protocol()
        print(f"{name}: {proto}")
        assert proto.min_reader_version == 1 and proto.min_writer_version <= 2, proto
        assert not proto.reader_features and not proto.writer_features
        ds_schema = dt.to_pyarrow_dataset().schema
        assert not any(_has_ntz(f.type) for f in ds_schema), ds_schema
        assert ds_schema.names == rs.schema_for(name).names
        assert tables.txn_version(name, "diode-red") == -1


def test_ensure_refuses_a_foreign_table(tmp_path: Path) -> None:
    root = tmp_path / "tables"
    write_deltalake(str(root / "bundles"), pa.table({"channel": ["x"]}))
    with pytest.raises(rs.RedTableError, match=r"'bundles' .* missing columns \[.*'bundle_id'"):
        RedTables(root, "delta-rs").ensure()


def test_tables_must_exist_first(tmp_path: Path) -> None:
    t = RedTables(tmp_path, "delta-rs")
    with pytest.raises(rs.RedTableError, match="'messages' does not exist .*ensure"):
        t.append("messages", messages(1), app_id="diode-red", version=1)


# -- round trip ------------------------------------------------------------------------------


def test_round_trip_messages_three_readers(tables: RedTables) -> None:
    data = messages(300, exchanges=3)
    reader = pa.RecordBatchReader.from_batches(data.schema, data.to_batches(max_chunksize=64))
    assert tables.append("messages", reader, app_id="diode-red", version=1)
    path = str(tables.path("messages"))
    dt = DeltaTable(path)
    via_delta = by_seq(dt.to_pyarrow_table())
    via_dataset = by_seq(dt.to_pyarrow_dataset().to_table())
    via_tables = by_seq(tables.read("messages"))
    for got in (via_delta, via_dataset, via_tables):
        assert got.num_rows == 300
        got = got.select(data.schema.names).cast(data.schema)
        assert got.equals(by_seq(data)), "rows changed on the way through Delta"
    assert via_tables.column("landed_at").type == pa.timestamp("us", tz="UTC")
    assert via_tables.column("landed_at")[0].as_py() == NOW  # microseconds kept
    assert via_tables.column("headers").to_pylist()[0] == [("k", "v1")]
    assert sorted(os.listdir(path)) == [
        "_delta_log",
        "exchange=ex0",
        "exchange=ex1",
        "exchange=ex2",
    ]  # partitioned by exchange, then landed_date
    assert os.listdir(os.path.join(path, "exchange=ex0")) == [f"landed_date={NOW.date()}"]
    ex1 = tables.read("messages", columns=["seq"], filter=pads.field("exchange") == "ex1")
    assert sorted(ex1.column("seq").to_pylist()) == [s for s in range(1, 301) if s % 3 == 1]
    tables.ensure()  # on existing tables: keeps them
    assert tables.read("messages").num_rows == 300


def test_append_casts_and_fills_nullable_columns(tables: RedTables) -> None:
    data = messages(5).drop_columns(["content_type", "headers"])  # nullable: filled with null
    data = data.set_column(
        data.schema.get_field_index("seq"), "seq", data.column("seq").cast(pa.int32())
    )
    data = data.select(list(reversed(data.schema.names)))  # any column order
    assert tables.append("messages", data, app_id="diode-red", version=1)
    got = by_seq(tables.read("messages"))
    assert got.column("seq").type == pa.int64()
    assert got.column("content_type").null_count == 5 and got.column("headers").null_count == 5


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: t.append_column("colour", pa.array(["red"] * t.num_rows)), r"\['colour'\]"),
        (lambda t: t.drop_columns(["body"]), r"missing required columns \['body'\]"),
        (
            lambda t: t.set_column(1, "seq", pa.array([None] * t.num_rows, pa.int64())),
            "column seq: 3 null",
        ),
        (
            lambda t: t.set_column(1, "seq", pa.array(["x"] * t.num_rows)),
            "column seq: string does not cast",
        ),
    ],
)
def test_append_refuses_data_that_does_not_fit(tables: RedTables, change: Any, match: str) -> None:
    with pytest.raises(rs.RedTableError, match="red table 'messages'.*" + match) as e:
        tables.append("messages", change(messages(3)), app_id="diode-red", version=1)
    assert isinstance(e.value, DiodeError)
    assert DeltaTable(str(tables.path("messages"))).version() == 0
    assert tables.txn_version("messages", "diode-red") == -1


# -- idempotency -----------------------------------------------------------------------------


def test_append_is_idempotent_per_app_transaction(tables: RedTables) -> None:
    assert tables.append("messages", messages(10), app_id="diode-red", version=5)
    assert not tables.append("messages", messages(10), app_id="diode-red", version=5)  # again
    assert not tables.append("messages", messages(10, first_seq=11), app_id="diode-red", version=4)
    assert tables.read("messages").num_rows == 10
    assert tables.txn_version("messages", "diode-red") == 5
    # app ids are independent of each other and of other tables
    assert tables.txn_version("messages", "diode-replay") == -1
    assert tables.txn_version("audit", "diode-red") == -1
    ev = [{"event": "replayed", "channel": "orders", "seq_first": 1, "seq_last": 10}]
    assert tables.append("audit", rs.audit_rows(ev, "diode-replay", 1, NOW), app_id="diode-replay",
                         version=1)  # fmt: skip
    assert tables.append("audit", rs.audit_rows(ev, "diode-red", 5, NOW), app_id="diode-red",
                         version=5)  # fmt: skip
    assert not tables.append("audit", rs.audit_rows(ev, "diode-replay", 1, NOW),
                             app_id="diode-replay", version=1)  # fmt: skip
    assert tables.txn_version("audit", "diode-replay") == 1
    assert tables.txn_version("audit", "diode-red") == 5
    ids = sorted(tables.read("audit").column("event_id").to_pylist())
    assert ids == ["diode-red:5:0", "diode-replay:1:0"]
    # a fresh object (another process) sees the same versions
    fresh = RedTables(tables.root, "delta-rs")
    assert fresh.txn_version("messages", "diode-red") == 5
    assert not fresh.append("messages", messages(10), app_id="diode-red", version=5)
    assert fresh.append("messages", messages(3, first_seq=11), app_id="diode-red", version=6)
    assert tables.read("messages").num_rows == 13


def test_bad_batch_mid_stream_commits_nothing(tables: RedTables) -> None:
    good, bad = messages(5), messages(5, first_seq=6)
    bad = bad.set_column(1, "seq", pa.array([None] * 5, pa.int64()))
    stream = pa.RecordBatchReader.from_batches(good.schema, good.to_batches() + bad.to_batches())
    with pytest.raises(rs.RedTableError, match="column seq: 5 null"):  # not delta-rs's wrapper
        tables.append("messages", stream, app_id="diode-red", version=1)
    assert DeltaTable(str(tables.path("messages"))).version() == 0
    assert tables.txn_version("messages", "diode-red") == -1
    assert tables.append("messages", good, app_id="diode-red", version=1)  # a retry works


def test_empty_data_commits_nothing(tables: RedTables) -> None:
    schema = rs.messages_schema()
    empty_reader = pa.RecordBatchReader.from_batches(schema, iter([]))
    assert not tables.append("messages", empty_reader, app_id="diode-red", version=1)
    assert not tables.append("messages", messages(0), app_id="diode-red", version=1)
    assert not tables.append("audit", rs.audit_rows([], "diode-red", 1, NOW),
                             app_id="diode-red", version=1)  # fmt: skip
    assert DeltaTable(str(tables.path("messages"))).version() == 0
    assert tables.txn_version("messages", "diode-red") == -1


def test_bad_app_transaction_refused(tables: RedTables) -> None:
    with pytest.raises(rs.RedTableError, match="needs a name and a version"):
        tables.append("messages", messages(1), app_id="diode-red", version=-1)
    with pytest.raises(rs.RedTableError, match="needs a name"):
        tables.append("messages", messages(1), app_id="", version=1)


# -- ledger ----------------------------------------------------------------------------------


def test_landed_sha256_and_set_chain_status(tables: RedTables) -> None:
    rows = [
        ledger(1, chain_status="first"),
        ledger(2),
        ledger(2, status="duplicate"),
        ledger(3, status="quarantined", plaintext_sha256=None, reason="bad_signature"),
        ledger(4, status="conflict", plaintext_sha256="f" * 64),
    ]
    assert tables.append("bundles", rs.bundles_rows(rows), app_id="diode-red", version=1)
    assert tables.landed_sha256("orders", 1) == f"{1:064x}"
    assert tables.landed_sha256("orders", 2) == f"{2:064x}"
    assert tables.landed_sha256("orders", 3) is None  # quarantined, never landed
    assert tables.landed_sha256("orders", 4) is None  # a conflict did not land
    assert tables.landed_sha256("orders", 99) is None
    assert tables.landed_sha256("other", 1) is None

    path = str(tables.path("bundles"))
    v0 = DeltaTable(path).version()
    tables.set_chain_status("orders", 2, "verified")
    v1 = DeltaTable(path).version()
    assert v1 == v0 + 1
    got = {(r["bundle_seq"], r["status"]): r["chain_status"] for r in tables.read("bundles")
           .to_pylist()}  # fmt: skip
    assert got == {
        (1, "landed"): "first",
        (2, "landed"): "verified",
        (2, "duplicate"): "n/a",  # only the landed row changes
        (3, "quarantined"): "n/a",
        (4, "conflict"): "n/a",
    }
    tables.set_chain_status("orders", 2, "verified")  # again: no commit
    tables.set_chain_status("orders", 99, "verified")  # no such row: no commit
    assert DeltaTable(path).version() == v1
    tables.set_chain_status("orders", 2, "broken")
    chains = tables.read("bundles", columns=["bundle_seq", "chain_status"],
                         filter=pc.field("status") == "landed")  # fmt: skip
    assert dict(zip(*chains.to_pydict().values(), strict=True)) == {1: "first", 2: "broken"}
    assert tables.read("bundles").num_rows == 5
    assert tables.txn_version("bundles", "diode-red") == 1  # updates keep the app transaction
    with pytest.raises(rs.RedTableError, match="'sideways' for orders/2"):
        tables.set_chain_status("orders", 2, "sideways")
    # the rewritten files are plain Parquet: any pyarrow reader can filter on strings
    dt = DeltaTable(path)
    for uri in dt.file_uris():
        assert not any(pa.types.is_string_view(t) for t in pq.read_schema(uri).types), uri
    direct = dt.to_pyarrow_dataset().to_table(filter=pc.field("chain_status") == "broken")
    assert direct.column("bundle_seq").to_pylist() == [2]
    assert [h["operation"] for h in dt.history(3)][:2] == ["WRITE", "WRITE"]


def test_chain_status_reads_only_the_ledger_files_that_may_hold_the_bundle(
    tables: RedTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger grows a file per landing: a late bundle's chain update must not read them all
    (the statistics of bundle_seq say which file may hold it, ours as well as delta-rs's)."""
    for v in range(1, 9):
        tables.append("bundles", rs.bundles_rows([ledger(v)]), app_id="diode-red", version=v)
    opened: list[str] = []
    real = red_tables.pq.read_table

    def counting(where: Any, *a: Any, **k: Any) -> Any:
        opened.append(str(where))
        return real(where, *a, **k)

    monkeypatch.setattr(red_tables.pq, "read_table", counting)
    tables.set_chain_status("orders", 5, "verified")
    assert len(opened) == 1, opened  # 8 files, 1 read
    tables.set_chain_status("orders", 5, "broken")  # the file our rewrite wrote: stats too
    assert len(opened) == 2, opened
    monkeypatch.undo()
    chains = tables.read("bundles", columns=["bundle_seq", "chain_status"])
    assert dict(zip(*chains.to_pydict().values(), strict=True)) == {
        v: ("broken" if v == 5 else "pending") for v in range(1, 9)
    }


def test_reads_and_updates_survive_files_from_delta_rs_dml(tables: RedTables) -> None:
    """Files written by DeltaTable.update declare string_view columns pyarrow cannot filter."""
    rows = [ledger(1, chain_status="first"), ledger(2), ledger(3)]
    tables.append("bundles", rs.bundles_rows(rows), app_id="diode-red", version=1)
    tables.append("bundles", rs.bundles_rows([ledger(4)]), app_id="diode-red", version=2)
    dt = DeltaTable(str(tables.path("bundles")))
    dt.update(updates={"reason": "'x'"}, predicate="bundle_seq = 2")
    views = [u for u in dt.file_uris() if pa.types.is_string_view(pq.read_schema(u).field(0).type)]
    assert views, "delta-rs no longer writes string_view: the fallback may be dropped"
    with pytest.raises(pa.ArrowNotImplementedError):
        dt.to_pyarrow_dataset().to_table(filter=pc.field("reason") == "x")
    got = tables.read("bundles", columns=["bundle_seq"], filter=pc.field("reason") == "x")
    assert got.column("bundle_seq").to_pylist() == [2]
    assert got.schema.field("bundle_seq").type == pa.int64()
    both = tables.read("bundles", filter=pc.field("file_name") != "none")
    assert sorted(both.column("bundle_seq").to_pylist()) == [1, 2, 3, 4]
    assert both.schema.field("channel").type == pa.string()
    assert tables.landed_sha256("orders", 3) == f"{3:064x}"
    tables.set_chain_status("orders", 3, "verified")
    chains = tables.read("bundles", columns=["bundle_seq", "chain_status", "reason"])
    assert sorted(chains.to_pylist(), key=lambda r: r["bundle_seq"]) == [
        {"bundle_seq": 1, "chain_status": "first", "reason": None},
        {"bundle_seq": 2, "chain_status": "pending", "reason": "x"},
        {"bundle_seq": 3, "chain_status": "verified", "reason": None},
        {"bundle_seq": 4, "chain_status": "pending", "reason": None},
    ]
    assert tables.txn_version("bundles", "diode-red") == 2


def test_quotes_in_channel_names_are_safe(tables: RedTables) -> None:
    rows = [ledger(1, channel="o'brien"), ledger(1, channel="o")]
    tables.append("bundles", rs.bundles_rows(rows), app_id="diode-red", version=1)
    tables.set_chain_status("o'brien", 1, "verified")
    got = {r["channel"]: r["chain_status"] for r in tables.read("bundles").to_pylist()}
    assert got == {"o'brien": "verified", "o": "pending"}
    assert tables.landed_sha256("o'brien", 1) == f"{1:064x}"


# -- maintenance -----------------------------------------------------------------------------


def test_maintain_compacts_and_vacuums(tables: RedTables) -> None:
    for v in range(1, 21):
        ev = [{"event": "heartbeat", "channel": "orders", "detail": f'{{"n": {v}}}'}]
        assert tables.append("audit", rs.audit_rows(ev, "diode-red", v, NOW), app_id="diode-red",
                             version=v)  # fmt: skip
    path = tables.path("audit")
    on_disk = lambda: len(list(path.glob("event_date=*/*.parquet")))  # noqa: E731
    assert on_disk() == 20
    with pytest.raises(rs.RedTableError, match="refused retention 0 h"):
        tables.maintain("audit", optimize=False, vacuum_hours=0)
    stats = tables.maintain("audit", vacuum_hours=0, enforce_retention=False)
    print(stats)
    assert stats["files_before"] == 20 and stats["files_after"] == 1
    assert stats["vacuum_removed"] == 20 and on_disk() == 1
    assert tables.txn_version("audit", "diode-red") == 20  # the checkpoint keeps transactions
    assert not tables.append("audit", rs.audit_rows(ev, "diode-red", 20, NOW),
                             app_id="diode-red", version=20)  # fmt: skip
    got = tables.read("audit")
    assert got.num_rows == 20
    assert sorted(got.column("event_id").to_pylist()) == sorted(
        f"diode-red:{v}:0" for v in range(1, 21)
    )
    assert got.column("event_date").to_pylist() == [date(2026, 11, 22)] * 20
    again = tables.maintain("audit", vacuum_hours=200)  # nothing left to do
    assert again["files_after"] == 1 and again["vacuum_removed"] == 0


# -- engine choice ---------------------------------------------------------------------------


def test_resolve_engine_without_spark() -> None:
    assert resolve_engine("auto", None) == "delta-rs"
    assert resolve_engine("delta-rs", None) == "delta-rs"
    with pytest.raises(ConfigError, match='set red.delta_engine = "delta-rs"'):
        resolve_engine("spark", None)
    with pytest.raises(ConfigError, match="'duckdb' is not one of"):
        resolve_engine("duckdb", None)
    with pytest.raises(ConfigError, match="needs a Spark session"):
        RedTables(Path("/nonexistent"), "spark")


@pytest.mark.spark
def test_resolve_engine_spark_without_delta_jars(spark: Any) -> None:
    assert resolve_engine("auto", spark) == "delta-rs"
    with pytest.raises(ConfigError, match=r"io.delta.tables.DeltaTable \(the delta-spark jars"):
        resolve_engine("spark", spark)


def delta_sql_conf() -> tuple[tuple[str, str], tuple[str, str]]:
    """``(extension key, value), (catalog key, value)``."""
    ext, cat = red_tables.DELTA_SQL_CONF.items()
    return ext, cat


def test_delta_on_spark_needs_the_jars_and_the_sql_extension_and_catalog() -> None:
    EXT, CAT = delta_sql_conf()
    both = dict([EXT, CAT])
    assert red_tables.delta_on_spark_missing(True, both) == []
    more = {EXT[0]: f"com.example.Ext, {EXT[1]}", CAT[0]: CAT[1]}  # one extension of several
    assert red_tables.delta_on_spark_missing(True, more) == []
    assert red_tables.delta_on_spark_missing(True, {}) == [
        f"{EXT[0]}={EXT[1]}",
        f"{CAT[0]}={CAT[1]}",
    ]
    assert red_tables.delta_on_spark_missing(True, {EXT[0]: EXT[1]}) == [f"{CAT[0]}={CAT[1]}"]
    assert len(red_tables.delta_on_spark_missing(False, both)) == 1


@pytest.mark.spark
def test_auto_picks_spark_only_with_the_jars_and_the_delta_sql_conf(
    spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jars without the extension and catalog (``UPDATE``/``OPTIMIZE`` would fail mid-run):
    ``auto`` keeps delta-rs, ``spark`` is refused at start with the whole flag set."""
    EXT, CAT = delta_sql_conf()
    monkeypatch.setattr(red_tables, "_spark_loads_delta", lambda s: True)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    assert resolve_engine("auto", spark) == "delta-rs"
    with pytest.raises(ConfigError) as e:
        resolve_engine("spark", spark)
    for flag in ("--packages io.delta:delta-spark_2.13:", f"--conf {EXT[0]}={EXT[1]}",
                 f"--conf {CAT[0]}={CAT[1]}"):  # fmt: skip
        assert flag in str(e.value)
    assert "DeltaTable" not in str(e.value).split("(missing: ")[1].split(")")[0]
    monkeypatch.setattr(red_tables, "_spark_conf", lambda s, key: dict([EXT, CAT])[key])
    assert resolve_engine("auto", spark) == "spark" == resolve_engine("spark", spark)
    monkeypatch.setattr(red_tables, "_spark_loads_delta", lambda s: False)
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")  # built in there
    assert resolve_engine("auto", spark) == "spark"


class _Recorder:
    """A stand-in Spark session that records what the spark engine hands it."""

    def __init__(self) -> None:
        self.saved: list[str] = []
        self.sql_text: list[str] = []
        self.conf = self

    def set(self, key: str, value: str) -> None:  # spark.conf.set
        pass

    def createDataFrame(self, data: Any) -> Any:  # noqa: N802 - Spark's name
        return self

    @property
    def write(self) -> Any:
        return self

    def format(self, name: str) -> Any:
        return self

    def option(self, key: str, value: Any) -> Any:
        return self

    def mode(self, mode: str) -> Any:
        return self

    def partitionBy(self, *cols: str) -> Any:  # noqa: N802 - Spark's name
        return self

    def save(self, path: str) -> None:
        self.saved.append(path)

    def sql(self, text: str) -> Any:
        self.sql_text.append(text)
        return self

    def collect(self) -> list[Any]:
        return []


def test_the_spark_engine_hands_spark_file_uris_not_bare_paths(tmp_path: Path) -> None:
    """A bare path is resolved against fs.defaultFS (hdfs:, dbfs: on clusters) while delta-rs
    reads the local one: Spark gets file:///… for appends, UPDATE, OPTIMIZE and VACUUM."""
    root = tmp_path / "odd `dir"
    local = RedTables(root, "delta-rs")
    local.ensure()
    local.append("bundles", rs.bundles_rows([ledger(1)]), app_id="t", version=1)
    rec = _Recorder()
    t = RedTables(root, "spark", rec)
    t.append("audit", rs.audit_rows([{"event": "landed"}], "diode-red", 1, NOW), app_id="a",
             version=1)  # fmt: skip
    t.set_chain_status("orders", 1, "verified")
    t.maintain("audit", vacuum_hours=200)
    uri = f"file://{root.resolve()}"
    assert rec.saved == [f"{uri}/audit"]
    ident = "delta.`" + uri.replace("`", "``")
    assert rec.sql_text[0].startswith(f"UPDATE {ident}/bundles` SET"), rec.sql_text
    assert rec.sql_text[1] == f"OPTIMIZE {ident}/audit`"
    assert rec.sql_text[2] == f"VACUUM {ident}/audit` RETAIN 200 HOURS"


@pytest.mark.spark
def test_spark_takes_the_conformed_rows_without_ntz(spark: Any) -> None:
    """The part of the Spark append path that runs without the Delta jars."""
    samples = {
        "messages": messages(3),
        "bundles": rs.bundles_rows([ledger(1)]),
        "audit": rs.audit_rows([{"event": "landed"}], "diode-red", 1, NOW),
    }
    for name, data in samples.items():
        df = spark.createDataFrame(data)
        kinds = df.schema.simpleString()
        assert "timestamp_ntz" not in kinds and df.columns == rs.schema_for(name).names, kinds
        assert df.count() == data.num_rows


# -- throughput ------------------------------------------------------------------------------


def _batches(n: int, size: int) -> Iterator[pa.RecordBatch]:
    for start in range(0, n, size):
        yield from messages(min(size, n - start), first_seq=start + 1, body_bytes=1024,
                            exchanges=4).to_batches()  # fmt: skip


def test_append_100k_messages_of_1kb(tables: RedTables) -> None:
    n = 100_000
    data = pa.concat_tables(pa.Table.from_batches([b]) for b in _batches(n, 20_000))
    t0 = time.perf_counter()
    assert tables.append("messages", data, app_id="diode-red", version=1)
    table_s = time.perf_counter() - t0
    reader = pa.RecordBatchReader.from_batches(rs.messages_schema(), _batches(n, 16_384))
    t0 = time.perf_counter()
    assert tables.append("messages", reader, app_id="diode-red", version=2)
    reader_s = time.perf_counter() - t0  # includes building the rows
    print(
        f"append 100k x 1 KB: table {n / table_s:,.0f} rows/s ({table_s:.2f} s), "
        f"streamed reader {n / reader_s:,.0f} rows/s ({reader_s:.2f} s)"
    )
    assert DeltaTable(str(tables.path("messages"))).count() == 2 * n
    assert table_s < 30


# -- durability: delta-rs never fsyncs its commits -------------------------------------------


def _spy_fsync(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path os.fsync is called on from now, in order (resolved through /proc)."""
    seen: list[Path] = []
    real = os.fsync

    def spy(fd: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def _log_entry(tables: RedTables, name: str, version: int) -> Path:
    return (tables.path(name) / "_delta_log" / f"{version:020d}.json").resolve()


@pytest.mark.parametrize("name", ["messages", "bundles", "audit"])
def test_append_fsyncs_its_commit_and_data(
    tables: RedTables, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delta-rs creates and links ``_delta_log/N.json`` (and writes ``bundles``/``audit`` data
    files) without any fsync: ``append`` must fsync them, and the log folder, before it
    returns — the landing moves evidence and saves its state on the strength of it."""
    data = {
        "messages": messages(4),
        "bundles": rs.bundles_rows([ledger(1)]),
        "audit": rs.audit_rows([{"event": "heartbeat", "channel": "orders"}], "diode-red", 1, NOW),
    }[name]
    before = DeltaTable(str(tables.path(name))).version()
    seen = _spy_fsync(monkeypatch)
    assert tables.append(name, data, app_id="diode-red", version=1)
    dt = DeltaTable(str(tables.path(name)))
    assert dt.version() == before + 1
    assert _log_entry(tables, name, before + 1) in seen
    assert (tables.path(name) / "_delta_log").resolve() in seen
    for uri in dt.file_uris():
        f = Path(uri.removeprefix("file://")).resolve()
        assert f in seen, f"data file {f} never fsynced"
        assert f.parent in seen, f"folder of {f} never fsynced"


def test_chain_status_and_maintenance_commits_are_fsynced(
    tables: RedTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables.append("bundles", rs.bundles_rows([ledger(1)]), app_id="diode-red", version=1)
    for v in (1, 2):
        ev = [{"event": "heartbeat", "channel": "orders"}]
        tables.append("audit", rs.audit_rows(ev, "diode-red", v, NOW), app_id="diode-red",
                      version=v)  # fmt: skip
    seen = _spy_fsync(monkeypatch)
    tables.set_chain_status("orders", 1, "verified")
    assert _log_entry(tables, "bundles", 2) in seen
    tables.maintain("audit")  # optimize (delta-rs writes the compacted file) + checkpoint
    log_dir = tables.path("audit") / "_delta_log"
    v = DeltaTable(str(tables.path("audit"))).version()
    assert _log_entry(tables, "audit", v) in seen
    assert (log_dir / f"{v:020d}.checkpoint.parquet").resolve() in seen
    assert (log_dir / "_last_checkpoint").resolve() in seen
    for uri in DeltaTable(str(tables.path("audit"))).file_uris():
        assert Path(uri.removeprefix("file://")).resolve() in seen


def test_ensure_fsyncs_the_newest_commits(
    tables: RedTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit made just before a crash (never fsynced) is skipped as committed by the retry:
    start-up (``ensure``) fsyncs the commits since the last checkpoint of every table."""
    ev = [{"event": "heartbeat", "channel": "orders"}]
    write_deltalake(str(tables.path("audit")), rs.audit_rows(ev, "diode-red", 1, NOW),
                    mode="append", partition_by=["event_date"])  # fmt: skip
    v = DeltaTable(str(tables.path("audit"))).version()
    seen = _spy_fsync(monkeypatch)
    RedTables(tables.root, "delta-rs").ensure()
    for name in rs.TABLE_NAMES:
        assert _log_entry(tables, name, 0) in seen
    assert _log_entry(tables, "audit", v) in seen
