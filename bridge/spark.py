"""Both sides: build a Spark session tuned for this bridge (local or cluster).

Under ``spark-submit`` the operator's settings win: ``--master``, ``--driver-memory`` and
every ``--conf`` (or ``spark-defaults.conf``) are kept, and the bridge's defaults fill in
only what is absent. Started from Python (``diode ... run``), the bridge launches the JVM
itself: ``master`` or ``$SPARK_MASTER``, then ``spark-defaults.conf`` (``$SPARK_CONF_DIR``,
else ``$SPARK_HOME/conf``: the file that launch reads), then ``local[2]``; the driver heap is
``$DIODE_SPARK_DRIVER_MEMORY``, then the file's ``spark.driver.memory``, then 2g; every other
key the file sets is kept. ``spark.sql.session.timeZone`` is always UTC (the tables'
timestamps are UTC).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from bridge.errors import ConfigError, DiodeError
from bridge.logs import get_logger, log_event

__all__ = [
    "get_spark", "spark_path", "under_spark_submit", "failure_line", "worker_python", "DEFAULTS",
    "FOREIGN_CHECKPOINT", "config_error_in", "job_failed", "spark_defaults_file",
    "read_spark_defaults",
]  # fmt: skip

log = get_logger("bridge.spark")

DEFAULTS: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "50000",
}
"""Set only when neither spark-submit nor ``spark-defaults.conf`` set them."""
FORCED: dict[str, str] = {"spark.sql.session.timeZone": "UTC"}
"""Always set, whatever the operator passed."""
LOCAL_DEFAULTS: dict[str, str] = {
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
}
"""A local master: nothing listens on all interfaces (set only when absent)."""
DRIVER_MEMORY_ENV = "DIODE_SPARK_DRIVER_MEMORY"
FOREIGN_CHECKPOINT = "holds another query's checkpoint"
"""In the ConfigError a streaming source raises for an offset it did not write (a checkpoint
dir shared with another query): :func:`config_error_in` finds it in the query's failure."""
_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def under_spark_submit() -> bool:
    """True when this Python was started by spark-submit (its JVM is already running)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_path(path: Path | str) -> str:
    """``path`` (a local path: the config allows no other) as the fully qualified URI handed to
    Spark: ``file:///abs/path``. Spark resolves a path without a scheme against
    ``fs.defaultFS`` (``hdfs:``, ``dbfs:`` on clusters), while delta-rs and the bridge use the
    local file: two different places. Not percent-encoded: Hadoop takes ``%20`` literally."""
    text = str(path)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", text):  # already a URI (s3://, file:, dbfs:/)
        return text
    return "file://" + str(Path(text).resolve())


def _jvm_bytes(size: str) -> int | None:
    """A JVM memory string (``512m``, ``2g``; no unit: MiB, as Spark reads it) in bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", size.lower())
    if m is None:
        return None
    return int(m.group(1)) * _UNITS.get(m.group(2) or "m", 2**20)


def spark_defaults_file() -> Path:
    """The ``spark-defaults.conf`` that launching Spark from Python reads (pyspark starts
    ``spark-submit``): ``$SPARK_CONF_DIR``, else ``$SPARK_HOME/conf``, else pyspark's own."""
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if conf_dir:
        return Path(conf_dir) / "spark-defaults.conf"
    home = os.environ.get("SPARK_HOME")
    if not home:
        from pyspark.find_spark_home import _find_spark_home

        home = _find_spark_home()
    return Path(home) / "conf" / "spark-defaults.conf"


_PROPERTY = re.compile(r"^\s*([^\s=:]+)\s*[=:\s]\s*(.*?)\s*$")


