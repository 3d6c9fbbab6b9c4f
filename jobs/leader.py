"""The builder leader's lease: one row, a fencing number per term, expiry by PostgreSQL's clock.

A builder becomes leader by taking the row ``accs_leader`` ('builder') when its lease has ended
(or when it already holds it), in one short transaction that draws a new fencing number from a
sequence and records the term in ``accs_leader_term``. It renews the lease in short
transactions while it leads. Nothing is held on a session, so the lease works the same through
a transaction-mode pooler (PgBouncer), across the leader's reconnects and after a PostgreSQL
restart; a leader that stops renewing (killed, frozen, cut off) loses it when it expires.

Fencing: every leader-only write runs in one transaction that checks this term's fence twice:
first with a plain read (a deposed leader does no work), then, after the work and just before
the commit, with :data:`CHECK_SQL`, which reads the lease row ``FOR SHARE`` only if it still
carries this term's fence and has not expired. If the term ended meanwhile, the check finds no
row and the whole transaction rolls back: a deposed leader's late write does nothing. If the
term is still live, the share lock makes a competitor's takeover (an UPDATE of that row) wait the
few milliseconds until the commit, so a term's writes always commit before the next term begins.
A leader frozen in the middle of a duty does not hold the lease row, so it never delays a
takeover; its work is rolled back when it wakes. One frozen in the short window between the
final check and the commit would hold a takeover off; the server ends such a transaction once it
has been idle for :data:`IDLE_LEASES` lease lengths, at least :data:`IDLE_FLOOR_MS` (a duty that
uploads inside its transaction, such as an exported prune, needs that long);
``SET LOCAL idle_in_transaction_session_timeout``. The term row records the span of its writes,
which lets anyone check from the database that terms never overlap (the fleet test does).

Lock order: the lease row comes before everything else a duty locks (advisory locks, job rows,
task rows); no other transaction locks it while holding those.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from django.db import OperationalError, connection, transaction

from accs_site import daemon
from accs_site.version import VERSION, VERSION_PATTERN

log = logging.getLogger("accs.builder")

LEASE_NAME = "builder"
LEASE_SECONDS = 10.0
# A duty's transaction idle this many lease lengths is ended by the server (see above).
IDLE_LEASES = 3
IDLE_FLOOR_MS = 30_000
# A competitor waits this long at most for the leader's duty transaction to end before trying
# again next tick (it only waits at all when it sees the lease expired).
TAKEOVER_LOCK_TIMEOUT_MS = 1000

# Take the lease when it has ended, or again when this holder has it (a new term: the old
# term's in-flight writes, if any, are fenced off). An UPDATE locks only rows that pass its WHERE
# on its snapshot, so a builder that sees a live lease never waits on the leader's duties.
TAKE_SQL = """
UPDATE accs_leader
   SET holder = %(holder)s, fence = nextval('accs_leader_fence_seq'), acquired_at = clock_timestamp(),
       expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
 WHERE name = %(name)s AND (expires_at <= now() OR holder = %(holder)s)
RETURNING fence, acquired_at, expires_at
"""
# The first builder ever (or after the row was deleted) creates the row.
CREATE_SQL = """
INSERT INTO accs_leader (name, holder, fence, acquired_at, expires_at)
SELECT %(name)s, %(holder)s, nextval('accs_leader_fence_seq'), clock_timestamp(),
       clock_timestamp() + %(ttl)s * interval '1 second'
 WHERE NOT EXISTS (SELECT 1 FROM accs_leader WHERE name = %(name)s)
    ON CONFLICT (name) DO NOTHING
RETURNING fence, acquired_at, expires_at
"""
TERM_SQL = """
INSERT INTO accs_leader_term (fence, holder, acquired_at, expires_at, writes) VALUES (%s, %s, %s, %s, 0)
"""
RENEW_SQL = """
WITH r AS (
  UPDATE accs_leader SET expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
   WHERE name = %(name)s AND holder = %(holder)s AND fence = %(fence)s AND expires_at > now()
  RETURNING fence, expires_at
), t AS (UPDATE accs_leader_term t SET expires_at = r.expires_at FROM r WHERE t.fence = r.fence)
SELECT expires_at FROM r
"""
RELEASE_SQL = """
WITH r AS (
  UPDATE accs_leader SET expires_at = clock_timestamp()
   WHERE name = %(name)s AND holder = %(holder)s AND fence = %(fence)s AND expires_at > now()
  RETURNING fence, expires_at
)
UPDATE accs_leader_term t SET expires_at = r.expires_at FROM r WHERE t.fence = r.fence
"""
# The fence checks of every leader-only transaction (see the module docstring): a plain read
# before the work, a share lock on a still-live term just before the commit.
PRECHECK_SQL = """
SELECT clock_timestamp() FROM accs_leader
 WHERE name = %(name)s AND holder = %(holder)s AND fence = %(fence)s AND expires_at > clock_timestamp()
