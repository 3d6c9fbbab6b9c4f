"""A report's moves are one timeline row per task, its job's moves folded in, and every reader shows them
as the lines they stand for: the job page line by line (``/metrics``
counts each move as its own kind: tests/ops/test_metrics.py).

The rows are written by one statement (jobs.finalize.WRITE_MOVES_SQL) from the moves the report's
statements hand over; the generated run below hands it arbitrary moves and reads back what it wrote.
"""

from __future__ import annotations

import json
from uuid import UUID

import pytest
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from hypothesis import HealthCheck, given, settings, strategies as st

from accs_site.clock import db_now
from events.models import Event
from events.timeline import is_folded, unfold
from jobs import api, transitions
from jobs.finalize import RESERVE_EVENT_ID, write_moves
from jobs.ids import uuid7
from jobs.states import JOB_TRANSITIONS, TASK_TRANSITIONS
from ops.jobpage import is_flapping
from tests.engine_helpers import claim_for, run_fail, run_ok
from tests.ops_helpers import make_user
from workflows.api import create_workflow
from workflows.models import Service

pytestmark = pytest.mark.django_db


def rows_after(event_id: int, job_id) -> list[Event]:
    return list(Event.objects.filter(job_id=job_id, id__gt=event_id).order_by("id"))


def last_event_id() -> int:
    return Event.objects.order_by("-id").values_list("id", flat=True).first() or 0


def lines(rows: list[Event]) -> list[tuple[str, str]]:
    return [("task" if line.task_id else "job", line.message) for row in rows for line in unfold(row)]


def test_a_short_tasks_report_is_one_row_standing_for_its_and_its_jobs_four_moves(make_service):
    svc = make_service("short")
    job = api.start_service("short")
    (task,) = claim_for(svc)
    before = last_event_id()
    run_ok([task])
    (row,) = rows_after(before, job.pk)  # four rows before: job started, task started, task done, job done
    assert is_folded(row) and row.task_id == task.id and row.attempt == 1 and row.level == "info"
    assert row.message == "task starting → done (job waiting → running → done)"
    assert lines([row]) == [("job", "job waiting → running"), ("task", "task starting → running"),
                            ("task", "task running → done"), ("job", "job running → done")]
    start, end = unfold(row)[1:3]
    assert start.data == {"from": "starting", "to": "running", "pid": 123} and end.data == {"from": "running",
                                                                                          "to": "done"}
    assert {(line.ts, line.source, line.id) for line in unfold(row)} == {(row.ts, "agent:test", row.id)}


def test_a_start_reported_alone_is_one_row_with_its_jobs_start(make_service):
    svc = make_service("long")
    job = api.start_service("long")
    (task,) = claim_for(svc, agent="agent-t")
    before = last_event_id()
    assert transitions.mark_running([(task.id, task.attempt, 7)], agent_id="agent-t", source="agent:test") == {task.id}
    (row,) = rows_after(before, job.pk)
    assert row.message == "task starting → running (job waiting → running)"
    assert lines([row]) == [("job", "job waiting → running"), ("task", "task starting → running")]
    before = last_event_id()
    transitions.report([transitions.Outcome(task_id=task.id, attempt=task.attempt, status="succeeded")],
                       agent_id="agent-t", source="agent:test")
    (row,) = rows_after(before, job.pk)
    assert lines([row]) == [("task", "task running → done"), ("job", "job running → done")]


@pytest.fixture
def pair(make_service):
    """A started job of two steps, ``store`` waiting for ``fetch``."""
    make_service("first")
    make_service("second")
    create_workflow(name="pair", steps=[{"key": "fetch", "service": "first"},
                                        {"key": "store", "service": "second", "depends_on": ["fetch"]}])
    return api.start_workflow("pair")


def test_a_dependent_promoted_by_a_finish_reads_after_the_finish(pair):
    """The finish's row is written after the promotion it caused, and its id was taken first."""
    job = pair
    (fetch,) = claim_for(Service.objects.get(key="first"))
    before = last_event_id()
    run_ok([fetch])
    rows = rows_after(before, job.pk)
    assert [(r.task_id, r.message) for r in rows][-1][1] == "task waiting → queued"
    assert lines(rows) == [("job", "job waiting → running"), ("task", "task starting → running"),
                           ("task", "task running → done"),
                           ("job", "job running → waiting (no task starting or running)"),
                           ("task", "task waiting → queued")]


def test_a_report_of_many_tasks_of_one_job_folds_its_start_into_the_first_and_its_end_into_the_last(make_service):
    svc = make_service("wide")
    create_workflow(name="wide", steps=[{"key": k, "service": "wide"} for k in ("a", "b", "c")])
    job = api.start_workflow("wide")
    tasks = sorted(claim_for(svc), key=lambda t: t.id)
    before = last_event_id()
    run_ok(tasks)
    rows = rows_after(before, job.pk)
    assert [r.task_id for r in rows] == [t.id for t in tasks]
    assert [r.message for r in rows] == ["task starting → done (job waiting → running)", "task starting → done",
                                         "task starting → done (job running → done)"]
    assert [m for _, m in lines(rows)].count("job running → done") == 1


def test_a_job_end_above_info_raises_its_rows_level_and_keeps_the_tasks_lines_at_info(make_service):
    make_service("ok")
    make_service("bad", max_attempts=1)
    create_workflow(name="tolerant", steps=[{"key": "x", "service": "bad", "on_failure": "continue"},
                                            {"key": "y", "service": "ok"}])
    job = api.start_workflow("tolerant")
    run_fail(claim_for(Service.objects.get(key="bad")))
    claimed = claim_for(Service.objects.get(key="ok"))
    before = last_event_id()
    run_ok(claimed)
    (row,) = rows_after(before, job.pk)
    assert row.level == "warn"
    assert [(line.level, line.message) for line in unfold(row)][1:] == [
        ("info", "task starting → running"), ("info", "task running → done"),
        ("warn", "job running → partial (1 task(s) of 1 step(s) with on_failure \"continue\" failed;"
                 " their dependents were skipped)")]
    assert unfold(row)[-1].data["continue_failed"] == 1


