"""The ``python`` executor: a dotted callable ``fn(params, ctx)`` returning a JSON-able dict.

It runs in the worker thread; its timeout and cancel are enforced by raising an exception inside
that thread (a callable blocked in C code is stopped when it returns to Python). With
``"isolation": "process"`` it runs in a child interpreter instead, which can always be killed.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from jobs.claim import ClaimedTask
from jobs.transitions import Outcome
from nodes.executors.base import TAIL_CHARS, RunContext, _outcome, redact
from nodes.executors.processes import run_process, task_env

# --------------------------------------------------------------------------------------------

_callables: dict[str, Callable] = {}


def load_callable(path: str) -> Callable:
    """Import ``package.module:function`` (or dotted) once."""
    fn = _callables.get(path)
    if fn is None:
        module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        fn = _callables[path] = getattr(importlib.import_module(module), attr)
    return fn


class TaskStopped(BaseException):
    """Raised inside a worker thread whose callable must stop (timeout or cancel).

    A BaseException, so a callable's ``except Exception`` does not swallow it.
    """


# Its public name, as before the package split: error texts and jobs.tasks_backend name the class by it.
TaskStopped.__module__ = "nodes.executors"

class _StoppableCall:
    """One callable running in a worker thread, which the stopper may interrupt exactly once."""

    def __init__(self, *, deadline: float, cancel: threading.Event, grace: Callable[[], float]) -> None:
        self.thread_id = threading.get_ident()
        self.deadline = deadline
        self.cancel = cancel
        self.grace = grace
        self.reason = ""
        self._canceled_at: float | None = None
        self._lock = threading.Lock()
        self._active = True

    def due(self, now: float) -> str:
        """Return why the call must be interrupted now ("timeout", "canceled"), or ""."""
        if now > self.deadline:
            return "timeout"
        if self.cancel.is_set():
            # A cooperative callable sees ctx.cancel and returns by itself; interrupt it only
            # after the same grace a process group gets.
            self._canceled_at = self._canceled_at or now
            if now - self._canceled_at >= self.grace():
                return "canceled"
        return ""

    def interrupt(self, reason: str) -> None:
        with self._lock:
            if not self._active or self.reason:
                return
            self.reason = reason
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), ctypes.py_object(TaskStopped))

    def finish(self) -> None:
        """Leave the callable: no interruption may land after this (a pending one is withdrawn)."""
        with self._lock:
            if self._active and self.reason:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
            self._active = False


class _Stopper:
    """A daemon thread that interrupts python callables past their timeout or cancel grace."""

    def __init__(self) -> None:
        self._calls: set[_StoppableCall] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, call: _StoppableCall) -> None:
        with self._lock:
            self._calls.add(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="accs-python-stopper", daemon=True)
                self._thread.start()
        self._wake.set()

    def discard(self, call: _StoppableCall) -> None:
        with self._lock:
            self._calls.discard(call)

    def _run(self) -> None:
        while True:
            with self._lock:
                calls = list(self._calls)
            if not calls:
                self._wake.wait()
                self._wake.clear()
                continue
            now = time.monotonic()
            for call in calls:
                reason = call.due(now)
                if reason:
                    call.interrupt(reason)
            time.sleep(0.05)


_stopper = _Stopper()

# Run in a child interpreter for "isolation": "process": the callable gets a ctx whose log and
# progress go to stderr (the command contract) and whose cancel is set by SIGTERM.
PROCESS_RUNNER = r"""
import importlib, json, os, signal, sys, threading, traceback
from types import SimpleNamespace
# The agent's import path (a site's manage.py may extend sys.path), so the child imports what it does.
sys.path[:0] = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
cancel = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: cancel.set())
if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django
    django.setup()

class Ctx:
    def __init__(self):
        self.cancel = cancel
        self.service_config = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
        self.task = SimpleNamespace(id=os.environ.get("ACCS_TASK_ID"), job_id=os.environ.get("ACCS_JOB_ID"),
                                    attempt=int(os.environ.get("ACCS_ATTEMPT") or 1),
                                    task_key=os.environ.get("ACCS_TASK_KEY", ""))
        self.node = os.environ.get("ACCS_NODE", "")
        self.agent_id = os.environ.get("ACCS_AGENT_ID", "")
    def progress(self, value):
        print("::progress:: %f" % float(value), file=sys.stderr, flush=True)
    def log(self, message, *, level="info"):
        level = {"warning": "warn", "critical": "error"}.get(level, level)
        level = level if level in ("debug", "info", "warn", "error") else "info"
        for line in str(message).splitlines() or [""]:
            print("::log::%s::%s" % (level, line), file=sys.stderr, flush=True)

