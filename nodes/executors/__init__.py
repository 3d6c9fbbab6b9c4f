"""Executors: how an agent runs one attempt of a task, one kind per module.

* :mod:`~nodes.executors.base`: the attempt's context (:class:`RunContext`), the executor protocol,
  secrets and redaction, cleaning output before it reaches the database, the site's allow-lists;
* :mod:`~nodes.executors.processes`: running an attempt as an OS process (the CLI contract:
  stdout → JSON results, stderr → log lines at their level, exit code) and the processes that
  die with the agent;
* :mod:`~nodes.executors.command`: ``command``, argv from the service template (no shell);
* :mod:`~nodes.executors.python`: ``python``, a dotted callable, in the worker thread or a child process;
* :mod:`~nodes.executors.http`: ``http``, a POST to a local service started on demand;
* :mod:`~nodes.executors.simulate`: ``simulate``, an unstable network with seeded delays and errors.
* :mod:`~nodes.executors.sandbox`: what a task can reach of the agent (not dumpable) and of other
  attempts (the opt-in bubblewrap sandbox of a command service).

Every name is importable from ``nodes.executors`` as before the package split.
"""

from __future__ import annotations

# Callers reach the module as nodes.executors.subprocess (the tests patch its Popen).
import subprocess  # noqa: F401

from nodes.executors.base import (
    INHERITED_ENV,
    KILL_GRACE_SECONDS,
    MAX_ERROR_CHARS,
    MAX_LOG_LINE_CHARS,
    MAX_RESULTS_BYTES,
    SECRET_KEY_RE,
    TAIL_CHARS,
    BadOutput,
    Executor,
    RunContext,
    agent_secrets,
    bad_output,
    clean_results,
    clean_text,
    not_allowed,
    output_violation,
    parse_results,
    redact,
    remove_scratch,
    render_argv,
    sanitize_outcome,
    secrets_in,
)
from nodes.executors.command import CommandExecutor
from nodes.executors.http import HttpExecutor
from nodes.executors.processes import (
    LEVEL_PREFIX_RE,
    LOG_MARK_RE,
    PR_SET_PDEATHSIG,
    PROGRESS_RE,
    STDERR_LEVEL,
    STDERR_LEVELS,
    agent_alive,
    die_with_parent,
    end_orphan_groups,
    orphans_on_node,
    ours,
    processes_in_group,
    run_process,
    service_env,
    stderr_level,
    task_env,
)
from nodes.executors.python import (
    ERROR_MARK,
    PROCESS_RUNNER,
    PythonExecutor,
    TaskStopped,
    exception_name,
    load_callable,
)
from nodes.executors.simulate import SimulateExecutor

__all__ = [
    "ERROR_MARK", "INHERITED_ENV", "KILL_GRACE_SECONDS", "LEVEL_PREFIX_RE", "LOG_MARK_RE", "MAX_ERROR_CHARS",
    "MAX_LOG_LINE_CHARS", "MAX_RESULTS_BYTES", "PROCESS_RUNNER", "PROGRESS_RE", "PR_SET_PDEATHSIG", "SECRET_KEY_RE",
    "STDERR_LEVEL", "STDERR_LEVELS", "TAIL_CHARS", "BadOutput", "CommandExecutor", "Executor", "HttpExecutor",
    "PythonExecutor", "RunContext", "SimulateExecutor", "TaskStopped", "agent_alive", "agent_secrets", "bad_output",
    "clean_results", "clean_text", "die_with_parent", "end_orphan_groups", "exception_name", "load_callable",
    "make_executors", "not_allowed", "orphans_on_node", "ours", "output_violation", "parse_results",
    "processes_in_group", "redact", "remove_scratch", "render_argv", "run_process", "sanitize_outcome", "secrets_in",
    "service_env", "stderr_level", "task_env",
]


def make_executors() -> dict[str, Executor]:
    """Return one executor instance per kind (they are shared by the agent's worker threads)."""
    return {"command": CommandExecutor(), "python": PythonExecutor(), "http": HttpExecutor(),
            "simulate": SimulateExecutor()}
