"""Test support shared by integration and scenario tests: an independent bundle reader (plain
gpg CLI + pyarrow, no bridge code) and the black job as a killable subprocess."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

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


# ---------------------------------------------------------------------- the job as a process
class BlackJob:
    """``spark_jobs/black_drain.py`` in its own process group, so SIGKILL reaches the JVM too."""

    def __init__(self, cfg_path: Path, trigger: str, log_dir: Path, *, tag: str = "job") -> None:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            DIODE_LOG_LEVEL="INFO",
            DIODE_LOG_FORMAT="json",
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
        )
        env.pop("DIODE_CONFIG", None)
        self.stdout_path = log_dir / f"{tag}-{trigger}.stdout"
        self.stderr_path = log_dir / f"{tag}-{trigger}.stderr"
        self._out = open(self.stdout_path, "wb")  # noqa: SIM115 - closed by kill()/wait()
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115
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

    def log_events(self) -> list[dict[str, Any]]:
        """The bridge's JSON log lines (Spark's own lines are skipped)."""
        out = []
        for path in (self.stderr_path, self.stdout_path):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue
        return out

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
