"""Crypto (both sides): `black.gpg_binary` / `red.gpg_binary` pick the gpg each side runs.

Every gpg call of a side, and the gpgconf / gpg-connect-agent it runs, must come from the
configured install: PATH holds decoys (they log and fail) while a side runs a configured gpg, so
a call that still went through PATH shows. A binary that is missing, not executable, not GnuPG,
too old or without its gpgconf fails the side's start naming the key and the fix. Unset, `gpg`
from PATH runs, as it always did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bridge.config import Config, config_from_dict, load_config
from bridge.crypto.gpg import GNUPG_TOOLS, Gpg, check_gpg_binary, gnupg_tool
from bridge.crypto.keys import KeyInventory, decryption_gpg, init_keys, signing_gpg
from bridge.errors import ConfigError, KeyMissingError
from bridge.red.verify import VerifyContext

pytestmark = pytest.mark.gpg

TOOLS = ("gpg", *GNUPG_TOOLS)
REAL = {t: shutil.which(t) or f"/nonexistent/{t}" for t in TOOLS}
"""The system's GnuPG (2.2), looked up before any test puts decoys first on PATH."""
GPG24 = os.environ.get("DIODE_GPG24") or "/opt/gnupg-2.4/bin/gpg"
"""GnuPG 2.4 as `bash scripts/gnupg-2.4.sh` installs it (DIODE_GPG24: where it put it)."""


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@dataclass
class Bench:
    """A test's folder, with the GnuPG homes it made stopped at its end."""

    root: Path
    decoy_log: Path
    homes: list[tuple[Path, str]]
    """(home, gpg binary whose gpgconf stops its daemons)."""

    def install(self, name: str, log: Path) -> str:
        """A GnuPG "install" of the system's tools that records each call (tool and argv)."""
        for tool in TOOLS:
            _script(
                self.root / name / tool, f'echo "{tool} $*" >> "{log}"\nexec "{REAL[tool]}" "$@"\n'
            )
        return str(self.root / name / "gpg")

    def keys(self, binary: str) -> KeyInventory:
        inv = init_keys(self.root / "keys", bridge_id="gb", binary=binary)
        self.homes += [(inv.black_home, binary), (inv.red_home, binary)]
        return inv

    def decoyed(self) -> list[str]:
        """The calls that went through PATH's gpg, gpgconf or gpg-connect-agent."""
        return self.decoy_log.read_text().splitlines() if self.decoy_log.exists() else []


@pytest.fixture
def bench(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bench]:
    """PATH starts with decoys of every GnuPG tool: each logs its call and exits 2."""
    b = Bench(short_tmp, short_tmp / "decoy.log", [])
    for tool in TOOLS:
        _script(short_tmp / "decoy" / tool, f'echo "{tool} $*" >> "{b.decoy_log}"\nexit 2\n')
    monkeypatch.setenv("PATH", f"{short_tmp / 'decoy'}{os.pathsep}{os.environ['PATH']}")
    try:
        yield b
    finally:
        for home, binary in b.homes:
            real = binary if os.sep in binary else REAL["gpg"]
            subprocess.run(
                [gnupg_tool(real, "gpgconf"), "--homedir", str(home), "--kill", "all"],
                capture_output=True,
                check=False,
                timeout=60,
            )


def _config(inv: KeyInventory, extra: dict[str, str], base: Path) -> Config:
    """Both sides of ``inv`` on one machine; ``extra``: ``{"black": "gpg_binary = ..."}``."""
    text = inv.to_toml_snippet()
    for side, line in extra.items():
        text = text.replace(f"[{side}]\n", f"[{side}]\n{line}\n", 1)
    return config_from_dict(tomllib.loads(text), base=base, environ={})


def _round_trip(bench: Bench, cfg: Config, inv: KeyInventory) -> None:
    """Black seals as its start and job do; red opens as its start and verify step do."""
    sealer = signing_gpg(cfg, one_shot=True)  # `diode check`, `diode keys check`
    src, sealed = bench.root / "plain", bench.root / "default.000000000001.e.dbundle"
    src.write_bytes(os.urandom(20_000))
    recipients = list(inv.red_fprs.values())
    sealer.seal(src, sealed, signer=inv.black_fpr, recipients=recipients)
    decryption_gpg(cfg, one_shot=True)
    opener = VerifyContext.from_config(cfg, environ={}).gpg()  # what verify_file runs
    opened = opener.open(sealed, bench.root / "out", pinned_signers=[inv.black_fpr])
    assert opened.encrypted and opened.signer_fpr == inv.black_fpr
    assert (bench.root / "out").read_bytes() == src.read_bytes()