def test_the_job_page_hides_a_folded_running_waiting_move_and_counts_it(pair):
    job = pair
    run_ok(claim_for(Service.objects.get(key="first")))
    admin = Client()
    admin.force_login(make_user("fold-root", superuser=True))
    page = admin.get(reverse("admin:jobs_job_change", args=[job.pk]))
    shown = [row.event.message for row in page.context["job_events"]]
    assert "job waiting → running" not in shown and "task running → done" in shown
    assert page.context["moves_hidden"] == 2  # waiting → running, running → waiting: both in fetch's row
    every = admin.get(reverse("admin:jobs_job_change", args=[job.pk]), {"moves": "all"})
    shown = [row.event.message for row in every.context["job_events"]]
    assert "job waiting → running" in shown and "job running → waiting (no task starting or running)" in shown
    assert all(not is_flapping(row.event) for row in page.context["job_events"])


# The writer against generated moves: every move handed over is on the timeline once, in order.



@st.composite
def walk(draw, table: dict, *, min_moves: int = 1, max_moves: int = 3) -> list[str]:
    """A path of statuses along the transition ``table``: each status one the one before may move to."""
    path = [draw(st.sampled_from(sorted(s for s, to in table.items() if to and s != "created")))]
    for _ in range(draw(st.integers(min_moves, max_moves))):
        onward = sorted(table.get(path[-1], ()))
        if not onward:
            break
        path.append(draw(st.sampled_from(onward)))
    return path if len(path) > 1 else [*path, sorted(table[path[0]])[0]]


LEVELS = st.sampled_from([None, "debug", "info", "warn", "error"])
RANK = {"debug": 0, "info": 1, None: 1, "warn": 2, "error": 3}


@st.composite
def handed_over(draw):
    jobs = [uuid7() for _ in range(draw(st.integers(1, 3)))]
    task_moves, job_moves = [], []
    for job in jobs:
        for _ in range(draw(st.integers(0, 3))):
            path = draw(walk(TASK_TRANSITIONS))
            data = {"from": path[0], "to": path[-1], **({"via": path[1:-1]} if len(path) > 2 else {})}
            if draw(st.booleans()):
                data["pid"] = draw(st.integers(1, 10**6))
            task_moves.append({"job_id": str(job), "task_id": str(uuid7()), "attempt": 1,
                               "level": draw(LEVELS), "data": data})
        for _ in range(draw(st.integers(0, 2))):
            frm, to = draw(walk(JOB_TRANSITIONS, max_moves=1))[:2]
            move = {"from": frm, "to": to}
            if draw(st.booleans()):
                # (PostgreSQL's text holds no NUL; a move's message is built by SQL from statuses and counts.)
                move["message"] = draw(st.text(st.characters(blacklist_characters="\x00"), min_size=1, max_size=40))
            if (level := draw(LEVELS)) not in (None, "info"):
                move["level"] = level
            job_moves.append({"job_id": str(job), "move": move})
    return jobs, task_moves, job_moves


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(handed_over())
def test_every_move_handed_over_is_one_line_in_order_at_the_level_of_its_row(moves):
    jobs, task_moves, job_moves = moves
    with transaction.atomic(), connection.cursor() as cur:  # an example that fails leaves the next one a clean slate
        for m in task_moves:  # each move takes its row's id when made, as the report's statements do
            cur.execute(f"SELECT {RESERVE_EVENT_ID}")
            m["id"] = cur.fetchone()[0]
        # The moves a statement made before the tasks' (a job's start); the finalization's own follow them
        # through the same statement (covered by the reports above).
        write_moves(cur, [json.dumps(m) for m in task_moves], [json.dumps(m) for m in job_moves], now=db_now(cur),
                    source="test:gen")
    rows = list(Event.objects.filter(job_id__in=jobs, source="test:gen").order_by("id"))
    for job in jobs:
        mine = [r for r in rows if r.job_id == job]
        tasks = [m for m in task_moves if m["job_id"] == str(job)]
        befores = [m["move"] for m in job_moves if m["job_id"] == str(job)]
        got = [(ln.task_id, ln.data.get("from"), ln.data.get("to"), ln.message, ln.level)
               for r in mine for ln in unfold(r)]
        want = []
        if tasks:
            for i, m in enumerate(sorted(tasks, key=lambda m: m["id"])):
                if i == 0:
                    want += [(None, j["from"], j["to"], j.get("message") or f"job {j['from']} → {j['to']}",
                              j.get("level", "info")) for j in befores]
                path = [m["data"]["from"], *m["data"].get("via", []), m["data"]["to"]]
                want += [(UUID(m["task_id"]), a, b, f"task {a} → {b}", m["level"] or "info")
                         for a, b in zip(path, path[1:], strict=False)]
            assert [r.task_id for r in mine] == [UUID(m["task_id"]) for m in sorted(tasks, key=lambda m: m["id"])]
            for r, m in zip(mine, sorted(tasks, key=lambda m: m["id"]), strict=True):
                folded = [RANK[m["level"]]] + [RANK[j.get("level")] for j in (befores if r is mine[0] else [])]
                assert r.level == ["debug", "info", "warn", "error"][max(folded)]
                assert r.id == m["id"]
        else:
            want = [(None, j["from"], j["to"], j.get("message") or f"job {j['from']} → {j['to']}",
                     j.get("level", "info")) for j in befores]
            assert len(mine) == len(befores)
        assert got == want
