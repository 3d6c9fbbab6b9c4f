"""An agent whose clock is wrong by minutes behaves exactly like one whose clock is right.

Defect 9 of the fault review: leases, backoff and claim eligibility used the agent's clock, so an
agent 80 s behind had its healthy tasks rescued over and over. Every such time now comes from
PostgreSQL. Real agent and builder processes; the agent's wall clock is shifted with time-machine.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from events.models import Event
from jobs import api
from jobs.models import Attempt, Task
from tests.daemons import ROOT, wait_all_final

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _skewed_agent(daemons, skew: float, *args: str, name: str) -> subprocess.Popen:
    log = open(daemons.log_dir / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "skewed_clock.py"), str(skew), "runagent", *args],
                            cwd=ROOT, env=daemons.env, stdout=log, stderr=subprocess.STDOUT)
    daemons.procs.append(proc)
    return proc


@pytest.mark.parametrize("skew", [-300.0, 300.0])
def test_a_skewed_agent_keeps_its_leases_and_honours_backoff(make_service, daemons, db_url, skew):
    make_service("tick", executor_config={"callable": "tests.callables:sleep"},
                 params_schema={"type": "object", "properties": {"seconds": {"type": "number"}}})
    make_service("flaky-skew", executor_config={"callable": "tests.callables:fail"}, max_attempts=2,
                 backoff_base_seconds=2, backoff_cap_seconds=2)
    jobs = [api.start_service("tick", params={"seconds": 2.5}) for _ in range(2)]
    flaky = api.start_service("flaky-skew")
    daemons.builder()
    _skewed_agent(daemons, skew, "--node", "skewed", "--services", "tick,flaky-skew", "--lease-seconds", "3",
                  name=f"agent-skew{int(skew)}")
    wait_all_final(db_url, timeout=60)
    assert not Event.objects.filter(message__contains="lease_expired").exists(), "healthy leases were rescued"
    for job in jobs:
        task = Task.objects.get(job=job)
        assert (task.status, task.attempt) == ("done", 1), (task.status, task.attempt)
    first, second = Attempt.objects.filter(task__job=flaky).order_by("attempt_no")
    gap = (second.started_at - first.finished_at).total_seconds()
    assert gap >= 2.0, f"retry after {gap:.2f}s, backoff was 2 s"
    assert gap < 30, f"retry after {gap:.2f}s: the backoff was measured on a skewed clock"
