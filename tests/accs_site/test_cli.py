"""The daemons' command lines as an operator meets them: real ``manage.py`` processes.

A bad option or setting is refused before anything starts (one line on stderr, exit code 2, no
traceback); a database that is down at start is waited for, said once; log lines are readable
on a terminal and JSON elsewhere.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import subprocess
import sys
import threading

import pytest

from events.logging import JsonFormatter, TextFormatter, choose_format
from tests import forkserver
from tests.daemons import ROOT, free_port, stop_process, wait_for

MANAGE = str(ROOT / "manage.py")


def env_with_database_down(**extra: str) -> dict[str, str]:
    """Environment whose database URL points at a closed port: a daemon that got past its checks would wait."""
    env = {key: value for key, value in os.environ.items() if key != "ACC_LOG_FORMAT"}
    env.update(ACC_DB_URL=f"postgres://postgres@127.0.0.1:{free_port()}/accs", PYTHONPATH=str(ROOT),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_command(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, MANAGE, *argv], cwd=ROOT, env=env or env_with_database_down(),
                          capture_output=True, text=True, timeout=60)


def assert_one_line_refusal(result: subprocess.CompletedProcess, needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {result.stderr}"
    assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------------------------
# Bad options: one line, exit code 2, nothing started
# --------------------------------------------------------------------------------------------

AGENT = ("runagent", "--services", "resize")


@pytest.mark.parametrize(("argv", "needle"), [
    ((*AGENT, "--poll-interval", "-1"), "--poll-interval: must be greater than 0"),
    ((*AGENT, "--poll-interval", "0"), "--poll-interval: must be greater than 0"),
    ((*AGENT, "--poll-interval", "soon"), "--poll-interval: expected a number"),
    ((*AGENT, "--node", "n" * 300), "--node: the node name is 300 characters long; at most 200"),
    ((*AGENT, "--node", "gpu node/1"), "--node: the node name 'gpu node/1' has characters"),
    ((*AGENT, "--node", "-rf"), "--node"),
    ((*AGENT, "--labels", "gpu"), "--labels: expected key=value pairs separated by commas, got 'gpu'"),
    ((*AGENT, "--lease-seconds", "0"), "--lease-seconds: must be greater than 0"),
    ((*AGENT, "--lease-seconds", "1"), "--lease-seconds: must be at least 3"),
    ((*AGENT, "--claim-batch", "0"), "--claim-batch: must be at least 1"),
    ((*AGENT, "--max-concurrent", "0"), "--max-concurrent: must be at least 1"),
    ((*AGENT, "--max-concurrent", "1e9"), "--max-concurrent: expected a whole number"),
    (("runagent",), "--services"),
    (("runbuilder", "--tick", "0"), "--tick: must be greater than 0"),
    (("runbuilder", "--tick", "nan"), "--tick: expected a number"),
    (("runbuilder", "--batch", "0"), "--batch: must be at least 1"),
    (("runbuilder", "--batch", "1000000"), "--batch: must be at most 10000"),
    (("accs_status", "--failures", "-1"), "--failures: must be at least 0"),
    (("accs_status", "--watch", "0.1"), "--watch: must be at least 0.5"),
], ids=lambda v: " ".join(v)[:40] if isinstance(v, tuple) else None)
def test_bad_option_is_refused_in_one_line_with_exit_code_2(argv, needle):
    assert_one_line_refusal(run_command(*argv), needle)


@pytest.mark.parametrize(("variables", "needle"), [
    ({"ACC_NODE_NAME": "node with spaces"}, "ACC_NODE_NAME (or the hostname): the node name"),
    ({"ACC_NODE_LABELS": "gpu"}, "ACC_NODE_LABELS: expected key=value pairs"),
    ({"ACC_POLL_INTERVAL_SEC": "-1"}, "ACC_POLL_INTERVAL_SEC: must be at least 0.01"),
    ({"ACC_LOG_FORMAT": "yaml"}, "ACC_LOG_FORMAT: expected one of auto, text, json, got 'yaml'"),
    ({"ACC_DB_URL": "mysql://u@db/accs"}, "ACC_DB_URL must point at PostgreSQL"),
])
def test_bad_setting_is_refused_in_one_line_with_exit_code_2(variables, needle):
    assert_one_line_refusal(run_command(*AGENT, env=env_with_database_down(**variables)), needle)


@pytest.mark.parametrize("argv", [("accs_status",), ("accs_status", "--json"), ("accs_status", "--tenant", "acme")],
                         ids=["tables", "json", "tenant"])
def test_accs_status_with_the_database_down_is_one_line_and_exit_code_2(argv):
    env = env_with_database_down()
    address = env["ACC_DB_URL"].split("@", 1)[1].split("/", 1)[0]
    result = run_command(*argv, env=env)
    assert_one_line_refusal(result, f"database unreachable at {address}")
    assert result.stdout == "", "nothing half-printed"


def test_help_shows_each_default_and_bound():
    agent = run_command("runagent", "--help").stdout
    builder = run_command("runbuilder", "--help").stdout
    flat = " ".join(agent.split())
    assert "1-1000 (default: 4)" in flat and "(default: ACC_POLL_INTERVAL_SEC, else 2)" in flat
    assert "(default: ACC_HEARTBEAT_TTL_SEC, else 120)" in flat and "(default: --max-concurrent)" in flat
    flat = " ".join(builder.split())
    assert "0.01-3600 (default: 1.0)" in flat and "1-10000 (default: 500)" in flat


# --------------------------------------------------------------------------------------------
# Database down at start: one line, then a quiet wait
# --------------------------------------------------------------------------------------------

class Output:
    """Collect a process's stderr lines (a pipe or a pty) in a thread, for bounded polls."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # a pty's reader gets EIO once the process is gone
                return
            if not chunk:
                return
            self.text += chunk.decode("utf-8", "replace").replace("\r\n", "\n")

    @property
    def lines(self) -> list[str]:
        return [line for line in self.text.splitlines() if line.strip()]

    def join(self) -> None:
        self._thread.join(timeout=10)


