"""Red, tables: the red Delta tables (messages, bundles, audit) with idempotent appends.

Every append carries a Delta *application transaction* ``(app_id, version)`` in the same
commit as its rows, and is skipped when the table's ``transaction_version(app_id)`` is already
``>= version``: re-applying a landing after a crash never duplicates rows. One writer per app
id at a time (the landing holds its lock; replay and approvals have their own app ids); the
check-then-commit is not guarded against two writers racing with the same app id.

Two engines write: ``delta-rs`` (the ``deltalake`` package, no JVM) and ``spark`` (Delta Lake on
Spark, needs the delta-spark jars). Creating tables, reading, and the transaction look-up
always use delta-rs on the local ``root``; tables written by either engine are read by both
(the protocol stays at reader 1 / writer 2: no ``timestamp_ntz``, no table features).

Neither engine fsyncs a commit (delta-rs creates ``_delta_log/N.json`` and links it in place;
its own data files are not fsynced either), yet the landing moves evidence and saves its state
on the strength of one. So every write here fsyncs what its commits added before it returns
(``sync_commits``: data files, their folders, the commit and checkpoint files, ``_delta_log``),
and ``ensure`` (start-up) fsyncs each table's commits since its last checkpoint: a commit made
just before a crash, which the retry then skips as committed, is made durable too.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import math
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.schema import Field
from deltalake.transaction import AddAction, RemoveAction

from bridge.errors import ConfigError
from bridge.fsutil import durable_mkdir, fsync_dir
from bridge.logs import get_logger, log_event
from bridge.red.schema import (
    ADDED_COLUMNS,
    AUDIT_PARTITIONS,
    BUNDLES_PARTITIONS,
    CHAIN_STATUSES,
    MESSAGES_PARTITIONS,
    TABLE_NAMES,
    RedTableError,
    schema_for,
)
from bridge.spark import spark_path

__all__ = [
    "Engine",
    "RedTables",
    "RedTableError",
    "resolve_engine",
    "sync_commits",
    "DELTA_SPARK_CLASS",
    "DELTA_SQL_CONF",
    "delta_on_spark_missing",
]

log = get_logger("bridge.red.tables")

Engine = Literal["spark", "delta-rs"]
DELTA_SPARK_CLASS = "io.delta.tables.DeltaTable"
MIN_SAFE_VACUUM_HOURS = 168.0
"""Delta's default ``delta.deletedFileRetentionDuration`` (7 days)."""

_PARTITIONS: dict[str, tuple[str, ...]] = {
    "messages": MESSAGES_PARTITIONS,
    "bundles": BUNDLES_PARTITIONS,
    "audit": AUDIT_PARTITIONS,
}
_DESCRIPTIONS = {
    "messages": "diode-bridge red: every message landed, once per (channel, seq)",
    "bundles": "diode-bridge red: ledger of every bundle file judged",
    "audit": "diode-bridge red: audit events",
}


# -- engine choice ---------------------------------------------------------------------------


DELTA_SQL_CONF: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
"""What Delta on Spark needs besides its jars: ``UPDATE`` (chain status), ``OPTIMIZE`` and
``VACUUM`` on ``delta.`path``` fail without the SQL extension and the catalog."""
DELTA_SPARK_FLAGS = "--packages io.delta:delta-spark_2.13:<version> " + " ".join(
    f"--conf {k}={v}" for k, v in DELTA_SQL_CONF.items()
)


def _on_databricks() -> bool:
    """Databricks runtimes have Delta built in, its extension and catalog included."""
    return bool(os.environ.get("DATABRICKS_RUNTIME_VERSION"))


def _spark_loads_delta(spark: Any) -> bool:
    """True if the session's JVM can load the Delta Lake classes."""
    try:
        jvm = spark._jvm
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(DELTA_SPARK_CLASS, False, loader)
        return True
    except Exception:  # no _jvm (Spark Connect), py4j error, ClassNotFoundException
        return False


def _spark_conf(spark: Any, key: str) -> str:
    try:
        return str(spark.conf.get(key, "") or "")
    except Exception:  # noqa: BLE001 - a conf that cannot be read counts as not set
        return ""


