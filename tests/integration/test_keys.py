"""Crypto: keys by side, public-key import, passphrases and permissions, with the real gpg."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.cli import cli
from bridge.config import Config, config_from_dict, load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import (
    SideKeys,
    decryption_gpg,
    import_public_keys,
    init_side,
    signing_gpg,
)
from bridge.crypto.passphrase import Passphrase
from bridge.errors import ConfigError, CryptoError

pytestmark = pytest.mark.gpg

SECRET = "Tr0ub4dor & 3 horses"
WRONG = "not the passphrase"


def _secret_fprs(home: Path) -> list[str]:
    """Secret keys of a home, listed by the plain gpg CLI (not the bridge)."""
    out = subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--with-colons", "--list-secret-keys"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    fprs, take = [], False
    for line in out.splitlines():
        f = line.split(":")
        if f[0] == "sec":
            take = True
        elif f[0] == "fpr" and take:
            fprs.append(f[9])
            take = False
    return fprs


def _modes(home: Path) -> set[tuple[str, int]]:
    return {
        ("d" if p.is_dir() else "f", p.stat().st_mode & 0o777)
        for p in [home, *home.rglob("*")]
        if p.is_dir() or p.is_file()
    }


def _pw_file(folder: Path, text: str = SECRET) -> Path:
    path = folder / "black.pass"
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _cfg(black: SideKeys, red: SideKeys, base: Path, **black_extra: object) -> Config:
    data = tomllib.loads(black.to_toml_snippet() + red.to_toml_snippet())
    data["black"].update(black_extra)
    return config_from_dict(data, base=base, environ={})


def _pair(
    root: Path, *, black_pp: Passphrase | None = None, red_pp: Passphrase | None = None
) -> tuple[SideKeys, SideKeys]:
    """A black host and a red host, set up the way the runbook says (public keys only cross)."""
    black = init_side("black", root / "bh" / "keys", bridge_id="t", passphrase=black_pp)
    red = init_side("red", root / "rh" / "keys", name="ops", bridge_id="t", passphrase=red_pp)
    import_public_keys(black.home, [red.public_file])
    import_public_keys(red.home, [black.public_file])
    return black, red


# ------------------------------------------------------------------------ keys by side


def test_each_side_holds_only_its_own_secret(short_tmp: Path) -> None:
    black, red = _pair(short_tmp)
    audit = init_side("red", red.home, name="audit", bridge_id="t")  # a 2nd red key, same host
    import_public_keys(black.home, [audit.public_file])
    assert _secret_fprs(black.home) == [black.fpr]  # no red secret on black
    assert sorted(_secret_fprs(red.home)) == sorted([red.fpr, audit.fpr])  # no black secret
    assert {red.fpr, audit.fpr} <= set(Gpg(black.home).fingerprints())
    assert black.fpr in Gpg(red.home).fingerprints()
    for home in (black.home, red.home):
        assert _modes(home) <= {("d", 0o700), ("f", 0o600)}, _modes(home)
    for pub in (black.public_file, red.public_file, audit.public_file):
        assert pub.stat().st_mode & 0o777 == 0o644
        assert b"PUBLIC KEY BLOCK" in pub.read_bytes() and b"PRIVATE" not in pub.read_bytes()
    assert black.public_file == short_tmp / "bh" / "pub" / "black.asc"
    # the printed lines are a working configuration: seal on black, open on red
    cfg = _cfg(black, red, short_tmp)
    assert cfg.link.black_signers == [black.fpr] and cfg.black.signing_key == black.fpr
    assert cfg.channels[0].recipients == [red.fpr]
    sealed = signing_gpg(cfg).seal_bytes(b"hi", signer=black.fpr, recipients=[red.fpr])
    assert decryption_gpg(cfg).open_bytes(sealed, pinned_signers=[black.fpr])[0] == b"hi"


def test_a_home_never_mixes_sides(short_tmp: Path) -> None:
    black, red = _pair(short_tmp)
    with pytest.raises(CryptoError, match=f"holds the red secret key {red.fpr}"):
        init_side("black", red.home)
    with pytest.raises(CryptoError, match=f"holds the black secret key {black.fpr}"):
        init_side("red", black.home, name="x")
    assert _secret_fprs(black.home) == [black.fpr]
    assert _secret_fprs(red.home) == [red.fpr]
    # a red secret smuggled into the black home stops black at startup
    exported = subprocess.run(
        ["gpg", "--homedir", str(red.home), "--batch", "--export-secret-keys", red.fpr],
        capture_output=True,
        check=True,
    ).stdout
    Gpg(black.home).import_keys(exported)
    with pytest.raises(CryptoError, match=f"{red.fpr} \\(a red key: can decrypt\\).*no red secret"):
        signing_gpg(_cfg(black, red, short_tmp))


def test_a_second_black_signing_key_is_refused_with_the_black_fix(short_tmp: Path) -> None:
    """An old black signing key left in the home after a rotation: refused, and the message
    says to keep it offline, not that it is red's."""
    black, red = _pair(short_tmp)
    old = init_side("black", short_tmp / "old" / "keys", bridge_id="t")
    exported = subprocess.run(
        ["gpg", "--homedir", str(old.home), "--batch", "--export-secret-keys", old.fpr],
        capture_output=True,
        check=True,
    ).stdout
    Gpg(black.home).import_keys(exported)
    with pytest.raises(CryptoError) as err:
        signing_gpg(_cfg(black, red, short_tmp))
    text = str(err.value)
    assert f"{old.fpr} (not black.signing_key" in text and "second black signing key" in text
    assert "keep it offline" in text and "red secret" not in text, text


