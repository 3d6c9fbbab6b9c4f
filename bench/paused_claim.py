"""Paused-tenant claim benchmark (``make bench-paused``): what a paused tenant's backlog costs the others' claims.

A tenant with ``PAUSED_TASKS`` (50,000) queued tasks at the head of the claim order (a higher priority)
and another with ``PAUSED_LIVE`` (1,000) behind it, one service. Two scenarios take turns claim by claim:

* ``no pause``: the claim takes the head, the big tenant's tasks;
* ``paused``: the big tenant is paused (``workflows.governor.pause_tenant``), so the claim must pass
  over its 50,000 tasks and take the other tenant's.

Each claim is one call of the agents' claim (``jobs.claim.claim_many``: the server function), 10 tasks,
rolled back so each sees the same queue, timed from the call to its return; ``PAUSED_CLAIMS`` (40) per
scenario, median and p95 reported. Two layouts of the backlog: ``free`` (tasks bound to no host, the
common case) and ``host-bound`` (the tasks bound in turn to the claiming node's 10 hosts: the claim's
host scan reads a host's queue in priority order across tenants, so there the paused tenant's head
is walked). Output: a table on stdout and ``bench/results/paused_claim.json``. Uses the database of
``ACC_DB_URL`` (``make db``) and empties the engine's tables first, as ``make bench`` does.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
os.environ.setdefault("ACC_LOG_LEVEL", "WARNING")

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from bench import run as bench  # noqa: E402  (sets Django up)
from jobs.claim import NodeLimits, claim_many, service_spec  # noqa: E402
from nodes.models import Host, Node  # noqa: E402
from tenants.models import Tenant  # noqa: E402
from workflows import governor  # noqa: E402
from workflows.api import save_service  # noqa: E402

PAUSED_TASKS = int(os.environ.get("PAUSED_TASKS", "50000"))
LIVE_TASKS = int(os.environ.get("PAUSED_LIVE", "1000"))
CLAIMS = int(os.environ.get("PAUSED_CLAIMS", "40"))
SERVICE = "bench-paused"
NODE = NodeLimits("bench-paused-node", slot_cap=10_000, cpu_budget=100_000, per_service={})
HOST = "bench-paused-host"
HOSTS = 10

QUEUE_SQL = """
-- n one-task jobs of the service for one tenant, at one priority, bound to the hosts in turn or to none.
WITH j AS (
    INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority, options,
                          step_params, scheduled_at, error_code, error_message, source, source_ref, correlation_id,
                          approval_state, approved_by, created_at, updated_at, started_at)
    SELECT gen_random_uuid(), %(tenant)s, %(svc)s, 'waiting', 0, 'bench', %(priority)s, '{}', '{}', now(), '', '',
           'manual', '', '', 'not_required', '', now(), now(), now()
      FROM generate_series(1, %(n)s)
    RETURNING id, order_seq
)
INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status, depends_on,
                       attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,
                       assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
SELECT gen_random_uuid(), j.id, %(tenant)s, 'bench', 'bench', %(svc)s,
       (%(hosts)s::bigint[])[1 + j.order_seq %% cardinality(%(hosts)s::bigint[])], false, 'queued', '{}', 0, 3, now(),
       %(priority)s, j.order_seq, 600, '{}', '', '', '', '', '', now(), now()
  FROM j
