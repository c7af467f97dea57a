"""Both sides, Spark wiring: what ``get_spark`` keeps of the operator's spark-submit settings,
the fully qualified paths handed to Spark (a cluster's ``fs.defaultFS`` is not the local disk),
and the one ``error:`` line a job prints for Spark's own failures. Real Spark in-process where
it can; two real ``spark-submit`` runs (a JVM start each) where only spark-submit shows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge import spark as bridge_spark
from bridge.config import load_config
from bridge.red.job import RedRun
from tests.red_factory import RedKeys, kill_agents, make_bundle, make_rows, write_red_toml

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".venv" / "bin" / "python"
SPARK_SUBMIT = REPO / ".venv" / "bin" / "spark-submit"
NO_HDFS = "hdfs://127.0.0.1:9"
"""A default file system nothing serves: a path Spark resolves against it fails."""


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    root = Path(os.path.realpath("/tmp")) / f"ss{os.getpid()}"  # short: gpg socket paths
    root.mkdir(exist_ok=True)
    k = RedKeys.create(root)
    yield k
    kill_agents(root)


def red_site(root: Path, keys: RedKeys, seq: int = 1) -> Path:
    """A red config under ``root`` with one good bundle in its inbox; the config's path."""
    toml = write_red_toml(root, keys, {"orders": True})
    made = root / "made"
    made.mkdir()
    b = make_bundle(made, keys, "orders", seq, make_rows("orders", range(1, 11)), None)
    inbox = root / "red" / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    os.replace(b.path, inbox / b.path.name)
    return toml


# -- get_spark: the operator's settings win ----------------------------------------------------


class Conf:
    """What ``pyspark.SparkConf`` answers, from a dict."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def contains(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


def test_under_spark_submit_only_absent_settings_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")
    monkeypatch.setenv("DIODE_SPARK_DRIVER_MEMORY", "3g")
    monkeypatch.setenv("SPARK_MASTER", "local[2]")
    given = {
        "spark.master": "yarn",
        "spark.sql.shuffle.partitions": "64",
        "spark.driver.memory": "8g",
        "spark.sql.session.timeZone": "Europe/Paris",
    }
    want = bridge_spark._settings(Conf(given), None)
    assert "spark.master" not in want and "spark.sql.shuffle.partitions" not in want
    assert "spark.driver.memory" not in want  # the JVM runs already: spark-submit's is real
    assert "spark.driver.bindAddress" not in want  # not a local master
    assert want["spark.sql.session.timeZone"] == "UTC"  # always
    assert want["spark.ui.enabled"] == "false"  # absent: the bridge's default
    assert not any("stopGracefullyOnShutdown" in k for k in want)  # no such key in Spark 4
    # spark-submit without --driver-memory: still not set (it could not apply)
    assert "spark.driver.memory" not in bridge_spark._settings(Conf({"spark.master": "x"}), None)


def test_started_from_python_the_bridge_launches_with_its_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    monkeypatch.setenv("DIODE_SPARK_DRIVER_MEMORY", "3g")
    monkeypatch.setenv("SPARK_MASTER", "local[1]")
    want = bridge_spark._settings(Conf({}), None)
    assert want["spark.master"] == "local[1]" and want["spark.driver.memory"] == "3g"
    assert want["spark.driver.bindAddress"] == "127.0.0.1"
    assert want["spark.sql.shuffle.partitions"] == "2"
    assert bridge_spark._settings(Conf({}), "local[3]")["spark.master"] == "local[3]"


def test_started_from_python_spark_defaults_conf_is_the_operators(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``diode ... run`` launches the JVM itself: what ``spark-defaults.conf`` sets is kept
    (the bridge's defaults fill in only what is absent), $SPARK_MASTER and
    $DIODE_SPARK_DRIVER_MEMORY still win over the file."""
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    monkeypatch.delenv("SPARK_MASTER", raising=False)
    monkeypatch.delenv("DIODE_SPARK_DRIVER_MEMORY", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    (tmp_path / "spark-defaults.conf").write_text(
        "# site settings\n! old-style comment\n\n"
        "spark.sql.shuffle.partitions   16\n"
        "spark.master=spark://head:7077\n"
        "spark.driver.memory: 6g\n"
        "spark.ui.enabled true\n"
        "not.spark.key 1\n"
    )
    assert bridge_spark.spark_defaults_file() == tmp_path / "spark-defaults.conf"
    found = bridge_spark.read_spark_defaults(bridge_spark.spark_defaults_file())
    assert found == {
        "spark.sql.shuffle.partitions": "16",
        "spark.master": "spark://head:7077",
        "spark.driver.memory": "6g",
        "spark.ui.enabled": "true",
    }
    want = bridge_spark._settings(Conf({}), None, found)
    for key in found:
        assert key not in want, (key, want)  # kept: the launch reads the file itself
    assert want["spark.sql.execution.arrow.pyspark.enabled"] == "true"  # absent: filled in
    assert "spark.driver.bindAddress" not in want  # the file's master is not local
    monkeypatch.setenv("SPARK_MASTER", "local[1]")
    monkeypatch.setenv("DIODE_SPARK_DRIVER_MEMORY", "3g")
    want = bridge_spark._settings(Conf({}), None, found)
    assert want["spark.master"] == "local[1]" and want["spark.driver.memory"] == "3g"
    assert want["spark.driver.bindAddress"] == "127.0.0.1"
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "none"))
    assert bridge_spark.read_spark_defaults(bridge_spark.spark_defaults_file()) == {}


