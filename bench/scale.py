"""Many agents on one PostgreSQL: claim latency, cap and double-claim checks (``make bench``).

``python bench/scale.py worker ...`` is one simulated agent process: it claims through the real
``claim_round`` (the agent's one claim statement, with every limit and the advisory locks; behind a
pooler, a claim that found the capped service's lock busy is made again after a short delay, as
the agent does) and reports through the real ``report``, but its "work" is a timer of 2–6 s
instead of an executor thread, so a 2-core machine can host a hundred of them. It writes each claim's duration, in
milliseconds, to its output file, and how many claims found the lock busy to ``<output>.contended``.

The driver (:func:`scale`) fills the queue, starts the workers, lets them go together, samples how
many tasks of the capped service are held (one snapshot every 20 ms) and then checks the attempts:
a task claimed twice would have two attempts, since the simulated work never fails.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SERVICE = "bench-scale"
HELD_SQL = ("SELECT count(*) FROM accs_task t JOIN accs_service s ON s.id = t.service_id"
            " WHERE s.key = %s AND t.status IN ('starting', 'running')")


def worker(args: argparse.Namespace) -> int:
    """Claim and finish simulated tasks until ``args.seconds`` have passed after the go signal."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks
    import django

    django.setup()
    from accs_site.daemon import Backoff, db_pooler
    from jobs.claim import NodeLimits, claim_round, service_spec
    from jobs.reports import Outcome, report
    from workflows.models import Service

    svc = Service.objects.get(key=SERVICE)
    spec = service_spec(svc)
    node = f"bench-scale-{args.index}"
    limits = NodeLimits(node, slot_cap=args.slots, cpu_budget=args.slots * 10, per_service={})
    agent_id = f"{node}:{os.getpid()}"
    rng = random.Random(args.index)
    go = Path(args.go)
    Path(args.out).with_suffix(".ready").touch()  # set up: the driver starts the clock once all are
    while not go.exists():
        time.sleep(0.05)
    until = time.monotonic() + args.seconds
    measure = Path(args.measure) if args.measure else None
    measuring = measure is None
    running: list[tuple[float, object]] = []
    durations: list[float] = []
    contended = 0  # claims that found the capped service's lock busy: claimed again after a short delay
    backoff = Backoff(base=0.01, cap=args.poll)
    pooled = db_pooler() is not None  # as the agent: behind a pooler, a capped service's lock is only tried
    while time.monotonic() < until:
        now = time.monotonic()
        finished = [task for deadline, task in running if deadline <= now]
        running = [(deadline, task) for deadline, task in running if deadline > now]
        if finished:
            report([Outcome(task_id=t.id, attempt=t.attempt, status="succeeded") for t in finished],
                   started=[(t.id, t.attempt, None) for t in finished], agent_id=agent_id, source=f"agent:{node}")
        free = args.slots - len(running)
        busy = False
        measuring = measuring or (measure is not None and measure.exists())
        if free > 0:
            started = time.perf_counter()
            answer = claim_round([spec], limits, agent_id=agent_id, free_slots=free, lease_seconds=600,
                                 try_capped=pooled)
            took = (time.perf_counter() - started) * 1000
            now = time.monotonic()
            running += [(now + rng.uniform(args.work_min, args.work_max), task) for task in answer.tasks]
            busy = bool(answer.contended)
            if measuring:
                durations.append(took)
                contended += busy
        wait = backoff.next_delay() if busy else args.poll  # as the agent does: claim again shortly
        if not busy:
            backoff.reset()
        next_end = min((deadline for deadline, _ in running), default=now + wait)
        time.sleep(max(0.0, min(next_end - time.monotonic(), wait)))
    Path(args.out).write_text("\n".join(f"{d:.3f}" for d in durations))
    Path(args.out).with_suffix(".contended").write_text(str(contended))
    return 0


def wait_ready(run_dir: Path, procs: list[subprocess.Popen], *, timeout: float = 600.0) -> None:
    """Wait until every worker has set up (imported Django, read its service), then 2 s more.

    A hundred interpreters importing Django take minutes of CPU on a small machine; a run whose
    clock starts before they are done measures their start-up, not the claims.
    """
    deadline = time.monotonic() + timeout
    while sum(1 for _ in run_dir.glob("*.ready")) < len(procs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit(f"workers not ready after {time.monotonic() - deadline + timeout:.0f} s"
                             f" ({sum(p.poll() is not None for p in procs)} exited)")
        time.sleep(0.2)
    time.sleep(2.0)


def scale(*, agents: int, slots: int, seconds: float, cap: int, say, reset, make_tasks) -> dict[str, float]:
    """Run ``agents`` simulated agents of ``slots`` each for ``seconds``; return the figures.

    ``cap`` is the service's global ``max_concurrent`` (0: none).
    """
    from django.db import connection

    from workflows.api import save_service

    reset()
    save_service(key=SERVICE, executor="python", executor_config={"callable": "bench.tasks:noop"},
                 params_schema={"type": "object"}, max_concurrent=cap)
    # Enough work for every slot for the whole run (the mean task lasts 4 s).
    busy = min(agents * slots, cap) if cap > 0 else agents * slots
    tasks = int(busy * seconds / 4 * 1.3) + agents * slots
    make_tasks(tasks, service=SERVICE)
    run_dir = ROOT / ".local" / "bench" / f"scale-{time.time_ns()}"
    run_dir.mkdir(parents=True)
    go = run_dir / "go"
    procs = [subprocess.Popen([sys.executable, __file__, "worker", "--index", str(i), "--slots", str(slots),
                               "--seconds", str(seconds), "--go", str(go), "--out", str(run_dir / f"{i}.txt")],
                              cwd=ROOT, env={**os.environ, "ACC_LOG_LEVEL": "WARNING"})
             for i in range(agents)]
    wait_ready(run_dir, procs)
    go.touch()
    peak = 0
    deadline = time.monotonic() + seconds
    with connection.cursor() as cur:
        while time.monotonic() < deadline:
            cur.execute(HELD_SQL, [SERVICE])
            peak = max(peak, cur.fetchone()[0])
            time.sleep(0.02)
    for proc in procs:
        proc.wait(timeout=120)
    failed = sum(1 for p in procs if p.returncode != 0)
    durations = sorted(float(x) for i in range(agents) if (run_dir / f"{i}.txt").exists()
                       for x in (run_dir / f"{i}.txt").read_text().split())
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM (SELECT task_id FROM accs_attempt GROUP BY task_id HAVING count(*) > 1) d")
        twice = cur.fetchone()[0]
        cur.execute("SELECT count(*) FROM accs_task WHERE status = 'done'")
        done = cur.fetchone()[0]
    q = statistics.quantiles(durations, n=100) if len(durations) > 1 else [0.0] * 99
    figures = {"claim_p50_ms": round(q[49], 2), "claim_p95_ms": round(q[94], 2), "claims": len(durations),
               "tasks_done": done, "tasks_per_s": round(done / seconds, 1), "held_peak": peak, "cap": cap,
               "cap_violations": int(cap > 0 and peak > cap), "double_claims": twice, "workers_failed": failed}
    say(f"  scale {agents} agents x {slots} slots, cap {cap}: {figures}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--slots", type=int, default=20)
    w.add_argument("--seconds", type=float, default=60)
    w.add_argument("--go", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--measure", help="record claims only once this file exists (after a warm-up)")
    w.add_argument("--poll", type=float, default=0.5)
    w.add_argument("--work-min", type=float, default=2.0)
    w.add_argument("--work-max", type=float, default=6.0)
    args = parser.parse_args()
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
