"""Black, supervision: the tap supervisor, the mirror loop and the spool's release survive the
faults a reviewer found (an unreadable tap status file, a fork or pipe the system refuses, a
state_dir that refuses the catalog, a full disk under it, a shipped segment that cannot be
deleted) — each either goes on or stops the job saying why, never a silent dead thread."""

from __future__ import annotations

import errno
import os
import resource
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge.black.mirror import Mirror, MirrorLoop
from bridge.black.spool import SpoolWriter, segment_name
from bridge.black.spool_read import SpoolReader, list_segments
from bridge.black.state import ChannelState, StateStore
from bridge.black.tap import tap_status
from bridge.black.taps import TapSupervisor
from bridge.config import Config
from bridge.errors import ConfigError, DiodeError, StateError
from tests.conftest import Vhost
from tests.integration.test_mirror import make_cfg
from tests.integration.test_tap import _fill, messages, publish_raw, setup_mirror, write_config
from tests.integration.test_tap_files_broker import immutable
from tests.support import captured_logs, small_tmpfs, wait_for
from tests.unit.test_black_dirs import refused_dir

pytestmark = [pytest.mark.broker]


def _durable_end(cfg: Config) -> int:
    return SpoolReader(Path(cfg.black.spool_dir), "main").durable_end()


@contextmanager
def _supervised(cfg: Config) -> Iterator[TapSupervisor]:
    """A started TapSupervisor whose tap of channel main is up, stopped afterwards."""
    sup = TapSupervisor(cfg).start()
    try:
        wait_for(lambda: sup.pids().get("main"), 10, "the tap started")
        yield sup
    finally:
        sup.stop()


def _restarted(sup: TapSupervisor, old: int) -> int:
    """The pid of channel main's tap once the supervisor restarted it (not ``old``)."""
    return int(
        wait_for(lambda: (p := sup.pids().get("main")) != old and p, 20, "the tap restarted")
    )


def _said(logs: list[Any], text: str) -> list[str]:
    return [m for r in logs if text in (m := r.getMessage())]


