"""Start this repository's Python scripts (``manage.py`` and the like) by forking a process that has
already imported the third-party packages they import, instead of a new interpreter each time.

A daemon's start is about 0.9 CPU-s, of which Python importing Django, psycopg and the rest is more
than half; the suite starts a few hundred such processes on two cores. :class:`Popen` is a drop-in
for :class:`subprocess.Popen`: for ``[sys.executable, "<script>.py", *args]`` it asks a fork server
for the process, else it starts one the usual way. The forked process is a real process running the
script as ``python <script>.py`` would, with its own environment, working folder, standard streams
and session; only the imports of third-party modules (no project module, no settings read) are
inherited. What cannot be inherited that way starts a new interpreter instead:

- an interpreter option (``-c``, ``-m``, ``-W`` …) or another program;
- ``preexec_fn``, ``pass_fds``, a user, group or umask, kept file descriptors (``close_fds=False``);
- an environment whose ``PYTHON*``, ``LD_*``, locale or time zone variables (read once, when an
  interpreter starts) differ from the fork server's: each set of them gets its own server;
- a command line or environment larger than :data:`ROOM`.

The forked process is the fork server's child, not this process's: its exit code reaches us over the
server's socket. A server ends when this process closes its end of that socket (its exit, or death).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

# Top-level packages whose modules, as this process has them loaded, the fork server imports: the
# third-party packages the site, the daemons and the commands import, and the standard library's
# heavier ones among them. A module that cannot be imported before Django's settings are read
# (models, for one) is skipped there and imported by the script as usual.
PRELOAD_PACKAGES = frozenset({
    "django", "psycopg", "psycopg_binary", "psycopg_pool", "asgiref", "sqlparse", "croniter", "dateutil",
    "referencing", "rpds", "attr", "attrs", "jsonschema_rs", "environ", "whitenoise", "django_tasks",
    "django_stubs_ext", "six", "asyncio", "email", "xml", "json", "logging", "http", "urllib", "uuid",
    "zoneinfo", "concurrent", "ctypes", "decimal", "wsgiref", "html", "ipaddress", "mimetypes", "secrets",
})
# The longest command line and environment (bytes, NUL-separated) a forked process can show in
# /proc/<pid>/cmdline and /proc/<pid>/environ; a longer one starts a new interpreter.
ROOM = 64 * 1024
# The project's own packages: never imported by the server (they read settings).
PROJECT = ("accs_site", "jobs", "nodes", "ops", "workflows", "tenants", "events", "tests", "chaos", "bench")
# What an interpreter (or the C library and loader under it) reads once, when it starts: Python's
# options, the dynamic loader's and the allocator's, the locale and the time zone.
AT_START = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_")
LOCALE = ("LANG", "TZ")
# Not wanted in a daemon even though this process (a test run) has them loaded.
NOT_PRELOADED = ("django.test", "django.contrib.staticfiles.testing", "django.core.servers")

# The fork server. Its requests: {"argv": [script, *args], "cwd", "env", "new_session"} with three
# descriptors (the child's stdin, stdout and stderr). Replies, in order: b"ready" once, {"pid": n} per
# request, {"exit": pid, "code": n} when a child ends (watched through pidfds, so no signal handler is
# installed that a child would inherit). The child leaves the loop and runs the script like the
# interpreter's own start would: ``sys.argv``, ``sys.path[0]``, ``__main__`` and the exit code.
SERVER = r"""
import importlib, json, os, select, socket, sys
control = socket.socket(fileno=int(sys.argv[1]))
PROJECT = set(json.loads(sys.argv[3]))
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except BaseException:
        pass
from django.conf import settings
if settings.configured or any(name.split(".")[0] in PROJECT for name in sys.modules):
    os._exit(3)  # something imported the site: every start of this signature takes a new interpreter
control.send(b"ready")


