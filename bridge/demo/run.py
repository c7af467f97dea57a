"""Demo, run: the whole chain on one machine (keys, black, stand-in diode, red, replay)."""

from __future__ import annotations

import math
import os
import shutil
import time
import urllib.parse
from pathlib import Path
from typing import Any

from bridge.black.job import BlackRun
from bridge.black.management import ManagementClient
from bridge.config import load_config
from bridge.crypto.gpg import Gpg, check_gpg_binary
from bridge.crypto.keys import DEFAULT_GPG, init_keys, toml_str
from bridge.crypto.perms import write_file
from bridge.demo.counter import ReplayCounter
from bridge.demo.diode import move_outbox
from bridge.demo.summary import red_account
from bridge.demo.traffic import DEMO_DIRECT_KEYS, DEMO_EXCHANGES, declare_exchanges, publish_mix
from bridge.demo.udp_link import UdpLink, free_udp_port, udp_config_toml
from bridge.diode.udp_key import generate_key_file
from bridge.diode.udp_sender import run_sender
from bridge.errors import ConfigError
from bridge.logs import get_logger, log_event
from bridge.red.job import RedRun
from bridge.red.replay import Replayer, audit_sink

__all__ = [
    "DEMO_VHOST_TAG", "DEMO_WORKDIR_MARKER", "check_demo_options", "check_demo_workdir",
    "check_demo_vhosts", "recreate_demo_vhosts", "run_demo", "write_demo_config",
]  # fmt: skip

log = get_logger("bridge.demo")

DEMO_VHOST_TAG = "diode-demo"
"""The tag the demo gives the vhosts it creates (management API: vhost ``tags``). The demo
deletes and re-creates a vhost only if it carries this tag: never one it did not create."""
DEMO_VHOST_DESCRIPTION = "created by `diode demo`: deleted and re-created by every demo run"


def check_demo_options(
    messages: int,
    *,
    big_every: int = 5000,
    transport: str = "file",
    loss_percent: float = 0.0,
    port: int = 5672,
) -> None:
    """ConfigError for a demo option out of range; called before anything is started."""
    if isinstance(messages, bool) or not isinstance(messages, int) or messages < 1:
        raise ConfigError(
            f"--messages {messages}: the number of messages the demo publishes; give a whole "
            "number of at least 1 (default 20000)"
        )
    if isinstance(big_every, bool) or not isinstance(big_every, int) or big_every < 0:
        raise ConfigError(
            f"--big-every {big_every}: every Nth message carries a 3 MB body; give a whole "
            "number of at least 0 (0: none; default 5000)"
        )
    if transport not in ("file", "udp"):
        raise ConfigError(f"--transport {transport}: give file or udp")
    if not (math.isfinite(loss_percent) and 0 <= loss_percent < 100):
        raise ConfigError(
            f"--loss {loss_percent}: the percentage of datagrams the relay drops; give a number "
            "from 0 up to (not including) 100, e.g. --loss 2"
        )
    if loss_percent and transport != "udp":
        raise ConfigError(f"--loss {loss_percent} needs --transport udp (only the relay drops)")
    if not 0 < port < 65536:
        raise ConfigError(f"AMQP port {port}: give a TCP port from 1 to 65535")


DEMO_WORKDIR_MARKER = ".diode-demo"
"""The file the demo leaves in its workdir: it deletes ``black/`` and ``red/`` there, and
reuses ``keys/``, only in a workdir that carries it (or a new, empty one)."""


def check_demo_workdir(workdir: Path) -> None:
    """ConfigError unless ``workdir`` is missing, empty, or an earlier demo's (it holds
    ``DEMO_WORKDIR_MARKER``): every run deletes ``black/`` and ``red/`` there and would use the
    keys in ``keys/``, so it must never be a real installation's directory."""
    if not workdir.exists():
        return
    if not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is not a directory: pass a new directory")
    if (workdir / DEMO_WORKDIR_MARKER).is_file() or not any(workdir.iterdir()):
        return
    raise ConfigError(
        f"--workdir {workdir} is not empty and was not made by `diode demo` (no "
        f"{DEMO_WORKDIR_MARKER} file): the demo deletes black/ and red/ in its workdir and uses "
        "the keys in keys/, so it never takes a directory it did not create. Pass a new or "
        "empty directory, e.g. --workdir ./diode-demo"
    )


