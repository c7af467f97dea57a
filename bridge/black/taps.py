"""Black, tap supervision: one tap process per channel, restarted when it dies.

Each tap runs in its own process (``diode black tap CHANNEL``): the delivery loop never
competes with Spark's driver for the GIL, and a tap killed at any moment (kill -9 included)
loses nothing — the broker redelivers what was not acked, the spool recognises what it
already holds. The supervisor restarts a dead tap with a growing back-off; a tap that exits
with a configuration error (exit status 2) is not restarted: the job stops and says why.
A tap the system refuses to start (fork or pipe: EAGAIN, ENOMEM, EMFILE) is tried again with
the same back-off, and stops the job after ``START_ATTEMPTS`` refusals in a row; metrics it
cannot export are logged and skipped; anything else that would end the supervisor stops the
job with it (``TapSupervisor.error``): the channels never go untapped behind a running job.
A tap that stops on an error writes why into a pipe its job gave it (``REASON_FD_ENV``): the
job's error and its log of the exit carry that reason, not only an exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from bridge.black.tap import PARENT_ENV, REASON_FD_ENV, tap_status
from bridge.config import Config
from bridge.errors import BrokerError, ConfigError, DiodeError
from bridge.fsutil import os_error_text
from bridge.logs import Recurring, get_logger, log_event
from bridge.metrics import BLACK

__all__ = [
    "TapSupervisor",
    "TapSupervisionFailed",
    "UntilEmptyTaps",
    "tap_command",
    "run_taps_until_empty",
    "export_tap_metrics",
]

log = get_logger("bridge.black.taps")

EXIT_CONFIG = 2
MAX_BACKOFF_S = 30.0
START_ATTEMPTS = 8
"""Refusals in a row to start a channel's tap (about a minute with the back-off) after which
the job stops: the system is out of processes, memory or file descriptors for good."""


class TapSupervisionFailed(DiodeError):
    """The supervisor cannot keep a channel's tap running (it could not start it, or it
    failed itself): the job stops with it; starting black again may help."""

    retryable = True


def _backoff(n: int) -> float:
    """Seconds before the ``n``-th restart in a row (0.5 s, doubling, at most MAX_BACKOFF_S)."""
    return min(MAX_BACKOFF_S, 0.5 * 2 ** min(n - 1, 6))


def export_tap_metrics(cfg: Config) -> None:
    """Publish each tap's last status (its own process serves no /metrics) as gauges."""
    now = time.time()
    for ch in cfg.channels:
        st = tap_status(cfg, ch.name)
        if st is None:
            continue
        BLACK.spool_end.labels(ch.name).set(st.durable_end)
        BLACK.spool_bytes.labels(ch.name).set(st.spool_bytes)
        BLACK.tap_paused.labels(ch.name).set(1 if st.paused else 0)
        BLACK.tap_status_age.labels(ch.name).set(max(0.0, now - st.updated))
        for event, n in st.counters.items():
            BLACK.tap_events.labels(ch.name, event).set(n)


def tap_command(cfg: Config, channel: str, *, until_empty: bool = False) -> list[str]:
    if cfg.source is None:
        raise ConfigError("the tap needs a config file: pass --config")
    cmd = [sys.executable, "-m", "bridge.cli", "black", "tap", "--config", str(cfg.source), channel]
    if until_empty:
        cmd.append("--until-empty")
    return cmd


@dataclass
class _Proc:
    channel: str
    proc: subprocess.Popen[bytes] | None = None
    reason_fd: int = -1
    restarts: int = 0
    refused_starts: int = 0
    """Starts the system refused in a row (fork, pipe)."""
    next_start: float = 0.0
    exits: list[int] = field(default_factory=list)


