"""Keyed claim benchmark (``make bench-keyed``): what a per-key limit adds to one claim.

A service with a ``concurrency_key`` (or a ``rate_key``) and a backlog whose head keys are at
their limit: the claim must pass over those keys' tasks and find the others. It must cost about
what the same claim costs without keys (the target is at most twice as much), whatever the backlog.

Each layout empties the engine's tables, queues its tasks as one-task jobs of one service straight
in SQL, their ``params.customer`` spread over its keys, and puts the first of its keys in the claim
order at their limit (2): held tasks (for the concurrency key) and recorded starts in the window
(for the rate key). The keys are arranged along the order in one of two ways:

* ``interleaved``: key = position in the order modulo the key count (the head tasks belong to the
  full keys, then every key comes round again);
* ``grouped``: each key's tasks in one run, so the full keys own the head of the order (the claim
  must get past all of their tasks).

The layouts (``KEYED_LAYOUTS`` picks some by name, comma-separated):

* ``last-round-interleaved`` / ``last-round-grouped``: 100,000 tasks, 1,000 keys, 50 full (the
  previous round's benchmark);
* ``full-800``: 50,000 tasks, 1,000 keys, 800 full, grouped: 40,000 queued tasks of full keys
  ahead of the first key with room (the layout that cost 16 times an unkeyed claim);
* ``many-keys``: 50,000 tasks, 10,000 keys, 2,000 full, interleaved (a key per 5 tasks: the cost
  of visiting each key).

Each scenario is its own service with the same backlog (queued the same way, its head keys at their
limit the same way), so no scenario changes another's rows:

* ``unkeyed``: the service names no key path: its tasks have no keys, so nothing of the keyed
  machinery runs (the claim every keyed one is compared with);
* ``plain``: the paths named, no limits: an unkeyed claim of keyed tasks, which still pass through
  the keys' triggers;
* ``concurrency``: ``concurrency_key_limit`` 2;
* ``rate``: ``rate_key_limit`` 2 per hour.

Then ``KEYED_CLAIMS`` (100) claims of 10 tasks per scenario, taking turns claim by claim in a shuffled
order (seeded), so a load that comes and goes hits each scenario alike; every claim is rolled back
so each sees the same queue, timed from the call to its return (the median is reported, with p95).
Two claims per scenario are run untimed first. Each keyed claim is given against both ``unkeyed``
and ``plain``: against ``plain`` alone, a cost in the triggers lands on both sides of the ratio (a
claim 10 times slower once showed 1.01x).
Output: a table on stdout
and ``bench/results/keyed_claim.json``. Uses the database of ``ACC_DB_URL`` (``make db``) and
empties the engine's tables first, as ``make bench`` does.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
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
from jobs.enqueue import resolve_tenant  # noqa: E402
from workflows.api import save_service  # noqa: E402
from workflows.models import Service  # noqa: E402


@dataclass(frozen=True)
class Layout:
    """A backlog: ``tasks`` queued over ``keys`` keys, the first ``full`` keys of the order at their limit."""

    tasks: int
    keys: int
    full: int
    arrangement: str  # "interleaved" or "grouped" (KEY_OF)


LAYOUTS = {
    "last-round-interleaved": Layout(100_000, 1_000, 50, "interleaved"),
    "last-round-grouped": Layout(100_000, 1_000, 50, "grouped"),
    "full-800": Layout(50_000, 1_000, 800, "grouped"),
    "many-keys": Layout(50_000, 10_000, 2_000, "interleaved"),
}
CLAIMS = int(os.environ.get("KEYED_CLAIMS", "100"))
LIMIT = 2
SERVICE = "bench-keyed"  # each scenario's service is named bench-keyed-<scenario>
NODE = NodeLimits("bench-keyed-node", slot_cap=10_000, cpu_budget=100_000, per_service={})

FILL_SQL = """
-- n one-task jobs of the service; the task at position i of the claim order has key {key}.
WITH j AS (
    INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority, options,
                          step_params, scheduled_at, error_code, error_message, source, source_ref, correlation_id,
                          approval_state, approved_by, created_at, updated_at, started_at)
    SELECT gen_random_uuid(), %(tenant)s, %(svc)s, 'waiting', 0, 'bench', 0, '{{}}', '{{}}', now(), '', '', 'manual',
           '', '', 'not_required', '', now(), now(), now()
      FROM generate_series(1, %(n)s)
    RETURNING id, order_seq
), r AS (SELECT j.*, row_number() OVER (ORDER BY j.order_seq) - 1 AS i FROM j)
INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status, depends_on,
                       attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,
                       assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
