# Databricks notebook source
# MAGIC %md
# MAGIC # diode-bridge — red side: audit, gaps and alarms
# MAGIC Audit events over time, transit gaps (opened / closed / still open), losses declared by
# MAGIC black, rejected and quarantined files, conflicts and other alarms, the hash chain status
# MAGIC of landed bundles, and replay / approval events.
# MAGIC
# MAGIC Reads the red Delta tables `audit` and `bundles`. On Databricks / Spark with the Delta
# MAGIC jars it uses `spark.read.format("delta")`; elsewhere the `deltalake` package (pip only).
# MAGIC Environment: `DIODE_CONFIG` (red config, default `demo-work/diode.toml`; its
# MAGIC `red.tables_dir` is the tables root), `DIODE_TABLES` (overrides the root, e.g. an
# MAGIC `abfss://` or `dbfs:/` URL), `DIODE_LOOKBACK_DAYS` (default 7; `0` = everything: a gap
# MAGIC opened before the window shows up only through its closing events).

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
# MAGIC %md ## Audit events over time, by kind

# COMMAND ----------
import json  # noqa: E402 - notebook cell

import matplotlib.pyplot as plt  # noqa: E402 - notebook cell

audit = table("audit").sort_values("at").reset_index(drop=True)
audit["d"] = audit.detail.map(lambda t: json.loads(t) if isinstance(t, str) and t else {})
events_per_minute = (
    audit.assign(minute=audit["at"].dt.floor("min"))
    .groupby(["minute", "event"])
    .size()
    .unstack(fill_value=0)
)
fig, ax = plt.subplots(figsize=(12, 4))
if not events_per_minute.empty:
    events_per_minute.plot(ax=ax, marker=".")
ax.set(xlabel="UTC minute", ylabel="events", title="audit events per minute")
plt.show()
audit.groupby(["event", "channel"], dropna=False).size().unstack(fill_value=0)

# COMMAND ----------
# MAGIC %md ## Transit gaps: bundles red has not received
# MAGIC `gap_opened` names a run of missing bundle seqs (`detail.first_bundle_seq..last_bundle_seq`;
# MAGIC `seq_first..seq_last` is the message seq range when known); each late arrival closes one
# MAGIC bundle seq (`gap_closed`). An operator can declare missing bundles lost for good
# MAGIC (`gap_written_off`, `detail.first_bundle_seq..last_bundle_seq`), or retire the channel
# MAGIC (`channel_retired`, after a `gap_written_off` per open gap; `detail.gaps_written_off`).
# MAGIC Still missing = opened minus arrived minus written off; a gap with none left is `closed`
# MAGIC (all arrived), `written off` or `retired`. A written-off bundle that lands after all closes
# MAGIC with `gap_closed` reason `written_off` and counts as arrived. `via_heartbeat`: the gap was
# MAGIC found by a heartbeat naming a bundle red never got (`missing_last_bundle`).


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


def span(a: object, b: object) -> str | None:
    return None if pd.isna(a) or pd.isna(b) else f"{int(a)}..{int(b)}"  # type: ignore[call-overload]


opened = audit[audit.event == "gap_opened"]
closed = audit[audit.event == "gap_closed"]
wrote_off = audit[audit.event == "gap_written_off"]
retired = audit[audit.event == "channel_retired"]
via_hb = {
    (r.channel, r.d.get("first_bundle_seq"), r.d.get("last_bundle_seq"))
    for r in audit[audit.event == "missing_last_bundle"].itertuples()
}
# bundle seqs declared lost for good, per channel: (first, last, at, how)
lost: dict[str, list[tuple[int, int, Any, str]]] = {}
for r in wrote_off.itertuples():
    w = (int(r.d["first_bundle_seq"]), int(r.d["last_bundle_seq"]), r.at, "written off")
    lost.setdefault(r.channel, []).append(w)
for r in retired.itertuples():  # its gaps also have their gap_written_off rows: a set below
    for x, y in r.d.get("gaps_written_off") or []:
        lost.setdefault(r.channel, []).append((int(x), int(y), r.at, "retired"))
