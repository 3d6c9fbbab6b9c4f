"""The builder loop: turn due jobs into tasks and keep the system healthy.

Every builder instantiates due jobs (several may run; SKIP LOCKED shares the work), within a
budget per tick (batches and seconds), so a large backlog never starves the rest. One builder,
the leader, holds the leader lease (:mod:`jobs.leader`: a row with a fencing number and an expiry
by PostgreSQL's clock) and also runs the maintenance duties (:mod:`jobs.duties`): rescue expired
leases, fire cron triggers, expire governor conditions, wake nodes, keep event partitions ready,
archive old months. Every builder stamps the cluster's pulse each tick (:mod:`jobs.pulse`), the
engine's own record of outages. Every due duty runs every tick within its own budget, each batch in a
transaction that first checks the leader's fence, so a deposed leader's late write does nothing.

The lease is taken and renewed in short transactions (every third of its length): nothing lives
on a session, so leadership works the same through a transaction-mode pooler and survives the
leader's reconnects; a leader that stops renewing (killed, frozen, cut off) loses it when it
expires and another builder takes over. Every step is guarded: a database outage is logged once,
the loop backs off with jitter and resumes; start-up waits for the database. A dedicated
connection LISTENs for due work where NOTIFY can arrive (direct, or ``ACC_LISTEN_DB_URL``).
"""

from __future__ import annotations

import logging
import random
import select
import signal
import time

import psycopg
from django.db import close_old_connections, connection

from accs_site import daemon
from accs_site.version import VERSION
from jobs import leader, pulse, transitions
from jobs.duties import Duty, all_duties
from jobs.notify import builder_channel

log = logging.getLogger("accs.builder")

LISTEN_APPLICATION_NAME = "accs builder listen"
INSTANTIATE_MAX_BATCHES = 4
INSTANTIATE_MAX_SECONDS = 2.0
STALL_LIMIT_SECONDS = daemon.DAEMON_STATEMENT_TIMEOUT_MS / 1000 + 15


