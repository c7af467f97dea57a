"""Both sides: build a Spark session tuned for this bridge (local or cluster)."""

from __future__ import annotations

import os
import sys

__all__ = ["get_spark"]


def get_spark(app_name: str, *, master: str | None = None):  # type: ignore[no-untyped-def]
    """Return a SparkSession; ``master`` defaults to $SPARK_MASTER or local[2]."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    master = master or os.environ.get("SPARK_MASTER", "local[2]")
    local = master.startswith("local")
    if local:  # nothing listens on all interfaces: keep a local driver on loopback
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "50000")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", os.environ.get("DIODE_SPARK_DRIVER_MEMORY", "2g"))
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
    )
    if local:
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("DIODE_SPARK_LOG_LEVEL", "WARN"))
    return spark
