"""The ``python`` executor: a dotted callable ``fn(params, ctx)`` returning a JSON-able dict.

It runs in the worker thread; its timeout and cancel are enforced by raising an exception inside
that thread (a callable blocked in C code is stopped when it returns to Python). With
``"isolation": "process"`` it runs in a child interpreter instead, which can always be killed.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from hashlib import sha1
from typing import IO

from accs_site.conf import accs
from jobs.claim import ClaimedTask
from jobs.transitions import Outcome
from nodes.executors.base import TAIL_CHARS, RunContext, _outcome, redact
from nodes.executors.guard import Refused, check_process
from nodes.executors.processes import (
    agent_marks,
    attempt_env,
    die_with_parent,
    run_process,
    service_env,
    supervise,
    task_env,
)
from nodes.executors.sandbox import refusal

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
# progress go to stderr (the command contract) and whose cancel is set by SIGTERM. Built from parts
# that a warm child (below) runs too: the imports, the attempt's own setup, Django, the call.
_RUNNER_IMPORTS = r"""
import importlib, json, os, signal, sys, threading, traceback
from types import SimpleNamespace
"""
_RUNNER_PATH = r"""
# The agent's import path (a site's manage.py may extend sys.path), so the child imports what it does.
sys.path[:0] = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
"""
_RUNNER_CANCEL = r"""
cancel = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: cancel.set())
"""
_RUNNER_DJANGO = r"""
if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django
    django.setup()
"""
_RUNNER_CALL = r"""
class Ctx:
    def __init__(self):
        self.cancel = cancel
        self.service_config = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
        self.task = SimpleNamespace(id=os.environ.get("ACCS_TASK_ID"), job_id=os.environ.get("ACCS_JOB_ID"),
                                    attempt=int(os.environ.get("ACCS_ATTEMPT") or 1),
                                    task_key=os.environ.get("ACCS_TASK_KEY", ""))
        self.node = os.environ.get("ACCS_NODE", "")
        self.agent_id = os.environ.get("ACCS_AGENT_ID", "")
        self.inputs = {}  # the parent steps' outputs, from the file the agent wrote (ACCS_INPUTS)
        if os.environ.get("ACCS_INPUTS"):
            with open(os.environ["ACCS_INPUTS"], encoding="utf-8") as fh:
                self.inputs = json.load(fh)
    def task_output(self, parent):
        if parent not in self.inputs:
            raise KeyError("%r is not a step this task depends on (its parents: %s)" % (parent, sorted(self.inputs)))
        return self.inputs[parent]
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
    # Params of any size travel in a file (one environment variable holds at most 128 KiB).
    with open(os.environ["ACCS_PARAMS_FILE"], encoding="utf-8") as params_file:
        params = json.load(params_file)
    result = fn(params, Ctx())
except BaseException as exc:  # SystemExit too: whatever the callable raises fails the attempt
    traceback.print_exc()
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    first = (str(exc).splitlines() or [""])[0]
    print(f"::error:: {name}: {first}", file=sys.stderr, flush=True)
    os._exit(1)
sys.stdout.write(json.dumps({} if result is None else result, default=str))
"""
PROCESS_RUNNER = _RUNNER_IMPORTS + _RUNNER_PATH + _RUNNER_CANCEL + _RUNNER_DJANGO + _RUNNER_CALL

# A warm parent ("zygote") for one (service, environment): it starts as the cold runner would (same
# argv, same environment minus the attempt's own ACCS_* names), sets Django up and imports the
# service's modules, then waits on its control socket. For each attempt the agent sends the attempt's
# ACCS_* variables and the write ends of the attempt's stdout and stderr pipes; the zygote forks, and
# the fork runs the attempt exactly as the cold runner does (_RUNNER_CANCEL + _RUNNER_CALL) in a
# fresh copy of the zygote's memory, then exits. The zygote never runs a task itself, so no attempt
# sees what another left in memory. Replies: b"ready", {"pid": n} per attempt in order, {"exit": pid,
# "code": n} when a fork ends. A fork is its own process group (the agent kills the group at a timeout)
# and gets SIGKILL when the zygote dies; the zygote gets it when the agent dies.
WARM_RUNNER = _RUNNER_IMPORTS + _RUNNER_PATH + _RUNNER_DJANGO + r"""
import ctypes, gc, select, socket
control = socket.socket(fileno=int(sys.argv[4]))
for name in json.loads(sys.argv[5]):
    importlib.import_module(name)
