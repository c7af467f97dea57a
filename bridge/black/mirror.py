"""Black, mirror: bind each channel's exchanges into its own durable mirror queue (DESIGN §3.9).

    exchanges (discovered | configured) ─plan_channel─> bindings ─> queue <prefix><channel>
                         └─> catalog (state_dir/exchanges.json), written before any binding
    <prefix><channel> ─dead letters (overflow, expiry)─> <prefix>dead-letter
                      ─> <prefix><channel>.dead

Mirror queues are classic (default) or quorum: both keep AMQP 0.9.1 messages unconverted.
Whatever the broker drops from a mirror queue — a length limit an operator set, a message's
own ``expiration`` — is dead-lettered into the channel's dead queue, which the tap turns into
recorded gaps. The bindings are planned in :mod:`bridge.black.plan`; the broker connection in
:mod:`bridge.black.broker`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import shlex
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from bridge.black.broker import broker_refused, connect, connection_parameters
from bridge.black.catalog import load_catalog, merge_catalog, save_catalog
from bridge.black.management import ManagementClient
from bridge.black.plan import (
    Binding,
    ChannelPlan,
    builtin_denied,
    catch_all_bindings,
    dead_letter_exchange,
    dead_queue_name,
    explicit_names,
    mirror_queue_name,
    plan_channel,
    wanted,
)
from bridge.config import Config
from bridge.diode.file_drop import not_writable
from bridge.errors import BrokerError, ConfigError, DiodeError, ManagementApiError, StateError
from bridge.fsutil import DIR_MODE, exclusive_lock, os_error_text
from bridge.logs import get_logger, log_event
from bridge.metrics import BLACK
from bridge.protocol.exchange import ExchangeDecl

__all__ = ["ChannelReport", "Mirror", "MirrorLoop", "MirrorReport"]

log = get_logger("bridge.black.mirror")

# ---------------------------------------------------------------- sync


@dataclass(frozen=True)
class ChannelReport:
    """What one sync did for one channel."""

    channel: str
    queue: str
    bound: list[str]
    """Exchanges whose bindings are all in place after this sync."""
    newly_bound: list[str]
    unbound_direct: list[str]
    skipped: list[str]
    removed: list[str] = field(default_factory=list)
    """Exchanges whose stale bindings (no longer planned) were removed."""
    bindings_listed: bool = True
    """False when the queue's bindings could not be listed (management API unavailable): stale
    ones cannot be seen, so every binding black could have made from an exchange it must not
    mirror (``unbound_unlisted``) was unbound blindly."""
    unbound_unlisted: list[str] = field(default_factory=list)
    """Exchanges known (catalog, config, earlier syncs) but now denied or no longer planned,
    whose possible bindings were unbound without knowing whether they existed."""
    queue_problems: list[str] = field(default_factory=list)
    messages: int | None = None
    """Messages waiting in the mirror queue when the sync looked (the tap's backlog: also the
    gauge ``bridge_black_mirror_queue_messages``); None if the broker did not say."""
    dead_messages: int | None = None
    """Messages waiting in its dead queue (dead letters the tap has not recorded yet)."""
    """Policies or arguments on the mirror or dead queue that make the broker lose messages
    black cannot count (also logged as errors and exported as gauges)."""


@dataclass(frozen=True)
class MirrorReport:
    """The outcome of :meth:`Mirror.sync`."""

    vhost: str
    channels: dict[str, ChannelReport]
    catalog_changed: list[str]
    discovered: bool

    @property
    def changed(self) -> bool:
        return bool(self.catalog_changed) or any(
            r.newly_bound or r.removed for r in self.channels.values()
        )


CATALOG_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)
"""errnos of a state_dir that refuses the catalog: only the operator can fix them."""


def catalog_failed(path: Path, doing: str, e: OSError) -> DiodeError:
    """Black, mirror: ``doing`` (reading, writing, locking) the exchange catalog ``path``
    failed (``e``): a refusal is a ConfigError (the operator must fix it), any other error a
    StateError that retrying may fix (``retryable``: a full disk, EIO); each names the file,
    the reason, the fix and what it costs (new exchanges stay unbound)."""
    where = f"{path}" if e.filename in (None, str(path)) else f"{path} (at {e.filename})"
    said = (
        f"mirror sync: {doing} the exchange catalog {where} failed ({os_error_text(e)}). The "
        "catalog is written before any binding: until it can be, no new exchange is mirrored"
    )
    if e.errno in CATALOG_REFUSED:
        return ConfigError(f"{said}. {not_writable('state_dir', path.parent, e, mode=DIR_MODE)}")
    err = StateError(
        f"{said}. Free space on, or check the disk (dmesg) of, black.state_dir {path.parent}; "
        "the sync is tried again"
    )
    err.retryable = True
    return err


@contextlib.contextmanager
def _catalog_file(path: Path, doing: str) -> Iterator[None]:
    """An OSError while ``doing`` the exchange catalog (or its lock) ``path``, as
    :func:`catalog_failed` says it."""
    try:
        yield
    except OSError as e:
        raise catalog_failed(path, doing, e) from e


class Mirror:
    """Keeps every channel's mirror queue declared and bound; cheap to call periodically.

    ``management`` defaults to a client built from ``cfg.black.management_*``. With
    ``black.discover`` it is required; without it, it is only asked for the types of exchanges
    named exactly, and its failures fall back to the catalog (names in `direct_routing_keys`
    are then assumed to be direct exchanges).
    """

    def __init__(
        self, cfg: Config, *, catalog_path: Path, management: ManagementClient | None = None
    ) -> None:
        self.cfg = cfg
        self.catalog_path = Path(catalog_path)
        # the vhost as the tap reads black.amqp_url (pika reads some URLs differently)
        self.vhost = connection_parameters(cfg.black, "mirror").virtual_host
        self.management = management or ManagementClient.from_config(cfg.black)
        self._lock = threading.Lock()
        self._bound: dict[str, set[tuple[str, str, str]]] = {}
        self._told: set[tuple[str, str]] = set()
        self._mgmt_error = ""  # why the management API failed this sync ("": it answered)
        self._policies_failing = False  # whether the last policy check could not be made

    def queue_arguments(self, channel: str) -> dict[str, Any]:
        b = self.cfg.black
        return {
            "x-queue-type": b.mirror_queue_type,
            "x-dead-letter-exchange": dead_letter_exchange(b),
            "x-dead-letter-routing-key": channel,
            # what a length limit drops is dead-lettered to black and recorded as a gap; a
            # classic queue's own argument wins over a policy's reject-publish (checked below
            # for quorum queues, where the policy wins)
            "x-overflow": "drop-head",
        }

    def sync(self) -> MirrorReport:
        """Discover, update the catalog, then declare and bind every channel's mirror queue."""
        with self._lock:
            conn = connect(self.cfg.black, purpose="mirror")
            try:
                return self._sync(conn)
            except pika.exceptions.AMQPError as e:
                raise BrokerError(
                    f"RabbitMQ connection lost during mirror sync of vhost {self.vhost!r} "
                    f"({type(e).__name__}); retrying may help"
                ) from None
            finally:
                if conn.is_open:
                    try:
                        conn.close()
                    except pika.exceptions.AMQPError:
                        pass

    def _sync(self, conn: BlockingConnection) -> MirrorReport:
        # `diode mirror` and a running job's MirrorLoop both rewrite the catalog
        lock = self.catalog_path.with_name("catalog.lock")
        with contextlib.ExitStack() as held:
            with _catalog_file(lock, "locking"):
                held.enter_context(exclusive_lock(
                    lock, what="mirror sync", timeout=60,
                    hint="another `diode mirror` or black job is syncing the same state_dir",
                ))  # fmt: skip
            return self._sync_locked(conn)

    def _sync_locked(self, conn: BlockingConnection) -> MirrorReport:
        with _catalog_file(self.catalog_path, "reading"):
            catalog = load_catalog(self.catalog_path)
        exchanges, listed = self._learn(conn, catalog)
        own = dead_letter_exchange(self.cfg.black)
        exchanges = [d for d in exchanges if d.name != own]  # black's own: never mirrored
        plans = [plan_channel(ch, exchanges) for ch in self.cfg.channels]
        if self.cfg.black.discover:
            to_catalog: list[ExchangeDecl] = exchanges
        else:
            planned = {b.exchange for p in plans for b in p.bindings}
            to_catalog = [d for d in exchanges if d.name in planned]
        merged, changed = merge_catalog(catalog, (d for d in to_catalog if d.type))
        if changed:
            with _catalog_file(self.catalog_path, "writing"):
                save_catalog(self.catalog_path, merged)
            log_event(
                log,
                logging.INFO,
                "exchange catalog updated",
                catalog=str(self.catalog_path),
                vhost=self.vhost,
                exchanges=changed,
            )
        known = set(catalog) | {d.name for d in exchanges}
        reports = {p.channel: self._apply(conn, p, listed, known) for p in plans}
        for name, rep in reports.items():
            BLACK.exchanges_unbound.labels(name).set(len(rep.unbound_direct))
        return MirrorReport(self.vhost, reports, changed, self.cfg.black.discover)

    def _learn(
        self, conn: BlockingConnection, catalog: dict[str, ExchangeDecl]
    ) -> tuple[list[ExchangeDecl], bool]:
        """(known exchanges, whether the management API answered)."""
        self._mgmt_error = ""
        try:
            listing: list[ExchangeDecl] | None = self.management.list_exchanges(self.vhost)
        except ManagementApiError as e:
            if self.cfg.black.discover:
                raise
            self._tell("", "mgmt", f"management API unavailable, using passive declares: {e}")
            self._mgmt_error = str(e)
            listing = None
        if self.cfg.black.discover:
            assert listing is not None
            return listing, True
        explicit = set().union(*(explicit_names(ch) for ch in self.cfg.channels))
        direct = set().union(*(set(ch.direct_routing_keys) for ch in self.cfg.channels))
        if listing is not None:
            return [d for d in listing if d.name in explicit], True
        found: list[ExchangeDecl] = []
        chan = conn.channel()
        for name in sorted(n for n in explicit if not builtin_denied(n, named=True)):
            try:
                chan.exchange_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as e:
                chan = conn.channel()
                if e.reply_code == 404:
                    continue
                raise broker_refused(
                    e, f"a passive declare of exchange {name!r}", self.vhost
                ) from None
            if name in catalog:
                found.append(catalog[name])
            elif name in direct:
                self._tell("", name, f"exchange {name!r}: type assumed direct (no management API)")
                found.append(ExchangeDecl(name, "direct"))
            else:
                found.append(ExchangeDecl(name, ""))
        chan.close()
        return found, False

    def _declare_without_overflow(self, chan: BlockingChannel, channel: str, queue: str) -> bool:
        """A mirror queue created before black declared ``x-overflow`` is refused with it (406):
        take it as it is (a policy then decides its overflow, checked each sync) and say so."""
        args = {k: v for k, v in self.queue_arguments(channel).items() if k != "x-overflow"}
        try:
            chan.queue_declare(queue, durable=True, arguments=args)
        except pika.exceptions.ChannelClosedByBroker:
            return False
        self._tell(
            channel, "no-overflow-arg",
            f"mirror queue {queue!r} was created without x-overflow: a policy's overflow "
            "applies to it. Re-create it when empty to pin drop-head (docs/runbook.md §4)",
        )  # fmt: skip
        return True

    def _declare(self, chan: BlockingChannel, channel: str) -> BlockingChannel:
        """Declare the dead-letter exchange, the dead queue and the mirror queue (idempotent)."""
        b = self.cfg.black
        dlx, dead, queue = (
            dead_letter_exchange(b),
            dead_queue_name(b, channel),
            mirror_queue_name(b, channel),
        )
        qtype = {"x-queue-type": b.mirror_queue_type}
        steps: list[tuple[str, Callable[[], Any]]] = [
            (f"exchange {dlx!r}", lambda: chan.exchange_declare(dlx, "direct", durable=True)),
            (f"queue {dead!r}", lambda: chan.queue_declare(dead, durable=True, arguments=qtype)),
            (f"binding {dead!r}", lambda: chan.queue_bind(dead, dlx, channel)),
            (
                f"queue {queue!r}",
                lambda: chan.queue_declare(
                    queue, durable=True, arguments=self.queue_arguments(channel)
                ),
            ),
        ]
        for what, step in steps:
            try:
                step()
            except pika.exceptions.ChannelClosedByBroker as e:
                if e.reply_code == 406 and what == steps[-1][0]:
                    chan = chan.connection.channel()  # the refusal closed this one
                    if self._declare_without_overflow(chan, channel, queue):
                        continue
                if e.reply_code == 406:
                    raise ConfigError(
                        f"channel {channel!r}: {what} already exists in vhost {self.vhost!r} "
                        f"with other arguments than black needs ({e.reply_text}). Fix: set "
                        "black.mirror_queue_type back to the queue's type (rabbitmqctl "
                        f"list_queues --vhost {shlex.quote(self.vhost)} name type arguments), "
                        "or, once the queue is empty, delete it (rabbitmqctl delete_queue "
                        f"--vhost {shlex.quote(self.vhost)} {shlex.quote(queue)}) so the mirror "
                        "re-creates it"
                    ) from None
                raise broker_refused(e, f"declaring {what}", self.vhost) from None
        return chan

    def _existing(self, queue: str, listed: bool) -> set[tuple[str, str, str]] | None:
        if not listed:
            return None
        try:
            rows = self.management.list_queue_bindings(self.vhost, queue)
        except ManagementApiError as e:
            log_event(
                log, logging.WARNING, f"cannot list bindings, re-binding all: {e}", queue=queue
            )
            return None
        return {Binding(r.source, r.routing_key, r.arguments).key() for r in rows if r.source}

    def _apply(
        self, conn: BlockingConnection, plan: ChannelPlan, listed: bool, known: set[str]
    ) -> ChannelReport:
        queue = mirror_queue_name(self.cfg.black, plan.channel)
        chan = self._declare(conn.channel(), plan.channel)
        existing = self._existing(queue, listed)
        prior = existing if existing is not None else self._bound.get(plan.channel, set())
        skipped = list(plan.skipped)
        done: set[tuple[str, str, str]] = set()
        failed: set[str] = set()
        newly: set[str] = set()
        for b in plan.bindings:
            if existing is not None and b.key() in existing:
                done.add(b.key())
                continue
            try:
                chan.queue_bind(queue, b.exchange, b.routing_key, arguments=b.arguments or None)
            except pika.exceptions.ChannelClosedByBroker as e:
                chan = conn.channel()
                if e.reply_code == 404:  # deleted since discovery; the next sync sees it gone
                    failed.add(b.exchange)
                    skipped.append(f"{b.exchange!r}: vanished during sync ({e.reply_text})")
                    continue
                raise broker_refused(
                    e, f"binding {queue!r} to {b.exchange!r}", self.vhost
                ) from None
            done.add(b.key())
            if b.key() not in prior:
                newly.add(b.exchange)
        removed: set[str] = set()
        blind: list[str] = []
        if existing is not None:
            planned = {b.key() for b in plan.bindings}
            for source, rk, args in sorted(existing - planned):
                chan.queue_unbind(queue, source, rk, arguments=json.loads(args) or None)
                removed.add(source)
        else:
            chan, blind = self._unbind_unlisted(conn, chan, plan, queue, known)
        depth = self._depths(chan, plan.channel)
        if chan.is_open:
            chan.close()
        problems: list[str] = []
        if not listed:
            self._policies_unchecked(queue, self._mgmt_error or "management API unavailable")
        else:
            problems = [
                p
                for p in (
                    self._check_overflow(plan.channel, queue),
                    self._check_dead_queue(plan.channel),
                )
                if p is not None
            ]
        self._bound[plan.channel] = done
        bound = sorted({b.exchange for b in plan.bindings} - failed)
        self._log(plan, queue, sorted(newly), sorted(removed), skipped)
        return ChannelReport(
            plan.channel,
            queue,
            bound,
            sorted(newly),
            list(plan.unbound_direct),
            skipped,
            sorted(removed),
            bindings_listed=existing is not None,
            unbound_unlisted=blind,
            queue_problems=problems,
            messages=depth[0],
            dead_messages=depth[1],
        )

    def _depths(self, chan: BlockingChannel, channel: str) -> tuple[int | None, int | None]:
        """Black, mirror: messages waiting in ``channel``'s mirror queue and dead queue (passive
        declares), also set as gauges: the depth an operator alarms on (a tap that stopped or
        falls behind). None for one the broker did not answer for."""
        out: list[int | None] = []
        for kind, q in (
            ("mirror", mirror_queue_name(self.cfg.black, channel)),
            ("dead", dead_queue_name(self.cfg.black, channel)),
        ):
            n: int | None = None
            if chan.is_open:  # a refused declare closed it: the rest is not read this sync
                try:
                    n = int(chan.queue_declare(q, passive=True).method.message_count)
                    BLACK.mirror_queue_messages.labels(channel, kind).set(n)
                except pika.exceptions.AMQPError as e:
                    log_event(log, 30, "mirror queue depth not read", channel=channel, queue=q,
                              error=str(e) or type(e).__name__)  # fmt: skip
            out.append(n)
        return out[0], out[1]

    def _unbind_unlisted(
        self,
        conn: BlockingConnection,
        chan: BlockingChannel,
        plan: ChannelPlan,
        queue: str,
        known: set[str],
    ) -> tuple[BlockingChannel, list[str]]:
        """The queue's bindings cannot be listed, so stale ones cannot be seen: unbind every
        binding the mirror could have made from each exchange it knows of (catalog, config,
        this process's earlier syncs) that the plan no longer binds — a newly denied exchange
        must stop flowing even while the management API is down. Unbinding a binding that does
        not exist is a no-op. Returns the channel to go on with and the exchanges unbound."""
        ch = self.cfg.channel(plan.channel)
        planned = {b.key() for b in plan.bindings}
        planned_names = {b.exchange for b in plan.bindings}
        remembered = {k for k in self._bound.get(plan.channel, set()) if k not in planned}
        # an exchange the channel still wants but cannot bind now (type unknown) keeps its
        # bindings: only what is denied or no longer selected is unbound
        names = (known | explicit_names(ch)) - planned_names
        # amq.* too (a channel may have named one): unbinding what does not exist is a no-op
        bindable = [n for n in sorted(names) if not builtin_denied(n, named=True)]
        targets = [b for n in bindable if not wanted(ch, n) for b in catch_all_bindings(ch, n)]
        targets += [Binding(e, rk, json.loads(a)) for e, rk, a in sorted(remembered)]
        done: set[str] = set()
        for b in targets:
            try:
                chan.queue_unbind(queue, b.exchange, b.routing_key, arguments=b.arguments or None)
            except pika.exceptions.ChannelClosedByBroker as e:
                chan = conn.channel()
                if e.reply_code == 404:  # the exchange is gone, and its bindings with it
                    continue
                raise broker_refused(
                    e, f"unbinding {queue!r} from {b.exchange!r}", self.vhost
                ) from None
            done.add(b.exchange)
        self._tell(
            plan.channel, "unlisted",
            f"the bindings of mirror queue {queue!r} cannot be listed (management API "
            "unavailable): every binding black could have made from the exchanges it must not "
            f"mirror was unbound blindly ({len(done)} exchanges); stale bindings cannot be "
            "verified until the management API answers",
        )  # fmt: skip
        return chan, sorted(done)

    def _queue_info(self, queue: str) -> dict[str, Any] | None:
        try:
            info = self.management.queue_info(self.vhost, queue)
        except DiodeError as e:
            self._policies_unchecked(queue, str(e))
            return None
        if self._policies_failing:
            self._policies_failing = False
            log_event(log, logging.INFO, "queue policies are checked again", vhost=self.vhost)
        return info

    def _policies_unchecked(self, queue: str, why: str) -> None:
        """Warn once per failure (until a check succeeds again) that the policies of the
        mirror and dead queues (overflow, limits) could not be checked; repeats at debug."""
        level = logging.DEBUG if self._policies_failing else logging.WARNING
        self._policies_failing = True
        log_event(
            log, level,
            "queue policies not checked (a policy's reject-publish overflow on a mirror queue, "
            f"a limit on a dead queue would lose messages without a gap): {why}; checked again "
            "at every sync",
            queue=queue, vhost=self.vhost,
        )  # fmt: skip

    def _check_overflow(self, channel: str, queue: str) -> str | None:
        """Warn when a policy makes the broker refuse messages at a length limit instead of
        dead-lettering them: producers get nacks, and black can never see or count them.
        Returns what was reported (None: nothing)."""
        info = self._queue_info(queue)
        if info is None:
            return None
        policy = info.get("effective_policy_definition") or {}
        overflow = policy.get("overflow") if isinstance(policy, dict) else None
        args = info.get("arguments") or {}
        # a classic queue's own x-overflow argument wins over the policy; a quorum queue's not
        own = info.get("type") != "quorum" and "x-overflow" in args
        refusing = isinstance(overflow, str) and overflow.startswith("reject-publish") and not own
        BLACK.mirror_refusing.labels(channel).set(1 if refusing else 0)
        if not refusing:
            return None
        msg = (
            f"mirror queue {queue!r} has policy {info.get('policy')!r} with overflow = "
            f"{overflow!r}: at its length limit the broker refuses producers' messages "
            "(nacks) instead of dead-lettering them, so black cannot count them as gaps. "
            "Remove the overflow key from the policy (docs/runbook.md §4)"
        )
        self._tell(channel, f"overflow:{overflow}", msg, level=logging.ERROR)
        return msg

    def _check_dead_queue(self, channel: str) -> str | None:
        """Report a limit on the channel's dead queue (an operator policy matching every
        ``<prefix>*`` queue, typically): what the broker drops there has no dead-letter
        exchange, so it vanishes without a gap. Neither overflow behaviour helps: dead-lettering
        is at-most-once, a refused dead letter is dropped as well. Returns what was reported."""
        queue = dead_queue_name(self.cfg.black, channel)
        info = self._queue_info(queue)
        if info is None:
            return None
        limits = dead_queue_limits(info)
        BLACK.dead_queue_limited.labels(channel).set(1 if limits else 0)
        if not limits:
            return None
        policies = [p for p in (info.get("policy"), info.get("operator_policy")) if p]
        msg = (
            f"dead queue {queue!r} of channel {channel!r} is limited ({', '.join(limits)}; "
            f"policies {policies or 'none'}): dead letters it drops — messages the mirror queue "
            "already dropped — vanish without a recorded gap. Exclude it from the policy "
            "(pattern e.g. '^diode\\.mirror\\.[^.]+$') or remove the queue argument "
            "(docs/runbook.md §4)"
        )
        self._tell(channel, "dead-limits:" + ",".join(limits), msg, level=logging.ERROR)
        return msg

    def _tell(self, channel: str, key: str, msg: str, level: int = logging.WARNING) -> None:
        """Warn once per (channel, key) for the process lifetime; later repeats at debug."""
        level = logging.DEBUG if (channel, key) in self._told else level
        self._told.add((channel, key))
        log_event(log, level, msg, channel=channel or None, vhost=self.vhost)

    def _log(
        self,
        plan: ChannelPlan,
        queue: str,
        newly: list[str],
        removed: list[str],
        skipped: list[str],
    ) -> None:
        ch = plan.channel
        if newly:
            log_event(
                log,
                logging.INFO,
                "exchanges bound to mirror queue",
                channel=ch,
                queue=queue,
                exchanges=newly,
            )
        if removed:
            log_event(
                log,
                logging.INFO,
                "stale bindings removed from mirror queue",
                channel=ch,
                queue=queue,
                exchanges=removed,
            )
        for name in plan.unbound_direct:
            self._tell(
                ch,
                "direct:" + name,
                (
                    f"channel {ch}: direct exchange {name!r} is NOT mirrored: "
                    "direct exchanges have "
                    f"no catch-all binding; list its routing keys in channels[{ch}]"
                    ".direct_routing_keys, or deny it"
                ),
            )
        for s in skipped:
            self._tell(ch, "skip:" + s, f"channel {ch}: not mirrored: {s}")


