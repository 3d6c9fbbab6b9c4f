"""Compare ACCS with its peers measured in the same session (``make bench-compare``).

Runs ``../shared/bench-peers/run_all.sh`` with one repetition on a copy of that folder (the
original is never written), then ``bench/run.py`` and ``bench/tasks_api.py`` (Django's Tasks
framework on ACCS, beside django-tasks' database backend from the same run), then writes
``bench/results/compare.json`` and
a table of ratios (ACCS ÷ best peer) and puts that table, with the date and machine, into the
README between the ``bench:start`` and ``bench:end`` markers.

``python bench/compare.py --render-only`` rebuilds compare.json and the README table from the
results already on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_SRC = ROOT.parent / "shared" / "bench-peers"
PEERS_COPY = Path(os.environ.get("ACC_BENCH_PEERS_DIR", "/tmp/accs-bench-peers"))
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"

# (label, ACCS key, higher is better, [(peer, file, path into its JSON), ...])
MEASURES = [
    ("enqueue one by one (jobs/s)", "enqueue_rate_single", True,
     [("Procrastinate", "procrastinate.json", ("enqueue", "one_by_one_sync", "median")),
      ("django-tasks", "django_tasks.json", ("enqueue", "one_by_one", "median"))]),
    ("enqueue batch (jobs/s)", "enqueue_rate_bulk", True,
     [("Procrastinate", "procrastinate.json", ("enqueue", "batch_defer_1000", "median")),
      ("django-tasks", "django_tasks.json", ("enqueue", "one_by_one_in_atomic", "median"))]),
    ("drain, 1 process (tasks/s)", "drain_tps_1_agent", True,
     [("Procrastinate", "procrastinate.json", ("drain", "1proc", "median")),
      ("django-tasks", "django_tasks.json", ("drain", "1proc", "median"))]),
    ("drain, 2 processes (tasks/s)", "drain_tps_2_agents", True,
     [("Procrastinate", "procrastinate.json", ("drain", "2proc", "median")),
      ("django-tasks", "django_tasks.json", ("drain", "2proc", "median"))]),
    ("pick-up p50 (ms)", "pickup_p50_ms", False,
     [("Procrastinate", "procrastinate.json", ("latency", "p50_ms")),
      ("django-tasks", "django_tasks.json", ("latency", "p50_ms"))]),
    ("pick-up p95 (ms)", "pickup_p95_ms", False,
     [("Procrastinate", "procrastinate.json", ("latency", "p95_ms")),
      ("django-tasks", "django_tasks.json", ("latency", "p95_ms"))]),
    # Django's Tasks framework: ``task.enqueue()`` and a task's pick-up (process isolation, the
    # default of a Tasks service), beside django-tasks' database backend doing the same.
    ("Tasks API: task.enqueue() one by one (jobs/s)", "tasks_enqueue_one_by_one", True,
     [("django-tasks", "django_tasks.json", ("enqueue", "one_by_one", "median"))]),
    ("Tasks API: pick-up p50 (ms)", "tasks_pickup_process_p50_ms", False,
     [("django-tasks", "django_tasks.json", ("latency", "p50_ms"))]),
    ("Tasks API: pick-up p95 (ms)", "tasks_pickup_process_p95_ms", False,
     [("django-tasks", "django_tasks.json", ("latency", "p95_ms"))]),
]


def _dig(data: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return float(data) if isinstance(data, (int, float)) else None


def run_peers() -> None:
    """Run the peers' benchmarks once on a private copy of their folder."""
    if PEERS_COPY.exists():
        shutil.rmtree(PEERS_COPY)
    shutil.copytree(PEERS_SRC, PEERS_COPY, ignore=shutil.ignore_patterns("results"))
    # The extras include pgbench's enqueue ceiling: one narrow INSERT per autocommitted transaction.
    env = {**os.environ, "BENCH_REPS": "1", "BENCH_EXTRAS": "1"}
    subprocess.run(["bash", str(PEERS_COPY / "run_all.sh")], cwd=PEERS_COPY, env=env, check=True)


def run_accs() -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / "run.py")], cwd=ROOT, check=True)
    # As many enqueues as the peers make, and the pick-up of the default (process) isolation.
    env = {**os.environ, "BENCH_PEERS_DIR": str(PEERS_COPY), "BENCH_TASKS_PARTS": "enqueue,process",
           "BENCH_TASKS_N": os.environ.get("BENCH_TASKS_N", "20000")}
    subprocess.run([sys.executable, str(ROOT / "bench" / "tasks_api.py")], cwd=ROOT, env=env, check=True)


