"""The builder's leader folds finished attempts into the dashboard's rollups (jobs.attempt_rollup): in batches of
any size to the same counts, each attempt once (a running one once it finishes), the counts and the mark in
one transaction (a fold that fails leaves both), never the last minutes (a claim may still commit them)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import given, settings, strategies as st

from accs_site.clock import db_now
from jobs import attempt_rollup as rollup
from jobs.attempt_rollup import LAG, SERVICE_GRID, WAIT_BINS, fold, wait_bin, wait_median
from jobs.builder import Builder
from jobs.duties import all_duties
from jobs.duties.attempt_rollup import duty
from jobs.models import Attempt
from tests.ops_helpers import pipeline_scene, two_tenants

ROLLED = """
SELECT bucket, service_id, tenant_id, attempts, succeeded, failed, {waits} FROM accs_attempt_rollup
 ORDER BY 1, 2, 3""".format(waits=", ".join(rollup.WAIT_COLUMNS))

DIRECT = """
SELECT date_bin('20 minutes', started_at, '1970-01-01 00:00:00+00'), service_id, tenant_id, count(*),
       count(*) FILTER (WHERE status = 'succeeded'), count(*) FILTER (WHERE status IN ('failed', 'timeout')),
       {waits}
  FROM (SELECT a.*, CASE WHEN claimable_at <= started_at
                    THEN width_bucket(date_part('epoch', started_at - claimable_at), %(bounds)s::float8[]) END AS bin
          FROM accs_attempt a
         WHERE started_at < %(mark)s AND status <> 'running') a
 GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
""".format(waits=", ".join(f"count(*) FILTER (WHERE bin = {i})" for i in range(WAIT_BINS)))

NODES = """
SELECT node, sum(attempts), sum(succeeded), sum(failed) FROM accs_attempt_node_rollup GROUP BY 1 ORDER BY 1"""
DIRECT_NODES = """
SELECT node, count(*), count(*) FILTER (WHERE status = 'succeeded'),
       count(*) FILTER (WHERE status IN ('failed', 'timeout'))
  FROM accs_attempt WHERE started_at < %(mark)s AND status <> 'running' GROUP BY 1 ORDER BY 1"""


def _history(now) -> None:
    """Spread the scene's attempts over two days (one in three keeps its time), with their waits."""
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_attempt SET started_at = started_at - (id % 3) * interval '17 hours 7 minutes',"
                    " claimable_at = claimable_at - (id % 3) * interval '17 hours 7 minutes' - (id % 5) * interval"
                    " '40 seconds', finished_at = finished_at - (id % 3) * interval '17 hours 7 minutes'")


def _rolled_and_direct() -> tuple[list, list, list, list]:
    with connection.cursor() as cur:
        cur.execute("SELECT folded_until FROM accs_attempt_rollup_mark WHERE name = 'attempts'")
        params = {"mark": cur.fetchone()[0], "bounds": [float(b) for b in rollup.WAIT_BOUNDS]}
        out = []
        for sql in (ROLLED, DIRECT, NODES, DIRECT_NODES):
            cur.execute(sql, params)
            out.append(cur.fetchall())
    return out[0], out[1], out[2], out[3]


def _pending() -> list[int]:
    with connection.cursor() as cur:
        cur.execute("SELECT pending FROM accs_attempt_rollup_mark WHERE name = 'attempts'")
        return cur.fetchone()[0]


@pytest.mark.django_db
@settings(deadline=None, max_examples=6)
@given(batch=st.integers(min_value=1, max_value=9))
def test_folds_of_any_batch_size_count_each_finished_attempt_once_as_a_direct_count(batch):
    if not Attempt.objects.exists():
        pipeline_scene(two_tenants())
        _history(timezone.now())
    with connection.cursor() as cur:  # each example folds from nothing
        cur.execute("DELETE FROM accs_attempt_rollup; DELETE FROM accs_attempt_node_rollup;"
                    " UPDATE accs_attempt_rollup_mark SET folded_until = NULL, pending = '{}'")
    now = timezone.now() + LAG + SERVICE_GRID  # past every attempt's bucket
    while fold(limit=batch, now=now):
        pass
    rolled, direct, nodes, direct_nodes = _rolled_and_direct()
    assert rolled == direct and nodes == direct_nodes and rolled
    running = set(Attempt.objects.filter(status="running").values_list("pk", flat=True))
    assert running and set(_pending()) == running, "the running attempt waits in the mark, not in the counts"


