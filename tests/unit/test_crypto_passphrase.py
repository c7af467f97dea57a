"""Crypto: where a key passphrase comes from (file, environment), read from real files."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.crypto.passphrase import MAX_PASSPHRASE_BYTES, Passphrase, resolve_passphrase
from bridge.errors import ConfigError

SECRET = "correct horse battery staple"

one_line = st.binary(min_size=1, max_size=MAX_PASSPHRASE_BYTES).filter(
    lambda b: not any(c in b for c in (b"\n", b"\r", b"\0"))
)


def _file(folder: Path, data: bytes, mode: int = 0o600) -> Path:
    path = folder / "pw"
    path.write_bytes(data)
    path.chmod(mode)
    return path


@given(secret=one_line, ending=st.sampled_from([b"", b"\n", b"\r\n"]))
def test_file_round_trip(secret: bytes, ending: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        pp = Passphrase(path=_file(Path(d), secret + ending))
        assert pp.secret() == secret


@given(secret=st.text(min_size=1, max_size=200).filter(lambda s: not set(s) & {"\n", "\r", "\0"}))
def test_env_round_trip(secret: str) -> None:
    pp = resolve_passphrase(file=None, env_name="PW", side="black", environ={"PW": secret})
    assert pp is not None and pp.secret() == os.fsencode(secret)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"\n", "empty"),
        (b"two\nlines\n", "ONE line"),
        (b"nul\0byte", "ONE line"),
        (b"x" * (MAX_PASSPHRASE_BYTES + 1), "longer than"),
        (b"x" * (MAX_PASSPHRASE_BYTES + 10), "at most"),
    ],
)
def test_bad_file_contents(tmp_path: Path, data: bytes, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        Passphrase(path=_file(tmp_path, data)).secret()
    assert str(tmp_path / "pw") in str(info.value)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path, SECRET.encode(), mode)
    with pytest.raises(ConfigError, match=f"chmod 600 {path}") as info:
        Passphrase(path=path).secret()
    assert SECRET not in str(info.value)


def test_missing_symlink_and_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist.*install -m 600"):
        Passphrase(path=tmp_path / "nope").secret()
    real = _file(tmp_path, SECRET.encode())
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError):
        Passphrase(path=tmp_path / "link").secret()
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="not a regular file"):
        Passphrase(path=tmp_path / "dir").secret()


def test_resolve_sources(tmp_path: Path) -> None:
    path = _file(tmp_path, SECRET.encode() + b"\n")
    env = {"DIODE_BLACK_PASSPHRASE": "from-env"}
    assert resolve_passphrase(file=None, env_name="DIODE_BLACK_PASSPHRASE", side="black",
                              environ={}) is None  # fmt: skip
    assert resolve_passphrase(file=None, env_name=None, side="black", environ=env) is None
    by_file = resolve_passphrase(file=path, env_name="OTHER", side="black", environ=env)
    assert by_file is not None and by_file.secret() == SECRET.encode()
    by_env = resolve_passphrase(
        file=None, env_name="DIODE_BLACK_PASSPHRASE", side="black", environ=env
    )
    assert by_env is not None and by_env.secret() == b"from-env"
    with pytest.raises(ConfigError, match="black.passphrase_file is set AND.*DIODE_BLACK_PASS"):
        resolve_passphrase(file=path, env_name="DIODE_BLACK_PASSPHRASE", side="black", environ=env)
    with pytest.raises(ConfigError, match="environment variable DIODE_RED_PASSPHRASE is empty"):
        resolve_passphrase(
            file=None,
            env_name="DIODE_RED_PASSPHRASE",
            side="red",
            environ={"DIODE_RED_PASSPHRASE": ""},
        )
    with pytest.raises(ValueError):
        Passphrase()


def test_secret_never_in_repr_or_pickle(tmp_path: Path) -> None:
    pp = Passphrase(path=_file(tmp_path, SECRET.encode()))
    assert pp.secret() == SECRET.encode()
    for text in (repr(pp), str(pp), f"{pp}", pp.source):
        assert SECRET not in text and str(tmp_path / "pw") in text
    blob = pickle.dumps(pp)
    assert SECRET.encode() not in blob
    again = pickle.loads(blob)
    assert again.secret() == SECRET.encode()  # read again from its source where unpickled


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pw"
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(Passphrase(path=fifo).secret())
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # the old code waits for a writer: give it one, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("opening a FIFO passphrase file hung (no O_NONBLOCK)")
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError), outcome
    assert "not a regular file" in str(outcome[0]) and str(fifo) in str(outcome[0])


_PROBE = """
import ctypes, json, logging, resource, sys
from pathlib import Path
from bridge.crypto.passphrase import resolve_passphrase
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
libc = ctypes.CDLL(None)
before = libc.prctl(3, 0, 0, 0, 0)  # 3: PR_GET_DUMPABLE
pp = resolve_passphrase(file=Path(sys.argv[1]), env_name=None, side="red", environ={})
print(json.dumps({"before": before, "dumpable": libc.prctl(3, 0, 0, 0, 0),
                  "core_limit": resource.getrlimit(resource.RLIMIT_CORE)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_process_holding_a_passphrase_never_dumps_core(tmp_path: Path) -> None:
    path = _file(tmp_path, SECRET.encode())
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seen = json.loads(out.stdout)
    assert seen["before"] == 1  # a fresh process may dump core...
    assert seen["dumpable"] == 0  # ...not once it holds a passphrase
    assert seen["core_limit"] == [0, 0]  # nor may it (or its children) raise the limit again
    assert "core dumps disabled" in out.stderr and SECRET not in out.stderr
