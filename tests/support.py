"""Test support shared by integration and scenario tests: an independent bundle reader (plain
gpg CLI + pyarrow, no bridge code), the checks every crash scenario makes on what black shipped,
the black job as a killable subprocess, and crash-point arming (``bridge.faults``)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from bridge.amqp.client import Connection
from bridge.crypto.keys import KeyInventory, init_keys
from bridge.faults import CRASH_ENV, MARK_ENV

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "spark_jobs" / "black_drain.py"


# ---------------------------------------------------------------------- independent reading
AMQP_PROPERTIES = (
    "content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
    "reply_to", "expiration", "message_id", "timestamp", "type", "user_id", "app_id",
    "cluster_id",
)  # fmt: skip
"""The AMQP 0-9-1 basic properties besides headers, written out from the spec (not imported
from the bridge: these tests read bundles independently)."""


def json_lines(*paths: Path) -> list[dict[str, Any]]:
    """Every JSON line of these process logs, in order (other lines are skipped)."""
    out = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def gpg_open_cli(red_home: Path, src: Path, black_fpr: str) -> bytes:
    """Decrypt + verify ``src`` with the plain gpg command line; returns the plaintext.

    With hidden recipients gpg tries each secret key on each anonymous slot and may exit 2
    although decryption and signature are good: the verdict comes from the status lines
    (GOODSIG, VALIDSIG by the pinned black key, DECRYPTION_OKAY), never from the exit code alone.
    """
    dst = src.parent.parent / f".{src.name}.plain"
    r = subprocess.run(
        ["gpg", "--homedir", str(red_home), "--batch", "--yes", "--status-fd", "1",
         "--output", str(dst), "--decrypt", str(src)],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    status = r.stdout.decode(errors="replace").splitlines()
    valid = [ln.split() for ln in status if ln.startswith("[GNUPG:] VALIDSIG ")]
    ok = (
        any(ln.startswith("[GNUPG:] GOODSIG ") for ln in status)
        and any(v[2].upper() == black_fpr or v[-1].upper() == black_fpr for v in valid)
        and "[GNUPG:] DECRYPTION_OKAY" in status
    )
    assert r.returncode in (0, 2) and ok and dst.exists(), (
        f"gpg could not open {src.name} (exit {r.returncode}):\n"
        f"{r.stdout.decode(errors='replace')}\n{r.stderr.decode(errors='replace')}"
    )
    data = dst.read_bytes()
    dst.unlink()
    return data


def read_plain_bundle(data: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(manifest, rows) of a plaintext bundle, with pyarrow alone."""
    pf = pq.ParquetFile(io.BytesIO(data))  # raises if it is not a whole Parquet file
    manifest = json.loads((pf.metadata.metadata or {})[b"diode.manifest"])
    return manifest, pf.read().to_pylist()


def bundle_files(outbox: Path) -> list[Path]:
    return sorted(outbox.glob("*.dbundle"))


@dataclass(frozen=True)
class OpenedBundle:
    """One delivered bundle file, opened with the gpg CLI and pyarrow."""

    path: Path
    sealed_sha256: str
    """Of the file as it was delivered (a re-drop of the archived copy has the same)."""
    plain_sha256: str
    """Of the plaintext: what the next bundle's ``prev_sha256`` names."""
    manifest: dict[str, Any]
    rows: list[dict[str, Any]]


def open_bundles(
    files: Iterable[Path], red_home: Path, black_fpr: str
) -> dict[int, list[OpenedBundle]]:
    """Every delivered copy of every bundle, by bundle seq; each name must agree with its
    authenticated manifest."""
    out: dict[int, list[OpenedBundle]] = {}
    for p in files:
        sealed = p.read_bytes()
        plain = gpg_open_cli(red_home, p, black_fpr)
        manifest, rows = read_plain_bundle(plain)
        channel, seq_txt, bundle_id, suffix = p.name.split(".")[-4:]
        assert (channel, int(seq_txt), bundle_id, suffix) == (
            manifest["channel"],
            manifest["bundle_seq"],
            manifest["bundle_id"],
            "dbundle",
        ), f"{p.name}: name and manifest disagree"
        out.setdefault(manifest["bundle_seq"], []).append(
            OpenedBundle(
                p,
                hashlib.sha256(sealed).hexdigest(),
                hashlib.sha256(plain).hexdigest(),
                manifest,
                rows,
            )
        )
    return out