@contextmanager
def _no_new_fds() -> Iterator[None]:
    """This process cannot open one file descriptor more (RLIMIT_NOFILE lowered to 3): the
    supervisor's pipe for a tap's reason fails with a real EMFILE, as in a job that leaked
    descriptors. Restored afterwards."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            pytest.skip(f"fd {fd} is closed: lowering RLIMIT_NOFILE to 3 would not refuse it")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
    try:
        with pytest.raises(OSError) as e:  # the fault is real
            os.close(os.open(os.devnull, os.O_RDONLY))
        assert e.value.errno == errno.EMFILE
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------------------ the tap supervisor


def test_an_unreadable_tap_status_file_stops_the_job_naming_it_never_silently(
    black_vhost: Vhost, tmp_path: Path
) -> None:
    """tap-main.json becomes a directory (or another owner's file, or EIO). The supervisor's
    thread died on the OSError reading it for the metrics and no tap was ever restarted while
    the job ran on with ``sup.error`` None. The supervisor warns once a minute and goes on; the
    restarted tap, which reads the file to tell whether its spool was lost, refuses to guess:
    the job stops with a ConfigError naming the file and the fix (going on could have hidden
    acked messages a lost spool took)."""
    url = black_vhost.amqp_url
    cfg = write_config(tmp_path, url, group_messages=1, group_seconds=0.1)
    setup_mirror(cfg, url)
    status = Path(cfg.black.state_dir) / "tap-main.json"
    with captured_logs("bridge.black.tap") as logs, _supervised(cfg) as sup:
        publish_raw(url, messages(1))
        wait_for(lambda: _durable_end(cfg) == 1, 20, "the tap spooled a message")
        wait_for(status.is_file, 10, "the tap's status file")
        status.unlink()
        status.mkdir()  # the fault
        pid = sup.pids()["main"]
        os.kill(pid, signal.SIGKILL)
        err = wait_for(lambda: sup.error, 30, "the job told")
    assert isinstance(err, ConfigError), err
    assert f"tap status file {status} cannot be read" in str(err), err
    assert "remove the file and start black again" in str(err), err
    warned = _said(logs, f"tap status file {status} cannot be read")
    assert len(warned) <= 1, f"warned once a minute, not at every export: {warned}"


def test_a_tap_the_system_refuses_to_start_is_tried_again_then_stops_the_job(
    black_vhost: Vhost, tmp_path: Path
) -> None:
    """A tap died while the job could not make the pipe (or fork) a new one needs (EMFILE,
    EAGAIN, ENOMEM). The OSError ended the supervisor's thread: no tap was restarted, ever,
    and the job never knew. Now a refused start is logged and tried again with back-off: the
    tap is back once the system lets it; refused ``start_attempts`` times in a row, it stops
    the job (``sup.error``) saying what to check."""
    url = black_vhost.amqp_url
    cfg = write_config(tmp_path, url, group_messages=1, group_seconds=0.1)
    setup_mirror(cfg, url)
    with captured_logs("bridge.black.taps") as logs, _supervised(cfg) as sup:
        sup.start_attempts = 3
        pid = sup.pids()["main"]
        with _no_new_fds():
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: _said(logs, "tap could not be started"), 10, "a refused start")
        pid = _restarted(sup, pid)
        assert sup.error is None
        publish_raw(url, messages(1))
        wait_for(lambda: _durable_end(cfg) == 1, 20, "the restarted tap spooled a message")
        with _no_new_fds():
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: sup.error is not None, 15, "the job told")
    refused = _said(logs, "tap could not be started")
    assert "Too many open files (EMFILE); trying again" in refused[0], refused
    err = sup.error
    assert isinstance(err, DiodeError) and err.retryable and not isinstance(err, ConfigError)
    msg = str(err)
    assert "the tap of channel 'main' could not be started 3 times in a row: " in msg, msg
    assert "(EMFILE)" in msg and "`ulimit -n`" in msg and "wait in its mirror queue" in msg


def test_a_failing_supervisor_stops_the_job_instead_of_leaving_it_untapped(
    black_vhost: Vhost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever else ends the supervisor's loop (a bug: here reading why a tap stopped
    raises) is the job's error, not a thread that dies with a traceback nobody acts on."""
    url = black_vhost.amqp_url
    cfg = write_config(tmp_path, url)
    setup_mirror(cfg, url)

    def broken(fd: int) -> str | None:
        os.close(fd)
        raise RuntimeError("a bug")

    monkeypatch.setattr("bridge.black.taps.read_reason", broken)
    with _supervised(cfg) as sup:
        os.kill(sup.pids()["main"], signal.SIGKILL)
        wait_for(lambda: sup.error is not None, 10, "the job told")
    assert isinstance(sup.error, DiodeError) and sup.error.retryable
    assert "the tap supervisor failed (RuntimeError: a bug): no tap would be restarted" in str(
        sup.error
    )


# --------------------------------------------------------------------------- the mirror loop


@pytest.fixture
def declare(black_vhost: Vhost) -> Iterator[Callable[[str], None]]:
    """Declares a fanout exchange on the black vhost."""
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    ch = conn.channel()
    try:
        yield lambda name: ch.exchange_declare(name, "fanout", durable=True)
    finally:
        conn.close()


def _loop_ended(loop: MirrorLoop, timeout: float = 10) -> None:
    try:
        wait_for(lambda: not loop.alive, timeout, "the mirror loop stopped")
    finally:
        loop.stop()


def test_a_state_dir_refusing_the_catalog_stops_the_mirror_loop_naming_the_file_and_fix(
    black_vhost: Vhost, tmp_path: Path, declare: Callable[[str], None]
) -> None:
    """The catalog is written before any binding. A state_dir that refuses it (an immutable
    attribute, another owner, a read-only mount) made each sync fail with an OSError that
    the loop logged and retried for ever: new exchanges stayed unbound behind a running job.
    It is a ConfigError now: ``fatal`` at once, naming the file and the fix."""
    state = tmp_path / "state"
    cfg = make_cfg(black_vhost, state, exchanges=["ev.*"])
    mirror = Mirror(cfg, catalog_path=state / "exchanges.json")
    declare("ev.one")
    mirror.sync()
    with refused_dir(state) as why:
        declare("ev.two")
        loop = MirrorLoop(mirror, 0.1, run_now=True).start()
        _loop_ended(loop)
    assert isinstance(loop.fatal, ConfigError) and loop.error is loop.fatal
    msg = str(loop.fatal)
    assert f"writing the exchange catalog {state / 'exchanges.json'} (at {state}/." in msg, msg
    assert f"failed ({why} (E" in msg and "no new exchange is mirrored" in msg
    assert f"black.state_dir {state} is not writable by the user running black" in msg
    assert loop.last_report is None, "nothing was bound without the catalog"


def test_a_full_disk_under_the_catalog_is_retried_and_stops_the_loop_only_if_it_lasts(
    black_vhost: Vhost, tmp_path: Path, declare: Callable[[str], None]
) -> None:
    """ENOSPC writing the catalog: retried (the disk may get room), the exchange bound once
    it has; still failing ``max_failures`` syncs in a row, it is ``fatal`` (it was retried
    for ever, ``error`` never even set), naming the file and the fix."""
    with small_tmpfs("1m", "mirrorfs") as fs:
        state = fs / "state"
        cfg = make_cfg(black_vhost, state, exchanges=["ev.*"])
        catalog = state / "exchanges.json"
        mirror = Mirror(cfg, catalog_path=catalog)
        declare("ev.one")
        mirror.sync()
        filler = fs / "filler"
        _fill(filler)
        declare("ev.two")
        loop = MirrorLoop(mirror, 0.2, run_now=True)
        loop.max_failures = 10
        loop.start()
        try:
            wait_for(lambda: loop.error is not None, 10, "a failed sync")
            assert loop.fatal is None and loop.alive, "a full disk may get room: retried"
            assert isinstance(loop.error, StateError) and loop.error.retryable
            filler.unlink()

            def bound() -> bool:
                r = loop.last_report
                return r is not None and "ev.two" in r.channels["c1"].bound

            wait_for(bound, 10, "ev.two bound once the disk had room")
            assert loop.error is None and loop.in_a_row == 0
            _fill(filler)
            declare("ev.three")
        finally:
            _loop_ended(loop)
    assert isinstance(loop.fatal, StateError)
    msg = str(loop.fatal)
    assert f"writing the exchange catalog {catalog} failed (No space left on device (ENOSPC))" in (
        msg
    ), msg
    assert f"Free space on, or check the disk (dmesg) of, black.state_dir {state}" in msg
    assert "It failed 10 times in a row: the mirror loop stopped" in msg


# ------------------------------------------------------------------------- the spool's release


def test_a_shipped_segment_that_cannot_be_deleted_is_named_with_its_fix_and_retried(
    tmp_path: Path,
) -> None:
    """An immutable segment (its folder is writable): the error named the folder and its
    attribute, the wrong fix. It names the segment, the positions it holds and what the
    refusal costs; nothing past it is released, and a later call releases it."""
    w = SpoolWriter.open(tmp_path / "spool", "main", segment_bytes=1, min_free_bytes=0)
    try:
        for i in range(3):  # one segment each: [0, 1), [1, 2), then the current one
            w.append_one("ev", "", False, b"", b"body-%d" % i)
            w.sync(i)
        seg, used = w.directory / segment_name(0), w.used_bytes()
        with immutable(seg), pytest.raises(ConfigError) as e:
            w.release_through(1)
        assert w.used_bytes() == used and seg.exists(), "nothing released past it"
        assert w.release_through(1) > 0, "tried again: released"
        assert list_segments(w.directory) == [2]
    finally:
        w.close()
    msg = str(e.value)
    assert f"black.spool_dir: {seg}, in the spool of channel 'main', is not writable" in msg, msg
    assert "(EPERM)" in msg and f"`chattr -i -a {seg}`" in msg, msg
    assert "It holds positions [0, 1), shipped already: the tap goes on" in msg
    assert "the tap pauses once the spool reaches [black.spool] max_bytes" in msg


def test_a_shipped_segment_the_tap_cannot_delete_stops_neither_the_tap_nor_the_job(
    black_vhost: Vhost, tmp_path: Path
) -> None:
    """The tap could not delete an old, shipped segment (EPERM): a ConfigError, the tap
    exited 2 and the whole job stopped, for housekeeping. Now the tap counts it
    (``release_refused``), logs it and goes on spooling; it releases the segment once it
    can. A spool that cannot shrink is held by the quota / min_free_bytes pause instead."""
    url = black_vhost.amqp_url
    cfg = write_config(
        tmp_path, url, group_messages=5, group_seconds=0.2, spool={"segment_max_age_seconds": 0.1}
    )
    setup_mirror(cfg, url)
    sent = messages(15)
    d = Path(cfg.black.spool_dir) / "main"

    def status(cond: Callable[[Any], bool], what: str) -> Any:
        return wait_for(lambda: (st := tap_status(cfg, "main")) and cond(st) and st, 20, what)

    with _supervised(cfg) as sup:
        pid = sup.pids()["main"]
        publish_raw(url, sent[:5])
        status(lambda s: s.durable_end == 5, "5 spooled")
        publish_raw(url, sent[5:10])
        status(lambda s: s.durable_end == 10 and len(list_segments(d)) >= 2, "2 segments")
        first, nxt = list_segments(d)[:2]
        status(lambda s: s.acked_through >= nxt - 1, "the first segment's acks proven")
        seg = d / segment_name(first)
        with immutable(seg):
            StateStore(Path(cfg.black.state_dir)).save(ChannelState("main", last_seq=nxt - 1))
            status(lambda s: s.counters.get("release_refused", 0) >= 1, "a refusal counted")
            publish_raw(url, sent[10:])
            status(lambda s: s.durable_end == 15, "15 spooled by the same tap")
            assert seg.exists() and sup.error is None and sup.pids() == {"main": pid}
        wait_for(lambda: not seg.exists(), 20, "the segment released once it could be")
        assert sup.error is None and sup.pids() == {"main": pid}
    rows = SpoolReader(Path(cfg.black.spool_dir), "main").read(nxt, 15)
    assert [b for batch in rows for b in batch.column("body").to_pylist()] == [
        b for _, b in sent[nxt:]
    ], "each message once, in order"