def _start(cfg: Config, channel: str, *, until_empty: bool) -> tuple[subprocess.Popen[bytes], int]:
    """Black, taps: start ``channel``'s tap process; returns it and the read end of the pipe
    it writes why it stopped into (``read_reason`` once it exited)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[PARENT_ENV] = str(os.getpid())  # the tap stops when this process is gone
    read, write = os.pipe()
    env[REASON_FD_ENV] = str(write)
    try:
        # our stdout is the caller's (`diode black run` and `diode demo` end it with their own
        # JSON summary); the tap's closing status line is in its status file (`diode status`)
        # too, and its logs go to stderr
        proc = subprocess.Popen(
            tap_command(cfg, channel, until_empty=until_empty), env=env,
            stdout=subprocess.DEVNULL, pass_fds=(write,),
        )  # fmt: skip
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)  # the tap holds the only write end: the pipe ends when it exits
    os.set_blocking(read, False)
    return proc, read


def read_reason(fd: int) -> str | None:
    """Black, taps: why an exited tap stopped, as it wrote it into its pipe (``_start``), or
    None if it wrote nothing (killed, or it ended well); closes ``fd``."""
    chunks: list[bytes] = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass  # a process the tap started still holds the write end: take what is there
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace").strip() or None


def _said(reason: str | None, fallback: str = "its log above says why") -> str:
    """Why a tap stopped, as it said (without a closing period), or ``fallback`` (where to
    look) when it said nothing."""
    return (reason or "").rstrip(".") or fallback


def _why(channel: str, reason: str | None) -> str:
    """``channel``'s tap stopped: its reason, or where to look when it gave none."""
    return f"{channel!r}: {_said(reason)}"


class UntilEmptyTaps:
    """One ``--until-empty`` tap per channel, in parallel (scheduled runs): each drains the
    backlog its queues held when it started. The job seals while they run."""

    def __init__(self, cfg: Config, *, timeout: float | None = None) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.reason_fds: dict[str, int] = {}
        try:
            for ch in cfg.channels:
                self.procs[ch.name], self.reason_fds[ch.name] = _start(
                    cfg, ch.name, until_empty=True
                )
        except BaseException:
            self.stop()
            raise
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def done(self) -> bool:
        """Every tap has exited (successfully or not)."""
        return all(p.poll() is not None for p in self.procs.values())

    def wait(self, seconds: float) -> None:
        """Wait until every tap has exited, at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while not self.done() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """Terminate taps still running (the run failed); what they made durable stays."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._reasons()

    def _reasons(self) -> dict[str, str | None]:
        """Why each exited tap stopped (``read_reason``), once: the pipes are closed after."""
        fds, self.reason_fds = self.reason_fds, {}
        return {name: read_reason(fd) for name, fd in fds.items()}

    def finish(self) -> None:
        """Wait for every tap (terminating those past the timeout); raise if one failed."""
        failed: dict[str, int] = {}
        for name, p in self.procs.items():
            left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            try:
                rc = p.wait(left)
            except subprocess.TimeoutExpired:
                p.terminate()
                rc = p.wait(30)
                rc = 0 if rc == -15 else rc  # stopped by the timeout: what it spooled stands
            if rc != 0:
                failed[name] = rc
        reasons = self._reasons()
        if failed:
            kind = ConfigError if EXIT_CONFIG in failed.values() else BrokerError
            why = "; ".join(_why(name, reasons.get(name)) for name in failed)
            raise kind(
                f"tap failed for channel(s) {failed} (exit status): {why}. Nothing is lost: "
                "what it did not make durable stays in the mirror queue"
            )


def run_taps_until_empty(cfg: Config, *, timeout: float | None = None) -> None:
    """Drain every channel's mirror queue into its spool, then return (or raise)."""
    UntilEmptyTaps(cfg, timeout=timeout).finish()


