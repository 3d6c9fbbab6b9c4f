"""Flow control in the claim: rate limits per service and per key, per-key concurrency caps.

The in-process tests drive the real claim statement with PostgreSQL's clock shifted by an
injected ``now``; the race tests run four real agent processes against one database and check
every recorded start and every held task against the limits.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Count

from jobs import api, transitions
from jobs.claim import NodeLimits, claim_many, service_spec
from jobs.models import RateStart, Task
from tests.daemons import Sampler, wait_for
from tests.engine_helpers import run_ok
from workflows.api import save_service
from workflows.validation import DefinitionError

NODE = NodeLimits(name="node-fc", slot_cap=50, cpu_budget=100, per_service={})
KEYED = {"params_schema": {"type": "object", "properties": {"customer": {"type": "string"},
                                                            "seconds": {"type": "number"}}}}


def db_now():
    with connection.cursor() as cur:
        cur.execute("SELECT now()")
        return cur.fetchone()[0]


def enqueue(service_key: str, customers: list[str]) -> None:
    api.start_many([api.JobSpec(service=service_key, params={"customer": c}) for c in customers])
    transitions.start_due_jobs(limit=10_000)


def claim(service, n: int = 50, *, now=None, agent: str = "agent-fc"):
    service.refresh_from_db()
    return claim_many([service_spec(service)], NODE, agent_id=agent, free_slots=n, lease_seconds=60, now=now)


def customers_of(tasks) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for t in tasks:
        counts[t.params.get("customer", "")] += 1
    return dict(counts)


@pytest.mark.django_db(transaction=True)
def test_service_rate_limit_allows_n_starts_per_period_then_refills_as_the_window_passes(make_service):
    svc = make_service("rated", rate_limit=5, rate_period_seconds=60, **KEYED)
    enqueue("rated", ["a"] * 20)
    t0 = db_now()
    assert len(claim(svc, now=t0)) == 5
    assert claim(svc, now=t0 + timedelta(seconds=30)) == [], "the window still holds 5 starts"
    assert RateStart.objects.filter(service=svc).count() == 5
    assert len(claim(svc, now=t0 + timedelta(seconds=60.5))) == 5, "the first 5 left the window"
    assert len(claim(svc, 2, now=t0 + timedelta(seconds=90))) == 0


@pytest.mark.django_db(transaction=True)
def test_rate_limit_per_key_limits_each_customer_and_lets_others_through(make_service):
    svc = make_service("per-customer", rate_key="customer", rate_key_limit=2, rate_period_seconds=60, **KEYED)
    # The busy customer comes first in the global order: its tasks must not hide the others.
    enqueue("per-customer", ["busy"] * 30 + ["b"] * 3 + ["c"])
    t0 = db_now()
    assert customers_of(claim(svc, now=t0)) == {"busy": 2, "b": 2, "c": 1}
    assert claim(svc, now=t0 + timedelta(seconds=10)) == []
    assert customers_of(claim(svc, now=t0 + timedelta(seconds=61))) == {"busy": 2, "b": 1}
    keys = dict(RateStart.objects.filter(service=svc).values_list("key").annotate(n=Count("id")))
    assert keys == {"busy": 4, "b": 3, "c": 1}


@pytest.mark.django_db(transaction=True)
def test_rate_limit_per_key_under_a_service_limit_takes_both(make_service):
    svc = make_service("both", rate_limit=3, rate_key="customer", rate_key_limit=2, **KEYED)
    enqueue("both", ["a"] * 5 + ["b"] * 5)
    t0 = db_now()
    assert customers_of(claim(svc, now=t0)) == {"a": 2, "b": 1}


@pytest.mark.django_db(transaction=True)
def test_per_key_concurrency_caps_held_tasks_and_frees_room_when_one_finishes(make_service):
    svc = make_service("per-key-cap", concurrency_key="customer", concurrency_key_limit=2, **KEYED)
    enqueue("per-key-cap", ["a"] * 6 + ["b"] * 6 + ["c"])
    first = claim(svc)
    assert customers_of(first) == {"a": 2, "b": 2, "c": 1}
    assert claim(svc) == [], "every key is at its cap"
    run_ok([t for t in first if t.params["customer"] == "a"][:1], agent="agent-fc")
    assert customers_of(claim(svc)) == {"a": 1}
    assert not RateStart.objects.exists(), "no rate limit: no starts recorded"


@pytest.mark.django_db(transaction=True)
def test_missing_key_counts_as_one_shared_key(make_service):
    svc = make_service("no-key", concurrency_key="customer.id", concurrency_key_limit=1, **KEYED)
    enqueue("no-key", ["x", "x", "y"])  # params have "customer": "x", so customer.id is missing for all
    assert len(claim(svc)) == 1


@pytest.mark.django_db(transaction=True)
def test_nested_key_path_reads_inside_params(make_service):
    svc = make_service("nested", concurrency_key="order.customer", concurrency_key_limit=1,
                       params_schema={"type": "object"})
    api.start_many([api.JobSpec(service="nested", params={"order": {"customer": c}}) for c in ("a", "a", "b")])
    transitions.start_due_jobs(limit=100)
    assert sorted(t.params["order"]["customer"] for t in claim(svc)) == ["a", "b"]


@pytest.mark.django_db(transaction=True)
def test_flow_limits_keep_the_global_order_across_services(make_service):
    """A limited service and a plain one claimed together still follow priority, then order_seq."""
    limited = make_service("limited", concurrency_key="customer", concurrency_key_limit=1, **KEYED)
    plain = make_service("plain", **KEYED)
    enqueue("limited", ["a", "a", "b"])
    enqueue("plain", ["z", "z"])
    got = claim_many([service_spec(limited), service_spec(plain)], NODE, agent_id="agent-fc", free_slots=3,
                     lease_seconds=60)
    seq = dict(Task.objects.values_list("id", "order_seq"))
    assert [seq[t.id] for t in got] == sorted(seq[t.id] for t in got)
    assert [(t.service_key, t.params["customer"]) for t in got] == [("limited", "a"), ("limited", "b"),
                                                                     ("plain", "z")]


@pytest.mark.django_db
@pytest.mark.parametrize("fields, where, words", [
    ({"rate_key_limit": 3}, "rate_key", "name the params path"),
    ({"rate_key": "customer"}, "rate_key_limit", "give the limit per key"),
    ({"concurrency_key": "a..b", "concurrency_key_limit": 1}, "concurrency_key", "is not a params path"),
    ({"rate_limit": 2, "rate_key": "c", "rate_key_limit": 5}, "rate_key_limit", "could never be reached"),
    ({"rate_period_seconds": 0}, "rate_period_seconds", "at least 1"),
])
def test_bad_flow_control_settings_are_refused_naming_the_field(make_service, fields, where, words):
    with pytest.raises(DefinitionError) as err:
        make_service("bad-flow", **fields)
    assert any(p.where == where and words in p.message for p in err.value.problems), err.value.problems


# ---------------------------------------------------------------------------------- races

SLEEPY = {"executor": "python", "executor_config": {"callable": "tests.callables:sleep"}, **KEYED}


def starts(service_id: int) -> list[tuple]:
    """(claim time, customer, agent) of every start of the service, from the timeline."""
    with connection.cursor() as cur:
        cur.execute("SELECT e.ts, t.params->>'customer', e.data->>'agent' FROM accs_event e"
                    " JOIN accs_task t ON t.id = e.task_id"
                    " WHERE e.message = 'task queued → starting' AND t.service_id = %s ORDER BY e.ts", [service_id])
        return cur.fetchall()


def max_in_window(times: list, period: float) -> int:
    """The most starts in any window of ``period`` seconds (each window opening at a start)."""
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while (t - times[lo]).total_seconds() >= period:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def agents(daemons, service_key: str, n: int = 4) -> None:
    daemons.agents_together([f"fc-{i}" for i in range(n)], service_key, "--max-concurrent", "4",
                            env={"ACC_POLL_INTERVAL_SEC": "0.1"})


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_agents_never_exceed_the_service_rate_limit(make_service, daemons, db_url):
    svc = save_service(key="rate-race", rate_limit=6, rate_period_seconds=2, **{**SLEEPY})
    api.start_many([api.JobSpec(service="rate-race", params={"seconds": 0.01}) for _ in range(40)])
    transitions.start_due_jobs(limit=100)
    agents(daemons, "rate-race")
    wait_for(lambda: Task.objects.filter(service=svc, status="done").count() >= 24, timeout=60,
             message="24 tasks done through a 6-per-2s limit")
    daemons.stop_all()
    rows = starts(svc.id)
    assert max_in_window([r[0] for r in rows], 2.0) == 6, (
        "never more than 6 starts in any 2 s, and the limit was reached")
    assert len({r[2] for r in rows}) >= 2, "several agents took part"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_agents_never_exceed_the_per_key_rate_limit(make_service, daemons, db_url):
    svc = save_service(key="key-rate-race", rate_key="customer", rate_key_limit=2, rate_period_seconds=2,
                       **{**SLEEPY})
    api.start_many([api.JobSpec(service="key-rate-race", params={"customer": c, "seconds": 0.01})
                    for c in ("a", "b", "c") * 10])
    transitions.start_due_jobs(limit=100)
    agents(daemons, "key-rate-race")
    wait_for(lambda: Task.objects.filter(service=svc, status="done").count() >= 18, timeout=60,
             message="18 tasks done through a 2-per-2s-per-customer limit")
    daemons.stop_all()
    by_key = defaultdict(list)
    for ts, customer, _ in starts(svc.id):
        by_key[customer].append(ts)
    assert {k: max_in_window(v, 2.0) for k, v in by_key.items()} == {"a": 2, "b": 2, "c": 2}


PEAK_TRIGGER = """
CREATE TABLE fc_peak (customer text, held int);
CREATE FUNCTION fc_record_held() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fc_peak SELECT NEW.params->>'customer', count(*) FROM accs_task
     WHERE service_id = NEW.service_id AND status IN ('starting', 'running')
       AND params->>'customer' = NEW.params->>'customer';
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER fc_record_held AFTER UPDATE OF status ON accs_task DEFERRABLE INITIALLY DEFERRED
   FOR EACH ROW WHEN (NEW.status = 'starting') EXECUTE FUNCTION fc_record_held();
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_agents_never_hold_more_than_the_per_key_cap(make_service, daemons, db_url):
    svc = save_service(key="key-cap-race", concurrency_key="customer", concurrency_key_limit=2, **{**SLEEPY})
    api.start_many([api.JobSpec(service="key-cap-race", params={"customer": c, "seconds": 0.3})
                    for c in ("a", "b", "c") * 8])
    with connection.cursor() as cur:
        # At each claim's commit, the held tasks of the claimed task's key (all committed claims
        # and this one): a second witness beside the sampler.
        cur.execute(PEAK_TRIGGER)
    sql = ("SELECT coalesce(max(n), 0), coalesce(sum(n), 0) FROM (SELECT count(*) n FROM accs_task"
           " WHERE status IN ('starting', 'running') AND service_id = %s GROUP BY params->>'customer') x")
    try:
        with Sampler(db_url, sql, (svc.id,)) as s:
            agents(daemons, "key-cap-race")
            # The tasks are queued once every agent runs, so all four race for them.
            transitions.start_due_jobs(limit=100)
            wait_for(lambda: Task.objects.filter(service=svc, status="done").count() == 24, timeout=90,
                     message="all 24 tasks done")
        daemons.stop_all()
        with connection.cursor() as cur:
            cur.execute("SELECT customer, max(held) FROM fc_peak GROUP BY 1 ORDER BY 1")
            peaks = dict(cur.fetchall())
    finally:
        with connection.cursor() as cur:
            cur.execute("DROP TABLE IF EXISTS fc_peak; DROP TRIGGER IF EXISTS fc_record_held ON accs_task;"
                        " DROP FUNCTION IF EXISTS fc_record_held()")
    assert s.maxima[0] == 2, "never three held tasks of one customer, and the cap was reached"
    assert s.maxima[1] > 2, "customers ran side by side"
    assert peaks == {"a": 2, "b": 2, "c": 2}
    agents_used = {r[2] for r in starts(svc.id)}
    assert len(agents_used) >= 2


