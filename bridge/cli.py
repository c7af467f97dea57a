"""Both sides: the ``diode`` command line (keys, mirror, black, red, approve, resend, demo)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import click

from bridge.errors import ConfigError, CryptoError, DiodeError
from bridge.signals import exit_now, stop_on_signals

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


metrics_option = click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="serve Prometheus /metrics on 127.0.0.1:PORT (bound at start: a port in use fails)",
)


def _load(config_path: Path | None):  # type: ignore[no-untyped-def]
    from bridge.config import load_config

    return load_config(config_path)


def _metrics(port: int | None) -> None:
    """Bind --metrics-port now (before the command changes anything): a port in use or
    refused is a ConfigError naming it."""
    if port is not None:
        from bridge.metrics import serve_metrics

        serve_metrics(port, option="--metrics-port")


def _key_problem(e: CryptoError) -> DiodeError:
    """A missing or unusable key found at start is a configuration error (exit 2); a gpg that
    hung is not (exit 1: retrying may help)."""
    from bridge.crypto.gpg import GpgTimeout

    if isinstance(e, GpgTimeout):
        return e
    return ConfigError(str(e))


def _require_gnupg_home(cfg: Any, side: str) -> None:
    """A check must not create the GnuPG home (gpg would): a missing one is reported, with the
    command that creates it and the key in it."""
    home = Path(getattr(cfg, side).gnupg_home)
    if not home.exists():
        raise ConfigError(
            f"{side}.gnupg_home {home} does not exist: create this side's key there with "
            f"`diode keys init --side {side} --home {home}` (it makes the directory, mode "
            f"0700), or point {side}.gnupg_home at the GnuPG home that holds it"
        )
    if not home.is_dir():
        raise ConfigError(f"{side}.gnupg_home {home} is not a directory: point it at one")


def _device(path: Path) -> tuple[int, Path] | None:
    """The device of ``path``, or of its nearest existing parent (where it would be created)."""
    for d in (path, *path.parents):
        try:
            return os.stat(d).st_dev, d
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return None


def _check_black_places(cfg: Any) -> None:
    """What the black job checks when it builds its outbox, without creating anything: the
    staging dir on the file system and mount of the outbox (and udp_outbox; a bind mount keeps
    the device number, so the rename of an absent name is probed), and with archive_mode =
    "link" the archive too. Paths not created yet count as their nearest existing parent."""
    import errno

    from bridge.diode.file_drop import rename_refusal

    b = cfg.black
    staging = Path(b.staging_dir)
    drops = [("outbox", Path(b.outbox))]
    if b.udp_outbox is not None:
        drops.append(("udp_outbox", Path(b.udp_outbox)))
    st = _device(staging)
    for key, d in drops:
        dv = _device(d)
        if st is None or dv is None:
            continue
        fix = (
            "a rename into the outbox is atomic only within one file system and mount, else a "
            "mover could see partial files. Set black.staging_dir to a directory on the "
            "outbox's file system outside the outbox (default: "
            f"{d.parent / ('.' + d.name + '.staging')}); if the outbox is itself a mount point "
            "(a bind mount included), mount the folder above it instead"
        )
        if st[0] != dv[0]:
            raise ConfigError(
                f"black.staging_dir {staging} (on the file system of {st[1]}) is not on the "
                f"file system of black.{key} {d} (on that of {dv[1]}): {fix}"
            )
        refused = rename_refusal(st[1], dv[1])
        if refused is not None and refused.errno == errno.EXDEV:
            raise ConfigError(
                f"black.staging_dir {staging} (at {st[1]}) and black.{key} {d} (at {dv[1]}) "
                "are on one file system but on different mounts (a bind mount): rename(2) "
                f"between them fails ({refused.strerror}). {fix}"
            )
    if b.archive_mode == "link":
        ar = _device(Path(b.archive))
        if st is not None and ar is not None and st[0] != ar[0]:
            raise ConfigError(
                f'black.archive_mode = "link" needs hard links from black.staging_dir {staging} '
                f"into black.archive {b.archive}, which is on another file system (that of "
                f"{ar[1]}): a hard link cannot cross file systems. Put the archive beside the "
                'outbox on its file system, or set black.archive_mode = "copy"'
            )


@click.group(cls=_Group)
@click.option(
    "--log-level",
    default=None,
    help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default $DIODE_LOG_LEVEL or INFO)",
)
@click.option("--log-format", type=click.Choice(["json", "text"]), default=None)
def cli(log_level: str | None, log_format: str | None) -> None:
    """diode-bridge: RabbitMQ traffic one way across a data diode."""
    from bridge.logs import setup_logging

    setup_logging(log_level, json_logs=None if log_format is None else log_format == "json")


# -- keys ----------------------------------------------------------------------------------------
@cli.group()
def keys() -> None:
    """Create, import and check the GnuPG keys; each side creates its own, on its own host."""


def _passphrase_option(file: Path | None, env: str | None):  # type: ignore[no-untyped-def]
    from bridge.crypto.passphrase import Passphrase

    if file is not None and env is not None:
        raise ConfigError("pass one of --passphrase-file and --passphrase-env, not both")
    if file is None and env is None:
        return None
    if env is not None:
        from bridge.crypto.passphrase import check_env_name

        check_env_name(env, "--passphrase-env")  # never echoed: it may be the passphrase
    pp = Passphrase(path=file) if file is not None else Passphrase(env_name=env)
    pp.secret()  # fail fast: missing, empty, multi-line, or readable by others
    return pp


_GPG_BINARY = click.option(
    "--gpg-binary",
    default="gpg",
    show_default=True,
    metavar="GPG",
    help="the gpg to run (a name on PATH or a path; gpgconf from beside it): the side's "
    "<side>.gpg_binary",
)


def _checked_gpg(binary: str) -> None:
    """A --gpg-binary other than the default is checked as the config key is at start."""
    if binary != "gpg":
        from bridge.crypto.gpg import check_gpg_binary

        check_gpg_binary(binary, key="--gpg-binary")


@keys.command("init")
@click.option(
    "--side",
    type=click.Choice(["black", "red"]),
    required=True,
    help="black: the signing key (run on black); red: a decryption key (run on red)",
)
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="GnuPG home (created 0700) [default: keys/black or keys/red]",
)
@click.option(
    "--name",
    default="red",
    show_default=True,
    help="red only: the key's name, exported as <name>.asc",
)
@click.option(
    "--pub-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="where the public key is exported (0644) [default: <home>/../pub]",
)
@click.option("--algo", type=click.Choice(["ed25519", "rsa"]), default="ed25519", show_default=True)
@click.option(
    "--bridge-id", default="diode-bridge", show_default=True, help="goes in the key's uid"
)
@click.option(
    "--passphrase-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="protect the key with the passphrase in this file (one line, mode 0600)",
)
@click.option(
    "--passphrase-env",
    default=None,
    metavar="VAR",
    help="protect the key with the passphrase in environment variable VAR",
)
@click.option("--force", is_flag=True, help="DESTROY this side's existing key in --home first")
@_GPG_BINARY
def keys_init(
    side: str,
    home: Path | None,
    name: str,
    pub_dir: Path | None,
    algo: str,
    bridge_id: str,
    passphrase_file: Path | None,
    passphrase_env: str | None,
    force: bool,
    gpg_binary: str,
) -> None:
    """Create THIS side's key, export its public key, print the config lines that pin it.

    Never creates the other side's secret key: run it on the black host with --side black and
    on the red host with --side red, then carry the .asc files across and `diode keys import`.
    """
    from bridge.crypto.keys import init_side

    pp = _passphrase_option(passphrase_file, passphrase_env)
    home = home if home is not None else Path("keys") / side
    _checked_gpg(gpg_binary)
    made = init_side(
        side,  # type: ignore[arg-type]
        home,
        name=name,
        pub_dir=pub_dir,
        algo=algo,  # type: ignore[arg-type]
        bridge_id=bridge_id,
        passphrase=pp,
        force=force,
        binary=gpg_binary,
    )
    other = "red" if side == "black" else "black"
    what = "black signing key" if side == "black" else f"red decryption key {name!r}"
    click.echo(f"{what}: {made.fpr}")
    click.echo(f"  GnuPG home:  {made.home.resolve()} (0700; the SECRET key: it stays here)")
    click.echo(f"  public key:  {made.public_file.resolve()} (0644)")
    if pp is not None:
        click.echo(f"  passphrase:  from {pp.source}")
    click.echo(
        f"Carry {made.public_file.name} to the {other} host and run there: "
        f"diode keys import --home <{other} gnupg_home> {made.public_file.name}"
    )
    click.echo("\n# paste into your diode TOML:\n" + made.to_toml_snippet())


@keys.command("import")
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="GnuPG home to import into (black.gnupg_home or red.gnupg_home)",
)
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@_GPG_BINARY
def keys_import(home: Path, files: tuple[Path, ...], gpg_binary: str) -> None:
    """Import PUBLIC keys (.asc) from the other side; refuses any secret key material."""
    from bridge.crypto.keys import import_public_keys, import_snippet

    _checked_gpg(gpg_binary)
    found = import_public_keys(home, files, binary=gpg_binary)
    click.echo(f"imported {len(found)} public key(s) into {home}:")
    for k in found:
        uid = k.uids[0] if k.uids else ""
        click.echo(f"  {k.fpr}  {k.role:<9}  {uid}  (from {k.source})")
    unusable = [k.fpr for k in found if k.role == "unusable"]
    if unusable:
        click.echo(f"warning: revoked, expired or unusable, not pinned: {unusable}", err=True)
    snippet = import_snippet(found)
    if snippet:
        click.echo("\n# pin in your diode TOML (full fingerprints):\n" + snippet)


@keys.command("check")
@config_option
@click.option("--side", type=click.Choice(["black", "red"]), required=True)
def keys_check(config_path: Path | None, side: str) -> None:
    """Check this side's keys: permissions, presence, passphrase (a test sign or decrypt).

    Exit 1 if group/others can read the GnuPG home, its files, the passphrase file, or a
    config file holding secrets; if group/others can write the config file or its directory;
    or on red if others can write the inbox or anyone but the owner red's other directories
    (the running job only warns about these). Exit 2 if a key is missing or unusable, or the
    GnuPG home does not exist (it is not created). A gpg-agent this command started is stopped.
    """
    from bridge.crypto.keys import decryption_gpg, signing_gpg
    from bridge.crypto.perms import permission_problems

    cfg = _load(config_path)
    _require_gnupg_home(cfg, side)
    problems = permission_problems(cfg, side=side)  # type: ignore[arg-type]
    try:
        if side == "black":
            gpg = signing_gpg(cfg, one_shot=True)
        else:
            gpg = decryption_gpg(cfg, one_shot=True)
    except CryptoError as e:
        raise _key_problem(e) from None
    for p in problems:
        click.echo(f"error: {p}", err=True)
    if problems:
        sys.exit(1)
    how = f"passphrase from {gpg.passphrase.source}" if gpg.passphrase else "no passphrase"
    click.echo(f"ok: {side} keys in {gpg.home} usable unattended ({how}); permissions tight")


# -- config / mirror ---------------------------------------------------------------------------
@cli.command("check")
@config_option
def check(config_path: Path | None) -> None:
    """Validate the config and the black keys; exit non-zero with the fix if anything is wrong.

    Exit 2: a configuration error (the config, a key missing or unusable, a directory black
    cannot write, the broker or its management API refusing the login); 1: anything else
    (permissions too loose, the broker unreachable). Changes nothing on the host: a missing
    GnuPG home is reported, not created, and a gpg-agent the check started is stopped."""
    from bridge.black.broker import check_amqp_url, connect
    from bridge.black.job import check_black_config
    from bridge.crypto.perms import permission_problems

    cfg = _load(config_path)
    check_amqp_url(cfg.black.amqp_url.get_secret_value())  # as the tap reads it
    _check_black_places(cfg)
    _require_gnupg_home(cfg, "black")
    try:
        check_black_config(cfg, one_shot=True)
    except CryptoError as e:
        raise _key_problem(e) from None
    problems = permission_problems(cfg, side="black")
    for p in problems:
        click.echo(f"error: {p}", err=True)
    if problems:
        sys.exit(1)
    if cfg.udp is not None and cfg.udp_channels():
        from bridge.diode.udp_key import load_key

        load_key(cfg.udp.key_file)  # fails fast with the fix (missing, readable by others, short)
    connect(cfg.black, purpose="diode check").close()
    if cfg.black.discover:
        from bridge.black.broker import tap_vhost
        from bridge.black.management import ManagementClient
        from bridge.black.plan import plan_channel, without_own

        mc = ManagementClient.from_config(cfg.black)
        try:
            version = mc.overview().get("rabbitmq_version")
            listing = mc.list_exchanges(tap_vhost(cfg.black.amqp_url.get_secret_value()))
        finally:
            mc.close()
        click.echo(f"broker: RabbitMQ {version}")
        listing = without_own(cfg.black, listing)
        for ch in cfg.channels:  # what `diode mirror` would leave out: said now, not at start
            plan = plan_channel(ch, listing)
            for why in plan.skipped:
                click.echo(f"warning: channel {ch.name!r}: not mirrored: {why}", err=True)
            for name in plan.unbound_direct:
                click.echo(
                    f"warning: channel {ch.name!r}: direct exchange {name!r} is not mirrored: "
                    f"list its routing keys in channels[{ch.name}].direct_routing_keys",
                    err=True,
                )
    click.echo(
        f"ok: {len(cfg.channels)} channel(s), keys present, broker reachable; config {cfg.source}"
    )


@cli.command("mirror")
@config_option
def mirror(config_path: Path | None) -> None:
    """Declare the mirror queues and bindings once and print what is mirrored."""
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
@metrics_option
def black_run(
    config_path: Path | None, trigger: str, timeout: float | None, metrics_port: int | None
) -> None:
    """Drain the mirrored exchanges into sealed bundles in the outbox."""
    from bridge.black.broker import check_amqp_url, connect
    from bridge.black.job import BlackRun
    from bridge.spark import get_spark

    cfg = _load(config_path)
    check_amqp_url(cfg.black.amqp_url.get_secret_value())  # the taps' parser, before anything
    _metrics(metrics_port)  # before the job creates directories or changes the broker
    connect(cfg.black, purpose="preflight").close()  # unreachable or refused: nothing created
    try:
        run = BlackRun(cfg)  # fails fast on keys/config before Spark starts
    except CryptoError as e:
        raise _key_problem(e) from None
    run.mirror.sync()  # ... and on the broker, the management API and queue arguments
    spark = get_spark("diode-black")
    try:
        with stop_on_signals(threading.Event()) as stop:  # SIGTERM/SIGINT: a graceful stop
            summary = run.run(spark, trigger, timeout=timeout, stop=stop)  # type: ignore[arg-type]
    finally:
        spark.stop()
    click.echo(json.dumps(summary.to_json()))


@black.command("heartbeat")
@config_option
@click.option(
    "--every",
    type=click.FloatRange(1, 86400),
    default=None,
    metavar="SECONDS",
    help="keep writing a round every SECONDS (the period red is told) until SIGTERM/SIGINT; "
    "default: one round, then exit",
)
def black_heartbeat(config_path: Path | None, every: float | None) -> None:
    """Write each channel's heartbeat while no black job runs (scheduled mode: runbook §5).

    The job's own heartbeat: same seq counter, signing and encryption, naming the last bundle
    the journal shipped. A running job holds state_dir/black.lock and beats itself: then
    nothing is written (exit 0, and it says so). Prints the round (with --every, the totals
    at the end) as JSON. Exit 2 on a configuration error, 1 if a heartbeat failed (one round).
    No broker needed."""
    from bridge.black.beat_cmd import HeartbeatCommand

    cfg = _load(config_path)
    _require_gnupg_home(cfg, "black")  # not created: a wrong path is reported
    try:
        cmd = HeartbeatCommand(cfg, interval=every)
    except CryptoError as e:
        raise _key_problem(e) from None
    if every is not None:
        with stop_on_signals(threading.Event()) as stop:  # SIGTERM/SIGINT: stop, exit 0
            totals = cmd.run(every, stop)
        click.echo(json.dumps(totals.to_json()))
        return
    done = cmd.beat_round()
    click.echo(json.dumps(done.to_json()))
    if done.skipped is not None:
        what = "no more" if done.written else "nothing"
        click.echo(f"{what} written: {done.skipped}", err=True)
    for channel, why in done.failed.items():
        click.echo(f"error: channel {channel!r}: heartbeat failed: {why}", err=True)
    if done.failed:
        sys.exit(1)


@black.command("tap")
@config_option
@click.argument("channel")
@click.option(
    "--until-empty", is_flag=True, help="stop once the mirror queue is drained into the spool"
)
def black_tap(config_path: Path | None, channel: str, until_empty: bool) -> None:
    """Drain one channel's mirror queue into its spool (``black run`` starts one per channel)."""
    from bridge.black.tap import tap_main

    status = tap_main(config_path, channel, until_empty=until_empty)
    click.echo(json.dumps(dataclasses.asdict(status)))