@pytest.mark.spark
def test_diode_run_launch_keeps_spark_defaults_conf(tmp_path: Path) -> None:
    """A real launch from Python (as ``diode black run`` does) with a spark-defaults.conf:
    the running session has the file's values, not the bridge's defaults."""
    (tmp_path / "spark-defaults.conf").write_text(
        "spark.sql.shuffle.partitions 7\nspark.driver.memory 700m\n"
    )
    probe = (
        "from bridge.spark import get_spark\n"
        "s = get_spark('defaults-probe')\n"
        "heap = s._jvm.java.lang.Runtime.getRuntime().maxMemory() // 2**20\n"
        "print(s.conf.get('spark.sql.shuffle.partitions'), s.sparkContext.master, heap)\n"
        "s.stop()\n"
    )
    env = dict(os.environ, SPARK_CONF_DIR=str(tmp_path), DIODE_SPARK_LOG_LEVEL="ERROR")
    for key in ("PYSPARK_GATEWAY_PORT", "SPARK_MASTER", "DIODE_SPARK_DRIVER_MEMORY"):
        env.pop(key, None)
    got = subprocess.run(
        [str(VENV_PY), "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert got.returncode == 0, (got.stdout + got.stderr)[-4000:]
    partitions, master, heap = got.stdout.strip().splitlines()[-1].split()
    assert partitions == "7" and master == "local[2]", got.stdout
    assert 500 <= int(heap) <= 700, heap  # the file's 700m, not the bridge's 2g


def test_spark_paths_are_fully_qualified_and_not_percent_encoded(tmp_path: Path) -> None:
    odd = tmp_path / "a b%c"
    assert bridge_spark.spark_path(odd) == f"file://{odd.resolve()}"
    rel = Path(os.path.relpath(odd))
    assert bridge_spark.spark_path(rel) == f"file://{odd.resolve()}"
    assert bridge_spark.spark_path("s3://bucket/t") == "s3://bucket/t"
    assert bridge_spark._jvm_bytes("600m") == 600 * 2**20 and bridge_spark._jvm_bytes("2") == 2**21
    assert bridge_spark._jvm_bytes("lots") is None


# -- in-process, real Spark ------------------------------------------------------------------


@pytest.mark.spark
def test_red_job_checkpoint_is_local_whatever_fs_default_fs_says(
    spark: Any, keys: RedKeys, tmp_path: Path
) -> None:
    """Spark resolves a bare checkpoint path against fs.defaultFS (hdfs: on a cluster): the
    job hands it file:///… so it stays where the config says."""
    cfg = load_config(red_site(tmp_path, keys))
    spark.conf.set("fs.defaultFS", NO_HDFS)  # copied into the Hadoop conf of every query
    try:
        summary = RedRun(cfg).run(spark, "available-now").to_json()
    finally:
        spark.conf.unset("fs.defaultFS")
    assert summary["bundles_landed"] == 1 and summary["messages_landed"] == 10, summary
    assert any((Path(cfg.red.checkpoint_dir) / "offsets").iterdir())


@pytest.mark.spark
def test_black_drain_prints_one_error_line_for_sparks_own_errors(
    spark: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An AnalysisException (not a DiodeError) is one ``error:`` line and exit 1."""
    sys.path.insert(0, str(REPO / "spark_jobs"))
    try:
        import black_drain  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(REPO / "spark_jobs"))

    def failing_run(cfg: Any, s: Any, *a: Any, **kw: Any) -> Any:
        return s.sql("SELECT * FROM diode_no_such_table").collect()

    monkeypatch.setattr("bridge.config.load_config", lambda path: object())
    monkeypatch.setattr("bridge.spark.get_spark", lambda name: spark)
    monkeypatch.setattr("bridge.black.job.run_black", failing_run)
    assert black_drain.main(["--config", "/nonexistent.toml"]) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "AnalysisException" in lines[0], err
    assert "diode_no_such_table" in lines[0] and "Traceback" not in err


# -- spark-submit ----------------------------------------------------------------------------


def submit(args: list[str], env: dict[str, str], timeout: float = 240) -> Any:
    env = dict(os.environ, PYSPARK_PYTHON=str(VENV_PY), PYSPARK_DRIVER_PYTHON=str(VENV_PY), **env)
    env.pop("PYSPARK_GATEWAY_PORT", None)
    env.pop("SPARK_MASTER", None)
    return subprocess.run(
        [str(SPARK_SUBMIT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.spark
def test_spark_submit_keeps_the_operators_settings_and_lands_on_the_local_paths(
    keys: RedKeys, tmp_path: Path
) -> None:
    toml = red_site(tmp_path, keys)
    got = submit(
        [
            "--master",
            "local[1]",
            "--driver-memory",
            "600m",
            "--conf",
            f"spark.hadoop.fs.defaultFS={NO_HDFS}",
            "spark_jobs/red_land.py",
            "--config",
            str(toml),
            "--trigger",
            "available-now",
        ],  # fmt: skip
        {"DIODE_SPARK_DRIVER_MEMORY": "2g", "DIODE_SPARK_LOG_LEVEL": "ERROR"},
    )
    out = got.stdout + got.stderr
    assert got.returncode == 0, out[-4000:]
    summary = json.loads(got.stdout.strip().splitlines()[-1])
    assert summary["bundles_landed"] == 1, summary
    events = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"ts"')]
    session = [e for e in events if e["msg"] == "spark session"]
    assert session and session[0]["master"] == "local[1]", events  # not the bridge's local[2]
    warned = [e for e in events if "has no effect on this driver" in e["msg"]]
    assert warned and "--driver-memory 2g" in warned[0]["msg"], events
    assert warned[0]["max_heap_mib"] == 600
    assert any((tmp_path / "red" / "checkpoint" / "offsets").iterdir())


@pytest.mark.spark
def test_spark_submit_with_a_worker_python_lacking_the_bridge_says_what_to_install(
    keys: RedKeys, tmp_path: Path
) -> None:
    """The executors' Python cannot import ``bridge``: one ``error:`` line naming that Python
    and the fix, exit 1 through exit_now (no traceback)."""
    toml = red_site(tmp_path, keys)
    strip = tmp_path / "strip.py"
    strip.write_text(
        "import runpy, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path[:] = [p for p in sys.path if p not in ('', '.', {str(REPO)!r})]\n"
        "a = sys.argv[1:]\n"
        "if a[:1] == ['-m']:\n"
        "    sys.argv = a[1:]\n"
        "    runpy.run_module(a[1], run_name='__main__', alter_sys=True)\n"
        "else:\n"
        "    sys.argv = a\n"
        "    runpy.run_path(a[0], run_name='__main__')\n"
    )
    worker = tmp_path / "python-without-bridge"
    worker.write_text(f'#!/bin/sh\nexec {VENV_PY} {strip} "$@"\n')
    worker.chmod(0o755)
    got = submit(
        [
            "--master",
            "local[1]",
            "--conf",
            f"spark.pyspark.python={worker}",
            "--conf",
            f"spark.pyspark.driver.python={VENV_PY}",  # else the driver's too
            "spark_jobs/red_land.py",
            "--config",
            str(toml),
            "--trigger",
            "available-now",
        ],  # fmt: skip
        {"DIODE_SPARK_LOG_LEVEL": "ERROR"},
    )
    out = got.stdout + got.stderr
    assert got.returncode == 1, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, out[-4000:]
    assert f"install diode-bridge into {worker} on every node" in lines[0], lines
    assert "Traceback" not in out, out[-4000:]