"""
CHECK_SQL = """
SELECT clock_timestamp() FROM accs_leader
 WHERE name = %(name)s AND holder = %(holder)s AND fence = %(fence)s AND expires_at > clock_timestamp()
   FOR SHARE
"""
RECORD_SQL = """
UPDATE accs_leader_term SET writes = writes + %(done)s, first_write_at = coalesce(first_write_at, %(began)s),
       last_write_at = clock_timestamp()
 WHERE fence = %(fence)s
"""


class NotLeader(Exception):
    """This builder's term ended (its lease expired or another builder took it): nothing was written."""


def default_holder() -> str:
    """Return a holder name unique to this builder: host, process id, random suffix, then its release.

    The release (``host:pid:suffix 0.2.0``) tells operators and ``nodes.releases`` which code leads;
    the previous release's builders wrote no release there.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)} {VERSION}"


def holder_version(holder: str) -> str:
    """Return the release a lease holder's name carries, or "" when it carries none (0.1.0)."""
    _, _, tail = holder.rpartition(" ")
    return tail if VERSION_PATTERN.fullmatch(tail) else ""


def _lock_not_available(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)


class Lease:
    """One builder's view of the leader lease: the fence of its current term, if it has one."""

    def __init__(self, *, holder: str | None = None, seconds: float = LEASE_SECONDS, name: str = LEASE_NAME) -> None:
        self.holder = holder or default_holder()
        self.seconds = seconds
        self.name = name
        self.fence: int | None = None
        self._renewed_at = 0.0  # monotonic time the last renewal was sent (before the request)

    @property
    def held(self) -> bool:
        return self.fence is not None

    def _params(self, **extra) -> dict:
        return {"name": self.name, "holder": self.holder, "ttl": self.seconds, "fence": self.fence, **extra}

    def acquire(self) -> int | None:
        """Take the lease if it is free (or ours); return the new term's fence, or None."""
        sent = time.monotonic()
        try:
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(f"SET LOCAL lock_timeout = {int(TAKEOVER_LOCK_TIMEOUT_MS)}")
                cur.execute(TAKE_SQL, self._params())
                row = cur.fetchone()
                if row is None:
                    cur.execute(CREATE_SQL, self._params())
                    row = cur.fetchone()
                if row is None:
                    return None
                fence, acquired_at, expires_at = row
                cur.execute(TERM_SQL, [fence, self.holder, acquired_at, expires_at])
        except OperationalError as exc:
            if _lock_not_available(exc):  # the leader's duty is still running: try next tick
                return None
            raise
        self.fence, self._renewed_at = fence, sent
        return fence

    def renew(self) -> bool:
        """Extend the lease of the current term; False (and no term) when it was lost."""
        if self.fence is None:
            return False
        sent = time.monotonic()
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(f"SET LOCAL lock_timeout = {int(TAKEOVER_LOCK_TIMEOUT_MS)}")
            cur.execute(RENEW_SQL, self._params())
            renewed = cur.fetchone() is not None
        if renewed:
            self._renewed_at = sent
        else:
            self.fence = None
        return renewed

    def due_for_renewal(self) -> bool:
        """Return whether a third of the lease has passed since the last renewal was sent."""
        return time.monotonic() - self._renewed_at >= self.seconds / 3

    def release(self) -> None:
        """End the current term now, so another builder leads without waiting for the expiry."""
        if self.fence is None:
            return
        try:
            with connection.cursor() as cur:
                cur.execute(RELEASE_SQL, self._params())
        finally:
            self.fence = None

    def run_fenced(self, fn: Callable[[], int], *, statement_timeout_ms: int | None = None) -> int:
        """Run ``fn`` (a leader-only write) in one transaction that first checks this term's fence.

        Raise :class:`NotLeader` (nothing written) when the term has ended. The work done is
        recorded on the term row, in the same transaction.
        """
        if self.fence is None:
            raise NotLeader("this builder holds no leader term")
        with transaction.atomic():
            with connection.cursor() as cur:
                idle_ms = max(IDLE_FLOOR_MS, int(self.seconds * IDLE_LEASES * 1000))
                cur.execute(f"SET LOCAL idle_in_transaction_session_timeout = {idle_ms}")
                if statement_timeout_ms is not None:
                    cur.execute(f"SET LOCAL statement_timeout = {int(statement_timeout_ms)}")
                began = self._check(cur, PRECHECK_SQL)
            done = fn()
            with connection.cursor() as cur:
                self._check(cur, CHECK_SQL)
                if done:
                    cur.execute(RECORD_SQL, self._params(done=int(done), began=began))
        return done

    def _check(self, cur, sql: str):
        cur.execute(sql, self._params())
        row = cur.fetchone()
        if row is None:
            fence, self.fence = self.fence, None
            raise NotLeader(f"the lease of term {fence} expired or another builder took it")
        return row[0]


def pooled_statement_timeout_ms() -> int | None:
    """Return the daemons' statement timeout to set per transaction when a pooler forbids ``options``."""
    return daemon.DAEMON_STATEMENT_TIMEOUT_MS if daemon.db_pooler() else None