if "django.db" in sys.modules:
    from django.db import connection, connections
    try:  # a first connection and query load the database driver and its adapters here, once
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception:
        pass
    connections.close_all()  # each fork opens its own connection: a socket must never be shared
ATTEMPT = compile(sys.argv[6], "<accs-attempt>", "exec")
libc = ctypes.CDLL(None, use_errno=True)
zygote = os.getpid()
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
gc.freeze()  # what the zygote holds stays shared with its forks: a fork's collections do not copy it

def become_attempt_process():
    os.setpgid(0, 0)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the zygote
    if os.getppid() != zygote:
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    control.close()
    os.close(wake_r)
    os.close(wake_w)

def attempt(request, fds):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    os.environ.update(request["env"])
    code = 0
    try:
        exec(ATTEMPT, {"__name__": "__main__"})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # what the cold runner's interpreter prints and exits 1 for (an import error)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

def fork_spare():
    # The next attempt's process, forked ahead, so an attempt does not wait for the fork. It opens no
    # database connection while it waits: a spare must not hold a server connection idle (the
    # attempt connects when its code first queries, as a cold one does).
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        become_attempt_process()
        message, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 2)
        if not message:
            os._exit(0)
        theirs.close()
        attempt(json.loads(message), fds)
    theirs.close()
    try:
        os.setpgid(pid, pid)  # also here: the agent may kill the group before the fork has run a line
    except OSError:
        pass
    return pid, ours

spare = fork_spare()
control.send(b"ready")
while True:
    readable = select.select([control, wake_r], [], [])[0]
    if wake_r in readable:
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if not pid:
            break
        control.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
    if control in readable:
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        if not message:  # the agent closed the pool
            os._exit(0)
        pid, channel = spare
        try:
            socket.send_fds(channel, [message], fds)
        except OSError:  # the spare is gone: fork this attempt now
            pid = os.fork()
            if pid == 0:
                become_attempt_process()
                attempt(json.loads(message), fds)
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass
        channel.close()
        for fd in fds:
            os.close(fd)
        control.send(json.dumps({"pid": pid}).encode())
        spare = fork_spare()
