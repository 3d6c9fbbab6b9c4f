"""A statement that works in batches changes at most its batch's rows, whatever plan PostgreSQL picks.

Each picks its rows with ``LIMIT … FOR UPDATE SKIP LOCKED``. Written as a subquery in the UPDATE's
WHERE, a plan that scans the subquery again for each row (a nested loop without a materialized inner
side, which stale or missing statistics can give) skips the rows the statement already updated and
takes the next ones: one "batch of 1" updated all ten attempts. The planner is pushed towards that
plan here; each statement picks its rows once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection

from accs_site.clock import db_now
from jobs.attempt_refs import fill_missing
from jobs.models import Attempt
from nodes.api import mark_lost, register_node
from tests.ops_helpers import pipeline_scene, two_tenants
from workflows import governor
from workflows.models import GovernorCondition

pytestmark = pytest.mark.django_db

RESCANNING_PLAN = ("enable_hashjoin", "enable_mergejoin", "enable_material", "enable_hashagg", "enable_sort")


@contextmanager
def rescanning_planner() -> Iterator[None]:
    """Nested loops that scan their inner side again for each outer row (the test's transaction undoes it)."""
    with connection.cursor() as cur:
        for setting in RESCANNING_PLAN:
            cur.execute(f"SET {setting} = off")
    try:
        yield
    finally:
        with connection.cursor() as cur:
            for setting in RESCANNING_PLAN:
                cur.execute(f"RESET {setting}")


def test_the_attempt_fill_takes_one_batch_at_a_time():
    pipeline_scene(two_tenants())
    total = Attempt.objects.update(service=None, tenant=None)
    assert total > 3
    seen: list[int] = []
    with rescanning_planner():
        assert fill_missing(batch=1, progress=seen.append) == total
    assert seen == list(range(1, total + 1)), "one attempt per batch"


def test_marking_silent_nodes_lost_takes_at_most_its_limit():
    for i in range(6):
        register_node(f"silent-{i}", labels={}, services=[], agent_id=f"h:{i}:a")
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_node SET last_seen = now() - interval '1 hour' WHERE name LIKE 'silent-%%'")
    with rescanning_planner():
        assert mark_lost(after_seconds=60, limit=2) == ["silent-0", "silent-1"]
        assert mark_lost(after_seconds=60, limit=2) == ["silent-2", "silent-3"]


def test_expiring_governor_conditions_takes_at_most_its_limit():
    with connection.cursor() as cur:
        now = db_now(cur)
    for i in range(6):
        GovernorCondition.objects.create(name=f"hold-{i}", raised_at=now - timedelta(hours=1),
                                         expires_at=now - timedelta(minutes=60 - i))
    with rescanning_planner():
        assert governor.expire_conditions(now, limit=2) == ["hold-0", "hold-1"]
    assert GovernorCondition.objects.filter(cleared_at__isnull=False).count() == 2