@pytest.mark.django_db(transaction=True)
def test_builder_forgets_starts_that_left_the_rate_window(make_service):
    from jobs.builder import Builder
    from jobs.duties import rate_window

    svc = make_service("forget", rate_limit=100, rate_period_seconds=60, **KEYED)
    enqueue("forget", ["a"] * 4)
    t0 = db_now()
    claim(svc, 2, now=t0 - timedelta(seconds=120))  # started two minutes ago: out of the window
    claim(svc, 2, now=t0)
    Builder(once=True, duties=[rate_window.duty()]).tick()
    assert sorted(RateStart.objects.values_list("at", flat=True)) == [t0, t0]


@pytest.mark.django_db
def test_flow_limits_are_edited_through_the_http_api_with_the_same_validation(make_service):
    import json

    from tests.api_helpers import client_for, user_with_token

    make_service("api-flow", **KEYED)
    client = client_for(user_with_token("root-fc", superuser=True)[1])

    def patch(body):
        return client.patch("/api/v1/services/api-flow", json.dumps(body), content_type="application/json")

    ok = patch({"rate_limit": 100, "rate_period_seconds": 60, "concurrency_key": "customer",
                "concurrency_key_limit": 3})
    assert ok.status_code == 200, ok.content
    assert (ok.json()["rate_limit"], ok.json()["concurrency_key_limit"]) == (100, 3)
    bad = patch({"rate_key_limit": 5})
    assert bad.status_code == 422 and "rate_key" in bad.content.decode()
    from workflows.models import Service

    assert Service.objects.get(key="api-flow").rate_key_limit == 0, "nothing written by the refused change"


