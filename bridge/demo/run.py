"""Demo, run: keys, a black vhost with sample traffic, the black job — all under one workdir."""

from __future__ import annotations

import shutil
import time
import urllib.parse
from pathlib import Path
from typing import Any

from bridge.black.job import BlackRun
from bridge.black.management import ManagementClient
from bridge.config import load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import init_keys
from bridge.crypto.perms import write_file
from bridge.demo.traffic import DEMO_DIRECT_KEYS, declare_exchanges, publish_mix
from bridge.logs import get_logger, log_event

__all__ = ["run_demo", "write_demo_config"]

log = get_logger("bridge.demo")


def write_demo_config(
    workdir: Path, *, black_fpr: str, red_fprs: list[str], amqp_url: str, mgmt: str
) -> Path:
    keys = ", ".join(f'"{f}"' for f in red_fprs)
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
transport = "file"

[channels.direct_routing_keys]
{direct}

[black]
amqp_url = "{amqp_url}"
management_url = "{mgmt}"
gnupg_home = "keys/black"
signing_key = "{black_fpr}"
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
inbox = "red/inbox"
"""
    p = workdir / "diode.toml"
    write_file(p, text.encode(), mode=0o600)  # it holds the AMQP password
    return p


def run_demo(
    workdir: Path,
    messages: int,
    *,
    vhost: str = "diode-demo",
    host: str = "127.0.0.1",
    port: int = 5672,
    mgmt: str = "http://127.0.0.1:15672",
    user: str = "guest",
    password: str = "guest",
    big_every: int = 5000,
    spark: Any = None,
) -> dict[str, Any]:
    """Run the black half of the pipeline on this machine; returns the summary."""
    t0 = time.monotonic()
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    keys_dir = workdir / "keys"
    if (keys_dir / "black").exists():  # keys of an earlier demo run are kept
        black_fpr = Gpg(keys_dir / "black").fingerprints(secret=True)[0]
        red_fprs = Gpg(keys_dir / "red").fingerprints(secret=True)
    else:
        inv = init_keys(keys_dir, red_names=("red", "red-audit"), bridge_id="demo-black")
        black_fpr, red_fprs = inv.black_fpr, list(inv.red_fprs.values())
    for sub in ("black", "red"):  # a fresh run: new vhost, new black state
        shutil.rmtree(workdir / sub, ignore_errors=True)
    mc = ManagementClient(mgmt, user, password)
    mc.delete_vhost(vhost)
    mc.put_vhost(vhost)
    mc.close()
    q = urllib.parse.quote(vhost, safe="")
    amqp_url = f"amqp://{user}:{password}@{host}:{port}/{q}"
    declare_exchanges(amqp_url)
    cfg_path = write_demo_config(
        workdir, black_fpr=black_fpr, red_fprs=red_fprs, amqp_url=amqp_url, mgmt=mgmt
    )
    cfg = load_config(cfg_path)
    run = BlackRun(cfg)
    run.mirror.sync()  # mirror queues exist before the first message is published
    log_event(log, 20, "publishing demo traffic", messages=messages, vhost=vhost)
    pub = publish_mix(amqp_url, messages, big_every=big_every)
    t_pub = time.monotonic()
    if spark is None:
        from bridge.spark import get_spark

        spark = get_spark("diode-demo")
    summary = run.run(spark, "available-now")
    out = {
        "published": pub.count,
        "published_bytes": pub.body_bytes,
        "by_exchange": pub.by_exchange,
        "sealed": summary.messages,
        "lost": summary.lost,
        "bundles": summary.bundles,
        "black_seconds": round(summary.seconds, 2),
        "black_msg_per_s": round(summary.messages / summary.seconds, 1)
        if summary.seconds
        else None,
        "black_drain_msg_per_s": summary.to_json()["drain_msg_per_s"],
        "publish_seconds": round(t_pub - t0, 2),
        "workdir": str(workdir),
        "outbox": str(cfg.black.outbox),
        "config": str(cfg_path),
        "ok": summary.messages == pub.count and summary.lost == 0,
    }
    return out