@cli.command("resend")
@config_option
@click.option("--channel", required=True)
@click.option("--from", "first", type=click.IntRange(1), required=True, help="first bundle seq")
@click.option(
    "--to", "last", type=click.IntRange(1), required=True, help="last bundle seq (inclusive)"
)
@click.option(
    "--wait",
    type=click.FloatRange(0),
    default=120.0,
    show_default=True,
    help="seconds each re-drop may wait while a starting black job sweeps the staging dir",
)
def resend(config_path: Path | None, channel: str, first: int, last: int, wait: float) -> None:
    """Re-drop archived bundles of a channel, unchanged, into the outbox.

    Runs beside a running black job and the diode's mover: each bundle is copied from the
    archive through the staging dir and appears in the outbox by one rename. Prints
    ``{"resent": [file names], "missing": [[first, last], ...]}`` (inclusive bundle seq ranges
    not in the archive); exit 1 if any is missing.
    """
    from bridge.diode.file_drop import Outbox

    cfg = _load(config_path)
    cfg.channel(channel)
    rep = Outbox.from_config(cfg, lock_wait=wait).resend(channel, first, last)
    click.echo(json.dumps({"resent": rep.resent, "missing": rep.missing}))
    if rep.missing:
        count = sum(b - a + 1 for a, b in rep.missing)
        click.echo(
            f"warning: {count} bundle(s) not in the archive (pruned?): "
            f"{_seq_ranges_text(rep.missing)}",
            err=True,
        )
        sys.exit(1)


