"""Running an attempt as an OS process: its environment, its output, and its death with the agent.

:func:`run_process` runs argv (no shell) in its own process group: stdout → JSON results, stderr
lines → log events (at warn, or at the level a line starts with: :func:`stderr_level`;
``::progress:: 0.5`` lines → progress), exit code 0 = success; a timeout or cancel kills the whole
group. A task's process gets an allow-listed environment (:func:`service_env`), never the agent's
``ACC_*`` settings.

Whatever a task writes costs the agent bounded memory: streams are read in chunks
(:data:`READ_CHUNK_BYTES`), a stderr line longer than :data:`MAX_LINE_BYTES` is cut (and says so)
and the rest of it discarded up to its newline (:func:`bounded_lines`), and stdout beyond the
results limit is drained without being kept (:class:`_Capture`).

Every process a task starts dies with the agent: the direct child gets a parent-death signal, and
an agent that starts on a node ends the process groups its dead predecessor left
(:func:`orphans_on_node`, :func:`end_orphan_groups`; see :mod:`nodes.agent`).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import IO, Any, Literal, Protocol

from jobs.claim import ClaimedTask
from jobs.instantiate import params_json
from jobs.transitions import Outcome
from nodes.executors.base import (
    INHERITED_ENV,
    KILL_GRACE_SECONDS,
    MAX_LOG_LINE_CHARS,
    MAX_RESULTS_BYTES,
    TAIL_CHARS,
    BadOutput,
    RunContext,
    _outcome,
    clean_text,
    parse_results,
    redact,
)
from nodes.executors.guard import Refused, check_process
from nodes.executors.sandbox import SandboxUnavailable, wrap
from nodes.scratch import scratch_dir

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
#: How much of a task's output stream is read at once.
READ_CHUNK_BYTES = 65536
#: The most of one stderr line (log or progress) the agent holds: UTF-8 takes at most four bytes a
#: character, so a kept line still fills a log line. The rest of a longer line is discarded.
MAX_LINE_BYTES = MAX_LOG_LINE_CHARS * 4
#: What ends a line that was cut.
CUT_MARK = " [cut: the line was longer than {limit} bytes]"
#: The most of a process's /proc environ or cmdline the agent reads (a task may set a huge environment).
MAX_PROC_FILE_BYTES = 4 * 1024 * 1024
#: Params of at most this many bytes of JSON also travel in ``ACCS_PARAMS``: half of the most Linux takes
#: in one environment string (MAX_ARG_STRLEN, 128 KiB), so a process always starts. Every size travels
#: in ``ACCS_PARAMS_FILE``.
PARAMS_ENV_MAX_BYTES = 64 * 1024
#: The name of the params file in its scratch folder.
PARAMS_FILE_NAME = "params.json"

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
            env = fh.read(MAX_PROC_FILE_BYTES).split(b"\0")
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
            raw = fh.read(MAX_PROC_FILE_BYTES)
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
            return b"runagent" in fh.read(MAX_PROC_FILE_BYTES)
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
    return {**service_env(ctx.service_config), **agent_marks(ctx), **attempt_env(task, ctx)}


def agent_marks(ctx: RunContext) -> dict[str, str]:
    """Return the names that mark a process as the agent's, so the next agent on the node can find it if
    it is orphaned."""
    return {"ACCS_NODE": ctx.node, "ACCS_AGENT_ID": ctx.agent_id}


def attempt_env(task: ClaimedTask, ctx: RunContext) -> dict[str, str]:
    """Return the CLI contract's ACCS_* variables of one attempt (a warm child receives them when it is handed
    the attempt).

    The params always travel in a file (``ACCS_PARAMS_FILE``), whatever their size; params of at most
    :data:`PARAMS_ENV_MAX_BYTES` also travel in ``ACCS_PARAMS``, as before the file.
    """
    text = params_json(task.params)
    env = {"ACCS_JOB_ID": str(task.job_id), "ACCS_TASK_ID": str(task.id), "ACCS_TASK_KEY": task.task_key,
           "ACCS_ATTEMPT": str(task.attempt), "ACCS_HOST": task.host or "",
           "ACCS_PARAMS_FILE": params_file(task, ctx, text=text)}
    if len(text.encode()) <= PARAMS_ENV_MAX_BYTES:
        env["ACCS_PARAMS"] = text
    if ctx.output_dir:
        env["ACCS_OUTPUT_DIR"] = ctx.output_dir
    if ctx.input_dir:
        env["ACCS_INPUT_DIR"] = ctx.input_dir
    env.update(inputs_env(task, ctx))
    return env


def params_file(task: ClaimedTask, ctx: RunContext, *, text: str) -> str:
    """Return the path of the attempt's params file, writing ``text`` there the first time.

    It sits in a scratch folder of its own (0700, unguessable, removed with the attempt's other folders,
    never collected as an output) and only its OS user may read it (0600). A sandboxed task sees it
    read-only.
    """
    if ctx.params_file:
        return ctx.params_file
    folder = scratch_dir(task)
    ctx.params_dir = folder
    path = os.path.join(folder, PARAMS_FILE_NAME)
    # O_EXCL and O_NOFOLLOW: the file is new, made here, never something that was waiting at its name.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    ctx.params_file = path
    return path


#: The name of the inputs file in its scratch folder.
INPUTS_FILE_NAME = "inputs.json"


def inputs_env(task: ClaimedTask, ctx: RunContext) -> dict[str, str]:
    """Return ``ACCS_INPUTS``: the path of a JSON file holding the outputs of the task's parent steps
    (``{parent step key: output}``), for a task that has parents; nothing for one that has none.

    The file sits in a scratch folder of its own (0700, unguessable, removed with the attempt's other
    folders, never collected as an output) and only its OS user may read it (0600). It is written once
    per attempt, whichever of the cold or warm start asks first.
    """
    if not ctx.inputs:
        return {}
    if ctx.inputs_dir is None:
        folder = scratch_dir(task)
        path = os.path.join(folder, INPUTS_FILE_NAME)
        # O_EXCL and O_NOFOLLOW: the file is new, made here, never something that was waiting at its name.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(ctx.inputs, fh, default=str)
        ctx.inputs_dir = folder
    return {"ACCS_INPUTS": os.path.join(ctx.inputs_dir, INPUTS_FILE_NAME)}


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


def run_process(task: ClaimedTask, ctx: RunContext, argv: list[str], *, env: dict[str, str] | None = None,
                program: Literal["service", "agent"] = "service") -> Outcome:
    """Run ``argv`` as the attempt: stdout → results, stderr → log lines, exit code → status.

    ``env`` replaces :func:`task_env` (a python callable that runs the site's own Django code);
    ``program="agent"``: argv[0] is the agent's own interpreter running its own runner. What is about
    to run is checked against the site's allow-lists first (:func:`nodes.executors.guard.check_process`).
    """
    env = env if env is not None else task_env(task, ctx)
    try:
        checked = check_process(argv, env, program=program)
    except Refused as exc:
        return _outcome(task, "failed", error=f"not allowed: {exc}", error_code="not_allowed", retryable=False)
    try:
        # The file executed is the one the guard checked, also in the sandbox (when the service asks for
        # one), which wraps the argv the guard checked and shows the params and inputs folders read-only.
        executable, command = wrap(argv, config=ctx.service_config, executable=checked,
                                   folders=(ctx.output_dir, ctx.input_dir), readable=(ctx.params_dir, ctx.inputs_dir))
        proc = subprocess.Popen(command, executable=executable, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                preexec_fn=die_with_parent())
    except SandboxUnavailable as exc:
        return _outcome(task, "failed", error=f"not allowed: {exc}", error_code="not_allowed", retryable=False)
    except OSError as exc:
        return _outcome(task, "failed", error=f"cannot start {argv[0]!r}: {exc}", error_code="spawn_failed")
    ctx.on_started(proc.pid)
    return supervise(proc, task, ctx)


class Process(Protocol):
    """What :func:`supervise` needs of a process: a ``Popen``, or a warm child another process forked."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def supervise(proc: Process, task: ClaimedTask, ctx: RunContext) -> Outcome:
    """Read a started attempt's output, stop its process group at the timeout or on cancel, and return
    its outcome (stdout → results, stderr → log lines, exit code → status)."""
    stdout = _Capture(MAX_RESULTS_BYTES + 1)
    stderr_tail: deque[str] = deque(maxlen=200)

    # Both are pipes: Popen was given PIPE for them above.
    proc_stdout, proc_stderr = proc.stdout, proc.stderr
    assert proc_stdout is not None and proc_stderr is not None

    def read_stdout() -> None:
        for chunk in chunks(proc_stdout):
            stdout.add(chunk)

    def read_stderr() -> None:
        for raw, cut in bounded_lines(chunks(proc_stderr)):
            line = clean_text(line_text(raw, cut=cut))
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


def chunks(stream: IO[bytes]) -> Iterator[bytes]:
    """Yield what a pipe delivers, at most :data:`READ_CHUNK_BYTES` at a time, as soon as it arrives."""
    fd = stream.fileno()
    while chunk := os.read(fd, READ_CHUNK_BYTES):
        yield chunk


def bounded_lines(pieces: Iterator[bytes], *, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[bytes, bool]]:
    """Yield ``(line, cut)`` for each newline-ended line of a byte stream (and a last unended one).

    A line holds at most ``limit`` bytes: a longer one is yielded as soon as it passes the limit,
    with ``cut`` true, and its rest is discarded up to the next newline. Memory stays bounded by
    ``limit`` and one piece, however long a line without a newline a task writes.
    """
    held = bytearray()
    discarding = False
    for piece in pieces:
        start = 0
        while True:
            end = piece.find(b"\n", start)
            part = piece[start:] if end < 0 else piece[start:end]
            if not discarding:
                room = limit - len(held)
                held += part[:room]
                if len(part) > room:
                    yield bytes(held), True
                    held.clear()
                    discarding = True
            if end < 0:
                break
            if not discarding:
                yield bytes(held), False
            held.clear()
            discarding = False
            start = end + 1
    if held:
        yield bytes(held), False


def line_text(raw: bytes, *, cut: bool) -> str:
    """Return a line read by :func:`bounded_lines` as text of at most MAX_LOG_LINE_CHARS, a cut one marked."""
    text = raw.decode(errors="replace")
    if not cut:
        return text[:MAX_LOG_LINE_CHARS]
    mark = CUT_MARK.format(limit=MAX_LINE_BYTES)
    return text[:MAX_LOG_LINE_CHARS - len(mark)] + mark


class _Capture:
    """Keep the first ``limit`` bytes of a stream (for results) and its last TAIL_CHARS bytes; drain the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.overflow = False
        self._tail = b""

    def add(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk)[-TAIL_CHARS:]
        if self.overflow or self.size + len(chunk) > self.limit:
            self.overflow = True
            self.parts.clear()  # results that cannot be used need not be held
            return
        self.parts.append(chunk)
        self.size += len(chunk)

    @property
    def tail(self) -> str:
        return self._tail.decode(errors="replace")

    def text(self) -> str:
        return b"".join(self.parts).decode(errors="replace")


def _kill_group(proc: Process, *, grace: float = KILL_GRACE_SECONDS) -> None:
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
