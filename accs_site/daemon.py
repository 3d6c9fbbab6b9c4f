"""What the long-running daemons (agent, builder) share to survive a bad day.

* :class:`Backoff` — exponential delays with jitter, capped, reset after a good pass;
* :func:`is_transient` (:func:`is_database_unreachable`: the database's part alone) /
  :func:`is_data_error` — sort errors into "retry later" and "this payload can never be written";
* :class:`Guard` — run one step of a loop, never let it kill the daemon, and log an outage once
  (when it starts and when it ends), not once per retry;
* :func:`wait_for_database` — block start-up until PostgreSQL answers, saying so in one line;
* :func:`ready_to_start` — the daemons' start-up: wait for PostgreSQL (for a bounded time if
  asked), then refuse a schema whose migrations are not all applied, in one line each;
* :func:`connect_options` / :func:`configure_daemon_session` / :func:`connect` — TCP keepalives,
  connect and statement timeouts on every long-lived connection, so a dead or hung peer is
  noticed in seconds instead of the kernel's ~15 minutes;
* :class:`StallBreaker` — a thread that breaks a database call blocked longer than a limit (a
  blackholed connection that no TCP timer can see, such as one through a stuck proxy).

Nothing here reads settings at import time: ``accs_site.settings`` imports this module.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")

# Seconds: how long to wait for a connection, and the TCP timers that notice a dead peer.
CONNECT_TIMEOUT = 5
KEEPALIVES_IDLE = 10
KEEPALIVES_INTERVAL = 3
KEEPALIVES_COUNT = 3
# Unacknowledged data this long (ms) closes the connection: a blackholed write is noticed too.
TCP_USER_TIMEOUT_MS = 20_000
# The daemons' statements: nothing they run should take this long; a stuck one is cancelled by
# the server and the loop goes on. Idle-in-transaction: a daemon never waits inside a transaction.
DAEMON_STATEMENT_TIMEOUT_MS = 30_000
DAEMON_IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000


class Backoff:
    """Exponential delays with full jitter between ``base`` and ``cap`` seconds."""

    def __init__(self, *, base: float = 0.2, cap: float = 10.0) -> None:
        self.base, self.cap = base, cap
        self.failures = 0

    def next_delay(self) -> float:
        """Return the delay before the next try and count one more failure."""
        ceiling = min(self.cap, self.base * 2 ** min(self.failures, 30))
        self.failures += 1
        # Jitter in [ceiling/2, ceiling]: daemons that failed together do not retry together.
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.failures = 0


def _error_classes() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """Return (the database's transient errors, the network's, data errors)."""
    from django.db import utils as dj

    database = (dj.OperationalError, dj.InterfaceError, psycopg.OperationalError, psycopg.InterfaceError)
    network = (ConnectionError, TimeoutError, socket.timeout)
    data = (dj.DataError, dj.IntegrityError, dj.ProgrammingError, psycopg.DataError, psycopg.IntegrityError,
            psycopg.ProgrammingError, ValueError, TypeError)
    return database, network, data


def is_transient(exc: BaseException) -> bool:
    """Return whether ``exc`` says the database was unreachable or busy (retrying may work).

    A statement cancelled by ``statement_timeout``, a deadlock victim, a lost or refused
    connection, a server shutting down: the transaction rolled back and nothing was written.
    A plain network error (a socket's, not the database driver's) counts too.
    """
    _, network, _ = _error_classes()
    return is_database_unreachable(exc) or isinstance(exc, network)


def is_database_unreachable(exc: BaseException) -> bool:
    """Return whether ``exc`` is the database driver's transient error: the database (not storage,
    not another service on the network) failed to answer, or answered with a cancel or a deadlock."""
    database, _, _ = _error_classes()
    return isinstance(exc, database) or _lost_mid_command(exc)


def _lost_mid_command(exc: BaseException) -> bool:
    """Return whether psycopg got a garbled answer to a command, as when the server (or the pooler's
    server connection) went away while answering it, during a PostgreSQL restart behind PgBouncer."""
    cause = exc.__cause__ if isinstance(exc.__cause__, psycopg.InternalError) else exc
    return isinstance(cause, psycopg.InternalError) and " results from command " in str(cause)


def is_data_error(exc: BaseException) -> bool:
    """Return whether ``exc`` says the payload itself cannot be written (retrying cannot help)."""
    _, _, data = _error_classes()
    return isinstance(exc, data) and not is_transient(exc)


def first_line(exc: BaseException) -> str:
    """Return the first line of an error, for one readable log line."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


