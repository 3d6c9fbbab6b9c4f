"""ACCS benchmarks (``make bench``): print figures and write bench/results/latest.json.

Keys: drain_tps_1_agent, drain_tps_2_agents (20,000 queued no-op ``python`` tasks drained by 1 or 2
``runagent`` processes; rate from the first attempt start to the last task finish, both read from
the database, as the peer benchmarks do), e2e_jobs_per_s (one-task jobs bulk-created, instantiated
by a running builder and run to done by two agents), enqueue_rate_single / enqueue_rate_bulk
(one-task jobs/s through the Python API, one by one and with start_many), pickup_p50_ms /
pickup_p95_ms (enqueue → task body, 200 jobs 50 ms apart into an idle agent),
claim_ms_p50_at_10k / _100k / _1m (one claim of 10 tasks with that many queued, 10 % in backoff and
10 % bound to another node's host at the head of the order), fanout_1000_instantiate_s /
fanout_1000_complete_s (a job fanning out over 1,000 hosts into a second 1,000-host fan-out: the start call,
and the job's start to its end with two agents).

Every claim, transition and event is written as in production. Environment: BENCH_N (20000),
BENCH_REPS (1), BENCH_LAT_JOBS (200), BENCH_LAT_GAP (0.05), BENCH_FANOUT_HOSTS (1000),
BENCH_CLAIM_SIZES (10000,100000,1000000), BENCH_SCALE_AGENTS (100; 0 skips), BENCH_SCALE_SLOTS (20),
BENCH_SCALE_SECONDS (60), BENCH_SCALE_CAP (1500), BENCH_FLEET_RATE (100).

enqueue_rate_single_atomic: 20,000 start_service calls inside one atomic(). fleet_100_agents_*:
100 simulated agent processes x 20 slots (bench/scale.py's worker) at an offered load of
BENCH_FLEET_RATE tasks/s, below saturation, straight to PostgreSQL and through PgBouncer in
transaction mode (bench/fleet.py): claim and pick-up p50/p95, server connections, the peak of held
tasks sampled every 20 ms against a cap of 1,500, and tasks claimed twice.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from jobs import api, transitions  # noqa: E402
from workflows.api import save_service  # noqa: E402

N = int(os.environ.get("BENCH_N", "20000"))
REPS = int(os.environ.get("BENCH_REPS", "1"))
LAT_JOBS = int(os.environ.get("BENCH_LAT_JOBS", "200"))
LAT_GAP = float(os.environ.get("BENCH_LAT_GAP", "0.05"))
FANOUT_HOSTS = int(os.environ.get("BENCH_FANOUT_HOSTS", "1000"))
SCALE_AGENTS = int(os.environ.get("BENCH_SCALE_AGENTS", "100"))
SCALE_SLOTS = int(os.environ.get("BENCH_SCALE_SLOTS", "20"))
SCALE_SECONDS = float(os.environ.get("BENCH_SCALE_SECONDS", "60"))
SCALE_CAP = int(os.environ.get("BENCH_SCALE_CAP", "1500"))
FLEET_RATE = float(os.environ.get("BENCH_FLEET_RATE", "100"))  # offered tasks/s: 200 saturates 2 cores
OUT = ROOT / "bench" / "results"


def say(text: str) -> None:
    print(text, flush=True)


def reset() -> None:
    with connection.cursor() as cur:
        # (The keyed claim's key rows and held counts too: a TRUNCATE fires no trigger to keep them.)
        cur.execute("TRUNCATE accs_job, accs_task, accs_attempt, accs_event, accs_artifact, accs_start,"
                    " accs_limit_key_head, accs_limit_key_held CASCADE")
        cur.execute("DELETE FROM accs_disk_sample"
                    " WHERE node_id LIKE 'bench-%%' OR node_id LIKE 'e2e-%%' OR node_id = 'lat'")
        cur.execute("DELETE FROM accs_host WHERE name LIKE 'fan-h%%'")
        cur.execute("DELETE FROM accs_node WHERE name LIKE 'bench-%%' OR name LIKE 'e2e-%%' OR name = 'lat'")
        cur.execute("CHECKPOINT")


def settle() -> None:
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE accs_task")
        cur.execute("VACUUM ANALYZE accs_job")
        cur.execute("CHECKPOINT")


def spawn(*args: str, env: dict | None = None) -> subprocess.Popen:
    log_dir = ROOT / ".local" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{args[0]}-{args[2] if len(args) > 2 else ''}-{time.time_ns()}.log", "w")
    return subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT,
                            # No-op tasks weigh nothing: give the bench nodes room for large claim batches.
                            env={**os.environ, "ACC_LOG_LEVEL": "WARNING", "ACC_CPU_BUDGET": "1000",
                                 "ACC_SLOT_CAP": "1000", **(env or {})})


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def progress_wait(label: str, total: int, done_sql: str, timeout: float = 600) -> None:
    start = time.monotonic()
    last = -1
    while True:
        with connection.cursor() as cur:
            cur.execute(done_sql)
            done = cur.fetchone()[0]
        if done != last and (time.monotonic() - start) > 1:
            if sys.stdout.isatty():
                sys.stdout.write(f"\r  {label}: {done}/{total}   ")
                sys.stdout.flush()
            last = done
        if done >= total:
            if sys.stdout.isatty():
                sys.stdout.write("\r" + " " * 60 + "\r")
            return
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"{label}: only {done}/{total} after {timeout}s")
        time.sleep(0.2)


def make_tasks(n: int, service: str = "bench-noop") -> None:
    """Queue ``n`` one-task jobs as tasks (admitted, or widened when they were narrow starts)."""
    from jobs.narrow import widen_aged

    api.start_many([api.JobSpec(service=service, params={"n": i}) for i in range(n)])
    while transitions.start_due_jobs(limit=5000) or widen_aged(after_seconds=0, limit=5000):
        pass


def drain(agents: int) -> float:
    reset()
    make_tasks(N)
    settle()
    procs = [spawn("runagent", "--node", f"bench-{i}", "--services", "bench-noop", "--max-concurrent", "64",
                   "--claim-batch", "64", "--once") for i in range(agents)]
    progress_wait(f"drain {agents} agent(s)", N, "SELECT count(*) FROM accs_task WHERE status = 'done'")
    for p in procs:
        p.wait(timeout=60)
    with connection.cursor() as cur:
        cur.execute("SELECT extract(epoch FROM max(t.finished_at) - min(a.started_at)),"
                    " count(*) FILTER (WHERE t.status = 'done')"
                    " FROM accs_task t JOIN accs_attempt a ON a.task_id = t.id")
        seconds, done = cur.fetchone()
    return done / float(seconds)


def e2e() -> float:
    reset()
    procs = [spawn("runbuilder", "--tick", "0.2", "--batch", "1000")] + [
        spawn("runagent", "--node", f"e2e-{i}", "--services", "bench-noop",
              "--max-concurrent", "64", "--claim-batch", "64")
        for i in range(2)]
    time.sleep(3)
    n = N // 2
    try:
        api.start_many([api.JobSpec(service="bench-noop", params={"n": i}) for i in range(n)])
        progress_wait("end to end", n, "SELECT count(*) FROM accs_job WHERE status = 'done'")
    finally:
        stop(procs)
    with connection.cursor() as cur:
        cur.execute("SELECT extract(epoch FROM max(finished_at) - min(created_at)) FROM accs_job")
        seconds = float(cur.fetchone()[0])
    return n / seconds


def enqueue_single(n: int = 2000) -> float:
    reset()
    start = time.perf_counter()
    for i in range(n):
        api.start_service("bench-noop", params={"n": i})
    return n / (time.perf_counter() - start)


def enqueue_single_atomic(n: int = 20_000) -> float:
    """One start_service call per job, all inside one atomic() (a view or a loop in a transaction)."""
    from django.db import transaction

    reset()
    start = time.perf_counter()
    with transaction.atomic():
        for i in range(n):
            api.start_service("bench-noop", params={"n": i})
    return n / (time.perf_counter() - start)


def enqueue_bulk() -> float:
    reset()
    specs = [api.JobSpec(service="bench-noop", params={"n": i}) for i in range(N)]
    start = time.perf_counter()
    api.start_many(specs)
    return N / (time.perf_counter() - start)


def pickup() -> tuple[float, float]:
    reset()
    procs = [spawn("runbuilder", "--tick", "1"), spawn("runagent", "--node", "lat", "--services", "bench-stamp",
                                                     "--max-concurrent", "4", env={"ACC_POLL_INTERVAL_SEC": "5"})]
    time.sleep(3)
    try:
        for _ in range(LAT_JOBS):
            api.start_service("bench-stamp", params={"t0": time.time()})
            time.sleep(LAT_GAP)
        progress_wait("pick-up", LAT_JOBS, "SELECT count(*) FROM accs_job WHERE status = 'done'")
    finally:
        stop(procs)
    with connection.cursor() as cur:
        cur.execute("SELECT (results->>'latency_ms')::float FROM accs_task WHERE results ? 'latency_ms'")
        lat = sorted(r[0] for r in cur.fetchall())
    q = statistics.quantiles(lat, n=100)
    return q[49], q[94]


def fanout(n: int = FANOUT_HOSTS) -> tuple[float, float]:
    """Return (instantiate, complete) seconds of a job fanning out over ``n`` hosts into a second fan-out.

    Instantiation is timed around the start call (one transaction); completion from the job's
    start to its end, both from the database, with two agents serving the hosts' two nodes.
    """
    from nodes.models import Host, Node
    from workflows.api import create_workflow
    from workflows.models import Workflow

    reset()
    for i in range(2):
        # The nodes' own limits are what agents claim under (a node row's limits win over the agent's
        # environment): as wide as the agents below, or each node runs 8 tasks at a time (the default).
        Node.objects.update_or_create(name=f"bench-{i}", defaults={"slot_cap": 1000, "cpu_budget": 1000})
    names = [f"fan-h{i}" for i in range(n)]
    Host.objects.bulk_create([Host(name=name, node_id=f"bench-{i % 2}") for i, name in enumerate(names)])
    if not Workflow.objects.filter(name="bench-fan").exists():
        create_workflow(name="bench-fan", steps=[
            {"key": "a", "service": "bench-noop", "depends_on": [], "fan_out": "hosts"},
            {"key": "b", "service": "bench-noop", "depends_on": ["a"], "fan_out": "hosts"}])
    start = time.perf_counter()
    job = api.start_workflow("bench-fan", options={"hosts": names})
    instantiate = time.perf_counter() - start
    procs = [spawn("runagent", "--node", f"bench-{i}", "--services", "bench-noop", "--max-concurrent", "64",
                   "--claim-batch", "64") for i in range(2)]
    try:
        progress_wait("fan-out", 1, f"SELECT count(*) FROM accs_job WHERE id = '{job.id}' AND status = 'done'")
    finally:
        stop(procs)
    with connection.cursor() as cur:
        cur.execute("SELECT extract(epoch FROM finished_at - started_at) FROM accs_job WHERE id = %s", [job.id])
        complete = float(cur.fetchone()[0])
    return instantiate, complete


CLAIM_SIZES = [int(x) for x in os.environ.get("BENCH_CLAIM_SIZES", "10000,100000,1000000").split(",")]


def _fill_queue(n: int) -> None:
    """Queue ``n`` tasks with backoff and other nodes' host-bound work at the head (bench.fixtures)."""
    from bench.fixtures import fill_queue
    from nodes.models import Host, Node

    reset()
    Node.objects.get_or_create(name="bench-other")
    host = Host.objects.create(name="fan-h-other", node_id="bench-other")
    with connection.cursor() as cur:
        cur.execute("SELECT id FROM accs_tenant WHERE slug = 'default'")
        tenant = cur.fetchone()[0]
        cur.execute("SELECT id FROM accs_service WHERE key = 'bench-noop'")
        fill_queue(cur, n=n, tenant_id=tenant, service_id=cur.fetchone()[0], other_host_id=host.id)
    settle()


