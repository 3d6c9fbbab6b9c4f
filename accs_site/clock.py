"""The one clock processes share: PostgreSQL's.

Leases, backoff, eligibility and event times coordinate several processes on several machines;
their clocks drift, the database's is one. Read it once per transaction with :func:`db_now` (the
transaction's start time, ``now()``) or write ``now()`` in SQL.
"""

from __future__ import annotations

from datetime import datetime


def db_now(cur) -> datetime:
    """Return PostgreSQL's clock (the current transaction's start time)."""
    cur.execute("SELECT now()")
    return cur.fetchone()[0]
