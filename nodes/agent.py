"""The agent loop: claim → run → report, on one machine.

One main thread claims and reports; worker threads run the executors and hand back what
happens (started, progress, log lines, outcome) through a queue; the lease renewal
(:mod:`nodes.renewal`) renews the held tasks' leases on a thread and a connection of its own,
so nothing the main thread waits for delays a renewal. Everything is keyed by (task, attempt),
so a late message of an old attempt never touches a newer one. Each pass:

1. reports everything that happened since the last pass (starts first, then log lines, then
   outcomes and progress, in one transaction); a report the database refuses for its data is
   retried item by item, and the attempt whose data is refused fails with ``bad_output``;
2. heartbeats the node (its limits, pause and services come back with it);
3. claims at most as many tasks as it has free slots (never a task it still runs), in one
   short transaction that waits for any lock at most ``ACC_CLAIM_LOCK_WAIT_SEC``, and hands
   them to workers; a claim whose wait ran out claims the other services without waiting for
   capped services' locks until one of them is free again;
4. sleeps until a NOTIFY on its services' channels, a worker's news, or the jittered poll timer.

The renewal renews held tasks every third of the shortest lease and stops attempts it lost or
was asked to cancel, at once, from its thread; it hands what it learnt to the main loop through
the same queue as the workers (counted in the agent's stats).

Faults: every step is guarded. A database outage is logged once, the loop backs off (with
jitter, capped) and resumes; outcomes, starts and log lines stay in memory until reported.
LISTEN is reopened with backoff. A watchdog thread stops an attempt whose lease the agent has
not renewed for ``TTL − margin`` (margin = TTL/4), so the task's process is gone before the
builder may hand the task to another agent (as ``interrupted`` when the renewals could not reach
the database, else as ``lease_lost``); a stall breaker breaks a database call of the main thread
that is blocked for too long.

Connections: two server connections, plus the LISTEN connection, whatever ``--max-concurrent``:
the lease renewal's own, and one pool of :data:`POOL_SIZE` that every other thread's Django
connection borrows from (claims, reports, and task code that uses the ORM, which gives its
connection back after each statement and when the task ends).
No transaction or row lock is held while work runs. First SIGTERM/SIGINT: stop claiming and let
running tasks finish (for at most ``drain_seconds``, when given; then as on a second signal);
second: stop them now (reported ``interrupted`` and retried at once); third: exit without
reporting (leases expire and the builder rescues the tasks). An attempt whose process had already
exited when a stop reached it keeps the outcome it produced.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from uuid import UUID

import psycopg
from django.db import close_old_connections, connection, transaction

from accs_site import daemon
from accs_site.conf import accs
from events import artifacts
from events.timeline import EventRow, write_events
from jobs import transitions
from jobs.claim import ClaimedTask, NodeLimits, ServiceSpec, adopt_claimed, claim_round, service_spec
from jobs.inputs import StepContext, step_context, step_contexts
from jobs.locks import is_lock_timeout
from jobs.notify import service_channel
from jobs.outcomes import INTERRUPTED_BY_OUTAGE, LEASE_LOST
from jobs.transitions import Outcome, ReportResult
from nodes.api import agent_identity, held_attempt_processes, register_node, sign_off, touch_node
from nodes.disk import claiming_paused, sample_disk
from nodes.executors import (
    RunContext,
    agent_alive,
    agent_secrets,
    bad_output,
    end_orphan_groups,
    make_executors,
    not_allowed,
    orphans_on_node,
    ours,
    output_violation,
    remove_scratch,
    sanitize_outcome,
    secrets_in,
)
from nodes.executors.sandbox import close_agent_process
from nodes.renewal import Answer, Held, LeaseRenewal
from nodes.scratch import remove_leftovers, scratch_dir
from workflows.governor import active_conditions, claim_adjustments
from workflows.models import Service as ServiceModel

log = logging.getLogger("accs.agent")

# Server connections the main loop and the worker threads share (claims, reports, task code's
# queries), LISTEN aside. The lease renewal has one of its own besides: two in all.
POOL_SIZE = 1
SERVICE_CACHE_SECONDS = 10.0  # definition changes are picked up within ~10 s
NODE_REFRESH_SECONDS = 2.0
DISK_SAMPLE_SECONDS = 60.0
SCRATCH_SWEEP_SECONDS = 3600.0  # leftover scratch folders: at start, then hourly
WATCHDOG_SECONDS = 0.1
# A database call blocked this long is broken by force (statement_timeout ends slow ones sooner
# on the server's side; this catches a connection that no longer answers at all).
STALL_LIMIT_SECONDS = daemon.DAEMON_STATEMENT_TIMEOUT_MS / 1000 + 15
# The batch read of a claim's inputs waits this long for a lock at most: the main loop must not wait
# behind one (an attempt whose read gave up reads its own inputs in its worker thread, which waits
# out locks and outages).
INPUT_READ_LOCK_WAIT_SECONDS = 0.5

Key = tuple[UUID, int]  # (task id, attempt number)


def lease_margin(ttl: float) -> float:
    """Return how long before the lease's end the agent stops an attempt it could not renew.

    A quarter of the TTL: heartbeats come every TTL/3, so one failed heartbeat is tolerated and
    the second one decides. The margin covers the watchdog's period (0.1 s), stopping the
    process group (SIGTERM, then SIGKILL after at most a third of the margin) and a loaded
    machine's scheduling delays. The renewal is timed before its request is sent, while
    PostgreSQL measures the lease from when it runs the statement, so the database's lease
    always ends at least ``margin`` after the agent's local deadline.
    """
    return ttl / 4


@dataclass
class Running:
    """One attempt this agent runs."""

    task: ClaimedTask
    ctx: RunContext
    # The lease fields change under Agent._running_lock (the renewal and the watchdog threads).
    renewed_at: float  # monotonic time the lease was last renewed (taken before the request)
    lease: float = 0.0  # the lease its claim granted (its service's, else the agent's)
    started_reported: bool = False
    pid: int | None = None
    expired: bool = False  # the local lease deadline passed, or the lease was lost: no longer renewed

    @property
    def key(self) -> Key:
        return (self.task.id, self.task.attempt)

    @property
    def margin(self) -> float:
        return lease_margin(self.lease)


@dataclass
class Service:
    spec: ServiceSpec
    executor: str
    config: dict[str, Any]
    block_during: list[str]
    priority_adjust_during: dict[str, int]


class Agent:
    """Run tasks of ``services`` on node ``node`` with at most ``max_concurrent`` at once."""

    def __init__(self, *, node: str, services: list[str], max_concurrent: int = 4, once: bool = False,
                 labels: dict[str, str] | None = None, poll_interval: float | None = None,
                 lease_seconds: float | None = None, claim_batch: int | None = None,
                 drain_seconds: float | None = None, database_wait: float | None = None) -> None:
        self.node = node
        self.service_keys = services
        self.max_concurrent = max_concurrent
        self.once = once
        self.labels = labels or {}
        self.poll_interval = poll_interval or accs.poll_interval_sec
        self.lease_seconds = float(lease_seconds or accs.heartbeat_ttl_sec)
        self.margin = lease_margin(self.lease_seconds)
        self.claim_batch = claim_batch or max_concurrent
        # How long the first SIGTERM lets running tasks finish before the agent stops them and hands
        # them back as interrupted (None: as long as they take). A supervisor that SIGKILLs after a
        # stop timeout should get a shorter drain, so no task is killed with the agent and then
        # rescued as a failure that uses up its retry budget.
        self.drain_seconds = drain_seconds
        # How long start-up waits for PostgreSQL (None: until it answers); --once gives up after a while.
        self.database_wait = database_wait if database_wait is not None else (
            daemon.ONCE_DATABASE_WAIT_SECONDS if once else None)
        self._drain_deadline: float | None = None
        self.agent_id = agent_identity()
        self.source = f"agent:{node}"
        self.extra = {"node": node}
        self.executors = make_executors()
        self.secrets = agent_secrets()  # redacted from every task's output, errors and log lines
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="accs-task")
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.running: dict[Key, Running] = {}
        # ``running`` and its items' lease fields: the watchdog and the lease renewal use them from their threads.
        self._running_lock = threading.Lock()
        self.pending_outcomes: dict[Key, Outcome] = {}
        self.pending_started: dict[Key, int | None] = {}
        self.pending_progress: dict[Key, float] = {}
        self.pending_logs: list[EventRow] = []
        self.stopping = False
        self.stop_now = False
        self.abandon = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._services: dict[str, Service] = {}
        self._services_at = -SERVICE_CACHE_SECONDS
        self._node_state = "active"
        self._node_limits: dict[str, Any] = {}
        self._node_at = -NODE_REFRESH_SECONDS
        self._disk_at = 0.0
        self._scratch_at = 0.0
        self._paused = False
        self._active_conditions: set[str] = set()
        # Tasks may be claimed for this agent that it does not run: a claim raised (it may have
        # committed all the same), or starting a claimed task raised. The next pass adopts them.
        self._claim_in_doubt = False
        self._claim_filled = False  # the last claim took all it asked for (more may be queued)
        # The last claim had a free slot to ask for work with: only such a claim that took nothing
        # (the queue empty, or this node paused) lets --once leave.
        self._claim_asked = False
        # The last claim left a capped service out because another claimer held its lock: claim
        # again after a short delay, doubling while the lock stays busy (5-10 ms, 10-20 ms, ... the poll).
        self._claim_contended = False
        # Behind a pooler a claim only tries a capped service's lock (jobs.claim.claim_round).
        self._pooled = daemon.db_pooler() is not None
        self._contended_backoff = daemon.Backoff(base=0.01, cap=self.poll_interval)
        # A claim waits for any lock at most this long. After a wait that ran out, claims only try
        # capped services' locks (as behind a pooler) until a claim finds all of them free again.
        self.claim_lock_wait = accs.claim_lock_wait_sec
        self._locks_busy = False
        self._notified = False  # the last wait ended with a NOTIFY
        self._listen: psycopg.Connection | None = None
        self._listen_retry_at = 0.0
        self._listen_backoff = daemon.Backoff(base=0.5, cap=10.0)
        self._listen_broken = False
        self.guard = daemon.Guard(log, extra=self.extra, on_transient=daemon.close_django_connection)
        self.backoff = daemon.Backoff(base=0.2, cap=10.0)
        self._db = connection  # the main thread's Django connection, for the stall breaker
        self.stall = daemon.StallBreaker(limit=STALL_LIMIT_SECONDS, connections=lambda: [self._db], logger=log,
                                         extra=self.extra)
        self._closed = threading.Event()
        self.stats = {"claimed": 0, "done": 0, "failed": 0, "fenced": 0, "repeated": 0, "expired": 0,
                      "contended": 0, "waited_out": 0, "lost": 0, "cancel_requested": 0}
        self.renewal = LeaseRenewal(node=node, agent_id=self.agent_id, agent_lease=self.lease_seconds,
                                    claim_lock_wait=self.claim_lock_wait, held=self._held_leases,
                                    on_answer=self._renewed, stall_limit=STALL_LIMIT_SECONDS, logger=log,
                                    extra=self.extra)
        self.known_services: list[str] = []
        self.unknown_services: list[str] = []
        self.registered = False  # the node row is ours to sign off only once we registered it
        self._handles_signals = False

    # ------------------------------------------------------------------ lifecycle
    def install_signal_handlers(self) -> None:
        def handle(signum: int, frame: FrameType | None) -> None:
            if self.stop_now:
                self.abandon = True
                log.warning("third signal: exiting without reporting; leases will expire", extra=self.extra)
            elif self.stopping:
                self.stop_now = True
                log.warning("second signal: stopping running tasks now (they are retried)", extra=self.extra)
            else:
                self.stopping = True
                if self.drain_seconds is not None:
                    self._drain_deadline = time.monotonic() + self.drain_seconds
                log.info("signal received: no new claims, draining %d running task(s)%s", len(self.running),
                         f" for at most {self.drain_seconds:g}s" if self.drain_seconds is not None else "",
                         extra=self.extra)
            self._wake()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        self._handles_signals = True

    def _ignore_late_signals(self) -> None:
        """Ignore SIGTERM and SIGINT once everything is reported and the agent signed off.

        The interpreter's exit (threads joined, modules torn down) takes a few tenths of a second
        and puts the default handlers back, so a signal landing then would end the process with
        status -15 although the agent stopped cleanly. There is nothing left to stop: exit 0.
        """
        if self._handles_signals:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def run(self) -> int:
        """Run until stopped (or, with ``once``, until no work is left). Return an exit code."""
        close_agent_process()  # tasks run as this OS user: they must not read its environment or memory
        # The start-up check's connection has a name of its own: it is closed before the pool opens,
        # and its backend may outlive the close by a moment, beside the pool's first connection.
        daemon.configure_daemon_session(application_name=f"accs agent {self.node} start")
        # Before anything else: a database that never answers or is not migrated is one line and an
        # exit code, with nothing to report or sign off.
        refused = daemon.ready_to_start(log, stopping=lambda: self.stopping, extra=self.extra,
                                        wait_seconds=self.database_wait)
        if refused is not None:
            self._ignore_late_signals()
            return refused
        threading.Thread(target=self._watchdog, name="accs-lease-watchdog", daemon=True).start()
        self.stall.start()
        try:
            # Connection pool: all threads but the lease renewal's share POOL_SIZE connections from
            # here on (after the first connection, so a refused one is reported as it is, not as a
            # pool timeout).
            daemon.use_shared_pool(max_size=POOL_SIZE, application_name=f"accs agent {self.node}")
            self.renewal.start()
            if not self._until_ok("check services", self._check_services):
                return 0
            if self.unknown_services:
                log.error("unknown service(s): %s; known services: %s", ", ".join(self.unknown_services),
                          ", ".join(self.known_services) or "(none defined)", extra=self.extra)
                return 2
            if not self._until_ok("register node", self._register):
                return 0
            self._step("end orphans", self._end_orphans)
            self._sweep_scratch()
            log.info("agent %s started on node %s for %s (max %d, lease %.0fs, local deadline %.1fs)",
                     self.agent_id, self.node, ",".join(self.service_keys), self.max_concurrent, self.lease_seconds,
                     self.lease_seconds - self.margin, extra=self.extra)
            self._loop()
        finally:
            self._shutdown()
            self._ignore_late_signals()
        return 0

    def _loop(self) -> None:
        while not self.abandon:
            self.guard.start_pass()
            claimed = self._pass()
            idle = not self.running and not self._has_pending()
            if self.stopping and idle:
                break
            # Every slot may have been held by finished tasks not yet reported when this pass claimed:
            # the queue counts as empty only after a claim that had room found nothing.
            if self.once and not claimed and idle and self._claim_asked and not self.guard.failed:
                break
            # Connection pool: the loop's connection goes back while it waits, for the tasks' use.
            daemon.close_django_connection()
            if self.guard.failed:
                self._sleep(self.backoff.next_delay())
            else:
                self.backoff.reset()
                # A claim that filled its batch may have left more work queued: claim again at once.
                # One that found a capped service's lock busy claims again shortly. One that took
                # less found the queue empty; a new task's NOTIFY ends the wait.
                if claimed and self._claim_filled:
                    pass
                elif self._claim_contended:
                    self._wait(limit=self._contended_backoff.next_delay())
                else:
                    self._wait()

    def _pass(self) -> int:
        """Run one pass of the loop; return how many tasks were claimed."""
        self._step("connection check", close_old_connections)
        if not self.guard.outage_this_pass:
            with self.stall.step("database probe"):
                self.guard.probe()
        # Woken by a NOTIFY (new work), claim before reporting what the workers finished: the new
        # task waits for no report. Slots the unreported outcomes free are used by the next claim.
        notified, self._notified = self._notified, False
        claimed: int | None = None
        if notified and self._node_at >= 0 and not self._claim_in_doubt and not self.stopping:
            claimed = self._step("claim", self._claim, default=0)
        self._step("report", self._flush_reports)
        if self._node_at < 0:  # the first pass: the node's limits and pause before any claim
            self._refresh_node(time.monotonic())
        self._check_drain_deadline()
        if self.stop_now:
            for item in self._running_items():
                item.ctx.stop("shutdown")
        if self._claim_in_doubt:
            self._step("adopt claimed tasks", self._adopt)
        if claimed is None:
            claimed = 0 if self.stopping else self._step("claim", self._claim, default=0)
        # The periodic work comes after the claim, so a task whose NOTIFY woke the agent is claimed
        # without waiting for it (what it refreshes is up to a refresh period old either way).
        now = time.monotonic()
        if now - self._node_at >= NODE_REFRESH_SECONDS:
            self._refresh_node(now)
        if now - self._disk_at >= DISK_SAMPLE_SECONDS:
            self._disk_at = now
            self._step("disk sample", self._sample_disk)
        if now - self._scratch_at >= SCRATCH_SWEEP_SECONDS:
            self._sweep_scratch()
        return claimed

    def _refresh_node(self, now: float) -> None:
        """Renew the node's heartbeat and re-read its limits, pause, services and governor conditions."""
        self._node_at = now
        self._step("node heartbeat", self._touch_node)
        self._step("services", self._load_services)
        self._step("claiming pause", self._refresh_pause)
        self._step("governor", self._refresh_governor)

    def _check_drain_deadline(self) -> None:
        """Past the drain deadline, stop running tasks as a second signal would (handed back, interrupted)."""
        if self.stop_now or self._drain_deadline is None or time.monotonic() < self._drain_deadline:
            return
        self.stop_now = True
        if self.running:
            log.warning("drain time (%gs) is over: stopping %d running task(s) now; they are handed back as "
                        "interrupted and queued again", self.drain_seconds, len(self.running), extra=self.extra)

    def _step(self, name: str, fn: Callable[[], object], *, default: Any = None) -> Any:
        """Run one guarded step; after a database failure in this pass, skip the remaining ones."""
        if self.guard.outage_this_pass:
            return default
        with self.stall.step(name):
            return self.guard.run(name, fn, default=default)

    def _until_ok(self, name: str, fn: Callable[[], object]) -> bool:
        """Retry ``fn`` with backoff until it succeeds; False if the agent was stopped first."""
        while not self.stopping:
            self.guard.start_pass()
            with self.stall.step(name):
                self.guard.run(name, fn)
            if not self.guard.failed:
                self.backoff.reset()
                return True
            self._sleep(self.backoff.next_delay())
        return False

    def _shutdown(self) -> None:
        if not self.abandon:
            self.guard.start_pass()
            self._step("report", self._flush_reports)
        if self._has_pending():
            log.error("exiting with %d unreported outcome(s); their leases will expire and the builder will "
                      "rescue them", len(self.pending_outcomes), extra=self.extra)
        self._closed.set()
        self.renewal.close()
        self.stall.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.registered and not self.abandon:
            self.guard.start_pass()
            if self._step("sign off", lambda: sign_off(self.node, agent_id=self.agent_id)):
                log.info("node %s is offline", self.node, extra=self.extra)
        self._close_listen()
        daemon.close_shared_pool()
        log.info("agent stopped: %s", self.stats, extra=self.extra)

    # ------------------------------------------------------------------ node, services, orphans
    def _check_services(self) -> None:
        """Refuse service keys that name no service (a typo would otherwise register a phantom node)."""
        known = sorted(ServiceModel.objects.values_list("key", flat=True))
        self.known_services = known
        self.unknown_services = sorted(set(self.service_keys) - set(known))

    def _register(self) -> None:
        register_node(self.node, labels=self.labels, services=self.service_keys, agent_id=self.agent_id)
        self.registered = True
        self._load_services(force=True)

    def _end_orphans(self) -> None:
        """End the process groups of this node's attempts whose agent died (``kill -9``, crash).

        Recorded attempts give the groups; a /proc scan finds the rest (attempts already rescued).
        Only processes whose environment names the task and a dead agent are killed.
        """
        candidates = [(pid, task_id) for pid, task_id, agent in held_attempt_processes(self.node)
                      if agent != self.agent_id and not agent_alive(agent) and ours(pid, task_id=task_id)]
        candidates += orphans_on_node(self.node, own_agent_id=self.agent_id)
        killed = end_orphan_groups(sorted(set(candidates)))
        if killed:
            log.warning("ended %d orphaned task process(es) of a dead agent on node %s: %s", len(killed), self.node,
                        killed, extra=self.extra)

    def _sweep_scratch(self) -> None:
        """Remove scratch folders left by agents that are gone (``kill -9``, a crash); see nodes.scratch.

        After the orphans are ended, so no process of a dead agent still writes into them.
        """
        self._scratch_at = time.monotonic()
        removed: list[Path] = self.guard.run("scratch sweep", remove_leftovers, default=[])
        if removed:
            log.warning("removed %d leftover scratch folder(s) of agents that are gone: %s", len(removed),
                        " ".join(p.name for p in removed), extra=self.extra)

    def _touch_node(self) -> None:
        self._node_state, self._node_limits = touch_node(self.node, agent_id=self.agent_id)

    def _load_services(self, *, force: bool = False) -> None:
        if not force and time.monotonic() - self._services_at < SERVICE_CACHE_SECONDS:
            return
        found = {}
        for s in ServiceModel.objects.filter(key__in=self.service_keys, is_active=True):
            found[s.key] = Service(service_spec(s),
                                   s.executor, s.executor_config or {}, list(s.block_during or []),
                                   dict(s.priority_adjust_during or {}))
        missing = set(self.service_keys) - set(found)
        if missing and force:
            log.warning("services not found or inactive: %s", ",".join(sorted(missing)), extra=self.extra)
        self._services, self._services_at = found, time.monotonic()

    def _limits(self) -> NodeLimits:
        per_service = dict(self._node_limits.get("max_concurrency") or {})
        for key in self.service_keys:
            env_cap = accs.max_concurrency_for(key)
            if env_cap is not None:
                per_service[key] = env_cap
        labels = {**(self._node_limits.get("labels") or {}), **self.labels}
        return NodeLimits(self.node, int(self._node_limits.get("slot_cap") or accs.slot_cap),
                          int(self._node_limits.get("cpu_budget") or accs.cpu_budget), per_service, labels)

    def _sample_disk(self) -> None:
        sample_disk(self.node, os.getcwd())

    def _refresh_pause(self) -> None:
        self._paused = self._node_state != "active" or claiming_paused(self.node)

    def _refresh_governor(self) -> None:
        self._active_conditions = set(active_conditions())

    # ------------------------------------------------------------------ claiming
    def _claim(self) -> int:
        """Claim across this agent's services in the one global order, in one statement."""
        free = min(self.max_concurrent - len(self.running), self.claim_batch)
        self._claim_filled = self._claim_contended = False
        self._claim_asked = free > 0
        if free <= 0 or self._paused:
            return 0
        services, adjust = [], {}
        for key in self.service_keys:
            service = self._services.get(key)
            if service is None:
                continue
            blocked, delta = claim_adjustments(service, self._active_conditions)
            if not blocked:
                services.append(service)
                adjust[service.spec.id] = delta
        if not services:
            return 0
        by_key = {s.spec.key: s for s in services}
        # Tasks still running here (any attempt) are never claimed again by this agent: the old
        # attempt's finish would race the new one.
        exclude = {task_id for task_id, _ in self.running}
        renewed_at = time.monotonic()  # before the request: the lease starts no earlier
        # Until every claimed task is started, some may be this agent's without it running them: the
        # answer may not arrive, or starting one may raise (a full disk) and leave the rest of the
        # answer unstarted. The flag stays up until then, so the next pass adopts what is left.
        self._claim_in_doubt = True
        answer = claim_round([s.spec for s in services], self._limits(), agent_id=self.agent_id, free_slots=free,
                             lease_seconds=self.lease_seconds, pid=os.getpid(), exclude=exclude,
                             priority_adjust=adjust, try_capped=self._pooled or self._locks_busy,
                             lock_wait=self.claim_lock_wait)
        tasks, renewed_at = self._renew_if_late(answer.tasks, renewed_at=renewed_at)
        contexts = self._read_contexts(tasks)
        for task in tasks:
            self._start(task, by_key[task.service_key], renewed_at=renewed_at, context=contexts.get(task.id))
        self._claim_in_doubt = False
        self._claim_filled = len(tasks) >= free
        self._claim_contended = bool(answer.contended) or answer.waited_out
        self._note_lock_waits(answer.waited_out, busy=bool(answer.contended))
        if not self._claim_contended:
            self._contended_backoff.reset()
        else:
            self.stats["contended"] += 1
        if tasks:
            self.stats["claimed"] += len(tasks)
            log.debug("claimed %d task(s)", len(tasks), extra=self.extra)
        return len(tasks)

    def _read_contexts(self, tasks: list[ClaimedTask]) -> dict[UUID, StepContext]:
        """Read the claimed tasks' parents' outputs in one statement, for their workers to start without a query.

        With one pooled connection, 64 workers each reading their own inputs queued 64 round trips
        (and the next report behind them). A read that fails or waits out its lock gives nothing: each
        attempt then reads its own, in its worker thread, as an attempt adopted after a lost answer does.
        """
        if not tasks:
            return {}
        try:
            return step_contexts([t.id for t in tasks], lock_wait=INPUT_READ_LOCK_WAIT_SECONDS)
        except Exception as exc:  # noqa: BLE001 - the workers read their own
            log.info("batch read of %d claimed task(s)' inputs %s; each reads its own", len(tasks),
                     "waited out a lock" if is_lock_timeout(exc) else f"failed ({daemon.first_line(exc)})",
                     extra=self.extra)
            daemon.close_django_connection()
            return {}

    def _renew_if_late(self, tasks: list[ClaimedTask], *, renewed_at: float) -> tuple[list[ClaimedTask], float]:
        """Renew the leases of a claim that took a renewal period or more; return the tasks still ours.

        The claim's leases begin once it holds its locks, but the agent counts them from before its
        request (so the database's lease never ends first): after a long wait for a lock, the
        local deadline of the tasks just claimed would be near or past. A renewal now moves it.
        """
        if not tasks:
            return tasks, renewed_at
        leases = {(t.id, t.attempt): t.lease_seconds or self.lease_seconds for t in tasks}
        if time.monotonic() - renewed_at < min(leases.values()) / 3:
            return tasks, renewed_at
        renewed_at = time.monotonic()  # before the request: the renewed lease starts no earlier
        lost, _ = transitions.heartbeat(list(leases), agent_id=self.agent_id, lease_seconds=leases)
        for task in tasks:
            if (task.id, task.attempt) in lost:
                log.warning("task %s attempt %d: lost before it started (its claim waited long)", task.id,
                            task.attempt, extra={**self.extra, "task_id": task.id})
        return [t for t in tasks if (t.id, t.attempt) not in lost], renewed_at

    def _note_lock_waits(self, waited_out: bool, *, busy: bool) -> None:
        """Leave the waiting for capped services' locks after a wait that ran out; come back once they are free.

        Logged once each way, not once per claim: a site may hold a capped service's lock for hours.
        """
        if waited_out:
            self.stats["waited_out"] += 1
            if not self._locks_busy:
                self._locks_busy = True
                log.warning("a claim waited %gs for a lock (another claimer, or a site pausing a capped service) "
                            "and gave up; claiming the other services without waiting for capped services' locks "
                            "until they are free", self.claim_lock_wait, extra=self.extra)
        elif self._locks_busy and not busy:
            self._locks_busy = False
            log.info("no lock was busy at the last claim%s", "" if self._pooled else
                     f"; claims wait for capped services' locks again (at most {self.claim_lock_wait:g}s)",
                     extra=self.extra)

    def _adopt(self) -> None:
        """Run the tasks a claim whose answer was lost gave this agent (found by its identity)."""
        known = {task_id for task_id, _ in (*self.running, *self.pending_outcomes, *self.pending_started)}
        renewed_at = time.monotonic()
        tasks = adopt_claimed(self.node, agent_id=self.agent_id, known=known, lease_seconds=self.lease_seconds)
        for task in tasks:
            service = self._services.get(task.service_key)
            if service is None:  # not served any more: its lease ends and the builder rescues it
                continue
            log.warning("adopting task %s attempt %d: its claim committed but the answer was lost", task.id,
                        task.attempt, extra={**self.extra, "task_id": task.id, "job_id": task.job_id})
            self._start(task, service, renewed_at=renewed_at)
            self.stats["claimed"] += 1
        self._claim_in_doubt = False  # only now: a start that raised leaves it up for the next pass

    def _start(self, task: ClaimedTask, service: Service, *, renewed_at: float,
               context: StepContext | None = None) -> None:
        """Run ``task`` in a worker; ``context`` is its inputs when already read (else the worker reads them)."""
        inbox, wake = self.inbox, self._wake
        key: Key = (task.id, task.attempt)

        def on_started(pid: int | None) -> None:
            inbox.put(("started", key, pid))
            wake()  # record the start promptly, not at the next poll

        def on_progress(value: float) -> None:
            inbox.put(("progress", key, value))
            wake()

        def on_log(level: str, message: str) -> None:
            inbox.put(("log", key, level, message))

        ctx = RunContext(task=task, service_config=service.config, on_started=on_started, on_progress=on_progress,
                         on_log=on_log, secrets=secrets_in(task.params) + self.secrets, node=self.node,
                         agent_id=self.agent_id)
        if service.executor == "command":
            ctx.output_dir = scratch_dir(task)
        lease_seconds = task.lease_seconds or self.lease_seconds
        with self._running_lock:
            self.running[key] = Running(task, ctx, renewed_at=renewed_at, lease=lease_seconds)
        self.renewal.poke()  # its lease may be shorter than any held so far
        executor = self.executors[service.executor]

        def work() -> None:
            # Connection pool: the task's queries each borrow a connection and give it back.
            with daemon.release_after_each_statement():
                run_and_report()

        def run_and_report() -> None:
            try:
                # This site's allow-lists are asked again before every run, whatever the row says.
                outcome = not_allowed(task, service.executor, service.config)
                if outcome is None:
                    outcome = _prepare_and_run(task, ctx, executor, limit=lease_seconds, context=context)
            except Exception as exc:  # noqa: BLE001 - an executor bug fails the attempt, not the agent
                log.exception("executor crashed", extra={"task_id": task.id, "job_id": task.job_id})
                outcome = Outcome(task_id=task.id, attempt=task.attempt, status="failed",
                                  error=f"executor error: {exc}")
            outcome = sanitize_outcome(_as_stopped(outcome, ctx, lease_seconds=lease_seconds), secrets=ctx.secrets)
            outcome = output_violation(outcome, ctx.output_schema)
            try:
                _store_artifacts(task, ctx, outcome, limit=lease_seconds)
            finally:
                remove_scratch(ctx)
                inbox.put(("done", key, outcome))
                wake()

        self.pool.submit(work)

    def _running_items(self) -> list[Running]:
        with self._running_lock:
            return list(self.running.values())

    # ------------------------------------------------------------------ the lease watchdog
    def _watchdog(self) -> None:
        """Stop attempts whose lease was not renewed for TTL − margin (runs in its own thread)."""
        while not self._closed.wait(WATCHDOG_SECONDS):
            try:
                self._expire_overdue(time.monotonic())
            except Exception:  # noqa: BLE001 - the watchdog must outlive any surprise
                log.exception("lease watchdog failed", extra=self.extra)

    def _expire_overdue(self, now: float) -> None:
        with self._running_lock:
            overdue = [item for item in self.running.values()
                       if not item.expired and now - item.renewed_at >= item.lease - item.margin]
            for item in overdue:
                item.expired = True
        for item in overdue:
            self.stats["expired"] += 1
            # The database unreachable: the outage stopped the work, not the task (it is queued
            # again without using its retry budget). The renewals say so first; a loop that cannot
            # reach it either says so too.
            outage = self.renewal.outage_since is not None or self.guard.outage_since is not None
            log.warning("lease of task %s attempt %d not renewed for %.1fs%s: stopping it before the builder hands "
                        "it to another agent", item.task.id, item.task.attempt, now - item.renewed_at,
                        " (the database is unreachable)" if outage else "",
                        extra={**self.extra, "task_id": item.task.id})
            item.ctx.stop("outage" if outage else "lease", kill_grace=item.margin / 3)

    # ------------------------------------------------------------------ reporting
    def _has_pending(self) -> bool:
        return bool(self.pending_outcomes or self.pending_started or self.pending_progress or self.pending_logs)

    def _drain_inbox(self) -> None:
        # Empty the wake pipe first: a worker that queues a message after this point also writes
        # a new wake byte, so the next select() returns at once instead of sleeping a full poll.
        self._drain_wake_pipe()
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                break
            kind, key = message[0], message[1]
            if kind == "lease":  # the renewal's news: the attempt was already stopped in its thread
                self.stats[message[2]] += 1
                continue
            item = self.running.get(key)
            if item is None:
                continue  # nothing arrives after "done"; a message for an unknown attempt is dropped
            if kind == "started":
                item.pid = message[2]
                item.started_reported = True
                self.pending_started[key] = message[2]
            elif kind == "progress":
                self.pending_progress[key] = message[2]
            elif kind == "log":
                level, text = message[2], message[3]
                self.pending_logs.append(EventRow(type="log", message=text[:2000], job_id=item.task.job_id,
                                                  task_id=key[0], attempt=key[1], source=self.source, level=level))
            elif kind == "done":
                if not item.started_reported:
                    self.pending_started[key] = item.pid
                self.pending_outcomes[key] = message[2]
                self.pending_progress.pop(key, None)
                with self._running_lock:
                    del self.running[key]

    def _flush_reports(self) -> None:
        """Report what happened since the last pass; keep it all in memory until it is written."""
        self._drain_inbox()
        if not self._has_pending():
            return
        self._mark_started_with_logs()
        outcomes = dict(self.pending_outcomes)
        started = dict(self.pending_started)
        progress = dict(self.pending_progress)
        logs = list(self.pending_logs)
        try:
            if logs or progress:
                with transaction.atomic():
                    if logs:
                        write_events(logs)
                    result = transitions.report(list(outcomes.values()), started=_started_items(started),
                                                agent_id=self.agent_id, source=self.source)
                    if progress:
                        transitions.report_progress([(k[0], k[1], v) for k, v in progress.items()],
                                                    source=self.source)
            else:
                # Outcomes and starts alone: the report is one transaction by itself (for successes,
                # one round trip), without a BEGIN and a COMMIT of its own around it.
                result = transitions.report(list(outcomes.values()), started=_started_items(started),
                                            agent_id=self.agent_id, source=self.source)
        except Exception as exc:  # noqa: BLE001 - sorted below
            if daemon.is_transient(exc):
                raise
            log.error("the database refused a report batch (%s); reporting item by item", daemon.first_line(exc),
                      extra=self.extra)
            self._report_each()
            return
        self.pending_outcomes, self.pending_started, self.pending_progress, self.pending_logs = {}, {}, {}, []
        self._account(result, outcomes.values())

    def _mark_started_with_logs(self) -> None:
        """Move to running, first and on their own, attempts whose log lines are in this batch.

        So a task's log events never precede its running event. Done in a transaction of its
        own: the report that follows locks jobs before tasks (the lock order), which a task
        lock taken earlier in the same transaction would break.
        """
        with_logs = {(row.task_id, row.attempt) for row in self.pending_logs}
        first = {k: pid for k, pid in self.pending_started.items() if k in with_logs}
        if not first:
            return
        transitions.mark_running(_started_items(first), agent_id=self.agent_id, source=self.source)
        for key in first:
            self.pending_started.pop(key, None)

    def _report_each(self) -> None:
        """Report pending items one at a time; an attempt whose data is refused fails as bad_output."""
        for key in sorted(set(self.pending_outcomes) | set(self.pending_started), key=str):
            outcome = self.pending_outcomes.get(key)
            start = {key: self.pending_started[key]} if key in self.pending_started else {}
            try:
                self._report_one(outcome, start)
            except Exception as exc:  # noqa: BLE001 - sorted below
                if daemon.is_transient(exc):
                    raise
                if outcome is not None:
                    self._report_refused(outcome, start, exc)
                else:
                    log.error("start of task %s attempt %d refused by the database (%s); dropped", key[0], key[1],
                              daemon.first_line(exc), extra={**self.extra, "task_id": key[0]})
            self.pending_outcomes.pop(key, None)
            self.pending_started.pop(key, None)
        for row in list(self.pending_logs):
            try:
                write_events([row])
            except Exception as exc:  # noqa: BLE001 - sorted below
                if daemon.is_transient(exc):
                    raise
                log.error("log line of task %s refused by the database (%s); dropped", row.task_id,
                          daemon.first_line(exc), extra=self.extra)
            self.pending_logs.remove(row)
        for key, value in list(self.pending_progress.items()):
            try:
                transitions.report_progress([(key[0], key[1], value)], source=self.source)
            except Exception as exc:  # noqa: BLE001 - progress is a hint; a refused one is dropped
                if daemon.is_transient(exc):
                    raise
            self.pending_progress.pop(key, None)

    def _report_one(self, outcome: Outcome | None, start: dict[Key, int | None]) -> None:
        with transaction.atomic():
            result = transitions.report([outcome] if outcome else [], started=_started_items(start),
                                        agent_id=self.agent_id, source=self.source)
        if outcome is not None:
            self._account(result, [outcome])

    def _report_refused(self, outcome: Outcome, start: dict[Key, int | None], exc: BaseException) -> None:
        """Fail the attempt whose report the database refused, with the reason; never drop it silently."""
        reason = f"the database refused this attempt's report: {daemon.first_line(exc)}"
        log.error("task %s attempt %d: %s", outcome.task_id, outcome.attempt, reason,
                  extra={**self.extra, "task_id": outcome.task_id})
        failed = bad_output(Outcome(task_id=outcome.task_id, attempt=outcome.attempt, status="failed",
                                    exit_code=outcome.exit_code), reason)
        try:
            self._report_one(failed, start)
        except Exception as again:  # noqa: BLE001 - sorted below
            if daemon.is_transient(again):
                self.pending_outcomes[(outcome.task_id, outcome.attempt)] = failed
                raise
            log.error("even the bad_output report of task %s was refused (%s); its lease will expire",
                      outcome.task_id, daemon.first_line(again), extra=self.extra)

    def _account(self, result: ReportResult, outcomes: Iterable[Outcome]) -> None:
        self.stats["done"] += len(result.done)
        self.stats["failed"] += len(result.failed) + len(result.retried)
        self.stats["fenced"] += len(result.fenced)
        self.stats["repeated"] += len(result.repeated)
        fenced, repeated = set(result.fenced), set(result.repeated)
        for o in outcomes:
            if o.task_id in repeated:
                log.info("task %s attempt %s: this report was already recorded (the answer to an earlier send"
                         " was lost)", o.task_id, o.attempt, extra={**self.extra, "task_id": o.task_id})
            elif o.task_id in fenced:
                log.warning("report fenced: task %s attempt %s is no longer ours", o.task_id, o.attempt,
                            extra={**self.extra, "task_id": o.task_id})
            elif o.status != "succeeded":
                log.info("task %s attempt %s %s: %s", o.task_id, o.attempt, o.status, o.error,
                         extra={**self.extra, "task_id": o.task_id})

    # ------------------------------------------------------------------ lease renewal (its thread)
    def _held_leases(self) -> dict[Key, Held]:
        """Return the attempts whose leases the renewal keeps: running, neither overdue nor lost."""
        with self._running_lock:
            return {key: Held(item.lease, item.renewed_at) for key, item in self.running.items() if not item.expired}

    def _renewed(self, answer: Answer) -> None:
        """Take in what a renewal learnt (called in the renewal's thread), keyed by (task, attempt).

        An attempt no longer running here is left alone; one the watchdog already stopped stays
        stopped. Lost and canceled attempts are stopped at once, and the news goes to the main
        loop through the inbox.
        """
        lost, cancel = [], []
        with self._running_lock:
            for key in answer.renewed:
                item = self.running.get(key)
                if item is not None and not item.expired:
                    item.renewed_at = max(item.renewed_at, answer.at)
                    if key in answer.cancel:
                        cancel.append(item)
            for key in answer.lost:
                item = self.running.get(key)
                if item is not None and not item.expired:
                    item.expired = True  # not renewed again; the watchdog has nothing left to stop
                    lost.append(item)
        for item in lost:
            log.warning("stopping task %s attempt %d: lease lost", item.task.id, item.task.attempt,
                        extra={**self.extra, "task_id": item.task.id})
            item.ctx.stop("lost", kill_grace=item.margin / 3)
            self.inbox.put(("lease", item.key, "lost"))
        for item in cancel:
            if not item.ctx.cancel.is_set():
                log.warning("stopping task %s attempt %d: cancel requested", item.task.id, item.task.attempt,
                            extra={**self.extra, "task_id": item.task.id})
                self.inbox.put(("lease", item.key, "cancel_requested"))
            item.ctx.stop("cancel")

    # ------------------------------------------------------------------ waiting
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe wakes the loop just as well

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _open_listen(self) -> None:
        """Open the LISTEN connection; on failure, poll only and try again later with backoff."""
        if time.monotonic() < self._listen_retry_at:
            return
        if not daemon.listen_available():  # behind a pooler, NOTIFY cannot reach us: poll
            if not self._listen_broken:
                self._listen_broken = True
                log.info("behind a pooler without ACC_LISTEN_DB_URL: no NOTIFY wake-ups; polling every %.2fs",
                         self.poll_interval, extra=self.extra)
            self._listen_retry_at = float("inf")
            return
        try:
            conn = daemon.connect(application_name=f"accs agent {self.node} listen", listen=True)
            for key in self.service_keys:
                conn.execute(f'LISTEN "{service_channel(key)}"')
        except psycopg.Error as exc:
            self._listen_retry_at = time.monotonic() + self._listen_backoff.next_delay()
            if not self._listen_broken:
                self._listen_broken = True
                log.warning("LISTEN unavailable (%s); polling until it is back", daemon.first_line(exc),
                            extra=self.extra)
            return
        if self._listen_broken:
            log.info("LISTEN re-established", extra=self.extra)
        self._listen, self._listen_broken = conn, False
        self._listen_backoff.reset()

    def _close_listen(self) -> None:
        daemon.close_quietly(self._listen)
        self._listen = None

    def _listen_fd(self) -> int | None:
        if self._listen is None:
            self._open_listen()
        if self._listen is None:
            return None
        try:
            return self._listen.fileno()
        except Exception:  # noqa: BLE001 - closed under us
            self._close_listen()
            return None

    def _wait(self, *, limit: float | None = None) -> None:
        """Sleep until a NOTIFY, a worker's news or the jittered poll timer (at most ``limit`` seconds)."""
        timeout = self.poll_interval * random.uniform(0.8, 1.2)
        if limit is not None:
            timeout = min(timeout, limit)
        if self._drain_deadline is not None and not self.stop_now:  # wake up when the drain time is over
            timeout = min(timeout, max(0.0, self._drain_deadline - time.monotonic()))
        fds = [self._wake_r]
        was_listening = self._listen is not None
        listen_fd = self._listen_fd()
        if listen_fd is not None and not was_listening:
            # Listening only from now on: work queued after the last claim sent its NOTIFY to
            # nobody (at start-up, or after LISTEN was lost), so claim once more before sleeping.
            self._notified = True
            return
        if listen_fd is not None:
            fds.append(listen_fd)
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError):
            ready = []
        # A file descriptor came from an open LISTEN connection, which nothing closed since.
        if listen_fd is not None and listen_fd in ready and self._listen is not None:
            self._notified = True
            try:
                for _ in self._listen.notifies(timeout=0, stop_after=1000):
                    pass
            except psycopg.Error as exc:
                log.warning("LISTEN connection lost (%s); reopening", daemon.first_line(exc), extra=self.extra)
                self._listen_broken = True
                self._close_listen()
                self._open_listen()

    def _sleep(self, delay: float) -> None:
        """Back off for ``delay`` seconds; a signal (not a worker's news) cuts it short."""
        deadline = time.monotonic() + delay
        signalled = (self.stopping, self.stop_now, self.abandon)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self.stopping, self.stop_now, self.abandon) != signalled:
                return
            try:
                select.select([self._wake_r], [], [], left)
            except (OSError, ValueError):
                time.sleep(min(left, 0.1))
            self._drain_wake_pipe()  # worker news stays in the inbox for the next pass


