"""LISTEN/NOTIFY channels (EVT3). A NOTIFY is a coalesced hint, never needed for correctness:
agents and the builder also poll. PostgreSQL delivers notifications at commit and folds identical
ones within a transaction, so one per service per transaction reaches the listeners."""

from __future__ import annotations

from collections.abc import Iterable

from accs_site.conf import accs


def service_channel(service_key: str) -> str:
    """Return the channel agents of ``service_key`` listen on."""
    return (accs.notify_channel_prefix + service_key.replace("-", "_")).lower()


def builder_channel() -> str:
    """Return the channel builders listen on (new due jobs, approvals)."""
    return accs.notify_channel_prefix + "_builder"


def notify(cursor, channels: Iterable[str]) -> None:
    """Send one empty notification per distinct channel, in the caller's transaction."""
    distinct = sorted(set(channels))
    if distinct:
        cursor.execute("SELECT pg_notify(c, '') FROM unnest(%s::text[]) AS c", [distinct])
