"""Where the suite's CPU goes, test by test: ``make test PYTEST_ARGS="-p tests.cpu_profile"``.

For each test (setup, call and teardown together) one JSON line in ``.local/cpu-profile/<worker>.jsonl``:
the wall seconds, the CPU seconds of the pytest process itself, of the processes it started and
reaped (daemons, ``manage.py`` runs, the browser through its driver; the scripts its fork server
forked and reaped) and of the worker's PostgreSQL
cluster (the postmaster, the backends it reaped and the ones still alive). The machine's other work
is not counted, so the figures hold under parallel workers. Not counted either: servers that detach
from the test (the private clusters of the chaos and upgrade tests, the local S3 server). To list
the costliest tests::

    cat .local/cpu-profile/*.jsonl | jq -s 'sort_by(-(.self + .children + .postgres)) | .[:20]'
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def _proc_times(pid: int) -> tuple[int, float, float]:
    """(parent pid, own CPU seconds, reaped children's CPU seconds) of ``pid`` from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, (int(fields[13]) + int(fields[14])) / TICK


def _cluster_cpu() -> float:
    """CPU seconds of the PostgreSQL cluster this process uses (0 when there is none to read)."""
    pid_file = ROOT / os.environ.get("ACC_PG_DIR", ".local/pg") / "data" / "postmaster.pid"
    try:
        postmaster = int(pid_file.read_text().split()[0])
        _, own, reaped = _proc_times(postmaster)
    except (OSError, ValueError, IndexError):
        return 0.0
    total = own + reaped
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                parent, child_own, child_reaped = _proc_times(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
            if parent == postmaster:
                total += child_own + child_reaped
    return total


def _forked_cpu() -> float:
    """CPU seconds of this process's fork servers (tests/forkserver.py) and the scripts they forked and
    reaped: those are the fork servers' children, not ours, until a server ends."""
    from tests import forkserver

    total = 0.0
    for pid in forkserver.server_pids():
        try:
            _, own, reaped = _proc_times(pid)
        except (OSError, ValueError, IndexError):
            continue
        total += own + reaped
    return total


def _sample() -> dict[str, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": time.monotonic(), "self": me.ru_utime + me.ru_stime,
            "children": kids.ru_utime + kids.ru_stime + _forked_cpu(), "postgres": _cluster_cpu()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    before = _sample()
    yield
    after = _sample()
    row = {"test": item.nodeid, **{k: round(after[k] - before[k], 3) for k in before}}
    out = ROOT / ".local" / "cpu-profile"
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