"""

SCENARIOS = ("no pause", "paused")


def fill(service, *, big: Tenant, live: Tenant, bound: bool) -> None:
    """Queue the big tenant's backlog at the head of the order and the live tenant's behind it (``bound``:
    on the claiming node's host)."""
    clear()
    Node.objects.get_or_create(name=NODE.name)
    # A node's slots are capped at its eligible hosts: as many hosts as a claim takes tasks.
    hosts = [Host.objects.create(name=f"{HOST}-{i}", node_id=NODE.name).pk for i in range(HOSTS)] if bound else []
    with connection.cursor() as cur:
        for tenant, n, priority in ((big, PAUSED_TASKS, 10), (live, LIVE_TASKS, 0)):
            cur.execute(QUEUE_SQL, {"tenant": tenant.pk, "svc": service.id, "n": n, "priority": priority,
                                    "hosts": hosts or None})
    bench.settle()


def clear() -> None:
    """Empty the engine's tables and forget the bench's node and hosts (made again by :func:`fill`)."""
    with connection.cursor() as cur:
        cur.execute("TRUNCATE accs_job, accs_task CASCADE")  # the hosts' tasks first
        cur.execute("DELETE FROM accs_host WHERE name LIKE %s", [HOST + "-%"])
    bench.reset()


class Rollback(Exception):
    pass


def one_claim(service, *, scenario: str, big: Tenant, live: Tenant) -> float:
    """Time one claim of 10 in the scenario (rolled back); check whose tasks it took; return ms."""
    if scenario == "paused":
        governor.pause_tenant(big, reason="bench", by="bench")
    else:
        governor.resume_tenant(big, by="bench")
    spec = service_spec(service)
    try:
        with transaction.atomic():
            start = time.perf_counter()
            got = claim_many([spec], NODE, agent_id="bench-paused", free_slots=10, lease_seconds=600)
            ms = (time.perf_counter() - start) * 1000
            with connection.cursor() as cur:
                cur.execute("SELECT DISTINCT tenant_id FROM accs_task WHERE id = ANY(%s)", [[t.id for t in got]])
                tenants = {r[0] for r in cur.fetchall()}
            want = live.pk if scenario == "paused" else big.pk
            assert len(got) == 10 and tenants == {want}, (scenario, len(got), tenants)
            raise Rollback
    except Rollback:
        pass
    return ms


def main() -> int:
    call_command("migrate", verbosity=0)
    bench.say(f"paused-tenant claim: {PAUSED_TASKS:,} queued tasks of one tenant at the head of the order, "
              f"{LIVE_TASKS:,} of another behind them, {CLAIMS} claims of 10 per scenario, taking turns")
    service = save_service(key=SERVICE, executor="python", executor_config={"callable": "bench.tasks:noop"},
                           params_schema={"type": "object"})
    big, _ = Tenant.objects.get_or_create(slug="bench-big", defaults={"name": "Bench big"})
    live, _ = Tenant.objects.get_or_create(slug="bench-live", defaults={"name": "Bench live"})
    results: dict[str, dict[str, dict[str, float]]] = {}
    for layout in ("free", "host-bound"):
        fill(service, big=big, live=live, bound=layout == "host-bound")
        runs: dict[str, list[float]] = {s: [] for s in SCENARIOS}
        for _ in range(CLAIMS):
            for scenario in SCENARIOS:  # in turn, so a load that comes and goes hits each alike
                runs[scenario].append(one_claim(service, scenario=scenario, big=big, live=live))
        results[layout] = {}
        for scenario, times in runs.items():
            times.sort()
            results[layout][scenario] = {"p50_ms": round(statistics.median(times), 2),
                                         "p95_ms": round(times[max(int(len(times) * 0.95) - 1, 0)], 2)}
        results[layout]["paused"]["vs_no_pause"] = round(
            results[layout]["paused"]["p50_ms"] / results[layout]["no pause"]["p50_ms"], 2)
        for scenario, r in results[layout].items():
            bench.say(f"  {layout:<11} {scenario:<9} p50 {r['p50_ms']:7.2f} ms  p95 {r['p95_ms']:7.2f} ms"
                      + (f"  {r['vs_no_pause']:.2f}x no pause" if "vs_no_pause" in r else ""))
    governor.resume_tenant(big, by="bench")
    bench.OUT.mkdir(parents=True, exist_ok=True)
    doc = {"paused_tasks": PAUSED_TASKS, "live_tasks": LIVE_TASKS, "claims": CLAIMS, "results": results}
    (bench.OUT / "paused_claim.json").write_text(json.dumps(doc, indent=2) + "\n")
    clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