def _check_vhost_names(vhost: str, red_vhost: str) -> None:
    for name, what in ((vhost, "--vhost"), (red_vhost, "the red vhost")):
        if name == "/":
            raise ConfigError(
                f"{what} '/': that is the broker's default vhost, where other applications' "
                "queues and exchanges live, and the demo deletes and re-creates its vhosts. "
                "Pass a vhost of the demo's own, e.g. --vhost diode-demo"
            )
        if not name.strip():
            raise ConfigError(f"{what} {name!r}: give a vhost name, e.g. --vhost diode-demo")
    if vhost == red_vhost:
        raise ConfigError(
            f"the black and red vhosts are both {vhost!r}: the demo needs two, e.g. "
            f"{vhost!r} and {vhost + '-red'!r}"
        )


def check_demo_vhosts(mc: ManagementClient, vhost: str, red_vhost: str) -> None:
    """ConfigError unless the black and red vhosts are each missing or created by the demo
    (tagged ``DEMO_VHOST_TAG``); reads only. ``/`` is always refused."""
    _check_vhost_names(vhost, red_vhost)
    for v in (vhost, red_vhost):
        tags = mc.vhost_tags(v)
        if tags is None or DEMO_VHOST_TAG in tags:
            continue
        what = f"vhost {v!r}" if v == vhost else f"vhost {v!r} (the red twin of {vhost!r})"
        raise ConfigError(
            f"{what} already exists on the broker ({mc.base_url}) and was not created by "
            f"`diode demo` (it has no {DEMO_VHOST_TAG!r} tag): the demo deletes and re-creates "
            "its vhosts, so it never takes one it did not create. Pass another --vhost (the demo "
            f"uses it and '<vhost>-red'), e.g. --vhost {vhost}-2; or, if {v!r} is an "
            f"earlier demo's and nothing else uses it, delete it: rabbitmqctl delete_vhost {v}"
        )


def recreate_demo_vhosts(mc: ManagementClient, vhost: str, red_vhost: str) -> None:
    """Delete and create the black and red vhosts afresh, tagged as the demo's, with full
    permissions for the demo's user; refuses (``check_demo_vhosts``) before deleting anything."""
    check_demo_vhosts(mc, vhost, red_vhost)
    for v in (vhost, red_vhost):
        mc.delete_vhost(v)
        mc.put_vhost(v, description=DEMO_VHOST_DESCRIPTION, tags=DEMO_VHOST_TAG)


def write_demo_config(
    workdir: Path,
    *,
    black_fpr: str,
    red_fprs: list[str],
    amqp_url: str,
    mgmt: str,
    red_amqp_url: str,
    transport: str = "file",
    udp_section: str = "",
    gpg_binary: str = DEFAULT_GPG,
) -> Path:
    keys = ", ".join(f'"{f}"' for f in red_fprs)
    gpg = "" if gpg_binary == DEFAULT_GPG else f"gpg_binary = {toml_str(gpg_binary)}\n"
    approved = ", ".join(f'"{x.name}"' for x in DEMO_EXCHANGES)
    direct = "\n".join(
        f'"{ex}" = [{", ".join(chr(34) + k + chr(34) for k in keys_)}]'
        for ex, keys_ in DEMO_DIRECT_KEYS.items()
    )
    text = f"""# Written by `diode demo`: every key is explained in conf/diode.example.toml.
[link]
bridge_id = "demo-black"
black_signers = ["{black_fpr}"]

[[channels]]
name = "default"
exchanges = ["*"]
deny = ["unrouted"]
recipients = [{keys}]
encrypt = true
transport = "{transport}"

[channels.direct_routing_keys]
{direct}

[black]
amqp_url = "{amqp_url}"
management_url = "{mgmt}"
gnupg_home = "keys/black"
{gpg}signing_key = "{black_fpr}"
outbox = "black/outbox"
archive = "black/archive"
state_dir = "black/state"
checkpoint_dir = "black/checkpoint"
spool_dir = "black/spool"
trigger_seconds = 2.0
heartbeat_seconds = 5.0

[black.bundle]
max_rows = 5000
max_bytes = 67108864
max_file_bytes = 134217728

[red]
gnupg_home = "keys/red"
{gpg}inbox = "red/inbox"
work_dir = "red/work"
processed_dir = "red/processed"
quarantine_dir = "red/quarantine"
state_dir = "red/state"
checkpoint_dir = "red/checkpoint"
tables_dir = "red/delta"
delta_engine = "delta-rs"
settle_seconds = 0.5

[red.replay]
amqp_url = "{red_amqp_url}"
approved = [{approved}]
{udp_section}"""
    p = workdir / "diode.toml"
    write_file(p, text.encode(), mode=0o600)  # it holds the AMQP password
    return p


