"""Starting jobs wakes the agents once per transaction and channel: every start in autocommit
notifies, many starts in one atomic() send the NOTIFY once, and a start rolled back with its
savepoint does not count (its notification was discarded with it)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection, transaction

from jobs import api, enqueue
from jobs.notify import not_yet_notified, notify, service_channel


@pytest.fixture
def sent(monkeypatch) -> list[list[str]]:
    """The channels each one-statement start asked PostgreSQL to notify."""
    calls: list[list[str]] = []
    real = enqueue.not_yet_notified

    def spy(channels):
        calls.append(out := real(channels))
        return out

    monkeypatch.setattr(enqueue, "not_yet_notified", spy)
    return calls


@pytest.mark.django_db
def test_many_starts_in_one_transaction_notify_each_channel_once(make_service, sent):
    make_service("wake-a")
    make_service("wake-b")
    with transaction.atomic():
        for key in ("wake-a", "wake-a", "wake-b", "wake-a", "wake-b"):
            api.start_service(key)
    assert sent == [[service_channel("wake-a")], [], [service_channel("wake-b")], [], []]


@pytest.mark.django_db
def test_a_channel_notified_in_a_rolled_back_savepoint_is_notified_again():
    channel = service_channel("wake-c")
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():
            assert not_yet_notified([channel]) == [channel]
            raise RuntimeError("roll the savepoint back")
        assert not_yet_notified([channel, channel]) == [channel]
        with transaction.atomic():
            assert not_yet_notified([channel]) == [], "notified by the enclosing transaction already"


def test_listeners_are_woken_by_each_commit_and_after_a_rolled_back_start(db_url, make_service, sent):
    make_service("wake-d")
    channel = service_channel("wake-d")
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{channel}"')
        api.start_service("wake-d")  # autocommit: its own transaction
        api.start_service("wake-d")
        with transaction.atomic():
            with pytest.raises(RuntimeError), transaction.atomic():
                api.start_service("wake-d")
                raise RuntimeError("roll the savepoint back")
            api.start_service("wake-d")
        got = [n.channel for n in listener.notifies(timeout=2, stop_after=3)]
    assert got == [channel] * 3
    assert sent == [[channel]] * 4
    assert connection.in_atomic_block is False


@pytest.mark.django_db
def test_notify_on_a_django_cursor_skips_channels_already_notified_in_the_transaction():
    a, b = service_channel("wake-e"), service_channel("wake-f")
    with transaction.atomic(), connection.cursor() as cur:
        notify(cur, [a])
        assert not_yet_notified([a, b]) == [b], "notify() counted a as notified"
        notify(cur, [a, b])  # nothing left to send
        assert not_yet_notified([a, b]) == []
