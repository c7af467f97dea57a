"""Scenario: kill -9 the red landing job, at each named crash point and at random moments;
every (channel, seq) lands exactly once and every delivered file is evidence exactly once.

Real gpg, real local Spark in a subprocess (``spark_jobs/red_land.py``) in its own process
group (a SIGKILL of the group takes the JVM and the Python workers), real Delta tables. The
clean runs that must end well (the template's, each recovery, the final one) run in the test's
process on the session's Spark: only a run that is killed needs a JVM of its own.

1. Deterministic: a template red world (some bundles landed, tables, state, checkpoint) is
   copied per crash point; more bundles of two channels (with a hole closed, so a chain status
   update is due), a junk file under a valid bundle name and a heartbeat are dropped; an
   ``available-now`` run with the point armed (``bridge.faults``) must die by SIGKILL in the
   second landing, and the journal and tables must show the window the point names. A clean run
   then finishes the landing and lands the rest (after ``red.after_tables``, a third run must
   find nothing to do and change nothing).
   A third case crashes the pipelined landing where Spark has already committed the batch
   whose landing is still being applied (its apply slowed down by ``bridge.faults``).
2. Random: ~30 small bundles, shuffled across channels and delivered in waves, while
   ``continuous`` runs are SIGKILLed at random moments and restarted; a final ``available-now``
   run lands the rest.

After both: ``messages`` holds each (channel, seq) once, with the body sent; the ledger has each
bundle landed once (chain statuses settled); audit event ids are unique and each file was
received once; every delivered file sits in processed/ or quarantine/ exactly once (no ``.1``
copy); the journal's intent, ``work_dir/plain`` and ``work_dir/landing`` are empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bridge.amqp.client import Connection
from bridge.config import Config, load_config
from bridge.faults import CRASH_ENV, MARK_ENV, SLOW_ENV
from bridge.red.evidence import REASON_SUFFIX
from bridge.red.job import run_red
from bridge.red.replay import Replayer
from tests.conftest import Vhost
from tests.red_factory import (
    RED_DIRS_TOML,
    BundleMade,
    RedKeys,
    kill_agents,
    make_chain,
    make_heartbeat,
)
from tests.support import REPO, crash_env, crash_marks

pytestmark = [pytest.mark.slow, pytest.mark.gpg, pytest.mark.spark]

JOB = REPO / "spark_jobs" / "red_land.py"
APP_ID = "diode-red"
CHANNELS = {"alpha": True, "beta": False}
"""Channel -> encrypt: alpha's bundles are signed and encrypted, beta's only signed."""
JOB_TIMEOUT = 240.0


# --------------------------------------------------------------------------- setup


def write_config(
    root: Path,
    keys: RedKeys,
    channels: dict[str, bool],
    *,
    replay: dict[str, Any] | None = None,
    **red: Any,
) -> Config:
    chans = "\n".join(
        f'[[channels]]\nname = "{n}"\nencrypt = {str(enc).lower()}\n'
        f"recipients = {json.dumps(keys.recipients)}\n"
        for n, enc in channels.items()
    )
    extra = "\n".join(f"{k} = {json.dumps(v)}" for k, v in red.items())
    text = f"""
[link]
bridge_id = "diode-bridge"
black_signers = ["{keys.black_fpr}"]

