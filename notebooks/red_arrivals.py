# Databricks notebook source
# MAGIC %md
# MAGIC # diode-bridge — red side: what arrived
# MAGIC Messages landed per exchange over time, latency (bundle created on black → landed on red,
# MAGIC and AMQP `timestamp` → landed), bundle sizes, per-channel contiguity, top exchanges and
# MAGIC routing keys, header queries and one message by `(channel, seq)`.
# MAGIC
# MAGIC Reads the red Delta tables `messages` and `bundles`. On Databricks / Spark with the Delta
# MAGIC jars it uses `spark.read.format("delta")`; elsewhere the `deltalake` package (pip only).
# MAGIC Environment: `DIODE_CONFIG` (red config, default `demo-work/diode.toml`; its
# MAGIC `red.tables_dir` is the tables root), `DIODE_TABLES` (overrides the root, e.g. an
# MAGIC `abfss://` or `dbfs:/` URL), `DIODE_LOOKBACK_DAYS` (default 7; `0` = everything),
# MAGIC `DIODE_CHANNEL` / `DIODE_SEQ` (the message to look up at the end).
# MAGIC `table()` brings the window's rows (never `body`, except for the one message) to pandas:
# MAGIC on a large table, shorten the window or aggregate in Spark SQL first.

# COMMAND ----------
# The one engine switch: `table(name, columns, where)` -> pandas, via Spark+Delta or delta-rs.
import operator
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pandas as pd

from bridge.config import load_config

cfg = load_config(os.environ.get("DIODE_CONFIG", "demo-work/diode.toml"))
TABLES = os.environ.get("DIODE_TABLES") or str(cfg.red.tables_dir)
LOOKBACK_DAYS = float(os.environ.get("DIODE_LOOKBACK_DAYS", "7"))
_SINCE = datetime.now(UTC) - timedelta(days=LOOKBACK_DAYS)
# the column that bounds each table in time (partition columns where there is one)
_WINDOW = {
    "messages": ("landed_date", _SINCE.date()),
    "audit": ("event_date", _SINCE.date()),
    "bundles": ("received_at", _SINCE),
}
_OPS = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
        ">": operator.gt, ">=": operator.ge}  # fmt: skip


def _delta_spark() -> Any:
    """The notebook's Spark session if it can read Delta, else None (then delta-rs is used)."""
    s = globals().get("spark")
    if s is None:
        return None
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return s
    try:
        s._jvm.java.lang.Class.forName("io.delta.tables.DeltaTable")
        return s
    except Exception:
        return None


SPARK = _delta_spark()
ENGINE = "spark" if SPARK is not None else "delta-rs"


def table(
    name: str, columns: list[str] | None = None, where: Sequence[tuple[str, str, Any]] = ()
) -> pd.DataFrame:
    """Rows of red table ``name`` in the lookback window as pandas (timestamps in UTC).

    ``where``: (column, op, value) with op one of = != < <= > >= in; pushed down to the scan.
    """
    path = f"{TABLES.rstrip('/')}/{name}"
    conds = list(where)
    if LOOKBACK_DAYS > 0 and name in _WINDOW:
        conds.append((_WINDOW[name][0], ">=", _WINDOW[name][1]))
    if SPARK is not None:
        from pyspark.sql import functions as F

        SPARK.conf.set("spark.sql.session.timeZone", "UTC")
        df = SPARK.read.format("delta").load(path)
        for c, op, v in conds:
            df = df.filter(F.col(c).isin(list(v)) if op == "in" else _OPS[op](F.col(c), v))
        pdf = (df.select(*columns) if columns else df).toPandas()
        for c in pdf.columns:  # Spark hands back naive session-time (UTC) timestamps
            if pd.api.types.is_datetime64_dtype(pdf[c]):
                pdf[c] = pdf[c].dt.tz_localize("UTC")
        return pdf
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    expr = None
    for c, op, v in conds:
        e = ds.field(c).isin(list(v)) if op == "in" else _OPS[op](ds.field(c), v)
        expr = e if expr is None else expr & e
    data = DeltaTable(path).to_pyarrow_dataset().to_table(columns=columns, filter=expr)
    return data.to_pandas(maps_as_pydicts="strict")


print(f"engine={ENGINE} tables={TABLES} lookback_days={LOOKBACK_DAYS or 'all'}")

# COMMAND ----------
# MAGIC %md ## Messages landed per minute, per exchange
# MAGIC `landed_at` is the red landing commit: arrivals come in bursts, one per landed batch.