def claim_cost(n: int, claims: int = 50) -> float:
    """Return the median ms of one claim of 10 tasks with ``n`` tasks queued (see :func:`_fill_queue`)."""
    from jobs.claim import NodeLimits, claim_many, service_spec
    from workflows.models import Service

    _fill_queue(n)
    svc = Service.objects.get(key="bench-noop")
    spec = service_spec(svc)
    limits = NodeLimits("bench-claim", slot_cap=10_000, cpu_budget=100_000, per_service={})
    times = []
    for _ in range(claims):
        start = time.perf_counter()
        got = claim_many([spec], limits, agent_id="bench", free_slots=10, lease_seconds=600)
        times.append((time.perf_counter() - start) * 1000)
        assert len(got) == 10, len(got)
    return statistics.median(times)


def median_of(fn, reps: int) -> tuple[float, list[float]]:
    runs = [fn() for _ in range(reps)]
    return statistics.median(runs), runs


def define_services() -> None:
    save_service(key="bench-noop", executor="python", executor_config={"callable": "bench.tasks:noop"},
                 params_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
    save_service(key="bench-stamp", executor="python", executor_config={"callable": "bench.tasks:stamp"},
                 params_schema={"type": "object", "properties": {"t0": {"type": "number"}}})


def main() -> int:
    call_command("migrate", verbosity=0)
    define_services()
    say(f"ACCS benchmarks: N={N}, reps={REPS}, {os.cpu_count()} cores, Python {platform.python_version()}")
    results: dict[str, object] = {}
    runs: dict[str, list[float]] = {}
    for key, fn in [("enqueue_rate_single", enqueue_single), ("enqueue_rate_single_atomic", enqueue_single_atomic),
                    ("enqueue_rate_bulk", enqueue_bulk),
                    ("drain_tps_1_agent", lambda: drain(1)), ("drain_tps_2_agents", lambda: drain(2)),
                    ("e2e_jobs_per_s", e2e)]:
        value, all_runs = median_of(fn, REPS)
        results[key], runs[key] = round(value, 1), [round(r, 1) for r in all_runs]
        say(f"  {key:<22} {value:>10,.1f}   runs {runs[key]}")
    p50, p95 = pickup()
    results["pickup_p50_ms"], results["pickup_p95_ms"] = round(p50, 2), round(p95, 2)
    say(f"  {'pickup_p50_ms':<22} {p50:>10.2f}")
    say(f"  {'pickup_p95_ms':<22} {p95:>10.2f}")
    for size in CLAIM_SIZES:
        label = f"claim_ms_p50_at_{size // 1000}k" if size < 1_000_000 else f"claim_ms_p50_at_{size // 1_000_000}m"
        results[label] = round(claim_cost(size), 3)
        say(f"  {label:<22} {results[label]:>10.3f}")
    inst, complete = fanout()
    results["fanout_1000_instantiate_s"], results["fanout_1000_complete_s"] = round(inst, 3), round(complete, 3)
    say(f"  {'fanout_1000_instantiate_s':<22} {inst:>10.3f}")
    say(f"  {'fanout_1000_complete_s':<22} {complete:>10.3f}")
    if SCALE_AGENTS:
        # The fleet at an offered load below saturation, direct and through PgBouncer (bench/fleet.py),
        # in place of the saturated run every slot raced in.
        from bench.fleet import run_mode

        s = connection.settings_dict
        direct_url = f"postgres://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"
        for mode in ("direct", "pgbouncer"):
            figures = run_mode(mode, agents=SCALE_AGENTS, slots=SCALE_SLOTS, rate=FLEET_RATE, seconds=SCALE_SECONDS,
                               cap=SCALE_CAP, direct_url=direct_url)
            say(f"  fleet {SCALE_AGENTS} agents x {SCALE_SLOTS} slots at {FLEET_RATE:g} tasks/s, {mode}: {figures}")
            for name, value in figures.items():
                if name != "mode":
                    results[f"fleet_{SCALE_AGENTS}_agents_{mode}_{name}"] = value
        reset()
    results["runs"] = runs
    results["meta"] = {"n": N, "reps": REPS, "cores": os.cpu_count(), "python": platform.python_version(),
                       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "latest.json").write_text(json.dumps(results, indent=2))
    reset()
    say(f"written {OUT / 'latest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
