"""A task's stderr lines are stored at warn, or at the level they start with, so "≥ error" finds "ERROR: disk full"."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from events.models import Event
from jobs import api
from jobs.models import Task
from nodes.executors import stderr_level
from tests.daemons import wait_all_final
from tests.ops_helpers import make_user

COMPLAINTS = [
    "ERROR: disk full on /srv",
    "plain complaint without a level",
    "[info] fine so far",
    "WARNING: almost full",
    "DEBUG cache warm",
    "critical: gave up",
    "Traceback (most recent call last):",
]


@pytest.mark.parametrize(("line", "level"), [
    ("ERROR: disk full", "error"), ("ERR: no space", "error"), ("[ERROR] boom", "error"), ("error: x", "error"),
    ("  CRITICAL: down", "error"), ("FATAL: gone", "error"), ("[critical] x", "error"),
    ("WARNING: low", "warn"), ("WARN: low", "warn"), ("[warn] low", "warn"), ("Warning: low", "warn"),
    ("WARNING:root:logged by logging", "warn"),
    ("INFO: fine", "info"), ("[INFO] fine", "info"), ("INFO fine", "info"),
    ("DEBUG: detail", "debug"), ("[debug] detail", "debug"),
    # No level named: stderr's own level.
    ("disk full", "warn"), ("Errors were found in 3 files", "warn"), ("Information follows", "warn"),
    ("Info about it", "warn"), ("note: something", "warn"), ("", "warn"), ("::error:: ValueError: x", "warn"),
])
def test_a_stderr_line_is_stored_at_the_level_it_names_else_warn(line, level):
    assert stderr_level(line) == level


def test_a_command_tasks_stderr_lines_keep_their_levels_and_the_error_filter_finds_them(
        make_service, daemons, db_url, client):
    script = "import sys\nfor line in sys.argv[1:]:\n    print(line, file=sys.stderr)\nprint('{{}}')"
    make_service("complainer", executor="command", executor_config={"argv": ["python", "-c", script, *COMPLAINTS]})
    job = api.start_service("complainer")
    daemons.agent("n1", "complainer")
    wait_all_final(db_url, timeout=60)
    task = Task.objects.get(job=job)
    assert task.status == "done", task.error_message
    logged = list(Event.objects.filter(task=task, type="log").order_by("id").values_list("message", "level"))
    assert logged == [(COMPLAINTS[0], "error"), (COMPLAINTS[1], "warn"), (COMPLAINTS[2], "info"),
                      (COMPLAINTS[3], "warn"), (COMPLAINTS[4], "debug"), (COMPLAINTS[5], "error"),
                      (COMPLAINTS[6], "warn")]
    make_user("root", superuser=True)
    client.login(username="root", password="correct horse battery staple")
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk]), {"level": "error"}).content.decode()
    timeline = " ".join(re.findall(r'<tr class="accs-event" data-level="\w+".*?</tr>', page, re.S))
    assert "ERROR: disk full on /srv" in timeline and "critical: gave up" in timeline
    assert "plain complaint" not in timeline and "fine so far" not in timeline


def log_at_levels(params, ctx):
    """A python callable that logs at several levels (run in a child process by the test below)."""
    ctx.log("chatty detail", level="debug")
    ctx.log("ERROR-looking text logged at info", level="info")
    ctx.log("something is off", level="warning")
    ctx.log("it broke", level="error")
    return {}


def test_a_process_isolated_callable_keeps_the_levels_it_logs_at(make_service, daemons, db_url):
    make_service("levels", executor="python",
                 executor_config={"callable": "tests.nodes.test_stderr_levels:log_at_levels", "isolation": "process"})
    job = api.start_service("levels")
    daemons.agent("n1", "levels")
    wait_all_final(db_url, timeout=60)
    task = Task.objects.get(job=job)
    assert task.status == "done", task.error_message
    logged = list(Event.objects.filter(task=task, type="log").order_by("id").values_list("message", "level"))
    assert logged == [("chatty detail", "debug"), ("ERROR-looking text logged at info", "info"),
                      ("something is off", "warn"), ("it broke", "error")]