# COMMAND ----------
MSG_COLUMNS = ["channel", "seq", "exchange", "routing_key", "timestamp", "headers",
               "bundle_seq", "land_seq", "landed_at"]  # fmt: skip
msgs = table("messages", MSG_COLUMNS)
per_minute = (
    msgs.assign(minute=msgs.landed_at.dt.floor("min"))
    .groupby(["minute", "exchange"])
    .size()
    .unstack(fill_value=0)
)
per_minute.tail(20)

# COMMAND ----------
import matplotlib.pyplot as plt  # noqa: E402 - notebook cell

fig, ax = plt.subplots(figsize=(12, 4))
if not per_minute.empty:
    per_minute.plot(ax=ax, marker=".")
ax.set(xlabel="landed (UTC minute)", ylabel="messages", title="messages landed per minute")
plt.show()

# COMMAND ----------
# MAGIC %md ## Latency per bundle: created on black → received → landed on red
# MAGIC `created_at` is black's clock, `received_at`/`landed_at` red's: skew between the two
# MAGIC machines shows up here (negative transit = red's clock is behind).


# COMMAND ----------
def seconds(delta: pd.Series) -> pd.Series:
    return delta.dt.total_seconds()


def stats(s: pd.Series) -> dict[str, float]:
    s = s.dropna()
    return {"n": len(s), "p50": s.quantile(0.5), "p95": s.quantile(0.95), "max": s.max()}


bundles = table("bundles")
landed = bundles[bundles.status == "landed"].sort_values(["channel", "bundle_seq"])
bundle_latency = pd.DataFrame(
    {
        "channel": landed.channel,
        "bundle_seq": landed.bundle_seq,
        "rows": landed.rows,
        "transit_s": seconds(landed.received_at - landed.created_at),
        "landing_s": seconds(landed.landed_at - landed.received_at),
        "total_s": seconds(landed.landed_at - landed.created_at),
    }
)
bundle_latency.groupby("channel")[["transit_s", "landing_s", "total_s"]].describe(
    percentiles=[0.5, 0.95]
)

# COMMAND ----------
# MAGIC %md ## Latency per message: AMQP `timestamp` property → landed
# MAGIC Only for messages whose producer set `timestamp` (whole seconds, producer's clock).

# COMMAND ----------
stamped = msgs[msgs.timestamp.notna() & msgs.timestamp.between(1, 4_102_444_800)]
message_latency = pd.DataFrame(
    {
        "exchange": stamped.exchange,
        "latency_s": seconds(
            stamped.landed_at
            - pd.to_datetime(stamped.timestamp.astype("int64"), unit="s", utc=True)
        ),
    }
)
latency = pd.DataFrame(
    {
        "bundle created -> landed": stats(bundle_latency.total_s),
        "bundle created -> received": stats(bundle_latency.transit_s),
        "bundle received -> landed": stats(bundle_latency.landing_s),
        "message timestamp -> landed": stats(message_latency.latency_s),
    }
).T
latency

# COMMAND ----------
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
if not bundle_latency.empty:
    a.hist(bundle_latency.total_s, bins=30)
if not message_latency.empty:
    b.hist(message_latency.latency_s, bins=30)
a.set(xlabel="seconds", ylabel="bundles", title="bundle created -> landed")
b.set(xlabel="seconds", ylabel="messages", title="AMQP timestamp -> landed")
plt.show()

# COMMAND ----------
# MAGIC %md ## Bundle sizes (rows and bytes on the wire) and ledger status

# COMMAND ----------
bundle_sizes = bundles.groupby(["channel", "status"]).agg(
    bundles=("bundle_seq", "count"),
    rows=("rows", "sum"),
    mean_rows=("rows", "mean"),
    mb=("file_bytes", lambda s: s.sum() / 2**20),
    mean_kb=("file_bytes", lambda s: s.mean() / 2**10),
)
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
if not landed.empty:
    a.hist(landed.rows.dropna(), bins=30)
    b.hist(landed.file_bytes.dropna() / 2**10, bins=30)
a.set(xlabel="rows", ylabel="bundles", title="rows per landed bundle")
b.set(xlabel="KiB", ylabel="bundles", title="file size per landed bundle")
plt.show()
bundle_sizes

# COMMAND ----------
# MAGIC %md ## Contiguity per channel: bundle seq over time, missing bundles and message holes
# MAGIC A landed bundle's `coverage_first..coverage_last` accounts for every message seq it
# MAGIC carried or declared lost; holes between coverages are messages red has not seen.


