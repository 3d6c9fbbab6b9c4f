"""The fault scenario (``make chaos``): real daemons, real faults, one JSON document of figures.

A private PostgreSQL cluster (never the development one), several agents and two builders as
processes, and thousands of one-task jobs whose command keeps a ledger of its runs
(``chaos/work.py``). While they drain, at seeded random times: agents are killed with SIGKILL and
started again (as systemd would), the leader builder is killed, PostgreSQL is restarted, an agent
is frozen past its lease (SIGSTOP … SIGCONT), and an agent is cut off from PostgreSQL through a
loopback TCP proxy while its task keeps running. Then the figures, every gate of which must be 0:

* ``lost``: tasks not done at the end;
* ``finished_twice``: tasks with more than one accepted (succeeded) attempt;
* ``late_reports_accepted``: succeeded attempts that are not their task's current attempt;
* ``overlapping_runs``: runs of a task that started while another run of it still held its lock;
* ``daemons_exited``: daemons that exited without the scenario killing them;
* ``orphans``: processes of the task command still alive after the daemons are stopped;
* ``deadlocks``: "deadlock detected" in the server log.

Also: rescue latency (from an agent's kill to the next claim of each task it held), fenced
reports recorded, faults injected, wall time and tasks/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tcp_proxy import TcpProxy  # noqa: E402

LEASE_SECONDS = 6.0
MAX_CONCURRENT = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """A throwaway PostgreSQL cluster run by scripts/pg_local.sh in a private folder."""

    def __init__(self, base: Path) -> None:
        self.base, self.port = base, free_port()
        self.env = {**os.environ, "ACC_PG_DIR": str(base), "ACC_PG_PORT": str(self.port), "ACC_PG_DBNAME": "chaos"}
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/chaos"

    def _script(self, verb: str) -> None:
        subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), verb], env=self.env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        self._script("start")

    def stop(self) -> None:
        self._script("stop")

    def server_log(self) -> str:
        for log in (self.base / "server.log", *self.base.glob("**/server.log")):
            if log.exists():
                return log.read_text(errors="replace")
        return ""


@dataclass
class Daemon:
    """One daemon process; ``expected_exit`` is set when the scenario itself stops it."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_dir: Path
    proc: subprocess.Popen | None = None
    expected_exit: bool = False
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"{self.name}.{self.starts}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *self.args], cwd=ROOT, env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.expected_exit = False

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def alive(self) -> bool:
        return bool(self.proc and self.proc.poll() is None)


@dataclass
class Scenario:
    tasks: int
    agents: int
    seed: int
    work: Path
    rng: random.Random = field(init=False)
    faults: list[dict] = field(default_factory=list)
    held_at_kill: list[tuple[str, int, float]] = field(default_factory=list)  # (task, attempt, wall time)
    exited: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


# What the chaos service needs of the site's allow-lists: its tool runs under the agent's interpreter
# and its env passes the ledger's path and the run's marker.
ALLOW_LISTS = {"ACC_ALLOWED_EXECUTABLES": "python", "ACC_ALLOWED_TASK_ENV": "CHAOS_LEDGER,CHAOS_RUN_ID"}


def _daemon_env(url: str, run_id: str, ledger: Path) -> dict[str, str]:
    return {**os.environ, **ALLOW_LISTS, "ACC_DB_URL": url, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "ACC_POLL_INTERVAL_SEC": "0.5", "ACC_LOG_LEVEL": "INFO", "CHAOS_RUN_ID": run_id,
            "CHAOS_LEDGER": str(ledger), "ACC_BACKOFF_BASE_SEC": "0.5"}


def _setup(url: str, tasks: int, rng: random.Random, *, ledger: Path, run_id: str) -> None:
    """Migrate the private database, define the service and start the jobs (bulk, as a builder would see them).

    Tasks get only what their service grants, not the agent's environment: the service passes the
    ledger's path and the run's marker (which the orphan count looks for) in its ``env``.
    """
    env = {**os.environ, **ALLOW_LISTS, "ACC_DB_URL": url, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput", "-v0"], cwd=ROOT, env=env,
                   check=True)
    code = f"""
import random
from jobs import api
from workflows.api import save_service
save_service(key="chaos-work", executor="command", executor_config={{"argv": ["python", "chaos/work.py", "{{seconds}}"],
                                                                  "env": {{"CHAOS_LEDGER": {str(ledger)!r},
                                                                          "CHAOS_RUN_ID": {run_id!r}}}}},
             params_schema={{"type": "object", "properties": {{"seconds": {{"type": "number"}}}},
                            "required": ["seconds"]}},
             max_attempts=25, backoff_base_seconds=0.5, backoff_cap_seconds=2, timeout_seconds=120)
rng = random.Random({rng.randrange(1 << 30)})
specs = [api.JobSpec(service="chaos-work", params={{"seconds": round(rng.uniform(3, 6) if rng.random() < 0.03
                                                              else rng.uniform(0.02, 0.25), 3)}})
         for _ in range({tasks})]
api.start_many(specs)
"""
    subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + code], cwd=ROOT,
                   env={**env, "DJANGO_SETTINGS_MODULE": "accs_site.settings"}, check=True)


