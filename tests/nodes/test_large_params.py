"""Params of any size the site allows reach a task's process: they travel in a file only the attempt's
OS user can read (``ACCS_PARAMS_FILE``), and small ones also in ``ACCS_PARAMS`` as before. Linux refuses
one environment string over 128 KiB, so params that travelled in the environment alone kept a process
from starting at all ("Argument list too long"). Real agents, real processes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api
from jobs.claim import ClaimedTask
from jobs.ids import short_id
from jobs.models import Attempt, Task
from nodes.executors import CommandExecutor, PythonExecutor, RunContext, python as python_executor
from nodes.executors.base import remove_scratch
from nodes.executors.processes import PARAMS_ENV_MAX_BYTES
from nodes.executors.python import WarmPool
from nodes.scratch import scratch_root
from tests.daemons import wait_all_final

HERE = "tests.nodes.test_large_params"
MIB = 1024 * 1024
#: Linux's limit on one argument or environment string (MAX_ARG_STRLEN).
MAX_ARG_STRLEN = 128 * 1024

# A command task that reads its params file and prints what it found: their digest (the results limit
# is 1 MB, so the params cannot come back whole), whether ACCS_PARAMS came too, and the file's mode.
READ_PARAMS = r"""
import hashlib, json, os, stat
path = os.environ["ACCS_PARAMS_FILE"]
with open(path, encoding="utf-8") as fh:
    params = json.load(fh)
small = os.environ.get("ACCS_PARAMS")
print(json.dumps({"digest": hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest(),
                  "env_params_equal": None if small is None else json.loads(small) == params,
                  "mode": stat.S_IMODE(os.stat(path).st_mode),
                  "folder_mode": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)}))
