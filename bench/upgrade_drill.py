"""The upgrade drill (``make upgrade-drill``): a live site on the previous release moved to this tree's code.

The previous release (``PREVIOUS_RELEASE``, a git revision; ``--previous``) is checked out with
``git worktree`` into a temporary folder. On a private PostgreSQL cluster (``scripts/pg_local.sh``
in that folder, never the development one) it is migrated with its own code; its two builders,
three agents and its web (gunicorn, two processes) start, and a stream of jobs arrives through the
HTTP API (a few per second, and a long job every few seconds). Then the steps of docs/deploy.md
("Deploying a new version"), with this tree's code: ``migrate`` while the old daemons run; the
web's graceful reload (``HUP``: the code folder it serves switches to the new release, the master
keeps its socket); the builders one at a time; the agents one at a time (each drains). With
``--rollback`` the site then goes back the documented way: every process to the previous release
first, then the new code's ``migrate APP MIGRATION`` down to the previous release's migrations, and
the previous release's ``migrate --check`` must pass and its daemons finish jobs started after it.

With ``--each-migration`` (the test ``tests/system/test_migrations_under_previous_release.py`` runs it
small) there is no rolling restart: each migration newer than the previous release is applied alone
(``migrate APP MIGRATION``, in the new code's plan order, all from one process of the new code) while
the previous release's daemons work, and the old daemons' error lines and blocked statements are
counted after each (``per_migration``).

Printed at the end, every gate of which must hold (exit 1 otherwise):

* ``lost``: jobs the API accepted that are missing, or have no task, after the drain;
* ``run_twice``: tasks whose work ran to its end more than once (the ledger of ``chaos/work.py``),
  or overlapped, or have two succeeded attempts;
* ``stuck``: tasks not finished when the drain's time is up;
* ``refused``: job POSTs answered with anything but 201, or not answered;
* ``old_error_lines``: error lines (level error or critical, tracebacks) in the previous release's logs;
* ``old_blocked_over_0_5s``: statements of the previous release's daemons and web that waited for a lock
  over 0.5 s (the server's ``log_lock_waits`` with ``deadlock_timeout`` 500 ms; ``migrate`` runs
  under its own application name, so its own waits are not counted);
* ``leader_overlaps``: pairs of leader terms whose writes overlap (``accs_leader_term``);
* ``leader_gap_over_lease``: a time with no leader between two terms longer than the builders'
  lease (``leader_gap_max_s`` is printed);
* ``old_token_after_migrate_failed``: the previous release cannot create an API token on the new schema;
* ``new_web_not_ready``: the new web's ``/api/v1/ready`` did not answer 200;
* with ``--rollback``, ``rollback_old_migrate_check_failed`` and ``rollback_no_jobs_after`` (no job
  accepted after the schema went back).

    python bench/upgrade_drill.py [--previous REV] [--rollback | --each-migration] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chaos.run import Cluster, free_port  # noqa: E402
from tests.daemons import OVERLAP_SQL, STARTED_LINES, wait_for  # noqa: E402

VERSION = re.search(r'VERSION = "([^"]+)"', (ROOT / "accs_site" / "version.py").read_text()).group(1)
PREVIOUS_RELEASE = os.environ.get("PREVIOUS_RELEASE", "8a12ebc")
APPS = ("tenants", "events", "workflows", "jobs", "nodes", "ops")
BUILDERS, AGENTS, SLOTS = 2, 3, 8
LEASE_SECONDS = 10.0
JOBS_PER_SECOND = 4.0
LONG_EVERY_S, LONG_SECONDS = 8.0, (10.0, 18.0)
BLOCKED = re.compile(r"app=(?P<app>[^|]*)\|.*still waiting for (?P<lock>\w+Lock)")
MIGRATE_APP = "accs-migrate"


@dataclass
class Release:
    """Where one release's code is: the folder whose ``manage.py`` its processes run."""

    name: str
    tree: Path


