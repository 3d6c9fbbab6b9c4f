"""Churn benchmark (``make bench-churn``): tasks flow through the engine while retention prunes them.

One-task jobs are bulk-started in chunks (``start_many`` + the builder's ``start_due_jobs``) so a
backlog of about ``CHURN_QUEUE`` tasks is always queued; this process claims and reports them in
batches through the real claim statement and report transaction, as an agent does (every
transition and event written). Meanwhile a second thread runs the retention prune
(``jobs.retention.prune_finished_jobs``, the builder duty's function) continuously, in batches of
``ACC_RETENTION_BATCH``, with a retention of ``CHURN_RETENTION_SEC`` seconds: the tenant keeps jobs
one day and the pruner's clock runs one day minus that many seconds ahead of PostgreSQL's.

Printed and written to bench/results/churn.json:

* ``claim_rate_start`` / ``claim_rate_end``: tasks claimed and reported per second of claim +
  report time over the first and the last 10 % of the tasks (the table bloat shows here);
* ``wall_rate``: tasks per second over the whole run, enqueue and instantiation included;
* ``sizes_start`` / ``sizes_end``: bytes of accs_task, accs_job, accs_attempt and accs_job_step
  (``pg_total_relation_size``, ``pg_relation_size``, ``pg_indexes_size``, with live and dead row
  estimates) when the first 10 % are done and when the last task is reported; with pruning
  keeping pace, the live rows stay at about the queue plus the retention's worth and the sizes
  level off (the timeline, archived by month, grows: it is shown for scale);
* ``pruned``: rows the prune deleted by the end (jobs, tasks, attempts, steps), and its passes;
* ``timeline``: the timeline's bytes (table and indexes) and rows per task at the end, every event of
  the run counted (its jobs' moves and the claims included).

``CHURN_HOLD_SNAPSHOT=1`` holds one REPEATABLE READ transaction open on a second connection for
the whole run (it read ``accs_job`` once, as a long report query would): vacuum cannot remove the
rows that die after its snapshot, so the claim must not slow down with the dead rows the run leaves
behind (the indexes it reads hold live work only). ``hold_snapshot`` in the results says which run
it was.

Environment: CHURN_TASKS (2,000,000: about an hour of a busy fleet), CHURN_SHORT=1 (20,000, a smoke
test), CHURN_QUEUE (20,000), CHURN_CLAIM_BATCH (64), CHURN_RETENTION_SEC (30; 5 in the short run),
CHURN_HOLD_SNAPSHOT, CHURN_OUT (the results' file in bench/results, churn.json). It runs on the
database of ACC_DB_URL and empties the engine's tables first, as ``make bench`` does.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
os.environ.setdefault("ACC_LOG_LEVEL", "WARNING")

from django.db import connection  # noqa: E402

from accs_site.clock import db_now  # noqa: E402
from accs_site.conf import accs  # noqa: E402
from bench import run as bench  # noqa: E402  (sets Django up)
from jobs import api, transitions  # noqa: E402
from jobs.claim import NodeLimits, ServiceSpec, claim_many  # noqa: E402
from jobs.retention import prune_finished_jobs  # noqa: E402
from tenants.models import Tenant  # noqa: E402
from workflows.models import Service  # noqa: E402

SHORT = os.environ.get("CHURN_SHORT") == "1"
TASKS = int(os.environ.get("CHURN_TASKS", "20000" if SHORT else "2000000"))
QUEUE = int(os.environ.get("CHURN_QUEUE", "20000"))
CLAIM_BATCH = int(os.environ.get("CHURN_CLAIM_BATCH", "64"))
HOLD_SNAPSHOT = os.environ.get("CHURN_HOLD_SNAPSHOT") == "1"
RETENTION_SEC = float(os.environ.get("CHURN_RETENTION_SEC", "5" if SHORT else "30"))
TABLES = ("accs_task", "accs_job", "accs_attempt", "accs_job_step")
SIZES_SQL = ("SELECT pg_total_relation_size(%(t)s::regclass), pg_relation_size(%(t)s::regclass),"
             " pg_indexes_size(%(t)s::regclass), s.n_live_tup, s.n_dead_tup"
             "  FROM pg_stat_user_tables s WHERE s.relid = %(t)s::regclass")

# The timeline is partitioned: its size is the sum of its partitions'.
EVENT_SIZES_SQL = """
SELECT sum(pg_total_relation_size(p.relid))::bigint, sum(pg_relation_size(p.relid))::bigint,
       sum(pg_indexes_size(p.relid))::bigint, sum(s.n_live_tup)::bigint, sum(s.n_dead_tup)::bigint
  FROM pg_partition_tree('accs_event') p JOIN pg_stat_user_tables s ON s.relid = p.relid WHERE p.isleaf