def _seq_ranges_text(ranges: list[tuple[int, int]], shown: int = 20) -> str:
    """``1-4, 7, 9-12`` for ``[(1, 4), (7, 7), (9, 12)]``; past ``shown`` ranges, how many more."""
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges[:shown])
    if len(ranges) > shown:
        text += f" and {len(ranges) - shown} more range(s)"
    return text


side_option = click.option(
    "--side",
    type=click.Choice(["auto", "black", "red"]),
    default="auto",
    show_default=True,
    help="auto: the side(s) that ran on this host (whose state_dir exists, else whose UDP end "
    "ran; black if none)",
)
json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="print the report as JSON (for scripts) instead of tables",
)


def _sides(cfg: Any, side: str) -> list[str]:
    if side != "auto":
        return [side]
    ran = [s for s in ("black", "red") if Path(getattr(cfg, s).state_dir).is_dir()]
    if not ran and cfg.udp is not None:  # only a UDP end ran here: its side
        if Path(cfg.udp.receive.spool_dir).is_dir():
            ran.append("red")
        elif Path(cfg.udp.send.state_dir).is_dir():
            ran.append("black")
    return ran or ["black"]


def _with_link(cfg: Any, out: dict[str, Any]) -> dict[str, Any]:
    """A side's status report, plus the UDP link when one is configured."""
    from bridge.diode.link_status import link_status

    if cfg.udp is not None:
        out["link"] = link_status(cfg)
    return out