# ---------------------------------------------------------------------------------- where it shows

@pytest.mark.django_db
def test_dashboard_metrics_and_stuck_reasons_show_starts_left_and_tasks_waiting_on_each_limit(client, make_service):
    from django.urls import reverse
    from prometheus_client.parser import text_string_to_metric_families

    from ops import metrics
    from ops.overview import flow_limits, overview
    from tests.ops_helpers import make_user

    rated = make_service("rated-dash", rate_limit=3, rate_period_seconds=60, **KEYED)
    keyed = make_service("keyed-dash", concurrency_key="customer", concurrency_key_limit=1, rate_key="customer",
                         rate_key_limit=5, **KEYED)
    enqueue("rated-dash", ["a"] * 5)
    enqueue("keyed-dash", ["a", "a", "a", "b"])
    assert len(claim(rated)) == 3
    assert customers_of(claim(keyed)) == {"a": 1, "b": 1}

    flows = {f.service: f for f in flow_limits()}
    r, k = flows["rated-dash"], flows["keyed-dash"]
    assert (r.started, r.starts_left, r.queued, r.waiting_on_rate) == (3, 0, 2, 2)
    assert (k.starts_left, k.keys_at_cap, k.keys_at_rate_limit, k.queued, k.waiting_on_key_cap) == (None, 2, 0, 2, 2)
    stuck = {(s.service, s.reason): s for s in overview().stuck}
    assert stuck[("rated-dash", "rate_limit")].count == 2
    assert "3/3 starts in the last 60 s" in stuck[("rated-dash", "rate_limit")].message
    assert stuck[("keyed-dash", "key_cap")].count == 2
    assert ("keyed-dash", "key_rate_limit") not in stuck

    client.force_login(make_user("root-flow", superuser=True))
    body = client.get(reverse("ops:dashboard")).content.decode()
    assert 'id="accs-flow"' in body and 'data-flow="rated-dash"' in body and "3/3 per 60 s" in body
    metrics._collector = metrics._registry = None
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(client.get("/metrics").content.decode()) for s in fam.samples}
    assert samples[("accs_rate_limit_starts_left", (("service", "rated-dash"),))] == 0
    assert samples[("accs_flow_waiting_tasks", (("limit", "rate_limit"), ("service", "rated-dash")))] == 2
    assert samples[("accs_flow_keys_at_limit", (("limit", "key_cap"), ("service", "keyed-dash")))] == 2
    assert samples[("accs_flow_waiting_tasks", (("limit", "key_cap"), ("service", "keyed-dash")))] == 2


