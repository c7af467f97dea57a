"""Unit: configuration loading, validation messages, env overrides, example completeness."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from bridge.config import (
    BlackConfig,
    BundleConfig,
    ChannelConfig,
    Config,
    LinkConfig,
    RedConfig,
    ReplayConfig,
    SpoolConfig,
    TapConfig,
    UdpConfig,
    UdpReceiveConfig,
    UdpSendConfig,
    load_config,
)
from bridge.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "conf" / "diode.example.toml"
FPR = "0123456789ABCDEF0123456789ABCDEF01234567"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "d.toml"
    p.write_text(text)
    return p


def test_example_loads_and_documents_every_key() -> None:
    cfg = load_config(EXAMPLE, environ={})
    assert cfg.channels[0].name == "default"
    text = EXAMPLE.read_text()
    models: list[type[BaseModel]] = [
        LinkConfig,
        ChannelConfig,
        BlackConfig,
        BundleConfig,
        TapConfig,
        SpoolConfig,
        RedConfig,
        ReplayConfig,
        UdpConfig,
        UdpSendConfig,
        UdpReceiveConfig,
    ]
    for model in models:
        for name in model.model_fields:
            # a comment line, then the key (optional keys are shown commented out: "# key = ")
            m = re.search(rf"^# .*\n(?:#.*\n)*(?:# )?{name} = ", text, re.M)
            assert m or f"[{name}" in text or f".{name}]" in text, (
                f"{model.__name__}.{name} undocumented"
            )


def test_unknown_key_is_rejected_with_a_fix(tmp_path: Path) -> None:
    p = _write(tmp_path, '[[channels]]\nname="a"\nencrypt=false\n[black]\namqp_ulr="x"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert "black.amqp_ulr" in str(e.value) and "unknown key" in str(e.value)


def test_encrypted_channel_without_recipients_says_how_to_fix(tmp_path: Path) -> None:
    p = _write(tmp_path, '[[channels]]\nname="a"\n')
    with pytest.raises(ConfigError, match="no recipients.*encrypt = false"):
        load_config(p, environ={})


def test_bad_fingerprint_and_missing_file(tmp_path: Path) -> None:
    p = _write(tmp_path, '[[channels]]\nname="a"\nrecipients=["ABC"]\n')
    with pytest.raises(ConfigError, match="not a full OpenPGP fingerprint"):
        load_config(p, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", environ={})


def test_signing_key_must_be_pinned(tmp_path: Path) -> None:
    other = "F" * 40
    p = _write(
        tmp_path,
        f'[link]\nblack_signers=["{other}"]\n[[channels]]\nname="a"\nencrypt=false\n'
        f'[black]\nsigning_key="{FPR}"\n',
    )
    with pytest.raises(ConfigError, match="not listed in link.black_signers"):
        load_config(p, environ={})


def test_env_overrides_and_relative_paths(tmp_path: Path) -> None:
    p = _write(tmp_path, '[[channels]]\nname="a"\nencrypt=false\n')
    cfg = load_config(
        p,
        environ={
            "DIODE__BLACK__BUNDLE__MAX_ROWS": "123",
            "DIODE__BLACK__OUTBOX": "/abs/out",
            "DIODE__LINK__BRIDGE_ID": "site-b",
        },
    )
    assert cfg.black.bundle.max_rows == 123
    assert cfg.black.outbox == Path("/abs/out")
    assert cfg.black.state_dir == tmp_path / "black" / "state"
    assert cfg.link.bridge_id == "site-b"


def test_duplicate_channels_rejected(tmp_path: Path) -> None:
    p = _write(
        tmp_path, '[[channels]]\nname="a"\nencrypt=false\n[[channels]]\nname="a"\nencrypt=false\n'
    )
    with pytest.raises(ConfigError, match="unique"):
        load_config(p, environ={})


def test_secrets_not_in_repr(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        '[[channels]]\nname="a"\nencrypt=false\n[black]\namqp_url="amqp://u:hunter2@h/v"\n',
    )
    cfg = load_config(p, environ={})
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)
    assert isinstance(cfg, Config)


@pytest.mark.parametrize(
    ("where", "url"),
    [("file", "http://mgr:Pw_S3cret@127.0.0.1:15672"), ("env", "https://mgr:Pw_S3cret@h:15671")],
)
def test_credentials_in_the_management_url_are_refused_without_echoing_them(
    tmp_path: Path, where: str, url: str
) -> None:
    """The management URL is shown in messages and status: a password in it would leak (an
    unreachable API printed it whole). Refused at load, naming the keys to use instead."""
    text = '[[channels]]\nname="a"\nencrypt=false\n'
    environ = {}
    if where == "file":
        text += f'[black]\nmanagement_url="{url}"\n'
    else:
        environ["DIODE__BLACK__MANAGEMENT_URL"] = url
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text), environ=environ)
    msg = str(err.value)
    assert "black.management_url" in msg and "carries credentials" in msg, msg
    assert "black.management_password" in msg and "Pw_S3cret" not in msg, msg
    ok = text.replace(url, "http://127.0.0.1:15672")
    assert load_config(_write(tmp_path, ok), environ={}).black.management_url


def test_udp_transport_needs_the_udp_section(tmp_path: Path) -> None:
    base = '[[channels]]\nname = "a"\nencrypt = false\ntransport = "udp"\n'
    with pytest.raises(ConfigError, match=r"no \[udp\] section"):
        load_config(_write(tmp_path, base), environ={})
    cfg = load_config(_write(tmp_path, base + "[udp]\n[udp.receive]\n"), environ={})
    assert cfg.udp_channels() == ["a"]
    assert cfg.udp is not None
    assert cfg.udp.key_file == tmp_path / "keys/udp.key"
    assert cfg.udp.receive.inbox == cfg.red.inbox  # default: red's inbox
    assert cfg.udp.send.state_dir == tmp_path / "black/udp-send"


def test_udp_refuses_every_interface_and_bad_addresses(tmp_path: Path) -> None:
    base = '[[channels]]\nname = "a"\nencrypt = false\n[udp.receive]\n'
    for spelling in ("0.0.0.0", "0", "0.0", "0x0", "[::]", "[::0]", "[0:0::0]", "[::ffff:0.0.0.0]"):
        with pytest.raises(ConfigError, match="every interface"):
            load_config(_write(tmp_path, base + f'bind = "{spelling}:47100"\n'), environ={})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_config(_write(tmp_path, base + 'bind = "localhost"\n'), environ={})
    cfg = load_config(_write(tmp_path, base + 'bind = "[::1]:9"\n'), environ={})
    assert cfg.udp is not None and cfg.udp.receive.bind == "[::1]:9"


def test_udp_blocks_larger_than_raptorq_keeps_whole_are_refused(tmp_path: Path) -> None:
    base = '[[channels]]\nname = "a"\nencrypt = false\ntransport = "udp"\n[udp]\nmtu = 9000\n'
    with pytest.raises(ConfigError, match=r"block_symbols\s*<= 932"):
        load_config(_write(tmp_path, base + "[udp.send]\nblock_symbols = 2048\n"), environ={})
    cfg = load_config(_write(tmp_path, base + "[udp.send]\nblock_symbols = 932\n"), environ={})
    assert cfg.udp is not None and cfg.udp.send.block_symbols == 932
    with pytest.raises(ConfigError, match="gso"):
        load_config(_write(tmp_path, base + '[udp.send]\ngso = "on"\n'), environ={})


def test_approved_exchanges_must_be_exchange_names(tmp_path: Path) -> None:
    base = '[[channels]]\nname = "a"\nencrypt = false\n[red.replay]\n'
    with pytest.raises(ConfigError, match=r"red\.replay\.approved.*default exchange"):
        load_config(_write(tmp_path, base + 'approved = ["ok", ""]\n'), environ={})
    with pytest.raises(ConfigError, match="AMQP allows 255"):
        load_config(_write(tmp_path, base + f'approved = ["{"x" * 256}"]\n'), environ={})
    cfg = load_config(_write(tmp_path, base + 'approved = ["amq.topic", "orders"]\n'), environ={})
    assert cfg.red.replay.approved == ["amq.topic", "orders"]


def test_red_max_plain_bytes_reaches_the_verify_context(tmp_path: Path) -> None:
    from bridge.red.verify import VerifyContext

    base = '[[channels]]\nname = "a"\nencrypt = false\n[red]\n'
    assert (
        VerifyContext.from_config(load_config(_write(tmp_path, base), environ={})).max_plain_bytes
        is None
    )
    cfg = load_config(_write(tmp_path, base + "max_plain_bytes = 5000000\n"), environ={})
    assert VerifyContext.from_config(cfg, environ={}).max_plain_bytes == 5_000_000
    with pytest.raises(ConfigError, match="max_plain_bytes"):
        load_config(_write(tmp_path, base + "max_plain_bytes = 10\n"), environ={})


def test_source_is_not_a_config_key(tmp_path: Path) -> None:
    text = 'source = "/etc/other.toml"\n[[channels]]\nname = "a"\nencrypt = false\n'
    with pytest.raises(ConfigError, match="unknown key 'source'"):
        load_config(_write(tmp_path, text), environ={})


@pytest.mark.parametrize("days", ["0", "0.01", "-1"])
def test_archive_retention_too_short_to_be_safe_is_refused_with_the_fix(
    tmp_path: Path, days: str
) -> None:
    # a prune between the archiving and the journal's commit of a bundle would delete the copy
    # crash recovery re-drops: that needs a retention well above the seconds a bundle takes
    p = _write(
        tmp_path,
        f'[[channels]]\nname="a"\nencrypt=false\n[black]\narchive_retention_days={days}\n',
    )
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    msg = str(e.value)
    assert "black.archive_retention_days" in msg and "1 hour" in msg, msg
    assert "Set black.archive_retention_days to at least" in msg, msg


def test_archive_retention_of_an_hour_is_accepted(tmp_path: Path) -> None:
    p = _write(
        tmp_path, '[[channels]]\nname="a"\nencrypt=false\n[black]\narchive_retention_days=0.05\n'
    )
    assert load_config(p, environ={}).black.archive_retention_days == 0.05


def test_management_ca_file_must_be_a_readable_pem_bundle(tmp_path: Path) -> None:
    from tests.mgmt_proxy import private_ca

    base = '[[channels]]\nname="a"\nencrypt=false\n[black]\n'
    assert load_config(_write(tmp_path, base), environ={}).black.management_ca_file is None
    (tmp_path / "tls").mkdir()
    bad = {
        "tls/missing.pem": "cannot be read (No such file or directory)",
        "tls": "cannot be read (Is a directory)",  # not a file
        "tls/garbage.pem": "holds no PEM certificate",
    }
    (tmp_path / "tls" / "garbage.pem").write_text("not a certificate\n")
    for value, why in bad.items():
        with pytest.raises(ConfigError) as e:
            load_config(_write(tmp_path, base + f'management_ca_file = "{value}"\n'), environ={})
        msg = str(e.value)
        assert "black.management_ca_file" in msg and why in msg, msg
        assert str(tmp_path / value) in msg, msg
    ca, _, _ = private_ca(tmp_path / "tls")
    cfg = load_config(_write(tmp_path, base + 'management_ca_file = "tls/ca.pem"\n'), environ={})
    assert cfg.black.management_ca_file == ca  # relative to the config file
    env = {"DIODE__BLACK__MANAGEMENT_CA_FILE": str(ca)}
    assert load_config(_write(tmp_path, base), environ=env).black.management_ca_file == ca