def _black_status(cfg: Any) -> dict[str, Any]:
    from bridge.black.report import channel_status

    return _with_link(cfg, channel_status(cfg))


def _red_status(cfg: Any) -> dict[str, Any]:
    from bridge.red.report import red_status as report

    return _with_link(cfg, report(cfg))


def _black_gaps(cfg: Any) -> dict[str, Any]:
    from bridge.black.report import channel_status, gap_ranges

    st = channel_status(cfg)
    ranges = gap_ranges(cfg)
    return {
        name: {"lost": c["lost"], "inexact": c["inexact"], "ranges": ranges.get(name, [])}
        for name, c in st["channels"].items()
    }


def _red_gaps(cfg: Any) -> dict[str, Any]:
    from bridge.red.report import red_gaps as report

    return report(cfg)


def _show(cfg: Any, sides: list[str], what: str, as_json: bool) -> None:
    """Print the ``what`` report ("status" or "gaps") of each side: JSON (one side: its report;
    both: {"black": ..., "red": ...}) or tables."""
    from bridge import views

    build = {
        ("black", "status"): (_black_status, views.black_status_view),
        ("red", "status"): (_red_status, views.red_status_view),
        ("black", "gaps"): (_black_gaps, views.black_gaps_view),
        ("red", "gaps"): (_red_gaps, views.red_gaps_view),
    }
    reports = {side: build[side, what][0](cfg) for side in sides}
    if as_json:
        doc = reports[sides[0]] if len(sides) == 1 else reports
        click.echo(json.dumps(doc, indent=2, default=str))
        return
    views.print_views(
        [build[side, what][1](r) for side, r in reports.items()]  # type: ignore[operator]
    )


