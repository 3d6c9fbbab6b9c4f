"""The builder loop: turn due jobs into tasks and keep the system healthy.

Every builder instantiates due jobs (several may run; SKIP LOCKED shares the work), within a
budget per tick (batches and seconds), so a large backlog never starves the rest. One builder,
the leader, holds a session-level advisory lock on a dedicated connection and also runs the
maintenance duties (:mod:`jobs.duties`): rescue expired leases, fire cron triggers, expire
governor conditions, wake nodes, keep event partitions ready, archive old months. Every due
duty runs every tick within its own budget.

Leadership is checked every tick on the session that holds the lock: if that session is gone
(a restart, a network cut, an operator's ``pg_terminate_backend``), the lock went with it; the
builder steps down, reconnects and competes again. Every step is guarded: a database outage
is logged once, the loop backs off with jitter and resumes; start-up waits for the database.
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
from jobs import transitions
from jobs.duties import Duty, all_duties
from jobs.notify import builder_channel

log = logging.getLogger("accs.builder")

LEADER_LOCK_KEY = 0x4143435301  # "ACCS" + 1
LOCK_APPLICATION_NAME = "accs builder lock"
INSTANTIATE_MAX_BATCHES = 4
INSTANTIATE_MAX_SECONDS = 2.0
STALL_LIMIT_SECONDS = daemon.DAEMON_STATEMENT_TIMEOUT_MS / 1000 + 15

# Is the leader lock held by this session? A session-level advisory lock on a bigint key shows
# in pg_locks as classid (high 32 bits), objid (low 32 bits), objsubid 1.
HOLDS_LOCK_SQL = """
SELECT count(*) FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
   AND classid::bigint = (%(key)s::bigint >> 32) AND objid::bigint = (%(key)s::bigint & 4294967295)
"""


class Builder:
    """Run builder ticks until stopped (or, with ``once``, one pass of everything)."""

    def __init__(self, *, tick_seconds: float = 1.0, batch: int = 500, once: bool = False,
                 duties: list[Duty] | None = None) -> None:
        self.tick_seconds = tick_seconds
        self.batch = batch
        self.once = once
        self.stopping = False
        self.is_leader = False
        self._conn: psycopg.Connection | None = None
        self._conn_retry_at = 0.0
        self._conn_backoff = daemon.Backoff(base=0.2, cap=10.0)
        self.duties = duties if duties is not None else all_duties(batch=batch)
        self._last_run: dict[str, float] = {}
        self.guard = daemon.Guard(log, on_transient=daemon.close_django_connection)
        self.backoff = daemon.Backoff(base=0.2, cap=10.0)
        self._db = connection
        self.stall = daemon.StallBreaker(limit=STALL_LIMIT_SECONDS, connections=lambda: [self._db, self._conn],
                                         logger=log)
        self.backlog = False
        self.stats = {"jobs_started": 0, "ticks": 0}

    def install_signal_handlers(self) -> None:
        def handle(signum, frame) -> None:
            if self.stopping:
                raise SystemExit(1)
            self.stopping = True

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    # ------------------------------------------------------------------ the dedicated session
    def _ensure_session(self) -> None:
        """Open the dedicated connection (LISTEN + leader lock) if it is closed, with backoff."""
        if self._conn is not None or time.monotonic() < self._conn_retry_at:
            return
        try:
            conn = daemon.connect(application_name=LOCK_APPLICATION_NAME)
            conn.execute(f'LISTEN "{builder_channel()}"')
        except psycopg.Error:
            self._conn_retry_at = time.monotonic() + self._conn_backoff.next_delay()
            raise
        self._conn, self.is_leader = conn, False
        self._conn_backoff.reset()

    def _drop_session(self, reason: str) -> None:
        if self.is_leader:
            log.warning("stepping down as leader: %s", reason)
        self.is_leader = False
        daemon.close_quietly(self._conn)
        self._conn = None

    def _check_leader(self) -> None:
        """Confirm the lock on its own session every tick; take it when free.

        A failed session is dropped and reopened at once (one more try in this tick); if the
        database itself is unreachable, the error goes to the loop's guard.
        """
        for last_try in (False, True):
            try:
                self._hold_or_take_lock()
                return
            except psycopg.Error as exc:
                self._drop_session(f"its session failed ({daemon.first_line(exc)})")
                if last_try:
                    raise

    def _hold_or_take_lock(self) -> None:
        self._ensure_session()
        if self._conn is None:  # waiting to reconnect (backoff)
            self.is_leader = False
            return
        if self.is_leader:
            if not self._conn.execute(HOLDS_LOCK_SQL, {"key": LEADER_LOCK_KEY}).fetchone()[0]:
                self._drop_session("the leader lock is no longer held by this session")
            return
        if self._conn.execute("SELECT pg_try_advisory_lock(%s)", [LEADER_LOCK_KEY]).fetchone()[0]:
            self.is_leader = True
            log.info("this builder is now the leader")

    # ------------------------------------------------------------------ one tick
    def tick(self) -> int:
        """Do one pass: start due jobs (all builders), then due duties (leader). Return jobs started."""
        self.guard.start_pass()
        self._step("connection check", close_old_connections)
        with self.stall.step("database probe"):
            self.guard.probe()
        started = self._step("instantiate due jobs", self._instantiate, default=0)
        self._step("leadership", self._check_leader)
        if self.is_leader:
            now = time.monotonic()
            for duty in self.duties:
                if self.once or now - self._last_run.get(duty.name, -duty.every) >= duty.every:
                    self._last_run[duty.name] = now
                    done = self._step(duty.name, lambda duty=duty: run_duty(duty), default=0)
                    if done:
                        log.info("maintenance %s: %d", duty.name, done)
        self.stats["ticks"] += 1
        self.stats["jobs_started"] += started
        return started

    def _step(self, name: str, fn, *, default=None):
        if self.guard.outage_this_pass:
            return default
        with self.stall.step(name):
            return self.guard.run(name, fn, default=default)

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
        if self._conn is None:
            time.sleep(timeout)
            return
        try:
            ready, _, _ = select.select([self._conn.fileno()], [], [], timeout)
            if ready:
                for _ in self._conn.notifies(timeout=0, stop_after=10000):
                    pass
        except (OSError, ValueError, psycopg.Error) as exc:
            self._drop_session(f"its session failed ({daemon.first_line(exc)})")
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
            log.info("builder started (tick %.2fs, batch %d)", self.tick_seconds, self.batch)
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


def run_duty(duty: Duty) -> int:
    """Run one duty within its budget: batches of ``limit`` while full, at most ``max_batches``."""
    done = 0
    for _ in range(duty.max_batches):
        n = duty.run(duty.limit)
        done += n
        if n < duty.limit:
            break
    return done
