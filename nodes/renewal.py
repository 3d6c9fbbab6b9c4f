"""The agent's lease renewal: heartbeats of the attempts it runs, on a thread and a connection of their own.

Nothing the agent's main loop does can delay a renewal: not a claim waiting for a capped
service's lock (a slow claimer, a convoy, a site pausing the service), not a large report, not a
step waiting for the loop's pooled connection. The renewal thread holds one server connection of
its own (the agent's second: the loop and the tasks' ORM queries share the first), opened when
there is something to renew and kept; each renewal is one short transaction that waits for a
row lock (a report or an operator's verb on the same task) at most a twelfth of the shortest
lease held, never longer than the claim's bound (``SET LOCAL``: nothing outlives the transaction, so it
works behind a transaction-mode pooler).

It renews every third of the shortest lease held (at most every third of the agent's own, since a
renewal also brings operators' cancels), and after a failure again within a quarter of that.
Everything is keyed by (task, attempt): a renewal renews only the attempt it names, so it never
touches a newer attempt of the same task, and its answer (renewed, lost, cancel requested) goes
back to the agent through ``on_answer``, called in this thread, whose receiver owns the hand-over
to its own state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg

from accs_site import daemon
from jobs import transitions
from jobs.locks import bound_lock_waits, is_lock_timeout

Key = tuple[UUID, int]  # (task id, attempt number)


@dataclass(frozen=True)
class Held:
    """One attempt to renew: the lease its claim granted and when it was last renewed (monotonic)."""

    lease: float
    renewed_at: float


@dataclass(frozen=True)
class Answer:
    """What one renewal learnt. ``at``: monotonic time taken before the request was sent, so the
    leases the database renewed start no earlier."""

    at: float
    renewed: frozenset[Key]
    lost: frozenset[Key]
    cancel: frozenset[Key]


def renewal_period(*, agent_lease: float, leases: list[float]) -> float:
    """Return how often to renew: every third of the shortest lease held, at most a third of the agent's own."""
    return min([agent_lease, *leases]) / 3


def renewal_lock_wait(*, period: float, claim_lock_wait: float) -> float:
    """Return how long a renewal waits for a row lock: a quarter of a period (a twelfth of the
    shortest lease), at most the claim's bound. A renewal that waits it out is retried within
    another quarter, and that retry too ends before the watchdog's deadline (lease − lease/4):
    a held row costs a late renewal, never the lease."""
    return min(period / 4, claim_lock_wait)


