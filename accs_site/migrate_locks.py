"""Bounded lock waits for ``manage.py migrate``: no statement of a migration waits long for a lock.

PostgreSQL grants a table's locks in the order they were asked for. A migration that waits for ACCESS
EXCLUSIVE on ``accs_task`` behind one long transaction therefore makes every later claim and report on
that table wait behind it, for as long as that transaction lasts. Here each statement ``migrate`` runs
waits at most a lock timeout (``lock_timeout``, ``ACC_MIGRATE_LOCK_TIMEOUT_SEC``); then the queue
behind it moves on, and the migration is tried again after a backoff, up to ``ACC_MIGRATE_LOCK_TRIES``
tries in all, before ``migrate`` fails with one line naming the migration and the lock it waited for.

What is tried again depends on the migration:

* an atomic migration rolled back whole, so the whole migration runs again;
* a non-atomic one (one statement per transaction, as ``CREATE INDEX CONCURRENTLY`` needs) keeps the
  statements it finished, so only the statement that timed out runs again. A statement that timed out
  left nothing behind, except ``CREATE INDEX CONCURRENTLY``: it records its index before it waits for
  the table's writers, so a timeout leaves an INVALID index of that name. Before each try of such a
  statement (in this run, or a later ``migrate`` after one that gave up) an INVALID index of that name is
  dropped (concurrently). ``REINDEX CONCURRENTLY`` and ``DETACH PARTITION CONCURRENTLY`` leave states that
  need a person, so they are not tried again.

It is an extension of Django's ``migrate``, not a database backend: a site keeps its ``ENGINE``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.migration import Migration
from django.db.migrations.state import ProjectState

LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for "canceling statement due to lock timeout"

_CREATE_INDEX_CONCURRENTLY = re.compile(
    r'^\s*CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+(?:IF\s+NOT\s+EXISTS\s+)?("(?:[^"]|"")+"|[\w$]+)',
    re.IGNORECASE)
_NOT_RETRY_SAFE = re.compile(r"\bREINDEX\b.*\bCONCURRENTLY\b|\bDETACH\s+PARTITION\b.*\bCONCURRENTLY\b",
                             re.IGNORECASE | re.DOTALL)

# What the migrating connection waits for, and who holds it (seen from a second connection).
_WAITING_FOR = """
SELECT l.mode, coalesce(l.relation::regclass::text, l.locktype), b.pid, b.application_name,
       extract(epoch FROM now() - b.xact_start)
  FROM pg_locks l
  LEFT JOIN LATERAL unnest(pg_blocking_pids(l.pid)) AS bp(pid) ON true
  LEFT JOIN pg_stat_activity b ON b.pid = bp.pid
 WHERE l.pid = %s AND NOT l.granted
 LIMIT 1"""


@dataclass(frozen=True, kw_only=True)
class LockPolicy:
    """How long one lock wait may last, how many tries a migration gets, and the pause between them."""

    timeout_s: float
    tries: int
    backoff_s: float = 0.5
    backoff_cap_s: float = 8.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"the lock timeout must be above 0 seconds, got {self.timeout_s!r}")
        if self.tries < 1:
            raise ValueError(f"a migration needs at least 1 try, got {self.tries!r}")

    def pause_before(self, attempt: int) -> float:
        """Return the pause before try ``attempt`` (2, 3, ...): doubling from ``backoff_s``, capped."""
        return min(self.backoff_cap_s, self.backoff_s * 2 ** max(0, attempt - 2))

    @property
    def timeout_sql(self) -> str:
        return f"SET lock_timeout = '{max(1, round(self.timeout_s * 1000))}ms'"


def is_lock_timeout(exc: BaseException) -> bool:
    """True when ``exc`` (or the driver error under Django's) is PostgreSQL's lock timeout."""
    while exc is not None:
        if getattr(exc, "sqlstate", None) == LOCK_NOT_AVAILABLE or getattr(exc, "pgcode", None) == LOCK_NOT_AVAILABLE:
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def concurrent_index_name(sql: str) -> str | None:
    """Return the index a ``CREATE INDEX CONCURRENTLY`` statement builds (unquoted), or None for other SQL."""
    found = _CREATE_INDEX_CONCURRENTLY.match(sql)
    if not found:
        return None
    name = found.group(1)
    return name[1:-1].replace('""', '"') if name.startswith('"') else name.lower()


@dataclass
class LockWait:
    """The last lock wait that timed out: the statement, and what it waited for when it was seen."""

    statement: str
    lock: str = ""

    def describe(self) -> str:
        return self.lock or "a lock (not seen in pg_locks before the timeout)"


class BoundedLocks:
    """Sets the lock timeout on the migrating connection, retries non-atomic statements, names the lock."""

    def __init__(self, *, connection: BaseDatabaseWrapper, policy: LockPolicy,
                 note: Callable[[str], None]) -> None:
        self.connection, self.policy, self.note = connection, policy, note
        self.last: LockWait | None = None
        self._seen = ""

    @contextmanager
    def active(self) -> Iterator[None]:
        """Set ``lock_timeout`` for the session and watch every statement while the block runs."""
        with self.connection.cursor() as cur:
            cur.execute(self.policy.timeout_sql)
        try:
            with self.connection.execute_wrapper(self._run):
                yield
        finally:
            if self.connection.connection is not None and not self.connection.in_atomic_block:
                with self.connection.cursor() as cur:
                    cur.execute("RESET lock_timeout")

    def _run(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict) -> Any:
        index = concurrent_index_name(sql) if isinstance(sql, str) else None
        # Inside a transaction a timeout aborts it: the whole migration is tried again (RetryingExecutor).
        retry_here = not self.connection.in_atomic_block and not _NOT_RETRY_SAFE.search(str(sql))
        attempt = 1
        while True:
            try:
                if index:
                    self._drop_invalid_index(index, execute, context)
                with self._watching():
                    return execute(sql, params, many, context)
            except OperationalError as exc:
                if not is_lock_timeout(exc):
                    raise
                self.last = LockWait(statement=" ".join(str(sql).split())[:160], lock=self._seen)
                if not retry_here or attempt >= self.policy.tries:
                    raise
                attempt += 1
                self._pause(attempt)

    def _pause(self, attempt: int) -> None:
        pause = self.policy.pause_before(attempt)
        self.note(f"lock wait over {self.policy.timeout_s:g} s for {self.last.describe() if self.last else 'a lock'}"
                  f"; try {attempt} of {self.policy.tries} in {pause:g} s")
        time.sleep(pause)  # a backoff: the daemons' queue behind the lock moves on meanwhile

    def _drop_invalid_index(self, name: str, execute: Callable[..., Any], context: dict) -> None:
        """Drop an INVALID index ``name`` left by a ``CREATE INDEX CONCURRENTLY`` that timed out."""
        cursor = context["cursor"]
        cursor.execute("SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
                       [self.connection.ops.quote_name(name)])
        row = cursor.fetchone()
        if row and row[0]:
            self.note(f"dropping the INVALID index {name} an earlier try left, before building it again")
            with self._watching():
                execute(f"DROP INDEX CONCURRENTLY IF EXISTS {self.connection.ops.quote_name(name)}", None, False,
                        context)

    @contextmanager
    def _watching(self) -> Iterator[None]:
        """Once a statement has run half the lock timeout, note from a second connection what it waits for."""
        self._seen = ""
        pid = self.connection.connection.info.backend_pid
        timer = threading.Timer(self.policy.timeout_s / 2, self._look, kwargs={"pid": pid})
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            timer.join()

    def _look(self, *, pid: int) -> None:
        other = connections.create_connection(self.connection.alias)
        try:
            with other.cursor() as cur:
                cur.execute(_WAITING_FOR, [pid])
                row = cur.fetchone()
        except Exception:  # noqa: BLE001 - a diagnosis only: the migration's own error decides
            return
        finally:
            other.close()
        if row:
            mode, what, holder, app, open_s = row
            held = (f", held by pid {holder} ({app or 'no application name'}"
                    f"{f', in a transaction open {open_s:.0f} s' if open_s is not None else ''})" if holder else "")
            self._seen = f"{mode} on {what}{held}"


class RetryingExecutor(MigrationExecutor):
    """Django's executor, trying an atomic migration again (it rolled back whole) after a lock timeout."""

    bounded: BoundedLocks

    def apply_migration(self, state: ProjectState, migration: Migration, fake: bool = False,
                        fake_initial: bool = False) -> ProjectState:
        def run(attempt: int) -> ProjectState:
            nonlocal state
            if attempt > 1:
                state = self._state_before_retry()
            return super(RetryingExecutor, self).apply_migration(state, migration, fake=fake,
                                                                 fake_initial=fake_initial)
        return self._tries(migration, fake, run)

    def unapply_migration(self, state: ProjectState, migration: Migration, fake: bool = False) -> ProjectState:
        # Migration.unapply works on copies of the state: a retry can start from the same one.
        return self._tries(migration, fake, lambda attempt: super(RetryingExecutor, self).unapply_migration(
            state, migration, fake=fake))

    def _state_before_retry(self) -> ProjectState:
        """Return the project state of the migrations recorded as applied.

        The failed try advanced the state it was given in place (Migration.apply does); it rolled back,
        so it is not recorded, and the applied migrations give the state before it again. Copying the
        state before every try instead costs a third more time on a full migrate; this costs only a retry.
        """
        self.loader.build_graph()
        return self._create_project_state(with_applied_migrations=True)  # type: ignore[attr-defined]

    def _tries(self, migration: Migration, fake: bool, run: Callable[[int], ProjectState]) -> ProjectState:
        whole = migration.atomic and self.connection.features.can_rollback_ddl and not fake
        tries = self.bounded.policy.tries if whole else 1  # a non-atomic one retries its statement instead
        for attempt in range(1, tries + 1):
            try:
                return run(attempt)
            except OperationalError as exc:
                if not is_lock_timeout(exc):
                    raise
                if attempt == tries:
                    raise MigrationLockTimeout(gave_up_line(migration, bounded=self.bounded, atomic=whole)) from exc
                self.bounded._pause(attempt + 1)
        raise AssertionError("unreachable: the last try returns or raises")


class MigrationLockTimeout(Exception):
    """A migration's lock waits timed out on every try."""


def gave_up_line(migration: Migration, *, bounded: BoundedLocks, atomic: bool) -> str:
    """Return the one line ``migrate`` fails with: the migration, the lock, what is applied of it."""
    wait = bounded.last or LockWait(statement="")
    applied = ("nothing of it is applied (its transaction rolled back)" if atomic else
               "it is not recorded as applied; its statements before that one are (it is not atomic)")
    return (f"migrate gave up on {migration.app_label}.{migration.name} after {bounded.policy.tries} "
            f"tr{'y' if bounded.policy.tries == 1 else 'ies'}: each waited over {bounded.policy.timeout_s:g} s "
            f"for {wait.describe()} (statement: {wait.statement}); {applied}. Run migrate again once that "
            "transaction ends (ACC_MIGRATE_LOCK_TIMEOUT_SEC, ACC_MIGRATE_LOCK_TRIES; docs/deploy.md)")