gap_rows = []
for r in opened.itertuples():
    a, b = int(r.d["first_bundle_seq"]), int(r.d["last_bundle_seq"])
    late = closed[(closed.channel == r.channel) & closed.bundle_seq.between(a, b)]
    got = sorted({int(x) for x in late.bundle_seq})
    cut = [(max(a, x), min(b, y), at, how) for x, y, at, how in lost.get(r.channel, [])
           if x <= b and y >= a]  # fmt: skip
    # sentinels a-1 and b+1 make holes() return the missing runs inside a..b
    still = holes(
        [(a - 1, a - 1), *((x, x) for x in got), *((x, y) for x, y, *_ in cut), (b + 1, b + 1)]
    )
    # written off and not arrived since (a written-off bundle that lands counts as arrived)
    gone = b - a + 1 - len(got) - sum(y - x + 1 for x, y in still)
    status = "open" if still else "closed"
    if not still and gone:
        status = "retired" if any(how == "retired" for *_, how in cut) else "written off"
    gap_rows.append(
        {
            "channel": r.channel,
            "opened_at": r.at,
            "bundle_seqs": f"{a}..{b}",
            "message_seqs": span(r.seq_first, r.seq_last),
            "via_heartbeat": (r.channel, a, b) in via_hb,
            "missing": b - a + 1,
            "arrived_late": len(got),
            "written_off": gone,
            "still_missing": still,
            "last_closed_at": late["at"].max() if len(late) else None,
            "written_off_at": max(at for *_, at, _ in cut) if cut else None,
            "status": status,
        }
    )
GAP_COLUMNS = ["channel", "opened_at", "bundle_seqs", "message_seqs", "via_heartbeat",
               "missing", "arrived_late", "written_off", "still_missing", "last_closed_at",
               "written_off_at", "status"]  # fmt: skip
gaps = pd.DataFrame(gap_rows, columns=GAP_COLUMNS)
open_gaps = gaps[gaps.status == "open"]
gap_summary = gaps.groupby("channel").agg(
    gaps=("status", "size"),
    open=("status", lambda s: int((s == "open").sum())),
    bundles_missing=("missing", "sum"),
    arrived_late=("arrived_late", "sum"),
    written_off=("written_off", "sum"),
)
gap_summary["still_missing"] = (
    gap_summary.bundles_missing - gap_summary.arrived_late - gap_summary.written_off
)
gap_summary

# COMMAND ----------
# missing bundles over time per channel: +n when a gap opens, -1 per late arrival, -n when n
# are written off (a written-off bundle that lands after all was taken off already)
wrote_off_n = wrote_off.d.map(
    lambda d: int(d["last_bundle_seq"]) - int(d["first_bundle_seq"]) + 1
).astype(int)
arrived = (closed.reason != "written_off").astype(int)
steps = pd.concat(
    [
        pd.DataFrame({"channel": gaps.channel, "at": gaps.opened_at, "delta": gaps.missing}),
        pd.DataFrame({"channel": closed.channel, "at": closed["at"], "delta": -arrived}),
        pd.DataFrame({"channel": wrote_off.channel, "at": wrote_off["at"], "delta": -wrote_off_n}),
    ]
).sort_values("at", kind="stable")
fig, ax = plt.subplots(figsize=(12, 4))
for ch, g in steps.groupby("channel"):
    ax.step(g["at"], g.delta.cumsum(), where="post", label=ch)
ax.set(xlabel="UTC", ylabel="bundles missing", title="open transit gaps")
if not steps.empty:
    ax.legend()
plt.show()
open_gaps

# COMMAND ----------
# MAGIC %md ## Losses declared by black (`gap_declared`)
# MAGIC Message seqs black knows it never shipped (queue overflow, spool loss...): carried in a
# MAGIC bundle's manifest, with the reason. Not recoverable by a resend.

# COMMAND ----------
declared = audit[audit.event == "gap_declared"][
    ["at", "channel", "bundle_seq", "seq_first", "seq_last", "reason"]
].assign(messages=lambda d: d.seq_last - d.seq_first + 1)
declared_by_reason = declared.groupby(["channel", "reason"]).agg(
    ranges=("messages", "size"), messages=("messages", "sum")
)
fig, ax = plt.subplots(figsize=(8, 3))
if not declared_by_reason.empty:
    declared_by_reason.messages.plot.barh(ax=ax)
ax.set(xlabel="messages declared lost", title="losses declared by black")
plt.show()
declared