SELECT gen_random_uuid(), r.id, %(tenant)s, 'bench', 'bench', %(svc)s, NULL, false, 'queued', '{{}}', 0, 3, now(), 0,
       r.order_seq, 600, jsonb_build_object('customer', 'c' || ({key})), '', '', '', '', '', now(), now()
  FROM r
"""

# SQL for the key number of the task at position r.i ('%%' is psycopg's percent sign).
KEY_OF = {"interleaved": "r.i %% {keys}", "grouped": "r.i / ({n} / {keys})"}

# The full keys' held tasks (of one service): the first FULL keys of the order, LIMIT each, running on
# another node.
HOLD_SQL = """
UPDATE accs_task t SET status = 'running', attempt = 1, claimed_by = 'bench-other:1:1', node = 'bench-other',
       claimed_at = now(), started_at = now(), lease_expires_at = now() + interval '1 hour', heartbeat_at = now()
 WHERE t.id IN (SELECT id FROM (
        SELECT t2.id, t2.params->>'customer' AS key,
               row_number() OVER (PARTITION BY t2.params->>'customer' ORDER BY t2.order_seq DESC) AS n
          FROM accs_task t2 WHERE t2.service_id = %(svc)s AND t2.params->>'customer' = ANY(%(keys)s)) x
         WHERE x.n <= %(limit)s)
"""

STARTS_SQL = """
INSERT INTO accs_rate_start (service_id, key, at)
SELECT %(svc)s, k, now() FROM unnest(%(keys)s::text[]) AS k CROSS JOIN generate_series(1, %(limit)s)
"""


SCENARIOS = ("unkeyed", "plain", "concurrency", "rate")


def limits_of(scenario: str) -> dict[str, object]:
    """Return the service's flow-control fields for a scenario (none for ``plain``, nor a path for ``unkeyed``)."""
    # The paths stay named without a limit, so the tasks stay keyed (jobs.limit_keys) from one
    # scenario to the next and only the claim differs: plain, the service claims as an unkeyed one.
    # Its tasks still pass through the keys' triggers, so a cost there lands on both sides of the
    # keyed claims' ratio to it: unkeyed (no path, no keys) is the claim with none of it.
    fields: dict[str, object] = {"concurrency_key": "customer", "concurrency_key_limit": 0, "rate_key": "customer",
                                 "rate_key_limit": 0, "rate_period_seconds": 3600}
    if scenario == "unkeyed":
        fields.update(concurrency_key="", rate_key="")
    elif scenario == "concurrency":
        fields.update(concurrency_key_limit=LIMIT)
    elif scenario == "rate":
        fields.update(rate_key_limit=LIMIT)
    return fields