def read_spark_defaults(path: Path) -> dict[str, str]:
    """The ``spark.*`` keys of a ``spark-defaults.conf`` (Java properties: ``key value``,
    ``key=value`` or ``key:value``; ``#`` and ``!`` start comments). None when absent."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip()[:1] in ("#", "!"):
            continue
        m = _PROPERTY.match(line)
        if m is not None and m.group(1).startswith("spark."):
            found[m.group(1)] = m.group(2)
    return found


def _settings(
    conf: Any, master: str | None, file_values: dict[str, str] | None = None
) -> dict[str, str]:
    """What to set on the builder, given what ``conf`` (spark-submit's SparkConf) holds and,
    started from Python, what ``spark-defaults.conf`` sets (``file_values``): a key either
    gives is the operator's, and kept."""
    file_values = file_values or {}

    def given(key: str) -> bool:
        return bool(conf.contains(key)) or key in file_values

    want: dict[str, str] = {}
    # ``conf`` holds a key only under spark-submit or once this process runs a JVM: the
    # environment then no longer applies; the file's keys still lose to it at launch
    launching = not under_spark_submit()
    if master is not None:  # the caller's explicit choice
        want["spark.master"] = master
    elif launching and os.environ.get("SPARK_MASTER") and not conf.contains("spark.master"):
        want["spark.master"] = os.environ["SPARK_MASTER"]
    elif not given("spark.master"):
        want["spark.master"] = "local[2]"
    for key, value in DEFAULTS.items():
        if not given(key):
            want[key] = value
    if launching and not conf.contains("spark.driver.memory"):
        # only the launcher sets the heap: under spark-submit the JVM runs already
        if os.environ.get(DRIVER_MEMORY_ENV):
            want["spark.driver.memory"] = os.environ[DRIVER_MEMORY_ENV]
        elif "spark.driver.memory" not in file_values:
            want["spark.driver.memory"] = "2g"
    chosen = want.get("spark.master") or conf.get("spark.master") or file_values.get("spark.master")
    if str(chosen or "").startswith("local"):
        want.update({k: v for k, v in LOCAL_DEFAULTS.items() if not given(k)})
    want.update(FORCED)
    return want


def _check_driver_memory(spark: Any) -> None:
    """Warn when $DIODE_SPARK_DRIVER_MEMORY is set but the driver JVM's heap differs (under
    spark-submit it cannot apply: the JVM started before Python)."""
    asked = os.environ.get(DRIVER_MEMORY_ENV)
    if not asked:
        return
    want = _jvm_bytes(asked)
    have = int(spark._jvm.java.lang.Runtime.getRuntime().maxMemory())
    if want is not None and abs(have - want) <= want * 0.1:  # the JVM keeps a little back
        return
    log_event(
        log, 30, f"{DRIVER_MEMORY_ENV} has no effect on this driver: its JVM's max heap is "
        f"{have // 2**20} MiB; under spark-submit pass --driver-memory {asked} (or "
        "spark.driver.memory in spark-defaults.conf), the JVM starts before Python",
        asked=asked, max_heap_mib=have // 2**20, spark_submit=under_spark_submit(),
    )  # fmt: skip


def get_spark(app_name: str, *, master: str | None = None):  # type: ignore[no-untyped-def]
    """Return a SparkSession; ``master`` overrides spark-submit's, else spark-submit's
    ``--master``, else $SPARK_MASTER, else local[2]."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if under_spark_submit():
        SparkContext._ensure_initialized()  # joins spark-submit's JVM: SparkConf sees its settings
    from_file = {} if under_spark_submit() else read_spark_defaults(spark_defaults_file())
    want = _settings(SparkConf(), master, from_file)
    if want.get("spark.master", "").startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name)
    for key, value in want.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("DIODE_SPARK_LOG_LEVEL", "WARN"))
    log_event(log, 20, "spark session", app=app_name, master=spark.sparkContext.master,
              spark_submit=under_spark_submit())  # fmt: skip
    _check_driver_memory(spark)
    return spark


def config_error_in(exc: BaseException) -> ConfigError | None:
    """The configuration error a source raised inside a failed streaming query (Spark hands it
    over as text): a checkpoint written by another query. None for any other failure."""
    for line in str(exc).splitlines():
        if FOREIGN_CHECKPOINT in line:
            return ConfigError(line.split("ConfigError: ", 1)[-1].strip())
    return None


def worker_python() -> str:
    """The Python the executors run (``spark.pyspark.python`` / $PYSPARK_PYTHON)."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    exe = getattr(sc, "pythonExec", None) if sc is not None else None
    return str(exe or os.environ.get("PYSPARK_PYTHON") or "the executors' Python")


_CAUSE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def failure_line(exc: BaseException, python: str) -> str:
    """One line for a job that failed with ``exc`` (a Py4J error, an AnalysisException, a
    query's failure: their text runs to Java and Python stack traces; a DiodeError's own
    message stays, cut to its first line and the last Python error it quotes). ``python``:
    the executors' Python, named when a worker could not import the bridge."""
    text = str(exc)
    if "No module named 'bridge'" in text:
        return (
            f"a Spark worker's Python cannot import the bridge (No module named 'bridge'): "
            f"install diode-bridge into {python} on every node (or ship it with "
            "--py-files/--archives)"
        )
    java = getattr(exc, "java_exception", None)  # py4j.protocol.Py4JJavaError
    if java is not None:
        try:
            text = str(java.toString())
        except Exception:  # noqa: BLE001 - the gateway may be gone: keep str(exc)
            pass
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0] if lines else ""
    causes = [m.group(0).strip() for ln in lines[1:] if (m := _CAUSE.match(ln))]
    cause = causes[-1] if causes else ""  # a Python worker's own error, last in its trace
    kind = "" if isinstance(exc, DiodeError) else f"{type(exc).__name__}: "  # ours: said already
    line = f"{kind}{head}" + (f" ({cause})" if cause and cause != head else "")
    return line[:1000]


def job_failed(exc: BaseException, job: str, side: str) -> int:
    """A Spark job script (``spark_jobs/<job>.py``) that failed with ``exc``: a critical log
    record, one ``error:`` line on stderr (:func:`failure_line`, never a traceback), and the
    exit status: 2 for a configuration error, 1 for anything else."""
    line = failure_line(exc, worker_python())
    said = str(exc) if isinstance(exc, DiodeError) else line  # ours: logged whole
    log_event(get_logger(f"spark_jobs.{job}"), 50, f"{side} job failed: {said}")
    print(f"error: {line}", file=sys.stderr)
    return 2 if isinstance(exc, ConfigError) else 1
