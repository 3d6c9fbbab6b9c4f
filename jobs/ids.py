"""The engine's row ids: time-ordered UUIDs (version 7), and the short form operators read.

Jobs, tasks and triggers are keyed by :func:`uuid7`: a 48-bit Unix time in milliseconds, then a
counter and random bits. A new row's id is then the largest so far, so every index keyed by a job
or task id (the tables' primary keys, the task and step indexes by job, the timeline's indexes by
job and by task) grows at its right edge: an insert touches the same few recent leaf pages, which
stay cached however long the history behind them. Random (version 4) ids land on a random leaf of
an index as large as the history, and once those indexes outgrow the cache every insert reads a
page from disk.

The layout is the one Python 3.14's ``uuid.uuid7()`` uses, so that function can replace this one
there: after the timestamp, a 42-bit counter seeded at random in each new millisecond and
incremented within it (ids from one process sort in the order they were made), then 32 random
bits drawn for every id.

:func:`short_id` is the form shown in the admin, the status command and messages: the last
:data:`SHORT_ID_DIGITS` hex digits, the random end of the id (the first digits are the clock and
are shared by every job of the same minute).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime
from uuid import UUID

#: Hex digits in a short id: the counter's low 8 bits and the 32-bit random tail. Among a million
#: jobs about one pair shares a short id (40 bits); ids made by one process in the same millisecond
#: share one only when 256 counter steps apart and their random tails match (2^-32).
SHORT_ID_DIGITS = 10

_VERSION_7_FLAGS = (0x7 << 76) | (0x2 << 62)  # version 7, RFC 9562 variant
_COUNTER_MAX = (1 << 42) - 1

_lock = threading.Lock()
_last_ms = -1
_last_counter = 0


def _seed() -> tuple[int, int]:
    """Return a fresh counter (its top bit clear, so it has room to grow) and a random tail."""
    rand = int.from_bytes(os.urandom(10), "big")
    return (rand >> 32) & (_COUNTER_MAX >> 1), rand & 0xFFFF_FFFF


def uuid7() -> UUID:
    """Return a new time-ordered id, larger than every id this process made before."""
    global _last_ms, _last_counter
    now_ms = time.time_ns() // 1_000_000
    with _lock:
        if now_ms > _last_ms:
            counter, tail = _seed()
        else:
            # The same millisecond (or the clock went back): keep the last one and count on.
            now_ms = _last_ms
            counter = _last_counter + 1
            if counter > _COUNTER_MAX:  # 2^41 ids in one millisecond at least: borrow the next one
                now_ms += 1
                counter, tail = _seed()
            else:
                tail = int.from_bytes(os.urandom(4), "big")
        _last_ms, _last_counter = now_ms, counter
    value = ((now_ms & 0xFFFF_FFFF_FFFF) << 80) | ((counter >> 30) << 64) | ((counter & 0x3FFF_FFFF) << 32) | tail
    return UUID(int=value | _VERSION_7_FLAGS)


def uuid7_many(n: int) -> list[UUID]:
    """Return ``n`` new time-ordered ids, each larger than the one before (a bulk start's), drawn at once.

    As :func:`uuid7` would make them one after another within one millisecond: one clock read, one
    read of randomness for all of them, the counter counting on.
    """
    global _last_ms, _last_counter
    if n <= 0:
        return []
    now_ms = time.time_ns() // 1_000_000
    tails = os.urandom(4 * n)
    out: list[UUID] = []
    with _lock:
        if now_ms > _last_ms:
            counter, _ = _seed()
        else:
            now_ms, counter = _last_ms, _last_counter + 1
        for i in range(n):
            if counter > _COUNTER_MAX:  # borrow the next millisecond, as uuid7 does
                now_ms += 1
                counter, _ = _seed()
            tail = int.from_bytes(tails[4 * i:4 * i + 4], "big")
            out.append(UUID(int=((now_ms & 0xFFFF_FFFF_FFFF) << 80) | ((counter >> 30) << 64)
                        | ((counter & 0x3FFF_FFFF) << 32) | tail | _VERSION_7_FLAGS))
            counter += 1
        _last_ms, _last_counter = now_ms, counter - 1
    return out


def _forget_after_fork() -> None:
    # A forked child would otherwise count on from its parent's counter, and the two processes
    # would make ids that differ only in their random tails.
    global _last_ms
    _last_ms = -1


os.register_at_fork(after_in_child=_forget_after_fork)


def id_range(start: datetime, end: datetime) -> tuple[UUID, UUID]:
    """Return the lowest and the highest id :func:`uuid7` can make from ``start`` to ``end``."""
    lo, hi = int(start.timestamp() * 1000), int(end.timestamp() * 1000)
    return UUID(int=lo << 80), UUID(int=((hi + 1) << 80) - 1)


def short_id(value: UUID | str) -> str:
    """Return the short form of an id, its last :data:`SHORT_ID_DIGITS` hex digits."""
    return str(value)[-SHORT_ID_DIGITS:]


def short_id_term(text: str) -> bytes | None:
    """Return ``text`` as the last bytes of an id to search for, or None when it cannot be one.

    Accepted: a short id or an id's whole last group (:data:`SHORT_ID_DIGITS` or 12 hex digits, in
    any case). Bytes, because a search compares them with each id's bytes: formatting every id as
    text to match its end costs three times as much.
    """
    digits = text.strip().lower()
    if len(digits) in (SHORT_ID_DIGITS, 12) and all(c in "0123456789abcdef" for c in digits):
        return bytes.fromhex(digits)
    return None