def _started_items(started: dict[Key, int | None]) -> list[tuple[UUID, int, int | None]]:
    return [(key[0], key[1], pid) for key, pid in started.items()]


def _as_stopped(outcome: Outcome, ctx: RunContext, *, lease_seconds: float) -> Outcome:
    """Name why the agent stopped an attempt: a shutdown or an outage interrupts it, a lost lease fails it.

    An operator's cancel stays ``canceled``. An attempt that ended by itself keeps its outcome.
    """
    if outcome.status != "canceled" or ctx.stop_reason in ("", "cancel"):
        return outcome
    if ctx.stop_reason == "shutdown":
        return Outcome(task_id=outcome.task_id, attempt=outcome.attempt, status="interrupted",
                       error="interrupted: the agent shut down and stopped the attempt", error_code="interrupted",
                       exit_code=outcome.exit_code, stdout_tail=outcome.stdout_tail, stderr_tail=outcome.stderr_tail)
    if ctx.stop_reason == "outage":
        return Outcome(task_id=outcome.task_id, attempt=outcome.attempt, status="interrupted",
                       error=f"outage: the database was unreachable, so the agent could not renew the lease (TTL "
                             f"{lease_seconds:.0f}s) and stopped the attempt before another agent could take the task",
                       error_code=INTERRUPTED_BY_OUTAGE, exit_code=outcome.exit_code,
                       stdout_tail=outcome.stdout_tail, stderr_tail=outcome.stderr_tail)
    return Outcome(task_id=outcome.task_id, attempt=outcome.attempt, status="failed", error_code=LEASE_LOST,
                   error=f"lease_lost: the agent could not renew the lease (TTL {lease_seconds:.0f}s) and stopped "
                         "the attempt before another agent could take the task",
                   exit_code=outcome.exit_code, stdout_tail=outcome.stdout_tail, stderr_tail=outcome.stderr_tail)