def delta_on_spark_missing(has_classes: bool, conf: dict[str, str]) -> list[str]:
    """What keeps Delta on Spark from working, given whether the JVM loads the Delta classes
    and the session's values of ``DELTA_SQL_CONF``'s keys: empty when nothing is missing."""
    missing = [] if has_classes else [f"class {DELTA_SPARK_CLASS} (the delta-spark jars)"]
    for key, value in DELTA_SQL_CONF.items():
        if key == "spark.sql.extensions":
            ok = value in [e.strip() for e in conf.get(key, "").split(",")]
        else:
            ok = conf.get(key, "").strip() == value
        if not ok:
            missing.append(f"{key}={value}")
    return missing


def _spark_delta_missing(spark: Any) -> list[str]:
    if _on_databricks():
        return []
    conf = {key: _spark_conf(spark, key) for key in DELTA_SQL_CONF}
    return delta_on_spark_missing(_spark_loads_delta(spark), conf)


def resolve_engine(setting: str, spark: Any | None) -> Engine:
    """The engine for ``red.delta_engine`` = ``setting`` ("auto" | "spark" | "delta-rs").

    "auto" picks Spark when a session is given that loads Delta Lake AND has its SQL extension
    and catalog configured (or runs on Databricks), else delta-rs.
    """
    if setting == "delta-rs":
        return "delta-rs"
    if setting == "auto":
        return "spark" if spark is not None and not _spark_delta_missing(spark) else "delta-rs"
    if setting == "spark":
        missing = ["a Spark session"] if spark is None else _spark_delta_missing(spark)
        if missing:
            raise ConfigError(
                f'red.delta_engine = "spark" but Delta Lake is not set up on Spark (missing: '
                f'{"; ".join(missing)}): set red.delta_engine = "delta-rs", or submit the job '
                f"with {DELTA_SPARK_FLAGS}"
            )
        return "spark"
    raise ConfigError(f'red.delta_engine = {setting!r} is not one of "auto", "spark", "delta-rs"')


# -- conforming data to a table schema -------------------------------------------------------


def _check_columns(table: str, schema: pa.Schema, given: pa.Schema) -> None:
    names = set(given.names)
    extra = sorted(names - set(schema.names))
    missing = sorted(f.name for f in schema if f.name not in names and not f.nullable)
    if extra or missing:
        raise RedTableError(
            f"data for red table {table!r} does not match its schema: "
            f"unknown columns {extra}, missing required columns {missing}"
        )


