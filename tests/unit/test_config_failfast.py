"""Unit: a misconfiguration is a ConfigError naming the key and where it came from (the file or
an environment variable), never a Python exception; values of the wrong TOML type are refused,
not coerced; environment overrides are parsed as TOML where the key is not text.

Also the other fail-fast checks below the CLI: log level and format, the passphrase variable's
name, the metrics port."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.config import load_config
from bridge.errors import ConfigError

BASE = '[[channels]]\nname = "a"\nencrypt = false\n'


def _load(tmp_path: Path, before: str = "", *, env: dict[str, str] | None = None, after: str = ""):  # type: ignore[no-untyped-def]
    """Load ``before`` + one channel + ``after`` (top-level keys must come before a table)."""
    p = tmp_path / "d.toml"
    p.write_text(before + BASE + after)
    return load_config(p, environ=env or {})


def _refused(tmp_path: Path, before: str = "", **kw: object) -> str:
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, before, **kw)  # type: ignore[arg-type]
    return str(e.value)


# ---------------------------------------------------------------------------- B: no traceback
@pytest.mark.parametrize(
    ("after", "key", "got"),
    [
        ("[black]\noutbox = 5\n", "black.outbox", "an integer"),
        ('[black]\ngnupg_home = ["a"]\n', "black.gnupg_home", "an array"),
        ("[black]\npassphrase_file = 1.5\n", "black.passphrase_file", "a float"),
        ("[black]\nstaging_dir = true\n", "black.staging_dir", "a boolean"),
        ("[red]\ninbox = 5\n", "red.inbox", "an integer"),
        ("[udp]\nkey_file = 5\n", "udp.key_file", "an integer"),
        ("[udp.receive]\ninbox = 5\n", "udp.receive.inbox", "an integer"),
        ("[udp.send]\nstate_dir = 5\n", "udp.send.state_dir", "an integer"),
    ],
)
def test_a_path_that_is_not_a_string_names_the_key(
    tmp_path: Path, after: str, key: str, got: str
) -> None:
    msg = _refused(tmp_path, after=after)
    assert f"{key}: must be a path" in msg and got in msg and "d.toml" in msg, msg


@pytest.mark.parametrize("before", ["black = 5\n", "red = 5\n", "udp = 5\n", "link = [1]\n"])
def test_a_section_given_as_a_value_names_it(tmp_path: Path, before: str) -> None:
    msg = _refused(tmp_path, before)
    section = before.split(" ")[0]
    assert f"{section}: must be a table" in msg and "d.toml" in msg, msg


def test_a_nested_section_given_as_a_value_names_it(tmp_path: Path) -> None:
    msg = _refused(tmp_path, after="[red]\nreplay = 5\n[black]\nbundle = 5\n")
    assert "red.replay: must be a table" in msg and "black.bundle: must be a table" in msg, msg


def test_a_section_the_file_gives_as_a_value_is_blamed_on_the_file_under_an_override(
    tmp_path: Path,
) -> None:
    msg = _refused(tmp_path, "black = 5\n", env={"DIODE__BLACK__OUTBOX": "x"})
    assert "d.toml: black must be a table" in msg and "DIODE__BLACK__OUTBOX" not in msg, msg


def test_a_config_file_that_is_not_utf8_is_refused_with_the_fix(tmp_path: Path) -> None:
    p = tmp_path / "d.toml"
    p.write_bytes(BASE.encode() + b'[link]\nbridge_id = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"not UTF-8 .*0xe9.*iconv"):
        load_config(p, environ={})


def test_a_config_path_that_is_a_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(tmp_path, environ={})


# ---------------------------------------------------------------------------- C: strict types
@pytest.mark.parametrize(
    ("after", "key", "wanted"),
    [
        ('[[channels]]\nname = "b"\nencrypt = "off"\n', "channels.1.encrypt", "a boolean"),
        ("[black]\ndiscover = 1\n", "black.discover", "a boolean"),
        ('[black.bundle]\nhide_recipients = "n"\n', "black.bundle.hide_recipients", "a boolean"),
        ('[black.bundle]\nmax_rows = "5000"\n', "black.bundle.max_rows", "an integer"),
        ("[black.bundle]\nmax_rows = 5000.0\n", "black.bundle.max_rows", "an integer"),
        ('[black]\narchive_retention_days = "14"\n', "black.archive_retention_days", "a number"),
        ("[black]\namqp_url = 5\n", "black.amqp_url", "a string"),
        ('[red.replay]\napproved = "orders"\n', "red.replay.approved", "an array"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_coerced(
    tmp_path: Path, after: str, key: str, wanted: str
) -> None:
    msg = _refused(tmp_path, after=after)
    assert f"{key}: must be {wanted}" in msg and "d.toml" in msg, msg


def test_a_wrong_type_is_reported_without_the_value(tmp_path: Path) -> None:
    msg = _refused(tmp_path, after="[black]\nmanagement_password = 123456789\n")
    assert "black.management_password: must be a string" in msg and "123456789" not in msg


def test_values_of_the_right_type_still_load(tmp_path: Path) -> None:
    cfg = _load(
        tmp_path,
        after="[black]\ndiscover = false\narchive_retention_days = 14\n"
        "[black.bundle]\nmax_rows = 5000\nhide_recipients = false\n",
    )
    assert cfg.black.discover is False and cfg.black.archive_retention_days == 14.0
    assert cfg.black.bundle.max_rows == 5000 and cfg.black.bundle.hide_recipients is False
    assert cfg.black.outbox == tmp_path / "black/outbox"
    assert cfg.black.staging_dir == tmp_path / "black/.outbox.staging"


def test_env_overrides_are_toml_values_where_the_key_is_not_text(tmp_path: Path) -> None:
    cfg = _load(
        tmp_path,
        env={
            "DIODE__BLACK__BUNDLE__MAX_ROWS": "5000",
            "DIODE__BLACK__DISCOVER": "false",
            "DIODE__BLACK__ARCHIVE_RETENTION_DAYS": "2",
            "DIODE__RED__REPLAY__APPROVED": '["orders", "sensors"]',
            # text keys take the text: quoted as the runbook writes secrets, or bare
            "DIODE__BLACK__MANAGEMENT_PASSWORD": '"S3cret"',
            "DIODE__BLACK__MANAGEMENT_USER": "2024",
            "DIODE__LINK__BRIDGE_ID": "2024",
            "DIODE__RED__DELTA_ENGINE": "delta-rs",
            "DIODE__BLACK__SPOOL_DIR": "2024",
        },
    )
    assert cfg.black.bundle.max_rows == 5000 and cfg.black.discover is False
    assert cfg.black.archive_retention_days == 2.0
    assert cfg.red.replay.approved == ["orders", "sensors"]
    assert cfg.black.management_password.get_secret_value() == "S3cret"
    assert cfg.black.management_user == "2024" and cfg.link.bridge_id == "2024"
    assert cfg.red.delta_engine == "delta-rs"
    assert cfg.black.spool_dir == tmp_path / "2024"


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("DIODE__BLACK__DISCOVER", "yes"),
        ("DIODE__BLACK__BUNDLE__MAX_ROWS", "5k"),
        ("DIODE__RED__REPLAY__APPROVED", "orders"),
        ("DIODE__BLACK__BUNDLE__MAX_ROWS", "5\nmax_bytes = 1"),
    ],
)
def test_an_env_value_that_does_not_parse_names_the_variable(
    tmp_path: Path, var: str, raw: str
) -> None:
    msg = _refused(tmp_path, env={var: raw})
    assert f"environment variable {var}" in msg and "not a TOML value" in msg, msg
    assert "d.toml" not in msg, msg


def test_an_env_value_of_the_wrong_type_names_the_variable(tmp_path: Path) -> None:
    msg = _refused(tmp_path, env={"DIODE__BLACK__DISCOVER": "1"})
    assert "black.discover (from environment variable DIODE__BLACK__DISCOVER)" in msg, msg
    assert "must be a boolean" in msg and "invalid configuration from the environment" in msg


# ---------------------------------------------------------------------------- D: env blamed
def test_an_unknown_key_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    msg = _refused(tmp_path, env={"DIODE__BLACK__BUNDLE__MAX_ROWZ": "5"})
    assert "environment variable DIODE__BLACK__BUNDLE__MAX_ROWZ" in msg, msg
    assert "black.bundle.max_rowz is not a configuration key" in msg, msg
    assert "d.toml" not in msg, msg


def test_a_bad_value_from_the_environment_names_the_variable_not_the_file(tmp_path: Path) -> None:
    msg = _refused(tmp_path, env={"DIODE__BLACK__BUNDLE__MAX_ROWS": "0"})
    assert "(from environment variable DIODE__BLACK__BUNDLE__MAX_ROWS)" in msg, msg
    assert "invalid configuration in d.toml" not in msg, msg


def test_a_file_error_lists_the_overrides_in_effect(tmp_path: Path) -> None:
    msg = _refused(
        tmp_path,
        after="[black]\ntrigger_seconds = 10\n",
        env={"DIODE__BLACK__BUNDLE__MAX_AGE_SECONDS": "1"},
    )
    assert "environment overrides in effect: DIODE__BLACK__BUNDLE__MAX_AGE_SECONDS" in msg, msg


def test_list_entries_cannot_be_overridden_and_the_message_says_how(tmp_path: Path) -> None:
    msg = _refused(tmp_path, env={"DIODE__CHANNELS__0__NAME": "x"})
    assert "environment variable DIODE__CHANNELS__0__NAME" in msg, msg
    assert "[[channels]] entries cannot be overridden" in msg and "DIODE__CHANNELS=" in msg, msg
    assert "is not a table" not in msg
    cfg = _load(tmp_path, env={"DIODE__CHANNELS": '[{ name = "b", encrypt = false }]'})
    assert [c.name for c in cfg.channels] == ["b"]
    msg = _refused(tmp_path, env={"DIODE__CHANNELS": '[{ name = "b", encrypt = "no" }]'})
    assert "channels.0.encrypt (from environment variable DIODE__CHANNELS)" in msg, msg


@pytest.mark.parametrize(
    ("var", "words"),
    [
        ("DIODE__BLACK", "[black] is a section, not a key"),
        ("DIODE__RED__REPLAY", "[red.replay] is a section, not a key"),
        ("DIODE__BLACK__OUTBOX__X", "black.outbox is a single value"),
        ("DIODE__SOURCE", "source is not a configuration key"),
    ],
)
def test_an_override_of_no_key_names_the_variable(tmp_path: Path, var: str, words: str) -> None:
    msg = _refused(tmp_path, env={var: "5"})
    assert f"environment variable {var}" in msg and words in msg, msg


# ---------------------------------------------------------------------------- H: log settings
@pytest.fixture
def log_env() -> Iterator[None]:
    saved = {
        k: os.environ.pop(k) for k in ("DIODE_LOG_LEVEL", "DIODE_LOG_FORMAT") if k in os.environ
    }
    root = logging.getLogger("bridge")
    handlers, level, propagate = root.handlers[:], root.level, root.propagate
    try:
        yield
    finally:
        for k in ("DIODE_LOG_LEVEL", "DIODE_LOG_FORMAT"):
            os.environ.pop(k, None)
        os.environ.update(saved)
        root.handlers[:], root.propagate = handlers, propagate
        root.setLevel(level)


def test_a_bad_log_level_or_format_is_refused_with_the_accepted_values(log_env: None) -> None:
    from bridge.logs import setup_logging

    with pytest.raises(ConfigError, match=r"--log-level = 'BOGUS'.*DEBUG, INFO, WARNING"):
        setup_logging("BOGUS")
    os.environ["DIODE_LOG_LEVEL"] = "verbose"
    with pytest.raises(ConfigError, match=r"DIODE_LOG_LEVEL = 'verbose'.*DEBUG, INFO"):
        setup_logging()
    os.environ["DIODE_LOG_LEVEL"] = "warn"
    os.environ["DIODE_LOG_FORMAT"] = "xml"
    with pytest.raises(ConfigError, match=r"DIODE_LOG_FORMAT = 'xml'.*json, text"):
        setup_logging()
    os.environ["DIODE_LOG_FORMAT"] = "text"
    setup_logging()
    assert logging.getLogger("bridge").level == logging.WARNING


# ---------------------------------------------------------------------------- G: passphrase env
def test_a_passphrase_variable_name_that_is_not_a_name_is_never_echoed() -> None:
    from bridge.crypto.passphrase import Passphrase

    with pytest.raises(ConfigError) as e:
        Passphrase(env_name="hunter2 is my secret")
    assert "hunter2" not in str(e.value) and "NAME of an environment variable" in str(e.value)
    assert Passphrase(env_name="MY_PW_1").source == "environment variable MY_PW_1"


# ---------------------------------------------------------------------------- F: metrics port
def test_a_metrics_port_out_of_range_or_in_use_names_port_and_option() -> None:
    from bridge.metrics import serve_metrics

    with pytest.raises(
        ConfigError, match=r"--metrics-port 99999 is not a TCP port: use 1\.\.65535"
    ):
        serve_metrics(99999)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            serve_metrics(port, option="--metrics-port")
    assert f"--metrics-port {port}" in str(e.value) and "another process" in str(e.value)


def test_a_heartbeat_period_over_a_day_is_refused_at_load(tmp_path: Path) -> None:
    """The heartbeat's interval_seconds is at most 86400 (protocol §9): a longer period was
    accepted, then every heartbeat failed to build and red never heard one."""
    msg = _refused(tmp_path, after="[black]\nheartbeat_seconds = 172800.0\n")
    assert "black.heartbeat_seconds" in msg and "86400" in msg, msg
    assert _load(tmp_path, after="[black]\nheartbeat_seconds = 86400.0\n")