def test_init_refuses_to_overwrite_and_force_replaces_only_that_key(short_tmp: Path) -> None:
    black, red = _pair(short_tmp)
    audit = init_side("red", red.home, name="audit", bridge_id="t")
    with pytest.raises(CryptoError, match=f"refusing to overwrite.*{red.fpr}"):
        init_side("red", red.home, name="ops", bridge_id="t")
    with pytest.raises(CryptoError, match=f"refusing to overwrite.*{black.fpr}"):
        init_side("black", black.home, bridge_id="t")
    assert sorted(_secret_fprs(red.home)) == sorted([red.fpr, audit.fpr])
    new_ops = init_side("red", red.home, name="ops", bridge_id="t", force=True)
    assert sorted(_secret_fprs(red.home)) == sorted([new_ops.fpr, audit.fpr])  # audit kept
    new_black = init_side("black", black.home, bridge_id="t", force=True)
    assert _secret_fprs(black.home) == [new_black.fpr]
    assert red.fpr in Gpg(black.home).fingerprints()  # imported recipients stay


def test_bad_names_and_algos_create_nothing(short_tmp: Path) -> None:
    for name in ("Red", "../x", ""):
        with pytest.raises(CryptoError, match="red key name"):
            init_side("red", short_tmp / "h", name=name)
    with pytest.raises(CryptoError, match="unknown key algorithm"):
        init_side("black", short_tmp / "h", algo="dsa")  # type: ignore[arg-type]
    assert not (short_tmp / "h").exists()


# ------------------------------------------------------------------------ import


@pytest.mark.parametrize("armor", [True, False])
def test_import_refuses_secret_material_and_imports_nothing(short_tmp: Path, armor: bool) -> None:
    black, red = _pair(short_tmp)
    other = init_side("red", short_tmp / "elsewhere", name="other", bridge_id="t")
    leaked = short_tmp / "leak.asc"
    args = ["--armor"] if armor else []
    leaked.write_bytes(
        subprocess.run(
            ["gpg", "--homedir", str(red.home), "--batch", *args, "--export-secret-keys"],
            capture_output=True,
            check=True,
        ).stdout
    )
    before = Gpg(black.home).fingerprints()
    with pytest.raises(CryptoError, match="SECRET key material.*nothing was imported"):
        import_public_keys(black.home, [other.public_file, leaked])  # the good one first
    assert Gpg(black.home).fingerprints() == before
    assert other.fpr not in before
    assert _secret_fprs(black.home) == [black.fpr]


