"""UDP sender (black) on real sockets and real disks that refuse: a full or immutable
udp.send.state_dir stops neither the sender nor its heartbeats, the journal's records are
retried and never lost or torn (no file skipped, none repeated but those in flight), a
compaction keeps the records of files still in the outbox, and sent files the sender may not
delete are left, logged once and never sent again."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from bridge.cli import cli
from bridge.diode.udp_sender import JOURNAL, SendSummary, envelope_prefix, run_sender
from bridge.errors import ConfigError
from bridge.metrics import REGISTRY
from bridge.protocol.datagram import Symbol
from tests.integration.test_udp_send import ID, Env, bundle
from tests.integration.test_udp_send import env as env  # noqa: F401 - the sender fixture
from tests.support import small_tmpfs
from tests.unit.test_black_dirs import refused_dir

LOGGER = "bridge.diode.udp_sender"
COMPACT_AT = 4 << 20  # the journal's compaction size


def fill(fs: Path) -> Path:
    """Write into ``fs`` until it refuses another byte (ENOSPC, for real); returns the filler.
    Called again, tops it up (what a write in progress freed meanwhile)."""
    filler = fs / "filler"
    with filler.open("ab", buffering=0) as f:
        for size in (1 << 16, 1):
            chunk = b"\0" * size
            try:
                while True:
                    f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return filler


def fill_journal_page(path: Path, slack: int = 0) -> None:
    """Append a record of a name no outbox file has, leaving ``slack`` bytes in the journal's
    last page: a tmpfs gives out whole pages, so that page takes appends even once the disk is
    full (as a real disk's last block would): the next record then fails whole, or half
    written (``slack`` less than a record)."""
    empty = '{"name": ".pad", "pad": ""}\n'
    room = (-slack - path.stat().st_size) % 4096
    room += 4096 if room < len(empty) else 0
    with path.open("a") as f:
        f.write(empty.replace('""', '"' + "x" * (room - len(empty)) + '"'))
    assert -path.stat().st_size % 4096 == slack


def wait_for(what: Callable[[], object], th: threading.Thread, timeout: float = 15) -> None:
    """Until ``what()`` is true, the sender's thread alive all along."""
    deadline = time.monotonic() + timeout
    while not what():
        assert th.is_alive(), "the sender died"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@contextmanager
def sending(cfg: Any) -> Iterator[tuple[threading.Thread, threading.Event, list[SendSummary]]]:
    """``run_sender`` in a thread until stopped: by the test, else when the block ends (before
    its disk goes away, whether the test passed or not)."""
    stop, result = threading.Event(), []
    th = threading.Thread(target=lambda: result.append(run_sender(cfg, stop=stop)), daemon=True)
    th.start()
    try:
        yield th, stop, result
    finally:
        stop.set()
        th.join(timeout=10)


def logged(caplog: pytest.LogCaptureFixture, start: str) -> int:
    return sum(r.getMessage().startswith(start) for r in caplog.records)


def records(path: Path) -> list[tuple[str, str]]:
    """(name, state) of every journal record, in order (the pad left out)."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["name"], r["state"]) for r in recs if r["name"] != ".pad"]


def test_a_full_state_dir_stops_neither_the_sender_nor_its_heartbeats(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The status file is refused (logged once, not each second); a file dropped meanwhile does
    not start without its "sending" record, tried again each second; once there is room again
    it goes, whole, once."""
    name, body = bundle("u1", 1), b"dropped while the disk was full" * 1000
    metric = "bridge_udp_sender_state_errors_total"
    before = {w: REGISTRY.get_sample_value(metric, {"what": w}) or 0 for w in ("journal", "status")}
    with small_tmpfs("1m", "udpst") as fs, caplog.at_level("INFO", logger=LOGGER):
        state = fs / "udp-send"
        cfg = env.cfg(state_dir=str(state), heartbeat_seconds=0.05, settle_seconds=0)
        with sending(cfg) as (th, _, result):
            wait_for((state / "status.json").exists, th)
            filler = fill(fs)
            full = time.monotonic()
            time.sleep(0.05)
            fill(fs)
            (env.outbox / name).write_bytes(body)  # the outbox has room: the state dir has none
            time.sleep(2.5)  # two status writes and two journal tries at least
            assert th.is_alive(), "the sender died of its full state dir"
            assert (env.outbox / name).exists()
            assert logged(caplog, "udp sender status file not written") == 1
            assert logged(caplog, "udp sender journal record not written") == 1
            freed = time.monotonic()
            filler.unlink()
            wait_for(lambda: not (env.outbox / name).exists(), th)
            assert records(state / JOURNAL) == [(name, "sending"), (name, "sent")]
            wait_for(lambda: logged(caplog, "udp sender state written again") == 2, th)
    (summary,) = result
    assert summary.files == [name] and summary.state_errors >= 4 and summary.unjournaled == 0
    for what, was in before.items():  # the metric an operator alarms on counts them too
        assert (REGISTRY.get_sample_value(metric, {"what": what}) or 0) >= was + 2, what
    heard = env.listener.quiet()
    assert heard.files() == {name: body}
    assert all(t > freed for t, d in heard.items if isinstance(d, Symbol))
    beats = [t for t, _ in heard.heartbeats() if full < t < freed]
    assert len(beats) >= (freed - full) / 0.05 * 0.5, len(beats)  # kept coming while full
    assert max(b - a for a, b in zip(beats, beats[1:], strict=False)) < 0.5


@pytest.mark.parametrize(("stop_while_full", "slack"), [(False, 0), (True, 0), (False, 60)])
def test_a_sent_record_the_full_disk_refuses_keeps_the_file_until_it_is_written(
    env: Env, caplog: pytest.LogCaptureFixture, stop_while_full: bool, slack: int
) -> None:
    """The disk fills while a file is sent: its "sent" record is refused, so the file stays in
    the outbox, taken by no scan (never resent), until the record is written; then it is
    removed. A record the disk cut short (``slack``) is cut off before it is written again,
    whole. A sender stopped before that leaves the file there, journaled "sending" only: the
    next start sends it again, whole, under a new epoch (it was in flight)."""
    name, body = bundle("u1", 1), bytes(range(256)) * 1600
    (env.outbox / name).write_bytes(body)
    with small_tmpfs("1m", "udpsn") as fs, caplog.at_level("INFO", logger=LOGGER):
        state = fs / "udp-send"
        cfg = env.cfg(state_dir=str(state), rate_bytes_per_second=400_000,
                      interleave_datagrams=32, heartbeat_seconds=0.05)  # fmt: skip
        with sending(cfg) as (th, stop, result):
            wait_for(lambda: (state / JOURNAL).exists() and (state / JOURNAL).stat().st_size, th)
            fill_journal_page(state / JOURNAL, slack)
            filler = fill(fs)
            time.sleep(0.05)
            fill(fs)
            wait_for(lambda: logged(caplog, "udp sender journal record not written"), th, 30)
            time.sleep(1.3)  # a try again, refused again; scans meanwhile
            assert th.is_alive() and (env.outbox / name).exists()
            assert (state / JOURNAL).stat().st_size % 4096 == 0  # the slack took part of one
            if stop_while_full:
                stop.set()
                th.join(timeout=10)
            filler.unlink()
            if not stop_while_full:
                wait_for(lambda: not (env.outbox / name).exists(), th)
        (first,) = result
        assert first.files == [name]  # on the wire, whole
        if stop_while_full:
            assert first.unjournaled == 1 and (env.outbox / name).exists()
            assert records(state / JOURNAL) == [(name, "sending")]
            assert logged(caplog, "udp sender stopped with files sent whose sent record") == 1
            second = run_sender(cfg, until_idle=True, timeout=30)
            assert second.files == [name] and second.epoch > first.epoch
            assert records(state / JOURNAL) == [
                (name, "sending"),
                (name, "sending"),
                (name, "sent"),
            ]
        else:
            assert first.unjournaled == 0 and first.state_errors >= 2
            assert records(state / JOURNAL) == [(name, "sending"), (name, "sent")]
            # a record of its own cut short is cut off quietly (the refusal was logged)
            assert not logged(caplog, "sender journal ended in a torn record")
    assert not (env.outbox / name).exists()
    heard = env.listener.quiet()
    assert heard.files() == {name: body}
    sent = {(s.epoch, s.obj.object_id) for s in heard.symbols()}
    assert len(sent) == (2 if stop_while_full else 1)  # never resent within a run


def journal_of(path: Path, size: int, *extra: dict[str, Any]) -> None:
    """A journal of records of names no outbox file has, ``size`` bytes or just under, then
    ``extra``."""
    lines, total, i = [], 0, 0
    while True:
        line = json.dumps({"name": f"u9.{i:012d}.{ID}.dbundle", "state": "sent"}) + "\n"
        if total + len(line) > size:
            break
        lines.append(line)
        total, i = total + len(line), i + 1
    lines += [json.dumps(r) + "\n" for r in extra]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))