def _held_by(conn: psycopg.Connection, node: str) -> list[tuple[str, int]]:
    return [(str(t), a) for t, a in conn.execute(
        "SELECT id, attempt FROM accs_task WHERE node = %s AND status IN ('starting', 'running')", [node]).fetchall()]


def _leader(builders: list[Daemon]) -> Daemon:
    """Return the builder whose latest log says it leads (the first one if none says so)."""
    best, best_at = builders[0], -1
    for builder in builders:
        log = builder.log_dir / f"{builder.name}.{builder.starts}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        at = text.rfind("now the leader")
        if at > best_at and builder.alive():
            best, best_at = builder, at
    return best


def run(args: argparse.Namespace) -> dict:
    sc = Scenario(tasks=args.tasks, agents=args.agents, seed=args.seed,
                  work=Path(tempfile.mkdtemp(prefix="accs-chaos-")))
    os.chmod(sc.work, 0o755)
    cluster = Cluster(sc.work / "pg")
    run_id = uuid.uuid4().hex
    ledger = sc.work / "ledger.txt"
    ledger.touch()
    logs = sc.work / "logs"
    logs.mkdir()
    daemons: list[Daemon] = []
    proxy: TcpProxy | None = None
    started = time.monotonic()
    try:
        cluster.start()
        _setup(cluster.url, sc.tasks, sc.rng, ledger=ledger, run_id=run_id)
        proxy = TcpProxy(0, "127.0.0.1", cluster.port)
        env = _daemon_env(cluster.url, run_id, ledger)
        cut_env = {**env, "ACC_DB_URL": f"postgres://postgres@127.0.0.1:{proxy.port}/chaos"}
        agent_args = ["--services", "chaos-work", "--max-concurrent", str(MAX_CONCURRENT),
                      "--lease-seconds", str(LEASE_SECONDS)]
        agents = [Daemon(f"agent-{i}", ["runagent", "--node", f"chaos-{i}", *agent_args],
                         cut_env if i == 0 else env, logs) for i in range(sc.agents)]
        builders = [Daemon(f"builder-{i}", ["runbuilder", "--tick", "0.2"], env, logs) for i in range(2)]
        daemons = agents + builders
        for d in daemons:
            d.start()
        conn = psycopg.connect(cluster.url, autocommit=True)
        plan = _fault_plan(sc)
        t0 = time.monotonic()
        while True:
            now = time.monotonic() - t0
            while plan and plan[0][0] <= now:
                _, kind = plan.pop(0)
                conn = _inject(kind, now, sc, agents, builders, cluster, proxy, conn)
            _watch(daemons, sc)
            try:
                open_ = conn.execute("SELECT count(*) FROM accs_task WHERE status <> 'done'").fetchone()[0]
                jobs = conn.execute("SELECT count(*) FROM accs_job").fetchone()[0]
            except psycopg.Error:
                conn = _reconnect(cluster.url)
                continue
            if not plan and open_ == 0 and jobs == sc.tasks:
                break
            if now > args.timeout:
                break
            time.sleep(0.2)
        drained = time.monotonic() - t0
        return _figures(sc, conn, ledger, logs, cluster, run_id, daemons, drained, started)
    finally:
        for d in daemons:
            d.expected_exit = True
            d.signal(signal.SIGCONT)
            d.signal(signal.SIGTERM)
        for d in daemons:
            if d.proc:
                try:
                    d.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(d.proc.pid, signal.SIGKILL)
        if proxy:
            proxy.close()
        try:
            cluster.stop()
        except subprocess.CalledProcessError:
            pass
        if not args.keep:
            shutil.rmtree(sc.work, ignore_errors=True)