"""


def digest(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """The python callable of the tests: what READ_PARAMS prints, for the params the callable was given."""
    path = os.environ["ACCS_PARAMS_FILE"]
    small = os.environ.get("ACCS_PARAMS")
    return {"digest": _digest(params), "env_params_equal": None if small is None else json.loads(small) == params,
            "mode": stat.S_IMODE(os.stat(path).st_mode),
            "folder_mode": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode), "ppid": os.getppid()}


def _digest(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


def _params(size: int) -> dict[str, Any]:
    """Return params whose JSON is ``size`` bytes (at least 40), with text that is not all one character."""
    head = {"blob": "", "n": 1}
    room = size - len(json.dumps(head).encode())
    assert room >= 0, size
    text = (hashlib.sha256(b"params").hexdigest() * (room // 64 + 1))[:room]
    params = {"blob": text, "n": 1}
    assert len(json.dumps(params).encode()) == size
    return params


def _expect(results: dict[str, Any], params: dict[str, Any]) -> None:
    size = len(json.dumps(params).encode())
    assert results["digest"] == _digest(params), "the task read other params than it was started with"
    assert (results["mode"], results["folder_mode"]) == (0o600, 0o700), results
    if size <= PARAMS_ENV_MAX_BYTES:
        assert results["env_params_equal"] is True, "small params also travel in ACCS_PARAMS, as before the file"
    else:
        assert results["env_params_equal"] is None, "large params travel in the file only"


# --------------------------------------------------------------------------------------------
# Real agents: a 1 MiB payload reaches a command task and a process-isolated callable, warm and cold
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_one_mib_params_payload_reaches_command_and_process_isolated_python_tasks_intact(make_service, daemons,
                                                                                         db_url):
    params = _params(MIB)
    make_service("cli", executor="command", max_attempts=1,
                 executor_config={"argv": ["python", "-c", READ_PARAMS.replace("{", "{{").replace("}", "}}")]})
    make_service("warm", executor="python", max_attempts=1,
                 executor_config={"callable": f"{HERE}:digest", "isolation": "process"})
    make_service("cold", executor="python", max_attempts=1,
                 executor_config={"callable": f"{HERE}:digest", "isolation": "process", "warm": False})
    jobs = {key: api.start_service(key, params=params) for key in ("cli", "warm", "cold")}
    daemons.agent("n1", "cli,warm,cold")
    wait_all_final(db_url, timeout=90)
    for key, job in jobs.items():
        task = Task.objects.get(job=job)
        attempt = Attempt.objects.filter(task=task).first()
        assert task.status == "done", (key, task.error_message, attempt and attempt.stderr_tail)
        _expect(task.results, params)
        assert not list(scratch_root().glob(f"accs-{short_id(task.id)}-*")), "the params folder goes with the attempt"


# --------------------------------------------------------------------------------------------
# The executors themselves, over sizes around Linux's per-string limit
# --------------------------------------------------------------------------------------------

def _task(params: dict[str, Any]) -> ClaimedTask:
    return ClaimedTask(id=uuid.uuid4(), job_id=uuid.uuid4(), task_key="t", attempt=1, params=params,
                       timeout_seconds=60, host=None, service_key="s")


def _run(executor: Any, params: dict[str, Any], config: dict[str, Any]) -> tuple[Any, RunContext]:
    task = _task(params)
    ctx = RunContext(task=task, service_config=config, on_started=lambda pid: None, on_progress=lambda value: None,
                     on_log=lambda level, text: None, node="params-node", agent_id="params-agent")
    try:
        return executor.run(task, ctx), ctx
    finally:
        remove_scratch(ctx)


# Sizes at the edges that matter: ACCS_PARAMS's own limit and Linux's per-string limit (the name and
# "=" count against it too), and anywhere between and beyond.
EDGES = [PARAMS_ENV_MAX_BYTES - 1, PARAMS_ENV_MAX_BYTES, PARAMS_ENV_MAX_BYTES + 1, MAX_ARG_STRLEN - 14,
         MAX_ARG_STRLEN - 13, MAX_ARG_STRLEN - 1, MAX_ARG_STRLEN, MAX_ARG_STRLEN + 1]
SIZES = st.sampled_from(EDGES) | st.integers(min_value=MAX_ARG_STRLEN - 4096, max_value=MAX_ARG_STRLEN + 4096) \
    | st.integers(min_value=40, max_value=3 * MAX_ARG_STRLEN)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=SIZES)
def test_params_of_any_size_around_the_environment_limit_reach_a_command_process(size):
    params = _params(size)
    outcome, ctx = _run(CommandExecutor(), params, {"argv": ["python", "-c", READ_PARAMS.replace("{", "{{")
                                                              .replace("}", "}}")]})
    assert outcome.status == "succeeded", (size, outcome.error, outcome.stderr_tail)
    _expect(outcome.results, params)
    assert ctx.params_dir and not os.path.exists(ctx.params_dir), "the params folder goes with the attempt"


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch):
    pool = WarmPool(size=1)
    monkeypatch.setattr(python_executor, "warm_pool", pool)
    yield pool
    pool.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=SIZES, warm=st.booleans())
def test_params_of_any_size_around_the_environment_limit_reach_a_process_isolated_callable(pool, size, warm):
    params = _params(size)
    config = {"callable": f"{HERE}:digest", "isolation": "process", "warm": warm}
    outcome, _ = _run(PythonExecutor(), params, config)
    assert outcome.status == "succeeded", (size, warm, outcome.error, outcome.stderr_tail)
    _expect(outcome.results, params)
    if warm:
        (zygote,) = pool.zygotes()
        assert outcome.results["ppid"] == zygote.proc.pid, "the warm parent serves an attempt whatever its params' size"


def test_the_params_file_is_its_owners_alone_in_a_folder_of_its_own():
    outcome, ctx = _run(CommandExecutor(), {"a": 1}, {"argv": ["python", "-c", READ_PARAMS.replace("{", "{{")
                                                               .replace("}", "}}")]})
    assert outcome.status == "succeeded", outcome.error
    assert outcome.results["mode"] == 0o600 and outcome.results["folder_mode"] == 0o700
    assert Path(ctx.params_file or "").name == "params.json"
    assert ctx.params_dir == os.path.dirname(ctx.params_file or "")