def test_a_state_dir_refusing_new_files_leaves_the_journal_whole_and_compacts_it_later(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """An immutable state dir (EPERM: no file can be made there, the journal is still appended
    to): the status file and the compaction the journal is due are refused, logged once each;
    the sender goes on sending. Once the dir takes files again the journal is compacted, and
    later records go into the compacted file."""
    journal_of(env.state / JOURNAL, COMPACT_AT - 100)  # a file's records cross the size
    a, b = bundle("u1", 1), bundle("u1", 2)
    with (
        caplog.at_level("INFO", logger=LOGGER),
        sending(env.cfg(heartbeat_seconds=0.05, settle_seconds=0)) as (th, _, result),
    ):
        wait_for((env.state / "status.json").exists, th)
        with refused_dir(env.state):
            (env.outbox / a).write_bytes(b"sent while the state dir refused new files")
            wait_for(lambda: not (env.outbox / a).exists(), th)
            time.sleep(2.2)  # status files and compactions refused, tried again
            assert th.is_alive(), "the sender died of its refused state dir"
            assert logged(caplog, "udp sender journal not compacted") == 1
            assert logged(caplog, "udp sender status file not written") == 1
            assert (env.state / JOURNAL).stat().st_size >= COMPACT_AT
            assert records(env.state / JOURNAL)[-2:] == [(a, "sending"), (a, "sent")]
        wait_for(lambda: (env.state / JOURNAL).stat().st_size < COMPACT_AT, th)
        (env.outbox / b).write_bytes(b"sent after the compaction")
        wait_for(lambda: not (env.outbox / b).exists(), th)
    assert result[0].files == [a, b]
    assert records(env.state / JOURNAL) == [(b, "sending"), (b, "sent")]
    assert not list(env.state.glob(f".{JOURNAL}.*.tmp"))  # no compaction left a copy behind
    assert env.listener.quiet().files() == {a: b"sent while the state dir refused new files",
                                            b: b"sent after the compaction"}  # fmt: skip


def test_a_compaction_at_start_keeps_the_sent_record_of_a_file_still_in_the_outbox(
    env: Env,
) -> None:
    """Killed between a file's "sent" record and its removal, with the journal due for
    compaction: the restart's first compaction (before its first scan) keeps that record, so
    the file is removed unsent, not sent again."""
    name, body = bundle("u1", 1), b"sent before the crash"
    path = env.outbox / name
    path.write_bytes(body)
    st = path.stat()
    digest = hashlib.sha256(envelope_prefix(name) + body).hexdigest()
    sent = {"name": name, "state": "sent", "digest": digest, "ino": st.st_ino,
            "mtime_ns": st.st_mtime_ns, "size": len(body), "epoch": 1, "object_id": 0}  # fmt: skip
    journal_of(env.state / JOURNAL, COMPACT_AT + 1000, sent)
    summary = run_sender(env.cfg(settle_seconds=0), until_idle=True, timeout=30)
    assert summary.already_sent == 1 and summary.files_sent == 0
    assert not path.exists()
    assert (env.state / JOURNAL).stat().st_size < COMPACT_AT  # compacted all the same
    assert not env.listener.quiet().symbols()


@contextmanager
def cli_logging() -> Iterator[None]:
    """The CLI sets up the bridge's logging for its process: put back what the tests had."""
    log = logging.getLogger("bridge")
    handlers, level, propagate = log.handlers[:], log.level, log.propagate
    try:
        yield
    finally:
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    """``data`` (tables of scalars, and ``channels``) as a TOML file."""
    lines: list[str] = []
    for ch in data["channels"]:
        lines += ["[[channels]]", *(f"{k} = {json.dumps(v)}" for k, v in ch.items())]

    def table(name: str, d: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in d.items() if not isinstance(v, dict))
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    for key in ("black", "udp"):
        table(key, data[key])
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sent_files_the_sender_may_not_delete_are_left_logged_once_and_never_sent_again(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """An immutable outbox (files cannot be removed, even by root): both files go, the run
    ends well (exit 0), each is logged once with the fix; a second run sends nothing, however
    many scans; once the outbox lets files go, the next run removes them, unsent."""
    files = {bundle("u1", 1): b"first" * 3000, bundle("u2", 2): b"second" * 5000}
    for n, body in files.items():
        (env.outbox / n).write_bytes(body)
    toml = write_toml(env.tmp / "diode.toml", env.data(settle_seconds=0))
    with refused_dir(env.outbox) as why:
        with cli_logging():
            r = CliRunner().invoke(cli, ["--log-format", "json", "udp", "send", "--config",
                                         str(toml), "--until-idle", "--timeout", "30"])  # fmt: skip
        assert r.exit_code == 0, (r.output, r.exception)
        first = json.loads(r.stdout.strip().splitlines()[-1])
        assert first["files"] == 2 and first["undeletable"] == 2, first
        assert r.stderr.count("sent file not removed from the outbox") == 2, r.stderr
        assert "lsattr -d" in r.stderr and why in r.stderr
        assert env.listener.quiet().files() == files
        before = len(env.listener.raw)
        with caplog.at_level("INFO", logger=LOGGER):
            second = run_sender(env.cfg(settle_seconds=0), timeout=1.0)  # ~20 scans
        assert second.files_sent == 0 and second.already_sent == 2 and second.undeletable == 2
        assert logged(caplog, "sent file not removed from the outbox") == 2
        assert sorted(p.name for p in env.outbox.iterdir()) == sorted(files)
    new = [env.listener.codec.open(d) for _, d in env.listener.raw[before:]]
    assert not [d for d in new if isinstance(d, Symbol)]  # nothing sent again
    third = run_sender(env.cfg(settle_seconds=0), until_idle=True, timeout=30)
    assert third.already_sent == 2 and third.files_sent == 0 and third.undeletable == 0
    assert not list(env.outbox.iterdir())


def test_a_state_dir_refusing_files_at_start_is_a_config_error_with_the_fix(env: Env) -> None:
    """Immutable from the start: the sender died with a raw PermissionError from its lock or
    first journal record (exit 1, a traceback). A ConfigError (exit 2) names the key, the
    attribute and the fix."""
    env.state.mkdir(parents=True, exist_ok=True)
    with refused_dir(env.state), pytest.raises(ConfigError) as e:
        run_sender(env.cfg(settle_seconds=0), until_idle=True, timeout=10)
    msg = str(e.value)
    assert f"udp.send.state_dir {env.state} refuses the sender's files" in msg, msg
    assert "chattr -i -a" in msg and "point it elsewhere" in msg, msg
