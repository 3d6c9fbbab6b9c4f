"""Executors (AGT3, AGT5): how an agent runs one attempt of a task.

Each executor's ``run(task, ctx)`` blocks in a worker thread and returns an Outcome. It reports
start (pid), progress and log lines through ``ctx``; the agent batches those into the database.

* ``command``: argv from the service template (params rendered as separate arguments, never a
  shell) in its own process group. stdout → JSON results, stderr lines → log events at level
  warn, or at the level a line names first (``ERROR: disk full`` → error, :func:`stderr_level`;
  ``::progress:: 0.5`` lines → progress), exit code 0 = success. Timeout and cancel kill the
  whole process group.
* ``python``: a dotted callable ``fn(params, ctx)`` returning a JSON-able dict, run in the
  worker thread; its timeout and cancel are enforced by raising an exception inside that thread
  (a callable blocked in C code is stopped when it returns to Python). With
  ``"isolation": "process"`` it runs in a child process instead, which can always be killed.
* ``http``: POST ``{job_id, task_id, attempt, params}`` to a local service, optionally started by a
  start command and stopped after it was idle for a while; redirects are not followed.
* ``simulate``: an unstable network with seeded delays, errors and timeouts.

Every process a task starts dies with the agent: the direct child gets a parent-death signal,
and an agent that starts on a node ends the process groups its dead predecessor left (see
:mod:`nodes.agent`). What a task prints is cleaned before it reaches the database
(:func:`sanitize_outcome`): NUL characters are stripped, NaN and Infinity are refused, sizes
are capped, so one task's output can never make a report fail.

Least privilege: a task's process gets an allow-listed environment (:func:`service_env`), never
the agent's ``ACC_*`` settings; the agent's secrets and secret params are redacted from tails,
errors and log lines; and :func:`not_allowed` refuses, before each run, what the site's
``ACC_ALLOWED_*`` lists do not name.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from accs_site.conf import MIN_SECRET_CHARS, known_secrets
from jobs.claim import ClaimedTask
from jobs.transitions import Outcome
from workflows.validation import argv_fields, not_allowed_problems

TAIL_CHARS = 4000
PROGRESS_RE = re.compile(r"^::progress::\s*([0-9.]+)\s*$")
#: A line of stderr that names no level is stored at this one: stderr is where programs complain,
#: so an operator's "≥ warn" filter keeps it (at info, "ERROR: disk full" hid among chatter).
STDERR_LEVEL = "warn"
#: Level words a stderr line may start with, and the timeline level each means.
STDERR_LEVELS = {"debug": "debug", "info": "info", "warn": "warn", "warning": "warn", "err": "error",
                 "error": "error", "critical": "error", "fatal": "error"}
#: A level prefix: ``[error] …`` or ``ERROR: …`` in any case, or a bare upper-case ``WARNING …``.
LEVEL_PREFIX_RE = re.compile(r"^\s*(?:\[\s*([A-Za-z]+)\s*\]|([A-Za-z]+)\s*:|([A-Z]+)\s)")
#: How the python executor's child process hands over a ``ctx.log`` line with its level.
LOG_MARK_RE = re.compile(r"^::log::(debug|info|warn|error)::(.*)$", re.S)
SECRET_KEY_RE = re.compile(r"(pass(word)?|secret|token|api[_-]?key|credential)", re.I)
KILL_GRACE_SECONDS = 3.0
# Results are one JSON document in a jsonb column; a task that needs more stores an artifact.
MAX_RESULTS_BYTES = 1_000_000
MAX_LOG_LINE_CHARS = 8000
MAX_ERROR_CHARS = 2000
# What a task's process inherits from the agent's environment; nothing else (least privilege:
# the agent's database URL, secret key, storage keys and tokens never reach a task).
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "HOME", "TMPDIR", "TZ", "PYTHONPATH",
                 "DJANGO_SETTINGS_MODULE")


def secrets_in(params: Any, *, secret: bool = False) -> list[str]:
    """Return the values of params whose names look secret (every value under such a name, in lists
    and objects too), to redact from logs and tails."""
    found: list[str] = []
    if isinstance(params, dict):
        for key, value in params.items():
            found += secrets_in(value, secret=secret or bool(SECRET_KEY_RE.search(str(key))))
    elif isinstance(params, (list, tuple)):
        for value in params:
            found += secrets_in(value, secret=secret)
    elif secret and isinstance(params, (str, int, float)) and not isinstance(params, bool):
        if len(str(params)) >= MIN_SECRET_CHARS:
            found.append(str(params))
    return found


def agent_secrets() -> list[str]:
    """Return the agent's own secrets (:func:`accs_site.conf.known_secrets`), which no task output,
    error or log line may carry into the database."""
    return known_secrets()


def redact(text: str, secrets: list[str]) -> str:
    """Replace every secret value in ``text`` with ``***`` (longest first, so a URL goes before its password)."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