class LeaseRenewal:
    """Renew the leases ``held()`` names, in a thread of its own; tell ``on_answer`` what was learnt."""

    def __init__(self, *, node: str, agent_id: str, agent_lease: float, claim_lock_wait: float,
                 held: Callable[[], Mapping[Key, Held]], on_answer: Callable[[Answer], None],
                 stall_limit: float, logger: logging.Logger, extra: dict[str, Any] | None = None) -> None:
        self.node = node
        self.agent_id = agent_id
        self.agent_lease = agent_lease
        self.claim_lock_wait = claim_lock_wait
        self.held = held
        self.on_answer = on_answer
        self.log = logger
        self.extra = extra or {}
        # Set while renewals fail because the database cannot be reached (not for a lock wait that
        # ran out: the database answered). The agent's watchdog reads it from its own thread.
        self.outage_since: float | None = None
        self._failing: str = ""  # what the current run of failures is, logged once when it starts
        self._conn: psycopg.Connection | None = None
        self._last_at = 0.0
        self._retry_at: float | None = None
        self._backoff = daemon.Backoff(base=0.1, cap=10.0)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accs-lease-renewal", daemon=True)
        # A blackholed connection no TCP timer sees yet: its blocked call is broken, and retried.
        self.stall = daemon.StallBreaker(limit=stall_limit, connections=lambda: [self._conn], logger=logger,
                                         extra=self.extra)

    def start(self) -> None:
        self.stall.start()
        self._thread.start()

    def poke(self) -> None:
        """Look at what is held again now (a new attempt may hold a shorter lease)."""
        self._wake.set()

    def close(self, *, timeout: float = 1.0) -> None:
        """Stop renewing; wait up to ``timeout`` for a renewal in flight, then close the connection."""
        self._closed.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.stall.close()
        if not self._thread.is_alive():
            daemon.close_quietly(self._conn)
            self._conn = None

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                delay = self._tick(time.monotonic())
            except Exception:  # noqa: BLE001 - the renewal must outlive any surprise
                self.log.exception("lease renewal failed", extra=self.extra)
                delay = 1.0
            self._wake.wait(delay)
            self._wake.clear()
        daemon.close_quietly(self._conn)
        self._conn = None

    def _tick(self, now: float) -> float | None:
        """Renew if due; return how long to sleep before looking again (None: until poked)."""
        held = dict(self.held())
        if not held:
            self._retry_at = None
            return None
        self._open_early(count=len(held))
        period = renewal_period(agent_lease=self.agent_lease, leases=[h.lease for h in held.values()])
        if self._retry_at is not None:
            due = self._retry_at
        else:
            due = max(self._last_at, min(h.renewed_at for h in held.values())) + period
        if now < due:
            return due - now
        self._last_at = now
        answer = self.renew(held, lock_wait=renewal_lock_wait(period=period, claim_lock_wait=self.claim_lock_wait))
        if answer is None:
            self._retry_at = time.monotonic() + min(self._backoff.next_delay(), period / 4)
            return self._retry_at - time.monotonic()
        self._retry_at = None
        self._backoff.reset()
        self.on_answer(answer)
        return period

    def renew(self, held: Mapping[Key, Held], *, lock_wait: float) -> Answer | None:
        """Renew ``held`` in one transaction; return what was learnt, or None when it failed (logged once)."""
        at = time.monotonic()  # before the request: the renewed lease starts no earlier
        keys = sorted(held, key=str)
        try:
            with self.stall.step("lease renewal"):
                conn = self._connection()
                with conn.transaction(), conn.cursor() as cur:
                    bound_lock_waits(cur, seconds=lock_wait)
                    lost, cancel = transitions.heartbeat(keys, agent_id=self.agent_id,
                                                         lease_seconds={k: held[k].lease for k in keys}, cursor=cur)
        except Exception as exc:  # noqa: BLE001 - sorted below
            self._failed(exc, count=len(keys))
            return None
        self._succeeded()
        return Answer(at=at, renewed=frozenset(keys) - lost, lost=frozenset(lost), cancel=frozenset(cancel))

    def _open_early(self, *, count: int) -> None:
        """Open the connection as soon as something is held, not at the first renewal a period later:
        the connection is there when needed, and a refused one is known (and retried) early."""
        if self._conn is not None and not self._conn.closed:
            return
        try:
            with self.stall.step("lease renewal connect"):
                self._connection()
        except Exception as exc:  # noqa: BLE001 - the renewal tries again when it is due
            self._failed(exc, count=count)

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = daemon.connect(application_name=f"accs agent {self.node} renewal")
        return self._conn

    def _failed(self, exc: BaseException, *, count: int) -> None:
        waited_out = is_lock_timeout(exc)
        if daemon.is_transient(exc) and not waited_out:
            daemon.close_quietly(self._conn)  # a fresh connection next time
            self._conn = None
            if self.outage_since is None:
                self.outage_since = time.monotonic()
        kind = "lock" if waited_out else ("outage" if daemon.is_transient(exc) else "error")
        if self._failing == kind:
            self.log.debug("lease renewal still failing: %s", daemon.first_line(exc), extra=self.extra)
            return
        self._failing = kind
        if waited_out:
            self.log.warning("lease renewal of %d attempt(s) waited too long for a row lock; retrying", count,
                             extra=self.extra)
        elif kind == "outage":
            self.log.warning("lease renewal of %d attempt(s) cannot reach the database (%s); retrying", count,
                             daemon.first_line(exc), extra=self.extra)
        else:
            self.log.error("lease renewal of %d attempt(s) failed: %s; retrying", count, daemon.first_line(exc),
                           exc_info=exc, extra=self.extra)

    def _succeeded(self) -> None:
        if self._failing:
            self.log.info("lease renewal works again", extra=self.extra)
        self._failing = ""
        self.outage_since = None
