"""LISTEN/NOTIFY channels. A NOTIFY is a coalesced hint, never needed for correctness:
agents and the builder also poll. PostgreSQL delivers notifications at commit and folds identical
ones within a transaction, so one per service per transaction reaches the listeners."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

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


def notify(cursor, channels: Iterable[str]) -> None:
    """Send one empty notification per distinct channel, in the caller's transaction."""
    distinct = sorted(set(channels))
    if distinct:
        cursor.execute("SELECT pg_notify(c, '') FROM unnest(%s::text[]) AS c", [distinct])
