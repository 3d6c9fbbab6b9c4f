"""The builder loop (BLD1-BLD4): turn due jobs into tasks and keep the system healthy.

Every builder instantiates due jobs (several may run; SKIP LOCKED shares the work). One of them,
the leader (a session-level advisory lock on a dedicated connection), also runs the maintenance
services: rescue expired leases, fire cron triggers, expire governor conditions, wake nodes,
keep event partitions ready and archive old months. Each service is small, bounded per pass
(``limit``), idempotent, and logs what it did. A tick's work follows what is due, not table size.
"""

from __future__ import annotations

import logging
import random
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from django.db import close_old_connections, connection
from django.db.utils import InterfaceError, OperationalError
from django.utils import timezone

from jobs import transitions
from jobs.notify import builder_channel

log = logging.getLogger("accs.builder")

LEADER_LOCK_KEY = 0x4143435301  # "ACCS" + 1


@dataclass
class Service:
    """One maintenance duty of the leader: run at most every ``every`` seconds."""

    name: str
    every: float
    run: Callable[[], int | list | object]
    last: float = field(default=0.0)


def _optional(module: str, attr: str) -> Callable | None:
    try:
        return getattr(__import__(module, fromlist=[attr]), attr)
    except (ImportError, AttributeError):
        return None


def _count(value) -> int:
    """Return how much a maintenance duty did: a count, a list of what it did, or a ReportResult."""
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple, set)):
        return len(value)
    if isinstance(value, transitions.ReportResult):
        return len(value.retried) + len(value.failed)
    return 0


def maintenance_services(*, batch: int) -> list[Service]:
    """Return the leader's duties; optional ones appear once their capability is installed."""
    services = [
        Service("rescue_expired_leases", 1.0, lambda: transitions.rescue_expired(limit=batch)),
        Service("wake_nodes", 15.0, lambda: _optional("nodes.wake", "wake_nodes")()),
    ]
    fire = _optional("jobs.triggers", "fire_due_schedules")
    if fire:
        services.append(Service("fire_cron_triggers", 1.0, lambda: fire(limit=100)))
    expire = _optional("workflows.governor", "expire_conditions")
    if expire:
        services.append(Service("expire_governor_conditions", 5.0, lambda: expire()))
    ensure = _optional("events.partitions", "ensure_partitions")
    if ensure:
        services.append(Service("ensure_event_partitions", 3600.0, lambda: ensure()))
    archive = _optional("events.partitions", "archive_partitions")
    if archive:
        services.append(Service("archive_event_partitions", 3600.0, lambda: archive(limit=1)))
    return services


class Builder:
    """Run builder ticks until stopped (or, with ``once``, one pass of everything)."""

    def __init__(self, *, tick_seconds: float = 1.0, batch: int = 500, once: bool = False) -> None:
        self.tick_seconds = tick_seconds
        self.batch = batch
        self.once = once
        self.stopping = False
        self.is_leader = False
        self._conn: psycopg.Connection | None = None
        self.services = maintenance_services(batch=batch)
        self.stats = {"jobs_started": 0, "ticks": 0}

    def install_signal_handlers(self) -> None:
        def handle(signum, frame) -> None:
            if self.stopping:
                raise SystemExit(1)
            self.stopping = True

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def _connect(self) -> None:
        s = connection.settings_dict
        self._conn = psycopg.connect(host=s["HOST"], port=s["PORT"] or None, dbname=s["NAME"], user=s["USER"],
                                     password=s["PASSWORD"] or None, autocommit=True)
        self._conn.execute(f'LISTEN "{builder_channel()}"')
        self.is_leader = False

    def _check_leader(self) -> None:
        """Hold (or try to take) the leader lock; it lives as long as the dedicated session."""
        if self.is_leader:
            return
        row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", [LEADER_LOCK_KEY]).fetchone()
        if row[0]:
            self.is_leader = True
            log.info("this builder is now the leader")

    def tick(self) -> int:
        """Do one pass: start due jobs (all builders), then due maintenance (leader). Return jobs started."""
        close_old_connections()
        started = 0
        while True:  # drain what is due in bounded batches
            ids = transitions.start_due_jobs(limit=self.batch)
            started += len(ids)
            if ids:
                log.info("started %d job(s)", len(ids), extra={"job_id": ids[0] if len(ids) == 1 else None})
            if len(ids) < self.batch:
                break
        self._check_leader()
        if self.is_leader:
            now = time.monotonic()
            for service in self.services:
                if self.once or now - service.last >= service.every:
                    service.last = now
                    try:
                        done = _count(service.run())
                    except Exception:  # noqa: BLE001 - one failing duty must not stop the others
                        log.exception("maintenance %s failed", service.name)
                        continue
                    if done:
                        log.info("maintenance %s: %d", service.name, done)
        self.stats["ticks"] += 1
        self.stats["jobs_started"] += started
        return started

    def _wait(self) -> None:
        timeout = self.tick_seconds * random.uniform(0.8, 1.2)
        try:
            ready, _, _ = select.select([self._conn.fileno()], [], [], timeout)
            if ready:
                for _ in self._conn.notifies(timeout=0, stop_after=10000):
                    pass
        except (OSError, psycopg.Error) as exc:
            log.warning("LISTEN connection lost (%s); reconnecting", exc)
            self._reconnect()

    def _reconnect(self) -> None:
        try:
            if self._conn is not None:
                self._conn.close()
        finally:
            self._conn = None
        while not self.stopping:
            try:
                self._connect()
                return
            except psycopg.Error as exc:
                log.warning("cannot reach the database (%s); retrying", exc)
                time.sleep(min(5.0, self.tick_seconds))

    def run(self) -> int:
        self._connect()
        log.info("builder started (tick %.2fs, batch %d)", self.tick_seconds, self.batch)
        try:
            while not self.stopping:
                try:
                    self.tick()
                except (OperationalError, InterfaceError) as exc:
                    log.warning("tick failed on a database error (%s); retrying", exc)
                    connection.close()
                    self._reconnect()
                if self.once:
                    break
                self._wait()
        finally:
            if self._conn is not None:
                self._conn.close()
            log.info("builder stopped: %s", self.stats)
        return 0
