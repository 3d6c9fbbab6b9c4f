"""LISTEN/NOTIFY channels. A NOTIFY is a coalesced hint, never needed for correctness:
agents and the builder also poll. PostgreSQL delivers notifications at commit and folds identical
ones within a transaction, so one per service per transaction reaches the listeners.

On Django's connection inside a transaction, a channel already notified in it is not notified
again (:func:`not_yet_notified`): many starts in one ``atomic()`` send one NOTIFY per channel, not
one per start. Each is still queued at commit whatever the number, but the statement is not paid
per start.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from accs_site.conf import accs

# PostgreSQL truncates identifiers, channel names included, to 63 bytes, and pg_notify() refuses
# longer ones outright; a long service key is shortened with a hash so its channel stays unique.
MAX_CHANNEL_BYTES = 63


def service_channel(service_key: str) -> str:
    """Return the channel agents of ``service_key`` listen on (at most 63 bytes)."""
    channel = (accs.notify_channel_prefix + service_key.replace("-", "_")).lower()
    if len(channel.encode()) <= MAX_CHANNEL_BYTES:
        return channel
    digest = hashlib.sha1(channel.encode()).hexdigest()[:12]
    head = channel.encode()[:MAX_CHANNEL_BYTES - len(digest) - 1].decode(errors="ignore")
    return f"{head}_{digest}"


def builder_channel() -> str:
    """Return the channel builders listen on (new due jobs, approvals)."""
    return accs.notify_channel_prefix + "_builder"


class _Notified:
    """The channels notified in a transaction (or savepoint): registered as an on-commit callback
    (doing nothing) because Django drops those with the savepoint or transaction they belong to,
    exactly when PostgreSQL drops the notifications sent in it."""

    __slots__ = ("channels",)

    def __init__(self, channels: set[str]) -> None:
        self.channels = channels

    def __call__(self) -> None:
        pass


def not_yet_notified(channels: Iterable[str], db: BaseDatabaseWrapper | None = None) -> list[str]:
    """Return the distinct channels (sorted) that Django's connection ``db`` (the default one) has
    not yet notified in this transaction, and count them as notified; all of them outside a
    transaction (autocommit)."""
    db = db or connections[DEFAULT_DB_ALIAS]
    distinct = sorted(set(channels))
    if not distinct or not db.in_atomic_block:
        return distinct
    done: set[str] = set()
    for entry in db.run_on_commit:  # (savepoint ids, callback, robust)
        func = entry[1]
        if isinstance(func, _Notified):
            done |= func.channels
    fresh = [c for c in distinct if c not in done]
    if fresh:
        db.on_commit(_Notified(set(fresh)))
    return fresh


def notify(cursor, channels: Iterable[str]) -> None:
    """Send one empty notification per distinct channel, in the caller's transaction (on Django's
    connection, only for the channels not yet notified in it)."""
    db = getattr(cursor, "db", None)  # a Django cursor's connection; a bare psycopg cursor has none
    distinct = not_yet_notified(channels, db) if isinstance(db, BaseDatabaseWrapper) else sorted(set(channels))
    if distinct:
        cursor.execute("SELECT pg_notify(c, '') FROM unnest(%s::text[]) AS c", [distinct])
