"""Where pick-up time goes: an agent traced from the outside, then the breakdown per task.

    python bench/trace_pickup.py          (BENCH_LAT_JOBS jobs, 200; BENCH_LAT_GAP seconds apart, 0.05)

Runs ``bench/run.py``'s pick-up (an idle agent, one ``bench-stamp`` job every ``gap`` seconds) with an
agent whose functions are wrapped (nothing in the agent's code changes, so the same tracer runs on
any checkout): the wake-up (select returning), each statement the claim sends, the claim's return,
the hand-over to the worker thread, the executor starting, the body's first line (from the task's
result), and the running report. Prints the median and p95 of each interval.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / ".local" / "bench" / "pickup-trace.jsonl"


def agent_main(argv: list[str]) -> None:
    """Run ``runagent`` with tracing wrappers; every mark goes to TRACE as a JSON line."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
    import threading

    import django

    django.setup()
    from django.core.management import call_command
    from django.db.backends.utils import CursorWrapper

    from jobs import claim as claim_mod
    from nodes import agent as agent_mod
    from nodes.executors import python as python_exec

    out = open(TRACE, "a", buffering=1)
    lock = threading.Lock()
    state: dict = {"cycle": None}

    def mark(name: str, **data) -> None:
        with lock:
            out.write(json.dumps({"t": time.time(), "mark": name, **data}) + "\n")

    original_wait = agent_mod.Agent._wait

    def traced_wait(self):
        original_wait(self)
        mark("woke")

    agent_mod.Agent._wait = traced_wait

    original_claim_round = claim_mod.claim_round

    def traced_claim_round(*args, **kwargs):
        mark("claim_call")
        answer = original_claim_round(*args, **kwargs)
        mark("claim_return", tasks=[str(t.id) for t in answer.tasks])
        return answer

    agent_mod.claim_round = traced_claim_round

    original_execute = CursorWrapper.execute

    def traced_execute(self, sql, params=None):
        if threading.current_thread() is not threading.main_thread():
            return original_execute(self, sql, params)
        mark("sql_send", sql=" ".join(str(sql).split())[:60])
        try:
            return original_execute(self, sql, params)
        finally:
            mark("sql_done")

    CursorWrapper.execute = traced_execute

    original_submit = agent_mod.ThreadPoolExecutor.submit

    def traced_submit(self, fn, *args, **kwargs):
        mark("submit")
        return original_submit(self, fn, *args, **kwargs)

    agent_mod.ThreadPoolExecutor.submit = traced_submit

    original_run = python_exec.PythonExecutor.run

    def traced_run(self, task, ctx):
        mark("exec_start", task=str(task.id))
        return original_run(self, task, ctx)

    python_exec.PythonExecutor.run = traced_run
    del state
    call_command("runagent", *argv)


def analyse() -> None:
    marks = [json.loads(line) for line in TRACE.read_text().splitlines()]
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
    import django

    django.setup()
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT id::text, (params->>'t0')::float8, (results->>'latency_ms')::float8,"
                    " extract(epoch FROM created_at)::float8 FROM accs_task WHERE results ? 'latency_ms'")
        tasks = {r[0]: (r[1], r[1] + r[2] / 1000, r[3]) for r in cur.fetchall()}
    # Walk the marks: each task's claim is the last claim_call before its claim_return, the wake
    # the last "woke" before that claim_call.
    last_woke = last_call = None
    sqls: list[tuple[str, float, float]] = []
    pending_sql = None
    exec_start: dict[str, float] = {}
    claimed: dict[str, dict] = {}
    for m in marks:
        if m["mark"] == "woke":
            last_woke = m["t"]
        elif m["mark"] == "claim_call":
            last_call, sqls = m["t"], []
        elif m["mark"] == "sql_send":
            pending_sql = (m["sql"], m["t"])
        elif m["mark"] == "sql_done" and pending_sql:
            sqls.append((pending_sql[0], pending_sql[1], m["t"]))
            pending_sql = None
        elif m["mark"] == "claim_return":
            for tid in m["tasks"]:
                claimed[tid] = {"woke": last_woke, "call": last_call, "ret": m["t"], "sqls": list(sqls)}
        elif m["mark"] == "exec_start":
            exec_start[m["task"]] = m["t"]
    intervals: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            intervals.setdefault(name, []).append(value * 1000)

    for tid, (t0, body, created) in tasks.items():
        c = claimed.get(tid)
        if not c or tid not in exec_start:
            continue
        add("enqueue call -> row created (db clock)", created - t0)
        add("enqueue -> agent woke", c["woke"] - t0 if c["woke"] else None)
        add("woke -> claim call", c["call"] - c["woke"] if c["woke"] else None)
        add("claim call -> claim return", c["ret"] - c["call"])
        for i, (sql, sent, done) in enumerate(c["sqls"]):
            add(f"  claim stmt {i}: {sql[:40]}", done - sent)
        add("claim return -> executor start", exec_start[tid] - c["ret"])
        add("executor start -> body", body - exec_start[tid])
        add("TOTAL enqueue -> body", body - t0)
    for name, values in intervals.items():
        values.sort()
        p95 = values[int(len(values) * 0.95) - 1] if len(values) > 1 else values[0]
        print(f"{name:<55} n={len(values):>3}  p50 {statistics.median(values):7.2f} ms  p95 {p95:7.2f} ms")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        agent_main(sys.argv[2:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "analyse":
        analyse()
        return 0
    sys.path.insert(0, str(ROOT))
    from bench import run

    run.call_command("migrate", verbosity=0)
    run.define_services()
    run.reset()
    TRACE.parent.mkdir(parents=True, exist_ok=True)
    TRACE.write_text("")
    env = {**os.environ, "ACC_LOG_LEVEL": "WARNING", "ACC_CPU_BUDGET": "1000", "ACC_SLOT_CAP": "1000",
           "ACC_POLL_INTERVAL_SEC": "5"}
    procs = [run.spawn("runbuilder", "--tick", "1"),
             subprocess.Popen([sys.executable, __file__, "agent", "--node", "lat", "--services", "bench-stamp",
                               "--max-concurrent", "4"], cwd=ROOT, env=env)]
    try:
        from bench.pickup_drain import stamp_jobs

        stamp_jobs(run)
    finally:
        run.stop(procs)
    analyse()
    return 0


if __name__ == "__main__":
    sys.exit(main())