def _conform(table: str, schema: pa.Schema, batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` in the table's column order and types; absent nullable columns are null."""
    arrays = []
    for f in schema:
        if f.name in batch.schema.names:
            col = batch.column(f.name)
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                raise RedTableError(
                    f"red table {table!r}, column {f.name}: {col.type} does not cast to "
                    f"{f.type}: {e}"
                ) from e
            if not f.nullable and col.null_count:
                raise RedTableError(
                    f"red table {table!r}, column {f.name}: {col.null_count} null value(s) "
                    "in a required column"
                )
        else:
            col = pa.nulls(batch.num_rows, f.type)
        arrays.append(col)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


class _Conformed:
    """Conformed batches of ``data``; remembers the first error, which a writer consuming the
    stream (delta-rs, through the Arrow C stream interface) reports only as its own."""

    def __init__(self, table: str, schema: pa.Schema, data: pa.Table | pa.RecordBatchReader):
        _check_columns(table, schema, data.schema)
        self.table, self.schema = table, schema
        self.error: BaseException | None = None
        self._source: Iterator[pa.RecordBatch] = (
            iter(data.to_batches()) if isinstance(data, pa.Table) else iter(data)
        )

    def _batches(self) -> Iterator[pa.RecordBatch]:
        try:
            for b in self._source:
                if b.num_rows:
                    yield _conform(self.table, self.schema, b)
        except BaseException as e:
            self.error = e
            raise

    def reader(self) -> pa.RecordBatchReader | None:
        """The stream, or None when ``data`` has no rows (nothing is read twice)."""
        batches = self._batches()
        first = next(batches, None)
        if first is None:
            return None
        return pa.RecordBatchReader.from_batches(self.schema, itertools.chain([first], batches))


def _filter_by_file(
    ds: pads.FileSystemDataset, columns: list[str] | None, filter: pads.Expression
) -> pa.Table:
    """``ds.to_table(columns, filter)`` for data sets with files pyarrow cannot filter in place
    (Parquet written by delta-rs DML declares ``string_view`` columns): those files are read
    whole, cast to the table schema, and filtered in memory; the others as usual.
    """
    parts = []
    for frag in ds.get_fragments():
        one = pads.FileSystemDataset([frag], ds.schema, ds.format, ds.filesystem)
        try:
            parts.append(one.to_table(columns=columns, filter=filter))
        except pa.ArrowNotImplementedError:
            got = one.to_table().filter(filter)
            parts.append(got.select(columns) if columns is not None else got)
    if not parts:
        return ds.to_table(columns=columns)
    return pa.concat_tables(parts)


def _null_counts(table: pa.Table) -> dict[str, int]:
    return {name: table.column(name).null_count for name in table.column_names}


def _may_hold(add: dict[str, Any], path: Path, bundle_seq: int) -> bool:
    """Whether a ledger file (a flattened add action, at ``path``) may hold ``bundle_seq``
    (of any channel): False only when statistics exclude it. The commit's statistics first
    (delta-rs writes them); else the Parquet footer's (the files ``_rewrite_bundles`` writes
    have none in the commit: statistics for some columns only would make delta-rs skip files
    on the others)."""
    lo, hi = add.get("min.bundle_seq"), add.get("max.bundle_seq")
    if lo is not None and hi is not None:
        return bool(lo <= bundle_seq <= hi)
    try:
        meta = pq.ParquetFile(path).metadata
        col = meta.schema.to_arrow_schema().get_field_index("bundle_seq")
        if col < 0:
            return True
        for g in range(meta.num_row_groups):
            st = meta.row_group(g).column(col).statistics
            if st is None or not st.has_min_max or st.min <= bundle_seq <= st.max:
                return True
        return False
    except (OSError, pa.ArrowException):
        return True  # read it whole: the read raises what is wrong


def _write_parquet(path: Path, table: pa.Table) -> int:
    """Write ``table`` to a new Parquet file, fsynced; returns its size in bytes."""
    with open(path, "xb") as fh:
        pq.write_table(table, fh, compression="snappy")
        fh.flush()
        os.fsync(fh.fileno())
    return path.stat().st_size


def _fsync_file(path: Path) -> bool:
    """fsync ``path``; False when it does not exist (removed since, e.g. by vacuum)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _added_paths(commit: Path) -> list[str]:
    """The ``add.path`` of every action in the commit file ``commit`` ([] if it is gone)."""
    try:
        lines = commit.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        if not line.strip():
            continue
        add = json.loads(line).get("add")
        if isinstance(add, dict) and isinstance(add.get("path"), str):
            out.append(add["path"])
    return out


def _local_file(root: Path, path: str) -> Path | None:
    """The file a log ``add.path`` names: relative to ``root`` and percent-encoded, or a
    ``file:`` URI; None for another scheme (a remote store: nothing to fsync here)."""
    url = urllib.parse.urlsplit(path)
    if url.scheme == "file":
        return Path(urllib.parse.unquote(url.path))
    if url.scheme:
        return None
    return root / urllib.parse.unquote(path)


def sync_commits(root: Path, after: int, upto: int) -> None:
    """fsync versions ``after`` + 1 .. ``upto`` of the Delta table at ``root``: the data files
    each commit adds and their folders up to ``root``, then the commit files (and a checkpoint
    written at one of those versions), ``_last_checkpoint`` and the ``_delta_log`` folder.
    Files removed since (vacuum, log clean-up) are passed over."""
    log_dir = root / "_delta_log"
    dirs: set[Path] = {root}
    for v in range(after + 1, upto + 1):
        for rel in _added_paths(log_dir / f"{v:020d}.json"):
            f = _local_file(root, rel)
            if f is None or not _fsync_file(f):
                continue
            d = f.parent
            dirs.add(d)
            while d != root and root in d.parents:
                d = d.parent
                dirs.add(d)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):  # deepest first
        fsync_dir(d)
    for v in range(after + 1, upto + 1):
        _fsync_file(log_dir / f"{v:020d}.json")
        _fsync_file(log_dir / f"{v:020d}.checkpoint.parquet")
    _fsync_file(log_dir / "_last_checkpoint")
    fsync_dir(log_dir)


def _last_checkpoint(root: Path) -> int:
    """The version of the table's last checkpoint, per ``_last_checkpoint``; -1 if none."""
    try:
        v = json.loads((root / "_delta_log" / "_last_checkpoint").read_bytes())["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return v if isinstance(v, int) and v >= 0 else -1


def _safe_dir(value: str) -> str:
    """A partition folder name that needs no escaping (the log's partitionValues hold the
    real value; readers never parse folder names)."""
    keep = "".join(c if (c.isascii() and (c.isalnum() or c in "._-")) else "_" for c in value)
    if keep != value or not keep:
        keep = (
            f"{keep[:60]}_{hashlib.sha256(value.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"
        )
    return keep[:120]


def _stat_value(v: Any, *, up: bool) -> Any:
    """A min/max as the Delta log writes it: timestamps in UTC to the millisecond (a max is
    rounded up, a min down, so the bounds stay true), dates as ISO dates."""
    if isinstance(v, datetime.datetime):
        v = v.astimezone(datetime.UTC)
        ms = v.replace(microsecond=(v.microsecond // 1000) * 1000)
        if up and ms != v:
            ms += datetime.timedelta(milliseconds=1)
        return ms.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms.microsecond // 1000:03d}Z"
    if isinstance(v, datetime.date):
        return v.isoformat()
    return v


class _PartFile:
    """One new Parquet data file of one partition, written batch by batch."""

    def __init__(self, root: Path, parts: list[str], key: tuple[str, ...], schema: pa.Schema):
        self.parts, self.key = parts, key
        rel_dir = "/".join(f"{p}={_safe_dir(v)}" for p, v in zip(parts, key, strict=True))
        self.rel = f"{rel_dir}/part-00000-{uuid.uuid4()}-c000.zstd.parquet".lstrip("/")
        self.path = root / self.rel
        durable_mkdir(self.path.parent)
        self._fh = open(self.path, "xb")  # noqa: SIM115 - closed in close()/abort()
        self._writer = pq.ParquetWriter(self._fh, schema, compression="zstd")
        self.rows = 0
        self.mins: dict[str, Any] = {}
        self.maxs: dict[str, Any] = {}
        self.nulls: dict[str, int] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)
        self.rows += batch.num_rows
        for f in batch.schema:
            col = batch.column(f.name)
            if pa.types.is_map(f.type) or pa.types.is_nested(f.type):
                continue
            self.nulls[f.name] = self.nulls.get(f.name, 0) + col.null_count
            t = f.type
            if not (
                pa.types.is_integer(t)
                or pa.types.is_string(t)
                or pa.types.is_boolean(t)
                or pa.types.is_timestamp(t)
                or pa.types.is_date(t)
            ):
                continue  # binary and maps: no min/max (Delta collects none either)
            mm = pc.min_max(col).as_py()
            if mm["min"] is not None:
                self.mins[f.name] = min(self.mins.get(f.name, mm["min"]), mm["min"])
                self.maxs[f.name] = max(self.maxs.get(f.name, mm["max"]), mm["max"])

    def close(self) -> AddAction:
        self._writer.close()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        stats = json.dumps(
            {
                "numRecords": self.rows,
                "minValues": {k: _stat_value(v, up=False) for k, v in self.mins.items()},
                "maxValues": {k: _stat_value(v, up=True) for k, v in self.maxs.items()},
                "nullCount": self.nulls,
            }
        )
        values = dict(zip(self.parts, self.key, strict=True))
        now_ms = int(time.time() * 1000)
        return AddAction(self.rel, self.path.stat().st_size, values, now_ms, True, stats)

    def abort(self) -> None:
        try:
            self._writer.close()
            self._fh.close()
        finally:
            self.path.unlink(missing_ok=True)


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


# -- the tables ------------------------------------------------------------------------------


class RedTables:
    """The three red tables under ``root``: ``root/messages``, ``root/bundles``, ``root/audit``."""

    def __init__(self, root: Path, engine: Engine, spark: Any | None = None) -> None:
        if engine not in ("spark", "delta-rs"):
            raise ConfigError(f"unknown Delta engine {engine!r} (resolve_engine decides it)")
        if engine == "spark" and spark is None:
            raise ConfigError('the "spark" Delta engine needs a Spark session')
        self.root = Path(root)
        self.engine: Engine = engine
        self.spark = spark
        self._open: dict[str, DeltaTable] = {}
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        """Where table ``name`` lives."""
        schema_for(name)  # names the known tables when ``name`` is not one
        return self.root / name

    def spark_path(self, name: str) -> str:
        """Table ``name`` as handed to Spark: a fully qualified ``file://`` URI (a bare path
        would be resolved against ``fs.defaultFS``, a different table from delta-rs's)."""
        return spark_path(self.path(name))

    def _spark_table(self, name: str) -> str:
        """``delta.`file:///…``` for Spark SQL (backticks in the path doubled)."""
        return "delta.`" + self.spark_path(name).replace("`", "``") + "`"

    # -- creation and look-ups (delta-rs for both engines) -------------------------------------
    def ensure(self) -> None:
        """Create the missing tables empty; check that existing ones have the expected columns
        (adding those a later build added: ``_check_or_evolve``). Both engines write only
        after this: the Spark writer appends by column name to the table it leaves."""
        durable_mkdir(self.root)
        for name in TABLE_NAMES:
            schema = schema_for(name)
            parts = list(_PARTITIONS[name]) or None
            dt = DeltaTable.create(
                str(self.path(name)),
                schema,
                mode="ignore",
                partition_by=parts,
                name=name,
                description=_DESCRIPTIONS[name],
            )
            self._check_or_evolve(name, dt)
            # a commit made just before a crash may never have been fsynced; the retry skips
            # it as committed. Everything since the last checkpoint is few (the checkpoint
            # interval) and covers it, and the creation (version 0) of a new table.
            path = self.path(name)
            sync_commits(path, max(_last_checkpoint(path), 0) - 1, dt.version())
            with self._lock:
                self._open[name] = dt
        fsync_dir(self.root)  # the table folders delta-rs created

    def _check_or_evolve(self, name: str, dt: DeltaTable) -> None:
        """Refuse a table whose columns or partitioning differ from what this version writes,
        except for columns a later build added (``ADDED_COLUMNS``) missing from a table an
        earlier build created: those are added (additive schema evolution, one metadata commit
        without an app transaction; the rows from before read as null)."""
        schema = schema_for(name)
        have = {f.name for f in dt.schema().fields}
        missing = [f for f in schema if f.name not in have]
        unknown = sorted(have - set(schema.names))
        parts = list(dt.metadata().partition_columns)
        later = ADDED_COLUMNS.get(name, ())
        if unknown or parts != list(_PARTITIONS[name]) or any(f.name not in later for f in missing):
            raise RedTableError(
                f"red table {name!r} at {self.path(name)} is not the table this version writes: "
                f"missing columns {sorted(f.name for f in missing)}, unknown columns {unknown}, "
                f"partitioned by {parts} (expected {list(_PARTITIONS[name])}); point "
                "red.tables_dir elsewhere or migrate it"
            )
        if missing:
            dt.alter.add_columns([Field.from_arrow(f) for f in missing])
            log_event(log, 20, "red table given the columns this version added; its rows from "
                      "before read them as null", table=name, path=str(self.path(name)),
                      columns=[f.name for f in missing], version=dt.version())  # fmt: skip

    def _table(self, name: str) -> DeltaTable:
        """The table, refreshed to its newest version."""
        path = self.path(name)
        with self._lock:
            dt = self._open.get(name)
            if dt is None:
                if not DeltaTable.is_deltatable(str(path)):
                    raise RedTableError(
                        f"red table {name!r} does not exist at {path}: call ensure() first"
                    )
                dt = self._open[name] = DeltaTable(str(path))
            else:
                dt.update_incremental()
            return dt

    def _synced(self, name: str, before: int) -> None:
        """fsync the commits made to ``name`` since version ``before`` (``sync_commits``)."""
        sync_commits(self.path(name), before, self._table(name).version())

    def txn_version(self, name: str, app_id: str) -> int:
        """The newest app-transaction version of ``app_id`` committed to ``name``; -1 if none."""
        v = self._table(name).transaction_version(app_id)
        return -1 if v is None else int(v)

    def read(
        self, name: str, columns: list[str] | None = None, filter: pads.Expression | None = None
    ) -> pa.Table:
        """Rows of ``name`` (newest version), ``filter`` a pyarrow.dataset expression."""
        ds = self._table(name).to_pyarrow_dataset()
        try:
            return ds.to_table(columns=columns, filter=filter)
        except pa.ArrowNotImplementedError:
            if filter is None:
                raise
            return _filter_by_file(ds, columns, filter)

    def landed_sha256(self, channel: str, bundle_seq: int) -> str | None:
        """The plaintext sha256 of the landed ledger row of ``channel``/``bundle_seq``, or None."""
        f = pads.field
        got = self.read(
            "bundles",
            columns=["plaintext_sha256"],
            filter=(f("channel") == channel)
            & (f("bundle_seq") == int(bundle_seq))
            & (f("status") == "landed"),
        )
        values = {v for v in got.column("plaintext_sha256").to_pylist() if v is not None}
        if len(values) > 1:
            log_event(log, 40, "bundle landed twice with different plaintexts in the ledger",
                      channel=channel, bundle_seq=bundle_seq, sha256=sorted(values))  # fmt: skip
        return min(values) if values else None

    # -- writes --------------------------------------------------------------------------------
    def append(
        self, name: str, data: pa.Table | pa.RecordBatchReader, *, app_id: str, version: int
    ) -> bool:
        """Append ``data`` with the app transaction ``(app_id, version)``, cast to the table's
        schema (missing nullable columns become null). Returns False, writing nothing, when the
        table has ``version`` of ``app_id`` already (or a later one) or ``data`` has no rows.
        The commit and its data are fsynced when it returns True.
        """
        if not app_id or isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise RedTableError(
                f"red table {name!r}: app transaction ({app_id!r}, {version!r}) needs a name "
                "and a version >= 0"
            )
        schema = schema_for(name)
        have = self.txn_version(name, app_id)
        if have >= version:
            log_event(log, 10, "append already committed, skipped", table=name, app_id=app_id,
                      version=version, table_has=have)  # fmt: skip
            return False
        conformed = _Conformed(name, schema, data)
        reader = conformed.reader()
        if reader is None:
            return False
        before = self._table(name).version()
        if self.engine == "spark":
            self._spark_append(name, reader.read_all(), app_id, version)
        elif name == "messages":  # large: stream into files, memory bounded by one batch
            self._append_files(name, reader, app_id, version)
        else:
            self._write_deltalake(name, conformed, reader, app_id, version)
        self._synced(name, before)
        return True

    def _write_deltalake(
        self,
        name: str,
        conformed: _Conformed,
        reader: pa.RecordBatchReader,
        app_id: str,
        version: int,
    ) -> None:
        """delta-rs' own writer (small tables: ``bundles``, ``audit``); it fsyncs nothing."""
        try:
            write_deltalake(
                str(self.path(name)),
                reader,
                mode="append",
                partition_by=list(_PARTITIONS[name]) or None,
                commit_properties=CommitProperties(app_transactions=[Transaction(app_id, version)]),
            )
        except Exception as e:
            if conformed.error is not None:  # the data's own error, not delta-rs's wrapper
                raise conformed.error from e
            raise

    def _append_files(
        self, name: str, reader: pa.RecordBatchReader, app_id: str, version: int
    ) -> None:
        """Stream ``reader`` into one Parquet file per partition (pyarrow, fsynced), then add
        them in one commit carrying the app transaction. Memory holds one batch, not the whole
        append (delta-rs' own writer held several times the data)."""
        root = self.path(name)
        parts = list(_PARTITIONS[name])
        schema = schema_for(name)
        data_schema = pa.schema([f for f in schema if f.name not in parts])
        writers: dict[tuple[str, ...], _PartFile] = {}
        try:
            for batch in reader:
                if not batch.num_rows:
                    continue
                keys = pa.table([batch.column(p) for p in parts], names=parts)
                groups = keys.group_by(parts, use_threads=False).aggregate([])
                for values in groups.to_pylist():
                    key = tuple("" if values[p] is None else str(values[p]) for p in parts)
                    mask = None
                    for p in parts:
                        eq = pc.equal(
                            batch.column(p), pa.scalar(values[p], batch.schema.field(p).type)
                        )
                        mask = eq if mask is None else pc.and_(mask, eq)
                    sub = batch.filter(mask)
                    w = writers.get(key)
                    if w is None:
                        w = writers[key] = _PartFile(root, parts, key, data_schema)
                    w.write(sub.select(data_schema.names))
            actions: list[AddAction | RemoveAction] = [w.close() for w in writers.values()]
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        if not actions:
            return
        for d in {w.path.parent for w in writers.values()}:
            fsync_dir(d)
        self._table(name).create_write_transaction(
            actions,
            mode="append",
            schema=schema,
            partition_by=parts or None,
            commit_properties=CommitProperties(app_transactions=[Transaction(app_id, version)]),
        )

    def _spark_append(self, name: str, data: pa.Table, app_id: str, version: int) -> None:
        """Delta on Spark: the writer options txnAppId/txnVersion make the append idempotent."""
        assert self.spark is not None
        writer = (
            self.spark.createDataFrame(data)
            .write.format("delta")
            .option("txnAppId", app_id)
            .option("txnVersion", version)
            .mode("append")
        )
        if _PARTITIONS[name]:
            writer = writer.partitionBy(*_PARTITIONS[name])
        writer.save(self.spark_path(name))

    def set_chain_status(self, channel: str, bundle_seq: int, status: str) -> None:
        """Set ``chain_status`` of the landed ledger row of ``channel``/``bundle_seq``.

        Idempotent: rows that already have ``status`` are not rewritten (no commit at all).
        delta-rs: the files holding such rows are rewritten with pyarrow and swapped in one
        commit (remove + add), not with ``DeltaTable.update``, whose files declare Arrow
        ``string_view`` columns that pyarrow cannot filter on (``read`` would fail).
        """
        if status not in CHAIN_STATUSES:
            raise RedTableError(
                f"chain status {status!r} for {channel}/{bundle_seq} is not one of "
                f"{list(CHAIN_STATUSES)}"
            )
        f = pads.field
        todo = (
            (f("channel") == channel)
            & (f("bundle_seq") == int(bundle_seq))
            & (f("status") == "landed")
            & (f("chain_status") != status)
        )
        if not self.read("bundles", columns=["bundle_seq"], filter=todo).num_rows:
            return
        before = self._table("bundles").version()
        if self.engine == "spark":
            assert self.spark is not None
            where = (
                f"channel = {_sql_str(channel)} AND bundle_seq = {int(bundle_seq)} "
                f"AND status = 'landed' AND chain_status <> {_sql_str(status)}"
            )
            self.spark.sql(
                f"UPDATE {self._spark_table('bundles')} SET chain_status = {_sql_str(status)} "
                f"WHERE {where}"
            )
        else:
            files = self._rewrite_bundles(todo, status, int(bundle_seq))
            log_event(log, 10, "ledger files rewritten", files=files)
        self._synced("bundles", before)
        log_event(log, 20, "chain status set", channel=channel, bundle_seq=bundle_seq,
                  chain_status=status)  # fmt: skip

    def _rewrite_bundles(self, rows: pads.Expression, status: str, bundle_seq: int) -> int:
        """Copy-on-write: every ledger file with a row matching ``rows`` is written anew with
        ``chain_status = status`` there; one commit removes the old files and adds the new.
        Only files whose statistics admit ``bundle_seq`` are read (a ledger grows
        a file per landing until compacted: reading them all made each late bundle's chain
        update cost the whole ledger). Returns the number of files rewritten.
        """
        dt = self._table("bundles")
        root = self.path("bundles")
        schema = schema_for("bundles")
        actions: list[AddAction | RemoveAction] = []
        now_ms = int(time.time() * 1000)
        for add in pa.table(dt.get_add_actions(flatten=True)).to_pylist():
            rel = str(add["path"])
            if not _may_hold(add, root / rel, bundle_seq):
                continue
            data = pq.read_table(root / rel).cast(schema)
            at = pa.array(range(data.num_rows), pa.int64())
            hits = data.append_column("_row", at).filter(rows).column("_row")
            if not len(hits):
                continue
            flags = pc.is_in(at, value_set=hits.combine_chunks())
            col = pc.if_else(flags, pa.scalar(status), data.column("chain_status"))
            new = data.set_column(schema.get_field_index("chain_status"), "chain_status", col)
            name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
            size = _write_parquet(root / name, new)
            stats = json.dumps({"numRecords": new.num_rows, "nullCount": _null_counts(new)})
            actions.append(AddAction(name, size, {}, now_ms, True, stats))
            actions.append(RemoveAction(rel, True, now_ms, add["size_bytes"], {}))
        if actions:
            fsync_dir(root)
            dt.create_write_transaction(actions, mode="append", schema=schema)
        return len(actions) // 2

    # -- maintenance ---------------------------------------------------------------------------
    def maintain(
        self,
        name: str,
        *,
        optimize: bool = True,
        vacuum_hours: float | None = None,
        enforce_retention: bool = True,
    ) -> dict[str, Any]:
        """Compact small files (``optimize``) and delete files no version younger than
        ``vacuum_hours`` needs (``vacuum_hours`` None: no vacuum). Returns stats.

        Retention below the table's ``delta.deletedFileRetentionDuration`` (168 h by default)
        is refused unless ``enforce_retention=False``. That is dangerous: a reader still on an
        older snapshot (the replay publisher between polls, a Spark stream, a notebook, time
        travel) or a writer whose commit started before the compaction may need the files
        vacuum deletes, and then fails with "file not found" (or, for a stream, skips data).
        Use it only when nothing else reads or writes the table. Hours are rounded up.
        """
        path = self.path(name)
        before = self._table(name).version()
        files_before = len(self._table(name).file_uris())
        stats: dict[str, Any] = {"table": name, "engine": self.engine, "files_before": files_before}
        hours = None if vacuum_hours is None else math.ceil(vacuum_hours)
        if hours is not None and hours < 0:
            raise RedTableError(f"vacuum of red table {name!r}: retention {vacuum_hours} h < 0")
        if self.engine == "spark":
            self._spark_maintain(name, optimize, hours, enforce_retention, stats)
        else:
            dt = self._table(name)
            if optimize:
                stats["optimize"] = dt.optimize.compact()
                dt.create_checkpoint()
            if hours is not None:
                try:
                    removed = dt.vacuum(
                        retention_hours=hours,
                        dry_run=False,
                        enforce_retention_duration=enforce_retention,
                    )
                except Exception as e:
                    if enforce_retention and hours < MIN_SAFE_VACUUM_HOURS:
                        raise RedTableError(
                            f"vacuum of red table {name!r} at {path} refused retention {hours} h "
                            f"(below the table's retention, 168 h by default): {e}; pass "
                            "enforce_retention=False only if nothing else reads the table"
                        ) from e
                    raise
                stats["vacuum_removed"] = len(removed)
        self._synced(name, before)  # the compacted files, the checkpoint, vacuum's commits
        stats["files_after"] = len(self._table(name).file_uris())
        stats["version"] = self._table(name).version()
        log_event(log, 20, "table maintained", **stats)
        return stats

    def _spark_maintain(
        self, name: str, optimize: bool, hours: int | None, enforce: bool, stats: dict[str, Any]
    ) -> None:
        assert self.spark is not None
        target = self._spark_table(name)
        if optimize:
            stats["optimize"] = [r.asDict() for r in self.spark.sql(f"OPTIMIZE {target}").collect()]
        if hours is not None:
            key = "spark.databricks.delta.retentionDurationCheck.enabled"
            self.spark.conf.set(key, "true" if enforce else "false")
            try:
                self.spark.sql(f"VACUUM {target} RETAIN {hours} HOURS").collect()
            finally:
                self.spark.conf.set(key, "true")
            stats["vacuum_hours"] = hours
