"""The warm pool of process-isolated python attempts: each attempt is a fresh fork of a warm parent
(zygote) per service, isolated as a cold child is, killed at its timeout, and gone with the agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.claim import ClaimedTask
from nodes.executors import PythonExecutor, RunContext, python as python_executor
from nodes.executors.python import WarmPool

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests.nodes.test_warm_pool"
_SEEN: list[int] = []  # module state an attempt changes: a later attempt must not see it


def describe(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    _SEEN.append(1)
    return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "seen": len(_SEEN),
            "task_id": os.environ.get("ACCS_TASK_ID"), "params": params,
            "agent_names": sorted(name for name in os.environ if name.startswith("ACC_"))}


def raises(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    raise ValueError("the task's own error")


def spawn_and_hang(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Start a grandchild, write both pids to ``params["file"]``, then hang."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(params["file"]).write_text(json.dumps({"child": os.getpid(), "parent": os.getppid(),
                                                "grandchild": grandchild.pid}))
    time.sleep(120)
    return {}


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] == "Z"  # a zombie has ended
    except OSError:
        return True


def _wait_until(check, *, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(0.05)


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[WarmPool]:
    pool = WarmPool(size=2)
    monkeypatch.setattr(python_executor, "warm_pool", pool)
    yield pool
    pool.close()


def run(fn: str, params: dict[str, Any] | None = None, *, timeout: int = 60, **config: Any):
    task = ClaimedTask(id=uuid.uuid4(), job_id=uuid.uuid4(), task_key="t", attempt=1, params=params or {},
                       timeout_seconds=timeout, host=None, service_key="s")
    started: list[int | None] = []
    ctx = RunContext(task=task, service_config={"callable": fn, "isolation": "process", **config},
                     on_started=started.append, on_progress=lambda value: None, on_log=lambda level, text: None,
                     node="warm-node", agent_id="warm-agent", kill_grace=0.2)
    outcome = PythonExecutor().run(task, ctx)
    return task, outcome, started


def test_attempts_fork_from_one_warm_parent_and_share_no_memory_nor_the_agents_settings(pool, monkeypatch):
    monkeypatch.setenv("ACC_WARM_TEST_SECRET", "not for tasks")
    first_task, first, _ = run(f"{HERE}:describe", {"n": 1})
    second_task, second, started = run(f"{HERE}:describe", {"n": 2})
    assert (first.status, second.status) == ("succeeded", "succeeded"), (first.error, second.error)
    a, b = first.results, second.results
    (zygote,) = pool.zygotes()
    assert a["ppid"] == b["ppid"] == zygote.proc.pid != os.getpid(), "both forked by the service's warm parent"
    assert a["pid"] != b["pid"] and started == [b["pid"]]
    assert (a["seen"], b["seen"]) == (1, 1), "the second attempt saw what the first left in memory"
    assert (a["task_id"], b["task_id"]) == (str(first_task.id), str(second_task.id))
    assert (a["params"], b["params"]) == ({"n": 1}, {"n": 2})
    assert a["agent_names"] == [], "an ACC_* setting of the agent reached the task"
    assert a["pgid"] == a["pid"], "each attempt is its own process group"


def test_another_service_gets_its_own_warm_parent(pool):
    _, one, _ = run(f"{HERE}:describe")
    _, other, _ = run(f"{HERE}:describe", env={"COLOUR": "blue"})
    assert one.results["ppid"] != other.results["ppid"], "two services shared a warm parent"
    assert len(pool.zygotes()) == 2


def test_an_exception_fails_the_attempt_named_as_a_cold_child_names_it(pool):
    _, warm, _ = run(f"{HERE}:raises")
    _, cold, _ = run(f"{HERE}:raises", warm=False)
    assert (warm.status, warm.error_code, warm.error) == (cold.status, cold.error_code, cold.error) == (
        "failed", "exception", "ValueError: the task's own error")
    assert "Traceback" in warm.stderr_tail and len(pool.zygotes()) == 1


def test_a_timeout_kills_the_attempt_and_its_process_group_and_the_parent_serves_on(pool, tmp_path):
    pids = tmp_path / "pids.json"
    _, outcome, _ = run(f"{HERE}:spawn_and_hang", {"file": str(pids)}, timeout=2)
    assert (outcome.status, outcome.error_code) == ("timeout", "timeout"), outcome.error
    found = json.loads(pids.read_text())
    _wait_until(lambda: _gone(found["child"]) and _gone(found["grandchild"]), timeout=10,
                message="the timed-out attempt and its grandchild to end")
    assert not _gone(found["parent"]) and found["parent"] in [z.proc.pid for z in pool.zygotes()]
    _, after, _ = run(f"{HERE}:describe")
    assert after.status == "succeeded"


def test_the_pool_is_bounded_and_the_least_recently_used_idle_parent_makes_room(monkeypatch):
    pool = WarmPool(size=1)
    monkeypatch.setattr(python_executor, "warm_pool", pool)
    try:
        _, first, _ = run(f"{HERE}:describe")
        first_parent = first.results["ppid"]
        _, second, _ = run(f"{HERE}:describe", env={"COLOUR": "blue"})
        assert second.results["ppid"] != first_parent
        assert [z.proc.pid for z in pool.zygotes()] == [second.results["ppid"]]
        _wait_until(lambda: _gone(first_parent), timeout=10, message="the evicted warm parent to end")
    finally:
        pool.close()


def test_a_pool_of_size_zero_starts_a_fresh_interpreter_per_attempt(monkeypatch):
    monkeypatch.setattr(python_executor, "warm_pool", WarmPool(size=0))
    _, outcome, _ = run(f"{HERE}:describe")
    assert outcome.status == "succeeded" and outcome.results["ppid"] == os.getpid()


def test_a_parent_that_cannot_start_leaves_the_attempt_to_a_cold_start_and_its_error(pool):
    _, outcome, _ = run("tests.nodes.no_such_module:fn")
    assert outcome.status == "failed" and "ModuleNotFoundError" in outcome.error
    assert pool.zygotes() == []


AGENT = """
import json, os, sys, threading, time, uuid
sys.path.insert(0, {root!r})
import django
django.setup()
from jobs.claim import ClaimedTask
from nodes.executors import PythonExecutor, RunContext
from nodes.executors.python import warm_pool
task = ClaimedTask(id=uuid.uuid4(), job_id=uuid.uuid4(), task_key="t", attempt=1, params={{"file": {file!r}}},
                   timeout_seconds=600, host=None, service_key="s")
