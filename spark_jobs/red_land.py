"""Spark job, red: verify, decrypt and land inbox bundles in Delta exactly once.

    spark-submit spark_jobs/red_land.py --config conf/diode.toml \
        [--trigger available-now|continuous] [--timeout N] [--metrics-port P]

Wiring only: the logic lives in ``bridge.red``.
"""

from __future__ import annotations

import argparse
import json
import threading


def main(argv: list[str] | None = None) -> int:
    from bridge.config import load_config
    from bridge.logs import setup_logging
    from bridge.red.job import run_red
    from bridge.signals import stop_on_signals
    from bridge.spark import get_spark, job_failed

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", default=None, help="diode TOML (default: $DIODE_CONFIG or conf/diode.toml)"
    )
    p.add_argument("--trigger", choices=["available-now", "continuous"], default="available-now")
    p.add_argument(
        "--timeout", type=float, default=None, help="stop a continuous run after N seconds"
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on 127.0.0.1")
    a = p.parse_args(argv)
    try:
        setup_logging()
        if a.metrics_port:
            from bridge.metrics import serve_metrics

            serve_metrics(a.metrics_port, option="--metrics-port")
        cfg = load_config(a.config)
        spark = get_spark("diode-red")
        with stop_on_signals(threading.Event()) as stop:  # SIGTERM/SIGINT: a graceful stop
            summary = run_red(cfg, spark, a.trigger, timeout=a.timeout, stop=stop)
    except Exception as e:  # ours, Py4J, AnalysisException: one line and a status, no traceback
        return job_failed(e, "red_land", "red")
    print(json.dumps(summary.to_json()))
    return 0


if __name__ == "__main__":
    from bridge.signals import exit_now

    exit_now(main())
