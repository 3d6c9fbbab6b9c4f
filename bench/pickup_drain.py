"""Interleaved A/B of pick-up and drain between checkouts (``bench/run.py``'s ``pickup()`` and ``drain(2)``).

    python bench/pickup_drain.py one pickup|drain       # one measure in this checkout, prints JSON
    python bench/pickup_drain.py ab DIR_A DIR_B --rounds 3 [--measures pickup,drain]

``ab`` runs each measure in checkout A, then B, then A... (each checkout with its own database, as
its ``.local/pg/port`` says), so both see the same machine load, and prints every run and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(measure: str) -> dict:
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from bench import run

    run.call_command("migrate", verbosity=0)
    run.define_services()
    if measure == "pickup":
        p50, p95 = pickup(run)
        return {"pickup_p50_ms": round(p50, 2), "pickup_p95_ms": round(p95, 2)}
    if measure == "drain":
        return {"drain_tps_2_agents": round(run.drain(2), 1)}
    raise SystemExit(f"unknown measure {measure}")


def wait_for_agent(run, node: str) -> None:
    """Wait until the agent registered its node (a loaded machine may take longer than run.py's 3 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with run.connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM accs_node WHERE name = %s AND agent_id <> ''", [node])
            if cur.fetchone()[0]:
                time.sleep(1.0)  # past its first pass
                return
        time.sleep(0.1)
    raise RuntimeError(f"agent of node {node} did not start")


def stamp_jobs(run) -> None:
    """Once the agent of node ``lat`` is up, start the pick-up's jobs LAT_GAP apart and wait for them."""
    wait_for_agent(run, "lat")
    for _ in range(run.LAT_JOBS):
        run.api.start_service("bench-stamp", params={"t0": time.time()})
        time.sleep(run.LAT_GAP)
    run.progress_wait("pick-up", run.LAT_JOBS, "SELECT count(*) FROM accs_job WHERE status = 'done'")


def pickup(run) -> tuple[float, float]:
    """``run.pickup()``, waiting for the agent to be up before the first job (not a fixed 3 s)."""
    run.reset()
    procs = [run.spawn("runbuilder", "--tick", "1"),
             run.spawn("runagent", "--node", "lat", "--services", "bench-stamp", "--max-concurrent", "4",
                       env={"ACC_POLL_INTERVAL_SEC": "5"})]
    try:
        stamp_jobs(run)
    finally:
        run.stop(procs)
    with run.connection.cursor() as cur:
        cur.execute("SELECT (results->>'latency_ms')::float FROM accs_task WHERE results ? 'latency_ms'")
        lat = sorted(r[0] for r in cur.fetchall())
    q = statistics.quantiles(lat, n=100)
    return q[49], q[94]


def run_in(checkout: str, measure: str) -> dict:
    out = subprocess.run([f"{checkout}/.venv/bin/python", "bench/pickup_drain.py", "one", measure], cwd=checkout,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_one = sub.add_parser("one")
    p_one.add_argument("measure")
    p_ab = sub.add_parser("ab")
    p_ab.add_argument("a")
    p_ab.add_argument("b")
    p_ab.add_argument("--rounds", type=int, default=3)
    p_ab.add_argument("--measures", default="pickup,drain")
    args = parser.parse_args()
    if args.cmd == "one":
        print(json.dumps(one(args.measure)), flush=True)
        return 0
    runs: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for r in range(args.rounds):
        for measure in args.measures.split(","):
            for label, checkout in (("A", args.a), ("B", args.b)) if r % 2 == 0 else (("B", args.b), ("A", args.a)):
                figures = run_in(checkout, measure)
                print(f"round {r + 1} {label} {measure}: {figures}", flush=True)
                for k, v in figures.items():
                    runs[label].setdefault(k, []).append(v)
    for label in ("A", "B"):
        for k, values in runs[label].items():
            print(f"{label} {k}: median {statistics.median(values)}  runs {values}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