def run_demo(
    workdir: Path,
    messages: int,
    *,
    vhost: str = "diode-demo",
    red_vhost: str | None = None,
    host: str = "127.0.0.1",
    port: int = 5672,
    mgmt: str = "http://127.0.0.1:15672",
    user: str = "guest",
    password: str = "guest",
    big_every: int = 5000,
    spark: Any = None,
    transport: str = "file",
    loss_percent: float = 0.0,
    gpg_binary: str = DEFAULT_GPG,
) -> dict[str, Any]:
    """Run the whole chain on this machine; returns the summary.

    ``gpg_binary``: the gpg both sides run (keys, config), checked first when it is not the
    default ``gpg`` from PATH.

    black vhost -> mirror -> tap -> spool -> black job -> outbox -> (stand-in mover, or UDP
    sender -> lossy relay -> UDP receiver) -> red inbox -> red job -> Delta -> replay
    publisher -> red vhost (queues bound to count).
    """
    t0 = time.monotonic()
    # refused before anything is created, started or deleted (files, keys, vhosts, processes)
    check_demo_options(
        messages, big_every=big_every, transport=transport, loss_percent=loss_percent, port=port
    )
    if gpg_binary != DEFAULT_GPG:
        check_gpg_binary(gpg_binary, key="the demo's gpg_binary")
        if os.sep in gpg_binary:  # the config resolves a relative path against the workdir
            gpg_binary = str(Path(gpg_binary).absolute())
    red_vhost = red_vhost or f"{vhost}-red"
    mc = ManagementClient(mgmt, user, password)
    try:
        check_demo_vhosts(mc, vhost, red_vhost)  # "/" before the broker is even asked
    finally:
        mc.close()
    workdir = workdir.resolve()
    check_demo_workdir(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / DEMO_WORKDIR_MARKER).touch()
    keys_dir = workdir / "keys"
    if (keys_dir / "black").exists():  # keys of an earlier demo run are kept
        black_fpr = Gpg(keys_dir / "black", binary=gpg_binary).fingerprints(secret=True)[0]
        red_fprs = Gpg(keys_dir / "red", binary=gpg_binary).fingerprints(secret=True)
    else:
        inv = init_keys(
            keys_dir, red_names=("red", "red-audit"), bridge_id="demo-black", binary=gpg_binary
        )
        black_fpr, red_fprs = inv.black_fpr, list(inv.red_fprs.values())
    for sub in ("black", "red"):  # a fresh run: new vhosts, new state on both sides
        shutil.rmtree(workdir / sub, ignore_errors=True)
    udp_section = ""
    if transport == "udp":
        if not (keys_dir / "udp.key").exists():
            generate_key_file(keys_dir / "udp.key")
        relay_port, receive_port = free_udp_port(), free_udp_port()
        udp_section = udp_config_toml(relay_port, receive_port, loss_percent=loss_percent)
    mc = ManagementClient(mgmt, user, password)
    try:
        recreate_demo_vhosts(mc, vhost, red_vhost)  # checks again right before deleting
    finally:
        mc.close()
    amqp_url = f"amqp://{user}:{password}@{host}:{port}/{urllib.parse.quote(vhost, safe='')}"
    red_url = f"amqp://{user}:{password}@{host}:{port}/{urllib.parse.quote(red_vhost, safe='')}"
    declare_exchanges(amqp_url)
    cfg_path = write_demo_config(
        workdir,
        black_fpr=black_fpr,
        red_fprs=red_fprs,
        amqp_url=amqp_url,
        mgmt=mgmt,
        red_amqp_url=red_url,
        transport=transport,
        udp_section=udp_section,
        gpg_binary=gpg_binary,
    )
    cfg = load_config(cfg_path)
    link = UdpLink(cfg, relay_port, loss_percent) if transport == "udp" else None
    try:
        if link is not None:
            link.start()  # stops what it started if it fails
        run = BlackRun(cfg)
        run.mirror.sync()  # mirror queues exist before the first message is published
        log_event(log, 20, "publishing demo traffic", messages=messages, vhost=vhost)
        pub = publish_mix(amqp_url, messages, big_every=big_every)
        t_pub = time.monotonic()
        if spark is None:
            from bridge.spark import get_spark

            spark = get_spark("diode-demo")
        black = run.run(spark, "available-now")
        t_black = time.monotonic()
        udp: dict[str, Any] = {}
        if link is None:
            moved = move_outbox(Path(cfg.black.outbox), Path(cfg.red.inbox))
            files_crossed = moved.files
        else:
            sent = run_sender(cfg, until_idle=True, timeout=600)
            udp = link.wait_delivered(list(sent.files), timeout=120)
            udp["processes"] = link.close()
            udp["datagrams_sent"] = sent.datagrams
            udp["files_sent"] = len(sent.files)
            files_crossed = udp["delivered"]
    finally:
        if link is not None:  # whatever failed above, no process of the link outlives the demo
            link.close()
    red = RedRun(cfg).run(spark, "available-now")
    t_red = time.monotonic()
    counter = ReplayCounter(red_url, [x.name for x in DEMO_EXCHANGES])
    replay = Replayer(cfg, sink=audit_sink(cfg)).run(until_caught_up=True, timeout=600)
    received = counter.drain(expected=pub.count, timeout=60)
    counter.close()
    t_end = time.monotonic()
    rs = red.to_json()
    held = red_account(cfg)
    out = {
        "published": pub.count,
        "published_bytes": pub.body_bytes,
        "by_exchange": pub.by_exchange,
        "sealed": black.messages,
        "lost": max(pub.count - held.unique, 0),
        "black_gaps": black.lost,
        "duplicates": held.duplicates,
        "duplicate_bundles": rs["duplicates"],
        "quarantined": held.quarantined,
        "bundles": black.bundles,
        "transport": transport,
        "files_crossed": files_crossed,
        "landed": rs["messages_landed"],
        "landed_unique": held.unique,
        "bundles_landed": rs["bundles_landed"],
        "rejected": rs["rejected"],
        "replayed": replay.to_json().get("confirmed"),
        "received_on_red": received,
        "publish_seconds": round(t_pub - t0, 2),
        "black_seconds": round(t_black - t_pub, 2),
        "black_msg_per_s": round(black.messages / (t_black - t_pub), 1),
        "red_seconds": round(t_red - t_black, 2),
        "red_msg_per_s": rs["msg_per_s"],
        "replay_seconds": round(t_end - t_red, 2),
        "total_seconds": round(t_end - t0, 2),
        "workdir": str(workdir),
        "outbox": str(cfg.black.outbox),
        "tables": str(cfg.red.tables_dir),
        "config": str(cfg_path),
    }
    if link is not None:
        out["udp"] = udp
    out["ok"] = (
        black.messages == pub.count
        and black.lost == 0
        and rs["messages_landed"] == pub.count
        and held.unique == held.rows == pub.count
        and held.quarantined == 0
        and rs["rejected"] == 0
        and received == pub.count
        and (link is None or udp["missing"] == 0)
    )
    return out