@pytest.mark.django_db
def test_a_running_attempt_is_counted_once_when_it_finishes_and_the_last_minutes_wait():
    tenants = two_tenants()
    pipeline_scene(tenants)
    now = timezone.now()
    fold(limit=1000, now=now)
    with connection.cursor() as cur:
        cur.execute("SELECT folded_until FROM accs_attempt_rollup_mark")
        assert cur.fetchone()[0] == rollup.floor_to(now - LAG, SERVICE_GRID)
        cur.execute("SELECT count(*) FROM accs_attempt_rollup")
        assert cur.fetchone()[0] == 0, "every attempt started in the last minutes: none folded yet"
    later = now + LAG + SERVICE_GRID
    fold(limit=1000, now=later)
    running = Attempt.objects.get(status="running")
    assert _pending() == [running.pk]
    Attempt.objects.filter(pk=running.pk).update(status="succeeded", finished_at=later)
    assert fold(limit=1000, now=later) == 1
    assert fold(limit=1000, now=later) == 0, "folded once"
    rolled, direct, nodes, direct_nodes = _rolled_and_direct()
    assert rolled == direct and nodes == direct_nodes and _pending() == []


@pytest.mark.django_db
def test_a_fold_that_fails_leaves_the_counts_and_the_mark_and_the_next_does_the_window_once():
    tenants = two_tenants()
    pipeline_scene(tenants)
    now = timezone.now() + timedelta(hours=1)
    with pytest.raises(RuntimeError), transaction.atomic():  # as a fenced-out leader's batch is rolled back
        assert fold(limit=1000, now=now)
        raise RuntimeError("the lease was lost")
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM accs_attempt_rollup")
        assert cur.fetchone()[0] == 0
        cur.execute("SELECT count(*) FROM accs_attempt_rollup_mark")
        assert cur.fetchone()[0] == 0, "the first fold's mark row went with it"
    assert fold(limit=1000, now=now)
    rolled, direct, nodes, direct_nodes = _rolled_and_direct()
    assert rolled == direct and nodes == direct_nodes and rolled


def test_the_median_wait_from_the_histogram_is_inside_the_bin_of_the_true_median():
    assert wait_median([0] * WAIT_BINS) is None
    assert wait_bin(0.0) == 0 and wait_bin(0.1) == 1 and wait_bin(10**6) == WAIT_BINS - 1
    waits = [0.3, 0.4, 1.2, 1.5, 1.9, 7.0, 300.0]
    bins = [0] * WAIT_BINS
    for w in waits:
        bins[wait_bin(w)] += 1
    estimate = wait_median(bins)
    assert wait_bin(estimate) == wait_bin(1.5) and 1 <= estimate < 2
    only_open = [0] * WAIT_BINS
    only_open[-1] = 3
    assert wait_median(only_open) == rollup.WAIT_BOUNDS[-1], "the open bin gives its lower bound"


def test_the_leader_folds_the_rollup_among_its_duties():
    assert "fold_attempt_rollup" in [d.name for d in all_duties(batch=100)]


def test_a_builder_tick_folds_the_attempts_under_the_leader_lease(transactional_db):
    tenants = two_tenants()
    pipeline_scene(tenants)
    Attempt.objects.update(started_at=timezone.now() - timedelta(hours=2))
    builder = Builder(once=True, duties=[duty()])
    try:
        builder.tick()
        assert builder.is_leader, "only the leader runs duties"
    finally:
        builder._drop_session("test over")
    rolled, direct, nodes, direct_nodes = _rolled_and_direct()
    assert rolled == direct and nodes == direct_nodes and rolled


@pytest.mark.django_db
def test_the_command_folds_everything_up_to_the_lag_and_says_how_many(capsys):
    pipeline_scene(two_tenants())
    _history(timezone.now())
    call_command("accs_attempt_rollup", "--batch", "3")
    rolled, direct, nodes, direct_nodes = _rolled_and_direct()
    assert rolled == direct and nodes == direct_nodes and rolled
    folded = sum(row[3] for row in rolled)
    assert f"folded {folded} attempts in " in capsys.readouterr().out
    with pytest.raises(CommandError, match="--batch must be at least 1"):
        call_command("accs_attempt_rollup", "--batch", "0")


@pytest.mark.django_db
def test_a_fold_keeps_to_the_databases_clock_whatever_the_builders_clock_says(monkeypatch):
    """The claims write attempts' starts with PostgreSQL's clock: a builder whose own clock runs an hour ahead
    must not move the mark past attempts still to be written (no page would ever count them)."""
    pipeline_scene(two_tenants())
    with connection.cursor() as cur:
        now = db_now(cur)
    ahead = now + timedelta(hours=1)
    monkeypatch.setattr(timezone, "now", lambda: ahead)
    fold(limit=1000)
    with connection.cursor() as cur:
        cur.execute("SELECT folded_until FROM accs_attempt_rollup_mark WHERE name = 'attempts'")
        mark = cur.fetchone()[0]
    assert mark == rollup.floor_to(now - LAG, SERVICE_GRID), (mark, now)
    assert not rollup.behind(), "behind by the database's clock, not the builder's"
