"""Django's Tasks framework on ACCS, measured as bench-peers measures django-tasks' database backend.

``python bench/tasks_api.py`` (after ``make db`` and ``manage.py migrate``) prints and writes
bench/results/tasks_api.json:

* enqueue_one_by_one: ``noop.enqueue(n=i)`` x BENCH_TASKS_N (2,000), autocommit (jobs/s);
* pickup_thread_p50_ms / _p95_ms: BENCH_LAT_JOBS (100) tasks BENCH_LAT_GAP (50 ms) apart into one idle
  agent (4 slots), enqueue -> task body, with ``isolation="thread"``;
* pickup_process_p50_ms / _p95_ms: the same with the default process isolation, BENCH_LAT_JOBS_PROCESS
  (200) tasks BENCH_LAT_GAP_PROCESS (50 ms) apart: each attempt forks from its service's warm parent
  (docs/executors.md, "The warm pool").
  With ``ACC_WARM_POOL_SIZE=0`` each attempt starts an interpreter and sets Django up instead, and tasks
  50 ms apart queue behind each other (the figure then measures that backlog).

Before each pick-up run one task is enqueued alone and waited for (pickup_*_first_ms): it pays the
agent's start and, for process isolation, its warm parent's. BENCH_TASKS_PARTS
(``enqueue,thread,process``) chooses what runs.
django-tasks' figures are read from bench-peers' results folder (BENCH_PEERS_DIR): its stored results
when run alone, the same session's when ``make bench-compare`` runs this after the peers.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import LAT_GAP, OUT, progress_wait, reset, say, spawn, stop  # noqa: E402, I001  (sets Django up)

from django.db import connection  # noqa: E402

from bench import task_funcs  # noqa: E402
from jobs.tasks_backend import task_backends  # noqa: E402

N = int(os.environ.get("BENCH_TASKS_N", "2000"))
LAT_JOBS = int(os.environ.get("BENCH_LAT_JOBS", "100"))
LAT_JOBS_PROCESS = int(os.environ.get("BENCH_LAT_JOBS_PROCESS", "200"))
LAT_GAP_PROCESS = float(os.environ.get("BENCH_LAT_GAP_PROCESS", "0.05"))
PARTS = set(os.environ.get("BENCH_TASKS_PARTS", "enqueue,thread,process").split(","))
ROOT = Path(__file__).resolve().parent.parent
# The main checkout sits beside shared/, a worktree two levels below it.
PEERS = Path(os.environ.get("BENCH_PEERS_DIR") or next(
    (p for p in (ROOT.parent / "shared" / "bench-peers", ROOT.parent.parent / "shared" / "bench-peers")
     if p.exists()),
    ROOT.parent / "shared" / "bench-peers"))


def enqueue_one_by_one() -> float:
    reset()
    task_funcs.noop.enqueue(n=-1)  # the service is created by the first enqueue, outside the timing
    start = time.perf_counter()
    for i in range(N):
        task_funcs.noop.enqueue(n=i)
    return N / (time.perf_counter() - start)


def pickup(stamp_task, *, jobs: int, gap: float) -> tuple[float, float, float]:
    """Return the pick-up p50 and p95 of ``jobs`` tasks ``gap`` seconds apart, and the first task's.

    The first task is enqueued alone once the agent runs and waited for: it pays the agent's start
    (and, for process isolation, its warm parent's start); the p50 and p95 are the idle agent's.
    """
    reset()
    key = task_backends["default"].ensure_service(stamp_task).key
    procs = [spawn("runagent", "--node", "lat", "--services", key, "--max-concurrent", "4",
                   env={"ACC_POLL_INTERVAL_SEC": "5"})]
    time.sleep(3)  # the agent connects and listens
    try:
        first_result = stamp_task.enqueue(time.time())
        progress_wait("first task", 1, "SELECT count(*) FROM accs_job WHERE status IN ('done', 'error')")
        for _ in range(jobs):
            stamp_task.enqueue(time.time())
            time.sleep(gap)
        progress_wait("pick-up", jobs + 1, "SELECT count(*) FROM accs_job WHERE status IN ('done', 'error')")
    finally:
        stop(procs)
    with connection.cursor() as cur:
        cur.execute("SELECT job_id::text, (results->>'return_value')::float FROM accs_task"
                    " WHERE results ? 'return_value'")
        found = dict(cur.fetchall())
    first = found.pop(first_result.id)
    q = statistics.quantiles(sorted(found.values()), n=100)
    if len(found) < jobs:
        say(f"  {jobs - len(found)} of {jobs} tasks returned no latency (failed)")
    return q[49], q[94], first


def peer(path: tuple[str, ...]) -> float | None:
    try:
        data = json.loads((PEERS / "results" / "django_tasks.json").read_text())
    except OSError:
        return None
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def main() -> int:
    doc: dict = {"n": N, "lat_jobs": LAT_JOBS, "lat_gap": LAT_GAP, "lat_jobs_process": LAT_JOBS_PROCESS,
                 "lat_gap_process": LAT_GAP_PROCESS}
    if "enqueue" in PARTS:
        doc["enqueue_one_by_one"] = round(enqueue_one_by_one(), 1)
        say(f"enqueue one by one: {doc['enqueue_one_by_one']} jobs/s")
    for name, stamp_task, jobs, gap in (("thread", task_funcs.stamp_thread, LAT_JOBS, LAT_GAP),
                                        ("process", task_funcs.stamp, LAT_JOBS_PROCESS, LAT_GAP_PROCESS)):
        if name not in PARTS:
            continue
        p50, p95, first = pickup(stamp_task, jobs=jobs, gap=gap)
        doc[f"pickup_{name}_p50_ms"], doc[f"pickup_{name}_p95_ms"] = round(p50, 1), round(p95, 1)
        doc[f"pickup_{name}_first_ms"] = round(first, 1)
        say(f"pick-up ({name}): p50 {p50:.1f} ms, p95 {p95:.1f} ms, first task {first:.1f} ms")
    doc["django_tasks"] = {"enqueue_one_by_one": peer(("enqueue", "one_by_one", "median")),
                           "pickup_p50_ms": peer(("latency", "p50_ms")), "pickup_p95_ms": peer(("latency", "p95_ms")),
                           "source": str(PEERS / "results" / "django_tasks.json")}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tasks_api.json").write_text(json.dumps(doc, indent=2) + "\n")
    say(json.dumps(doc["django_tasks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