class Guard:
    """Run loop steps so that no exception ends the daemon; log each outage once.

    A transient database error starts an "outage": it is logged once, with the step that saw
    it; further failures are quiet until :meth:`probe` gets an answer again, which logs how long
    it lasted (a step's success does not end it: many steps need no database when idle).
    Any other exception is logged with its traceback once per step until that step succeeds.
    ``failed`` tells the loop that this pass had a failure, so it backs off before the next one;
    ``outage_this_pass`` that the database is unreachable, so the pass's other steps are skipped.
    """

    def __init__(self, logger: logging.Logger, *, extra: dict[str, Any] | None = None,
                 on_transient: Callable[[], None] | None = None) -> None:
        self.log = logger
        self.extra = extra or {}
        self.on_transient = on_transient
        self.outage_since: float | None = None
        self.failed = False
        self.outage_this_pass = False
        self._broken_steps: set[str] = set()

    def run(self, step: str, fn: Callable[[], T], *, default: T = None) -> T:  # type: ignore[assignment]
        """Return ``fn()``, or ``default`` when it raised (logged as described above)."""
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - the point: nothing ends the loop
            self.failed_step(step, exc)
            return default
        self.ok(step)
        return value

    def failed_step(self, step: str, exc: BaseException) -> None:
        """Record that ``step`` raised ``exc``; log it if it starts an outage or a new breakage."""
        self.failed = True
        if is_transient(exc):
            self.outage_this_pass = True
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                self.log.warning("database unreachable during %s (%s); retrying with backoff until it is back",
                                 step, first_line(exc), extra=self.extra)
            else:
                self.log.debug("%s still failing: %s", step, first_line(exc), extra=self.extra)
            if self.on_transient is not None:
                try:
                    self.on_transient()
                except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                    pass
            return
        if step not in self._broken_steps:
            self._broken_steps.add(step)
            self.log.error("%s failed: %s; retrying with backoff", step, first_line(exc), exc_info=exc,
                           extra=self.extra)

    def ok(self, step: str) -> None:
        """Record that ``step`` succeeded (it may not have needed the database: no outage ends here)."""
        if step in self._broken_steps:
            self._broken_steps.discard(step)
            self.log.info("%s works again", step, extra=self.extra)

    def probe(self) -> bool:
        """During an outage, ask the database for ``SELECT 1``; end the outage (logged once) if it answers."""
        if self.outage_since is None:
            return True
        try:
            from django.db import connection

            with connection.cursor() as cur:
                cur.execute("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - still down
            self.failed_step("database probe", exc)
            return False
        self.log.info("database reachable again after %.1fs", time.monotonic() - self.outage_since, extra=self.extra)
        self.outage_since = None
        return True

    def start_pass(self) -> None:
        """Forget the previous pass's failures (the outage itself lasts until a step succeeds)."""
        self.failed = False
        self.outage_this_pass = False


def close_django_connection() -> None:
    """Drop this thread's Django connection (the next query opens a fresh one)."""
    from django.db import connection

    try:
        connection.close()
    except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped anyway
        connection.connection = None


def connect_options(*, statement_timeout_ms: int | None = None,
                    idle_in_transaction_timeout_ms: int | None = None) -> dict[str, Any]:
    """Return libpq connection parameters: connect timeout, TCP keepalives, user timeout.

    ``tcp_user_timeout`` needs libpq 12 or newer; it is left out for an older libpq rather than
    failing every connection. The timeouts in ``options`` apply to the session's statements.
    """
    opts: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT,
        "keepalives": 1,
        "keepalives_idle": KEEPALIVES_IDLE,
        "keepalives_interval": KEEPALIVES_INTERVAL,
        "keepalives_count": KEEPALIVES_COUNT,
    }
    if psycopg.pq.version() >= 120000:
        opts["tcp_user_timeout"] = TCP_USER_TIMEOUT_MS
    session = []
    if statement_timeout_ms is not None:
        session.append(f"-c statement_timeout={int(statement_timeout_ms)}")
    if idle_in_transaction_timeout_ms is not None:
        session.append(f"-c idle_in_transaction_session_timeout={int(idle_in_transaction_timeout_ms)}")
    if session:
        opts["options"] = " ".join(session)
    return opts