@cli.command("status")
@config_option
@side_option
@json_option
def status(config_path: Path | None, side: str, as_json: bool) -> None:
    """Black: per channel last bundle and message seq, spool and tap, pending work, losses,
    outbox backlog. Red: per channel last bundle, lag behind black's heartbeat, open gaps,
    chain, heartbeat age, silence; files; quarantined by reason; replay position per exchange.
    And the UDP link when one is configured."""
    cfg = _load(config_path)
    _show(cfg, _sides(cfg, side), "status", as_json)


@cli.command("gaps")
@config_option
@side_option
@json_option
def gaps(config_path: Path | None, side: str, as_json: bool) -> None:
    """Black: messages lost (and carried inexactly) as seq ranges with reason. Red: bundles
    missing in transit, written off, declared lost by black, UDP gap records."""
    cfg = _load(config_path)
    _show(cfg, _sides(cfg, side), "gaps", as_json)


# -- red -------------------------------------------------------------------------------
@cli.group()
def red() -> None:
    """Red (high) side."""


@red.command("run")
@config_option
@click.option(
    "--trigger",
    type=click.Choice(["available-now", "continuous"]),
    default="continuous",
    show_default=True,
    help="available-now: land what is complete in the inbox and stop (schedulers)",
)
@click.option("--timeout", type=float, default=None, help="stop after N seconds")
@metrics_option
def red_run(
    config_path: Path | None, trigger: str, timeout: float | None, metrics_port: int | None
) -> None:
    """Verify, decrypt and land inbox bundles in Delta (messages, bundles, audit)."""
    from bridge.red.job import RedRun
    from bridge.spark import get_spark

    cfg = _load(config_path)
    _metrics(metrics_port)  # before the run creates its directories
    run = RedRun(cfg)  # fails fast on keys, pinned signers and directories before Spark starts
    spark = get_spark("diode-red")
    try:
        with stop_on_signals(threading.Event()) as stop:  # SIGTERM/SIGINT: a graceful stop
            summary = run.run(spark, trigger, timeout=timeout, stop=stop)  # type: ignore[arg-type]
    finally:
        spark.stop()
    click.echo(json.dumps(summary.to_json()))


def _replay_preflight(url: str) -> None:
    """Log in to the red broker once before replaying: a refused login or a missing vhost is a
    ConfigError (exit 2: retrying cannot help); a broker that is down is only logged (warning):
    the replay is a service and keeps retrying."""
    from bridge.amqp.client import Connection, parse_url
    from bridge.errors import AmqpAccessRefused, BrokerError
    from bridge.logs import get_logger, log_event

    try:
        where = parse_url(url).where
    except ConfigError as e:
        raise ConfigError(f"red.replay.amqp_url: {e}") from None
    try:
        conn = Connection.open(url, client_name="diode-red-replay-check", connect_timeout=5)
    except AmqpAccessRefused as e:
        raise ConfigError(
            f"red.replay.amqp_url: {e} (set in the config or DIODE__RED__REPLAY__AMQP_URL; "
            "retrying cannot help)"
        ) from None
    except BrokerError as e:
        log_event(
            get_logger("bridge.cli"),
            30,
            f"red broker at {where} unavailable at start ({e}): the replay keeps retrying with "
            "back-off until it is reachable; check the broker, and the host and port in "
            "red.replay.amqp_url",
            target=where,
        )
        return
    with contextlib.suppress(Exception):
        conn.close()