"""
_WARM_ATTEMPT = _RUNNER_IMPORTS + _RUNNER_CANCEL + _RUNNER_CALL
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


# --------------------------------------------------------------------------------------------
# The warm pool: one zygote per (service, environment), bounded per agent
# --------------------------------------------------------------------------------------------

#: The largest attempt request a zygote takes (its ACCS_* variables: params travel in their file, and in
#: ACCS_PARAMS only up to PARAMS_ENV_MAX_BYTES, so every attempt fits); a larger one starts cold.
MAX_WARM_REQUEST = 256 * 1024
#: A zygote nobody used for this long ends (its memory back; code deployed since is imported afresh).
WARM_IDLE_SECONDS = 300.0
#: How long an attempt waits for its service's zygote to finish starting before it starts cold.
WARM_READY_SECONDS = 30.0
#: After a zygote failed to start (its imports or Django's setup raised), attempts of its service start
#: cold for this long: the cold start reports the error as the attempt's.
WARM_RETRY_SECONDS = 60.0


class WarmChild:
    """An attempt forked by a zygote: what :func:`nodes.executors.processes.supervise` reads and waits on.

    Not our child (the zygote's), so its exit code arrives over the zygote's control socket.
    """

    def __init__(self, pid: int, stdout_fd: int, stderr_fd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        # Unbuffered bytes: supervise reads them in bounded chunks.
        self.stdout: IO[bytes] | None = open(stdout_fd, "rb", buffering=0)  # noqa: SIM115 - closed with the process
        self.stderr: IO[bytes] | None = open(stderr_fd, "rb", buffering=0)  # noqa: SIM115
        self._done = threading.Event()

    def exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("warm attempt", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def close(self) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()


class _Request:
    """One attempt sent to a zygote, waiting for the pid of its fork."""

    def __init__(self, stdout_fd: int, stderr_fd: int) -> None:
        self.fds = (stdout_fd, stderr_fd)
        self.child: WarmChild | None = None
        self.answered = threading.Event()


class Zygote:
    """The agent's side of one warm parent process: start it, hand it attempts, hear of their exits."""

    def __init__(self, key: str, argv: list[str], env: dict[str, str]) -> None:
        self.key = key
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.settled = threading.Event()  # ready, or dead before it was
        self.ready = False
        self.dead = False
        self.last_used = time.monotonic()
        self._lock = threading.Lock()
        self._pending: deque[_Request] = deque()
        self._children: dict[int, WarmChild] = {}

    def spawn(self) -> None:
        """Start the zygote (called by the pool's own thread: the parent-death signal follows the thread
        that forked, and that thread lives as long as the agent)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [*self.argv, str(theirs.fileno()), json.dumps(warm_modules(self.argv)), _WARM_ATTEMPT],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env,
                pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=die_with_parent())
        except OSError:
            ours.close()
            self._died()
            return
        finally:
            theirs.close()
        self.sock = ours
        threading.Thread(target=self._read, name=f"accs-warm-{self.key[:8]}", daemon=True).start()

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._children) + len(self._pending)

    def start(self, env: dict[str, str]) -> WarmChild | None:
        """Fork an attempt with ``env`` added to the zygote's environment; None when this zygote cannot."""
        request = json.dumps({"env": env}).encode()
        if not self.ready or self.dead or self.sock is None or len(request) > MAX_WARM_REQUEST:
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pending = _Request(out_r, err_r)
        try:
            with self._lock:
                self._pending.append(pending)
                try:
                    socket.send_fds(self.sock, [request], [out_w, err_w])
                except OSError:
                    self._pending.remove(pending)
                    raise
        except OSError:
            for fd in (out_r, err_r):
                os.close(fd)
            return None
        finally:
            os.close(out_w)
            os.close(err_w)
        if not pending.answered.wait(10.0) or pending.child is None:
            # A zygote that does not fork within seconds is broken: end it (its forks die with it).
            self.kill()
            return None
        return pending.child

    def kill(self) -> None:
        """End the zygote and, through their parent-death signal, every attempt it forked."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _read(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            if data == b"ready":
                self.ready = True
                self.settled.set()
                continue
            message = json.loads(data)
            with self._lock:
                if "pid" in message and self._pending:
                    pending = self._pending.popleft()
                    child = WarmChild(message["pid"], *pending.fds)
                    self._children[child.pid] = child
                    pending.child = child
                    pending.answered.set()
                elif "exit" in message:
                    found = self._children.pop(message["exit"], None)
                    if found is not None:
                        found.exited(message["code"])
        self._died()

    def _died(self) -> None:
        self.dead = True
        self.settled.set()
        with self._lock:
            children, self._children = list(self._children.values()), {}
            pending, self._pending = list(self._pending), deque()
        for child in children:  # they got SIGKILL with the zygote
            child.exited(-signal.SIGKILL)
        for request in pending:
            for fd in request.fds:
                os.close(fd)
            request.answered.set()
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            self.kill()
            self.proc.wait()


def warm_modules(argv: list[str]) -> list[str]:
    """Return the modules a zygote imports before any attempt: the callable's and, for a Django task, the task's."""
    path = argv[3]
    modules = [path.partition(":")[0] if ":" in path else path.rpartition(".")[0]]
    task = json.loads(argv[4]).get("task")
    if isinstance(task, str) and "." in task:
        modules.append(task.rpartition(".")[0])
    return [m for m in modules if m]


class WarmPool:
    """Zygotes for process-isolated python services, at most ``size`` per agent (``ACC_WARM_POOL_SIZE``).

    A zygote is started on the first process-isolated attempt of its (service, environment) and kept
    while it is used; the least recently used idle one makes room for another service, and one idle
    for :data:`WARM_IDLE_SECONDS` ends. When none can be had (size 0, the pool full of busy zygotes, a
    zygote that failed to start, a request too large), the attempt starts a fresh interpreter as before.
    """

    def __init__(self, *, size: int | None = None) -> None:
        self._size = size
        self._zygotes: dict[str, Zygote] = {}
        self._failed: dict[str, float] = {}
        self._lock = threading.Lock()
        self._to_spawn: deque[Zygote] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def size(self) -> int:
        return self._size if self._size is not None else accs.warm_pool_size

    def start(self, argv: list[str], env: dict[str, str], attempt: dict[str, str]) -> WarmChild | None:
        """Fork the attempt from the zygote of (argv, env), starting that zygote when needed; None: start cold."""
        if self.size <= 0 or not sys.platform.startswith("linux"):  # the parent-death signal is Linux's
            return None
        key = sha1(json.dumps([argv, sorted(env.items())]).encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            if self._failed.get(key, 0.0) > now:
                return None
            zygote = self._zygotes.get(key)
            if zygote is None or zygote.dead:
                zygote = self._add(key, argv, env)
                if zygote is None:
                    return None
            zygote.last_used = now
        if not zygote.settled.wait(WARM_READY_SECONDS) or not zygote.ready:
            with self._lock:
                if zygote.dead and self._zygotes.get(key) is zygote:
                    del self._zygotes[key]
                    self._failed[key] = time.monotonic() + WARM_RETRY_SECONDS
            return None
        return zygote.start(attempt)

    def _add(self, key: str, argv: list[str], env: dict[str, str]) -> Zygote | None:
        """Make room (the least recently used idle zygote ends) and queue a new zygote; under the lock."""
        for old_key, old in list(self._zygotes.items()):
            if old.dead:
                del self._zygotes[old_key]
        if len(self._zygotes) >= self.size:
            idle = [z for z in self._zygotes.values() if z.ready and z.running == 0]
            if not idle:
                return None
            victim = min(idle, key=lambda z: z.last_used)
            del self._zygotes[victim.key]
            victim.kill()
        zygote = self._zygotes[key] = Zygote(key, argv, env)
        self._to_spawn.append(zygote)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="accs-warm-pool", daemon=True)
            self._thread.start()
            atexit.register(self.close)
        self._wake.set()
        return zygote

    def _run(self) -> None:
        """Start queued zygotes; end those idle too long."""
        while True:
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            while True:
                with self._lock:
                    zygote = self._to_spawn.popleft() if self._to_spawn else None
                if zygote is None:
                    break
                zygote.spawn()
            now = time.monotonic()
            with self._lock:
                stale = [z for z in self._zygotes.values()
                         if z.ready and z.running == 0 and now - z.last_used > WARM_IDLE_SECONDS]
                for zygote in stale:
                    del self._zygotes[zygote.key]
            for zygote in stale:
                zygote.kill()

    def zygotes(self) -> list[Zygote]:
        with self._lock:
            return list(self._zygotes.values())

    def close(self) -> None:
        """End every zygote and the attempts they forked (the agent's exit; its death does the same by signal)."""
        with self._lock:
            zygotes, self._zygotes = list(self._zygotes.values()), {}
            self._to_spawn.clear()
        for zygote in zygotes:
            zygote.kill()


warm_pool = WarmPool()


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
        refused = refusal("python", config)
        if refused:
            return _outcome(task, "failed", error=refused, error_code="not_allowed", retryable=False)
        if config.get("isolation") == "process":
            # The warm child gets the same environment as a cold one: checked once, before either starts.
            env = task_env(task, ctx)
            cold_env = {**os.environ, **env} if config.get("inherit_env") is True else env
            try:
                check_process([sys.executable], cold_env, program="agent")
            except Refused as exc:
                return _outcome(task, "failed", error=f"not allowed: {exc}", error_code="not_allowed",
                                retryable=False)
            if config.get("warm", True) is not False:
                child = self._start_warm(task, ctx)
                if child is not None:
                    ctx.on_started(child.pid)
                    try:
                        return _process_error(supervise(child, task, ctx))
                    finally:
                        child.close()
            argv = [sys.executable, "-c", PROCESS_RUNNER, config["callable"], json.dumps(config), json.dumps(sys.path)]
            # "inherit_env": the child runs the agent's own Django code (a site's @task functions), which
            # needs the agent's settings and database; any other child gets only task_env's few names.
            return _process_error(run_process(task, ctx, argv, env=cold_env, program="agent"))
        return self._run_in_thread(task, ctx)

    def _start_warm(self, task: ClaimedTask, ctx: RunContext) -> WarmChild | None:
        """Fork the attempt from its service's zygote (the same environment a cold child gets), or None."""
        config = ctx.service_config
        argv = [sys.executable, "-c", WARM_RUNNER, config["callable"], json.dumps(config), json.dumps(sys.path)]
        base = {**service_env(config), **agent_marks(ctx)}
        if config.get("inherit_env") is True:
            base = {**os.environ, **base}
        return warm_pool.start(argv, base, attempt_env(task, ctx))

    def _run_in_thread(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        config = ctx.service_config
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
