"""Each migration newer than the previous release is applied alone while that release's daemons work.

The previous release is ``PREVIOUS_RELEASE`` in the Makefile (a git revision, checked out with
``git worktree``); ``bench/upgrade_drill.py --each-migration`` runs it on a private PostgreSQL
cluster (a builder, an agent, its web and a job stream through the HTTP API) and applies this tree's
migrations one at a time (``migrate APP MIGRATION``). After each: the old daemons logged no error line
and none of their statements waited for a lock over 0.5 s; at the end every job accepted has run
exactly once and finished.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.daemons import ROOT


def previous_release() -> str:
    found = re.search(r"^PREVIOUS_RELEASE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile names no PREVIOUS_RELEASE"
    return found.group(1)


def test_each_new_migration_applies_under_the_previous_releases_running_daemons():
    argv = [sys.executable, str(ROOT / "bench" / "upgrade_drill.py"), "--each-migration", "--previous",
            previous_release(), "--builders", "1", "--agents", "1", "--slots", "6", "--long-seconds", "2", "5",
            "--warmup", "4", "--drain-timeout", "60"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    per_migration = result["per_migration"]
    # This release has migrations the previous one lacks; each was applied, and the old daemons noticed nothing.
    assert per_migration, result
    bad = [m for m in per_migration if m["exit"] or m["old_error_lines"] or m["old_blocked_over_0_5s"]]
    assert not bad, (bad, result["old_error_detail"], result["blocked_detail"])
    assert result["gates"] == {"lost": 0, "run_twice": 0, "stuck": 0, "refused": 0, "old_error_lines": 0,
                               "old_blocked_over_0_5s": 0, "leader_overlaps": 0, "leader_gap_over_lease": 0,
                               "old_token_after_migrate_failed": 0, "migrate_failed": 0}, result
    assert result["jobs_accepted"] > 10 and result["tasks"] >= result["jobs_accepted"], result
    assert proc.returncode == 0