@dataclass
class RunContext:
    """What an executor may do while it runs: report start, progress and log lines, see cancel."""

    task: ClaimedTask
    service_config: dict[str, Any]
    on_started: Callable[[int | None], None]
    on_progress: Callable[[float], None]
    on_log: Callable[[str, str], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    secrets: list[str] = field(default_factory=list)
    output_dir: str | None = None
    input_dir: str | None = None
    # How long a stopped process group gets between SIGTERM and SIGKILL; the agent shortens it
    # when the lease is at stake (another agent may start the task soon).
    kill_grace: float = KILL_GRACE_SECONDS
    # Why the agent asked the attempt to stop: "cancel" (an operator), "shutdown", "lease".
    stop_reason: str = ""
    log_records: list[dict[str, Any]] = field(default_factory=list)
    node: str = ""
    agent_id: str = ""

    def log(self, message: str, *, level: str = "info") -> None:
        text = clean_text(redact(str(message), self.secrets))[:MAX_LOG_LINE_CHARS]
        self.log_records.append({"ts": _utc_now(), "level": level, "message": text})
        self.on_log(level, text)

    def progress(self, value: float) -> None:
        try:
            value = float(value)
        except (TypeError, ValueError):
            return
        if math.isfinite(value):
            self.on_progress(value)

    def stop(self, reason: str, *, kill_grace: float | None = None) -> None:
        """Ask the attempt to stop (the first reason given wins)."""
        if not self.stop_reason:
            self.stop_reason = reason
        if kill_grace is not None:
            self.kill_grace = min(self.kill_grace, kill_grace)
        self.cancel.set()


def _utc_now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat()


# --------------------------------------------------------------------------------------------
# Cleaning output before it reaches the database
# --------------------------------------------------------------------------------------------

class BadOutput(ValueError):
    """A task's output that can never be stored (NaN, too large, not JSON)."""


def clean_text(text: str) -> str:
    """Strip NUL characters, which PostgreSQL text and jsonb cannot hold."""
    return text.replace("\x00", "") if "\x00" in text else text


def _reject_constant(name: str) -> Any:
    raise BadOutput(f"results contain {name}, which JSON (and PostgreSQL) cannot store")


def clean_results(value: Any, *, depth: int = 0) -> Any:
    """Return ``value`` with NUL stripped from every string (keys too); refuse NaN and Infinity."""
    if depth > 200:
        raise BadOutput("results are nested too deeply")
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadOutput(f"results contain {value}, which JSON (and PostgreSQL) cannot store")
        return value
    if isinstance(value, dict):
        return {clean_text(str(k)): clean_results(v, depth=depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_results(v, depth=depth + 1) for v in value]
    return value


def parse_results(stdout: str) -> Any:
    """Parse a command's stdout as one JSON value; raise BadOutput when it cannot be stored."""
    if not stdout.strip():
        return {}
    if len(stdout.encode(errors="replace")) > MAX_RESULTS_BYTES:
        raise BadOutput(f"stdout is larger than {MAX_RESULTS_BYTES} bytes; store big outputs as files in ACCS_OUTPUT_DIR")
    try:
        return json.loads(stdout, parse_constant=_reject_constant)
    except json.JSONDecodeError:
        raise BadOutput("stdout is not JSON (the CLI contract wants one JSON value)") from None


def sanitize_outcome(outcome: Outcome, *, secrets: list[str] = ()) -> Outcome:
    """Make an outcome storable: clean text fields, redact ``secrets`` from them, check results;
    bad results fail the attempt.

    A result that cannot be stored becomes a final failure (``bad_output``): running the task
    again would print the same thing.
    """
    secrets = list(secrets)
    outcome.error = redact(clean_text(outcome.error or ""), secrets)[:MAX_ERROR_CHARS]
    outcome.stdout_tail = redact(clean_text(outcome.stdout_tail or ""), secrets)[-TAIL_CHARS:]
    outcome.stderr_tail = redact(clean_text(outcome.stderr_tail or ""), secrets)[-TAIL_CHARS:]
    if outcome.results is None:
        return outcome
    try:
        outcome.results = clean_results(outcome.results)
        size = len(json.dumps(outcome.results, default=str, allow_nan=False))
    except (BadOutput, ValueError, TypeError, RecursionError) as exc:
        return bad_output(outcome, str(exc))
    if size > MAX_RESULTS_BYTES:
        return bad_output(outcome, f"results are {size} bytes, more than {MAX_RESULTS_BYTES}; "
                                   "store big outputs as artifacts")
    return outcome


def bad_output(outcome: Outcome, reason: str) -> Outcome:
    """Return a final failure of ``outcome``'s attempt for output that cannot be stored."""
    return Outcome(task_id=outcome.task_id, attempt=outcome.attempt, status="failed",
                   error=clean_text(f"bad output: {reason}")[:MAX_ERROR_CHARS], error_code="bad_output",
                   retryable=False, exit_code=outcome.exit_code, stdout_tail=outcome.stdout_tail,
                   stderr_tail=outcome.stderr_tail)


class Executor(Protocol):
    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome: ...


def _outcome(task: ClaimedTask, status: str, **fields: Any) -> Outcome:
    return Outcome(task_id=task.id, attempt=task.attempt, status=status, **fields)


def render_argv(template: list[str], params: dict[str, Any]) -> list[str]:
    """Render each argv element's plain ``{name}`` fields from params; each stays one argument.

    Anything but a plain name (attributes, indexing, conversions, format specs) is refused, even in
    a row written to the database without validation.
    """
    values = {k: (json.dumps(v) if isinstance(v, (dict, list)) else ("" if v is None else str(v))) for k, v in params.items()}
    out = []
    for arg in template:
        rendered = []
        for literal, name in argv_fields(arg):
            rendered.append(literal)
            if name is not None:
                if name not in values:
                    raise ValueError(f"argv placeholder {name!r} has no value in params")
                rendered.append(values[name])
        out.append("".join(rendered))
    if out and out[0] == "python":
        out[0] = sys.executable  # the agent's own interpreter, so demo tools need no PATH set-up
    return out


# --------------------------------------------------------------------------------------------
# Processes that die with the agent
# --------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - a libc without dlopen(NULL)
    _libc = None


def die_with_parent() -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that makes the child receive SIGKILL when the agent dies.

    Linux sends the signal when the thread that forked the child ends; the agent's worker
    threads live as long as the agent. Grandchildren are not covered: they share the child's
    process group, which the next agent on the node ends (:func:`end_orphan_groups`).
    """
    if _libc is None:
        return None
    parent = os.getpid()
    prctl = _libc.prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the agent died between fork and prctl
            os._exit(1)

    return preexec


def ours(pid: int, *, task_id: str) -> bool:
    """Return whether process ``pid`` was started for task ``task_id`` (never a stranger's pid)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return f"ACCS_TASK_ID={task_id}".encode() in env


def processes_in_group(pgid: int) -> list[int]:
    """Return the pids whose process group is ``pgid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            found.append(int(entry))
    return found


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def agent_alive(agent_id: str) -> bool:
    """Return whether the agent ``hostname:pid:boot-id`` may still run on this machine.

    An agent on another machine, or one whose pid now runs an agent again, counts as alive: the
    safe answer when in doubt is not to kill.
    """
    host, _, rest = agent_id.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return True
    try:
        with open(f"/proc/{pid_text}/cmdline", "rb") as fh:
            return b"runagent" in fh.read()
    except OSError:
        return False


def orphans_on_node(node: str, *, own_agent_id: str) -> list[tuple[int, str]]:
    """Return (process group, task id) of task processes on ``node`` whose agent is dead."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        env = _environ(int(entry))
        agent = env.get(b"ACCS_AGENT_ID", b"").decode(errors="replace")
        if env.get(b"ACCS_NODE") != node.encode() or not agent or agent == own_agent_id:
            continue
        if agent_alive(agent):
            continue
        try:
            found.add((os.getpgid(int(entry)), env.get(b"ACCS_TASK_ID", b"").decode()))
        except ProcessLookupError:
            continue
    return sorted(found)


def end_orphan_groups(candidates: list[tuple[int, str]]) -> list[int]:
    """Kill the process groups of ``(pgid, task_id)`` pairs whose members are ours; return pids killed.

    A pid the kernel has since given to another program is left alone: only processes whose
    environment names the task (``ACCS_TASK_ID``) are signalled.
    """
    killed = []
    for pgid, task_id in candidates:
        for pid in processes_in_group(pgid):
            if ours(pid, task_id=task_id):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
    return killed


# --------------------------------------------------------------------------------------------
# command
# --------------------------------------------------------------------------------------------

class CommandExecutor:
    """Run a CLI tool following the ACCS contract (no shell, own process group)."""

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        try:
            argv = render_argv(ctx.service_config.get("argv", []), task.params)
        except ValueError as exc:
            return _outcome(task, "failed", error=str(exc), retryable=False, error_code="bad_params")
        return run_process(task, ctx, argv)


def not_allowed(task: ClaimedTask, executor: str, config: dict[str, Any]) -> Outcome | None:
    """Return a final failure (``not_allowed``) when this site's allow-lists refuse the service's
    executor config, else None. The agent asks before every run: a row written to the database
    without validation, or an allow-list narrowed since, must not run."""
    problems = not_allowed_problems(executor, config)
    if not problems:
        return None
    return _outcome(task, "failed", error="not allowed: " + "; ".join(str(p) for p in problems),
                    error_code="not_allowed", retryable=False)


def service_env(config: dict[str, Any]) -> dict[str, str]:
    """Return the environment a service's processes start from: the few names in INHERITED_ENV and
    the service's own ``env``; never the agent's ACC_* settings (nor ACCS_* names, which the agent sets)."""
    env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
    extra = config.get("env")
    if isinstance(extra, dict):
        env.update({str(k): str(v) for k, v in extra.items() if not str(k).startswith(("ACC_", "ACCS_"))})
    return env


def task_env(task: ClaimedTask, ctx: RunContext) -> dict[str, str]:
    """Return the environment of a task's process: :func:`service_env` and the CLI contract's ACCS_* variables."""
    env = service_env(ctx.service_config)
    env.update(ACCS_JOB_ID=str(task.job_id), ACCS_TASK_ID=str(task.id), ACCS_TASK_KEY=task.task_key,
               ACCS_ATTEMPT=str(task.attempt), ACCS_HOST=task.host or "", ACCS_PARAMS=json.dumps(task.params))
    # Marks the process as the agent's, so the next agent on the node can find it if it is orphaned.
    env.update(ACCS_NODE=ctx.node, ACCS_AGENT_ID=ctx.agent_id)
    if ctx.output_dir:
        env["ACCS_OUTPUT_DIR"] = ctx.output_dir
    if ctx.input_dir:
        env["ACCS_INPUT_DIR"] = ctx.input_dir
    return env


def stderr_level(line: str) -> str:
    """Return the timeline level of a line a task wrote to stderr: the level it starts with, else warn."""
    match = LEVEL_PREFIX_RE.match(line)
    word = next((g for g in match.groups() if g), "") if match else ""
    return STDERR_LEVELS.get(word.lower(), STDERR_LEVEL)


def _stderr_line(line: str) -> tuple[str, str]:
    """Return a stderr line's level and its text (a python child's ``ctx.log`` line without its mark)."""
    marked = LOG_MARK_RE.match(line)
    if marked:
        return marked.group(1), marked.group(2)
    return stderr_level(line), line


def run_process(task: ClaimedTask, ctx: RunContext, argv: list[str], *, env: dict[str, str] | None = None) -> Outcome:
    """Run ``argv`` as the attempt: stdout → results, stderr → log lines, exit code → status.

    ``env`` replaces :func:`task_env` (a python callable that runs the site's own Django code).
    """
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env=env if env is not None else task_env(task, ctx), start_new_session=True,
                                preexec_fn=die_with_parent(),
                                text=True, errors="replace")
    except OSError as exc:
        return _outcome(task, "failed", error=f"cannot start {argv[0]!r}: {exc}", error_code="spawn_failed")
    ctx.on_started(proc.pid)
    stdout = _Capture(MAX_RESULTS_BYTES + 1)
    stderr_tail: deque[str] = deque(maxlen=200)

    def read_stdout() -> None:
        for chunk in iter(lambda: proc.stdout.read(65536), ""):
            stdout.add(chunk)

    def read_stderr() -> None:
        for line in proc.stderr:
            line = clean_text(line.rstrip("\n"))[:MAX_LOG_LINE_CHARS]
            match = PROGRESS_RE.match(line)
            if match:
                ctx.progress(float(match.group(1)))
                continue
            level, line = _stderr_line(line)
            stderr_tail.append(line)
            ctx.log(line, level=level)

    readers = [threading.Thread(target=read_stdout, daemon=True), threading.Thread(target=read_stderr, daemon=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + task.timeout_seconds
    ended_by = ""
    while proc.poll() is None:
        if ctx.cancel.wait(timeout=0.02):
            ended_by = "canceled"
        elif time.monotonic() > deadline:
            ended_by = "timeout"
        if ended_by:
            # A stop (cancel, timeout, shutdown, lost lease) that comes after the process exited
            # by itself changes nothing: the exit code and results it produced are the outcome.
            if proc.poll() is not None:
                ended_by = ""
                break
            _kill_group(proc, grace=ctx.kill_grace)
            break
    proc.wait()
    for reader in readers:
        reader.join(timeout=5)
    text = clean_text(stdout.text())
    tails = {"stdout_tail": redact(clean_text(stdout.tail), ctx.secrets),
             "stderr_tail": redact("\n".join(stderr_tail)[-TAIL_CHARS:], ctx.secrets), "exit_code": proc.returncode}
    if ended_by == "timeout":
        return _outcome(task, "timeout", error=f"timeout after {task.timeout_seconds}s: process group killed",
                        error_code="timeout", **tails)
    if ended_by == "canceled":
        return _outcome(task, "canceled", error="canceled: process group killed", **tails)
    if proc.returncode != 0:
        last = next((line for line in reversed(stderr_tail) if line.strip()), "")
        return _outcome(task, "failed", error=redact(f"exit code {proc.returncode}: {last}"[:500], ctx.secrets),
                        error_code="exit_code", **tails)
    if stdout.overflow:
        return _outcome(task, "failed", error=f"bad output: stdout is larger than {MAX_RESULTS_BYTES} bytes; "
                        "store big outputs as files in ACCS_OUTPUT_DIR", error_code="bad_output", retryable=False,
                        **tails)
    try:
        results = parse_results(text)
    except BadOutput as exc:
        return _outcome(task, "failed", error=f"bad output: {exc}", error_code="bad_output", retryable=False, **tails)
    return _outcome(task, "succeeded", results=results, **tails)


class _Capture:
    """Keep the first ``limit`` characters of a stream (for results) and its last TAIL_CHARS."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.size = 0
        self.overflow = False
        self.tail = ""

    def add(self, chunk: str) -> None:
        self.tail = (self.tail + chunk)[-TAIL_CHARS:]
        if self.size + len(chunk) > self.limit:
            self.overflow = True
            return
        self.parts.append(chunk)
        self.size += len(chunk)

    def text(self) -> str:
        return "".join(self.parts)


def _kill_group(proc: subprocess.Popen, *, grace: float = KILL_GRACE_SECONDS) -> None:
    """Stop the whole process group: SIGTERM, then SIGKILL after ``grace`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=max(grace, 0.0))
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # also children that outlived the leader
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------------------------
# python
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
                return _outcome(task, "timeout", error=f"timeout after {task.timeout_seconds}s: the callable was interrupted",
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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: a local service's 3xx could point the agent at any address."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None  # urllib then raises HTTPError with the 3xx status


# No proxies either: an http_proxy variable would send "local" requests across the network.
_local_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _read_capped(response: Any, limit: int) -> bytes:
    """Read at most ``limit`` bytes; raise BadOutput when the body is larger."""
    body = response.read(limit + 1)
    if len(body) > limit:
        raise BadOutput(f"the response is larger than {limit} bytes; store big outputs as artifacts")
    return body


class HttpExecutor:
    """POST the task to a local HTTP service; start it on demand and stop it when idle.

    Redirects are not followed and proxies are not used (the request goes to the validated URL
    and nowhere else); a response larger than the results limit fails the attempt.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[str, subprocess.Popen] = {}
        self._last_used: dict[str, float] = {}

    def _ensure_started(self, config: dict[str, Any]) -> None:
        command = config.get("start_command")
        if not command:
            return
        key = json.dumps(command)
        with self._lock:
            proc = self._started.get(key)
            if proc is None or proc.poll() is not None:
                self._started[key] = subprocess.Popen(render_argv(command, {}), start_new_session=True,
                                                      env=service_env(config),
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self._wait_ready(config)
            self._last_used[key] = time.monotonic()

    @staticmethod
    def _wait_ready(config: dict[str, Any], timeout: float = 15.0) -> None:
        url = config.get("health_url") or config["url"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _local_opener.open(url, timeout=1).close()  # noqa: S310 - loopback only (validated)
                return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                time.sleep(0.1)

    def stop_idle(self, idle_seconds_for: Callable[[str], float]) -> None:
        """Stop started services idle for longer than their ``idle_stop_seconds``."""
        with self._lock:
            for key, proc in list(self._started.items()):
                if proc.poll() is None and time.monotonic() - self._last_used.get(key, 0) > idle_seconds_for(key):
                    _kill_group(proc)
                    del self._started[key]

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        config = ctx.service_config
        try:
            self._ensure_started(config)
        except (OSError, ValueError) as exc:
            return _outcome(task, "failed", error=f"cannot start the service: {exc}", error_code="spawn_failed")
        ctx.on_started(None)
        body = json.dumps({"job_id": str(task.job_id), "task_id": str(task.id), "attempt": task.attempt,
                           "task_key": task.task_key, "params": task.params}).encode()
        request = urllib.request.Request(config["url"], data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with _local_opener.open(request, timeout=task.timeout_seconds) as response:  # noqa: S310
                payload = _read_capped(response, MAX_RESULTS_BYTES).decode(errors="replace")
        except urllib.error.HTTPError as exc:
            text = exc.read(TAIL_CHARS * 4).decode(errors="replace")[-TAIL_CHARS:]
            if 300 <= exc.code < 400:
                return _outcome(task, "failed", error=f"HTTP {exc.code} from the service: redirects are not followed"
                                f" (it pointed at {exc.headers.get('Location', '?')[:200]!r})",
                                error_code="http_redirect", retryable=False, stdout_tail=redact(text, ctx.secrets))
            return _outcome(task, "failed", error=f"HTTP {exc.code} from the service", error_code="http_status",
                            stdout_tail=redact(text, ctx.secrets))
        except BadOutput as exc:
            return _outcome(task, "failed", error=f"bad output: {exc}", error_code="bad_output", retryable=False)
        except TimeoutError:
            return _outcome(task, "timeout", error=f"timeout after {task.timeout_seconds}s", error_code="timeout")
        except OSError as exc:
            return _outcome(task, "failed", error=f"service unreachable: {exc}", error_code="http_unreachable")
        try:
            results = json.loads(payload) if payload.strip() else {}
        except json.JSONDecodeError:
            return _outcome(task, "failed", error="response is not JSON", error_code="bad_response",
                            stdout_tail=redact(payload[-TAIL_CHARS:], ctx.secrets))
        return _outcome(task, "succeeded", results=results)


class SimulateExecutor:
    """An unstable network (seed 004, AGT5): seeded random delay, error or timeout per attempt."""

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        config = ctx.service_config
        ctx.on_started(os.getpid())
        rng = random.Random(f"{config.get('seed', 0)}:{task.id}:{task.attempt}")
        delay = rng.uniform(config.get("min_delay_ms", 5), config.get("max_delay_ms", 50)) / 1000
        roll = rng.random()
        if roll < config.get("timeout_rate", 0):
            ctx.cancel.wait(min(task.timeout_seconds, delay * 10))
            return _outcome(task, "timeout", error=f"timeout: simulated network timeout (host {task.host})",
                            error_code="timeout")
        if ctx.cancel.wait(delay):
            return _outcome(task, "canceled", error="canceled")
        if roll < config.get("timeout_rate", 0) + config.get("error_rate", 0):
            ctx.log(f"connection to {task.host or 'target'} reset (simulated)", level="warn")
            return _outcome(task, "failed", error="simulated network error: connection reset", error_code="network")
        ctx.log(f"command acknowledged by {task.host or 'target'} after {delay * 1000:.0f} ms")
        return _outcome(task, "succeeded", results={"host": task.host, "latency_ms": round(delay * 1000, 1)})


def make_executors() -> dict[str, Executor]:
    """Return one executor instance per kind (they are shared by the agent's worker threads)."""
    return {"command": CommandExecutor(), "python": PythonExecutor(), "http": HttpExecutor(),
            "simulate": SimulateExecutor()}


def remove_scratch(ctx: RunContext) -> None:
    """Remove the attempt's scratch directories (after its outputs were collected)."""
    for directory in (ctx.output_dir, ctx.input_dir):
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