DEAD_QUEUE_LIMITS = ("max-length", "max-length-bytes", "message-ttl", "expires", "delivery-limit")
"""Policy keys (queue arguments: ``x-`` + key) under which the broker drops from a queue."""


def dead_queue_limits(info: dict[str, Any]) -> list[str]:
    """``key=value`` for each dropping limit the management API's ``info`` shows on a queue
    (effective policy, operator policy included, or its own arguments); with the ``overflow``
    that applies to it when there is one (pure)."""
    policy = info.get("effective_policy_definition") or {}
    policy = policy if isinstance(policy, dict) else {}
    args = info.get("arguments") or {}
    args = args if isinstance(args, dict) else {}
    found = [
        f"{k}={v}"
        for k in DEAD_QUEUE_LIMITS
        if (v := args.get("x-" + k, policy.get(k))) is not None
    ]
    overflow = args.get("x-overflow", policy.get("overflow"))
    if found and overflow is not None:
        found.append(f"overflow={overflow}")
    return found


MAX_SYNC_FAILURES = 5
"""Mirror syncs failing in a row (other than the broker's) after which the loop stops: with
the default ``discover_interval_seconds`` (30), about two and a half minutes."""


class MirrorLoop:
    """A daemon thread re-running :meth:`Mirror.sync` every ``interval`` seconds.

    A :class:`BrokerError` is logged and retried (the broker comes back, and the taps wait for
    it too). A terminal error (ConfigError: a state_dir that refuses the catalog; StateError:
    a damaged catalog) is logged, kept in :attr:`fatal` and ends the loop. Any other failure —
    an error retrying may fix (a full disk under the catalog), a bug — is retried, and becomes
    ``fatal`` after ``max_failures`` in a row: new exchanges would otherwise stay unbound for
    good behind a running job. Run ``mirror.sync()`` once before :meth:`start` so startup
    errors surface (or pass ``run_now=True``).
    """

    def __init__(
        self,
        mirror: Mirror,
        interval: float,
        *,
        run_now: bool = False,
        max_failures: int = MAX_SYNC_FAILURES,
    ) -> None:
        if interval <= 0:
            raise ConfigError(f"mirror loop interval must be > 0, got {interval}")
        self.mirror = mirror
        self.interval = interval
        self.run_now = run_now
        self.max_failures = max_failures
        self.last_report: MirrorReport | None = None
        self.error: DiodeError | None = None
        self.fatal: DiodeError | None = None
        """The terminal error that ended the loop (a transient one is only in ``error``)."""
        self.failures = 0
        self.in_a_row = 0
        """Syncs failed in a row other than the broker's (those that become ``fatal``)."""
        self.on_report: Callable[[MirrorReport], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="diode-black-mirror", daemon=True)

    def start(self) -> MirrorLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        if not self.run_now and self._stop.wait(self.interval):
            return
        while not self._stop.is_set():
            try:
                report = self.mirror.sync()
            except BrokerError as e:
                self.failures += 1
                self.error = e
                log_event(
                    log,
                    logging.WARNING,
                    f"mirror sync failed, will retry: {e}",
                    retry_in_s=self.interval,
                    failures=self.failures,
                )
            except Exception as e:
                self.error = self._failed(e)
                if self.fatal is not None:
                    return
            else:
                self.last_report, self.error, self.in_a_row = report, None, 0
                if self.on_report is not None:
                    self.on_report(report)
            if self._stop.wait(self.interval):
                return

    def _failed(self, e: Exception) -> DiodeError:
        """A sync failed with ``e`` (not the broker's): logged; sets ``fatal`` if retrying
        cannot help, or it failed ``max_failures`` times in a row. Returns the error to keep."""
        self.failures += 1
        self.in_a_row += 1
        if not isinstance(e, DiodeError):  # a bug, or a library's own error: its traceback
            log.exception("mirror sync failed unexpectedly")
            err: DiodeError = StateError(f"mirror sync failed: {type(e).__name__}: {e}")
            err.retryable = True  # it may not happen again: tried up to max_failures times
        else:
            err = e
        if not err.retryable:
            self.fatal = err
        elif self.in_a_row >= self.max_failures:
            self.fatal = StateError(
                f"{str(err).rstrip('.')}. It failed {self.in_a_row} times in a row: the mirror "
                "loop stopped, and the job with it (new exchanges would never be mirrored)"
            )
        if self.fatal is not None:
            log_event(log, logging.ERROR, f"mirror sync failed terminally, loop stopped: "
                      f"{self.fatal}")  # fmt: skip
            return self.fatal
        log_event(
            log, logging.WARNING, f"mirror sync failed, will retry: {err}",
            retry_in_s=self.interval, failures=self.in_a_row, of=self.max_failures,
        )  # fmt: skip
        return err
