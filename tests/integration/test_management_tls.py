"""Integration: an HTTPS management API whose certificate a private CA signed (a real TLS
proxy, tests/mgmt_proxy.py, in front of the real management API; the CA and certificate
made here with ``cryptography``).

Given no CA file, Then the error gives the TLS reason and says to set
black.management_ca_file (not "is the management plugin enabled?"); Given the CA in
black.management_ca_file, Then discovery works.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from bridge.black.management import ManagementClient
from bridge.black.mirror import Mirror
from bridge.config import Config, load_config
from bridge.errors import ManagementApiError
from tests.conftest import Vhost
from tests.mgmt_proxy import Proxy, management_proxy, private_ca

pytestmark = pytest.mark.broker


@pytest.fixture
def https_api(black_vhost: Vhost, tmp_path: Path) -> Iterator[tuple[Proxy, Path]]:
    """(an HTTPS proxy to the real management API, the PEM file of the CA that signed it)."""
    ca, cert, key = private_ca(tmp_path)
    with management_proxy(black_vhost.management_url, tls=(cert, key)) as proxy:
        yield proxy, ca


def _config(tmp_path: Path, vhost: Vhost, api: str, ca_line: str) -> Config:
    toml = tmp_path / "diode.toml"
    toml.write_text(
        f'[[channels]]\nname = "c1"\nencrypt = false\n[black]\namqp_url = "{vhost.amqp_url}"\n'
        f'management_url = "{api}"\nstate_dir = "state"\n{ca_line}\n'
    )
    return load_config(toml, environ={})


def test_a_private_ca_needs_the_ca_file_and_says_so(
    https_api: tuple[Proxy, Path], black_vhost: Vhost, tmp_path: Path
) -> None:
    proxy, ca = https_api
    with pytest.raises(ManagementApiError) as ei:  # the system's CAs
        ManagementClient(proxy.url, "guest", "guest").list_exchanges(black_vhost.name)
    msg = str(ei.value)
    assert "CERTIFICATE_VERIFY_FAILED" in msg and "set black.management_ca_file" in msg, msg
    assert "rabbitmq-plugins enable" not in msg  # the plugin is fine: TLS is not
    assert proxy.forwarded == 0

    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "ca.pem").write_bytes(ca.read_bytes())
    cfg = _config(tmp_path, black_vhost, proxy.url, 'management_ca_file = "tls/ca.pem"')
    assert cfg.black.management_ca_file == tmp_path / "tls" / "ca.pem"  # beside the config
    names = [d.name for d in ManagementClient.from_config(cfg.black).list_exchanges(
        black_vhost.name)]  # fmt: skip
    assert "amq.topic" in names and proxy.forwarded == 1
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    conn.channel().exchange_declare("ev", "fanout", durable=True)
    conn.close()
    report = Mirror(cfg, catalog_path=tmp_path / "state" / "exchanges.json").sync()
    assert report.discovered and report.channels["c1"].bound == ["ev"]


def test_a_ca_file_of_another_ca_names_the_file(
    https_api: tuple[Proxy, Path], black_vhost: Vhost, tmp_path: Path
) -> None:
    proxy, _ = https_api
    (tmp_path / "other").mkdir()
    other, _, _ = private_ca(tmp_path / "other")
    mc = ManagementClient(proxy.url, "guest", "guest", ca_file=other)
    with pytest.raises(ManagementApiError) as ei:
        mc.overview()
    msg = str(ei.value)
    assert "CERTIFICATE_VERIFY_FAILED" in msg and f"black.management_ca_file ({other})" in msg
