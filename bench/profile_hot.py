"""Where the hot path's time goes: ``python bench/profile_hot.py bulk|instantiate|drain [N]``.

Prints, for one run on the bench database, the wall time split into the time spent waiting for
PostgreSQL (every statement timed from Django's ``execute_wrapper``, grouped by its first words)
and the process's own Python time (cProfile, top functions by own time). ``docs/performance.md``
quotes these figures.

* ``bulk``: ``start_many`` of N one-task jobs (default 20,000), as ``enqueue_rate_bulk`` measures.
* ``instantiate``: the builder turning N queued one-task jobs (default 10,000) into tasks, the
  first half of ``e2e_jobs_per_s``.
* ``drain``: one agent, in this process, draining N queued no-op tasks (default 5,000) with
  ``--max-concurrent 64 --claim-batch 64 --once`` as ``drain_tps_1_agent`` runs it.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
os.environ.setdefault("ACC_LOG_LEVEL", "WARNING")
os.environ.setdefault("ACC_CPU_BUDGET", "1000")
os.environ.setdefault("ACC_SLOT_CAP", "1000")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from bench import run as bench  # noqa: E402
from jobs import api  # noqa: E402


class StatementTimer:
    """Time every statement on Django's connection, grouped by what it does."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @staticmethod
    def label(sql: str) -> str:
        first = sql.lstrip().split("\n", 1)[0]
        if first.startswith("--"):  # the engine's statements open with a comment naming them
            return first[2:].strip()[:60]
        text = " ".join(sql.split())
        match = re.search(r"\b(?:INSERT INTO|UPDATE|DELETE FROM|FROM)\s+\"?(\w+)", text)
        head = text.split(" ", 1)[0].upper()
        if text.upper().startswith("WITH"):
            head = "WITH"
        return f"{head} … {match.group(1) if match else ''}"[:60]

    def __call__(self, execute, sql, params, many, context):
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            key = self.label(sql)
            self.seconds[key] += time.perf_counter() - started
            self.calls[key] += 1

    def report(self, wall: float) -> None:
        total = sum(self.seconds.values())
        print(f"  waiting for PostgreSQL: {total:.2f} s of {wall:.2f} s wall ({100 * total / wall:.0f} %)")
        for key, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:8]:
            per_call = 1000 * seconds / self.calls[key]
            print(f"    {seconds:7.2f} s  {self.calls[key]:7d} calls  {per_call:7.2f} ms/call  {key}")


def python_report(profile: cProfile.Profile, limit: int = 12) -> None:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(limit)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    print("  own time by function (cProfile, this thread):")
    for line in lines[start:start + limit + 1]:
        print("    " + line[:150])


def profiled(fn) -> None:
    timer = StatementTimer()
    profile = cProfile.Profile()
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    with connection.execute_wrapper(timer):
        profile.enable()
        fn()
        profile.disable()
    wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    print(f"  wall {wall:.2f} s, this process's CPU {cpu:.2f} s")
    timer.report(wall)
    python_report(profile)


def bulk(n: int) -> None:
    bench.reset()
    specs = [api.JobSpec(service="bench-noop", params={"n": i}) for i in range(n)]
    print(f"bulk: start_many of {n:,} one-task jobs")
    started = time.perf_counter()
    profiled(lambda: api.start_many(specs))
    print(f"  {n / (time.perf_counter() - started):,.0f} jobs/s under the profiler")


def drain(n: int) -> None:
    from nodes.agent import Agent

    bench.reset()
    bench.make_tasks(n)
    bench.settle()
    agent = Agent(node="bench-prof", services=["bench-noop"], max_concurrent=64, once=True, labels={},
                  poll_interval=None, lease_seconds=None, claim_batch=64)
    print(f"drain: one in-process agent, {n:,} no-op tasks, 64 slots, claim batch 64")
    started = time.perf_counter()
    profiled(agent.run)
    print(f"  {n / (time.perf_counter() - started):,.0f} tasks/s under the profiler (agent start included)")


def instantiate(n: int) -> None:
    from jobs import transitions

    bench.reset()
    api.start_many([api.JobSpec(service="bench-noop", params={"n": i}) for i in range(n)])
    print(f"instantiate: the builder's start of {n:,} queued one-task jobs, 1,000 per statement")
    started = time.perf_counter()

    def run() -> None:
        while transitions.start_due_jobs(limit=1000):
            pass

    profiled(run)
    print(f"  {n / (time.perf_counter() - started):,.0f} jobs/s under the profiler")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "bulk"
    call_command("migrate", verbosity=0)
    bench.define_services()
    if what == "bulk":
        bulk(int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)
    elif what == "drain":
        drain(int(sys.argv[2]) if len(sys.argv) > 2 else 5_000)
    elif what == "instantiate":
        instantiate(int(sys.argv[2]) if len(sys.argv) > 2 else 10_000)
    else:
        raise SystemExit(f"unknown profile {what!r}: bulk, drain or instantiate")


if __name__ == "__main__":
    main()
