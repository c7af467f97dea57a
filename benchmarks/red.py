"""Benchmark, red: the landing (inbox -> verify+decrypt on executors -> Delta) vs baselines.

    python benchmarks/red.py [--bundles N] [--rows M] [--body-bytes B]
                             [--large-bundles N] [--large-rows M] [--large-bytes B]
                             [--files-per-batch K] [--engine E] [--no-subprocess]
                             [--replay N] [--dir DIR] [--out DIR]

Every baseline is measured in the same run, on the same disk and the same bundle files
(DESIGN.md section 7; the machine is shared and noisy, so ratios count, not absolute rates):

* 1 KB (``--bundles`` x ``--rows`` messages of ``--body-bytes``; default 40 x 5000 x 1 KB =
  200k messages): sealed bundles as black makes them (row schema v2, Parquet zstd, body at
  zstd 1, signed + encrypted to every red key, -z 0, hidden recipients, one hash chain).
  Baselines: raw ``gpg --decrypt`` of the same files (the options ``Gpg.open`` uses, output
  fsynced; one at a time, and as many at a time as Spark has cores); ``verify_file`` of each
  file in this process (no Spark, same parallelism); a pyarrow read of the plaintexts; raw
  ``write_deltalake`` of the same rows in the ``messages`` schema, already in memory (one
  commit, and one commit per bundle). Then ``RedRun(cfg).run(spark, "available-now")`` in this
  process with Spark already up (a small warm-up run before it takes the JVM's first-query
  cost, reported apart), instrumented: the run is split into set-up, query start, Spark
  between batches, *execute* (``df.toArrow()`` in the sink: the executors verify and decrypt
  the batch's files) and the driver's landing (judging and journal in the sink; then, in a
  background thread that overlaps the next batch, Delta appends by table with the plaintext
  read and schema conforming apart, chain updates, evidence moves). The landing
  window runs from the first batch's start to the last landing's commit. Then the same files
  landed by ``spark_jobs/red_land.py`` as a subprocess, cold: whole run including Spark's start,
  and its landing window from its own log lines ("inbox scanned" -> last "landed").
  Target: >= 50,000 msg/s inbox to Delta (judged on the in-process whole run, warm Spark).
* 1 MB (``--large-bundles`` x ``--large-rows`` x ``--large-bytes``, default 20 x 50 x 1 MB;
  ``--large-bundles 0`` skips it): the same baselines and the in-process run, in MB/s of
  message bodies, against raw gpg decrypt.

* Replay (``--replay N``, default 50,000 x 1 KB; 0 skips it): ``benchmarks/replay.py``'s
  measurement, the replay publisher against a raw pika async-confirmed publish loop and the
  bridge's own AMQP client in the same loop, same broker, same bodies and window. Target:
  >= 0.8x raw pika.

Peak RSS of the whole process tree (this process, the JVM, Spark's Python workers, gpg, the
subprocess) is sampled every 0.5 s during each run; CPU seconds per run are charged to this
process, the JVM and the rest of the tree. Writes ``<out>/red-<utc time>.json`` and prints a
table; step output (JVM, gpg, the subprocess's log lines) goes to ``<out>/red-<time>.log``.
Needs gpg, Java and the venv (and RabbitMQ with its management API for the replay); works in
temp dirs and a throw-away vhost and removes them. Not part of CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable, write_deltalake

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from replay import measure_replay, print_replay  # noqa: E402 - benchmarks/ is this script's dir

import bridge.red.landing as landing_module  # noqa: E402
import bridge.red.tables as tables_module  # noqa: E402
from bridge.config import Config, load_config  # noqa: E402
from bridge.crypto.gpg import Gpg  # noqa: E402
from bridge.crypto.keys import KeyInventory, init_keys  # noqa: E402
from bridge.logs import setup_logging  # noqa: E402
from bridge.protocol.bundle import manifest_for, pack_bundle, sha256_hex  # noqa: E402
from bridge.protocol.exchange import ExchangeDecl  # noqa: E402
from bridge.protocol.manifest import format_utc  # noqa: E402
from bridge.protocol.naming import bundle_name  # noqa: E402
from bridge.protocol.properties import Properties, encode_properties, field_table  # noqa: E402
from bridge.protocol.rows import build_rows  # noqa: E402
from bridge.red import schema as rs  # noqa: E402
from bridge.red.evidence import Evidence  # noqa: E402
from bridge.red.job import RedRun  # noqa: E402
from bridge.red.landing import Landing  # noqa: E402
from bridge.red.tables import RedTables  # noqa: E402
from bridge.red.verify import VerifyContext, verify_file  # noqa: E402
from bridge.signals import exit_now  # noqa: E402
from bridge.spark import get_spark  # noqa: E402

KB = 1024
MB = 1024 * 1024
TARGET_MSG_S = 50_000.0
BRIDGE_ID = "diode-bench"
CHANNEL = "bench"
EXCHANGE = "bench.red"
PROPS = encode_properties(
    Properties(
        content_type="application/octet-stream",
        delivery_mode=2,
        headers=field_table({"sensor": "s01", "n": 1}),
    )
)
DECL = {EXCHANGE: ExchangeDecl(name=EXCHANGE, type="fanout")}
GPG_SLACK = MB
"""gpg's --max-output is the file size plus this, as in bridge.red.verify."""


# -- bundles --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Made:
    """One sealed bundle on disk."""

    path: Path
    name: str
    bundle_seq: int
    bundle_id: str
    rows: int
    plain_bytes: int
    wire_bytes: int


def _bodies(rows: int, size: int) -> pa.Array:
    """``rows`` distinct random bodies of ``size`` bytes, one buffer (zstd cannot shrink them)."""
    if rows * size >= 2**31:
        raise ValueError(f"{rows} x {size} bytes do not fit one Arrow binary array")
    offsets = pa.py_buffer((np.arange(rows + 1, dtype=np.int32) * size).tobytes())
    return pa.Array.from_buffers(
        pa.binary(), rows, [None, offsets, pa.py_buffer(os.urandom(rows * size))]
    )