def test_each_side_runs_its_configured_gpg_and_its_gpgconf(bench: Bench) -> None:
    black_log, red_log = bench.root / "black.log", bench.root / "red.log"
    black_gpg, red_gpg = bench.install("bg", black_log), bench.install("rg", red_log)
    inv = bench.keys(black_gpg)
    cfg = _config(
        inv,
        {"black": f'gpg_binary = "{black_gpg}"', "red": 'gpg_binary = "rg/gpg"'},
        bench.root,
    )
    assert cfg.red.gpg_binary == red_gpg  # a relative path: to the config file's folder
    black_log.unlink()  # init_keys ran it for both homes
    _round_trip(bench, cfg, inv)
    assert bench.decoyed() == []
    black_calls, red_calls = black_log.read_text(), red_log.read_text()
    assert "gpg --version" in black_calls and "--sign" in black_calls  # checked, then used
    assert f"gpgconf --homedir {inv.black_home} --kill all" in black_calls  # one-shot check
    assert f"gpg-connect-agent --homedir {inv.black_home} --no-autostart" in black_calls
    assert str(inv.red_home) not in black_calls
    assert "--decrypt" in red_calls and f"gpgconf --homedir {inv.red_home} --kill" in red_calls
    assert str(inv.black_home) not in red_calls


