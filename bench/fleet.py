"""A fleet at an offered load below saturation, direct and through PgBouncer (``python bench/fleet.py``).

Unlike a saturated run (every slot busy, every claim racing), this is what a fleet sees in
production: work arrives at a steady rate (``--rate`` tasks per second), lower than the fleet's
capacity, and many agents wait for it. Each simulated agent is a ``bench/scale.py worker``
process (the real ``claim_round`` and ``report``, tasks of 2–6 s simulated by a timer, polling
every 0.5 s; through PgBouncer, claiming again after 5–10 ms, then longer, when the capped
service's lock was busy), connected straight to PostgreSQL or through a transaction-mode PgBouncer
(scripts/pgbouncer_local.sh, ``ACC_DB_POOLER=pgbouncer``). Figures per mode: claim p50/p95 (one
claim statement, as the agent times it), pick-up p50/p95 (task created → claimed, PostgreSQL's
clock), claims that found the lock busy (``contended_claims``; each is also a claim, a short one,
in the claim figures), server connections (peak of all, and of those in use: not idle), cap
violations (held tasks sampled every 20 ms against the service's cap) and double claims (a task
with two attempts: the simulated work never fails). Written to bench/results/fleet.json.

Each mode starts on emptied tables, runs ``--warmup`` seconds (15) of load, analyzes the engine's
tables and only then measures for ``--seconds``. The first minute is not the fleet's steady state:
every connection plans its first claim at the go signal, for tables without statistics, and keeps
those plans until autovacuum's analyze, which comes at any point of that minute; without the
warm-up one run and the next measured very different first minutes.

Defaults are the issue's fleet (100 agents × 20 slots for 60 s) at 100 tasks/s; 200 tasks/s keeps
1.4–1.7 of 2 cores busy. ``cpu_cores_busy`` says how close a run came to the machine's saturation.
A 2-core machine shared with other work wants ``--agents 20 --rate 40 --seconds 30``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "bench")  # the benchmarks' services call bench.tasks

from bench.scale import wait_ready  # noqa: E402

SERVICE = "bench-scale"  # the service bench/scale.py's workers claim
CONNECTIONS_SQL = """
SELECT count(*), count(*) FILTER (WHERE state <> 'idle')
  FROM pg_stat_activity
 WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid()
   AND coalesce(application_name, '') NOT LIKE 'bench driver%%'
"""
# The service's held tasks (task_held_service_idx), by id so the plan is the same at every sample.
HELD_SQL = "SELECT count(*) FROM accs_task WHERE service_id = %s AND status IN ('starting', 'running')"


def _quantiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    q = statistics.quantiles(values, n=100)
    return round(q[49], 2), round(q[94], 2)


class Sampler(threading.Thread):
    """Sample server connections and held tasks every 20 ms on a connection of its own.

    Its statements are prepared once: planned at every sample, they cost PostgreSQL a tenth of a
    core, taken from the fleet it measures.
    """

    def __init__(self, url: str, cap: int, service_id: int) -> None:
        super().__init__(daemon=True)
        self.url, self.cap, self.service_id = url, cap, service_id
        self.stop = threading.Event()
        self.peak_connections = self.peak_in_use = self.peak_held = self.violations = 0
        self.samples = 0

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, application_name="bench driver sampler") as conn:
            while not self.stop.is_set():
                total, in_use = conn.execute(CONNECTIONS_SQL, prepare=True).fetchone()
                held = conn.execute(HELD_SQL, [self.service_id], prepare=True).fetchone()[0]
                self.peak_connections = max(self.peak_connections, total)
                self.peak_in_use = max(self.peak_in_use, in_use)
                self.peak_held = max(self.peak_held, held)
                self.violations += int(self.cap > 0 and held > self.cap)
                self.samples += 1
                time.sleep(0.02)


def _postgres_kind(cmd: str) -> str:
    """A PostgreSQL process's kind: the server connections, autovacuum, or the other background work."""
    if "autovacuum worker" in cmd:
        return "postgres autovacuum"
    title = cmd.split(":", 1)[1].strip() if ":" in cmd else ""
    background = ("checkpointer", "background writer", "walwriter", "autovacuum launcher", "logical replication",
                  "stats", "archiver", "walsender")
    return "postgres background" if not title or title.startswith(background) else "postgres connections"