def _fault_plan(sc: Scenario) -> list[tuple[float, str]]:
    """Return (seconds after start, fault) pairs, in time order."""
    rng = sc.rng
    plan = [(rng.uniform(1, 20), "kill_agent") for _ in range(max(3, sc.tasks // 500))]
    plan += [(rng.uniform(4, 8), "kill_leader"), (rng.uniform(10, 14), "restart_postgres"),
             (rng.uniform(2, 6), "freeze_agent"), (rng.uniform(15, 18), "cut_agent")]
    return sorted(plan)


def _reconnect(url: str) -> psycopg.Connection:
    while True:
        try:
            return psycopg.connect(url, autocommit=True, connect_timeout=2)
        except psycopg.Error:
            time.sleep(0.5)


def _inject(kind: str, elapsed: float, sc: Scenario, agents: list[Daemon], builders: list[Daemon],
            cluster: Cluster, proxy: TcpProxy, conn: psycopg.Connection) -> psycopg.Connection:
    """Inject one fault; return a working monitoring connection."""
    at = time.time()
    entry: dict = {"fault": kind, "at_s": round(elapsed, 1)}
    if kind == "kill_agent":
        victim = sc.rng.choice(agents[1:])  # agent-0 is the one cut off through the proxy
        node = victim.args[victim.args.index("--node") + 1]
        try:
            held = _held_by(conn, node)
        except psycopg.Error:
            conn, held = _reconnect(cluster.url), []
        victim.expected_exit = True
        victim.signal(signal.SIGKILL)
        victim.proc.wait()
        sc.held_at_kill += [(t, a, at) for t, a in held]
        victim.start()  # as systemd's Restart=always would
        entry.update(daemon=victim.name, held=len(held))
    elif kind == "kill_leader":
        leader = _leader(builders)
        leader.expected_exit = True
        leader.signal(signal.SIGKILL)
        leader.proc.wait()
        leader.start()
        entry.update(daemon=leader.name)
    elif kind == "restart_postgres":
        conn.close()
        cluster.stop()
        time.sleep(2)
        cluster.start()
        conn = _reconnect(cluster.url)
    elif kind == "freeze_agent":
        # The agent holding the most work (agent-0 is kept for the cut): freezing one that had just
        # been restarted and held nothing would cost no lease and test nothing.
        victim, held = _busiest(conn, agents[1:])
        victim.signal(signal.SIGSTOP)
        frozen = _wait_rescued(conn, held, at_least=LEASE_SECONDS + 3)
        victim.signal(signal.SIGCONT)
        entry.update(daemon=victim.name, held=len(held), frozen_s=round(frozen, 1))
    elif kind == "cut_agent":
        held = _wait_holding(conn, agents[0])
        proxy.cut()
        cut = _wait_rescued(conn, held, at_least=LEASE_SECONDS + 4)
        proxy.restore()
        entry.update(daemon=agents[0].name, held=len(held), cut_s=round(cut, 1))
    sc.faults.append(entry)
    return conn


def _wait_holding(conn: psycopg.Connection, agent: Daemon, *, timeout: float = 30.0) -> list[tuple[str, int]]:
    """Wait (bounded) until ``agent``'s node holds a task, so the fault hits running work; return what it holds.

    The bound is generous: a freeze comes 2-6 s after the start, and on a loaded machine an agent
    (just started, or restarted by an earlier kill) can take longer than that to import Django and
    claim. With nothing held, the fault would cost no lease and test nothing.
    """
    node = agent.args[agent.args.index("--node") + 1]
    deadline = time.monotonic() + timeout
    while True:
        try:
            held = _held_by(conn, node)
        except psycopg.Error:
            held = []
        if held or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def _busiest(conn: psycopg.Connection, agents: list[Daemon], *, timeout: float = 30.0
             ) -> tuple[Daemon, list[tuple[str, int]]]:
    """Wait (bounded) until one of ``agents`` holds a task; return the one holding the most, and what it holds."""
    deadline = time.monotonic() + timeout
    while True:
        held: dict[str, list[tuple[str, int]]] = {}
        for agent in agents:
            try:
                held[agent.name] = _held_by(conn, agent.args[agent.args.index("--node") + 1])
            except psycopg.Error:
                held[agent.name] = []
        victim = max(agents, key=lambda a: len(held[a.name]))
        if held[victim.name] or time.monotonic() > deadline:
            return victim, held[victim.name]
        time.sleep(0.05)


def _wait_rescued(conn: psycopg.Connection, held: list[tuple[str, int]], *, at_least: float,
                  timeout: float = 45.0) -> float:
    """Keep the fault on for ``at_least`` seconds and until a held attempt's lease has been rescued.

    A fixed pause could end just before the builder's rescue (e.g. while a new leader takes over),
    so the fault would cost no lease and the late report it exists to test would never be sent.
    Returns how long the fault lasted; gives up after ``timeout`` seconds (the gates then tell).
    """
    started = time.monotonic()
    while True:
        elapsed = time.monotonic() - started
        if elapsed >= timeout or (elapsed >= at_least and (not held or _any_rescued(conn, held))):
            return elapsed
        time.sleep(0.1)


def _any_rescued(conn: psycopg.Connection, held: list[tuple[str, int]]) -> bool:
    try:
        return bool(conn.execute(
            "SELECT 1 FROM accs_task t JOIN unnest(%s::uuid[], %s::int[]) AS h(id, attempt) ON t.id = h.id"
            " WHERE t.attempt > h.attempt OR t.status NOT IN ('starting', 'running') LIMIT 1",
            [[t for t, _ in held], [a for _, a in held]]).fetchone())
    except psycopg.Error:
        return False


def _watch(daemons: list[Daemon], sc: Scenario) -> None:
    """Count a daemon that exited by itself, and start it again so the run can go on."""
    for d in daemons:
        if d.proc and d.proc.poll() is not None and not d.expected_exit:
            sc.exited.append(f"{d.name} (exit {d.proc.returncode})")
            d.start()


def _orphans(run_id: str) -> int:
    """Count live processes carrying this run's marker in their environment (the task command)."""
    marker = f"CHAOS_RUN_ID={run_id}".encode()
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"chaos/work.py" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read():
                    count += 1
        except OSError:
            continue
    return count


def _figures(sc: Scenario, conn: psycopg.Connection, ledger: Path, logs: Path, cluster: Cluster, run_id: str,
             daemons: list[Daemon], drained: float, started: float) -> dict:
    for d in daemons:  # stop every daemon before looking for orphans
        d.expected_exit = True
        d.signal(signal.SIGCONT)
        d.signal(signal.SIGTERM)
    for d in daemons:
        try:
            d.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(d.proc.pid, signal.SIGKILL)
    time.sleep(1)
    q = lambda sql, *p: conn.execute(sql, p).fetchone()[0]  # noqa: E731
    lines = [line.split() for line in ledger.read_text().splitlines() if line.strip()]
    latencies = []
    for task, attempt, at in sc.held_at_kill:
        row = conn.execute("SELECT extract(epoch FROM started_at) FROM accs_attempt WHERE task_id = %s"
                           " AND attempt_no > %s ORDER BY attempt_no LIMIT 1", [task, attempt]).fetchone()
        if row and row[0]:
            latencies.append(float(row[0]) - at)
    server_log = cluster.server_log()
    daemon_logs = "".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
    figures = {
        "lost": (q("SELECT count(*) FROM accs_task WHERE status <> 'done'")
                 + max(0, sc.tasks - q("SELECT count(*) FROM accs_task"))),
        "finished_twice": q("SELECT count(*) FROM (SELECT task_id FROM accs_attempt WHERE status = 'succeeded'"
                            " GROUP BY task_id HAVING count(*) > 1) s"),
        "late_reports_accepted": q("SELECT count(*) FROM accs_attempt a JOIN accs_task t ON t.id = a.task_id"
                                   " WHERE a.status = 'succeeded' AND a.attempt_no <> t.attempt"),
        "overlapping_runs": sum(1 for parts in lines if parts[0] == "overlap"),
        "daemons_exited": len(sc.exited),
        "orphans": _orphans(run_id),
        "deadlocks": len(re.findall(r"deadlock detected", server_log + daemon_logs)),
    }
    return {
        "gates": figures,
        "passed": all(v == 0 for v in figures.values()),
        "seed": sc.seed, "tasks": sc.tasks, "agents": sc.agents, "lease_seconds": LEASE_SECONDS,
        "faults": sc.faults, "daemons_exited_detail": sc.exited,
        "fenced_reports_recorded": q("SELECT count(*) FROM accs_event WHERE type = 'fenced'"),
        # Attempts the builder ended because their lease ran out: as a failure (no heartbeat), or as
        # an interruption when the lease ended during an outage the pulse recorded.
        "lease_rescues": {
            "expired": q("SELECT count(*) FROM accs_attempt WHERE error_text LIKE 'lease_expired%%'"),
            "in_outage": q("SELECT count(*) FROM accs_attempt WHERE status = 'interrupted'"
                           " AND error_text LIKE 'outage:%%'"),
        },
        "attempts": q("SELECT count(*) FROM accs_attempt"),
        "runs_started": sum(1 for parts in lines if parts[0] == "start"),
        "rescue_latency_s": {"n": len(latencies),
                             "p50": round(statistics.median(latencies), 2) if latencies else None,
                             "max": round(max(latencies), 2) if latencies else None},
        "drain_s": round(drained, 1), "wall_s": round(time.monotonic() - started, 1),
        "tasks_per_s": round(sc.tasks / drained, 1) if drained else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="ACCS fault scenario; prints JSON, exits 1 if a gate is not 0.")
    parser.add_argument("--tasks", type=int, default=int(os.environ.get("CHAOS_TASKS", "2000")))
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("CHAOS_SEED", str(random.randrange(1 << 16)))))
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds to wait for the drain.")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder (cluster, logs, ledger).")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