def check_chain(
    by_seq: dict[int, list[OpenedBundle]], *, channel: str, max_rows: int
) -> list[dict[str, Any]]:
    """Assert what every crash scenario promises of one channel's bundles; returns the rows.

    Bundle seqs 1..N gapless; every copy of bundle N the same plaintext (a re-delivery or a
    bundle re-created after a crash is identical to the first delivery); the hash chain
    intact; manifests agree with their rows; no gaps; message seqs 0..M-1 gapless, each once.
    """
    assert sorted(by_seq) == list(range(1, len(by_seq) + 1)), f"bundle seqs {sorted(by_seq)}"
    prev: str | None = None
    rows_all: list[dict[str, Any]] = []
    for bseq in sorted(by_seq):
        copies = by_seq[bseq]
        first = copies[0]
        for c in copies[1:]:
            assert (c.plain_sha256, c.manifest) == (first.plain_sha256, first.manifest), (
                f"bundle {bseq} delivered twice with different contents: {first.path.name}, "
                f"{c.path.name}"
            )
        m, rows = first.manifest, first.rows
        assert m["format"] == 1 and m["channel"] == channel and m["schema_version"] == 2
        assert m["prev_sha256"] == prev, f"hash chain broken at bundle {bseq}"
        assert m["gaps"] == [], f"bundle {bseq} reports gaps {m['gaps']}"
        assert m["rows"] == len(rows) and 0 < len(rows) <= max_rows, (bseq, m["rows"])
        assert (m["first_seq"], m["last_seq"]) == (rows[0]["seq"], rows[-1]["seq"]), bseq
        counts: dict[str, int] = {}
        for r in rows:
            assert r["channel"] == channel
            counts[r["exchange"]] = counts.get(r["exchange"], 0) + 1
        assert m["exchanges"] == counts, bseq
        prev = first.plain_sha256
        rows_all.extend(rows)
    seqs = [r["seq"] for r in rows_all]
    assert seqs == list(range(len(seqs))), "message seqs are not gapless / unique / ordered"
    return rows_all


def check_messages(
    rows: Sequence[dict[str, Any]], sent: Sequence[tuple[str, str, bytes, bytes]]
) -> None:
    """Every message published once, in publish order, with exchange, routing key, property
    bytes and body exactly as sent."""
    assert len(rows) == len(sent), f"{len(rows)} messages sealed, {len(sent)} published"
    for r, (ex, rk, props, body) in zip(rows, sent, strict=True):
        got = (r["exchange"], r["routing_key"], r["properties_raw"], r["body"])
        assert got == (ex, rk, props, body), f"seq {r['seq']} differs from what was published"