def _plaintext(
    bundle_seq: int, first: int, rows: int, size: int, prev: str | None
) -> tuple[bytes, str]:
    """Packed plaintext of one bundle (as black's sink packs it) and its bundle id."""
    seqs = pa.array(range(first, first + rows), pa.int64())
    batch = build_rows(
        CHANNEL, seqs, [EXCHANGE] * rows, ["bench.key"] * rows, [False] * rows,
        [PROPS] * rows, _bodies(rows, size), DECL,
    )  # fmt: skip
    table = pa.Table.from_batches([batch])
    bid = uuid.uuid4().hex
    m = manifest_for(
        table, channel=CHANNEL, bundle_seq=bundle_seq, bundle_id=bid,
        created_at=format_utc(dt.datetime.now(dt.UTC)), bridge_id=BRIDGE_ID, prev_sha256=prev,
    )  # fmt: skip
    return pack_bundle(table, m, body_zstd_level=1), bid


def make_chain(out: Path, inv: KeyInventory, n: int, rows: int, size: int) -> list[Made]:
    """``n`` consecutive bundles of CHANNEL (hash chain, contiguous seqs), sealed by 2 gpg at a
    time while the next plaintexts are packed."""
    out.mkdir(parents=True, exist_ok=True)
    gpg = Gpg(inv.black_home)
    recipients = list(inv.red_fprs.values())

    def seal(plain: bytes, name: str) -> int:
        tmp = out / f".{name}.tmp"
        gpg.seal(plain, tmp, signer=inv.black_fpr, recipients=recipients)
        os.replace(tmp, out / name)
        return (out / name).stat().st_size

    made: list[Made] = []
    prev: str | None = None
    pending: list[tuple[Future[int], Made]] = []
    with ThreadPoolExecutor(2) as pool:
        for i in range(n):
            bseq = i + 1
            plain, bid = _plaintext(bseq, i * rows, rows, size, prev)
            prev = sha256_hex(plain)
            name = bundle_name(CHANNEL, bseq, bid)
            m = Made(out / name, name, bseq, bid, rows, len(plain), 0)
            pending.append((pool.submit(seal, plain, name), m))
            del plain
            while len(pending) > 3:
                f, m = pending.pop(0)
                made.append(dataclasses.replace(m, wire_bytes=f.result()))
        made.extend(dataclasses.replace(m, wire_bytes=f.result()) for f, m in pending)
    return made


def drop(cfg: Config, made: Sequence[Made]) -> None:
    """Put the bundles into the inbox (hard links: the originals stay for the next run)."""
    inbox = Path(cfg.red.inbox)
    inbox.mkdir(parents=True, exist_ok=True)
    for m in made:
        try:
            os.link(m.path, inbox / m.name)
        except OSError:
            shutil.copyfile(m.path, inbox / m.name)


# -- process tree: CPU and memory -----------------------------------------------------------------
def _kind(p: psutil.Process) -> str:
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return "other"
    if p.pid == os.getpid():
        return "driver"
    if name == "java":
        return "jvm"
    if name.startswith("gpg") or name in ("keyboxd", "dirmngr"):
        return "gpg"
    if "red_land.py" in cmd:
        return "red_land"
    if "python" in name:
        return "python_workers"
    return f"other:{name}"


def _short_cmd(p: psutil.Process) -> str:
    try:
        args = p.cmdline()
    except psutil.Error:
        return ""
    keep = [a for a in args if not a.startswith("-") and ("/" not in a or a == args[0])]
    return " ".join([Path(args[0]).name if args else "", *keep[1:4]])[:90]


def _tree() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


Key = tuple[int, float]
"""A process: (pid, create time)."""