{chans}
[red]
gnupg_home = "{keys.red_home}"
{RED_DIRS_TOML}{extra}
"""
    if replay is not None:
        text += "\n[red.replay]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in replay.items())
    root.mkdir(parents=True, exist_ok=True)
    p = root / "diode.toml"
    p.write_text(text)
    return load_config(p)


def drop(cfg: Config, *files: Path) -> None:
    """Copy ``files`` into the inbox, each under a hidden name first, then renamed (atomic)."""
    inbox = Path(cfg.red.inbox)
    inbox.mkdir(parents=True, exist_ok=True)
    for f in files:
        tmp = inbox / f".{f.name}.part"
        shutil.copyfile(f, tmp)
        os.replace(tmp, inbox / f.name)


def junk_bundle(made: Path, channel: str, bundle_seq: int) -> Path:
    """A hostile file under a valid bundle name: not a gpg message at all."""
    p = made / f"{channel}.{bundle_seq:012d}.{os.urandom(16).hex()}.dbundle"
    p.write_bytes(b"\x00not a gpg message at all" * 40)
    return p


class RedJob:
    """``spark_jobs/red_land.py`` in its own process group, so SIGKILL reaches the JVM too."""

    def __init__(
        self,
        cfg: Config,
        trigger: str,
        *,
        tag: str,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        full = dict(os.environ)
        for k in (CRASH_ENV, MARK_ENV, "DIODE_CONFIG"):
            full.pop(k, None)
        full.update(
            PYTHONPATH=os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            DIODE_LOG_LEVEL="INFO",
            DIODE_LOG_FORMAT="json",
            DIODE_SPARK_LOG_LEVEL="ERROR",
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
        )
        full.update(env or {})
        assert cfg.source is not None
        log_dir = Path(cfg.source).parent / "logs"
        log_dir.mkdir(exist_ok=True)
        self.tag = tag
        self.stdout_path = log_dir / f"{tag}.stdout"
        self.stderr_path = log_dir / f"{tag}.stderr"
        self._out = open(self.stdout_path, "wb")  # noqa: SIM115 - closed by kill()/wait()
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115
        cmd = [sys.executable, str(JOB), "--config", str(cfg.source), "--trigger", trigger]
        if timeout is not None:
            cmd += ["--timeout", str(timeout)]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=full, stdout=self._out, stderr=self._err, start_new_session=True
        )

    def running(self) -> bool:
        return self.proc.poll() is None

    def _close(self) -> None:
        self._out.close()
        self._err.close()

    def kill(self) -> None:
        """SIGKILL the whole group: python driver, Spark JVM, python workers, gpg."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._close()

    def wait(self, timeout: float = JOB_TIMEOUT) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
            print(f"job {self.tag}: rc {rc} after {time.monotonic() - self.started:.1f}s")
            return rc
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"red job {self.tag} still running after {timeout}s:\n{self.tail()}")
        finally:
            self._close()

    def summary(self) -> dict[str, Any]:
        """The run summary the job prints as its last stdout line when it ends normally."""
        lines = [x for x in self.stdout_path.read_text().splitlines() if x.startswith('{"batches"')]
        assert lines, f"red job {self.tag} printed no summary:\n{self.tail()}"
        return dict(json.loads(lines[-1]))

    def errors(self, n: int = 15) -> str:
        """The first error lines of the job's stderr (its log and Python's tracebacks)."""
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        hits = [x[:600] for x in text.splitlines() if "rror" in x or "xception" in x]
        return "\n".join(hits[:n])

    def tail(self, n: int = 40) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return "\n".join(text.splitlines()[-n:])


class Publisher:
    """``diode red replay`` (the replay publisher) in its own process group."""

    def __init__(self, cfg: Config, tag: str) -> None:
        assert cfg.source is not None
        log = Path(cfg.source).parent / "logs" / f"{tag}.log"
        log.parent.mkdir(exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(REPO), DIODE_LOG_FORMAT="json")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from bridge.cli import main; main()",
                 "red", "replay", "--config", str(cfg.source)],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def run_clean(cfg: Config, spark: Any) -> dict[str, Any]:
    """An unarmed ``available-now`` run that must end well, in this process on the session's
    Spark (a JVM start saved: only the runs that are killed need a process of their own);
    returns its summary."""
    return run_red(cfg, spark, "available-now").to_json()


def wait_until(cond: Callable[[], bool], timeout: float, what: str, job: RedJob) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if not job.running():
            pytest.fail(
                f"red job {job.tag} exited ({job.proc.poll()}) before {what}:\n{job.errors()}\n"
                f"...\n{job.tail()}"
            )
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{job.tail()}")


