"""Black, heartbeat command: ``diode black heartbeat`` beats for every channel while no job runs.

In scheduled mode a timer starts ``diode black run --trigger available-now`` every few minutes,
and heartbeats stop between two runs; this command fills the silence (one round, or one every
``--every`` seconds until SIGTERM/SIGINT). Each heartbeat is the one the job writes: the same
:class:`HeartbeatWriter` (file name, signing, encryption, seq counter in
``state_dir/heartbeat-<channel>.json``), its last bundle seq read from the channel's journal as
last committed, which names only bundles durably in the outbox and archive.

Every beat holds black's run lock (``state_dir/black.lock``), one channel at a time: a running
job holds it for its whole run and beats itself, so the command writes nothing then; a job that
starts meanwhile waits at most for the one beat in progress (its gpg call is killed after
``BEAT_SEAL_SECONDS``) and never sees a second writer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.black.heartbeat import BEAT_SEAL_SECONDS, HeartbeatWriter, run_every
from bridge.black.job import check_black_writable
from bridge.black.state import LOCK_FILE, StateStore
from bridge.config import Config
from bridge.crypto.keys import signing_gpg
from bridge.diode.file_drop import Outbox
from bridge.errors import ConfigError, StateError
from bridge.fsutil import LOCK_POLL_MAX_S, exclusive_lock
from bridge.logs import get_logger, log_event

__all__ = ["BeatRound", "BeatTotals", "HeartbeatCommand"]

log = get_logger("bridge.black.beat_cmd")
GIVE_WAY_S = 2 * LOCK_POLL_MAX_S
"""Between two beats (channels, rounds) the run lock stays free this long, so a job waiting for
it gets it after the beat in progress, not after the whole round (or never, when rounds run
back to back)."""


@dataclass
class BeatRound:
    """One round: the heartbeat written per channel, the failures per channel, and why the
    round stopped early (``skipped``: another process holds black's run lock)."""

    written: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"written": self.written, "failed": self.failed, "skipped": self.skipped}


@dataclass
class BeatTotals:
    """What ``--every`` did until it was stopped."""

    rounds: int = 0
    heartbeats: int = 0
    failed: int = 0
    skipped_rounds: int = 0

    def add(self, r: BeatRound) -> None:
        self.rounds += 1
        self.heartbeats += len(r.written)
        self.failed += len(r.failed)
        self.skipped_rounds += r.skipped is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "heartbeats": self.heartbeats,
            "failed": self.failed,
            "skipped_rounds": self.skipped_rounds,
        }


def _require_state_dir(state_dir: Path) -> None:
    """ConfigError unless black's state dir exists: a heartbeat names what the journal there
    says was shipped and continues the seqs kept there, so a state dir made here (a typo, the
    job never ran) would give red heartbeats that contradict the job's."""
    if state_dir.is_dir():
        return
    what = "is not a directory" if state_dir.exists() else "does not exist"
    raise ConfigError(
        f"black.state_dir {state_dir} {what}: heartbeats continue the black job's journal and "
        "heartbeat seqs kept there. Point black.state_dir at the black job's state dir, or "
        "run `diode black run --trigger available-now` once first (it creates it)"
    )


class HeartbeatCommand:
    """Build with the config (fails fast on what the operator must fix), then
    :meth:`beat_round` once or :meth:`run` every ``interval`` seconds.

    ``interval``: the period the heartbeats declare to red (``--every``); default
    ``black.heartbeat_seconds``.
    """

    def __init__(self, cfg: Config, *, interval: float | None = None) -> None:
        state_dir = Path(cfg.black.state_dir)
        _require_state_dir(state_dir)
        check_black_writable(cfg)
        gpg = signing_gpg(cfg)  # the key is there, usable, unlocked; recipients can encrypt
        gpg.timeout = min(gpg.timeout, BEAT_SEAL_SECONDS)  # bounds how long a beat holds the lock
        self.cfg = cfg
        self.lock_path = state_dir / LOCK_FILE
        store = StateStore(state_dir, create=False)
        outbox = Outbox.from_config(cfg)
        self.writer = HeartbeatWriter(cfg, store=store, gpg=gpg, outbox=outbox, interval=interval)
        self._skipping = False

    def beat_round(self) -> BeatRound:
        """One heartbeat per channel, each under black's run lock; stops at the first channel
        whose lock another process holds (a running job beats itself)."""
        done = BeatRound()
        for ch in self.cfg.channels:
            time.sleep(GIVE_WAY_S)  # a job waiting for the lock gets in between two beats
            with contextlib.ExitStack() as held:
                try:
                    held.enter_context(exclusive_lock(self.lock_path, what="black heartbeat"))
                except StateError:
                    done.skipped = (
                        f"another process holds {self.lock_path}: a black job, which writes "
                        "its own heartbeats (or another `diode black heartbeat`)"
                    )
                    break
                out = self.writer.beat_logged(ch)
            if isinstance(out, Exception):
                done.failed[ch.name] = str(out)
            else:
                done.written[ch.name] = out
        return done

    def run(self, every: float, stop: threading.Event) -> BeatTotals:
        """A round every ``every`` seconds until ``stop`` is set (the lock is free between
        beats); says when it starts and stops finding the lock held."""
        totals = BeatTotals()

        def one() -> None:
            r = self.beat_round()
            totals.add(r)
            if (r.skipped is not None) != self._skipping:
                self._skipping = r.skipped is not None
                said = (
                    f"heartbeats paused: {r.skipped}"
                    if r.skipped is not None
                    else "heartbeats resumed: no black job holds the run lock"
                )
                log_event(log, 20, said, lock=str(self.lock_path))

        run_every(every, stop, one)
        return totals