def test_absent_key_runs_gpg_from_path_as_before(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = bench.root / "path.log"
    on_path = Path(bench.install("path", log)).parent
    monkeypatch.setenv("PATH", f"{on_path}{os.pathsep}{os.environ['PATH']}")
    inv = bench.keys("gpg")
    cfg = _config(inv, {}, bench.root)
    assert cfg.black.gpg_binary == cfg.red.gpg_binary == "gpg"
    _round_trip(bench, cfg, inv)
    calls = log.read_text()
    assert "--version" not in calls  # unset: not checked, as before the key existed
    assert f"gpgconf --homedir {inv.red_home} --kill all" in calls
    assert bench.decoyed() == []


@pytest.mark.skipif(
    not os.access(GPG24, os.X_OK),
    reason=f"no GnuPG 2.4 at {GPG24}: run `bash scripts/gnupg-2.4.sh` (DIODE_GPG24: the gpg it "
    "installed, when not under /opt)",
)
def test_both_sides_on_a_vendored_gnupg_24(bench: Bench) -> None:
    """The install scripts/gnupg-2.4.sh makes under /opt: keys, seal, open, all by 2.4."""
    assert check_gpg_binary(GPG24, key="black.gpg_binary").startswith("2.4.")
    inv = bench.keys(GPG24)
    line = f'gpg_binary = "{GPG24}"'
    cfg = _config(inv, {"black": line, "red": line}, bench.root)
    _round_trip(bench, cfg, inv)
    assert bench.decoyed() == []  # the system's 2.2 never ran
    agent = subprocess.run(
        [gnupg_tool(GPG24, "gpg-connect-agent"), "--homedir", str(inv.red_home)]
        + ["GETINFO version", "/bye"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "D 2.4." in agent  # red's verify step started the agent of 2.4


BAD = {
    "missing": ("nope/gpg", "no such file"),
    "directory": ("./bin", "not a file"),
    "not-executable": ("plain/gpg", "not executable"),
    "not-on-path": ("gpg-not-installed-anywhere", "not found on PATH"),
    "not-gnupg": ("other/gpg", "is not GnuPG.*'sequoia-ish 1.0'"),
    "too-old": ("old/gpg", r"is GnuPG 2\.1\.18, too old"),
    "no-gpgconf": ("lone/gpg", "gpgconf is missing"),
}


def _bad_binaries(root: Path) -> None:
    (root / "bin").mkdir()
    (root / "plain").mkdir()
    (root / "plain" / "gpg").write_text("#!/bin/sh\n")  # mode 0644
    _script(root / "other" / "gpg", "echo 'sequoia-ish 1.0'\n")
    _script(root / "old" / "gpg", "echo 'gpg (GnuPG) 2.1.18'\necho 'libgcrypt 1.7.6'\n")
    _script(root / "lone" / "gpg", f'exec "{REAL["gpg"]}" "$@"\n')


@pytest.mark.parametrize("case", list(BAD))
def test_a_binary_that_is_not_gnupg_22_fails_the_start_naming_the_key(
    bench: Bench, case: str
) -> None:
    value, why = BAD[case]
    _bad_binaries(bench.root)
    inv = KeyInventory(bench.root / "kb", bench.root / "kr", "A" * 40, {"red": "B" * 40})
    for side, start in (("black", signing_gpg), ("red", decryption_gpg)):
        cfg = _config(inv, {side: f'gpg_binary = "{value}"'}, bench.root)
        with pytest.raises(ConfigError, match=why) as refused:
            start(cfg, one_shot=True)
        msg = str(refused.value)
        assert msg.startswith(f"{side}.gpg_binary = ")
        assert f"set {side}.gpg_binary to its gpg" in msg or "complete install" in msg
        assert not inv.black_home.exists() and not inv.red_home.exists()  # nothing created
    assert bench.decoyed() == []


def test_diode_check_and_keys_check_exit_2_with_the_message(bench: Bench) -> None:
    """The CLI: `diode check` (black) and `diode keys check --side red`, before any key."""
    inv = KeyInventory(bench.root / "kb", bench.root / "kr", "A" * 40, {"red": "B" * 40})
    for home in (inv.black_home, inv.red_home):
        home.mkdir(mode=0o700)
    text = inv.to_toml_snippet()
    text = text.replace("[black]\n", '[black]\ngpg_binary = "nope/gpg"\n')
    text = text.replace("[red]\n", '[red]\ngpg_binary = "gpg-not-installed-anywhere"\n')
    conf = bench.root / "diode.toml"
    conf.write_text(text)
    conf.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIODE")}
    for argv, want in (
        (["check"], f"black.gpg_binary = '{bench.root / 'nope' / 'gpg'}': no such file"),
        (["keys", "check", "--side", "red"], "red.gpg_binary = 'gpg-not-installed-anywhere'"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "bridge.cli", *argv, "--config", str(conf)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert want in r.stderr and "install GnuPG 2.2 or later" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_the_key_at_config_load(tmp_path: Path) -> None:
    """A name stays a name (PATH), a relative path is the config folder's, an override from the
    environment counts as set; an empty value or one of two lines is refused at load. Whether
    it runs is checked when the side starts, not here (each side's gpg is on its own host)."""
    data = {"channels": [{"name": "c", "encrypt": False}], "black": {"gpg_binary": "gpg2"}}
    env = {"DIODE__RED__GPG_BINARY": "vendor/bin/gpg"}
    cfg = config_from_dict(data, base=tmp_path, environ=env)
    assert cfg.black.gpg_binary == "gpg2"
    assert cfg.red.gpg_binary == str(tmp_path / "vendor" / "bin" / "gpg")
    assert "gpg_binary" in cfg.red.model_fields_set
    for bad in ("", " ", "/usr/bin/gpg\n/usr/bin/gpg2"):
        with pytest.raises(ConfigError, match=r"black\.gpg_binary.*a name on PATH"):
            config_from_dict({**data, "black": {"gpg_binary": bad}}, base=tmp_path, environ={})


def test_demo_config_names_the_demo_gpg_for_both_sides(tmp_path: Path) -> None:
    from bridge.demo.run import write_demo_config

    args = {"black_fpr": "A" * 40, "red_fprs": ["B" * 40], "amqp_url": "amqp://x", "mgmt": "m"}
    plain = load_config(write_demo_config(tmp_path, red_amqp_url="amqp://y", **args), environ={})
    assert "gpg_binary" not in plain.black.model_fields_set | plain.red.model_fields_set
    vendored = "/opt/gnupg-2.4/bin/gpg"
    path = write_demo_config(tmp_path, red_amqp_url="amqp://y", gpg_binary=vendored, **args)
    cfg = load_config(path, environ={})
    assert cfg.black.gpg_binary == cfg.red.gpg_binary == vendored


def test_keys_init_and_import_run_the_gpg_binary_given(bench: Bench) -> None:
    """`diode keys init` / `import` read no config: they ran the first gpg on PATH whatever
    the side's gpg_binary. --gpg-binary runs that one (and its gpgconf), checked like the key."""
    log = bench.root / "side.log"
    gpg = bench.install("side", log)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIODE")}

    def diode(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bridge.cli", *argv], capture_output=True,
                              text=True, env=env, timeout=180, check=False)  # fmt: skip

    red_home, black_home = bench.root / "kr", bench.root / "kb"
    bench.homes += [(red_home, gpg), (black_home, gpg)]
    r = diode("keys", "init", "--side", "red", "--home", str(red_home), "--gpg-binary", gpg)
    assert r.returncode == 0, r.stdout + r.stderr
    pub = bench.root / "pub" / "red.asc"
    assert pub.exists()
    assert f'gpg_binary = "{gpg}"' in r.stdout, r.stdout  # the lines to paste name it
    r = diode("keys", "import", "--home", str(black_home), "--gpg-binary", gpg, str(pub))
    assert r.returncode == 0 and "imported 1 public key(s)" in r.stdout, r.stdout + r.stderr
    assert bench.decoyed() == []  # the case: nothing went through PATH's gpg
    calls = log.read_text()
    assert "gpg --version" in calls and "gen-key" in calls
    assert f"--homedir {black_home}" in calls and "--import" in calls
    r = diode("keys", "import", "--home", str(black_home), "--gpg-binary", "nope/gpg", str(pub))
    assert r.returncode == 2 and "--gpg-binary = 'nope/gpg': no such file" in r.stderr, r.stderr


def test_fixes_name_the_configured_gpg(bench: Bench) -> None:
    """A key missing from a home that a configured gpg uses: the fix named `diode keys import`
    without --gpg-binary and `gpg --homedir`, i.e. PATH's gpg, another GnuPG release."""
    gpg = bench.install("side", bench.root / "side.log")
    home = bench.root / "kb"
    home.mkdir(mode=0o700)
    bench.homes.append((home, gpg))
    with pytest.raises(KeyMissingError) as e:
        Gpg(home, binary=gpg).require_keys(["A" * 40], purpose="recipients", capability="encrypt")
    assert f"`diode keys import --home {home} --gpg-binary {gpg} FILE.asc`" in str(e.value)
    with pytest.raises(KeyMissingError) as e:
        Gpg(home, binary=gpg).export_public("A" * 40)
    assert f"`{gpg} --homedir {home} --list-keys`" in str(e.value)