# ---------------------------------------------------------------------- the job as a process
class BlackJob:
    """``spark_jobs/black_drain.py`` in its own process group, so SIGKILL reaches the JVM too."""

    def __init__(
        self,
        cfg_path: Path,
        trigger: str,
        log_dir: Path,
        *,
        tag: str = "job",
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: extra environment for the job and the taps it starts (e.g. crash_env())."""
        full = dict(os.environ)
        for k in (CRASH_ENV, MARK_ENV, "DIODE_CONFIG"):
            full.pop(k, None)
        full.update(
            PYTHONPATH=os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            DIODE_LOG_LEVEL="INFO",
            DIODE_LOG_FORMAT="json",
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
        )
        full.update(env or {})
        env = full
        self.stdout_path = log_dir / f"{tag}-{trigger}.stdout"
        self.stderr_path = log_dir / f"{tag}-{trigger}.stderr"
        self._out = open(self.stdout_path, "wb")  # noqa: SIM115 - closed by kill()/wait()
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115
        self.tag = tag
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, str(JOB), "--config", str(cfg_path), "--trigger", trigger],
            cwd=REPO, env=env, stdout=self._out, stderr=self._err, start_new_session=True,
        )  # fmt: skip

    def running(self) -> bool:
        return self.proc.poll() is None

    def _close(self) -> None:
        self._out.close()
        self._err.close()

    def kill(self) -> None:
        """SIGKILL the whole group: python driver, Spark JVM, python workers."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._close()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._close()

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def summary(self) -> dict[str, Any]:
        """The run summary the job prints on stdout when it ends normally."""
        lines = [x for x in self.stdout_path.read_text().splitlines() if x.startswith('{"batches"')]
        assert lines, f"the job printed no summary:\n{self.tail()}"
        return dict(json.loads(lines[-1]))

    def log_events(self) -> list[dict[str, Any]]:
        """The bridge's JSON log lines (Spark's own lines are skipped)."""
        return json_lines(self.stderr_path, self.stdout_path)

    def tail(self, n: int = 60) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return "\n".join(text.splitlines()[-n:])


def wait_for(
    cond: Callable[[], Any],
    timeout: float,
    what: str,
    job: BlackJob | None = None,
    poll: float = 0.2,
) -> Any:
    """Poll ``cond`` until truthy (and return it); fail with the job's log if it dies or time
    runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if job is not None and not job.running():
            pytest.fail(f"black job exited ({job.proc.returncode}) before {what}:\n{job.tail()}")
        time.sleep(poll)
    pytest.fail(
        f"timed out after {timeout}s waiting for {what}" + (f":\n{job.tail()}" if job else "")
    )


# ---------------------------------------------------------------------- crash points, taps
def crash_env(point: str, mark: Path, nth: int = 1) -> dict[str, str]:
    """Environment arming crash point ``point`` to fire the ``nth`` time it is reached; the
    process appends the point to ``mark`` before it SIGKILLs itself."""
    return {CRASH_ENV: f"{point}:{nth}", MARK_ENV: str(mark)}


def crash_marks(mark: Path) -> list[str]:
    """The crash points that fired, in order (the mark file's lines)."""
    return mark.read_text().split() if mark.exists() else []


def tap_pid(state_dir: Path, channel: str) -> int | None:
    """Pid of the channel's running tap process (from ``tap-<channel>.json``), None if the
    status names no live ``black tap`` process."""
    try:
        pid = int(json.loads((state_dir / f"tap-{channel}.json").read_bytes())["pid"])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    zombie = stat.rsplit(")", 1)[-1].split()[0] == "Z"
    if zombie or b"tap" not in cmd or channel.encode() not in cmd:
        return None
    return pid


@contextmanager
def small_tmpfs(size: str, prefix: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (e.g. ``"2m"``), mounted on a new dir under /tmp and
    unmounted and removed afterwards: a disk that really fills up. Skips the test without
    root (or CAP_SYS_ADMIN)."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], check=False)
        shutil.rmtree(d, ignore_errors=True)


class LoRoute:
    """A host route on lo for ``addr`` whose MTU a test sets (``mtu(n)``), removed after."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.spec = ["local", f"{addr}/32", "dev", "lo", "table", "local"]

    def mtu(self, n: int) -> None:
        made = subprocess.run(["ip", "route", "replace", *self.spec, "mtu", "lock", str(n)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if made.returncode != 0:
            pytest.skip(f"cannot add a route here: {made.stderr.strip()}")


@contextmanager
def lo_route(addr: str, mtu: int) -> Iterator[LoRoute]:
    """127.x ``addr`` reached through a route of ``mtu`` (lo's own is 65536); skips the test
    without root."""
    if os.geteuid() != 0:
        pytest.skip("adding a route needs root")
    route = LoRoute(addr)
    route.mtu(mtu)
    try:
        yield route
    finally:
        subprocess.run(["ip", "route", "del", *route.spec], capture_output=True, check=False)


# ---------------------------------------------------------------------- keys, logs
@contextmanager
def key_inventory(
    bridge_id: str, red_names: Sequence[str] = ("red",), prefix: str = "dk"
) -> Iterator[KeyInventory]:
    """Fresh black and red keys (slow: for a module-scoped fixture) under a short /tmp path
    (gpg-agent socket paths are limited), the agents stopped and the keys removed after."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield init_keys(d / "keys", red_names=red_names, bridge_id=bridge_id)
    finally:
        for home in ("black", "red"):
            subprocess.run(
                ["gpgconf", "--homedir", str(d / "keys" / home), "--kill", "gpg-agent"],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def captured_logs(logger_name: str) -> Iterator[list[logging.LogRecord]]:
    """The records ``logger_name`` logs meanwhile at INFO and above, whatever the logging
    setup of the process."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger(logger_name)
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _confirmed(conn: Connection, acked: int, seconds: float) -> int:
    """The highest delivery tag confirmed, after one poll of up to ``seconds``; a nack fails."""
    for c in conn.poll(seconds).confirms:
        assert c.ack, f"the broker nacked publish {c.delivery_tag}"
        acked = max(acked, c.delivery_tag)
    return acked


def publish_confirmed(
    url: str,
    messages: Iterable[tuple[str, str, bytes, bytes]],
    *,
    client_name: str = "diode-test-producer",
    window: int = 2000,
) -> None:
    """Publish ``(exchange, routing key, property bytes, body)`` in order with confirms (at
    most about ``window`` unconfirmed), through
    the bridge's own client (raw property bytes: pika cannot send float headers; names that are
    not UTF-8 go as surrogate escapes); returns once the broker acked every one."""
    conn = Connection.open(url, client_name=client_name)
    try:
        ch = conn.channel()
        ch.confirm_select()
        acked = last = 0
        for exchange, rk, props, body in messages:
            last = ch.publish(exchange, rk, props, body)
            if last - acked > window:  # bounded in flight: take the confirms so far
                acked = _confirmed(conn, acked, 0.5)
        while acked < last:
            acked = _confirmed(conn, acked, 1.0)
    finally:
        conn.close()


def foreign_checkpoint(spark: Any, checkpoint_dir: Path) -> None:
    """Fill ``checkpoint_dir`` with the checkpoint of another query (a rate source, whose
    offset is ``0``), as a checkpoint dir shared by mistake would hold."""
    q = (
        spark.readStream.format("rate").load().writeStream.format("noop")
        .option("checkpointLocation", f"file://{Path(checkpoint_dir).resolve()}")
        .trigger(availableNow=True).start()
    )  # fmt: skip
    q.awaitTermination()


def without_dac(*caps: str) -> list[str]:
    """The command prefix that runs a child without CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and
    ``caps`` (as root, whom mode bits do not stop; nothing for another user, whom they stop
    anyway). Skips the test as root without setpriv."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: cannot run a child that mode bits stop")
    drop = ",".join(f"-{c}" for c in ("dac_override", "dac_read_search", *caps))
    return [setpriv, "--bounding-set", drop]