def serve():
    children = {}
    while True:
        readable, _, _ = select.select([control, *children], [], [])
        for fd in readable:
            if fd is not control:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                control.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if control not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 22, 3)
        if not message:
            os._exit(0)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            for fd in children:
                os.close(fd)
            return request, fds
        for fd in fds:
            os.close(fd)
        children[os.pidfd_open(pid)] = pid
        control.send(json.dumps({"pid": pid}).encode())


request, fds = serve()
control.close()
del control
for target, fd in enumerate(fds):
    os.dup2(fd, target)
for fd in fds:
    if fd > 2:
        os.close(fd)
if request["new_session"]:
    os.setsid()
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
script = request["argv"][0]
sys.argv = list(request["argv"])
# /proc/<pid>/cmdline and /proc/<pid>/environ show the script's command line and environment, as for
# an interpreter started with them (an agent reads them to tell whether another agent still runs, and
# which processes are a task's): written over the server's own argument and environment areas, which
# its last argument and a variable pad out (the request was refused before the fork if they do not
# fit). The C library's environment no longer points there: os.environ's clear unset every name.
import ctypes
fields = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
for start, end, data in (
        (int(fields[45]), int(fields[46]), b"".join(os.fsencode(a) + b"\0" for a in [sys.executable, *sys.argv])),
        (int(fields[47]), int(fields[48]), b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0"
                                                    for k, v in os.environ.items()))):
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
del ctypes, fields, start, end, data
sys.path[0] = os.path.dirname(os.path.realpath(script))
del request, fds, serve


def stdio(fd, old, reading):
    # As the interpreter's start makes them: unbuffered (PYTHONUNBUFFERED, the server's own option) or
    # buffered, line-buffered on a terminal and for stderr; the descriptor is never closed by them.
    import io
    raw = io.FileIO(fd, "rb" if reading else "wb", closefd=False)
    write_through = bool(getattr(old, "write_through", False))
    buffered = raw if write_through and not reading else (io.BufferedReader(raw) if reading else io.BufferedWriter(raw))
    try:
        terminal = raw.isatty()
    except OSError:
        terminal = False
    return io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors, newline="\n",
                            line_buffering=not write_through and (terminal or fd == 2), write_through=write_through)


sys.stdin = sys.__stdin__ = stdio(0, sys.__stdin__, True)
sys.stdout = sys.__stdout__ = stdio(1, sys.__stdout__, False)
sys.stderr = sys.__stderr__ = stdio(2, sys.__stderr__, False)
del stdio
# The script as the interpreter's start runs it: an absolute __file__ and code file name, argv[0] as
# given, a module of its own as __main__.
import builtins, importlib.machinery, types
path = os.path.abspath(script)
main = types.ModuleType("__main__")
main.__file__, main.__cached__, main.__spec__, main.__package__ = path, None, None, None
main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
main.__builtins__ = builtins
sys.modules["__main__"] = main
with open(path, "rb") as fh:
    code = compile(fh.read(), path, "exec")