def test_import_reports_roles_and_refuses_garbage(short_tmp: Path) -> None:
    black, red = _pair(short_tmp)
    junk = short_tmp / "junk.asc"
    junk.write_bytes(b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\nnope\n")
    with pytest.raises(CryptoError, match="no OpenPGP public key"):
        import_public_keys(red.home, [junk])
    with pytest.raises(CryptoError, match="cannot read key file"):
        import_public_keys(red.home, [short_tmp / "absent.asc"])
    found = import_public_keys(red.home, [black.public_file, red.public_file])
    assert [(k.fpr, k.role) for k in found] == [(black.fpr, "signer"), (red.fpr, "recipient")]
    assert found[0].uids == ("t black signer",)


# ------------------------------------------------------------------------ passphrases


def test_protected_signing_key_with_file_env_and_without(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    pw = _pw_file(short_tmp)
    black, red = _pair(short_tmp, black_pp=Passphrase(path=pw))
    assert "passphrase_file" in black.to_toml_snippet()
    probe = Gpg(black.home)
    assert probe.needs_passphrase(black.fpr, capability="sign")
    # from the file
    cfg = _cfg(black, red, short_tmp)
    assert cfg.black.passphrase_file == pw
    gpg = signing_gpg(cfg)
    sealed = gpg.seal_bytes(b"x", signer=black.fpr, recipients=[red.fpr])
    assert decryption_gpg(cfg).open_bytes(sealed, pinned_signers=[black.fpr])[0] == b"x"
    # from the environment
    no_file = _cfg(black, red, short_tmp, passphrase_file=None)
    env = {"DIODE_BLACK_PASSPHRASE": SECRET}
    assert signing_gpg(no_file, environ=env).passphrase is not None
    named = _cfg(black, red, short_tmp, passphrase_file=None, passphrase_env="MY_PW")
    assert signing_gpg(named, environ={"MY_PW": SECRET}).passphrase is not None
    # without: fails fast, saying how to fix it, even though gpg-agent caches the passphrase
    probe.passphrase = Passphrase(path=pw)
    probe.seal_bytes(b"warm", signer=black.fpr, recipients=[], encrypt=False)  # cache it
    probe.passphrase = None
    cached = [ln for ln in probe._agent("KEYINFO --list") if ln.split()[6:7] == ["1"]]
    assert cached, "the agent should cache the passphrase here: the case under test"
    with pytest.raises(CryptoError, match="passphrase-protected.*black.passphrase_file") as info:
        signing_gpg(no_file, environ={})
    assert "DIODE_BLACK_PASSPHRASE" in str(info.value)
    # a wrong one fails too (the cached right one must not hide it)
    probe.seal_bytes(b"warm", signer=black.fpr, recipients=[], encrypt=False)  # cache is warm
    with pytest.raises(CryptoError, match="does not unlock the key") as wrong:
        signing_gpg(no_file, environ={"DIODE_BLACK_PASSPHRASE": WRONG})
    with pytest.raises(ConfigError, match="AND the environment variable"):
        signing_gpg(cfg, environ=env)  # file and env at once: ambiguous
    for text in (str(info.value), str(wrong.value), caplog.text):
        assert SECRET not in text and WRONG not in text


@pytest.fixture
def red_locked(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SideKeys, SideKeys]:
    monkeypatch.setenv("RED_PW_AT_INIT", SECRET)
    black, red = _pair(short_tmp, red_pp=Passphrase(env_name="RED_PW_AT_INIT"))
    monkeypatch.delenv("RED_PW_AT_INIT")
    return black, red


def test_protected_red_key_opens_only_with_its_passphrase(
    short_tmp: Path, red_locked: tuple[SideKeys, SideKeys]
) -> None:
    black, red = red_locked
    assert 'passphrase_env = "RED_PW_AT_INIT"' in red.to_toml_snippet()
    assert Gpg(red.home).needs_passphrase(red.fpr, capability="encrypt")
    cfg = _cfg(black, red, short_tmp)
    sealed = signing_gpg(cfg).seal_bytes(b"y", signer=black.fpr, recipients=[red.fpr])
    assert cfg.red.passphrase_env == "RED_PW_AT_INIT"  # the snippet names the variable
    opened = decryption_gpg(cfg, environ={"RED_PW_AT_INIT": SECRET})
    assert opened.open_bytes(sealed, pinned_signers=[black.fpr])[0] == b"y"
    with pytest.raises(CryptoError, match="passphrase-protected.*red.passphrase_file"):
        decryption_gpg(cfg, environ={})
    with pytest.raises(CryptoError, match="does not unlock"):
        decryption_gpg(cfg, environ={"RED_PW_AT_INIT": WRONG})
    default_env = cfg.model_copy(
        update={"red": cfg.red.model_copy(update={"passphrase_env": "DIODE_RED_PASSPHRASE"})}
    )
    assert decryption_gpg(default_env, environ={"DIODE_RED_PASSPHRASE": SECRET}).passphrase


def _wrapper(bin_dir: Path, log: Path) -> Path:
    """A gpg that records its argv and environment, then runs the real gpg."""
    bin_dir.mkdir()
    real = subprocess.run(["sh", "-c", "command -v gpg"], capture_output=True, text=True)
    agent = subprocess.run(
        ["sh", "-c", "command -v gpg-connect-agent"], capture_output=True, text=True
    )
    (bin_dir / "gpg-connect-agent").symlink_to(agent.stdout.strip())
    script = bin_dir / "gpg"
    script.write_text(
        "#!/bin/sh\n"
        f'tr "\\0" "\\n" < /proc/$$/cmdline >> "{log}"\n'
        f'tr "\\0" "\\n" < /proc/$$/environ >> "{log}"\n'
        f'echo "--- end of call" >> "{log}"\n'
        f'exec "{real.stdout.strip()}" "$@"\n'
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("source", ["file", "env"])
def test_passphrase_never_on_argv_nor_in_gpg_environment(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    pw = _pw_file(short_tmp)
    black, red = _pair(short_tmp, black_pp=Passphrase(path=pw))
    log = short_tmp / "calls.log"
    binary = _wrapper(short_tmp / "bin", log)
    if source == "env":
        monkeypatch.setenv("DIODE_BLACK_PASSPHRASE", SECRET)
        pp = Passphrase(env_name="DIODE_BLACK_PASSPHRASE")
    else:
        pp = Passphrase(path=pw)
    gpg = Gpg(black.home, binary=str(binary), passphrase=pp)
    gpg.check_unlock(black.fpr, capability="sign", purpose="test")
    src = short_tmp / "plain"
    src.write_bytes(os.urandom(5000))
    gpg.seal(src, short_tmp / "x.dbundle", signer=black.fpr, recipients=[red.fpr])
    gpg.seal_bytes(b"hb", signer=black.fpr, recipients=[red.fpr])
    calls = log.read_text(errors="replace")
    assert calls.count("--- end of call") >= 3
    assert calls.count("--passphrase-fd") >= 3  # the passphrase did reach gpg, by pipe
    assert SECRET not in calls
    assert "--passphrase\n" not in calls and "--passphrase-file" not in calls
    assert "DIODE_BLACK_PASSPHRASE=" not in calls  # not even the variable's name is passed on
    red_gpg = Gpg(red.home)
    sealed = (short_tmp / "x.dbundle").read_bytes()
    plain, _ = red_gpg.open_bytes(sealed, pinned_signers=[black.fpr])
    assert plain == src.read_bytes()


# ------------------------------------------------------------------------ the CLI


def _hex_tokens(text: str) -> list[str]:
    return re.findall(r"\b[0-9A-F]{16,}\b", text)


def test_cli_flow_prints_fingerprints_and_checks_permissions(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = CliRunner()
    monkeypatch.chdir(short_tmp)
    r_black = runner.invoke(cli, ["keys", "init", "--side", "black", "--home", "bh/keys"])
    assert r_black.exit_code == 0, r_black.output
    r_red = runner.invoke(
        cli, ["keys", "init", "--side", "red", "--name", "ops", "--home", "rh/keys"]
    )
    assert r_red.exit_code == 0, r_red.output
    r_imp_b = runner.invoke(cli, ["keys", "import", "--home", "bh/keys", "rh/pub/ops.asc"])
    r_imp_r = runner.invoke(cli, ["keys", "import", "--home", "rh/keys", "bh/pub/black.asc"])
    assert r_imp_b.exit_code == 0 and r_imp_r.exit_code == 0, r_imp_b.output + r_imp_r.output
    outputs = r_black.output + r_red.output + r_imp_b.output + r_imp_r.output
    assert all(len(t) == 40 for t in _hex_tokens(outputs))  # fingerprints, never key ids
    assert _secret_fprs(short_tmp / "bh" / "keys") == _hex_tokens(r_black.output)[:1]
    snippet = r_black.output.split("# paste into your diode TOML:\n")[1]
    snippet += r_red.output.split("# paste into your diode TOML:\n")[1]
    cfg_path = short_tmp / "diode.toml"
    cfg_path.write_text(
        snippet.replace("[black]\n", '[black]\namqp_url = "amqp://u:S3cret@127.0.0.1/v"\n')
    )
    cfg_path.chmod(0o644)
    loose = runner.invoke(cli, ["keys", "check", "--side", "black", "--config", str(cfg_path)])
    assert loose.exit_code == 1
    assert "black.amqp_url" in loose.output and "chmod 600" in loose.output
    assert "S3cret" not in loose.output
    cfg_path.chmod(0o600)
    for side in ("black", "red"):
        ok = runner.invoke(cli, ["keys", "check", "--side", side, "--config", str(cfg_path)])
        assert ok.exit_code == 0, ok.output
        assert "no passphrase" in ok.output
    (short_tmp / "bh" / "keys").chmod(0o755)
    home = runner.invoke(cli, ["keys", "check", "--side", "black", "--config", str(cfg_path)])
    assert home.exit_code == 1 and "chmod 700" in home.output
    assert load_config(cfg_path, environ={}).black.signing_key in r_black.output
    # red's directories are checked on red, like black's on black
    work = short_tmp / "red" / "work"
    work.mkdir(parents=True)
    work.chmod(0o777)
    red = runner.invoke(cli, ["keys", "check", "--side", "red", "--config", str(cfg_path)])
    assert red.exit_code == 1, red.output
    assert f"red.work_dir {work} is writable by group and others" in red.output
    assert f"`chmod go-w {work}`" in red.output


def test_cli_init_with_passphrase_file(short_tmp: Path) -> None:
    pw = _pw_file(short_tmp)
    runner = CliRunner()
    home = short_tmp / "bh"
    loose = short_tmp / "loose.pass"
    loose.write_text(SECRET)
    loose.chmod(0o644)
    bad = runner.invoke(
        cli,
        ["keys", "init", "--side", "black", "--home", str(home), "--passphrase-file", str(loose)],
    )
    assert bad.exit_code == 2 and "chmod 600" in bad.output and not home.exists()
    r = runner.invoke(
        cli, ["keys", "init", "--side", "black", "--home", str(home), "--passphrase-file", str(pw)]
    )
    assert r.exit_code == 0, r.output
    assert f'passphrase_file = "{pw}"' in r.output and SECRET not in r.output
    fpr = _secret_fprs(home)[0]
    assert Gpg(home).needs_passphrase(fpr, capability="sign")


# ------------------------------------------------------------------------ revoked keys' sides


def _revoke(owner: Path, fpr: str, *, into: Path) -> None:
    """Import into ``into`` the revocation certificate gpg made for ``fpr`` in ``owner``."""
    cert = (owner / "openpgp-revocs.d" / f"{fpr}.rev").read_text()
    armored = cert.replace(":-----BEGIN PGP PUBLIC KEY BLOCK", "-----BEGIN PGP PUBLIC KEY BLOCK")
    Gpg(into).import_keys(armored)


def _caps(home: Path, fpr: str) -> str:
    """gpg's capability letters of a key's primary (plain gpg CLI)."""
    out = subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--with-colons", "--list-keys", fpr],
        capture_output=True,
        check=True,
    ).stdout.decode()
    return next(ln.split(":")[11] for ln in out.splitlines() if ln.startswith("pub:"))


def test_a_revoked_red_secret_on_black_is_still_refused(short_tmp: Path) -> None:
    black, red = _pair(short_tmp)
    leaked = subprocess.run(
        ["gpg", "--homedir", str(red.home), "--batch", "--export-secret-keys", red.fpr],
        capture_output=True,
        check=True,
    ).stdout
    Gpg(black.home).import_keys(leaked)
    _revoke(red.home, red.fpr, into=black.home)
    assert "e" not in _caps(black.home, red.fpr).lower()  # gpg shows no usable `E` any more
    with pytest.raises(CryptoError, match=f"{red.fpr} \\(a red key, revoked or expired\\)"):
        signing_gpg(_cfg(black, red, short_tmp))
    with pytest.raises(CryptoError, match=f"holds the red secret key {red.fpr}"):
        init_side("black", black.home, bridge_id="t", force=True)  # never "replaced" as black's
    assert sorted(_secret_fprs(black.home)) == sorted([black.fpr, red.fpr])


def test_a_revoked_black_secret_on_red_is_still_black(short_tmp: Path) -> None:
    black = init_side("black", short_tmp / "bh" / "keys", bridge_id="t")
    _revoke(black.home, black.fpr, into=black.home)
    assert _caps(black.home, black.fpr) == "sc"  # no usable `S` any more
    with pytest.raises(CryptoError, match=f"holds the black secret key {black.fpr}"):
        init_side("red", black.home, name="ops", bridge_id="t")
    assert _secret_fprs(black.home) == [black.fpr]


# ------------------------------------------------------------------------ gpg-agent after a command


def _agent_pid(home: Path) -> int | None:
    """The pid of the gpg-agent serving ``home``, asked without starting one."""
    out = subprocess.run(
        ["gpg-connect-agent", "--homedir", str(home), "--no-autostart", "GETINFO pid", "/bye"],
        capture_output=True,
        check=False,
    ).stdout.decode()
    pids = [int(ln[2:]) for ln in out.splitlines() if ln.startswith("D ")]
    return pids[0] if pids else None


def _agent_gone(home: Path) -> bool:
    for _ in range(50):  # gpgconf --kill returns before the agent has exited
        if _agent_pid(home) is None:
            return True
        time.sleep(0.1)
    return False


def test_one_shot_key_commands_stop_the_agents_they_started(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pw = _pw_file(short_tmp)
    black, red = _pair(short_tmp, black_pp=Passphrase(path=pw))  # init and import, twice each
    assert _agent_gone(black.home) and _agent_gone(red.home)
    cfg = _cfg(black, red, short_tmp)
    signing_gpg(cfg, one_shot=True)
    decryption_gpg(cfg, one_shot=True)
    assert _agent_gone(black.home) and _agent_gone(red.home)
    # an agent that was running before (a job's) is never stopped
    subprocess.run(["gpg-connect-agent", "--homedir", str(black.home), "/bye"], check=True)
    running = _agent_pid(black.home)
    assert running is not None
    import_public_keys(black.home, [red.public_file])
    signing_gpg(cfg, one_shot=True)
    signing_gpg(cfg)  # the black job's own start: leaves the agent alone
    assert _agent_pid(black.home) == running


def test_diode_check_stops_the_agent_it_started(short_tmp: Path) -> None:
    """`diode check` (check_black_config with one_shot) leaves no gpg-agent behind, with the
    passphrase it cached; the black job's start (one_shot off) keeps its agent."""
    from bridge.black.job import check_black_config

    pw = _pw_file(short_tmp)
    black, red = _pair(short_tmp, black_pp=Passphrase(path=pw))
    assert _agent_gone(black.home)
    toml = short_tmp / "diode.toml"
    paths = "".join(
        f'{k} = "{short_tmp / k}"\n' for k in ("outbox", "archive", "state_dir", "spool_dir")
    )
    text = (black.to_toml_snippet() + red.to_toml_snippet()).replace(
        "[black]\n", "[black]\n" + paths, 1
    )
    toml.write_text(text)
    toml.chmod(0o600)
    assert tomllib.loads(text)["black"]["outbox"] == str(short_tmp / "outbox")
    cfg = load_config(toml, environ={})
    check_black_config(cfg, one_shot=True)
    assert _agent_gone(black.home)
    check_black_config(cfg)  # the job's start
    assert _agent_pid(black.home) is not None
    subprocess.run(["gpgconf", "--homedir", str(black.home), "--kill", "all"], check=False)


def _cached(home: Path) -> list[str]:
    """Keygrips whose passphrase gpg-agent of ``home`` caches now."""
    return [ln.split()[2] for ln in Gpg(home)._agent("KEYINFO --list") if ln.split()[6:7] == ["1"]]


def test_a_key_check_leaves_no_passphrase_in_the_agent(
    short_tmp: Path, red_locked: tuple[SideKeys, SideKeys]
) -> None:
    black, red = red_locked
    pw = _pw_file(short_tmp)
    cfg = _cfg(black, red, short_tmp)
    gpg = decryption_gpg(cfg, environ={"RED_PW_AT_INIT": SECRET})  # the red job's start
    assert _cached(red.home) == []  # the test decryption unlocked it: forgotten again
    sealed = signing_gpg(cfg).seal_bytes(b"z", signer=black.fpr, recipients=[red.fpr])
    assert gpg.open_bytes(sealed, pinned_signers=[black.fpr])[0] == b"z"  # still opens
    locked_black = init_side("black", short_tmp / "b2" / "keys", passphrase=Passphrase(path=pw))
    import_public_keys(locked_black.home, [red.public_file])  # the channel's recipient
    cfg2 = _cfg(locked_black, red, short_tmp)
    signing_gpg(cfg2)
    assert _cached(locked_black.home) == []


# ------------------------------------------------------------------------ fix-it messages


def test_bad_homes_and_pub_dirs_are_named_with_the_fix(short_tmp: Path) -> None:
    (short_tmp / "afile").write_text("x")
    with pytest.raises(ConfigError, match=f"--pub-dir.*{short_tmp / 'afile'}, which is a file"):
        init_side("black", short_tmp / "bh", pub_dir=short_tmp / "afile" / "x")
    assert not (short_tmp / "bh").exists()  # checked before any key is made
    dangling = short_tmp / "rh"
    dangling.symlink_to(short_tmp / "gone")
    with pytest.raises(CryptoError, match=f"{dangling} is a symlink to .*gone, which does not"):
        init_side("red", dangling, name="ops")
    assert dangling.is_symlink() and not (short_tmp / "gone").exists()
    black = init_side("black", short_tmp / "b" / "keys", bridge_id="t")
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (black.home / "extra.d").symlink_to(elsewhere, target_is_directory=True)
    red = init_side("red", short_tmp / "r" / "keys", name="ops", bridge_id="t")
    import_public_keys(black.home, [red.public_file])  # locks the home down: the link is left
    assert (black.home / "extra.d").is_symlink()