def configure_daemon_session(*, application_name: str) -> None:
    """Give every Django connection this process opens from now on the daemons' timeouts.

    Django reads ``OPTIONS`` each time it connects, and all threads share the settings dict, so
    the worker threads' connections get them too. Web processes keep their own defaults.
    Behind a pooler the timeouts cannot travel as a startup parameter (PgBouncer refuses
    ``options``): they are left to the server (``ALTER ROLE ... SET``, docs/deploy.md) and the
    builder's leader sets them per transaction (``SET LOCAL``).
    """
    from django.db import connections

    options = connections.settings["default"].setdefault("OPTIONS", {})
    if db_pooler():
        options.update(connect_options())
        options.pop("options", None)
        options["prepare_threshold"] = None
    else:
        options.update(connect_options(statement_timeout_ms=DAEMON_STATEMENT_TIMEOUT_MS,
                                       idle_in_transaction_timeout_ms=DAEMON_IDLE_IN_TRANSACTION_TIMEOUT_MS))
    options["application_name"] = application_name


def use_shared_pool(*, max_size: int, application_name: str | None = None) -> None:
    """Make every thread's Django connection in this process borrow from one bounded pool.

    Django's own psycopg pool (``OPTIONS["pool"]``): a thread's connection is taken from the pool
    when it first queries and goes back when it is closed, so ``max_size`` bounds the server
    connections of the whole process whatever its number of threads. Pooling needs
    ``CONN_MAX_AGE = 0``; server-side cursors are off because a borrowed connection goes back
    between statements (:func:`release_after_each_statement`). ``application_name`` names the pool's
    connections from here on (the connection closed here may have had another).
    """
    from django.db import connections

    settings = connections.settings["default"]
    close_django_connection()  # an unpooled connection opened earlier goes; the next query borrows
    if application_name:
        settings.setdefault("OPTIONS", {})["application_name"] = application_name
    settings["CONN_MAX_AGE"] = 0
    settings["DISABLE_SERVER_SIDE_CURSORS"] = True
    settings.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": max_size, "timeout": POOL_WAIT_SECONDS}


def close_shared_pool() -> None:
    """Close the pool of :func:`use_shared_pool` (its connections end); a no-op without one."""
    from django.db import connection

    try:
        connection.close()
        connection.close_pool()  # type: ignore[attr-defined]  # the PostgreSQL backend's, Django 5.1 and later
    except Exception:  # noqa: BLE001 - closing at exit must not fail the exit
        pass


# How long a thread waits for a pooled connection before its step fails (and is retried).
POOL_WAIT_SECONDS = 10.0


@contextmanager
def release_after_each_statement():
    """Return this thread's pooled connection after every statement run outside a transaction.

    For task code in an agent's worker thread: an ORM query borrows a connection and gives it
    back at once, so a task that queries and then works for minutes holds no server connection
    meanwhile. Inside ``transaction.atomic()`` the connection stays until the block ends (and is
    given back after a commit); whatever is left is returned when the block exits. The ORM has
    already read the rows of a statement when it returns (client-side cursors only).
    """
    from django.db import connection

    def give_back() -> None:
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - a broken connection is dropped by the pool anyway
            connection.connection = None

    def release(execute, sql, params, many, context):
        try:
            return execute(sql, params, many, context)
        finally:
            if not connection.in_atomic_block:
                give_back()
            elif give_back not in [hook[1] for hook in connection.run_on_commit]:
                connection.on_commit(give_back)

    with connection.execute_wrapper(release):
        try:
            yield
        finally:
            give_back()