@pytest.mark.django_db
def test_admin_service_form_puts_each_flow_problem_under_its_field(client):
    from django.urls import reverse

    from tests.ops.test_admin import SERVICE_FORM
    from tests.ops_helpers import make_user
    from workflows.models import Service

    client.force_login(make_user("root-flow-form", superuser=True))
    form = {**SERVICE_FORM, "params_schema": '{"type": "object", "properties": {"preset": {"type": "string"}}}'}
    response = client.post(reverse("admin:workflows_service_add"), {**form, "concurrency_key_limit": 2})
    errors = response.context["adminform"].form.errors
    assert any("name the params path" in e for e in errors["concurrency_key"]), errors
    assert not Service.objects.filter(key="render").exists()
    ok = client.post(reverse("admin:workflows_service_add"), {**form, "concurrency_key": "customer.id",
                                                             "concurrency_key_limit": 2})
    assert ok.status_code == 302
    assert Service.objects.get(key="render").concurrency_key_limit == 2


# --------------------------------------------------------------------------------------------
# The instant of a start, and limits read by the claim itself
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_claim_that_waited_for_the_service_lock_stamps_its_starts_after_the_lock_was_released(
        make_service, db_url):
    """A second connection holds the service's claim lock; the claim waits on it, then stamps its starts."""
    import threading

    import psycopg

    svc = make_service("rated-wait", rate_limit=3, rate_period_seconds=60, **KEYED)
    enqueue("rated-wait", ["a"] * 5)
    got: dict[str, object] = {}

    def claimer() -> None:
        try:
            got["tasks"] = claim(svc, agent="agent-wait")
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            got["error"] = exc
        finally:
            connection.close()

    with psycopg.connect(db_url, autocommit=False) as holder, psycopg.connect(db_url, autocommit=True) as watch:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{svc.id}"])
        thread = threading.Thread(target=claimer)
        thread.start()
        wait_for(lambda: watch.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                 .fetchone()[0] == 1, message="the claim waiting for the service lock")
        released_after = holder.execute("SELECT clock_timestamp()").fetchone()[0]
        holder.commit()
        thread.join(timeout=30)
    assert "error" not in got, got.get("error")
    assert len(got["tasks"]) == 3
    stamps = list(RateStart.objects.filter(service=svc).values_list("at", flat=True))
    assert len(stamps) == 3
    assert min(stamps) > released_after, "a start stamped before the claim held the lock"
    claimed = Task.objects.filter(service=svc, status="starting").values_list("claimed_at", flat=True)
    assert min(claimed) > released_after


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("before", "after", "expected"), [
    ({"concurrency_key": "customer", "concurrency_key_limit": 3}, {"concurrency_key_limit": 1}, {"a": 1, "b": 1}),
    ({"rate_key": "customer", "rate_key_limit": 3}, {"rate_key_limit": 1}, {"a": 1, "b": 1}),
    ({"rate_limit": 5}, {"rate_limit": 1}, {"a": 1}),
    ({"max_concurrent": 5}, {"max_concurrent": 2}, {"a": 2}),
    ({}, {"concurrency_key": "customer", "concurrency_key_limit": 1}, {"a": 1, "b": 1}),
], ids=["key-cap", "key-rate", "service-rate", "max-concurrent", "new-key-cap"])
def test_a_lowered_limit_applies_to_the_very_next_claim_even_with_the_agents_stale_service_spec(
        make_service, before, after, expected):
    from workflows.models import Service

    svc = make_service("lowered", **before, **KEYED)
    enqueue("lowered", ["a"] * 4 + ["b"] * 4)
    stale = service_spec(svc)  # what an agent's service cache holds
    Service.objects.filter(id=svc.id).update(**after)
    tasks = claim_many([stale], NODE, agent_id="agent-stale", free_slots=50, lease_seconds=60)
    assert customers_of(tasks) == expected


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("limit", ["concurrency", "rate"])
def test_the_keyed_claim_never_visits_the_keys_at_their_limit(make_service, limit):
    """With the head keys at their limit, the claim reads neither their tasks nor their rows: the database
    marks a full key's rows and the walk's index leaves them out; the keys it visits are probed one by one."""
    from django.db import transaction

    from jobs.claim import claim_statement

    fields = ({"concurrency_key": "customer", "concurrency_key_limit": 1} if limit == "concurrency"
              else {"rate_key": "customer", "rate_key_limit": 1})
    svc = make_service("keyed-once", **fields, **KEYED)
    # Two keys own the head of the backlog: 200 tasks a claim passes over once they are at their limit.
    enqueue("keyed-once", ["c0"] * 100 + ["c1"] * 100 + [f"x{i}" for i in range(50)])
    assert customers_of(claim(svc, 2)) == {"c0": 1, "c1": 1}, "each key's room (1), then the next key"
    with connection.cursor() as cur:
        cur.execute("ANALYZE accs_task")
        cur.execute("ANALYZE accs_rate_start")
    sql, params = claim_statement([(service_spec(svc), 10)], adjust={})
    params.update({"now": None, "hosts": [], "slots": 10, "cpu": 1000, "agent": "plan", "node": "plan",
                   "lease": 60.0, "pid": 1, "source": "plan", "exclude": []})
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cur.fetchone()[0]
        transaction.set_rollback(True)
    # The starts (accs_rate_start) and held counts are probed for the keys visited and the candidates
    # (at most 4 * 10 + 16 each); a filter that looked them up per task passed over would loop 198+
    # times. The sets of every full key (cused, rused) are not read at all.
    nodes = list(_plan_nodes(plan[0]["Plan"]))
    starts = [n["Actual Loops"] for n in nodes if n.get("Relation Name") == "accs_rate_start"]
    ctes = [(n["CTE Name"], n["Actual Loops"]) for n in nodes if n.get("CTE Name") in ("cused", "rused")]
    assert all(loops <= 4 * 10 + 16 for loops in starts), starts
    assert all(loops == 0 for _, loops in ctes), ctes
    # The two full keys' 198 queued tasks are never read: each key is passed over in its one row.
    read = sum(n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0) for n in nodes
               if n.get("Relation Name") == "accs_task" and n.get("Index Name") in ("task_claim_idx",
                                                                                     "task_limit_key_idx"))
    assert read <= 2 * 10 + 10, f"{read} queued tasks read for a claim of 10"
    rows = [n for n in nodes if n.get("Index Name") == "limit_key_head_order_idx"]
    assert rows and sum(n.get("Rows Removed by Filter", 0) for n in rows) == 0, "no full key's row visited"
    with connection.cursor() as cur:
        cur.execute("SELECT key FROM accs_limit_key_head WHERE service_id = %s AND (cap_full OR rate_until > now())"
                    " ORDER BY key", [svc.id])
        assert [k for (k,) in cur.fetchall()] == ["c0", "c1"], "the two full keys are marked"