def _prepare_and_run(task: ClaimedTask, ctx: RunContext, executor: Any, *, limit: float,
                     context: StepContext | None = None) -> Outcome:
    """Read what the attempt needs from the database (unless its claim's batch read gave ``context``)
    and storage, then run it. Stopped while it waited out an outage (see :func:`_while_reachable`),
    the attempt ends ``canceled`` before it ran, which :func:`_as_stopped` names by why it was stopped."""
    steps: list[tuple[str, Callable[[ClaimedTask, RunContext], None]]] = []
    if context is None:
        steps.append(("read its parents' outputs", _read_step_context))
    else:
        _give_step_context(ctx, context)
    if ctx.output_dir and accs.minio.configured:
        steps.append(("stage its input artifacts", _stage_inputs))
    for what, step in steps:
        if not _while_reachable(task, ctx, what, step, limit=limit):
            return Outcome(task_id=task.id, attempt=task.attempt, status="canceled", error="stopped before it ran")
    return executor.run(task, ctx)


def _while_reachable(task: ClaimedTask, ctx: RunContext, what: str,
                     step: Callable[[ClaimedTask, RunContext], object], *, limit: float) -> bool:
    """Run ``step`` (the attempt's database work outside its own code) until it succeeds; return
    whether it did.

    While the database is unreachable (a restart, a cut connection) the step is tried again with
    backoff rather than failing the attempt: the attempt holds its lease meanwhile (the renewals run
    on their own thread), and an outage is no fault of the task. The waiting ends when the attempt
    is stopped (an operator's cancel, or the lease watchdog once the outage outlasts the lease,
    which names the outage as the reason): False. A database that answers but keeps failing the
    step for ``limit`` seconds, or any other error, is the step's own and is raised.
    """
    backoff = daemon.Backoff(base=0.2, cap=5.0)
    deadline = time.monotonic() + limit
    while True:
        try:
            close_old_connections()  # this worker thread's connection may have died in an outage
            step(task, ctx)
        except Exception as exc:
            if not daemon.is_database_unreachable(exc) or time.monotonic() > deadline:
                raise
            daemon.close_django_connection()
            if backoff.failures == 0:
                log.warning("task %s attempt %d could not %s (%s); trying again until the database answers",
                            task.id, task.attempt, what, daemon.first_line(exc),
                            extra={"task_id": task.id, "job_id": task.job_id})
            if ctx.cancel.wait(backoff.next_delay()):
                return False
        else:
            if backoff.failures:
                log.info("task %s attempt %d could %s again", task.id, task.attempt, what,
                         extra={"task_id": task.id, "job_id": task.job_id})
            return True