# COMMAND ----------
# MAGIC %md ## Rejected and quarantined files, by reason
# MAGIC Every file red refused (bad signature, unknown signer, name/manifest mismatch, malformed,
# MAGIC conflict...) is moved to `quarantine/` with its reason. Counted from `audit` alone, one
# MAGIC row per file: `rejected` (failed a check), `quarantined` (refused by the intake before any
# MAGIC check) or `conflict`. The ledger's `quarantined` / `conflict` rows are the same bundle
# MAGIC files again (heartbeats and unnamed files have none), so they are not added.

# COMMAND ----------
bundles = table("bundles")
refused = audit[audit.event.isin(["rejected", "quarantined", "conflict"])]
rejections = (
    refused[["event", "reason", "channel"]]
    .fillna("?")
    .groupby(["event", "reason", "channel"])
    .size()
    .rename("files")
)
fig, ax = plt.subplots(figsize=(8, 3))
if not rejections.empty:
    rejections.plot.barh(ax=ax)
ax.set(xlabel="files", title="rejected / quarantined")
plt.show()
refused[["at", "event", "channel", "bundle_seq", "file_name", "reason", "detail"]]

# COMMAND ----------
# MAGIC %md ## Alarms: conflicts, broken chains, coverage mismatches, silent links, replay failures
# MAGIC A **conflict** is a second, different bundle for a `(channel, bundle_seq)` that already
# MAGIC landed: below, the quarantined file's plaintext hash next to the landed one.

# COMMAND ----------
ALARMS = ["conflict", "chain_broken", "coverage_mismatch", "heartbeat_replayed", "link_silent",
          "replay_failed"]  # fmt: skip
alarms = audit[audit.event.isin(ALARMS)][
    ["at", "event", "channel", "bundle_seq", "file_name", "seq_first", "seq_last", "reason",
     "detail"]
]  # fmt: skip
landed = bundles[bundles.status == "landed"]
conflicts = bundles[bundles.status == "conflict"][
    ["channel", "bundle_seq", "file_name", "reason", "received_at", "plaintext_sha256"]
].merge(
    landed[["channel", "bundle_seq", "file_name", "plaintext_sha256"]],
    on=["channel", "bundle_seq"],
    how="left",
    suffixes=("", "_landed"),
)
print(conflicts.to_string())
alarms

# COMMAND ----------
# MAGIC %md ## Hash chain of landed bundles
# MAGIC `verified`: `prev_sha256` matches the landed predecessor; `pending`: the predecessor has
# MAGIC not landed yet (a gap); `broken`: it landed with another hash (alarm); `first`: the
# MAGIC channel's first bundle.

# COMMAND ----------
chain = pd.crosstab(landed.channel, landed.chain_status)
chain_problems = landed[landed.chain_status.isin(["pending", "broken"])][
    ["channel", "bundle_seq", "chain_status", "prev_sha256", "file_name", "landed_at"]
].sort_values(["channel", "bundle_seq"])
print(chain.to_string())
chain_problems

# COMMAND ----------
# MAGIC %md ## Replay into red RabbitMQ, approvals

# COMMAND ----------
# Rows come from `detail.rows`: a channel's seqs are shared by all its exchanges, so an
# exchange's seq_first..seq_last spans the other exchanges' rows too. `rows_replayed`: rows the
# red broker confirmed; `rows_skipped`: rows a `replay_failed` (bad_row, unroutable) passed
# over; the other columns count events.
replay = audit[audit.event.isin(["replayed", "replay_failed", "approved", "revoked"])].copy()
replay["rows"] = replay.d.map(lambda d: int(d.get("rows") or 0))
replay_by_exchange = replay.pivot_table(
    index="exchange", columns="event", values="at", aggfunc="size", fill_value=0
).rename(columns={"replayed": "replayed_events"})
replay_by_exchange["rows_replayed"] = (
    replay[replay.event == "replayed"].groupby("exchange").rows.sum()
)
replay_by_exchange["rows_skipped"] = (
    replay[replay.event == "replay_failed"].groupby("exchange").rows.sum()
)
replay_by_exchange = replay_by_exchange.fillna(0).astype(int)
replayed = replay[replay.event == "replayed"]
fig, ax = plt.subplots(figsize=(12, 3))
for ex, g in replayed.groupby("exchange"):
    ax.step(g["at"], g.rows.cumsum(), where="post", label=ex)
ax.set(xlabel="UTC", ylabel="messages", title="replayed (cumulative)")
if not replayed.empty:
    ax.legend()
plt.show()
replay_by_exchange
