"""Time-ordered row ids (jobs.ids.uuid7) and the short ids operators read and search."""

from __future__ import annotations

import re
import time
import uuid
from datetime import UTC, datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs import admin as jobs_admin, api, ids, transitions
from jobs.models import Job, Task


@pytest.fixture
def frozen_ms(monkeypatch):
    """Hold the clock ids read on one millisecond (set ``.ms`` to move it)."""

    class Clock:
        ms = 1_790_000_000_000

        def time_ns(self) -> int:
            return self.ms * 1_000_000 + 123_456

    clock = Clock()
    monkeypatch.setattr(ids.time, "time_ns", clock.time_ns)
    monkeypatch.setattr(ids, "_last_ms", -1)  # forget the ids earlier tests made by the real clock
    return clock


def test_an_id_is_version_7_and_begins_with_the_millisecond_it_was_made():
    before = time.time_ns() // 1_000_000
    made = ids.uuid7()
    after = time.time_ns() // 1_000_000
    assert made.version == 7 and made.variant == uuid.RFC_4122
    assert before <= made.int >> 80 <= after


def test_ids_sort_in_the_order_they_were_made_within_and_across_milliseconds(frozen_ms):
    made = [ids.uuid7() for _ in range(3000)]
    frozen_ms.ms += 1
    made += [ids.uuid7() for _ in range(10)]
    frozen_ms.ms -= 5  # the clock steps back: ids keep growing from the last millisecond
    made += [ids.uuid7() for _ in range(10)]
    assert made == sorted(made) and len(set(made)) == len(made)
    assert {m.int >> 80 for m in made} == {frozen_ms.ms + 4, frozen_ms.ms + 5}


def test_a_full_counter_moves_on_to_the_next_millisecond(frozen_ms, monkeypatch):
    first = ids.uuid7()
    monkeypatch.setattr(ids, "_last_counter", (1 << 42) - 1)
    second = ids.uuid7()
    assert second > first and second.int >> 80 == (first.int >> 80) + 1


def test_short_ids_of_a_thousand_ids_made_in_the_same_millisecond_are_distinct(frozen_ms):
    made = [ids.uuid7() for _ in range(1000)]
    assert {m.int >> 80 for m in made} == {frozen_ms.ms}
    shorts = [ids.short_id(m) for m in made]
    assert len(set(shorts)) == 1000
    assert all(len(s) == ids.SHORT_ID_DIGITS and str(m).endswith(s) for s, m in zip(shorts, made, strict=True))


def test_short_id_term_accepts_the_end_of_an_id_only():
    made = ids.uuid7()
    assert ids.short_id_term(f" {ids.short_id(made).upper()} ") == made.bytes[-5:]
    assert ids.short_id_term(str(made)[-12:]) == made.bytes[-6:]
    assert ids.short_id_term("abc123") is None, "too short: would match too many ids"
    assert ids.short_id_term(str(made)[-11:]) is None, "not whole bytes"
    assert ids.short_id_term("zzzzzzzzzz") is None
    assert ids.short_id_term(str(made)[-13:]) is None, "crosses the id's last dash"


@pytest.mark.django_db
def test_jobs_and_tasks_take_time_ordered_ids(tenants, make_service):
    make_service("ingest")
    started = [api.start_service("ingest", tenant=tenants.acme) for _ in range(3)]
    many = api.start_many([api.JobSpec(service="ingest", tenant=tenants.acme.slug) for _ in range(50)])
    job_ids = [j.id for j in started] + list(many)
    assert all(i.version == 7 for i in job_ids)
    assert job_ids == sorted(job_ids), "a later job has a larger id"
    tasks = list(Task.objects.filter(job_id__in=job_ids).values_list("id", flat=True))
    assert tasks and all(t.version == 7 for t in tasks)
    assert Job(tenant=tenants.acme).id.version == 7, "the model's default"


@pytest.mark.django_db
def test_the_job_list_finds_a_job_by_its_short_id(client, root, tenants, make_service):
    make_service("ingest")
    jobs = [api.start_service("ingest", tenant=tenants.acme) for _ in range(5)]
    wanted = jobs[2]
    url = reverse("admin:jobs_job_changelist")
    body = client.get(url, {"q": ids.short_id(wanted.pk)}).content.decode()
    shown = set(re.findall(r'<th class="field-short_id"><a [^>]*>([0-9a-f]+)</a></th>', body))
    assert shown == {ids.short_id(wanted.pk)}
    # The task list finds the job's task by the job's short id, and the task by its own.
    task = Task.objects.get(job=wanted)
    task_url = reverse("admin:jobs_task_changelist")
    for term in (ids.short_id(wanted.pk), ids.short_id(task.pk)):
        body = client.get(task_url, {"q": term}).content.decode()
        assert body.count('<th class="field-task_key">') == 1 and f"/admin/jobs/task/{task.pk}/" in body, term


@pytest.mark.django_db
def test_a_short_id_is_one_probe_of_the_short_id_index_and_the_whole_last_group_is_checked(tenants, make_service):
    make_service("ingest")
    job = api.start_service("ingest", tenant=tenants.acme)
    short, group = ids.short_id(job.pk), str(job.pk)[-12:]
    assert jobs_admin.ids_ending(Job, ids.short_id_term(short)) == [job.pk]
    assert jobs_admin.ids_ending(Job, ids.short_id_term(group.upper())) == [job.pk]
    other_group = ("00" if group[:2] != "00" else "11") + group[2:]
    assert jobs_admin.ids_ending(Job, ids.short_id_term(other_group)) == [], "the whole group must match"
    assert jobs_admin.ids_ending(Job, ids.short_id_term("0123456788")) == []
    task = Task.objects.get(job=job)
    # Tables of a few hundred rows, their statistics fresh: a probe of the short id index is then clearly
    # cheaper than a walk of the primary key, whatever statistics an earlier test left (on a table of one
    # row the two cost the same, and the planner took either).
    api.start_many([api.JobSpec(service="ingest", tenant=tenants.acme) for _ in range(300)])
    transitions.start_due_jobs(limit=1000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE accs_job, accs_task")
    for model, wanted, index in ((Job, job, "job_short_id_idx"), (Task, task, "task_short_id_idx")):
        with CaptureQueriesContext(connection) as queries:
            assert jobs_admin.ids_ending(model, ids.short_id_term(ids.short_id(wanted.pk))) == [wanted.pk]
        assert len(queries) == 1
        # No order asked: under the model's ordering and the limit, a planner without statistics on the
        # index's expression walks the order index through the whole table instead of probing this one.
        assert "ORDER BY" not in queries[0]["sql"], queries[0]["sql"]
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("EXPLAIN " + queries[0]["sql"])
            plan = " ".join(row[0] for row in cursor.fetchall())
        assert index in plan and "Sort" not in plan, plan


def test_id_range_holds_the_ids_made_in_it(frozen_ms):
    made = ids.uuid7()
    at = made.int >> 80
    lo, hi = ids.id_range(datetime.fromtimestamp(at / 1000, UTC), datetime.fromtimestamp(at / 1000, UTC))
    assert lo <= made <= hi and lo.int >> 80 == hi.int >> 80 == at
