"""Real daemon processes for tests: agents and builders as ``manage.py`` subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests import forkserver

ROOT = Path(__file__).resolve().parent.parent


# The line each daemon logs once it is connected and about to work (nodes/agent.py, jobs/builder.py), or
# that it waits for an unreachable PostgreSQL (accs_site/daemon.py: started as far as it can be).
STARTED_LINES = {"runagent": "started on node", "runbuilder": "builder started"}
WAITING_LINE = "waiting for PostgreSQL"
# How long a daemon may take to start: importing Django and connecting is quick on an idle machine and
# takes tens of seconds on a loaded one; the test's own bounds then time only what it tests.
START_TIMEOUT = 180.0


# Any two terms whose leader-only writes overlap in time (different fences, intersecting spans).
OVERLAP_SQL = """
SELECT a.fence, b.fence FROM accs_leader_term a JOIN accs_leader_term b ON a.fence < b.fence
 WHERE a.first_write_at IS NOT NULL AND b.first_write_at IS NOT NULL
   AND (a.last_write_at >= b.first_write_at OR a.last_write_at >= b.acquired_at)
"""


def overlapping_terms(db_url: str) -> list[tuple[int, int]]:
    """Return the pairs of builder leader terms (fences) whose leader-only writes overlap in time."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute(OVERLAP_SQL).fetchall()


class Daemons:
    """Start daemons; stop them all at teardown (SIGTERM, then SIGKILL).

    ``start`` returns once the daemon logs that it started (or has exited, for tests of refusals).
    """

    def __init__(self, env: dict[str, str], log_dir: Path, *, manage_py: Path = ROOT / "manage.py") -> None:
        self.env = env
        self.log_dir = log_dir
        self.manage_py = manage_py  # another site's manage.py runs the same daemons (tests/embedded_site)
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, name: str, env: dict[str, str] | None = None, wait: bool = True) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        proc = forkserver.Popen([sys.executable, str(self.manage_py), *args], cwd=self.manage_py.parent,
                                env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = self.log_dir / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(proc)
        if wait and args and args[0] in STARTED_LINES:
            wait_started(proc, STARTED_LINES[args[0]], name=name)
        return proc

    def agent(
        self, node: str, services: str, *extra: str, name: str | None = None, env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> subprocess.Popen:
        return self.start(
            "runagent", "--node", node, "--services", services, *extra, name=name or f"agent-{node}", env=env,
            wait=wait,
        )

    def agents_together(self, nodes: list[str], services: str, *extra: str,
                        env: dict[str, str] | None = None) -> list[subprocess.Popen]:
        """Start one agent per node at once and return when every one of them has started: a race
        between agents is then a race, not the first one draining the queue while the others import."""
        procs = [self.agent(node, services, *extra, env=env, wait=False) for node in nodes]
        for node, proc in zip(nodes, procs, strict=True):
            wait_started(proc, STARTED_LINES["runagent"], name=f"agent-{node}")
        return procs

    def builder(self, *extra: str, name: str = "builder") -> subprocess.Popen:
        return self.start("runbuilder", "--tick", "0.2", *extra, name=name)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Sampler:
    """Poll a SQL query on its own connection in a thread; keep the maximum of each column."""

    def __init__(self, url: str, sql: str, params: tuple = ()) -> None:
        self.url, self.sql, self.params = url, sql, params
        self.maxima: list[int] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.is_set():
                row = conn.execute(self.sql, self.params).fetchone()
                values = [int(v or 0) for v in row]
                self.maxima = [max(a, b) for a, b in zip(self.maxima, values, strict=True)] if self.maxima else values
                self.samples += 1
                time.sleep(0.01)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def wait_started(proc: subprocess.Popen, line: str, *, name: str, timeout: float = START_TIMEOUT) -> None:
    """Wait until ``proc`` logs ``line`` (or that it waits for PostgreSQL) or exits; fail naming the daemon."""
    log_path: Path = proc.log_path  # type: ignore[attr-defined]

    def started() -> bool:
        text = log_path.read_text(errors="replace")
        return proc.poll() is not None or line in text or WAITING_LINE in text

    wait_for(started, timeout=timeout, interval=0.1, message=f"{name} to log {line!r} ({log_path})")


def wait_all_final(url: str, *, timeout: float, expected: int | None = None) -> None:
    """Wait until every job is final (done/error/canceled); fail with a count otherwise."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            total, open_ = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE status IN ('queued', 'waiting', 'running'))"
                " FROM accs_job").fetchone()
            if open_ == 0 and (expected is None or total == expected):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"timed out: {open_} of {total} jobs still queued/waiting/running")
            time.sleep(0.1)


def wait_for(condition: Callable[[], Any], *, timeout: float = 30.0, interval: float = 0.05, message: str = "") -> Any:
    """Poll ``condition`` until it returns a truthy value; fail with ``message`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for: {message or condition}")
        time.sleep(interval)


wait_until = wait_for


def wait_for_result(result, *, timeout: float = 30.0):
    """Refresh a Django Tasks ``result`` until it is finished (bounded); return it."""

    def finished() -> bool:
        result.refresh()
        return result.is_finished

    wait_for(finished, timeout=timeout, message=f"task result {result.id} ({result.task.name}) to finish")
    return result


def stop_process(proc: subprocess.Popen, *, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    """Send ``sig`` to a process that still runs; kill it if it has not exited after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def agent_in_this_process() -> Iterator[None]:
    """Give back this process's database settings after an agent ran in it (``Agent.run()`` gives its
    connections the daemons' timeouts and its connection pool)."""
    from django.db import connections

    settings = connections.settings["default"]
    saved, saved_options = dict(settings), dict(settings.setdefault("OPTIONS", {}))
    try:
        yield
    finally:
        settings["OPTIONS"].clear()
        settings["OPTIONS"].update(saved_options)
        settings.update({k: v for k, v in saved.items() if k != "OPTIONS"})
        if "DISABLE_SERVER_SIDE_CURSORS" not in saved:
            settings.pop("DISABLE_SERVER_SIDE_CURSORS", None)
        connections.close_all()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def http_server(argv: list[str], *, env: dict[str, str], port: int, log_path: Path, name: str,
                timeout: float = 60) -> Iterator[str]:
    """Run a web server process until it answers ``/api/v1/health``; yield its URL; stop it after."""
    import requests

    log = open(log_path, "wb")
    proc = forkserver.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited: {log_path.read_text()[-2000:]}")
        try:
            return requests.get(f"{url}/api/v1/health", timeout=5).status_code == 200
        except requests.RequestException:  # not listening yet, or the first request is still warming up
            return False

    try:
        wait_for(up, timeout=timeout, message=f"{name} answering /api/v1/health")
        yield url
    finally:
        stop_process(proc)
        log.close()
