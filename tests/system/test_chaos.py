"""The fault scenario at a small size: every gate is 0 (``make chaos`` runs the full size).

Real agents and builders against a private PostgreSQL cluster: agents killed with SIGKILL, the
leader builder killed, PostgreSQL restarted, an agent frozen past its lease and an agent cut
off from the database through a TCP proxy (see chaos/run.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.daemons import ROOT

pytestmark = pytest.mark.slow


def test_no_task_is_lost_or_finished_twice_and_no_daemon_dies_under_faults():
    proc = subprocess.run([sys.executable, str(ROOT / "chaos" / "run.py"), "--tasks", "300", "--seed", "7"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    result = json.loads(proc.stdout)
    assert result["gates"] == {"lost": 0, "finished_twice": 0, "late_reports_accepted": 0, "overlapping_runs": 0,
                               "daemons_exited": 0, "orphans": 0, "deadlocks": 0}, (result, proc.stderr[-2000:])
    assert {f["fault"] for f in result["faults"]} == {"kill_agent", "kill_leader", "restart_postgres",
                                                      "freeze_agent", "cut_agent"}
    assert sum(result["lease_rescues"].values()) > 0, ("the faults must have cost some leases, or nothing was"
                                                       " tested", result)
    assert proc.returncode == 0
