"""Executors (AGT3, AGT5): how an agent runs one attempt of a task.

Each executor's ``run(task, ctx)`` blocks in a worker thread and returns an Outcome. It reports
start (pid), progress and log lines through ``ctx``; the agent batches those into the database.

* ``command``: argv from the service template (params rendered as separate arguments, never a
  shell) in its own process group. stdout → JSON results, stderr lines → log events
  (``::progress:: 0.5`` lines → progress), exit code 0 = success. Timeout and cancel kill the
  whole process group.
* ``python``: a dotted callable ``fn(params, ctx)`` returning a JSON-able dict.
* ``http``: POST ``{job_id, task_id, attempt, params}`` to a local service, optionally started by a
  start command and stopped after it was idle for a while.
* ``simulate``: an unstable network with seeded delays, errors and timeouts.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobs.claim import ClaimedTask
from jobs.transitions import Outcome

TAIL_CHARS = 4000
PROGRESS_RE = re.compile(r"^::progress::\s*([0-9.]+)\s*$")
SECRET_KEY_RE = re.compile(r"(pass(word)?|secret|token|api[_-]?key|credential)", re.I)
KILL_GRACE_SECONDS = 3.0


def secrets_in(params: dict[str, Any]) -> list[str]:
    """Return the values of params whose names look secret, to redact from logs and tails."""
    found: list[str] = []
    for key, value in params.items():
        if isinstance(value, dict):
            found += secrets_in(value)
        elif SECRET_KEY_RE.search(key) and isinstance(value, (str, int)) and len(str(value)) >= 3:
            found.append(str(value))
    return found


def redact(text: str, secrets: list[str]) -> str:
    """Replace every secret value in ``text`` with ``***``."""
    for secret in secrets:
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

    def log(self, message: str, *, level: str = "info") -> None:
        self.on_log(level, redact(message, self.secrets))

    def progress(self, value: float) -> None:
        self.on_progress(value)


class Executor(Protocol):
    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome: ...


def _outcome(task: ClaimedTask, status: str, **fields: Any) -> Outcome:
    return Outcome(task_id=task.id, attempt=task.attempt, status=status, **fields)


def render_argv(template: list[str], params: dict[str, Any]) -> list[str]:
    """Render each argv element with ``str.format`` over params; each stays one argument."""
    values = {k: (json.dumps(v) if isinstance(v, (dict, list)) else ("" if v is None else str(v))) for k, v in params.items()}
    out = []
    for arg in template:
        try:
            out.append(arg.format_map(values))
        except KeyError as exc:
            raise ValueError(f"argv placeholder {exc} has no value in params") from None
    if out and out[0] == "python":
        out[0] = sys.executable  # the agent's own interpreter, so demo tools need no PATH set-up
    return out


class CommandExecutor:
    """Run a CLI tool following the ACCS contract (no shell, own process group)."""

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        try:
            argv = render_argv(ctx.service_config.get("argv", []), task.params)
        except ValueError as exc:
            return _outcome(task, "failed", error=str(exc), retryable=False, error_code="bad_params")
        env = dict(os.environ)
        env.update(ACCS_JOB_ID=str(task.job_id), ACCS_TASK_ID=str(task.id), ACCS_TASK_KEY=task.task_key,
                   ACCS_ATTEMPT=str(task.attempt), ACCS_HOST=task.host or "", ACCS_PARAMS=json.dumps(task.params))
        if ctx.output_dir:
            env["ACCS_OUTPUT_DIR"] = ctx.output_dir
        if ctx.input_dir:
            env["ACCS_INPUT_DIR"] = ctx.input_dir
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, text=True, errors="replace")
        except OSError as exc:
            return _outcome(task, "failed", error=f"cannot start {argv[0]!r}: {exc}", error_code="spawn_failed")
        ctx.on_started(proc.pid)
        stdout_chunks: list[str] = []
        stderr_tail: deque[str] = deque(maxlen=200)

        def read_stdout() -> None:
            stdout_chunks.append(proc.stdout.read())

        def read_stderr() -> None:
            for line in proc.stderr:
                line = line.rstrip("\n")
                match = PROGRESS_RE.match(line)
                if match:
                    ctx.progress(float(match.group(1)))
                    continue
                stderr_tail.append(line)
                ctx.log(line, level="info")

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
                _kill_group(proc)
                break
        proc.wait()
        for reader in readers:
            reader.join(timeout=5)
        stdout = "".join(stdout_chunks)
        tails = {"stdout_tail": redact(stdout[-TAIL_CHARS:], ctx.secrets),
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
        try:
            results = json.loads(stdout) if stdout.strip() else {}
        except json.JSONDecodeError:
            return _outcome(task, "failed", error="stdout is not JSON (the CLI contract wants one JSON value)",
                            error_code="bad_stdout", retryable=False, **tails)
        return _outcome(task, "succeeded", results=results, **tails)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the whole process group: SIGTERM, then SIGKILL after a short grace."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=KILL_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # also children that outlived the leader
    except ProcessLookupError:
        pass


_callables: dict[str, Callable] = {}


def load_callable(path: str) -> Callable:
    """Import ``package.module:function`` (or dotted) once."""
    fn = _callables.get(path)
    if fn is None:
        module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        fn = _callables[path] = getattr(importlib.import_module(module), attr)
    return fn


class PythonExecutor:
    """Call a Python function inside the agent process.

    A timeout is reported as such, but the thread cannot be killed: Python offers no safe way to
    stop a running function. Use the ``command`` executor for work that must be killable.
    """

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        ctx.on_started(os.getpid())
        try:
            fn = load_callable(ctx.service_config["callable"])
            results = fn(task.params, ctx)
        except Exception as exc:  # noqa: BLE001 - user code may raise anything; it becomes the attempt's error
            tail = redact(traceback.format_exc()[-TAIL_CHARS:], ctx.secrets)
            return _outcome(task, "failed", error=redact(f"{type(exc).__name__}: {exc}"[:500], ctx.secrets),
                            error_code="exception", stderr_tail=tail)
        if ctx.cancel.is_set():
            return _outcome(task, "canceled", error="canceled")
        return _outcome(task, "succeeded", results=results if results is not None else {})


class HttpExecutor:
    """POST the task to a local HTTP service; start it on demand and stop it when idle."""

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
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self._wait_ready(config)
            self._last_used[key] = time.monotonic()

    @staticmethod
    def _wait_ready(config: dict[str, Any], timeout: float = 15.0) -> None:
        url = config.get("health_url") or config["url"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=1)  # noqa: S310 - loopback only (validated)
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
        except OSError as exc:
            return _outcome(task, "failed", error=f"cannot start the service: {exc}", error_code="spawn_failed")
        ctx.on_started(None)
        body = json.dumps({"job_id": str(task.job_id), "task_id": str(task.id), "attempt": task.attempt,
                           "task_key": task.task_key, "params": task.params}).encode()
        request = urllib.request.Request(config["url"], data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=task.timeout_seconds) as response:  # noqa: S310
                payload = response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")[-TAIL_CHARS:]
            return _outcome(task, "failed", error=f"HTTP {exc.code} from the service", error_code="http_status",
                            stdout_tail=redact(text, ctx.secrets))
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


def scratch_dir(task: ClaimedTask) -> str:
    """Return a fresh directory for a command's output files."""
    return tempfile.mkdtemp(prefix=f"accs-{str(task.id)[:8]}-{task.attempt}-")