"""


def sizes() -> dict[str, dict[str, int]]:
    """Return the on-disk sizes of the churning tables (and of the timeline, for scale).

    Live and dead rows are the statistics collector's estimates, for reading the sizes.
    """
    out = {}
    with connection.cursor() as cur:
        for table in TABLES:
            cur.execute(SIZES_SQL, {"t": table})
            total, heap, indexes, live, dead = cur.fetchone()
            out[table] = {"total_bytes": total, "table_bytes": heap, "indexes_bytes": indexes,
                          "live_rows": live, "dead_rows": dead}
        cur.execute(EVENT_SIZES_SQL)
        out["accs_event"] = dict(zip(("total_bytes", "table_bytes", "indexes_bytes", "live_rows", "dead_rows"),
                                     cur.fetchone(), strict=True))
    return out


class Pruner(threading.Thread):
    """Run the retention prune continuously, as the builder's duty would with a short retention."""

    def __init__(self) -> None:
        super().__init__(name="churn-pruner", daemon=True)
        self.stopping = threading.Event()
        self.totals = {"jobs": 0, "tasks": 0, "attempts": 0, "steps": 0, "passes": 0}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                with connection.cursor() as cur:
                    ahead = db_now(cur) + timedelta(days=1) - timedelta(seconds=RETENTION_SEC)
                result = prune_finished_jobs(limit=accs.retention_batch, now=ahead, export=False)
                for name in ("jobs", "tasks", "attempts", "steps"):
                    self.totals[name] += getattr(result, name)
                self.totals["passes"] += 1
                if result.jobs < accs.retention_batch:
                    self.stopping.wait(1.0)  # caught up: the duty's next tick
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            connection.close()


class SnapshotHolder:
    """A second connection in one REPEATABLE READ transaction from start to end (vacuum's horizon)."""

    def __init__(self) -> None:
        import psycopg

        wanted = ("dbname", "user", "password", "host", "port")
        params = {k: v for k, v in connection.get_connection_params().items() if k in wanted}
        self.conn = psycopg.connect(**params, application_name="churn-snapshot", autocommit=True)
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        self.conn.execute("SELECT 1 FROM accs_job LIMIT 1")  # takes the snapshot, and holds it

    def close(self) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()


def enqueue(n: int) -> None:
    api.start_many([api.JobSpec(service="bench-noop", params={"n": i}) for i in range(n)])
    while transitions.start_due_jobs(limit=5000):
        pass


def rate(batches: list[tuple[int, float]]) -> float:
    done = sum(n for n, _ in batches)
    return done / sum(dt for _, dt in batches)


def window(batches: list[tuple[int, float]], share: float, *, last: bool) -> list[tuple[int, float]]:
    """Return the batches covering the first (or last) ``share`` of the tasks."""
    wanted, picked, seen = share * sum(n for n, _ in batches), [], 0
    for batch in (reversed(batches) if last else batches):
        if seen >= wanted:
            break
        picked.append(batch)
        seen += batch[0]
    return picked