def fill(service, layout: Layout) -> list[str]:
    """Queue the service's backlog and put its head keys at their limit (held tasks and starts); return them."""
    with connection.cursor() as cur:
        # (The default tenant, which a demo or a test run against this database may have removed.)
        tenant = resolve_tenant(None).id
        key = KEY_OF[layout.arrangement].format(keys=layout.keys, n=layout.tasks)
        cur.execute(FILL_SQL.format(key=key), {"tenant": tenant, "svc": service.id, "n": layout.tasks})
        cur.execute("SELECT params->>'customer' FROM accs_task WHERE service_id = %s ORDER BY order_seq LIMIT %s",
                    [service.id, layout.full * layout.tasks // layout.keys])
        head: list[str] = []
        for (k,) in cur.fetchall():
            if k not in head:
                head.append(k)
            if len(head) == layout.full:
                break
        # The full keys' held tasks come from the end of the order, so the head stays queued.
        cur.execute(HOLD_SQL, {"svc": service.id, "keys": head, "limit": LIMIT})
        cur.execute(STARTS_SQL, {"svc": service.id, "keys": head, "limit": LIMIT})
    return head


class Rollback(Exception):
    pass


# Claims run and thrown away per scenario before the timed ones (each connection plans the claim
# functions' statements at their first call).
WARMUP = 2


def one_claim(service, full: list[str]) -> tuple[float, int]:
    """Time one claim of 10 of the service (rolled back); return (ms, tasks claimed)."""
    spec = service_spec(service)
    try:
        with transaction.atomic():
            start = time.perf_counter()
            got = claim_many([spec], NODE, agent_id="bench-keyed", free_slots=10, lease_seconds=600)
            ms = (time.perf_counter() - start) * 1000
            taken = {t.params.get("customer") for t in got}
            # Keyed, the claim fills its room from as many keys as it needs (grouped: 2 from each of 5).
            assert len(got) == 10, len(got)
            if spec.keyed:
                assert not taken & set(full), f"claimed a key at its limit: {sorted(taken & set(full))}"
            raise Rollback
    except Rollback:
        pass
    return ms, len(got)


def make_services() -> dict[str, Service]:
    """Return each scenario's service, its limits set (the paths of ``plain`` straight in the table)."""
    services = {}
    for scenario in SCENARIOS:
        key = f"{SERVICE}-{scenario}"
        # (A previous run's plain service names paths without limits, which the validation refuses.)
        Service.objects.filter(key=key).update(concurrency_key="", rate_key="", concurrency_key_limit=0,
                                               rate_key_limit=0)
        service = save_service(key=key, executor="python", executor_config={"callable": "bench.tasks:noop"},
                               params_schema={"type": "object", "properties": {"customer": {"type": "string"}}},
                               rate_period_seconds=3600)
        Service.objects.filter(id=service.id).update(**limits_of(scenario))
        service.refresh_from_db()
        services[scenario] = service
    return services


def main() -> int:
    call_command("migrate", verbosity=0)
    chosen = [n.strip() for n in os.environ.get("KEYED_LAYOUTS", ",".join(LAYOUTS)).split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"KEYED_LAYOUTS names unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    bench.say(f"keyed claim: {CLAIMS} claims of 10 per scenario and layout, the scenarios (a service each) taking"
              f" turns claim by claim; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    services = make_services()
    results: dict[str, dict[str, dict[str, float]]] = {}
    turns = random.Random(20261130)
    for name in chosen:
        layout = LAYOUTS[name]
        bench.say(f"  {name}: {layout.tasks:,} queued tasks a service, {layout.keys:,} keys ({layout.arrangement}),"
                  f" the first {layout.full:,} at their limit ({LIMIT})")
        bench.reset()
        with connection.cursor() as cur:
            cur.execute("DELETE FROM accs_rate_start")
        full = {scenario: fill(service, layout) for scenario, service in services.items()}
        bench.settle()
        with connection.cursor() as cur:
            cur.execute("VACUUM ANALYZE accs_rate_start")
            cur.execute("VACUUM ANALYZE accs_limit_key_head")
        for scenario, service in services.items():
            for _ in range(WARMUP):
                one_claim(service, full[scenario])
        runs: dict[str, list[tuple[float, int]]] = {s: [] for s in SCENARIOS}
        for _ in range(CLAIMS):
            order = list(SCENARIOS)
            turns.shuffle(order)
            for scenario in order:
                runs[scenario].append(one_claim(services[scenario], full[scenario]))
        results[name] = {}
        for scenario, got in runs.items():
            times = sorted(ms for ms, _ in got)
            results[name][scenario] = {"p50_ms": round(statistics.median(times), 2),
                                       "p95_ms": round(times[max(int(len(times) * 0.95) - 1, 0)], 2),
                                       "claimed": round(statistics.median(n for _, n in got), 1)}
        plain, unkeyed = results[name]["plain"]["p50_ms"], results[name]["unkeyed"]["p50_ms"]
        for scenario in ("concurrency", "rate"):
            results[name][scenario]["vs_plain"] = round(results[name][scenario]["p50_ms"] / plain, 2)
        for scenario in ("plain", "concurrency", "rate"):
            results[name][scenario]["vs_unkeyed"] = round(results[name][scenario]["p50_ms"] / unkeyed, 2)
        for scenario, r in results[name].items():
            bench.say(f"    {scenario:<12} p50 {r['p50_ms']:7.2f} ms  p95 {r['p95_ms']:7.2f} ms"
                      f"  {r['claimed']:4.1f} claimed"
                      + (f"  {r['vs_plain']:.2f}x plain" if "vs_plain" in r else "")
                      + (f"  {r['vs_unkeyed']:.2f}x unkeyed" if "vs_unkeyed" in r else ""))
    bench.OUT.mkdir(parents=True, exist_ok=True)
    doc = {"layouts": {n: asdict(LAYOUTS[n]) for n in chosen}, "limit": LIMIT, "claims": CLAIMS,
           "load_average": os.getloadavg(), "results": results}
    (bench.OUT / "keyed_claim.json").write_text(json.dumps(doc, indent=2) + "\n")
    bench.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