def _read_step_context(task: ClaimedTask, ctx: RunContext) -> None:
    """Give the attempt its parents' outputs and its step's output schema (:func:`jobs.inputs.step_context`);
    a secret among those outputs is redacted from what the attempt logs, as a secret param is."""
    _give_step_context(ctx, step_context(task.id))


def _give_step_context(ctx: RunContext, found: StepContext) -> None:
    ctx.inputs, ctx.output_schema = found.inputs, found.output_schema
    ctx.secrets += found.secrets


def _stage_inputs(task: ClaimedTask, ctx: RunContext) -> None:
    """Download the task's input artifacts into a fresh directory (ACCS_INPUT_DIR)."""
    ctx.input_dir = ctx.input_dir or scratch_dir(task)  # tried again after an outage: the same folder
    artifacts.stage_inputs(job_id=task.job_id, task_id=task.id, directory=ctx.input_dir)


def _store_artifacts(task: ClaimedTask, ctx: RunContext, outcome: Outcome, *, limit: float) -> None:
    """Upload output files and the attempt's log, in the worker thread, when storage is configured."""
    if not accs.minio.configured:
        return
    records = ctx.log_records + [{"ts": _now_iso(), "level": "info",
                                  "message": f"attempt {task.attempt} ended: {outcome.status}"}]
    # One upload each: output files the store refuses must not cost the attempt's log.
    output_dir = ctx.output_dir
    if output_dir:
        _guarded_upload(task, ctx, "upload its output files", limit, lambda: artifacts.collect_outputs(
            job_id=task.job_id, task_id=task.id, task_key=task.task_key, attempt=task.attempt,
            directory=output_dir))
    _guarded_upload(task, ctx, "upload its log", limit, lambda: artifacts.upload_attempt_log(
        job_id=task.job_id, task_id=task.id, task_key=task.task_key, attempt=task.attempt, records=records))


def _guarded_upload(task: ClaimedTask, ctx: RunContext, what: str, limit: float,
                    upload: Callable[[], object]) -> None:
    """Run one artifact upload, waiting out an outage of the database as the attempt's preparation
    does; storage trouble is logged and must not lose the outcome."""
    try:
        if not _while_reachable(task, ctx, what, lambda _task, _ctx: upload(), limit=limit):
            log.warning("task %s attempt %d: gave up trying to %s (the attempt was stopped)", task.id, task.attempt,
                        what, extra={"task_id": task.id, "job_id": task.job_id})
    except Exception:  # noqa: BLE001 - storage trouble must not lose the outcome
        log.exception("artifact upload failed", extra={"task_id": task.id, "job_id": task.job_id})
        daemon.close_django_connection()


def _now_iso() -> str:
    from django.utils import timezone

    return timezone.now().isoformat()