@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("limit", ["concurrency", "rate"])
def test_a_keyed_claim_fills_its_room_from_as_many_keys_as_it_needs_over_a_grouped_backlog(make_service, limit):
    """Each key's tasks in one run: the claim takes each key's room (2) and moves on to the next key."""
    fields = ({"concurrency_key": "customer", "concurrency_key_limit": 2} if limit == "concurrency"
              else {"rate_key": "customer", "rate_key_limit": 2})
    svc = make_service("grouped", **fields, **KEYED)
    # A key's run (30) is longer than a scan window of the claim's room (4 * 10 + 16) can cross twice.
    enqueue("grouped", [f"k{i}" for i in range(8) for _ in range(30)])
    got = claim(svc, 10)
    assert customers_of(got) == {f"k{i}": 2 for i in range(5)}, "10 free slots: 5 keys with room for 2 each"
    seq = dict(Task.objects.values_list("id", "order_seq"))
    assert [seq[t.id] for t in got] == sorted(seq[t.id] for t in got), "claimed in the global order"
    assert customers_of(claim(svc, 10)) == {"k5": 2, "k6": 2, "k7": 2}, "the next claim goes on to the keys left"
    assert claim(svc, 10) == [], "every key is at its limit"


@pytest.mark.django_db(transaction=True)
def test_a_keyed_claim_walks_down_the_priorities_and_keeps_each_keys_room_for_its_first_tasks(make_service):
    """Across priorities: the highest first, a key's room to its tasks first in the order."""
    svc = make_service("prio", concurrency_key="customer", concurrency_key_limit=2, **KEYED)
    api.start_many([api.JobSpec(service="prio", params={"customer": c}, priority=p)
                    for c, p in [("a", 0)] * 3 + [("b", 0)] * 3 + [("b", 5), ("c", 9), ("a", 5), ("c", 9)]])
    transitions.start_due_jobs(limit=100)
    got = claim(svc, 5)
    prio = dict(Task.objects.values_list("id", "priority"))
    assert [(t.params["customer"], prio[t.id]) for t in got] == [("c", 9), ("c", 9), ("b", 5), ("a", 5), ("a", 0)]


@pytest.mark.django_db(transaction=True)
def test_two_keyed_services_claimed_together_count_each_ones_keys_apart(make_service):
    """The same key name in two services: full in one, it still has room in the other."""
    one = make_service("keyed-one", concurrency_key="customer", concurrency_key_limit=1, **KEYED)
    two = make_service("keyed-two", rate_key="customer", rate_key_limit=2, **KEYED)
    enqueue("keyed-one", ["a"] * 5 + ["b"])
    enqueue("keyed-two", ["a"] * 5 + ["b"])
    assert customers_of(claim(one, 1)) == {"a": 1}, "a is at its cap in keyed-one"
    got = claim_many([service_spec(one), service_spec(two)], NODE, agent_id="agent-fc", free_slots=10,
                     lease_seconds=60)
    assert sorted((t.service_key, t.params["customer"]) for t in got) == [
        ("keyed-one", "b"), ("keyed-two", "a"), ("keyed-two", "a"), ("keyed-two", "b")]

def _plan_nodes(node: dict):
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)