# --------------------------------------------------------------------------- reading back


def table(cfg: Config, name: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
    dt = DeltaTable(str(Path(cfg.red.tables_dir) / name))
    return dt.to_pyarrow_table(columns=columns).to_pylist()


def txn(cfg: Config, name: str) -> int:
    """The newest ``diode-red`` app transaction version of table ``name`` (-1: none)."""
    v = DeltaTable(str(Path(cfg.red.tables_dir) / name)).transaction_version(APP_ID)
    return -1 if v is None else int(v)


def saved_land_seq(cfg: Config) -> int:
    try:
        doc = json.loads((Path(cfg.red.state_dir) / "red-state.json").read_bytes())
    except (FileNotFoundError, ValueError):
        return 0
    return int(doc["land_seq"])


def intent_path(cfg: Config) -> Path:
    return Path(cfg.red.state_dir) / "landing" / "intent.json"


def evidence_names(cfg: Config) -> list[str]:
    """Names of every file in processed/ and quarantine/ (reason files left out)."""
    out = []
    for d in (Path(cfg.red.processed_dir), Path(cfg.red.quarantine_dir)):
        out += [p.name for p in d.rglob("*") if p.is_file() and not p.name.endswith(REASON_SUFFIX)]
    return out


def check_exactly_once(
    cfg: Config,
    bundles: Sequence[BundleMade],
    hostile: Sequence[Path],
    others: Sequence[Path],
) -> None:
    """Everything the module doc promises, for ``bundles`` (must land), ``hostile`` (valid
    bundle names that must be quarantined) and ``others`` (heartbeats: processed)."""
    # messages: each (channel, seq) once, all of them, with the body sent
    want = {
        (r["channel"], r["seq"]): r["body"]
        for b in bundles
        for r in b.rows.select(["channel", "seq", "body"]).to_pylist()
    }
    msgs = table(cfg, "messages", ["channel", "seq", "body", "bundle_seq"])
    got = Counter((m["channel"], m["seq"]) for m in msgs)
    twice = sorted(k for k, n in got.items() if n > 1)
    assert not twice, f"{len(twice)} (channel, seq) landed more than once: {twice[:10]}"
    missing = sorted(set(want) - set(got))
    assert not missing, f"{len(missing)} (channel, seq) never landed: {missing[:10]}"
    assert set(got) == set(want), f"unexpected rows {sorted(set(got) - set(want))[:10]}"
    assert all(m["body"] == want[(m["channel"], m["seq"])] for m in msgs), "a body differs"

    # ledger: each bundle landed once, the hostile ones quarantined once, chains settled
    ledger = table(cfg, "bundles")
    landed = Counter((r["channel"], r["bundle_seq"]) for r in ledger if r["status"] == "landed")
    assert all(n == 1 for n in landed.values()), f"ledger lands twice: {landed}"
    assert set(landed) == {(b.manifest.channel, b.manifest.bundle_seq) for b in bundles}
    quarantined = Counter(r["file_name"] for r in ledger if r["status"] == "quarantined")
    assert quarantined == Counter(p.name for p in hostile), quarantined
    assert {r["status"] for r in ledger} <= {"landed", "quarantined"}, "duplicates or conflicts"
    chains = {
        (r["channel"], r["bundle_seq"]): r["chain_status"]
        for r in ledger
        if r["status"] == "landed"
    }
    for (channel, bseq), status in sorted(chains.items()):
        assert status == ("first" if bseq == 1 else "verified"), (channel, bseq, status)

    # audit: event ids unique, every file received once
    audit = table(cfg, "audit", ["event_id", "event", "file_name"])
    ids = Counter(a["event_id"] for a in audit)
    assert all(n == 1 for n in ids.values()), [k for k, n in ids.items() if n > 1]
    received = Counter(a["file_name"] for a in audit if a["event"] == "received")
    names = [b.name for b in bundles] + [p.name for p in (*hostile, *others)]
    assert received == Counter(names), f"received events: {received}"

    # evidence: every file in processed/ or quarantine/ exactly once, nothing left behind
    stored = Counter(evidence_names(cfg))
    assert stored == Counter(names), (
        f"evidence differs: extra {sorted((stored - Counter(names)).elements())}, "
        f"missing {sorted((Counter(names) - stored).elements())}"
    )
    q = Path(cfg.red.quarantine_dir)
    in_quarantine = {p.name for p in q.rglob("*.dbundle")}
    assert in_quarantine == {p.name for p in hostile}, in_quarantine
    work = Path(cfg.red.work_dir)
    assert not list(Path(cfg.red.inbox).iterdir()), "files left in the inbox"
    assert [p.name for p in (work / "intake").iterdir()] in ([], ["NEXT"]), "files left in intake"
    assert not intent_path(cfg).exists(), "the landing intent is still there"
    assert not list((work / "plain").iterdir()), "plaintexts left in work_dir/plain"
    assert not list((work / "landing").iterdir()), "held plaintexts left in work_dir/landing"
    assert max(txn(cfg, t) for t in ("messages", "bundles", "audit")) <= saved_land_seq(cfg)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    k = RedKeys.create(root)
    try:
        yield k
    finally:
        kill_agents(root)
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Template:
    """A red world after one clean run (alpha 1, beta 1 and 3 landed), to copy per test."""

    root: Path
    alpha: list[BundleMade]
    beta: list[BundleMade]
    first: list[BundleMade]
    """Landed by the template run."""
    later: list[Path]
    """To drop in each test: alpha 2-4, junk alpha 9, beta 2, 4, 5, a heartbeat of alpha."""
    junk: Path
    heartbeat: Path


@pytest.fixture(scope="module")
def template(keys: RedKeys, spark: Any) -> Template:
    made = keys.root / "made"
    made.mkdir()
    alpha = make_chain(made, keys, "alpha", 4, 10, encrypt=CHANNELS["alpha"])
    beta = make_chain(made, keys, "beta", 5, 10, exchange="audit", encrypt=CHANNELS["beta"])
    junk = junk_bundle(made, "alpha", 9)
    hb = make_heartbeat(made, keys, "alpha", 1, last_bundle_seq=4).path
    root = keys.root / "tpl"
    cfg = write_config(
        root, keys, CHANNELS, settle_seconds=0.0, max_files_per_batch=3,
        link_silent_seconds=3600.0, trigger_seconds=0.5,
    )  # fmt: skip
    first = [alpha[0], beta[0], beta[2]]
    drop(cfg, *(b.path for b in first))
    s = run_clean(cfg, spark)
    assert s["bundles_landed"] == 3 and s["rejected"] == 0, s
    # sorted as the intake takes them, 3 a batch: [a2 a3 a4] [a9-junk b2 b4] [b5 heartbeat];
    # the second landing has messages, a reject and closes beta's hole (b3 -> verified)
    later = [alpha[1].path, alpha[2].path, alpha[3].path, junk]
    later += [beta[1].path, beta[3].path, beta[4].path, hb]
    return Template(root, alpha, beta, first, later, junk, hb)


# --------------------------------------------------------------------------- 1. deterministic

POINTS = ["red.after_intent", "red.after_messages", "red.after_tables", "red.after_moves"]
NTH = 2
"""The crash fires in the run's second landing: [junk, beta 2, beta 4] (see ``template``)."""


def check_window(cfg: Config, point: str, n: int) -> dict[str, Any]:
    """Assert what the journal and the tables show after a crash at ``point`` in landing
    ``n``; returns the intent."""
    assert intent_path(cfg).exists(), f"{point}: no landing intent left by the crash"
    intent = json.loads(intent_path(cfg).read_bytes())
    assert intent["land_seq"] == n, (intent["land_seq"], n)
    assert saved_land_seq(cfg) == n - 1, f"{point}: state saved past the crash"
    assert intent["plains"], f"{point}: the interrupted landing has no messages"
    assert any(r["status"] == "quarantined" for r in intent["ledger"]), "no reject in landing"
    srcs = [Path(m["src"]) for m in intent["moves"]]
    expect = {
        # point: (messages, bundles, audit committed n?, files moved?)
        "red.after_intent": (False, False, False, False),
        "red.after_messages": (True, False, False, False),
        "red.after_tables": (True, True, True, False),
        "red.after_moves": (True, True, True, True),
    }[point]
    have = (
        txn(cfg, "messages") == n,
        txn(cfg, "bundles") == n,
        txn(cfg, "audit") == n,
        not any(p.exists() for p in srcs),
    )
    assert have == expect, f"{point}: (messages, bundles, audit, moved) = {have}"
    for name in ("messages", "bundles", "audit"):
        assert txn(cfg, name) in (n - 1, n), (name, txn(cfg, name), n)
    if not expect[3]:
        assert all(p.exists() for p in srcs), f"{point}: some files moved before the window"
    return dict(intent)


def from_template(keys: RedKeys, template: Template, name: str) -> tuple[Config, int, Path]:
    """A copy of the template world under ``name`` with the later files dropped: its config,
    its saved land_seq and the path of its crash mark."""
    root = keys.root / name
    shutil.copytree(template.root, root, symlinks=True)
    shutil.rmtree(root / "logs", ignore_errors=True)
    cfg = load_config(root / "diode.toml")
    drop(cfg, *template.later)
    return cfg, saved_land_seq(cfg), root / "crash.mark"


@pytest.mark.parametrize("point", POINTS)
def test_kill_9_at_a_landing_crash_point_then_recover(
    keys: RedKeys, template: Template, point: str, spark: Any
) -> None:
    cfg, n0, mark = from_template(keys, template, point.replace(".", "-"))

    job = RedJob(cfg, "available-now", tag="armed", env=crash_env(point, mark, NTH))
    rc = job.wait()
    assert rc == -signal.SIGKILL, f"{point}: not killed by SIGKILL ({rc}):\n{job.tail()}"
    assert crash_marks(mark) == [point], f"{point} did not fire:\n{job.tail()}"
    intent = check_window(cfg, point, n0 + NTH)
    interrupted = {Path(m["src"]).name.split(".", 1)[1] for m in intent["moves"]}
    assert interrupted == {template.junk.name, template.beta[1].name, template.beta[3].name}

    s = run_clean(cfg, spark)
    assert s["recovered_landings"] == 1, s
    assert s["bundles_landed"] == 1 and s["heartbeats"] == 1 and s["rejected"] == 0, s
    bundles = template.alpha + template.beta
    check_exactly_once(cfg, bundles, [template.junk], [template.heartbeat])
    if point != "red.after_tables":  # one point proves it
        return
    versions = {t: DeltaTable(str(Path(cfg.red.tables_dir) / t)).version() for t in ("messages",)}

    # a third run finds nothing to do and changes nothing
    s = run_clean(cfg, spark)
    assert s["recovered_landings"] == 0 and s["files"] == 0, s
    check_exactly_once(cfg, bundles, [template.junk], [template.heartbeat])
    assert versions == {
        t: DeltaTable(str(Path(cfg.red.tables_dir) / t)).version() for t in versions
    }


def spark_committed_next(cfg: Config) -> int:
    """The intake ordinal after the newest batch Spark's checkpoint has committed: files below
    it are, for Spark, done."""
    ck = Path(cfg.red.checkpoint_dir)
    committed = [int(p.name) for p in (ck / "commits").iterdir() if p.name.isdigit()]
    last = max(committed)
    offsets = (ck / "offsets" / str(last)).read_text().splitlines()
    return int(json.loads(offsets[-1])["next"])


@pytest.mark.parametrize("lose_intent", [False, True], ids=["journal", "journal-lost"])
def test_kill_9_while_a_committed_batch_is_still_being_applied(
    keys: RedKeys, template: Template, lose_intent: bool
) -> None:
    """The red job applies a landing in the background while Spark verifies the next batch, so
    Spark commits a batch whose landing is not done. Every apply is slowed (``red.apply``, 8 s)
    and the job dies at the next batch's sink while the previous apply is still running
    (``red.apply_in_flight``): Spark's checkpoint already says the files are done, the journal
    holds the landing's intent, and a clean run finishes it — exactly once. ``journal-lost``:
    the intent is deleted before the restart (a state dir restored from a copy, a hand): the
    source finds the files below Spark's committed offset that no journal holds and takes them
    again under new ordinals, so they still land, once."""
    cfg, n0, mark = from_template(keys, template, f"in-flight-{lose_intent}")

    env = {**crash_env("red.apply_in_flight", mark), SLOW_ENV: "red.apply:8"}
    job = RedJob(cfg, "available-now", tag="in-flight", env=env)
    rc = job.wait()
    assert rc == -signal.SIGKILL, f"not killed by SIGKILL ({rc}):\n{job.tail()}"
    assert crash_marks(mark) == ["red.apply_in_flight"], job.tail()
    # the window: a landing journaled, not applied, and its batch committed by Spark (the
    # first, unless a slow host got the second batch to the sink only after it was applied)
    assert intent_path(cfg).exists(), "no landing intent left by the crash"
    intent = json.loads(intent_path(cfg).read_bytes())
    n = int(intent["land_seq"])
    assert n in (n0 + 1, n0 + 2) and saved_land_seq(cfg) == n - 1, (n, n0)
    ordinals = [int(m["ordinal"]) for m in intent["moves"]]
    assert ordinals and max(ordinals) < spark_committed_next(cfg), (ordinals, "not committed")
    assert all(Path(m["src"]).exists() for m in intent["moves"]), "files moved before the crash"
    assert txn(cfg, "messages") < n, "the slowed apply wrote messages before the crash"
    interrupted = {Path(m["src"]).name.split(".", 1)[1] for m in intent["moves"]}
    assert interrupted <= {p.name for p in template.later} and len(interrupted) == 3

    if lose_intent:
        intent_path(cfg).unlink()
    job = RedJob(cfg, "available-now", tag="after")
    assert job.wait() == 0, job.tail()
    s = job.summary()
    assert s["recovered_landings"] == (0 if lose_intent else 1), s
    taken_again = "never landed" in job.stderr_path.read_text(errors="replace")
    assert taken_again == lose_intent, job.tail()
    check_exactly_once(cfg, template.alpha + template.beta, [template.junk], [template.heartbeat])


def test_random_kill_9_of_the_job_and_the_publisher_while_files_arrive(
    keys: RedKeys, red_vhost: Vhost, spark: Any
) -> None:
    """Waves of bundles of two channels (shuffled, so out of order), each wave landed by a
    continuous run while the replay publisher tails ``messages`` into red RabbitMQ; both are
    SIGKILLed at random moments after the wave's first landing (the publisher first, while the
    job may still land), and restarted with the next wave; a final available-now run and a
    final publisher run finish. At least one job kill must have interrupted work in progress,
    and one publisher kill must have hit it mid-replay: it had confirmed rows in that wave and
    left landed rows unpublished. Every landed message reaches red's exchange at least once
    (the publisher's order under hold-back and restarts is tested in test_red_replay)."""
    rng = random.Random(20261122)
    root = keys.root / "random"
    replay = {"amqp_url": red_vhost.amqp_url, "approved": ["orders"], "in_flight": 32,
              "batch_rows": 40}  # fmt: skip
    cfg = write_config(root, keys, CHANNELS, replay=replay, max_files_per_batch=1,
                       settle_seconds=0.2)  # fmt: skip
    made = root / "made"
    made.mkdir(parents=True)
    alpha = make_chain(made, keys, "alpha", 10, 30, encrypt=True)
    beta = make_chain(made, keys, "beta", 10, 30, encrypt=False)
    bundles = alpha + beta
    order = list(bundles)
    rng.shuffle(order)
    waves = [order[i : i + 7] for i in range(0, len(order), 7)]  # 3 waves: 3 JVM starts
    with Connection.open(red_vhost.amqp_url) as admin:  # as the rows declare it
        admin.channel().exchange_declare("orders", "topic", durable=True,
                                         arguments={"alternate-exchange": "unrouted"})  # fmt: skip
        admin.channel().queue_declare("replayed", durable=True)  # the vhost goes with the test
        admin.channel().queue_bind("replayed", "orders", "#")  # before anything is published
    interrupted = publisher_cut = 0
    for i, wave in enumerate(waves):
        drop(cfg, *(b.path for b in wave))
        before = saved_land_seq(cfg)
        confirmed = replayed(cfg)[0]
        job = RedJob(cfg, "continuous", tag=f"kill{i}", timeout=JOB_TIMEOUT)
        pub = Publisher(cfg, tag=f"publisher{i}")
        try:
            wait_until(lambda b=before: saved_land_seq(cfg) > b, 120, "a first landing", job)
            wait_until(lambda c=confirmed: replayed(cfg)[0] > c, 60, "a first replay", job)
            time.sleep(rng.uniform(0.0, 1.0))
            pub.kill()
            cut = replayed(cfg)
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            pub.kill()
            job.kill()
        intake = [p for p in (Path(cfg.red.work_dir) / "intake").iterdir() if p.name != "NEXT"]
        if intake or intent_path(cfg).exists() or list(Path(cfg.red.inbox).iterdir()):
            interrupted += 1
        if cut[0] > confirmed and replayed(cfg)[1]:  # it had published; rows were left
            publisher_cut += 1
    assert interrupted >= 1, "no job kill hit a run with work in progress: proved nothing"
    assert publisher_cut >= 1, "no publisher kill hit it mid-replay: proved nothing"
    s = run_clean(cfg, spark)
    assert s["rejected"] == 0, s
    check_exactly_once(cfg, bundles, [], [])

    final = Replayer(cfg).run(until_caught_up=True, timeout=120)
    assert final.caught_up and not final.errors, final
    want = Counter((m["channel"], m["seq"]) for m in table(cfg, "messages", ["channel", "seq"]))
    got: Counter[tuple[str, int]] = Counter()
    with Connection.open(red_vhost.amqp_url, client_name="test-red-consumer") as sink:
        sink.channel().basic_consume("replayed", no_ack=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and set(got) != set(want):
            got.update(body_key(d.body) for d in sink.poll(0.2).deliveries)
        got.update(body_key(d.body) for d in sink.poll(0.5).deliveries)  # any stragglers
    missing = sorted(set(want) - set(got))
    assert not missing, f"{len(missing)} landed messages never published: {missing[:10]}"
    assert set(got) == set(want), "published something that never landed"
    print(f"published {got.total()} for {len(want)} rows; {interrupted} job kills mid-work, "
          f"{publisher_cut} publisher kills mid-replay")  # fmt: skip


def replayed(cfg: Config) -> tuple[int, int]:
    """Exchange ``orders``: rows the publisher confirmed (its saved progress) and rows landed
    after them (lag)."""
    st = Replayer(cfg).status()["exchanges"].get("orders", {})
    progress = st.get("progress") or {}
    return int(progress.get("confirmed_rows") or 0), int(st.get("lag_rows") or 0)


def body_key(body: bytes) -> tuple[str, int]:
    doc = json.loads(body)
    return doc["channel"], doc["seq"]