# ---------------------------------------------------------------------------- poolers and LISTEN
def db_pooler() -> str | None:
    """Return the pooler in front of PostgreSQL (``ACC_DB_POOLER``: ``pgbouncer``), or None when direct."""
    # settings.py imports this module; the typed settings load when asked, after Django's.
    from accs_site.conf import accs

    return accs.db_pooler


def listen_db_url() -> str | None:
    """Return the direct URL for LISTEN connections (``ACC_LISTEN_DB_URL``), or None."""
    # settings.py imports this module; the typed settings load when asked, after Django's.
    from accs_site.conf import accs

    return accs.listen_db_url


def listen_available() -> bool:
    """Return whether this process can LISTEN: directly connected, or given a direct URL for it.

    NOTIFY cannot reach a client through a transaction-mode pooler (the server session that
    LISTENed is handed to other clients), so behind one the daemons poll instead.
    """
    return db_pooler() is None or listen_db_url() is not None


def close_quietly(conn: psycopg.Connection | None) -> None:
    """Close a dedicated connection that may already be broken (closing it may fail too)."""
    if conn is None:
        return
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - a broken connection's close is allowed to fail
        pass


def database_address() -> str:
    """Return ``host:port`` of the default database, for messages."""
    from django.db import connections

    s = connections.settings["default"]
    return f"{s.get('HOST') or 'localhost'}:{s.get('PORT') or 5432}"


def connect(*, application_name: str, autocommit: bool = True, listen: bool = False) -> psycopg.Connection:
    """Open a dedicated connection with keepalives and timeouts.

    With ``listen``, to ``ACC_LISTEN_DB_URL`` when it is set (straight to PostgreSQL, past the
    pooler). Through a pooler: no ``options`` startup parameter and no prepared statements.
    """
    from django.db import connections

    direct_url = listen_db_url() if listen else None
    pooled = db_pooler() is not None and direct_url is None
    opts = connect_options(statement_timeout_ms=None if pooled else DAEMON_STATEMENT_TIMEOUT_MS)
    if pooled:
        opts["prepare_threshold"] = None
    if direct_url:
        return psycopg.connect(direct_url, autocommit=autocommit, application_name=application_name, **opts)
    s = connections.settings["default"]
    return psycopg.connect(host=s["HOST"] or None, port=s["PORT"] or None, dbname=s["NAME"], user=s["USER"],
                           password=s["PASSWORD"] or None, autocommit=autocommit, application_name=application_name,
                           **opts)


# Refusals no retry can cure: the daemon says which setting is wrong and exits.
CONFIGURATION_ERRORS = {
    "unsupported startup parameter": "a pooler (PgBouncer) refuses the daemons' session options; set "
                                     "ACC_DB_POOLER=pgbouncer (docs/deploy.md, Connections and PgBouncer)",
    "password authentication failed": "check the user and password in ACC_DB_URL",
    "no such database": "the pooler knows no such database; check ACC_DB_URL and the pooler's [databases]",
    "no such user": "the pooler knows no such user; check ACC_DB_URL and the pooler's auth_file",
}


def configuration_problem(exc: BaseException) -> str | None:
    """Return what to fix when ``exc`` is a connection refused for its configuration, else None."""
    text = str(exc).lower()
    for needle, advice in CONFIGURATION_ERRORS.items():
        if needle in text:
            return advice
    return None


def exit_on_configuration_error(logger: logging.Logger, exc: BaseException, *,
                                extra: dict[str, Any] | None = None) -> None:
    """Log a connection refused for its configuration in one line and exit with status 2."""
    advice = configuration_problem(exc)
    if advice is None:
        return
    logger.error("configuration error: PostgreSQL at %s refused the connection (%s): %s", database_address(),
                 first_line(exc), advice, extra=extra)
    raise SystemExit(2)


# Exit code of a daemon that cannot start because of the database: unreachable for longer than
# it was told to wait, or missing migrations (2 is a bad option or setting, accs_site.cli).
EXIT_DATABASE_NOT_READY = 3
# How long ``--once`` runs wait for PostgreSQL before giving up (a service waits for ever).
ONCE_DATABASE_WAIT_SECONDS = 30.0


