# Databricks notebook source
# MAGIC %md
# MAGIC # diode-bridge — black side: what was shipped
# MAGIC Journal position, losses and the outbox backlog per channel, and the bundles in the
# MAGIC archive over time. Runs on Databricks or locally (`jupytext` / plain Python).
# MAGIC Red-side notebooks (arrivals, latency, gaps, audit over the Delta tables) come with the
# MAGIC red issue. Set `DIODE_CONFIG` to the black config (the demo writes `demo-work/diode.toml`).

# COMMAND ----------
import os

from bridge.black.report import channel_status, files_table
from bridge.config import load_config

cfg = load_config(os.environ.get("DIODE_CONFIG", "demo-work/diode.toml"))
status = channel_status(cfg)
status

# COMMAND ----------
# MAGIC %md ## Losses known on black (gaps carried to red in the manifests)

# COMMAND ----------
{name: c["lost"] for name, c in status["channels"].items()}

# COMMAND ----------
# MAGIC %md ## Archived bundles: size per bundle and cumulative bytes shipped

# COMMAND ----------
archive = files_table(cfg, where="archive").to_pandas()
bundles = archive[archive.kind == "bundle"].sort_values(["channel", "seq"])
bundles["shipped_mb"] = bundles.groupby("channel")["bytes"].cumsum() / 2**20
bundles.tail(20)

# COMMAND ----------
import matplotlib.pyplot as plt  # noqa: E402 - notebook cell

fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
for ch, g in bundles.groupby("channel"):
    a.bar(g.seq, g.bytes / 2**20, label=ch)
    b.plot(g.mtime - g.mtime.min(), g.shipped_mb, label=ch)
a.set(xlabel="bundle seq", ylabel="MB", title="bundle size")
b.set(xlabel="seconds since first bundle", ylabel="MB shipped", title="shipped over time")
a.legend()
plt.show()

# COMMAND ----------
# MAGIC %md ## Waiting in the outbox (the diode's mover has not taken them yet)

# COMMAND ----------
files_table(cfg, where="outbox").to_pandas().groupby(["channel", "kind"]).size()