def start(argv: tuple[str, ...], env: dict[str, str], *, terminal: bool) -> tuple[subprocess.Popen, Output]:
    """Start ``manage.py argv`` with stderr on a pseudo-terminal (``terminal``) or a pipe."""
    if terminal:
        reader, writer = pty.openpty()
    else:
        reader, writer = os.pipe()
    proc = forkserver.Popen([sys.executable, MANAGE, *argv], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=writer)
    os.close(writer)
    return proc, Output(reader)


def stop(proc: subprocess.Popen, output: Output) -> None:
    stop_process(proc)
    output.join()
    os.close(output.fd)


@pytest.mark.parametrize("argv", [("runbuilder", "--tick", "0.2"), ("runagent", "--node", "n1", "--services", "x")],
                         ids=["runbuilder", "runagent"])
def test_database_down_at_start_is_one_line_and_a_wait_not_a_traceback(argv):
    env = env_with_database_down()
    address = env["ACC_DB_URL"].split("@", 1)[1].split("/", 1)[0]
    proc, output = start(argv, env, terminal=False)
    try:
        wait_for(lambda: "waiting for PostgreSQL" in output.text or proc.poll() is not None, timeout=30,
                 message="the daemon says it waits for PostgreSQL")
        # It keeps waiting (retrying with backoff) instead of exiting.
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
        before_stop = output.lines
    finally:
        stop(proc, output)
    assert len(before_stop) == 1, before_stop
    assert f"waiting for PostgreSQL at {address}" in json.loads(before_stop[0])["msg"]
    assert "Traceback" not in output.text, output.text
    assert output.text.count("waiting for PostgreSQL") == 1
    assert proc.returncode == 0, "a stop while waiting is a clean stop"


# --------------------------------------------------------------------------------------------
# Log format: text on a terminal, JSON elsewhere, ACC_LOG_FORMAT decides
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("terminal", "setting", "expected"), [
    (True, None, "text"),
    (False, None, "json"),
    (True, "json", "json"),
    (False, "text", "text"),
], ids=["terminal", "pipe", "terminal-forced-json", "pipe-forced-text"])
def test_log_lines_are_text_on_a_terminal_and_json_elsewhere(terminal, setting, expected):
    env = env_with_database_down(**({"ACC_LOG_FORMAT": setting} if setting else {}))
    proc, output = start(("runbuilder",), env, terminal=terminal)
    try:
        wait_for(lambda: "waiting for PostgreSQL" in output.text or proc.poll() is not None, timeout=30,
                 message="the builder's first log line")
    finally:
        stop(proc, output)
    first = output.lines[0]
    if expected == "json":
        assert json.loads(first)["level"] == "warning", first
    else:
        assert first.lstrip().startswith("20") and " WARNING accs.builder: waiting for PostgreSQL at " in first, first
        with pytest.raises(ValueError):
            json.loads(first)


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_format_choice_follows_the_setting_then_the_terminal():
    assert choose_format("auto", _Stream(True)) == "text"
    assert choose_format("auto", _Stream(False)) == "json"
    assert choose_format("json", _Stream(True)) == "json"
    assert choose_format("text", _Stream(False)) == "text"
    assert choose_format("auto", None) == "json"
    closed = open(os.devnull, "w")  # noqa: SIM115 - closed at once on purpose
    closed.close()
    assert choose_format("auto", closed) == "json", "a closed stream's isatty raises"


def test_text_formatter_writes_one_readable_line_with_context():
    record = logging.LogRecord("accs.agent", logging.WARNING, __file__, 1, "claimed %d", (3,), None)
    record.node, record.job_id = "n1", "j-1"
    line = TextFormatter().format(record)
    assert "\n" not in line and " WARNING accs.agent: claimed 3  [job_id=j-1 node=n1]" in line
    assert json.loads(JsonFormatter().format(record))["node"] == "n1"


OPERATOR_COMMANDS = [("accs_status",), ("accs_redrive", "--dry-run"), ("demo",)]


@pytest.mark.parametrize("argv", OPERATOR_COMMANDS, ids=lambda argv: argv[0])
def test_operator_commands_with_the_database_down_say_so_in_one_line(argv):
    env = env_with_database_down()
    address = env["ACC_DB_URL"].split("@", 1)[1].split("/", 1)[0]
    result = run_command(*argv, env=env)
    assert_one_line_refusal(result, f"database unreachable at {address}")
    assert result.stdout == "", "nothing half-printed"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("argv", OPERATOR_COMMANDS, ids=lambda argv: argv[0])
def test_operator_commands_on_an_unmigrated_database_name_the_missing_migration(argv, db_url):
    import uuid

    import psycopg

    name = f"accs_unmigrated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        env = env_with_database_down(ACC_DB_URL=f"{db_url.rsplit('/', 1)[0]}/{name}")
        result = run_command(*argv, env=env)
    finally:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    assert_one_line_refusal(result, "is missing migration ")
    assert "apply them with `manage.py migrate`" in result.stderr
