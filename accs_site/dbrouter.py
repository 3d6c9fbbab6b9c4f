"""Send the cockpit's and the API's read-only queries to a read replica (``ACC_READ_DB_URL``).

A large site reads its dashboards from a streaming replica so that operators' pages never queue
behind the engine on the primary. The rule is narrow on purpose, because a read the engine acts on
must see the primary's latest commit:

* only while a web request with a safe method (GET, HEAD, OPTIONS) is being served
  (:class:`ReadReplicaMiddleware` marks it); the builder, the agents and every command never are;
* only outside any transaction on the primary: a read inside ``atomic()`` (a claim, a report, an
  admin's change form, any engine transaction) belongs to that transaction;
* only for ACCS's own models (jobs, tasks, attempts, events, nodes, services, workflows, tenants),
  not for sessions, users, API tokens or throttles, which a login or a token made a moment ago
  must find at once.

Writes always go to the primary. Raw SQL (the dashboard's and the metrics' queries) asks
:func:`read_connection` for its connection under the same rule. Without ``ACC_READ_DB_URL``
there is no ``replica`` alias and nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.http import HttpRequest, HttpResponse

REPLICA = "replica"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: App labels whose models a read-only request may read from the replica.
REPLICA_APPS = frozenset({"jobs", "events", "nodes", "workflows", "tenants", "ops"})
#: Models read to authenticate or throttle a request: always the primary (a token just created must work).
PRIMARY_ONLY_MODELS = frozenset({"apitoken", "apithrottle"})

_read_only_request: ContextVar[bool] = ContextVar("accs_read_only_request", default=False)


def replica_configured() -> bool:
    """Return True when the site has a ``replica`` database (``ACC_READ_DB_URL`` is set)."""
    return REPLICA in connections.settings


def replica_allowed() -> bool:
    """Return True when a read made now may go to the replica (see the module's rule)."""
    return (replica_configured() and _read_only_request.get()
            and not connections[DEFAULT_DB_ALIAS].in_atomic_block)


def read_connection() -> BaseDatabaseWrapper:
    """Return the connection a cockpit read in raw SQL should use: the replica when allowed, else the primary."""
    return connections[REPLICA if replica_allowed() else DEFAULT_DB_ALIAS]


class ReadReplicaRouter:
    """Django database router: ACCS models' reads in a read-only request go to the replica."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        meta = model._meta
        if meta.app_label in REPLICA_APPS and meta.model_name not in PRIMARY_ONLY_MODELS and replica_allowed():
            return REPLICA
        return DEFAULT_DB_ALIAS

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return DEFAULT_DB_ALIAS

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        # Both aliases hold the same rows (the replica streams the primary).
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == DEFAULT_DB_ALIAS


class ReadReplicaMiddleware:
    """Mark a safe-method request as read-only for the router (and for :func:`read_connection`)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        token = _read_only_request.set(request.method in SAFE_METHODS)
        try:
            return self.get_response(request)
        finally:
            _read_only_request.reset(token)


def replica_lag() -> dict[str, Any] | None:
    """Return the replica's replay lag (``seconds``, ``replayed_at``), or None without a replica.

    The lag is how long ago the last replayed transaction committed on the primary; a replica
    whose primary writes nothing shows a growing figure, so ``receiving`` says whether it still
    streams. An unreachable replica gives ``error``.
    """
    if not replica_configured():
        return None
    try:
        with connections[REPLICA].cursor() as cur:
            cur.execute("SELECT pg_is_in_recovery(), pg_last_xact_replay_timestamp(),"
                        " extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp()),"
                        " pg_last_wal_receive_lsn() IS NOT NULL")
            recovering, replayed_at, seconds, receiving = cur.fetchone()
    except Exception as exc:  # noqa: BLE001 - the dashboard shows why, it must not fail with the replica
        return {"error": str(exc).splitlines()[0][:200], "seconds": None, "replayed_at": None, "receiving": False}
    replayed: datetime | None = replayed_at
    return {"error": "" if recovering else "the read database is not a replica (pg_is_in_recovery() is false)",
            "seconds": None if seconds is None else max(0.0, float(seconds)), "replayed_at": replayed,
            "receiving": bool(receiving)}