class TreeSampler(threading.Thread):
    """RSS of this process and all its descendants, summed, every ``period`` seconds; and the
    CPU seconds each process spent while sampled (own, and of its waited children: gpg runs
    under Spark's Python workers). A process that ends between samples is charged what it had
    at its last sample; its waited children go to its parent's ``*_children``."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(daemon=True, name="tree-sampler")
        self.period = period
        self.peak = 0
        self.samples = 0
        self.peak_by_kind: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self._kinds: dict[Key, str] = {}
        self._cmds: dict[Key, str] = {}
        self._cpu_last: dict[Key, tuple[str, float, float]] = {}
        self._halt = threading.Event()
        self._sample(rss=False)
        self._cpu_first = dict(self._cpu_last)

    def _sample(self, *, rss: bool = True) -> None:
        by_kind: dict[str, int] = defaultdict(int)
        for p in _tree():
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    mem = p.memory_info().rss if rss else 0
                    t = p.cpu_times()
            except psutil.Error:
                continue
            kind = self._kinds.get(key)
            if kind is None or kind.startswith("other"):  # spark-submit's bash execs java
                kind = self._kinds[key] = _kind(p)
                self._cmds[key] = _short_cmd(p)
            by_kind[kind] += mem
            self._cpu_last[key] = (kind, t.user + t.system, t.children_user + t.children_system)
        if not rss:
            return
        total = sum(by_kind.values())
        self.samples += 1
        if total > self.peak:
            self.peak, self.at_peak = total, dict(by_kind)
        for k, v in by_kind.items():
            self.peak_by_kind[k] = max(self.peak_by_kind.get(k, 0), v)

    def run(self) -> None:
        while not self._halt.is_set():
            self._sample()
            self._halt.wait(self.period)

    def stop(self) -> dict[str, Any]:
        self._halt.set()
        self.join()
        self._sample()
        cpu: dict[str, float] = defaultdict(float)
        per_process: list[tuple[float, str]] = []
        for key, (kind, own, kids) in self._cpu_last.items():
            _, own0, kids0 = self._cpu_first.get(key, (kind, 0.0, 0.0))
            if kind == "driver":  # its waited children (red_land.py) are sampled themselves
                kids = kids0
            cpu[kind] += own - own0
            cpu[f"{kind}_children"] += kids - kids0
            per_process.append((own - own0 + kids - kids0, f"{key[0]} {self._cmds.get(key, '')}"))
        per_process.sort(reverse=True)
        return {
            "memory": {
                "peak_mb": round(self.peak / MB, 1),
                "samples": self.samples,
                "at_peak_by_kind_mb": {
                    k: round(v / MB, 1) for k, v in sorted(self.at_peak.items())
                },
                "peak_by_kind_mb": {
                    k: round(v / MB, 1) for k, v in sorted(self.peak_by_kind.items())
                },
            },
            "cpu_s": {k: round(v, 2) for k, v in sorted(cpu.items()) if round(v, 2)},
            "cpu_top_processes": [f"{c:.2f} s  {cmd}" for c, cmd in per_process[:10]],
        }


@contextmanager
def sampled() -> Iterator[dict[str, Any]]:
    """Peak RSS of the tree and CPU by kind while the block runs, filled in at its end."""
    out: dict[str, Any] = {}
    s = TreeSampler()
    s.start()
    try:
        yield out
    finally:
        out.update(s.stop())


# -- baselines ------------------------------------------------------------------------------------
def _rates(n_msgs: int, body_mb: float, secs: float) -> dict[str, Any]:
    return {"seconds": round(secs, 3), "msg_s": n_msgs / secs, "mb_s": body_mb / secs}


def _pmap(fn: Callable[[Made], Any], made: Sequence[Made], parallel: int) -> list[Any]:
    if parallel <= 1:
        return [fn(m) for m in made]
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(fn, made))


def raw_gpg_decrypt(
    made: Sequence[Made],
    inv: KeyInventory,
    out: Path,
    parallel: int,
    body_mb: float,
    rounds: int = 2,
) -> dict[str, Any]:
    """``gpg --decrypt`` of every file with ``Gpg.open``'s options, output fsynced; ``parallel``
    gpg at a time; best of ``rounds``. The plaintexts of the last round stay in ``out``."""
    out.mkdir(parents=True, exist_ok=True)

    def one(m: Made) -> None:
        dst = out / f"{m.name}.parquet"
        cmd = [
            "gpg", "--homedir", str(inv.red_home), "--batch", "--no-tty", "--pinentry-mode",
            "loopback", "--status-fd", "2", "--no-auto-key-retrieve", "--trust-model", "always",
            "--max-output", str(m.wire_bytes + GPG_SLACK), "--yes", "--output", str(dst),
            "--decrypt", "--", str(m.path),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        fd = os.open(dst, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    walls = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _pmap(one, made, parallel)
        walls.append(time.perf_counter() - t0)
    n = sum(m.rows for m in made)
    wire = sum(m.wire_bytes for m in made) / MB
    best = min(walls)
    return {"parallel": parallel, "walls_s": [round(w, 3) for w in walls],
            "wire_mb_s": wire / best, **_rates(n, body_mb, best)}  # fmt: skip


def verify_alone(
    made: Sequence[Made], cfg: Config, plain: Path, parallel: int, body_mb: float
) -> dict[str, Any]:
    """``verify_file`` (checks 1-7: gpg, sha256, manifest, rows) of every file in this process,
    no Spark; ``parallel`` threads (the executors run ``defaultParallelism`` tasks)."""
    plain.mkdir(parents=True, exist_ok=True)
    ctx = dataclasses.replace(VerifyContext.from_config(cfg), plain_dir=str(plain))

    def one(m: Made) -> None:
        v = verify_file(m.path, m.name, ctx)
        if not v.ok:
            raise RuntimeError(f"bundle {m.name}: verify_file rejected it: {v.reason} {v.detail}")
        Path(v.plaintext_path or "").unlink()

    t0 = time.perf_counter()
    _pmap(one, made, parallel)
    secs = time.perf_counter() - t0
    return {"parallel": parallel, **_rates(sum(m.rows for m in made), body_mb, secs)}


def pyarrow_read(plains: Sequence[Path], n: int, body_mb: float, rounds: int = 2) -> dict[str, Any]:
    """``pq.read_table`` of every plaintext (all columns); best of ``rounds``."""
    walls = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        rows = sum(pq.read_table(p).num_rows for p in plains)
        walls.append(time.perf_counter() - t0)
        if rows != n:
            raise RuntimeError(f"plaintexts hold {rows} rows, expected {n}")
    return _rates(n, body_mb, min(walls))


def messages_rows(plain: Path, m: Made, land_seq: int, at: dt.datetime) -> pa.Table:
    """A bundle's rows in the ``messages`` schema, red columns added as the landing adds them."""
    t = pq.read_table(plain)
    k = t.num_rows
    extra = {
        "bundle_seq": pa.array([m.bundle_seq] * k, pa.int64()),
        "bundle_id": pa.array([m.bundle_id] * k, pa.string()),
        "land_seq": pa.array([land_seq] * k, pa.int64()),
        "landed_at": pa.array([at] * k, pa.timestamp("us", tz="UTC")),
        "landed_date": pa.array([at.date()] * k, pa.date32()),
    }
    schema = rs.messages_schema()
    cols = [(extra[f.name] if f.name in extra else t.column(f.name)).cast(f.type) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def raw_delta(
    plains: Sequence[Path], made: Sequence[Made], root: Path, body_mb: float
) -> dict[str, Any]:
    """``write_deltalake`` of the same rows (messages schema, in memory before the clock starts)
    into a new table partitioned like ``messages``: one commit for all, one commit per bundle."""
    at = dt.datetime.now(dt.UTC)
    tables = [messages_rows(p, m, 1, at) for p, m in zip(plains, made, strict=True)]
    n = sum(t.num_rows for t in tables)
    parts = list(rs.MESSAGES_PARTITIONS)
    out: dict[str, Any] = {}
    for mode in ("one_commit", "commit_per_bundle"):
        path = root / f"delta-{mode}"
        DeltaTable.create(str(path), rs.messages_schema(), partition_by=parts)
        t0 = time.perf_counter()
        if mode == "one_commit":
            batches = (b for t in tables for b in t.to_batches())
            reader = pa.RecordBatchReader.from_batches(rs.messages_schema(), batches)
            write_deltalake(str(path), reader, mode="append", partition_by=parts)
        else:
            for t in tables:
                write_deltalake(str(path), t, mode="append", partition_by=parts)
        secs = time.perf_counter() - t0
        got = DeltaTable(str(path)).to_pyarrow_dataset().count_rows()
        if got != n:
            raise RuntimeError(f"raw Delta table {path} holds {got} rows, expected {n}")
        out[mode] = _rates(n, body_mb, secs)
        shutil.rmtree(path)
    return out


# -- the red job, instrumented --------------------------------------------------------------------
def _append_key(_tables: Any, name: str, *args: Any, **kw: Any) -> str:
    return f"append_{name}"


class Probe:
    """Wall seconds and calls by step of the landing, from wrapped methods (class-level patches
    of bridge.red, undone on exit; bridge/ itself is not changed)."""

    def __init__(self) -> None:
        self.secs: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.marks: dict[str, float] = {}
        self.batches: list[dict[str, Any]] = []
        self._where = threading.local()
        """``tick`` / ``recover`` while one runs on this thread: their appends and moves are
        kept apart from the micro-batches' (ticks run on the job's main thread)."""

    def add(self, key: str, secs: float) -> None:
        scope = getattr(self._where, "scope", None)
        key = f"{scope}:{key}" if scope else key
        self.secs[key] += secs
        self.calls[key] += 1

    def scoped(self, scope: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def timed(*args: Any, **kw: Any) -> Any:
            probe._where.scope = scope
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                probe._where.scope = None
                probe.add(scope, time.perf_counter() - t0)

        return timed

    def timer(self, key: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                probe.add(key(*args, **kw) if callable(key) else key, time.perf_counter() - t0)

        return timed

    def _timed_messages(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``Landing._messages`` returns a lazy reader delta-rs consumes while it writes: time the
        reader's own work (plaintext Parquet read, red columns) batch by batch."""
        probe = self

        def timed(*args: Any, **kw: Any) -> Any:
            reader, counted = fn(*args, **kw)

            def batches() -> Iterator[pa.RecordBatch]:
                while True:
                    t0 = time.perf_counter()
                    try:
                        b = reader.read_next_batch()
                    except StopIteration:
                        probe.secs["read_plaintexts"] += time.perf_counter() - t0
                        return
                    probe.add("read_plaintexts", time.perf_counter() - t0)
                    yield b

            return pa.RecordBatchReader.from_batches(reader.schema, batches()), counted

        return timed

    def _marking_apply(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                t1 = time.perf_counter()
                probe.add("apply", t1 - t0)
                if not getattr(probe._where, "scope", None):
                    probe.marks["last_commit"] = t1

        return timed

    @contextmanager
    def installed(self) -> Iterator[Probe]:
        patches: list[tuple[Any, str, Callable[..., Any]]] = [
            (Landing, "submit", lambda f: self.timer("landing", f)),
            (Landing, "_wait", lambda f: self.timer("wait_apply", f)),
            (Landing, "drain", lambda f: self.scoped("drain", f)),
            (Landing, "_apply", self._marking_apply),
            (Landing, "_messages", self._timed_messages),
            (Landing, "tick", lambda f: self.scoped("tick", f)),
            (Landing, "recover", lambda f: self.scoped("recover", f)),
            (RedTables, "append", lambda f: self.timer(_append_key, f)),
            (RedTables, "set_chain_status", lambda f: self.timer("chain_updates", f)),
            (RedTables, "landed_sha256", lambda f: self.timer("ledger_lookups", f)),
            (Evidence, "processed", lambda f: self.timer("evidence_moves", f)),
            (Evidence, "quarantine", lambda f: self.timer("evidence_moves", f)),
            (tables_module, "_conform", lambda f: self.timer(lambda t, *a: f"conform_{t}", f)),
            (landing_module, "atomic_write_bytes", lambda f: self.timer("journal_writes", f)),
        ]  # fmt: skip
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        for (obj, name, wrap), (_, _, orig) in zip(patches, saved, strict=True):
            setattr(obj, name, wrap(orig))
        try:
            yield self
        finally:
            for obj, name, orig in saved:
                setattr(obj, name, orig)


class _TimedFrame:
    """The micro-batch DataFrame handed to the sink, its ``toArrow()`` timed: that is when
    Spark runs the batch's tasks (the executors verify and decrypt its files)."""

    def __init__(self, df: Any, probe: Probe, batch: dict[str, Any]) -> None:
        self._df, self._probe, self._batch = df, probe, batch

    def toArrow(self) -> pa.Table:  # noqa: N802 - Spark's name
        t0 = time.perf_counter()
        table = self._df.toArrow()
        t1 = time.perf_counter()
        secs = t1 - t0
        self._probe.add("execute", secs)
        self._probe.marks.setdefault("first_verdicts", t1)
        self._batch.update(files=table.num_rows, execute_s=round(secs, 3))
        return table

    def __getattr__(self, name: str) -> Any:
        return getattr(self._df, name)


class TimedRun(RedRun):
    """``RedRun`` that notes when the query starts and times each micro-batch of its sink."""

    def __init__(self, cfg: Config, probe: Probe) -> None:
        super().__init__(cfg)
        self.probe = probe
        self.query: Any = None

    def start_query(self, spark: Any, trigger: Any) -> Any:
        t0 = time.perf_counter()
        self.probe.marks["query_start_begin"] = t0
        self.query = super().start_query(spark, trigger)
        self.probe.marks["query_started"] = time.perf_counter()
        self.probe.add("query_start", self.probe.marks["query_started"] - t0)
        return self.query

    def _sink(self, df: Any, batch_id: int) -> None:
        t0 = time.perf_counter()
        self.probe.marks.setdefault("first_batch", t0)
        landing0 = self.probe.secs["landing"]
        batch: dict[str, Any] = {"batch_id": batch_id}
        super()._sink(_TimedFrame(df, self.probe, batch), batch_id)
        t1 = time.perf_counter()
        self.probe.add("sink", t1 - t0)
        self.probe.marks["last_batch_end"] = t1
        batch["landing_s"] = round(self.probe.secs["landing"] - landing0, 3)
        batch["sink_s"] = round(t1 - t0, 3)
        self.probe.batches.append(batch)


def _progress(query: Any) -> dict[str, Any]:
    """Spark's own per-batch durations (StreamingQueryProgress.durationMs), summed."""
    sums: dict[str, int] = defaultdict(int)
    batches = 0
    try:
        progress = query.recentProgress
    except Exception as e:  # noqa: BLE001 - a report detail, not a result
        return {"error": str(e)}
    for p in progress:
        if not p.numInputRows:
            continue
        batches += 1
        for k, v in (p.durationMs or {}).items():
            sums[k] += int(v)
    return {"batches_with_rows": batches, "duration_ms": dict(sorted(sums.items()))}


def _check_landed(cfg: Config, summary: dict[str, Any], n: int, files: int) -> int:
    got = DeltaTable(str(Path(cfg.red.tables_dir) / "messages")).to_pyarrow_dataset().count_rows()
    if summary.get("messages_landed") != n or summary.get("rejected") or got != n:
        raise RuntimeError(
            f"red run of {files} bundles on channel {CHANNEL!r}: expected {n} messages landed, "
            f"none rejected; summary {summary}, messages table holds {got} rows"
        )
    return got


def breakdown(p: Probe, t0: float, t1: float) -> list[tuple[int, str, float]]:
    """(depth, step, seconds): the run split into steps; residues are named as such."""
    s, mk = p.secs, p.marks
    run = t1 - t0
    setup = mk["query_start_begin"] - t0
    to_first = mk.get("first_batch", t1) - mk["query_started"]
    after_last = t1 - mk.get("last_batch_end", t1)
    between = (mk.get("last_batch_end", t1) - mk.get("first_batch", t1)) - s["sink"]
    sink_rest = s["sink"] - s["execute"] - s["landing"]
    msgs = s["append_messages"]
    conform_msgs = s["conform_messages"]
    write_msgs = msgs - s["read_plaintexts"] - conform_msgs
    other_tables = s["append_bundles"] + s["append_audit"]
    apply_rest = (
        s["apply"] - msgs - other_tables - s["chain_updates"] - s["evidence_moves"]
    )  # state save (its journal write is counted below), hold dir removal
    judge = s["landing"] - s["wait_apply"]
    return [
        (0, "whole run (RedRun.run, warm Spark)", run),
        (1, "set-up: config check, lock, recover, tables ensure", setup),
        (1, "query start (writeStream.start)", s["query_start"]),
        (1, "query started -> 1st batch (intake scan, planning)", to_first),
        (1, "Spark between batches (offsets, WAL, planning)", between),
        (1, "execute: verify+decrypt on executors (toArrow)", s["execute"]),
        (1, "landing in the sink (Landing.submit)", s["landing"]),
        (2, "waiting for the last batch's apply", s["wait_apply"]),
        (2, "judge: verdict rows, sequence checks, intent", judge),
        (3, "ledger look-ups (landed_sha256)", s["ledger_lookups"]),
        (3, "journal writes, fsynced (intent; the apply's state save too)", s["journal_writes"]),
        (1, "apply, background thread (overlaps the next batch)", s["apply"]),
        (2, "Delta append: messages", msgs),
        (3, "read plaintexts + red columns", s["read_plaintexts"]),
        (3, "conform to the table schema", conform_msgs),
        (3, "delta-rs write + commit", write_msgs),
        (2, "Delta append: bundles + audit", other_tables),
        (2, "chain status updates", s["chain_updates"]),
        (2, "evidence moves (intake -> processed/)", s["evidence_moves"]),
        (2, "rest of apply (state save, hold dir)", apply_rest),
        (1, "rest of the sink", sink_rest),
        (1, "timer ticks (Landing.tick, between batches too)", s["tick"]),
        (1, "after the last batch (query end, last apply, tick)", after_last),
        (2, "waiting for the last apply (Landing.drain)", s["drain"]),
    ]


def red_inprocess(
    spark: Any, cfg: Config, made: Sequence[Made], body_bytes: int, warm_up: bool = False
) -> dict[str, Any]:
    """Land ``made`` with ``RedRun(cfg).run(spark, "available-now")``, instrumented."""
    n = sum(m.rows for m in made)
    drop(cfg, made)
    probe = Probe()
    with sampled() as meter, probe.installed():
        t0 = time.perf_counter()
        run = TimedRun(cfg, probe)
        summary = run.run(spark, "available-now").to_json()
        t1 = time.perf_counter()
    _check_landed(cfg, summary, n, len(made))
    mk = probe.marks
    window = mk["last_commit"] - mk["first_batch"]
    run_s = t1 - t0
    body_mb = n * body_bytes / MB
    out: dict[str, Any] = {
        "messages": n,
        "bundles": len(made),
        "summary": summary,
        "run_s": round(run_s, 3),
        "run_msg_s": n / run_s,
        "run_mb_s": body_mb / run_s,
        "window_s": round(window, 3),
        "window_msg_s": n / window,
        "window_mb_s": body_mb / window,
        "verdict_to_commit_s": round(mk["last_commit"] - mk["first_verdicts"], 3),
        "verdict_to_commit_msg_s": n / (mk["last_commit"] - mk["first_verdicts"]),
        "landing_s": round(probe.secs["landing"], 3),
        "landing_msg_s": n / probe.secs["landing"],
        "execute_s": round(probe.secs["execute"], 3),
        "execute_msg_s": n / probe.secs["execute"],
        "execute_mb_s": body_mb / probe.secs["execute"],
        "landing_mb_s": body_mb / probe.secs["landing"],
        "batches": probe.batches,
        "steps_s": {k: round(v, 3) for k, v in sorted(probe.secs.items())},
        "calls": dict(sorted(probe.calls.items())),
        "breakdown": [
            {
                "depth": d,
                "step": name,
                "seconds": round(v, 3),
                "pct_of_run": round(100 * v / run_s, 1),
            }
            for d, name, v in breakdown(probe, t0, t1)
        ],
        "spark_progress": _progress(run.query),
        **meter,
    }
    if not warm_up:
        out["met"] = out["run_msg_s"] >= TARGET_MSG_S
    return out


def _log_times(path: Path) -> dict[str, list[float]]:
    """Epoch seconds of the subprocess's JSON log lines of interest, by message."""
    want = ("red job starting", "inbox scanned", "landed")
    out: dict[str, list[float]] = {k: [] for k in want}
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("msg") in out and "ts" in doc:
            at = dt.datetime.strptime(doc["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)
            out[doc["msg"]].append(at.timestamp())
    return out


def red_subprocess(
    cfg: Config, made: Sequence[Made], log_dir: Path, body_bytes: int
) -> dict[str, Any]:
    """Land ``made`` with ``spark_jobs/red_land.py`` in a new process (cold: its own JVM)."""
    n = sum(m.rows for m in made)
    drop(cfg, made)
    err = log_dir / "red_land.stderr"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DIODE_LOG_LEVEL": "INFO",
           "DIODE_LOG_FORMAT": "json"}  # fmt: skip
    cmd = [sys.executable, str(REPO / "spark_jobs" / "red_land.py"), "--config", str(cfg.source)]
    with sampled() as meter, open(err, "wb") as ef:
        wall0 = time.time()
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=ef, cwd=REPO, env=env, check=False
        )
        secs = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"spark_jobs/red_land.py --config {cfg.source} exited {proc.returncode} "
            f"(stderr in {err})"
        )
    summary = json.loads(lines[-1])
    _check_landed(cfg, summary, n, len(made))
    marks = _log_times(err)
    out: dict[str, Any] = {
        "messages": n,
        "summary": summary,
        "wall_s": round(secs, 3),
        "wall_msg_s": n / secs,
        "wall_mb_s": n * body_bytes / MB / secs,
        "run_s": summary.get("seconds"),  # RedRun.run inside the job: Spark already up
        "stderr": str(err),
        **meter,
    }
    if marks["red job starting"]:
        out["spark_start_s"] = round(marks["red job starting"][0] - wall0, 3)
    if marks["inbox scanned"] and marks["landed"]:
        w = marks["landed"][-1] - marks["inbox scanned"][0]
        out["window_s"] = round(w, 3)
        out["window_msg_s"] = n / w if w > 0 else None
        out["landings"] = len(marks["landed"])
    out["met"] = out["wall_msg_s"] >= TARGET_MSG_S
    return out


# -- setup ----------------------------------------------------------------------------------------
def write_config(
    work: Path, inv: KeyInventory, name: str, *, engine: str, files_per_batch: int | None
) -> Config:
    d = work / name
    extra = f"max_files_per_batch = {files_per_batch}\n" if files_per_batch else ""
    p = work / f"{name}.toml"
    p.write_text(f"""
[link]
bridge_id = "{BRIDGE_ID}"
black_signers = ["{inv.black_fpr}"]
[[channels]]
name = "{CHANNEL}"
encrypt = true
recipients = {json.dumps(list(inv.red_fprs.values()))}
[red]
gnupg_home = "{inv.red_home}"
inbox = "{d}/inbox"
work_dir = "{d}/work"
processed_dir = "{d}/processed"
quarantine_dir = "{d}/quarantine"
state_dir = "{d}/state"
checkpoint_dir = "{d}/checkpoint"
tables_dir = "{d}/tables"
delta_engine = "{engine}"
settle_seconds = 0.0
{extra}""")
    return load_config(p)


def kill_agents(inv: KeyInventory) -> None:
    for home in (inv.black_home, inv.red_home):
        subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"],
                       check=False, capture_output=True)  # fmt: skip


_LOG: list[int] = []
"""File descriptor of the run's log: each step's stdout and stderr (JVM, gpg) go there."""


@contextmanager
def _to_log() -> Iterator[None]:
    if not _LOG:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(_LOG[0], 1)
    os.dup2(_LOG[0], 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def timed(label: str, fn: Callable[[], Any]) -> Any:
    print(f"  {label} ...", end="", flush=True)
    t0 = time.perf_counter()
    with _to_log():
        r = fn()
    print(f" {time.perf_counter() - t0:.1f} s", flush=True)
    return r


# -- one size -------------------------------------------------------------------------------------
@dataclass
class Scenario:
    key: str
    bundles: int
    rows: int
    body_bytes: int
    subprocess: bool
    made: list[Made] = field(default_factory=list)

    @property
    def messages(self) -> int:
        return self.bundles * self.rows

    @property
    def body_mb(self) -> float:
        return self.messages * self.body_bytes / MB


def baselines(sc: Scenario, inv: KeyInventory, cfg: Config, work: Path, par: int) -> dict[str, Any]:
    plain = work / f"{sc.key}-plain"
    b: dict[str, Any] = {}
    b["gpg_1"] = timed("raw gpg --decrypt, 1 at a time",
                       lambda: raw_gpg_decrypt(sc.made, inv, plain, 1, sc.body_mb))  # fmt: skip
    b["gpg_p"] = timed(f"raw gpg --decrypt, {par} at a time",
                       lambda: raw_gpg_decrypt(sc.made, inv, plain, par, sc.body_mb))  # fmt: skip
    b["verify_p"] = timed(
        f"verify_file in-process, {par} threads",
        lambda: verify_alone(sc.made, cfg, work / f"{sc.key}-verify", par, sc.body_mb),
    )
    plains = [plain / f"{m.name}.parquet" for m in sc.made]
    b["pyarrow_read"] = timed(
        "pyarrow read of the plaintexts", lambda: pyarrow_read(plains, sc.messages, sc.body_mb)
    )
    b["delta"] = timed(
        "raw write_deltalake", lambda: raw_delta(plains, sc.made, work / sc.key, sc.body_mb)
    )
    shutil.rmtree(plain, ignore_errors=True)
    return b


def ratios(res: dict[str, Any], base: dict[str, Any], unit: str) -> dict[str, float | None]:
    k = "msg_s" if unit == "msg" else "mb_s"
    out: dict[str, float | None] = {}
    for name, rate in (
        ("inprocess_run", res["inprocess"][f"run_{k}"]),
        ("inprocess_window", res["inprocess"][f"window_{k}"]),
        ("subprocess_wall", res.get("subprocess", {}).get(f"wall_{k}")),
    ):
        for bname, b in (
            ("gpg_1", base["gpg_1"]),
            ("gpg_p", base["gpg_p"]),
            ("verify_p", base["verify_p"]),
            ("pyarrow_read", base["pyarrow_read"]),
            ("delta_one_commit", base["delta"]["one_commit"]),
            ("delta_commit_per_bundle", base["delta"]["commit_per_bundle"]),
        ):
            out[f"{name}/{bname}"] = rate / b[k] if rate else None
    return out


# -- report ---------------------------------------------------------------------------------------
def _rate(v: float | None, unit: str) -> str:
    if v is None:
        return f"{'-':>16}"
    return f"{v:>10,.0f} msg/s" if unit == "msg" else f"{v:>11,.1f} MB/s"


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:>6.2f}" if a and b else f"{'-':>6}"


def print_scenario(title: str, s: dict[str, Any], unit: str) -> None:
    line = "-" * 131
    k = "msg_s" if unit == "msg" else "mb_s"
    b = s["baselines"]
    delta = max(b["delta"]["one_commit"][k], b["delta"]["commit_per_bundle"][k])
    cols = [("gpg1", b["gpg_1"][k]), (f"gpg{b['gpg_p']['parallel']}", b["gpg_p"][k]),
            ("verify", b["verify_p"][k]), ("read", b["pyarrow_read"][k]),
            ("delta", delta)]  # fmt: skip
    head = "".join(f"{'x ' + c:>9}" for c, _ in cols)
    title += "; x delta: the faster raw write_deltalake"
    print(f"\n{line}\n{title}\n{'':<66}{'rate':>16}{head}  target\n{line}")

    def row(label: str, rate: float | None, target: str = "") -> None:
        print(f"{label:<66}{_rate(rate, unit)}{''.join(f'{_x(rate, v):>9}' for _, v in cols)}"
              f"  {target}")  # fmt: skip

    row("  raw gpg --decrypt, 1 at a time", b["gpg_1"][k])
    row(f"  raw gpg --decrypt, {b['gpg_p']['parallel']} at a time", b["gpg_p"][k])
    row(f"  verify_file in-process, {b['verify_p']['parallel']} threads (no Spark)",
        b["verify_p"][k])  # fmt: skip
    row("  pyarrow read of the plaintexts", b["pyarrow_read"][k])
    row("  raw write_deltalake, one commit", b["delta"]["one_commit"][k])
    row("  raw write_deltalake, a commit per bundle", b["delta"]["commit_per_bundle"][k])
    r = s["inprocess"]
    tgt = f">= {TARGET_MSG_S:,.0f} {'met' if r.get('met') else 'NOT met'}" if unit == "msg" else ""
    row(f"  red job in-process, whole run ({r['run_s']:.1f} s, warm Spark)", r[f"run_{k}"], tgt)
    row(f"  ... landing window, 1st batch -> last commit ({r['window_s']:.1f} s)",
        r[f"window_{k}"])  # fmt: skip
    v2c = r["verdict_to_commit_s"]
    row(
        f"  ... 1st batch's verdicts -> last commit ({v2c:.1f} s)",
        (
            r["verdict_to_commit_msg_s"]
            if unit == "msg"
            else s["body_bytes"] / MB * r["messages"] / v2c
        ),
    )
    row(f"  ... execute alone: verify on executors ({r['execute_s']:.1f} s)", r[f"execute_{k}"])
    row(f"  ... sink's landing alone: Landing.submit ({r['landing_s']:.1f} s)",
        r[f"landing_{k}"])  # fmt: skip
    if "subprocess" in s:
        p = s["subprocess"]
        tgt = f">= {TARGET_MSG_S:,.0f} {'met' if p['met'] else 'NOT met'}" if unit == "msg" else ""
        row(f"  red_land.py subprocess, whole run incl. Spark start ({p['wall_s']:.1f} s)",
            p[f"wall_{k}"], tgt)  # fmt: skip
        if p.get("window_msg_s"):
            w = p["window_msg_s"] if unit == "msg" else p["window_msg_s"] * s["body_bytes"] / MB
            row(f"  ... its window, 'inbox scanned' -> last 'landed' ({p['window_s']:.1f} s)", w)
        print(f"  ... Spark start to 'red job starting' {p.get('spark_start_s', '-')} s; "
              f"RedRun.run {p.get('run_s')} s; peak RSS {p['memory']['peak_mb']:,.0f} MB; "
              f"CPU s {p['cpu_s']}")  # fmt: skip
    print(f"  in-process: {r['summary']['batches']} batches, files per batch "
          f"{[x.get('files') for x in r['batches']]}; peak RSS {r['memory']['peak_mb']:,.0f} MB "
          f"(at peak: {r['memory']['at_peak_by_kind_mb']}); CPU s {r['cpu_s']}")  # fmt: skip
    print(f"\n  where the in-process run's time goes{'':<24}{'seconds':>10}{'% run':>8}")
    for st in r["breakdown"]:
        label = "  " + "  " * st["depth"] + st["step"]
        print(f"{label:<70}{st['seconds']:>10.2f}{st['pct_of_run']:>8.1f}")
    sp = r["spark_progress"].get("duration_ms", {})
    if sp:
        print("  Spark's durationMs, summed over batches: "
              + ", ".join(f"{k2} {v / 1000:.2f} s" for k2, v in sp.items()))  # fmt: skip


def print_table(res: dict[str, Any]) -> None:
    print(f"\nSpark {res['spark_master']}, defaultParallelism {res['parallelism']}, "
          f"{res['cpus']} CPUs, Delta engine {res['engine']}, load at start "
          f"{res['load_avg_at_start'][0]:.2f}; Spark session start {res['spark_start_s']} s; "
          f"warm-up run (excluded) {res['warmup']['run_s']} s")  # fmt: skip
    for key, unit in (("small", "msg"), ("large", "mb")):
        if key in res:
            s = res[key]
            title = (f"{s['messages']:,} messages of {s['body_bytes']:,} B in {s['bundles']} "
                     f"bundles of {s['rows']:,} (plaintext {s['plain_mb']:,.0f} MB, wire "
                     f"{s['wire_mb']:,.0f} MB); ratios: rate / baseline")  # fmt: skip
            print_scenario(title, s, unit)
    print("-" * 131)


# -- main -----------------------------------------------------------------------------------------
def run_scenario(
    sc: Scenario, inv: KeyInventory, work: Path, spark: Any, a: argparse.Namespace, par: int
) -> dict[str, Any]:
    print(f"{sc.key}: {sc.bundles} bundles x {sc.rows:,} rows x {sc.body_bytes:,} B")
    sc.made = timed("seal bundles", lambda: make_chain(work / f"{sc.key}-made", inv, sc.bundles,
                                                        sc.rows, sc.body_bytes))  # fmt: skip
    cfg_in = write_config(
        work, inv, f"{sc.key}-in", engine=a.engine, files_per_batch=a.files_per_batch
    )
    out: dict[str, Any] = {
        "messages": sc.messages, "bundles": sc.bundles, "rows": sc.rows,
        "body_bytes": sc.body_bytes,
        "plain_mb": sum(m.plain_bytes for m in sc.made) / MB,
        "wire_mb": sum(m.wire_bytes for m in sc.made) / MB,
    }  # fmt: skip
    out["baselines"] = base = baselines(sc, inv, cfg_in, work, par)
    out["inprocess"] = timed(
        "red job in-process, available-now",
        lambda: red_inprocess(spark, cfg_in, sc.made, sc.body_bytes),
    )
    shutil.rmtree(work / f"{sc.key}-in", ignore_errors=True)
    out["ratios"] = ratios(out, base, "msg" if sc.body_bytes < MB else "mb")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bundles", type=int, default=40, help="1 KB scenario: bundles (0: skip)")
    ap.add_argument("--rows", type=int, default=5000, help="1 KB scenario: rows per bundle")
    ap.add_argument("--body-bytes", type=int, default=KB, help="1 KB scenario: body size")
    ap.add_argument("--large-bundles", type=int, default=20, help="1 MB scenario (0: skip)")
    ap.add_argument("--large-rows", type=int, default=50, help="1 MB scenario: rows per bundle")
    ap.add_argument("--large-bytes", type=int, default=MB, help="1 MB scenario: body size")
    ap.add_argument("--files-per-batch", type=int, default=None,
                    help="red.max_files_per_batch (default: the config default)")  # fmt: skip
    ap.add_argument("--engine", default="auto", choices=["auto", "spark", "delta-rs"],
                    help="red.delta_engine")  # fmt: skip
    ap.add_argument("--no-subprocess", action="store_true", help="skip the red_land.py run")
    ap.add_argument("--replay", type=int, default=50_000,
                    help="replay vs raw pika publish: messages (0: skip)")  # fmt: skip
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="work disk")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args()
    os.environ.setdefault("DIODE_LOG_LEVEL", "WARNING")  # Spark's Python workers
    setup_logging(os.environ["DIODE_LOG_LEVEL"])
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).isoformat(),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(a).items()},
        "target_msg_s": TARGET_MSG_S,
    }
    # short root: gpg-agent socket paths are limited to ~100 bytes
    work = Path(tempfile.mkdtemp(prefix="dbr-", dir=a.dir))
    log_path = a.out / f"red-{stamp}.log"
    _LOG.append(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    print(f"step logs (JVM, gpg, red_land.py) in {log_path}")
    inv: KeyInventory | None = None
    spark = None
    try:
        inv = timed("keys", lambda: init_keys(work / "keys", red_names=("red", "audit"),
                                              bridge_id=BRIDGE_ID))  # fmt: skip
        print("Spark")
        t0 = time.perf_counter()
        spark = session = timed("session start", lambda: get_spark("diode-bench-red"))
        timed("first job", lambda: session.range(10).count())
        res["spark_start_s"] = round(time.perf_counter() - t0, 2)
        res["spark_master"] = spark.sparkContext.master
        par = res["parallelism"] = int(spark.sparkContext.defaultParallelism)
        warm_cfg = write_config(
            work, inv, "warm", engine=a.engine, files_per_batch=a.files_per_batch
        )
        res["engine"] = tables_module.resolve_engine(warm_cfg.red.delta_engine, spark)
        warm = make_chain(work / "warm-made", inv, 2, 200, KB)
        res["warmup"] = timed(
            "warm-up run, available-now (excluded)",
            lambda: red_inprocess(spark, warm_cfg, warm, KB, warm_up=True),
        )
        small: Scenario | None = None
        if a.bundles:
            small = Scenario("small", a.bundles, a.rows, a.body_bytes, not a.no_subprocess)
            res["small"] = run_scenario(small, inv, work, spark, a, par)
        if a.large_bundles:
            large = Scenario("large", a.large_bundles, a.large_rows, a.large_bytes, False)
            res["large"] = run_scenario(large, inv, work, spark, a, par)
            shutil.rmtree(work / "large-made", ignore_errors=True)
        spark.stop()
        spark = None
        if small is not None and small.subprocess:
            print("red_land.py subprocess, cold (Spark in this process stopped)")
            cfg_sub = write_config(work, inv, "small-sub", engine=a.engine,
                                   files_per_batch=a.files_per_batch)  # fmt: skip
            sub = res["small"]["subprocess"] = timed(
                "spark_jobs/red_land.py, available-now",
                lambda: red_subprocess(cfg_sub, small.made, work, small.body_bytes),  # type: ignore[union-attr]
            )
            with open(log_path, "ab") as lf:
                lf.write(Path(sub["stderr"]).read_bytes())
            sub["stderr"] = str(log_path)
            res["small"]["ratios"] = ratios(res["small"], res["small"]["baselines"], "msg")
        if a.replay:
            print("replay publisher against raw confirmed publishing (benchmarks/replay.py)")
            res["replay"] = measure_replay(a.replay, KB, 1000, work / "replay")
    finally:
        if spark is not None:
            spark.stop()
        if inv is not None:
            kill_agents(inv)
        shutil.rmtree(work, ignore_errors=True)
        os.close(_LOG.pop())

    out = a.out / f"red-{stamp}.json"
    out.write_text(json.dumps(res, indent=2, default=str))
    print_table(res)
    if "replay" in res:
        print_replay(res["replay"])
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    exit_now(main())