@red.command("replay")
@config_option
@click.option(
    "--until-caught-up",
    is_flag=True,
    help="stop once every approved row is confirmed or its exchange stopped; exit 1 unless "
    "caught up (an exchange stopped, or --timeout passed first)",
)
@click.option("--timeout", type=float, default=None, help="stop after N seconds")
@metrics_option
def red_replay(
    config_path: Path | None, until_caught_up: bool, timeout: float | None, metrics_port: int | None
) -> None:
    """Publish landed messages of approved exchanges into red RabbitMQ (confirmed, resumable).

    Exit 2 when the red broker refuses the login or the vhost at start; with --until-caught-up,
    exit 1 when the run ended without catching up: an exchange is stopped (named, with why),
    or --timeout passed first. A broker that is down at start is logged (warning) and
    retried."""
    from bridge.red.replay import Replayer, audit_sink

    cfg = _load(config_path)
    url = cfg.red.replay.amqp_url.get_secret_value()
    _replay_preflight(url)
    _metrics(metrics_port)
    replayer = Replayer(cfg, sink=audit_sink(cfg))
    with stop_on_signals(threading.Event()) as stop:  # SIGTERM/SIGINT: a graceful stop, exit 0
        summary = replayer.run(until_caught_up=until_caught_up, timeout=timeout, stop=stop)
    click.echo(json.dumps(summary.to_json()))
    if until_caught_up and not summary.caught_up:
        if summary.stopped:  # its rows wait; a running publisher retries it every minute
            why = "; ".join(f"exchange {n!r} is stopped: {r}" for n, r in summary.stopped.items())
            click.echo(f"error: the replay did not catch up ({why}); fix it and run again "
                       "(runbook §15.3)", err=True)  # fmt: skip
            sys.exit(1)
        why = f"--timeout {timeout:g} s passed" if timeout is not None else "it was stopped"
        last = f"; last error: {summary.errors[-1]}" if summary.errors else ""
        click.echo(f"error: the replay did not catch up ({why}){last}", err=True)
        sys.exit(1)


red.add_command(red_replay, "publish")  # the replay publisher's other name (DESIGN §3.8)


@red.command("rewind")
@config_option
@click.option("--exchange", required=True, help="the exchange whose replay to rewind (exact name)")
@click.option("--to-seq", metavar="CHANNEL:SEQ", default=None, help="back to this landed row")
@click.option(
    "--since", metavar="ISO-TIME", default=None, help="back to the first row landed at or after"
)
@click.option(
    "--skipped",
    is_flag=True,
    help="back to the first row the replay skipped (replay_failed kind user_id or bad_row) "
    "since the exchange's last rewind",
)
@click.option("--reason", default=None, help="why (a ticket, who asked): kept in the audit")
@click.option("--dry-run", is_flag=True, help="print what it would do; change nothing")
def red_rewind(
    config_path: Path | None,
    exchange: str,
    to_seq: str | None,
    since: str | None,
    skipped: bool,
    reason: str | None,
    dry_run: bool,
) -> None:
    """Move an exchange's replay progress back: the next replay publishes its rows again from
    there, in order (duplicates for consumers: de-duplicate on red.replay.id_header).

    Refused (exit 1) while the replay publisher runs; exit 2 for an unknown exchange or a
    --to-seq row that has not landed; exit 0 with a note when there is nothing to rewind.
    Audited as replay_rewound (runbook §15.4)."""
    from bridge.red.replay_rewind import Target, rewind_exchange

    target = Target.from_options(to_seq, since, skipped)  # before reading anything
    out = rewind_exchange(_load(config_path), exchange, target, reason=reason, dry_run=dry_run)
    click.echo(json.dumps(out))