def churn() -> dict[str, object]:
    svc = Service.objects.get(key="bench-noop")
    spec = ServiceSpec(svc.id, svc.key, svc.cpu_weight, svc.max_concurrent, svc.exclusive_per_host)
    limits = NodeLimits("bench-churn", slot_cap=10_000, cpu_budget=100_000, per_service={})
    batches: list[tuple[int, float]] = []
    produced = done = 0
    sizes_start: dict | None = None
    enqueue(min(QUEUE, TASKS))  # the first backlog, with fresh statistics, as a running system has
    produced = min(QUEUE, TASKS)
    bench.settle()
    holder = SnapshotHolder() if HOLD_SNAPSHOT else None
    pruner = Pruner()
    pruner.start()
    started = time.perf_counter()
    next_note = started + 10
    try:
        while done < TASKS:
            if produced - done < QUEUE // 2 and produced < TASKS:
                chunk = min(QUEUE, TASKS - produced)
                enqueue(chunk)
                produced += chunk
            t0 = time.perf_counter()
            claimed = claim_many([spec], limits, agent_id="bench-churn", free_slots=CLAIM_BATCH, lease_seconds=600)
            transitions.report(
                [transitions.Outcome(task_id=t.id, attempt=t.attempt, status="succeeded", results={}) for t in claimed],
                started=[(t.id, t.attempt, None) for t in claimed], agent_id="bench-churn", source="bench:churn",
            )
            batches.append((len(claimed), time.perf_counter() - t0))
            done += len(claimed)
            if not claimed and produced >= TASKS:
                raise RuntimeError(f"nothing left to claim after {done} of {TASKS} tasks")
            if sizes_start is None and done >= TASKS // 10:
                sizes_start = sizes()
            if pruner.error is not None:
                raise RuntimeError("the pruner failed") from pruner.error
            if time.perf_counter() > next_note:
                next_note += 10
                bench.say(f"  {done:,}/{TASKS:,} tasks, {pruner.totals['jobs']:,} jobs pruned, "
                          f"{done / (time.perf_counter() - started):,.0f} tasks/s")
        wall = time.perf_counter() - started
        sizes_end = sizes()
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM accs_event")
            event_rows = cur.fetchone()[0]
    finally:
        pruner.stopping.set()
        pruner.join(timeout=120)
        if holder is not None:
            holder.close()
    return {
        "tasks": TASKS,
        "hold_snapshot": HOLD_SNAPSHOT,
        "claim_rate_start": round(rate(window(batches, 0.1, last=False)), 1),
        "claim_rate_end": round(rate(window(batches, 0.1, last=True)), 1),
        "wall_rate": round(TASKS / wall, 1),
        "wall_seconds": round(wall, 1),
        "sizes_start": sizes_start,
        "sizes_end": sizes_end,
        "pruned": dict(pruner.totals),
        # The timeline a task leaves (every event of the run, its jobs' included, per task); with indexes.
        "timeline": {"bytes_per_task": round(sizes_end["accs_event"]["total_bytes"] / TASKS),
                     "rows_per_task": round(event_rows / TASKS, 2)},
    }


def show(results: dict) -> None:
    bench.say(f"  claim rate, first 10 %   {results['claim_rate_start']:>10,.1f} tasks/s")
    bench.say(f"  claim rate, last 10 %    {results['claim_rate_end']:>10,.1f} tasks/s"
              f" ({results['claim_rate_end'] / results['claim_rate_start']:.0%} of the start)")
    bench.say(f"  overall (with enqueue)   {results['wall_rate']:>10,.1f} tasks/s"
              f" over {results['wall_seconds']:,.0f} s")
    bench.say(f"  pruned                   {results['pruned']}")
    bench.say(f"  timeline per task        {results['timeline']['bytes_per_task']:>10,} bytes with indexes,"
              f" {results['timeline']['rows_per_task']:g} rows")
    bench.say("  sizes MB (total / table / indexes), after the first 10 % → at the end:")
    for table in results["sizes_end"]:
        a, b = results["sizes_start"][table], results["sizes_end"][table]
        bench.say(f"    {table:<14} {_mb(a):>20} → {_mb(b):<20} live rows {a['live_rows']:,} → {b['live_rows']:,}")


def _mb(size: dict[str, int]) -> str:
    return "/".join(f"{size[k] / 1e6:.1f}" for k in ("total_bytes", "table_bytes", "indexes_bytes"))


def main() -> int:
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    bench.define_services()
    bench.reset()
    Tenant.objects.filter(slug="default").update(retention_days=1)
    bench.settle()
    bench.say(f"ACCS churn benchmark: {TASKS:,} tasks, queue {QUEUE:,}, claim batch {CLAIM_BATCH}, "
              f"retention {RETENTION_SEC:g} s, prune batch {accs.retention_batch}"
              + (", one REPEATABLE READ snapshot held throughout" if HOLD_SNAPSHOT else ""))
    try:
        results = churn()
    finally:
        Tenant.objects.filter(slug="default").update(retention_days=None)
    results["meta"] = {"cores": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "queue": QUEUE, "claim_batch": CLAIM_BATCH, "retention_sec": RETENTION_SEC}
    show(results)
    bench.OUT.mkdir(parents=True, exist_ok=True)
    name = os.environ.get("CHURN_OUT", "churn.json")
    (bench.OUT / name).write_text(json.dumps(results, indent=2))
    bench.say(f"written {bench.OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