del builtins, types, path, fh
exec(code, main.__dict__)
"""


def _signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The environment an interpreter reads once, at its start (:data:`AT_START`, :data:`LOCALE`)."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(AT_START) or k in LOCALE))


def _preload() -> list[str]:
    names = [name for name in sorted(sys.modules)
             if name.split(".")[0] in PRELOAD_PACKAGES and not name.startswith(NOT_PRELOADED)
             and ".tests" not in name]
    return names


class _Child:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.code: int | None = None
        self.done = threading.Event()


def _await_orphan(child: _Child) -> None:
    try:
        fd = os.pidfd_open(child.pid)
    except ProcessLookupError:
        fd = None
    if fd is not None:
        select.select([fd], [], [])
        os.close(fd)
    child.code = -signal.SIGKILL
    child.done.set()


class _Server:
    """This process's side of one fork server."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(theirs.fileno()), json.dumps(_preload()), json.dumps(PROJECT),
                 "-" * ROOM],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=env, pass_fds=(theirs.fileno(),), cwd="/")
        finally:
            theirs.close()
        self.sock = ours
        self.dead = False
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._replies: list[_Child] = []
        self._reply = threading.Condition()
        self._ready = threading.Event()
        self._children: dict[int, _Child] = {}
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            if data == b"ready":
                self._ready.set()
                continue
            message = json.loads(data)
            with self._reply:
                if "pid" in message:
                    child = self._children[message["pid"]] = _Child(message["pid"])
                    self._replies.append(child)
                    self._reply.notify_all()
                else:
                    child = self._children.pop(message["exit"])
                    child.code = message["code"]
                    child.done.set()
        with self._reply:
            self.dead = True
            self._ready.set()
            self._reply.notify_all()
            orphans, self._children = list(self._children.values()), {}
        # A child whose server died (it keeps running, as an orphan) cannot tell us its exit code:
        # once it ends, it is reported killed.
        for child in orphans:
            threading.Thread(target=_await_orphan, args=(child,), name="forkserver-orphan", daemon=True).start()

    def fork(self, argv: list[str], cwd: str, env: dict[str, str], new_session: bool, fds: list[int]) -> _Child | None:
        if not self._ready.wait(120) or self.dead:
            return None
        request = json.dumps({"argv": argv, "cwd": cwd, "env": env, "new_session": new_session}).encode()
        with self._lock:
            try:
                socket.send_fds(self.sock, [request], fds)
            except OSError:
                return None
            with self._reply:
                while not self._replies and not self.dead:
                    self._reply.wait()
                return self._replies.pop(0) if self._replies else None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


def _server(env: dict[str, str]) -> _Server:
    key = _signature(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None:  # one that died stays: its starts take a new interpreter
            if not _servers:
                atexit.register(_close_all)
            # Nothing else of the environment: no settings module, no database URL, to be read there.
            server = _servers[key] = _Server({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **dict(key),
                                              "ACCS_FORKSERVER_ROOM": "-" * ROOM})
        return server


def server_pids() -> list[int]:
    """The pids of this process's fork servers that run."""
    with _servers_lock:
        return [server.proc.pid for server in _servers.values() if not server.dead]


def _close_all() -> None:
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.close()


def enabled() -> bool:
    """Off with ``ACCS_TEST_FORKSERVER=0`` (every script then starts its own interpreter)."""
    return os.environ.get("ACCS_TEST_FORKSERVER", "1") != "0" and hasattr(os, "pidfd_open")


class Popen(subprocess.Popen):
    """:class:`subprocess.Popen` that forks ``[sys.executable, script.py, …]`` from a fork server."""

    _forked: _Child | None = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        argv = [os.fspath(a) for a in args] if isinstance(args, list | tuple) else None
        usable = (enabled() and argv is not None and len(argv) >= 2 and not shell and executable is None
                  and argv[0] == sys.executable and argv[1].endswith(".py") and not argv[1].startswith("-")
                  and preexec_fn is None and not pass_fds and close_fds and restore_signals
                  and gid is None and not gids and uid is None and umask < 0 and process_group in (None, -1)
                  and Path(cwd or ".", argv[1]).is_file()
                  and sum(len(os.fsencode(arg)) + 1 for arg in argv) < ROOM)
        child = None
        if usable:
            child_env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
            usable = sum(len(os.fsencode(k)) + len(os.fsencode(v)) + 2 for k, v in child_env.items()) < ROOM
        if usable:
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]
            child = _server(child_env).fork(argv[1:], os.path.abspath(os.fspath(cwd or ".")), child_env,
                                            bool(start_new_session), fds)
        if child is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, process_group)
        self._forked = child
        self.pid = child.pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._forked is None:
            return super()._internal_poll(_deadstate, **kwargs)
        if self.returncode is None and self._forked.done.is_set():
            self.returncode = self._forked.code
        return self.returncode

    def _wait(self, timeout):
        if self._forked is None:
            return super()._wait(timeout)
        if self.returncode is None:
            if not self._forked.done.wait(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._forked.code
        return self.returncode


def run(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):  # noqa: A002
    """:func:`subprocess.run` with :class:`Popen`."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        retcode = process.poll()
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, retcode, stdout, stderr)