class DatabaseNotReady(Exception):
    """The database cannot serve a daemon: unreachable past its wait, or not migrated. The message is one line."""


def wait_for_database(logger: logging.Logger, *, stopping: Callable[[], bool] = lambda: False,
                      extra: dict[str, Any] | None = None, sleep: Callable[[float], Any] = time.sleep,
                      give_up_after: float | None = None) -> bool:
    """Block until PostgreSQL answers a query; return False if ``stopping()`` became true first.

    Prints one clear line the first time it cannot connect, then retries quietly with backoff.
    With ``give_up_after`` (seconds), raise :class:`DatabaseNotReady` once that time has passed
    without an answer instead, and print nothing before: the caller says it in one line.
    """
    from django.db import connection

    backoff = Backoff(base=0.2, cap=5.0)
    announced = give_up_after is not None  # a bounded wait is said once, at its end
    deadline = None if give_up_after is None else time.monotonic() + give_up_after
    while not stopping():
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT 1")
            if announced:
                logger.info("PostgreSQL at %s answers", database_address(), extra=extra)
            return True
        except Exception as exc:  # noqa: BLE001 - any failure to connect means "not yet"
            close_django_connection()
            exit_on_configuration_error(logger, exc, extra=extra)  # …except a refusal no retry cures
            if not announced:
                announced = True
                logger.warning("waiting for PostgreSQL at %s … (%s)", database_address(), first_line(exc),
                               extra=extra)
            delay = backoff.next_delay()
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DatabaseNotReady(f"PostgreSQL at {database_address()} did not answer within "
                                           f"{give_up_after:g}s ({first_line(exc)}); giving up") from None
                delay = min(delay, left)
            sleep(delay)
    return False