@red.command("declare")
@config_option
@click.argument("exchanges", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def red_declare(config_path: Path | None, exchanges: tuple[str, ...], as_json: bool) -> None:
    """Declare exchanges on the red broker as black had them, publishing nothing.

    EXCHANGES default to every exchange with landed rows. The replay declares an exchange only
    at its first publish: declare it first, bind the red queues to it, then approve it, and no
    message is returned unroutable. Exit 1 when one is refused or has not landed, 2 when the
    red broker refuses the login or the vhost."""
    from bridge.errors import BrokerError
    from bridge.red.replay_declare import declare_exchanges

    cfg = _load(config_path)
    url = cfg.red.replay.amqp_url.get_secret_value()
    _replay_preflight(url)
    messages = Path(cfg.red.tables_dir) / "messages"
    try:
        done = declare_exchanges(messages, url, exchanges)
    except BrokerError as e:
        raise click.ClickException(f"red broker (red.replay.amqp_url): {e}") from None
    if as_json:
        click.echo(json.dumps([d.to_json() for d in done]))
    elif not done:
        click.echo("nothing to declare: no row has landed yet")
    for d in done if not as_json else ():
        detail = f" (type {d.decl[0]})" if d.decl is not None and d.outcome == "declared" else ""
        click.echo(f"{d.outcome}: {d.exchange!r}{detail}{': ' + d.why if d.why else ''}")
    if any(d.outcome in ("refused", "not_landed") for d in done):
        sys.exit(1)


@red.command("status")
@config_option
@json_option
def red_status(config_path: Path | None, as_json: bool) -> None:
    """= diode status --side red."""
    _show(_load(config_path), ["red"], "status", as_json)


@red.command("gaps")
@config_option
@json_option
def red_gaps(config_path: Path | None, as_json: bool) -> None:
    """= diode gaps --side red."""
    _show(_load(config_path), ["red"], "gaps", as_json)


@red.command("write-off")
@config_option
@click.option("--channel", required=True, help="the channel whose bundles will never come")
@click.option("--from", "first", type=int, required=True, help="first bundle seq")
@click.option("--to", "last", type=int, required=True, help="last bundle seq")
@click.option("--note", required=True, help="why (a ticket, who decided): kept in the audit")
def red_write_off(config_path: Path | None, channel: str, first: int, last: int, note: str) -> None:
    """Declare bundles of an open transit gap lost for good (black no longer has them)."""
    from bridge.red.writeoff import write_off_gap

    out = write_off_gap(_load(config_path), channel, first, last, note)
    click.echo(json.dumps(out, default=str))


@red.command("retire")
@config_option
@click.option("--channel", required=True, help="a channel already removed from red's config")
@click.option("--note", required=True, help="why (a ticket, who decided): kept in the audit")
def red_retire(config_path: Path | None, channel: str, note: str) -> None:
    """Retire a channel removed from red's config: write off its open gaps, stop watching it
    for silence. Configuring it again reinstates it."""
    from bridge.red.writeoff import retire_channel

    click.echo(json.dumps(retire_channel(_load(config_path), channel, note), default=str))


@red.command("maintain")
@config_option
@click.option("--table", type=click.Choice(["messages", "bundles", "audit", "all"]), default="all")
@click.option(
    "--vacuum-hours",
    type=float,
    default=None,
    help="also VACUUM files unreferenced for this long (>= 168 unless you know why not)",
)
def red_maintain(config_path: Path | None, table: str, vacuum_hours: float | None) -> None:
    """Compact small files (OPTIMIZE) and optionally VACUUM the red Delta tables.

    With ``red.delta_engine = "spark"`` this starts a Spark session (``$SPARK_MASTER``, Delta
    jars on its classpath) and runs OPTIMIZE / VACUUM as Delta Lake's SQL; otherwise delta-rs
    does it in this process. Either way the tables stay standard Delta. The ledger (bundles)
    is skipped while a red job runs (runbook §16)."""
    from bridge.red.job import open_tables
    from bridge.red.maintain import check_vacuum_hours, maintain_tables

    check_vacuum_hours(vacuum_hours)  # before Spark, before any table
    cfg = _load(config_path)
    spark = None
    if cfg.red.delta_engine == "spark":
        from bridge.spark import get_spark

        spark = get_spark("diode-red-maintain")
    try:
        tables = open_tables(cfg, spark)
        names = ["messages", "bundles", "audit"] if table == "all" else [table]
        out = maintain_tables(cfg, tables, names, vacuum_hours)
    finally:
        if spark is not None:
            spark.stop()
    click.echo(json.dumps(out, indent=2, default=str))


@cli.group()
def quarantine() -> None:
    """What red refused: quarantine_dir/<day>/<name> with a reason file each (runbook §12)."""


@quarantine.command("list")
@config_option
@click.option("--reason", default=None, help="only this reason (runbook §12.1)")
@click.option(
    "--since",
    type=click.DateTime(formats=["%Y-%m-%d"]),
    default=None,
    help="only from this UTC day on (YYYY-MM-DD)",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON document: summary and entries")
def quarantine_list(
    config_path: Path | None, reason: str | None, since: Any, as_json: bool
) -> None:
    """Every quarantined file with its reason, oldest first, and a count per reason."""
    from bridge.red.quarantine import list_quarantined, quarantine_summary

    entries = list_quarantined(
        _load(config_path), reason=reason, since=since.date() if since else None
    )
    summary = quarantine_summary(entries)
    if as_json:
        click.echo(json.dumps({"summary": summary, "entries": entries}, indent=2, default=str))
        return
    for e in entries:
        why = e.get("why") or e.get("error") or ""
        arrived = e.get("original_name")  # printable (escaped) by the intake
        came = f" (arrived as {arrived})" if arrived and arrived != e["stored_as"] else ""
        click.echo(f"{e['day']}/{e['stored_as']}{came}  {e['reason']}  {why}"[:240])
    by = ", ".join(f"{k} {v}" for k, v in summary["by_reason"].items())
    click.echo(f"{summary['total']} quarantined" + (f": {by}" if by else ""))
    if summary.get("file_gone"):
        click.echo(
            f"{summary['file_gone']} reason file(s) kept without their file (re-injected, "
            "runbook §12.2; or a move a crash interrupted: pending or abandoned, as listed)"
        )


@quarantine.command("show")
@config_option
@click.argument("name")
@click.option("--no-audit", is_flag=True, help="skip the audit table (reason file only)")
def quarantine_show(config_path: Path | None, name: str, no_audit: bool) -> None:
    """One quarantined file (NAME or DAY/NAME as listed): its reason record, whether it is
    still the file quarantined (SHA-256), and its audit rows."""
    from bridge.red.quarantine import show_quarantined

    out = show_quarantined(_load(config_path), name, audit=not no_audit)
    click.echo(json.dumps(out, indent=2, default=str))


@cli.command("approve")
@config_option
@click.argument("exchanges", nargs=-1, required=True)
@click.option("--revoke", is_flag=True, help="stop replaying these exchanges")
@click.option("--note", default="", help="why (kept in the approvals file and the audit table)")
def approve(config_path: Path | None, exchanges: tuple[str, ...], revoke: bool, note: str) -> None:
    """Approve red exchanges for replay (their whole landed history is replayed)."""
    from bridge.red.approvals import approve_exchanges

    cfg = _load(config_path)
    out = approve_exchanges(cfg, list(exchanges), revoke=revoke, note=note)
    click.echo(json.dumps(out, default=str))


@cli.command("revoke")
@config_option
@click.argument("exchanges", nargs=-1, required=True)
@click.option("--note", default="", help="why (kept in the approvals file and the audit table)")
def revoke(config_path: Path | None, exchanges: tuple[str, ...], note: str) -> None:
    """Stop replaying red exchanges (the same as `diode approve --revoke`); their rows stay
    landed, and approving them again replays their history."""
    from bridge.red.approvals import approve_exchanges

    out = approve_exchanges(_load(config_path), list(exchanges), revoke=True, note=note)
    click.echo(json.dumps(out, default=str))


# -- udp -------------------------------------------------------------------------------
@cli.group()
def udp() -> None:
    """UDP transport across a one-way link (DESIGN.md 3.6, docs/protocol.md §12)."""


@udp.command("keygen")
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="key file"
)
@click.option("--force", is_flag=True, help="replace an existing key file")
def udp_keygen(out: Path, force: bool) -> None:
    """Make the link's pre-shared datagram key (mode 0600); copy the file to both sides."""
    from bridge.diode.udp_key import generate_key_file

    generate_key_file(out, force=force)
    click.echo(f"wrote {out}: set udp.key_file to it on black and on red")


@udp.command("send")
@config_option
@click.option("--until-idle", is_flag=True, help="stop once the outbox holds nothing to send")
@click.option("--timeout", type=float, default=None, help="stop after N seconds")
@metrics_option
def udp_send(
    config_path: Path | None, until_idle: bool, timeout: float | None, metrics_port: int | None
) -> None:
    """Black: carry the outbox files of "udp" channels as paced, FEC-coded datagrams."""
    from bridge.diode.udp_sender import run_sender

    cfg = _load(config_path)
    _metrics(metrics_port)
    summary = run_sender(cfg, until_idle=until_idle, timeout=timeout)
    click.echo(json.dumps(_jsonable(summary)))


@udp.command("receive")
@config_option
@click.option("--timeout", type=float, default=None, help="stop after N seconds")
@metrics_option
def udp_receive(config_path: Path | None, timeout: float | None, metrics_port: int | None) -> None:
    """Red: reassemble datagrams into files in red's inbox (durable spool, digest checked)."""
    from bridge.diode.udp_receiver import run_receiver

    cfg = _load(config_path)
    _metrics(metrics_port)
    summary = run_receiver(cfg, timeout=timeout)
    click.echo(json.dumps(_jsonable(summary)))


@udp.command(
    "relay",
    context_settings={"ignore_unknown_options": True},
    add_help_option=False,  # --help / -h go to the relay's own parser: its real options
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def udp_relay(argv: tuple[str, ...]) -> None:
    """Lossy virtual diode for tests and demos (--listen, --forward, --loss, ...)."""
    from bridge.diode.udp_relay import main as relay_main

    sys.exit(relay_main(list(argv)))


@udp.command("status")
@config_option
def udp_status(config_path: Path | None) -> None:
    """The link as each side last wrote it: sender epoch and counters, receiver counters, gaps."""
    from bridge.diode.link_status import link_status

    click.echo(json.dumps(link_status(_load(config_path)), indent=2))


def _jsonable(obj: Any) -> Any:
    to_json = getattr(obj, "to_json", None)
    if callable(to_json):
        return to_json()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


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
@click.option(
    "--transport",
    type=click.Choice(["file", "udp"]),
    default="file",
    show_default=True,
    help="file: a stand-in hot-folder mover; udp: sender -> lossy relay -> receiver",
)
@click.option(
    "--loss", type=float, default=0.0, show_default=True, help="udp: % of datagrams the relay drops"
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON summary as the last line")
def demo(
    messages: int,
    workdir: Path,
    vhost: str,
    big_every: int,
    transport: str,
    loss: float,
    as_json: bool,
) -> None:
    """Set up and run the whole chain on this machine: black broker -> bundles -> diode ->
    red Delta -> red broker, then print a summary."""
    from bridge.demo.run import run_demo
    from bridge.demo.summary import summary_table

    if loss and transport != "udp":
        raise click.UsageError("--loss needs --transport udp")
    summary = run_demo(
        workdir, messages, vhost=vhost, big_every=big_every, transport=transport, loss_percent=loss
    )
    click.echo(summary_table(summary))
    if as_json:
        click.echo(json.dumps(summary))  # the last line, for scripts
    else:
        for k, v in summary.items():
            click.echo(f"{k:>18}: {v}")
    if not summary["ok"]:
        sys.exit(1)


def main() -> None:
    """Console entry point; exits through ``exit_now`` (delta-rs can abort at interpreter exit)."""
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
    except Exception:  # a bug or a library's own error: shown, then the same careful exit
        import traceback

        traceback.print_exc()
        code = 1
    exit_now(code)


if __name__ == "__main__":
    main()