ctx = RunContext(task=task, service_config={{"callable": "{here}:spawn_and_hang", "isolation": "process"}},
                 on_started=lambda pid: None, on_progress=lambda v: None, on_log=lambda level, text: None,
                 node="warm-node", agent_id="warm-agent")
threading.Thread(target=PythonExecutor().run, args=(task, ctx), daemon=True).start()
while not warm_pool.zygotes() or warm_pool.zygotes()[0].proc is None:
    time.sleep(0.05)
print(json.dumps({{"zygote": warm_pool.zygotes()[0].proc.pid}}), flush=True)
time.sleep(600)
"""


def test_an_agent_killed_by_sigkill_takes_its_warm_parents_and_their_attempts_with_it(tmp_path):
    pids = tmp_path / "pids.json"
    script = AGENT.format(root=str(ROOT), file=str(pids), here=HERE)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "accs_site.settings"}
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert agent.stdout is not None
        zygote = json.loads(agent.stdout.readline())["zygote"]
        _wait_until(lambda: pids.exists() and pids.read_text(), timeout=60, message="the attempt to start")
        found = json.loads(pids.read_text())
        assert not _gone(zygote) and not _gone(found["child"])
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        # The grandchild is the next agent's to end (end_orphan_groups), as with a cold child.
        _wait_until(lambda: _gone(zygote) and _gone(found["child"]), timeout=10,
                    message="the warm parent and its attempt to die with the agent")
    finally:
        if agent.poll() is None:
            agent.kill()
        if pids.exists() and pids.read_text():
            try:
                os.kill(json.loads(pids.read_text())["grandchild"], signal.SIGKILL)
            except ProcessLookupError:
                pass