def missing_migrations() -> list[str]:
    """Return the migrations (``app.name``) this code has that the database has not applied, in order."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, backwards in plan if not backwards]


# The apps whose migrations ACCS ships (a site's own apps may keep rows of migrations it deleted).
ACCS_APPS = ("accs_site", "tenants", "workflows", "jobs", "nodes", "events", "ops")


def newer_migrations(*, database: str = "default") -> list[str]:
    """Return the ACCS migrations (``app.name``) the database has applied that this code does not have.

    A newer release migrated the database. Daemons keep running on it (the newer release's
    migrations expand the schema, so the previous release's code works on it); ``migrate --check``
    fails, so a rollback is not taken for done while the schema is ahead of the code.
    """
    from django.db import connections
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(connections[database], ignore_no_migrations=True)
    squashed = {old for migration in loader.replacements.values() for old in migration.replaces}
    known = set(loader.disk_migrations) | squashed
    return sorted(f"{app}.{name}" for app, name in loader.applied_migrations or {}
                  if app in ACCS_APPS and (app, name) not in known)


def check_schema() -> None:
    """Raise :class:`DatabaseNotReady`, naming the first missing migration, unless all are applied.

    Started on a database that was never migrated (or is behind the code), a daemon would fail
    on a missing table or column on every pass for ever; it stops at once instead.
    """
    missing = missing_migrations()
    if not missing:
        return
    from django.db import connections

    name = connections.settings["default"].get("NAME")
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    raise DatabaseNotReady(f"database {name} at {database_address()} is missing migration {missing[0]}{more}: "
                           "apply them with `manage.py migrate`, then start again")


# Once every migration was found applied, a process need not read the migration graph again: a
# schema does not go back behind the code that runs on it.
_schema_seen_current = False


def database_not_ready() -> str | None:
    """Return one line saying why the database cannot serve ACCS now (down, or missing a migration); None if it can.

    For the operators' commands and the readiness probe: they answer at once instead of waiting.
    """
    global _schema_seen_current
    from django.db import connection

    try:
        with connection.cursor() as cur:
            cur.execute("SELECT 1")
        if not _schema_seen_current:
            check_schema()
            _schema_seen_current = True
    except DatabaseNotReady as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure to reach or read the database is the answer
        close_django_connection()
        return f"database unreachable at {database_address()}: {first_line(exc)}"
    return None


def ready_to_start(logger: logging.Logger, *, stopping: Callable[[], bool] = lambda: False,
                   extra: dict[str, Any] | None = None, wait_seconds: float | None = None) -> int | None:
    """Wait for PostgreSQL and check its schema; return None to start, else the exit code to stop with.

    ``wait_seconds``: how long to wait for the database (None: until it answers or the daemon is
    stopped, which returns 0). A database that never answered or misses migrations is one
    error line and :data:`EXIT_DATABASE_NOT_READY`.
    """
    while True:
        try:
            if not wait_for_database(logger, stopping=stopping, extra=extra, give_up_after=wait_seconds):
                return 0
            check_schema()
            return None
        except DatabaseNotReady as exc:
            logger.error("%s", exc, extra=extra)
            return EXIT_DATABASE_NOT_READY
        except Exception as exc:  # noqa: BLE001 - sorted below: one line, never a traceback
            # The database went away between its answer and the check (a restart): wait for it again,
            # as long again (it answered, so this is progress, not a wait without end).
            if is_transient(exc):
                close_django_connection()
                continue
            logger.error("cannot read the database's migrations (%s)", first_line(exc), extra=extra)
            return EXIT_DATABASE_NOT_READY


def shutdown_socket(fd: int) -> None:
    """Shut a connection's socket down in both directions, so a call blocked on it returns."""
    try:
        sock = socket.socket(fileno=_dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def _dup(fd: int) -> int:
    import os

    return os.dup(fd)


class StallBreaker:
    """Break a database call that has been blocked longer than ``limit`` seconds.

    Kernel timers cannot see every hang (a peer that still acknowledges packets but never
    answers, such as a stuck proxy). The loop marks each step with :meth:`step`; a daemon thread
    shuts the sockets of ``connections()`` down when a step runs too long, which makes the
    blocked call raise a connection error that the loop's guard handles like any outage.
    """

    def __init__(self, *, limit: float, connections: Callable[[], Iterable[Any]], logger: logging.Logger,
                 extra: dict[str, Any] | None = None) -> None:
        self.limit = limit
        self.connections = connections
        self.log = logger
        self.extra = extra or {}
        self._since: float | None = None
        self._name = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="accs-stall-breaker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    @contextmanager
    def step(self, name: str):
        with self._lock:
            self._since, self._name = time.monotonic(), name
        try:
            yield
        finally:
            with self._lock:
                self._since = None

    def check(self, now: float | None = None) -> bool:
        """Break the connections if the current step is overdue; return whether it did."""
        now = time.monotonic() if now is None else now
        with self._lock:
            since, name = self._since, self._name
            if since is None or now - since < self.limit:
                return False
            self._since = None  # once per step
        self.log.warning("%s blocked for %.0fs on the database; breaking the connection", name, now - since,
                         extra=self.extra)
        for conn in self.connections():
            fd = _fileno(conn)
            if fd is not None:
                shutdown_socket(fd)
        return True

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 4)):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher must outlive any surprise
                self.log.exception("stall breaker check failed", extra=self.extra)


def _fileno(conn: Any) -> int | None:
    """Return the socket of a psycopg connection or a Django wrapper's, or None."""
    raw = conn if isinstance(conn, psycopg.Connection) else getattr(conn, "connection", None)
    if raw is None:
        return None
    try:
        return raw.fileno() if not raw.closed else None
    except Exception:  # noqa: BLE001 - a connection being closed by its owner
        return None


def ensure_daemon_logging() -> None:
    """Let a daemon's lines (``accs.*``, INFO and up) reach stderr in a site whose logging sends them
    nowhere: an embedding site without a ``LOGGING`` for them would otherwise run a builder or an agent
    that says nothing, not even that it started or why it backs off. A site that routes them keeps its
    own handlers."""
    accs_log = logging.getLogger("accs")
    node: logging.Logger | None = accs_log
    while node is not None:
        if any(not getattr(h, "timeline_only", False) for h in node.handlers):
            return  # the site routes them (its level then decides what it sees)
        node = node.parent if node.propagate else None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    accs_log.addHandler(handler)
    if accs_log.level == logging.NOTSET:
        accs_log.setLevel(logging.INFO)