@dataclass
class Proc:
    """One daemon of the drill; its log file per start, the release it was started from."""

    name: str
    args: list[str]
    env: dict[str, str]
    logs: Path
    release: Release | None = None
    proc: subprocess.Popen | None = None
    log_files: list[tuple[str, Path]] = field(default_factory=list)

    def start(self, release: Release) -> None:
        self.release = release
        log = self.logs / f"{self.name}.{len(self.log_files) + 1}.{release.name}.log"
        self.log_files.append((release.name, log))
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(release.tree / "manage.py"), *self.args],
                                         cwd=release.tree, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop(self, *, timeout: float) -> None:
        """Send one SIGTERM (a drain for an agent, leadership released for a builder) and wait for the exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise RuntimeError(f"{self.name} did not stop within {timeout:g} s of SIGTERM") from None


class Web:
    """gunicorn serving whichever release the folder ``current`` points to; HUP reloads its workers from it."""

    def __init__(self, work: Path, env: dict[str, str], logs: Path) -> None:
        self.current, self.env, self.logs = work / "current", env, logs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.served: list[str] = []

    def point_at(self, release: Release) -> None:
        """Switch the served folder atomically (a new symlink renamed over the old one)."""
        link = self.current.with_name("current.new")
        link.unlink(missing_ok=True)
        link.symlink_to(release.tree)
        link.replace(self.current)
        self.served.append(release.name)

    def start(self, release: Release) -> None:
        self.point_at(release)
        gunicorn = Path(sys.executable).parent / "gunicorn"
        # --chdir names the symlink, not its target: new workers import the code it points to then.
        with open(self.logs / "web.log", "a") as out:
            self.proc = subprocess.Popen(
                [str(gunicorn), "accs_site.wsgi:application", "-c", str(ROOT / "deploy" / "gunicorn.conf.py"),
                 "--chdir", str(self.current), "--bind",
                 f"127.0.0.1:{self.port}", "--workers", "2", "--threads", "4", "--graceful-timeout", "30",
                 "--access-logfile", "-"], cwd=self.current, env={**self.env, "PWD": str(self.current)},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def release(self) -> str:
        """Return the release a worker answered from: /metrics' ``accs_build_info`` (the previous release has none)."""
        request = urllib.request.Request(self.url + "/metrics",
                                         headers={"Authorization": f"Bearer {self.env['ACC_METRICS_TOKEN']}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                found = re.search(r'accs_build_info\{version="([^"]+)"', answer.read().decode())
        except OSError:
            return "unreachable"
        return found.group(1) if found else "old"

    def serves(self, wanted: str, *, answers: int = 8) -> bool:
        """True when ``answers`` requests in a row came from ``wanted`` (both workers switched)."""
        return all(self.release() == wanted for _ in range(answers))

    def reload(self, release: Release) -> None:
        """Serve ``release`` without closing the socket: new workers start on it, old ones finish and exit."""
        self.point_at(release)
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=40)


class Load(threading.Thread):
    """Post jobs through the HTTP API at a steady rate; a long one every ``LONG_EVERY_S`` seconds."""

    def __init__(self, url: str, token: str, *, long_seconds: tuple[float, float] = LONG_SECONDS) -> None:
        super().__init__(name="drill-load", daemon=True)
        self.url, self.token, self.long_seconds = url + "/api/v1/jobs", token, long_seconds
        self.stopping = threading.Event()
        self.accepted: list[str] = []
        self.refused: list[str] = []
        self.rng = random.Random()

    def post(self, seconds: float) -> None:
        body = json.dumps({"service": "drill-work", "params": {"seconds": seconds}}).encode()
        request = urllib.request.Request(self.url, data=body, method="POST", headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                payload = json.loads(answer.read())
                if answer.status == 201:
                    self.accepted.append(str(payload.get("id") or payload.get("job_id")))
                else:
                    self.refused.append(f"{time.strftime('%H:%M:%S')} HTTP {answer.status}")
        except urllib.error.HTTPError as exc:
            self.refused.append(f"{time.strftime('%H:%M:%S')} HTTP {exc.code} {exc.read()[:200]!r}")
        except (OSError, ValueError) as exc:
            self.refused.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")

    def run(self) -> None:
        next_long = time.monotonic()
        while not self.stopping.is_set():
            if time.monotonic() >= next_long:
                next_long += LONG_EVERY_S
                self.post(round(self.rng.uniform(*self.long_seconds), 2))
            self.post(round(self.rng.uniform(0.02, 0.3), 3))
            self.stopping.wait(1 / JOBS_PER_SECOND)


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def manage(release: Release, *args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(release.tree / "manage.py"), *args], cwd=release.tree, env=env,
                          capture_output=True, text=True, check=check)


# Applies the migrations it is sent, one per line (``app name``), each alone with ``migrate APP MIGRATION``
# (the release's own command: its lock timeout and retries), and answers each with one JSON line. One
# process for all of them: each ``manage.py migrate`` would pay a second of start-up for a migration
# that takes a fraction of that.
MIGRATE_EACH = """
import io, json, sys, traceback
import django
django.setup()
from django.core.management import call_command
from django.core.management.base import CommandError
for line in sys.stdin:
    app, name = line.split()
    out = io.StringIO()
    try:
        call_command("migrate", app, name, interactive=False, stdout=out, stderr=out)
        code = 0
    except CommandError as exc:
        out.write(f"CommandError: {exc}\\n")
        code = exc.returncode or 1
    except Exception:
        out.write(traceback.format_exc())
        code = 1
    print(json.dumps({"exit": code, "output": out.getvalue()}), flush=True)
"""


class Migrator:
    """One process of ``release``'s code that applies migrations one at a time, as it is told."""

    def __init__(self, release: Release, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", MIGRATE_EACH], cwd=release.tree, text=True,
            env={**env, "DJANGO_SETTINGS_MODULE": "accs_site.settings", "PYTHONPATH": str(release.tree)},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def migrate(self, migration: str) -> subprocess.CompletedProcess:
        """Apply ``app.name``; return what ``manage.py migrate APP MIGRATION`` would have (exit code, output)."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(" ".join(migration.split(".", 1)) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:  # the process died: its stderr says why
            return subprocess.CompletedProcess(self.proc.args, 1, "", self.close())
        done = json.loads(answer)
        return subprocess.CompletedProcess(self.proc.args, done["exit"], done["output"], "")

    def close(self) -> str:
        """End the process; return its stderr."""
        _, err = self.proc.communicate(input="", timeout=60)
        return err


def django_snippet(release: Release, code: str, *, env: dict[str, str]) -> str:
    """Run ``code`` with ``release``'s Django set up; return its stdout."""
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + code], cwd=release.tree,
                          env={**env, "DJANGO_SETTINGS_MODULE": "accs_site.settings", "PYTHONPATH": str(release.tree)},
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{release.name}: {done.stderr[-2000:]}")
    return done.stdout


SETUP = """
from django.contrib.auth import get_user_model
from django.core.management import call_command
from tenants.accounts import issue_token
from workflows.api import save_service
save_service(key="drill-work", executor="command",
             executor_config={{"argv": ["python", {work!r}, "{{seconds}}"], "env": {{"CHAOS_LEDGER": {ledger!r}}}}},
             params_schema={{"type": "object", "properties": {{"seconds": {{"type": "number"}}}},
                            "required": ["seconds"]}}, max_attempts=5, timeout_seconds=120)
get_user_model().objects.create_user("drill")
call_command("accs_member", "add", "drill", "default", "--role", "admin")
print(issue_token("drill", "drill load", expires_at=None, scopes="read,run")[1])
"""
OLD_TOKEN = """
from tenants.accounts import issue_token
print(issue_token("drill", "after migrate", expires_at=None, scopes=None)[0].prefix)
"""


def last_migrations(tree: Path) -> dict[str, str]:
    """Return each ACCS app's newest migration in ``tree`` (the previous release's state to roll back to)."""
    out = {}
    for app in APPS:
        names = sorted(p.stem for p in (tree / app / "migrations").glob("[0-9][0-9][0-9][0-9]_*.py"))
        if names:
            out[app] = names[-1]
    return out


def log_says(proc: Proc, text: str) -> bool:
    return text in proc.log_files[-1][1].read_text(errors="replace")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class Drill:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="accs-upgrade-"))
        os.chmod(self.work, 0o755)
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.ledger = self.work / "ledger.txt"
        self.ledger.touch()
        self.cluster = Cluster(self.work / "pg")
        self.cluster.env["ACC_PG_DBNAME"] = "drill"
        self.cluster.url = self.cluster.url.rsplit("/", 1)[0] + "/drill"
        self.old = Release("old", self.work / "previous")
        self.new = Release("new", ROOT)
        self.env = {**os.environ, "ACC_DB_URL": self.cluster.url, "PYTHONUNBUFFERED": "1", "ACC_LOG_FORMAT": "json",
                    "ACC_LOG_LEVEL": "INFO", "ACC_POLL_INTERVAL_SEC": "0.5", "ACC_ALLOWED_EXECUTABLES": "python",
                    "ACC_ALLOWED_TASK_ENV": "CHAOS_LEDGER", "ACC_SECRET_KEY": secrets.token_urlsafe(50),
                    "ACC_METRICS_TOKEN": secrets.token_urlsafe(20)}
        self.env.pop("PYTHONPATH", None)
        self.migrate_env = {**self.env, "ACC_DB_URL": f"{self.cluster.url}?application_name={MIGRATE_APP}"}
        self.builders = [Proc(f"builder-{i}", ["runbuilder", "--tick", "0.5", "--lease-seconds", str(LEASE_SECONDS)],
                              self.env, self.logs) for i in range(args.builders)]
        self.agents = [Proc(f"agent-{i}", ["runagent", "--node", f"drill-{i}", "--services", "drill-work",
                                           "--max-concurrent", str(args.slots), "--drain-seconds", "120"],
                            self.env, self.logs) for i in range(args.agents)]
        self.web = Web(self.work, self.env, self.logs)
        self.steps: list[tuple[str, float]] = []
        self.facts: dict[str, object] = {}

    def step(self, name: str, started: float) -> None:
        self.steps.append((name, round(time.monotonic() - started, 1)))
        say(f"{name}: {time.monotonic() - started:.1f} s")

    # The scenario.
    def run(self) -> dict:
        try:
            return self._run()
        finally:
            self._teardown()

    def _run(self) -> dict:
        token = self._start_previous()
        load = Load(self.web.url, token, long_seconds=tuple(self.args.long_seconds))
        load.start()
        say("the previous release is running with a job stream")
        time.sleep(self.args.warmup)  # the stream builds up history and running long jobs
        if self.args.each_migration:
            self._each_migration()
        else:
            self._upgrade_and_back(load)
        load.stopping.set()
        load.join(timeout=60)
        self.facts["drained_s"] = self._drain(timeout=self.args.drain_timeout)
        return self._figures(load)

    def _start_previous(self) -> str:
        """Start the previous release on a private cluster: migrated, its daemons and web up; return a token."""
        say(f"previous release {self.args.previous} into {self.old.tree}")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(self.old.tree), self.args.previous],
                       check=True, capture_output=True)
        # Its bytecode once, here: every process of the old release would compile its sources again
        # where PYTHONDONTWRITEBYTECODE is set (as `make install` does for this tree).
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(self.old.tree)], check=True,
                       capture_output=True)
        self.cluster.start()
        with psycopg.connect(self.cluster.url, autocommit=True) as conn:
            for setting, value in (("log_lock_waits", "on"), ("deadlock_timeout", "500ms"),
                                   ("log_line_prefix", "%m [%p] app=%a| ")):
                conn.execute(f"ALTER SYSTEM SET {setting} = '{value}'")
            conn.execute("SELECT pg_reload_conf()")
        manage(self.old, "migrate", "--noinput", "-v0", env=self.migrate_env)
        token = django_snippet(self.old, SETUP.format(work=str(ROOT / "chaos" / "work.py"), ledger=str(self.ledger)),
                               env=self.env).strip().splitlines()[-1]
        self.facts["previous_migrations"] = last_migrations(self.old.tree)

        for proc in (*self.builders, *self.agents):
            proc.start(self.old)
        self.web.start(self.old)
        wait_for(lambda: http_status(self.web.url + "/api/v1/health") == 200, timeout=60, message="the old web")
        wait_for(lambda: any(log_says(b, "now the leader") for b in self.builders), timeout=60,
                 message="an old builder leading")
        return token

    def _each_migration(self) -> None:
        """Apply each newer migration alone under the old daemons; count their errors and waits after each."""
        self.facts["per_migration"] = []
        migrator = Migrator(self.new, self.migrate_env)
        try:
            for migration in self._pending_migrations():
                errors_before, blocked_before = len(self._old_errors()), len(self._old_blocked())
                t0 = time.monotonic()
                done = migrator.migrate(migration)
                self.step(f"migrate {migration} (new code, old daemons running)", t0)
                self._note_lock_waits(done)
                self.facts["per_migration"].append({
                    "migration": migration, "exit": done.returncode, "seconds": round(time.monotonic() - t0, 1),
                    "old_error_lines": len(self._old_errors()) - errors_before,
                    "old_blocked_over_0_5s": len(self._old_blocked()) - blocked_before,
                    **({"output": (done.stdout + done.stderr)[-1500:]} if done.returncode else {})})
                if done.returncode:
                    break  # the later ones depend on it
        finally:
            migrator.close()
        self.facts["old_token_after_migrate"] = self._old_token()

    def _note_lock_waits(self, done: subprocess.CompletedProcess) -> None:
        """Keep migrate's lines about lock waits it gave up and tried again (its lock timeout at work)."""
        waits = self.facts.setdefault("migrate_lock_waits", [])
        waits.extend(line.strip() for line in done.stdout.splitlines() if "lock wait over" in line)

    def _pending_migrations(self) -> list[str]:
        """Return the migrations the new code would apply, ``app.name`` in its plan's order."""
        plan = manage(self.new, "showmigrations", "--plan", env=self.migrate_env).stdout
        return [line.split()[-1] for line in plan.splitlines() if line.startswith("[ ]")]

    def _upgrade_and_back(self, load: Load) -> None:
        t0 = time.monotonic()
        done = manage(self.new, "migrate", "--noinput", env=self.migrate_env, check=False)
        if done.returncode:
            raise RuntimeError(f"migrate (new code) failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
        self.step("migrate (new code, old daemons running)", t0)
        self._note_lock_waits(done)
        self.facts["old_token_after_migrate"] = self._old_token()

        self._roll(self.new, t0=time.monotonic())
        self.facts["new_ready"] = http_status(self.web.url + "/api/v1/ready")
        time.sleep(self.args.settle)

        if self.args.rollback:
            self._roll(self.old, t0=time.monotonic())
            t0 = time.monotonic()
            for app, name in self.facts["previous_migrations"].items():
                self._note_lock_waits(manage(self.new, "migrate", app, name, "--noinput", env=self.migrate_env))
            self.step("migrate down (new code's migrate APP MIGRATION), old daemons running", t0)
            check = manage(self.old, "migrate", "--check", env=self.migrate_env, check=False)
            self.facts["rollback_old_migrate_check_exit"] = check.returncode
            self.facts["rollback_accepted_before"] = len(load.accepted)
            time.sleep(self.args.settle)
            self.facts["rollback_accepted_after"] = len(load.accepted) - self.facts["rollback_accepted_before"]

    def _roll(self, release: Release, *, t0: float) -> None:
        """The recipe's rolling restart onto ``release``: web reload, builders one by one, agents one by one."""
        self.web.reload(release)
        wanted = VERSION if release is self.new else "old"
        wait_for(lambda: self.web.serves(wanted), timeout=90,
                 message=f"the web's workers on the {release.name} release")
        self.step(f"web reloaded onto the {release.name} release (HUP)", t0)
        # A builder's SIGTERM ends its tick and its lease; an agent's drains its running tasks.
        for procs, command, stop_timeout, verb in ((self.builders, "runbuilder", 30, "restarted"),
                                                   (self.agents, "runagent", 150, "drained and restarted")):
            for proc in procs:
                proc.stop(timeout=stop_timeout)
                proc.start(release)
                wait_for(lambda p=proc, c=command: log_says(p, STARTED_LINES[c]), timeout=120,
                         message=f"{proc.name} started on the {release.name} release")
                self.step(f"{proc.name} {verb} on the {release.name} release", t0)

    def _old_token(self) -> str:
        try:
            return "created " + django_snippet(self.old, OLD_TOKEN, env=self.env).strip()
        except RuntimeError as exc:
            return f"FAILED: {str(exc)[-300:]}"

    def _drain(self, *, timeout: float) -> float:
        started = time.monotonic()
        with psycopg.connect(self.cluster.url, autocommit=True) as conn:
            def finished() -> bool:
                return not conn.execute("SELECT 1 FROM accs_task WHERE status <> 'done' LIMIT 1").fetchone() and \
                    not conn.execute("SELECT 1 FROM accs_job j WHERE NOT EXISTS"
                                     " (SELECT 1 FROM accs_task t WHERE t.job_id = j.id) LIMIT 1").fetchone()
            try:
                wait_for(finished, timeout=timeout, interval=0.5, message="every task to finish")
            except pytest.fail.Exception:
                pass  # counted as stuck
        return round(time.monotonic() - started, 1)

    # The figures.
    def _figures(self, load: Load) -> dict:
        with psycopg.connect(self.cluster.url, autocommit=True) as conn:
            q = lambda sql, *p: conn.execute(sql, p).fetchone()[0]  # noqa: E731
            accepted = [a for a in load.accepted if a and a != "None"]
            missing = q("SELECT count(*) FROM unnest(%s::uuid[]) a(id) WHERE NOT EXISTS"
                        " (SELECT 1 FROM accs_job j WHERE j.id = a.id)", accepted)
            no_task = q("SELECT count(*) FROM accs_job j"
                        " WHERE NOT EXISTS (SELECT 1 FROM accs_task t WHERE t.job_id = j.id)")
            succeeded_twice = q("SELECT count(*) FROM (SELECT task_id FROM accs_attempt WHERE status = 'succeeded'"
                                " GROUP BY task_id HAVING count(*) > 1) s")
            stuck = q("SELECT count(*) FROM accs_task WHERE status <> 'done'")
            overlaps = conn.execute(OVERLAP_SQL).fetchall()
            terms = conn.execute("SELECT fence, holder, acquired_at, expires_at FROM accs_leader_term"
                                 " ORDER BY acquired_at").fetchall()
            tasks = q("SELECT count(*) FROM accs_task")
            interrupted = q("SELECT count(*) FROM accs_attempt WHERE status = 'interrupted'")
        ledger = [line.split() for line in self.ledger.read_text().splitlines() if line.strip()]
        ends = Counter(parts[1] for parts in ledger if parts[0] == "end")
        gaps = [(b[2] - a[3]).total_seconds() for a, b in zip(terms, terms[1:], strict=False)]
        errors, blocked = self._old_errors(), self._old_blocked()
        gates = {
            "lost": missing + no_task,
            "run_twice": sum(1 for n in ends.values() if n > 1) + succeeded_twice
            + sum(1 for parts in ledger if parts[0] == "overlap"),
            "stuck": stuck,
            "refused": len(load.refused),
            "old_error_lines": len(errors),
            "old_blocked_over_0_5s": len(blocked),
            "leader_overlaps": len(overlaps),
            "leader_gap_over_lease": int(max(gaps, default=0) > LEASE_SECONDS),
            "old_token_after_migrate_failed": int(not str(self.facts["old_token_after_migrate"]).startswith("created")),
        }
        if self.args.rollback:
            gates["rollback_old_migrate_check_failed"] = int(self.facts["rollback_old_migrate_check_exit"] != 0)
            gates["rollback_no_jobs_after"] = int(not self.facts["rollback_accepted_after"])
        if self.args.each_migration:
            gates["migrate_failed"] = sum(1 for m in self.facts["per_migration"] if m["exit"])
        elif self.facts.get("new_ready") != 200:
            gates["new_web_not_ready"] = 1
        return {
            "previous_release": self.args.previous, "passed": all(v == 0 for v in gates.values()), "gates": gates,
            "jobs_accepted": len(accepted), "tasks": tasks, "interrupted_attempts": interrupted,
            "leader_terms": [(fence, holder) for fence, holder, *_ in terms],
            "leader_gap_max_s": round(max(gaps, default=0), 2), "steps_s": self.steps,
            "refused_detail": load.refused[:10], "old_error_detail": errors[:10], "blocked_detail": blocked[:10],
            **{k: v for k, v in self.facts.items() if k != "previous_migrations"},
            "rolled_back_to": self.facts["previous_migrations"] if self.args.rollback else None,
            "logs": str(self.logs) if self.args.keep else None,
        }

    def _old_errors(self) -> list[str]:
        """Error lines in the logs of the daemons started from the previous release."""
        old_logs = [path for proc in (*self.builders, *self.agents) for rel, path in proc.log_files if rel == "old"]
        return [line for path in old_logs for line in _error_lines(path)]

    def _old_blocked(self) -> list[str]:
        """The server's lock-wait lines (over 0.5 s) of every session but migrate's own."""
        return [m.group(0) for m in BLOCKED.finditer(self.cluster.server_log()) if m.group("app") != MIGRATE_APP]

    def _teardown(self) -> None:
        self.web.stop()
        for proc in (*self.agents, *self.builders):
            try:
                proc.stop(timeout=30)
            except RuntimeError as exc:
                say(str(exc))
        try:
            self.cluster.stop()
        except subprocess.CalledProcessError:
            pass
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(self.old.tree)],
                       capture_output=True)
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def _error_lines(path: Path) -> list[str]:
    """Return the log's lines at level error or above (JSON lines, or plain text), and traceback heads."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        level = ""
        if line.startswith("{"):
            try:
                level = str(json.loads(line).get("level", ""))
            except ValueError:
                pass
        if level.lower() in ("error", "critical") or line.startswith("Traceback") or " ERROR " in line:
            out.append(f"{path.name}: {line[:300]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="ACCS upgrade drill; prints JSON, exits 1 if a gate fails.")
    parser.add_argument("--previous", default=PREVIOUS_RELEASE, help="git revision of the previous release")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--rollback", action="store_true", default=os.environ.get("DRILL_ROLLBACK") == "1",
                      help="then roll back to the previous release (code first, then the schema)")
    mode.add_argument("--each-migration", action="store_true",
                      help="no restart: apply each newer migration alone under the old daemons, checking after each")
    parser.add_argument("--builders", type=int, default=BUILDERS)
    parser.add_argument("--agents", type=int, default=AGENTS)
    parser.add_argument("--slots", type=int, default=SLOTS, help="each agent's --max-concurrent")
    parser.add_argument("--long-seconds", type=float, nargs=2, default=LONG_SECONDS, metavar=("LOW", "HIGH"),
                        help="how long the long job (one every few seconds) runs")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of job stream before migrate")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of job stream after each switch")
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (cluster, logs, ledger)")
    args = parser.parse_args()
    result = Drill(args).run()
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