def compare(peers_dir: Path) -> dict:
    """Return the comparison document from ACCS's latest.json and the peers' results folder."""
    accs = json.loads((RESULTS / "latest.json").read_text())
    tasks_api = RESULTS / "tasks_api.json"
    if tasks_api.exists():  # the Tasks framework's figures, under keys of their own
        accs.update({f"tasks_{key}": value for key, value in json.loads(tasks_api.read_text()).items()
                     if isinstance(value, (int, float))})
    peers = {p.name: json.loads(p.read_text()) for p in peers_dir.glob("*.json")}
    rows = []
    for label, key, higher, sources in MEASURES:
        figures = {peer: _dig(peers.get(file, {}), path) for peer, file, path in sources}
        figures = {k: v for k, v in figures.items() if v}
        best_peer = (max if higher else min)(figures, key=figures.get) if figures else None
        ours = accs.get(key)
        ratio = round(ours / figures[best_peer], 2) if best_peer and ours else None
        rows.append({"measure": label, "key": key, "higher_is_better": higher, "accs": ours, "peers": figures,
                     "best_peer": best_peer, "ratio_accs_to_best_peer": ratio})
    ceiling = _dig(peers.get("raw_sql.json", {}), ("extras", "enqueue1_autocommit_insert_c1_10s", "tps"))
    single = accs.get("enqueue_rate_single")
    measured = accs.get("meta", {}).get("when")  # when bench/run.py ran, not when this rendered
    when = (time.strftime("%Y-%m-%d %H:%M UTC", time.strptime(measured, "%Y-%m-%dT%H:%M:%SZ")) if measured
            else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return {"when": when,
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "peers_dir": str(peers_dir), "rows": rows,
            "ceiling": {"narrow_insert_per_txn_c1_tps": ceiling,
                        "accs_enqueue_one_by_one_share": round(single / ceiling, 3) if ceiling and single else None}}


def table(doc: dict) -> str:
    """Render the comparison as a Markdown table."""
    lines = [f"Measured {doc['when']} on {doc['machine']}, peers and ACCS in one session "
             "(`make bench-compare`).", "",
             "| measure | ACCS | best peer | ACCS ÷ best peer |", "|---|---|---|---|"]
    for row in doc["rows"]:
        peer = f"{row['peers'][row['best_peer']]:,.1f} ({row['best_peer']})" if row["best_peer"] else "—"
        ratio = row["ratio_accs_to_best_peer"]
        better = "" if ratio is None else (" (better)" if (ratio > 1) == row["higher_is_better"] and ratio != 1 else "")
        ours = f"{row['accs']:,.1f}" if row["accs"] is not None else "—"
        lines.append(f"| {row['measure']} | {ours} | {peer} | {ratio if ratio is not None else '—'}{better} |")
    ceiling = doc.get("ceiling") or {}
    if ceiling.get("narrow_insert_per_txn_c1_tps"):
        share = ceiling.get("accs_enqueue_one_by_one_share")
        lines += ["", f"Physical ceiling in the same run: pgbench inserting one narrow row per transaction (one "
                  f"connection, fsync on) made {ceiling['narrow_insert_per_txn_c1_tps']:,.0f} rows/s; ACCS's "
                  f"one-by-one enqueue is {share:.0%} of it." if share is not None else
                  f"Physical ceiling in the same run: pgbench inserting one narrow row per transaction (one "
                  f"connection, fsync on) made {ceiling['narrow_insert_per_txn_c1_tps']:,.0f} rows/s."]
    return "\n".join(lines)


def write(doc: dict) -> str:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compare.json").write_text(json.dumps(doc, indent=2))
    rendered = table(doc)
    text = README.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        README.write_text(f"{head}{START}\n{rendered}\n{END}{tail}")
    return rendered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-only", action="store_true", help="Compare the results already on disk.")
    args = parser.parse_args()
    if not args.render_only:
        run_peers()
        run_accs()
    peers_dir = PEERS_COPY / "results" if (PEERS_COPY / "results").exists() else PEERS_SRC / "results"
    print(write(compare(peers_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
