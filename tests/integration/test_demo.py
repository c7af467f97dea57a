"""Integration: the README's first command, `diode demo`, from a fresh workdir (real broker,
real gpg, Spark in the CLI's own process): black broker -> bundles -> stand-in diode -> red
Delta -> red broker, every published message landed once and received on red."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bridge.black.management import ManagementClient
from tests.conftest import AUTH, MGMT
from tests.integration.test_red_notebooks import run_notebook

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("transport", ["file", "udp"])
def test_demo_runs_from_scratch(
    short_tmp: Path, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    vhost = f"diode-test-demo-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=str(REPO), DIODE_LOG_LEVEL="WARNING")
    extra = ["--transport", "udp", "--loss", "2"] if transport == "udp" else []
    try:
        r = subprocess.run(
            [sys.executable, "-m", "bridge.cli", "demo", "--messages", "3000", "--workdir",
             str(short_tmp / "demo"), "--vhost", vhost, "--json", *extra],
            cwd=REPO, env=env, capture_output=True, timeout=600, check=False,
        )  # fmt: skip
    finally:
        mc = ManagementClient(MGMT, *AUTH, timeout=60)
        mc.delete_vhost(vhost)
        mc.delete_vhost(f"{vhost}-red")
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    out = r.stdout.decode().strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["ok"] is True and summary["lost"] == 0
    assert Path(summary["tables"]).resolve() == (short_tmp / "demo" / "red" / "delta").resolve()
    # every message accounted for from red's evidence: the Delta table and the quarantine
    assert summary["landed_unique"] == summary["published"]
    assert summary["duplicates"] == 0 and summary["quarantined"] == 0
    assert summary["black_gaps"] == 0 and summary["duplicate_bundles"] == 0
    table = "\n".join(out[:-1])  # the human summary table comes before the JSON line
    assert out[0].startswith("stage "), f"stdout holds more than the summary: {out[0]!r}"
    assert f"received on red {summary['received_on_red']:,}" in " ".join(table.split())
    assert "lost 0 · duplicates 0 · quarantined 0" in table and "· ok" in table
    assert summary["sealed"] == summary["published"] > 2000 and summary["bundles"] >= 1
    assert summary["files_crossed"] >= summary["bundles"]
    assert summary["landed"] == summary["published"] and summary["rejected"] == 0
    assert summary["received_on_red"] == summary["published"]
    from deltalake import DeltaTable

    messages = DeltaTable(str(Path(summary["tables"]) / "messages")).to_pyarrow_table(
        columns=["channel", "seq"]
    )
    keys = set(zip(messages["channel"].to_pylist(), messages["seq"].to_pylist(), strict=True))
    assert len(keys) == messages.num_rows == summary["published"], "each (channel, seq) once"
    if transport == "udp":  # the files really crossed as datagrams, through a lossy relay
        udp = summary["udp"]
        assert udp["missing"] == 0 and udp["files_sent"] == udp["delivered"] >= summary["bundles"]
        relay = udp["processes"]["relay"]
        assert relay["received"] >= udp["datagrams_sent"] > 0  # all of it through the relay
        assert relay["forwarded"] + relay["dropped_random"] == relay["received"]
        if relay["received"] >= 500:  # 0.98^500 < 1e-4: then a 2% loss must have fired
            assert relay["dropped_random"] > 0, "the 2% loss never fired"
        assert udp["processes"]["receiver"]["objects_completed"] == udp["files_sent"]
    cfg = Path(summary["config"])
    assert cfg.stat().st_mode & 0o077 == 0, "the demo config holds the AMQP password: 0600"
    if transport == "file":
        check_notebooks_on_demo_output(cfg, summary, monkeypatch)


def check_notebooks_on_demo_output(
    cfg: Path, summary: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notebooks, run over the tables the demo just wrote, show what the demo reported: every
    message, every bundle landed with its chain verified, no gap, no alarm, the replay."""
    ns = run_notebook("red_arrivals.py", cfg, monkeypatch)
    assert int(ns["per_minute"].to_numpy().sum()) == summary["published"]
    lat = ns["latency"]
    assert lat.loc["bundle created -> landed", "n"] == summary["bundles"]
    assert 0 < lat.loc["bundle created -> landed", "max"] < 600, lat
    contig = ns["contiguity"]
    assert set(contig.channel) and all(m == [] for m in contig.missing_bundles), contig
    assert all(h == [] for h in contig.message_holes), contig
    msg, carrier = ns["message"], ns["carrier"]
    assert len(msg) == 1 and carrier.bundle_seq.tolist() == [msg.bundle_seq[0]]

    ns = run_notebook("red_audit.py", cfg, monkeypatch)
    assert ns["open_gaps"].empty and ns["declared"].empty, ns["gaps"]
    assert ns["alarms"].empty, ns["alarms"]
    assert ns["chain_problems"].empty, ns["chain_problems"]
    assert int(ns["chain"].to_numpy().sum()) == summary["bundles"]
    assert len(ns["rejections"]) == 0, ns["rejections"]