class Builder:
    """Run builder ticks until stopped (or, with ``once``, one pass of everything)."""

    def __init__(self, *, tick_seconds: float = 1.0, batch: int = 500, once: bool = False,
                 duties: list[Duty] | None = None, lease_seconds: float = leader.LEASE_SECONDS) -> None:
        self.tick_seconds = tick_seconds
        self.batch = batch
        self.once = once
        self.stopping = False
        self.lease = leader.Lease(seconds=lease_seconds)
        self._conn: psycopg.Connection | None = None  # the LISTEN connection
        self._conn_retry_at = 0.0
        self._conn_backoff = daemon.Backoff(base=0.2, cap=10.0)
        self._polling_announced = False
        self.duties = duties if duties is not None else all_duties(batch=batch)
        self._last_run: dict[str, float] = {}
        self.guard = daemon.Guard(log, on_transient=daemon.close_django_connection)
        self.backoff = daemon.Backoff(base=0.2, cap=10.0)
        self._db = connection
        self.stall = daemon.StallBreaker(limit=STALL_LIMIT_SECONDS, connections=lambda: [self._db, self._conn],
                                         logger=log)
        self.backlog = False
        self.stats = {"jobs_started": 0, "ticks": 0}

    @property
    def is_leader(self) -> bool:
        return self.lease.held

    def install_signal_handlers(self) -> None:
        def handle(signum, frame) -> None:
            if self.stopping:
                raise SystemExit(1)
            self.stopping = True

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    # ------------------------------------------------------------------ the LISTEN session
    def _ensure_session(self) -> None:
        """Open the LISTEN connection if it is closed (with backoff), where NOTIFY can arrive."""
        if self._conn is not None or time.monotonic() < self._conn_retry_at:
            return
        if not daemon.listen_available():
            if not self._polling_announced:
                self._polling_announced = True
                log.info("behind a pooler without ACC_LISTEN_DB_URL: no NOTIFY wake-ups; ticking every %.2fs",
                         self.tick_seconds)
            return
        try:
            conn = daemon.connect(application_name=LISTEN_APPLICATION_NAME, listen=True)
            conn.execute(f'LISTEN "{builder_channel()}"')
        except psycopg.Error:
            self._conn_retry_at = time.monotonic() + self._conn_backoff.next_delay()
            raise
        self._conn = conn
        self._conn_backoff.reset()

    def _close_listen(self) -> None:
        daemon.close_quietly(self._conn)
        self._conn = None

    def _drop_session(self, reason: str) -> None:
        """Step down (ending the term at once, when the database answers) and close the LISTEN connection."""
        if self.is_leader:
            log.warning("stepping down as leader: %s", reason)
            try:
                self.lease.release()
            except Exception as exc:  # noqa: BLE001 - unreachable: the lease expires by itself
                log.info("could not end the leader term early (%s); it expires by itself", daemon.first_line(exc))
        self._close_listen()

    def _check_leader(self) -> None:
        """Renew the lease when a third of it has passed; take it when it is free."""
        if self.is_leader:
            fence = self.lease.fence
            if not self.lease.due_for_renewal() or self.lease.renew():
                return
            log.warning("stepping down as leader: the lease of term %s ended before it was renewed", fence)
        fence = self.lease.acquire()
        if fence is not None:
            log.info("this builder is now the leader (term %d)", fence)

    # ------------------------------------------------------------------ one tick
    def tick(self) -> int:
        """Do one pass: start due jobs (all builders), then due duties (leader). Return jobs started."""
        self.guard.start_pass()
        self._step("connection check", close_old_connections)
        with self.stall.step("database probe"):
            self.guard.probe()
        # Before any duty: an outage the pulse records now is on record before the rescue looks.
        self._step("pulse", lambda: pulse.stamp(gap_seconds=max(pulse.GAP_SECONDS, 3 * self.tick_seconds)))
        started = self._step("instantiate due jobs", self._instantiate, default=0)
        self._step("leadership", self._check_leader)
        now = time.monotonic()
        for duty in self.duties:
            if not self.is_leader:
                break
            if self.once or now - self._last_run.get(duty.name, -duty.every) >= duty.every:
                self._last_run[duty.name] = now
                self._step("leadership", self._check_leader)  # renews only when a third of the lease passed
                done = self._step(duty.name, lambda duty=duty: self._run_duty(duty), default=0)
                if done:
                    log.info("maintenance %s: %d", duty.name, done)
        self._step("listen", self._ensure_session)
        self.stats["ticks"] += 1
        self.stats["jobs_started"] += started
        return started

    def _step(self, name: str, fn, *, default=None):
        if self.guard.outage_this_pass:
            return default
        with self.stall.step(name):
            return self.guard.run(name, fn, default=default)

    def _run_duty(self, duty: Duty) -> int:
        if not self.is_leader:
            return 0
        try:
            return run_duty(duty, lease=self.lease)
        except leader.NotLeader as exc:
            log.warning("stepping down as leader: %s; %s wrote nothing", exc, duty.name)
            return 0

    def _instantiate(self) -> int:
        """Start due jobs in batches, within this tick's budget (the rest waits for the next tick)."""
        started, deadline = 0, time.monotonic() + INSTANTIATE_MAX_SECONDS
        self.backlog = False
        for _ in range(INSTANTIATE_MAX_BATCHES):
            ids = transitions.start_due_jobs(limit=self.batch)
            started += len(ids)
            if ids:
                log.info("started %d job(s)", len(ids), extra={"job_id": ids[0] if len(ids) == 1 else None})
            if len(ids) < self.batch:
                return started
            if time.monotonic() > deadline:
                break
        self.backlog = True  # more is due: the next tick follows at once
        return started

    # ------------------------------------------------------------------ waiting and running
    def _wait(self) -> None:
        if self.backlog:
            return
        timeout = self.tick_seconds * random.uniform(0.8, 1.2)
        if self.is_leader:
            timeout = min(timeout, self.lease.seconds / 3)  # renew in time whatever the tick
        if self._conn is None:
            time.sleep(timeout)
            return
        try:
            ready, _, _ = select.select([self._conn.fileno()], [], [], timeout)
            if ready:
                for _ in self._conn.notifies(timeout=0, stop_after=10000):
                    pass
        except (OSError, ValueError, psycopg.Error) as exc:
            self._close_listen()
            log.warning("LISTEN connection lost (%s); reopening", daemon.first_line(exc))

    def run(self) -> int:
        daemon.configure_daemon_session(application_name="accs builder")
        # A database that never answers (--once) or is not migrated: one line and an exit code.
        refused = daemon.ready_to_start(log, stopping=lambda: self.stopping,
                                        wait_seconds=daemon.ONCE_DATABASE_WAIT_SECONDS if self.once else None)
        if refused is not None:
            return refused
        self.stall.start()
        try:
            log.info("builder started (ACCS %s as %s, tick %.2fs, batch %d)", VERSION, self.lease.holder,
                     self.tick_seconds, self.batch)
            while not self.stopping:
                self.tick()
                if self.once:
                    break
                if self.guard.failed:
                    time.sleep(self.backoff.next_delay())
                else:
                    self.backoff.reset()
                    self._wait()
        finally:
            self.stall.close()
            self._drop_session("the builder is stopping")
            log.info("builder stopped: %s", self.stats)
        return 0


def run_duty(duty: Duty, *, lease: leader.Lease | None = None) -> int:
    """Run one duty within its budget: batches of ``limit`` while full, at most ``max_batches``.

    With ``lease``, each batch runs in a transaction fenced by the leader's term
    (:meth:`jobs.leader.Lease.run_fenced`): :class:`jobs.leader.NotLeader` when the term ended.
    """
    done = 0
    timeout = leader.pooled_statement_timeout_ms()
    for _ in range(duty.max_batches):
        if lease is None:
            n = duty.run(duty.limit)
        else:
            n = lease.run_fenced(lambda: duty.run(duty.limit), statement_timeout_ms=timeout)
        done += n
        if n < duty.limit:
            break
    return done
