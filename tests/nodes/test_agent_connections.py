"""An agent's server connections: a fixed number whatever --max-concurrent, even when tasks use the ORM:
one pooled (claims, reports, the tasks' queries), the lease renewal's own, and LISTEN."""

from __future__ import annotations

import pytest

from jobs import api
from jobs.models import Task
from tests.daemons import Sampler, wait_all_final

pytestmark = pytest.mark.django_db(transaction=True)

# Per sample: the agent's pooled connections, its lease renewal's, its LISTEN connections, its start-up
# check's (closed before the pool opens; its backend may outlive the close by a moment), tasks running.
COUNTS_SQL = """
SELECT count(*) FILTER (WHERE application_name = 'accs agent ' || %s),
       count(*) FILTER (WHERE application_name = 'accs agent ' || %s || ' renewal'),
       count(*) FILTER (WHERE application_name = 'accs agent ' || %s || ' listen'),
       count(*) FILTER (WHERE application_name = 'accs agent ' || %s || ' start'),
       (SELECT count(*) FROM accs_task WHERE status = 'running')
  FROM pg_stat_activity WHERE datname = current_database()
"""


@pytest.mark.parametrize("concurrency", [1, 20, 100])
def test_an_agent_holds_two_connections_and_listen_whatever_its_concurrency(concurrency, make_service, daemons,
                                                                            db_url):
    svc = make_service("orm", executor_config={"callable": "tests.callables:orm_then_wait"})
    for _ in range(concurrency):
        api.start_service(svc, params={"seconds": 3})
    node = f"conn-{concurrency}"
    with Sampler(db_url, COUNTS_SQL, (node, node, node, node)) as sampler:
        agent = daemons.agent(node, "orm", "--max-concurrent", str(concurrency),
                              env={"ACC_SLOT_CAP": "1000", "ACC_CPU_BUDGET": "1000"})
        wait_all_final(db_url, timeout=60 + concurrency / 2, expected=concurrency)
    pooled, renewal, listen, start, running = sampler.maxima
    print(f"--max-concurrent {concurrency}: {pooled} pooled + {renewal} renewal + {listen} LISTEN server "
          f"connections, {running} tasks running at once")
    assert Task.objects.filter(status="done").count() == concurrency, agent.log_path.read_text()[-3000:]
    assert running >= max(1, concurrency * 3 // 4), "the tasks ran side by side (each queries, then works 3 s)"
    assert listen == 1
    assert renewal == 1, "the lease renewal's connection of its own"
    assert pooled == 1, f"{pooled} pooled connections at --max-concurrent {concurrency}"
    assert start <= 1, "one start-up check, on one connection"