# COMMAND ----------
def holes(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The gaps between inclusive ranges (after merging overlaps)."""
    out: list[tuple[int, int]] = []
    top = None
    for a, b in sorted(ranges):
        if top is not None and a > top + 1:
            out.append((top + 1, a - 1))
        top = b if top is None else max(top, b)
    return out


contig = []
for ch, g in landed.groupby("channel"):
    seqs = [int(x) for x in g.bundle_seq]
    missing = holes([(s, s) for s in seqs])
    cov = g.dropna(subset=["coverage_first", "coverage_last"])
    cov_ranges = [
        (int(a), int(b)) for a, b in zip(cov.coverage_first, cov.coverage_last, strict=True)
    ]
    contig.append(
        {
            "channel": ch,
            "bundles": f"{min(seqs)}..{max(seqs)}",
            "landed": len(set(seqs)),
            "missing_bundles": missing,
            "messages": f"{min(a for a, _ in cov_ranges)}..{max(b for _, b in cov_ranges)}"
            if cov_ranges
            else None,
            "message_holes": holes(cov_ranges),
        }
    )
contiguity = pd.DataFrame(contig)

fig, ax = plt.subplots(figsize=(12, 4))
for (ch, status), g in bundles.groupby(["channel", "status"]):
    ax.plot(g.received_at, g.bundle_seq, ".", label=f"{ch} {status}")
ax.set(xlabel="received (UTC)", ylabel="bundle seq", title="bundle seq vs arrival")
if not bundles.empty:
    ax.legend()
plt.show()
contiguity

# COMMAND ----------
# MAGIC %md ## Top exchanges and routing keys

# COMMAND ----------
top_exchanges = msgs.exchange.value_counts().head(20)
top_routing_keys = msgs.groupby(["exchange", "routing_key"]).size().nlargest(20)
fig, ax = plt.subplots(figsize=(8, 4))
if not top_exchanges.empty:
    top_exchanges.sort_values().plot.barh(ax=ax)
ax.set(xlabel="messages", title="top exchanges")
plt.show()
top_routing_keys

# COMMAND ----------
# MAGIC %md ## Headers
# MAGIC `headers` is a `map<string,string>` of the AMQP headers as text (for queries);
# MAGIC `headers_typed` is the exact typed JSON (decode with
# MAGIC `bridge.protocol.headers.typed_json_to_headers`). In Spark SQL:
# MAGIC ```sql
# MAGIC SELECT exchange, headers['x-kind'] AS kind, count(*) FROM delta.`<tables>/messages`
# MAGIC WHERE element_at(headers, 'x-kind') IS NOT NULL GROUP BY 1, 2
# MAGIC ```

# COMMAND ----------
header_pairs = (
    msgs[["exchange", "headers"]]
    .dropna()
    .assign(pair=lambda d: d.headers.map(lambda h: list(h.items())))
    .explode("pair")
    .dropna(subset=["pair"])
)
header_pairs["key"] = header_pairs.pair.str[0]
header_pairs["value"] = header_pairs.pair.str[1]
header_keys = header_pairs.groupby(["exchange", "key"]).size().sort_values(ascending=False)
header_keys.head(20)

# COMMAND ----------
# messages carrying the most common header key, by its value (edit KEY to ask another)
KEY = header_keys.index[0][1] if len(header_keys) else "x-kind"
by_header = (
    header_pairs[header_pairs.key == KEY].groupby(["exchange", "value"]).size().rename("messages")
)
by_header.head(20)

# COMMAND ----------
# MAGIC %md ## One message by `(channel, seq)`, with the bundle that carried it

# COMMAND ----------
from bridge.protocol.headers import typed_json_to_headers  # noqa: E402 - notebook cell

CHANNEL = os.environ.get("DIODE_CHANNEL") or (str(msgs.channel.iloc[0]) if len(msgs) else "")
SEQ = int(os.environ.get("DIODE_SEQ") or (msgs.seq.iloc[0] if len(msgs) else -1))
message = table("messages", where=[("channel", "=", CHANNEL), ("seq", "=", SEQ)])
if len(message):
    row = message.iloc[0]
    body = bytes(row.body)
    print(f"({CHANNEL}, {SEQ}): {len(body)} body bytes, first 64: {body[:64]!r}")
    if row.headers_typed is not None:
        print("typed headers:", typed_json_to_headers(row.headers_typed))
    carrier = bundles[(bundles.channel == CHANNEL) & (bundles.bundle_seq == row.bundle_seq)]
else:
    print(f"({CHANNEL}, {SEQ}) is not in messages (lookback {LOOKBACK_DAYS or 'all'} days)")
    carrier = bundles.iloc[0:0]
print(carrier.T)
message.drop(columns=["body", "properties_raw"]).T