def _cpu_by_kind() -> tuple[float, dict[str, tuple[str, int]]]:
    """Now, and the CPU time (clock ticks) each process on this machine has used, with its kind."""
    ticks: dict[str, tuple[str, int]] = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        kind = ("agents" if "scale.py worker" in cmd else "pgbouncer" if "pgbouncer" in cmd
                else "driver" if "fleet.py" in cmd else _postgres_kind(cmd) if "postgres" in cmd else "other")
        ticks[pid] = (kind, int(fields[11]) + int(fields[12]))  # utime + stime
    return time.monotonic(), ticks


def _cpu_cores(before: tuple[float, dict[str, tuple[str, int]]],
               after: tuple[float, dict[str, tuple[str, int]]]) -> dict[str, float]:
    """Cores busy on average between two readings, per kind of process and in all.

    Whether the offered load is below the machine's saturation: the agents share its cores with
    PostgreSQL here, so a total near the core count means every figure measures a queue for CPU.
    A process that ended between the readings is not counted.
    """
    hz = os.sysconf("SC_CLK_TCK") * (after[0] - before[0])
    cores: dict[str, float] = {}
    for pid, (kind, ticks) in after[1].items():
        cores[kind] = cores.get(kind, 0.0) + (ticks - before[1].get(pid, (kind, 0))[1]) / hz
    rounded = {kind: round(n, 2) for kind, n in sorted(cores.items())}
    return {**rounded, "all": round(sum(cores.values()), 2), "of": os.cpu_count() or 0}