class TapSupervisor:
    """Keeps one tap process per channel alive (continuous runs)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.procs = {ch.name: _Proc(ch.name) for ch in cfg.channels}
        self.error: DiodeError | None = None
        self.start_attempts = START_ATTEMPTS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="diode-taps", daemon=True)
        self._export_failed = Recurring()

    def start(self) -> TapSupervisor:
        now = time.monotonic()
        for p in self.procs.values():
            self._launch(p, now)
        self._thread.start()
        return self

    def pids(self) -> dict[str, int]:
        return {n: p.proc.pid for n, p in self.procs.items() if p.proc and p.proc.poll() is None}

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for p in self.procs.values():
            if p.proc is not None and p.proc.poll() is None:
                p.proc.terminate()
        for p in self.procs.values():
            if p.proc is not None:
                try:
                    p.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.proc.kill()
                    p.proc.wait()
            if p.reason_fd >= 0:
                fd, p.reason_fd = p.reason_fd, -1
                os.close(fd)

    def _fail(self, error: DiodeError, **ids: str) -> None:
        """Stop supervising: the job's health check ends the run with ``error``."""
        self.error = error
        log_event(log, 50, str(error), **ids)
        self._stop.set()

    def _run(self) -> None:
        try:
            self._supervise()
        except Exception as e:  # a bug: never a job that runs on with nobody restarting taps
            log.exception("the tap supervisor failed")
            self._fail(
                e if isinstance(e, DiodeError) else TapSupervisionFailed(
                    f"the tap supervisor failed ({type(e).__name__}: {e}): no tap would be "
                    "restarted any more, so the job stops. Its traceback is in the log above; "
                    "start black again"
                )
            )  # fmt: skip

    def _export(self) -> None:
        """The taps' metrics; a failure is logged (once a minute) and skipped: they only
        inform, and the supervisor must go on restarting taps."""
        try:
            export_tap_metrics(self.cfg)
        except Exception as e:
            if self._export_failed.due(f"{type(e).__name__}: {e}"):
                log.exception("tap metrics not exported (tried again every second)")
        else:
            self._export_failed.over()

    def _launch(self, p: _Proc, now: float) -> None:
        """Start ``p``'s tap. A refusal of the system (fork, pipe: EAGAIN, ENOMEM, EMFILE) is
        tried again with back-off, then ends supervision after ``start_attempts`` in a row."""
        try:
            p.proc, p.reason_fd = _start(self.cfg, p.channel, until_empty=False)
        except OSError as e:
            p.refused_starts += 1
            why = os_error_text(e)
            if p.refused_starts >= self.start_attempts:
                self._fail(TapSupervisionFailed(
                    f"the tap of channel {p.channel!r} could not be started {p.refused_starts} "
                    f"times in a row: {why}. The system is out of processes, memory or file "
                    "descriptors: check `ulimit -u` / `ulimit -n` of the user running black "
                    "(LimitNPROC / LimitNOFILE of its service), free memory, and what else "
                    "runs as that user; then start black again. Nothing is lost: the channel's "
                    "messages wait in its mirror queue"
                ), channel=p.channel)  # fmt: skip
                return
            delay = _backoff(p.refused_starts)
            p.next_start = now + delay
            log_event(
                log, 40, f"tap could not be started: {why}; trying again (nothing is lost: "
                "the messages wait in the mirror queue)", channel=p.channel,
                refused=p.refused_starts, of=self.start_attempts, in_seconds=delay,
            )  # fmt: skip
            return
        p.refused_starts = 0

    def _supervise(self) -> None:
        exported = 0.0
        while not self._stop.wait(0.2):
            now = time.monotonic()
            if now - exported >= 1.0:
                self._export()
                exported = now
            for p in self.procs.values():
                if p.proc is None:
                    if now >= p.next_start:
                        self._launch(p, now)
                        if self._stop.is_set():
                            return
                    continue
                rc = p.proc.poll()
                if rc is None:
                    continue
                p.exits.append(rc)
                p.proc = None
                fd, p.reason_fd = p.reason_fd, -1
                reason = read_reason(fd) if fd >= 0 else None
                if rc == EXIT_CONFIG:
                    self._fail(ConfigError(
                        f"the tap of channel {p.channel!r} stopped on a configuration error: "
                        f"{_said(reason, 'its log says which')}. Fix it and "
                        "restart black"
                    ), channel=p.channel)  # fmt: skip
                    return
                p.restarts += 1
                delay = _backoff(p.restarts)
                p.next_start = now + delay
                log_event(
                    log, 40, "tap exited; restarting it (nothing is lost: unacked messages "
                    "wait in the mirror queue)",
                    channel=p.channel, exit_status=rc, reason=reason or "its log above says why",
                    restarts=p.restarts, in_seconds=delay,
                )  # fmt: skip
