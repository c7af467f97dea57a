"""Both sides: the ``diode`` command line (keys, mirror, black run, resend, status, gaps, demo)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from bridge.errors import ConfigError, DiodeError

__all__ = ["main", "cli"]


def _fail(e: DiodeError) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2 if isinstance(e, ConfigError) else 1)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DiodeError as e:
            _fail(e)


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="diode TOML (default: $DIODE_CONFIG or conf/diode.toml)",
)


def _load(config_path: Path | None):  # type: ignore[no-untyped-def]
    from bridge.config import load_config

    return load_config(config_path)


@click.group(cls=_Group)
@click.option(
    "--log-level", default=None, help="DEBUG, INFO, WARNING (default $DIODE_LOG_LEVEL or INFO)"
)
@click.option("--log-format", type=click.Choice(["json", "text"]), default=None)
def cli(log_level: str | None, log_format: str | None) -> None:
    """diode-bridge: RabbitMQ traffic one way across a data diode."""
    from bridge.logs import setup_logging

    setup_logging(log_level, json_logs=None if log_format is None else log_format == "json")


# -- keys ----------------------------------------------------------------------------------------
@cli.group()
def keys() -> None:
    """Create and inspect the GnuPG keys of both sides."""


@keys.command("init")
@click.option(
    "--dir",
    "keys_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("keys"),
    show_default=True,
    help="creates <dir>/black, <dir>/red (GnuPG homes) and <dir>/pub",
)
@click.option(
    "--red-name",
    "red_names",
    multiple=True,
    default=("red",),
    show_default=True,
    help="one red recipient key per name (repeat the option)",
)
@click.option("--algo", type=click.Choice(["ed25519", "rsa"]), default="ed25519", show_default=True)
@click.option("--bridge-id", default="diode-bridge", show_default=True)
@click.option("--force", is_flag=True, help="replace existing key homes")
def keys_init(
    keys_dir: Path, red_names: tuple[str, ...], algo: str, bridge_id: str, force: bool
) -> None:
    """Create the black signing key and red recipient key(s); print the config lines."""
    from bridge.crypto.keys import init_keys

    inv = init_keys(keys_dir, red_names=red_names, algo=algo, bridge_id=bridge_id, force=force)  # type: ignore[arg-type]
    click.echo(f"black signing key: {inv.black_fpr}  (home {inv.black_home})")
    for name, fpr in inv.red_fprs.items():
        click.echo(f"red key {name!r}: {fpr}  (home {inv.red_home})")
    click.echo(f"public keys exported to {inv.pub_dir}")
    click.echo("\n# paste into your diode TOML:\n" + inv.to_toml_snippet())


# -- config / mirror ---------------------------------------------------------------------------
@cli.command("check")
@config_option
def check(config_path: Path | None) -> None:
    """Validate the config and the black keys; exit non-zero with the fix if anything is wrong."""
    from bridge.black.broker import connect
    from bridge.black.job import check_black_config

    cfg = _load(config_path)
    check_black_config(cfg)
    connect(cfg.black, purpose="diode check").close()
    if cfg.black.discover:
        from bridge.black.management import ManagementClient

        mc = ManagementClient(
            cfg.black.management_url,
            cfg.black.management_user,
            cfg.black.management_password.get_secret_value(),
        )
        version = mc.overview().get("rabbitmq_version")
        mc.close()
        click.echo(f"broker: RabbitMQ {version}")
    from bridge.black.probe import probe_stream_fidelity

    fid = probe_stream_fidelity(cfg.black)
    if fid.exact:
        click.echo("stream fidelity: every AMQP header type is kept")
    else:
        click.echo(
            f"warning: this broker's stream queues drop header types {fid.dropped} and refuse "
            f"{fid.refused} (the publisher's connection is closed): messages with them cannot "
            "cross unchanged; see docs/runbook.md, 'Broker limits'",
            err=True,
        )
    click.echo(
        f"ok: {len(cfg.channels)} channel(s), keys present, broker reachable; config {cfg.source}"
    )


@cli.command("mirror")
@config_option
def mirror(config_path: Path | None) -> None:
    """Declare the stream queues and bindings once and print what is mirrored."""
    from pathlib import Path as P

    from bridge.black.mirror import Mirror

    cfg = _load(config_path)
    report = Mirror(cfg, catalog_path=P(cfg.black.state_dir) / "exchanges.json").sync()
    click.echo(json.dumps(dataclasses.asdict(report), indent=2, default=str))


# -- black -----------------------------------------------------------------------------------------
@cli.group()
def black() -> None:
    """Black (low) side."""


@black.command("run")
@config_option
@click.option(
    "--trigger",
    type=click.Choice(["available-now", "continuous"]),
    default="continuous",
    show_default=True,
    help="available-now: drain the backlog and stop (schedulers)",
)
@click.option("--timeout", type=float, default=None, help="stop after N seconds")
@click.option(
    "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on 127.0.0.1"
)
def black_run(
    config_path: Path | None, trigger: str, timeout: float | None, metrics_port: int | None
) -> None:
    """Drain the mirrored exchanges into sealed bundles in the outbox."""
    from bridge.black.job import BlackRun
    from bridge.metrics import serve_metrics
    from bridge.spark import get_spark

    cfg = _load(config_path)
    run = BlackRun(cfg)  # fails fast on keys/config before Spark starts
    run.mirror.sync()  # ... and on the broker, the management API and stream arguments
    if metrics_port:
        serve_metrics(metrics_port)
    spark = get_spark("diode-black")
    try:
        summary = run.run(spark, trigger, timeout=timeout)  # type: ignore[arg-type]
    finally:
        spark.stop()
    click.echo(json.dumps(summary.to_json()))


@cli.command("resend")
@config_option
@click.option("--channel", required=True)
@click.option("--from", "first", type=click.IntRange(1), required=True, help="first bundle seq")
@click.option(
    "--to", "last", type=click.IntRange(1), required=True, help="last bundle seq (inclusive)"
)
def resend(config_path: Path | None, channel: str, first: int, last: int) -> None:
    """Re-drop archived bundles of a channel, unchanged, into the outbox."""
    from bridge.diode.file_drop import Outbox

    cfg = _load(config_path)
    cfg.channel(channel)
    ob = Outbox(
        cfg.black.outbox, cfg.black.archive, retention_days=cfg.black.archive_retention_days
    )
    rep = ob.resend(channel, first, last)
    click.echo(json.dumps({"resent": rep.resent, "missing": rep.missing}))
    if rep.missing:
        click.echo(
            f"warning: {len(rep.missing)} bundle(s) not in the archive (pruned?): "
            f"{rep.missing[:20]}",
            err=True,
        )
        sys.exit(1)


@cli.command("status")
@config_option
def status(config_path: Path | None) -> None:
    """Per channel: last bundle and message seq, counters, pending work, outbox backlog."""
    from bridge.black.report import channel_status

    click.echo(json.dumps(channel_status(_load(config_path)), indent=2))


@cli.command("gaps")
@config_option
def gaps(config_path: Path | None) -> None:
    """Messages known lost on black (stream retention, oversize), per channel and reason."""
    from bridge.black.report import channel_status

    st = channel_status(_load(config_path))
    click.echo(json.dumps({name: c["lost"] for name, c in st["channels"].items()}, indent=2))


# -- demo ------------------------------------------------------------------------------
@cli.command("demo")
@click.option("--messages", type=int, default=20000, show_default=True)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-work"),
    show_default=True,
)
@click.option("--vhost", default="diode-demo", show_default=True, help="black vhost (re-created)")
@click.option(
    "--big-every",
    type=int,
    default=5000,
    show_default=True,
    help="every Nth message carries a 3 MB body (0: none)",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON summary as the last line")
def demo(messages: int, workdir: Path, vhost: str, big_every: int, as_json: bool) -> None:
    """Set up and run the pipeline on this machine: keys, traffic, black job, bundles."""
    from bridge.demo.run import run_demo

    summary = run_demo(workdir, messages, vhost=vhost, big_every=big_every)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        for k, v in summary.items():
            click.echo(f"{k:>18}: {v}")
    if not summary["ok"]:
        sys.exit(1)


def main() -> None:
    """Console entry point. Exits with os._exit after flushing (delta-rs can abort at exit)."""
    code = 0
    try:
        cli.main(standalone_mode=False)
    except SystemExit as e:
        code = int(e.code or 0) if not isinstance(e.code, str) else 1
    except click.exceptions.Abort:
        code = 130
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