def _autoanalyzes() -> int:
    """How many times autovacuum has analyzed the engine's tables (each analyze re-plans the claims)."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT coalesce(sum(autoanalyze_count), 0) FROM pg_stat_user_tables WHERE relname LIKE 'accs%%'")
        return int(cur.fetchone()[0])


def _feed(*, rate: float, seconds: float) -> int:
    """Start ``rate`` one-task jobs a second for ``seconds`` (in tenths of a second); return how many."""
    from jobs import api, transitions

    fed, started = 0, time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        due = int(rate * elapsed) - fed
        if due > 0:
            api.start_many([api.JobSpec(service=SERVICE, params={"n": fed + i}) for i in range(due)])
            while transitions.start_due_jobs(limit=5000):
                pass
            fed += due
        time.sleep(0.1)
    return fed


# The engine's tables the claim and the report read, analyzed once the warm-up has filled them.
ANALYZE_SQL = "ANALYZE accs_job, accs_task, accs_attempt, accs_event"


def run_mode(mode: str, *, agents: int, slots: int, rate: float, seconds: float, cap: int, direct_url: str,
             warmup: float = 15.0) -> dict:
    from django.db import connection

    from workflows.api import save_service

    with connection.cursor() as cur:
        cur.execute("TRUNCATE accs_job, accs_task, accs_attempt, accs_event CASCADE")
        cur.execute("DELETE FROM accs_node WHERE name LIKE 'bench-scale-%%'")
    service = save_service(key=SERVICE, executor="python", executor_config={"callable": "bench.tasks:noop"},
                           params_schema={"type": "object"}, max_concurrent=cap)
    env = {**os.environ, "ACC_LOG_LEVEL": "WARNING"}
    if mode == "pgbouncer":
        script = str(ROOT / "scripts" / "pgbouncer_local.sh")
        subprocess.run([script, "start"], check=True, capture_output=True)
        dbname = direct_url.rsplit("/", 1)[1]
        env.update(ACC_DB_URL=subprocess.run([script, "url", dbname], check=True, capture_output=True,
                                             text=True).stdout.strip(), ACC_DB_POOLER="pgbouncer")
    run_dir = ROOT / ".local" / "bench" / f"fleet-{mode}-{time.time_ns()}"
    run_dir.mkdir(parents=True)
    go, measure = run_dir / "go", run_dir / "measure"
    # The workers stop claiming a few seconds after the feed ends, once the last tasks are picked up.
    procs = [subprocess.Popen([sys.executable, str(ROOT / "bench" / "scale.py"), "worker", "--index", str(i),
                               "--slots", str(slots), "--seconds", str(warmup + seconds + 8), "--go", str(go),
                               "--measure", str(measure), "--out", str(run_dir / f"{i}.txt")], cwd=ROOT, env=env)
             for i in range(agents)]
    wait_ready(run_dir, procs)
    sampler = Sampler(direct_url, cap, service.id)
    sampler.start()
    go.touch()
    # The warm-up: the tables start empty (truncated), and until they are analyzed with work in
    # them, every connection's claim and report run plans made for empty tables (a PL/pgSQL
    # function plans its statements once per connection; ANALYZE makes them plan again). Those
    # first plans are all made at the go signal. A fleet in production runs on analyzed tables and
    # warm connections; autovacuum's analyze comes at any point of the first minute.
    fed = _feed(rate=rate, seconds=warmup)
    with connection.cursor() as cur:
        cur.execute(ANALYZE_SQL)
        cur.execute("SELECT now()")
        measured_from = cur.fetchone()[0]
    measure.touch()
    analyzes = _autoanalyzes()
    cpu_before = _cpu_by_kind()
    fed += _feed(rate=rate, seconds=seconds)
    analyzes = _autoanalyzes() - analyzes
    cpu = _cpu_cores(cpu_before, _cpu_by_kind())
    for proc in procs:
        proc.wait(timeout=180)
    sampler.stop.set()
    sampler.join(5)
    claims = sorted(float(x) for i in range(agents) if (run_dir / f"{i}.txt").exists()
                    for x in (run_dir / f"{i}.txt").read_text().split())
    contended = sum(int(p.read_text() or 0) for p in run_dir.glob("*.contended"))
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM (SELECT task_id FROM accs_attempt GROUP BY task_id HAVING count(*) > 1) d")
        twice = cur.fetchone()[0]
        cur.execute("SELECT count(*) FILTER (WHERE status = 'done'),"
                    " array_agg(extract(epoch FROM claimed_at - created_at) * 1000)"
                    " FILTER (WHERE claimed_at IS NOT NULL AND created_at >= %s)"
                    " FROM accs_task t WHERE service_id = (SELECT id FROM accs_service WHERE key = %s)",
                    [measured_from, SERVICE])
        done, pickups = cur.fetchone()
    claim_p50, claim_p95 = _quantiles(claims)
    pickup_p50, pickup_p95 = _quantiles(sorted(float(p) for p in pickups or []))
    return {"mode": mode, "agents": agents, "slots": slots, "offered_tasks_per_s": rate, "seconds": seconds,
            "warmup_seconds": warmup,
            "fed": fed, "done": done, "claims": len(claims), "contended_claims": contended,
            "claim_p50_ms": claim_p50, "claim_p95_ms": claim_p95,
            "pickup_p50_ms": pickup_p50, "pickup_p95_ms": pickup_p95,
            "server_connections_peak": sampler.peak_connections, "server_connections_in_use_peak": sampler.peak_in_use,
            "held_peak": sampler.peak_held, "cap": cap, "cap_violations": sampler.violations,
            "double_claims": twice, "workers_failed": sum(1 for p in procs if p.returncode != 0),
            "cpu_cores_busy": cpu, "autoanalyzes_measured": analyzes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--slots", type=int, default=20)
    parser.add_argument("--rate", type=float, default=100.0, help="offered tasks per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured, after the warm-up")
    parser.add_argument("--warmup", type=float, default=15.0,
                        help="seconds of load before the tables are analyzed and the measure starts")
    parser.add_argument("--cap", type=int, default=1500, help="the service's max_concurrent")
    parser.add_argument("--modes", default="direct,pgbouncer")
    args = parser.parse_args()
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    settings.DATABASES["default"]["OPTIONS"]["application_name"] = "bench driver"
    call_command("migrate", verbosity=0)
    s = settings.DATABASES["default"]
    direct_url = f"postgres://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"
    results = []
    for mode in args.modes.split(","):
        figures = run_mode(mode, agents=args.agents, slots=args.slots, rate=args.rate, seconds=args.seconds,
                           cap=args.cap, direct_url=direct_url, warmup=args.warmup)
        print(json.dumps(figures), flush=True)
        results.append(figures)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps({"runs": results, "cores": os.cpu_count(),
                                                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                               indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