path = sys.argv[1]
module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
fn = getattr(importlib.import_module(module), attr)
try:
    result = fn(json.loads(os.environ["ACCS_PARAMS"]), Ctx())
except BaseException as exc:  # SystemExit too: whatever the callable raises fails the attempt
    traceback.print_exc()
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    first = (str(exc).splitlines() or [""])[0]
    print(f"::error:: {name}: {first}", file=sys.stderr, flush=True)
    os._exit(1)
sys.stdout.write(json.dumps({} if result is None else result, default=str))
"""
ERROR_MARK = "::error:: "


def exception_name(exc: BaseException) -> str:
    """Return the class path Python's tracebacks print: bare for builtins, else module-qualified."""
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _process_error(outcome: Outcome) -> Outcome:
    """Name the child's exception in a failed attempt's error (the runner's ``::error::`` line)."""
    if outcome.status != "failed" or outcome.error_code != "exit_code":
        return outcome
    lines = outcome.stderr_tail.splitlines()
    marks = [line for line in lines if line.startswith(ERROR_MARK)]
    if not marks:
        return outcome
    outcome.error = marks[-1][len(ERROR_MARK):][:500]
    outcome.error_code = "exception"
    outcome.stderr_tail = "\n".join(line for line in lines if not line.startswith(ERROR_MARK)) + "\n"
    return outcome


class PythonExecutor:
    """Call a Python function; enforce its timeout and cancel.

    By default the callable runs in the worker thread (fast: no process per task); on timeout,
    or when it ignores a cancel for the grace period, an exception (:class:`TaskStopped`) is
    raised inside it. Code blocked in C (a long ``time.sleep``, a socket read) is stopped when it
    returns to Python. ``"isolation": "process"`` runs the callable in a child interpreter that
    is killed like a command's process group.
    """

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        config = ctx.service_config
        if config.get("isolation") == "process":
            argv = [sys.executable, "-c", PROCESS_RUNNER, config["callable"], json.dumps(config), json.dumps(sys.path)]
            # "inherit_env": the child runs the agent's own Django code (a site's @task functions), which
            # needs the agent's settings and database; any other child gets only task_env's few names.
            env = {**os.environ, **task_env(task, ctx)} if config.get("inherit_env") is True else None
            return _process_error(run_process(task, ctx, argv, env=env))
        ctx.on_started(os.getpid())
        call = _StoppableCall(deadline=time.monotonic() + task.timeout_seconds, cancel=ctx.cancel,
                              grace=lambda: ctx.kill_grace)
        _stopper.add(call)
        try:
            try:
                fn = load_callable(config["callable"])
                results = fn(task.params, ctx)
            finally:
                call.finish()
        except TaskStopped:
            call.finish()
            if call.reason == "timeout":
                return _outcome(task, "timeout",
                                error=f"timeout after {task.timeout_seconds}s: the callable was interrupted",
                                error_code="timeout")
            return _outcome(task, "canceled", error="canceled: the callable was interrupted")
        except BaseException as exc:  # noqa: BLE001 - user code may raise anything, SystemExit included
            # It becomes the attempt's error, named as a traceback names it; letting a BaseException
            # through would end the worker without a report and leave the task running for good. A real
            # Ctrl-C reaches the agent's main thread, never this one.
            tail = redact(traceback.format_exc()[-TAIL_CHARS:], ctx.secrets)
            return _outcome(task, "failed", error=redact(f"{exception_name(exc)}: {exc}"[:500], ctx.secrets),
                            error_code="exception", stderr_tail=tail)
        finally:
            _stopper.discard(call)
        if ctx.cancel.is_set():
            return _outcome(task, "canceled", error="canceled")
        return _outcome(task, "succeeded", results=results if results is not None else {})
