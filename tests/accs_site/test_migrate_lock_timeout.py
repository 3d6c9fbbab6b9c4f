"""``manage.py migrate`` waits for a lock at most its lock timeout, tries again, and gives up with one line.

Real PostgreSQL, real processes: a throwaway app (written to a temporary folder, added to the settings)
has an atomic migration adding a column to ``accs_task`` (ACCESS EXCLUSIVE) and a non-atomic one
building an index on it concurrently. A second connection holds a claim's lock on ``accs_task`` in an
open transaction (ROW EXCLUSIVE, as an agent's report does) while ``migrate`` runs in a subprocess; a
third runs ordinary reads of ``accs_task`` meanwhile and times each.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command
from hypothesis import given, strategies as st

from accs_site.migrate_locks import LockPolicy, concurrent_index_name, is_lock_timeout
from tests import forkserver
from tests.daemons import ROOT, wait_for

COLUMN = "lockprobe_note"
INDEX = "lockprobe_task_idx"
APP = {
    "__init__.py": "",
    "migrations/__init__.py": "",
    "migrations/0001_task_column.py": f'''
from django.db import migrations, models

class Migration(migrations.Migration):
    operations = [
        migrations.CreateModel("Note", [("id", models.BigAutoField(primary_key=True)), ("text", models.TextField())]),
        migrations.RunSQL('ALTER TABLE accs_task ADD COLUMN {COLUMN} text',
                          'ALTER TABLE accs_task DROP COLUMN {COLUMN}'),
    ]
''',
    "migrations/0002_task_index.py": f'''
from django.db import migrations

class Migration(migrations.Migration):
    atomic = False
    dependencies = [("lockprobe", "0001_task_column")]
    operations = [migrations.RunSQL('CREATE INDEX CONCURRENTLY {INDEX} ON accs_task ({COLUMN})',
                                    'DROP INDEX CONCURRENTLY IF EXISTS {INDEX}')]
''',
}
SETTINGS = ("from accs_site.settings import *  # noqa: F403\n"
            "INSTALLED_APPS = [*INSTALLED_APPS, 'lockprobe']  # noqa: F405\n")


@pytest.fixture
def probe_env(subprocess_env, tmp_path: Path, db_url: str) -> Iterator[dict[str, str]]:
    for name, text in APP.items():
        path = tmp_path / "lockprobe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "lockprobe_settings.py").write_text(SETTINGS)
    yield {**subprocess_env, "PYTHONPATH": f"{tmp_path}:{ROOT}", "DJANGO_SETTINGS_MODULE": "lockprobe_settings"}
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f"DROP INDEX IF EXISTS {INDEX}")
        conn.execute(f"ALTER TABLE accs_task DROP COLUMN IF EXISTS {COLUMN}")
        conn.execute("DROP TABLE IF EXISTS lockprobe_note")
        conn.execute("DELETE FROM django_migrations WHERE app = 'lockprobe'")


def _migrate(env: dict[str, str], *args: str, out: Path | None = None) -> subprocess.Popen:
    return forkserver.Popen([sys.executable, "manage.py", "migrate", "lockprobe", *args, "--noinput"], cwd=ROOT,
                            env=env, stdout=open(out, "w") if out else subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture
def no_autovacuum_of_accs_task(db_url: str):
    """No autovacuum of accs_task while the test runs, and none running when it starts.

    An autovacuum worker holds the lock an index build takes first (SHARE UPDATE EXCLUSIVE) and is
    told to give way only after deadlock_timeout (1 s), longer than the test's lock timeout (0.3 s):
    the build would time out before it recorded its index, not in the wait the test is about. Turning
    autovacuum off for the table takes that lock too, so it also waits out (or cancels) one running.
    """
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE accs_task SET (autovacuum_enabled = false)")
    yield
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE accs_task RESET (autovacuum_enabled)")


def _holding_a_claim_lock(db_url: str) -> psycopg.Connection:
    """A connection in an open transaction holding ROW EXCLUSIVE on accs_task, as an agent mid-report."""
    conn = psycopg.connect(db_url, application_name="old-agent")
    conn.execute("LOCK TABLE accs_task IN ROW EXCLUSIVE MODE")
    return conn


class Reader(threading.Thread):
    """A third session: ordinary reads of accs_task back to back, each one timed."""

    def __init__(self, db_url: str) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(db_url, autocommit=True)
        self.stopping = threading.Event()
        self.longest = 0.0

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            self.conn.execute("SELECT count(*) FROM accs_task").fetchone()
            self.longest = max(self.longest, time.monotonic() - started)
            self.stopping.wait(0.02)

    def stop(self) -> float:
        self.stopping.set()
        self.join(timeout=30)
        self.conn.close()
        return self.longest


def _state(db_url: str) -> dict[str, object]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return {
            "table": conn.execute("SELECT to_regclass('lockprobe_note') IS NOT NULL").fetchone()[0],
            "column": conn.execute("SELECT 1 FROM information_schema.columns WHERE table_name = 'accs_task'"
                                   " AND column_name = %s", [COLUMN]).fetchone() is not None,
            "index_valid": (conn.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
                                         [INDEX]).fetchone() or [None])[0],
            "applied": [r[0] for r in conn.execute("SELECT name FROM django_migrations WHERE app = 'lockprobe'"
                                                   " ORDER BY name")],
        }


@pytest.mark.django_db(transaction=True)
def test_a_held_lock_delays_other_sessions_at_most_the_lock_timeout_and_migrate_applies_once_it_is_freed(
        probe_env, db_url, tmp_path):
    holder = _holding_a_claim_lock(db_url)
    reader = Reader(db_url)
    reader.start()
    out = tmp_path / "migrate.out"
    proc = _migrate(probe_env, "0001", "--lock-timeout", "1", "--lock-tries", "30", out=out)
    try:
        wait_for(lambda: out.read_text().count("lock wait over 1 s") >= 2, timeout=60,
                 message="migrate to time out twice on accs_task")
        assert "AccessExclusiveLock on accs_task, held by pid" in out.read_text() and "old-agent" in out.read_text()
        assert _state(db_url)["applied"] == []
    finally:
        holder.commit()  # the agent's report ends
        holder.close()
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    longest = reader.stop()
    # The reader queued behind migrate's waiting request (so the timeout mattered), never beyond it.
    assert 0.3 < longest < 1.0 + 0.8, longest
    # Its first operation (a new table) ran on every try, rolled back with the timeout, and stands once.
    assert _state(db_url) == {"table": True, "column": True, "index_valid": None, "applied": ["0001_task_column"]}


@pytest.mark.django_db(transaction=True)
def test_migrate_gives_up_after_its_tries_with_one_line_and_nothing_of_the_migration_applied(probe_env, db_url):
    holder = _holding_a_claim_lock(db_url)
    try:
        proc = _migrate(probe_env, "0001", "--lock-timeout", "0.3", "--lock-tries", "3")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        holder.rollback()
        holder.close()
    assert proc.returncode == 1, stderr
    [line] = [x for x in stderr.splitlines() if x.strip()]
    assert "migrate gave up on lockprobe.0001_task_column after 3 tries" in line, line
    assert "AccessExclusiveLock on accs_task" in line and "old-agent" in line and "nothing of it is applied" in line
    assert stdout.count("lock wait over 0.3 s") == 2, stdout
    assert _state(db_url) == {"table": False, "column": False, "index_valid": None, "applied": []}


@pytest.mark.django_db(transaction=True)
def test_an_index_build_that_timed_out_leaves_an_invalid_index_the_next_try_drops_and_builds_again(
        probe_env, db_url, no_autovacuum_of_accs_task):
    assert _migrate(probe_env, "0001").wait(timeout=120) == 0
    holder = _holding_a_claim_lock(db_url)
    try:
        proc = _migrate(probe_env, "0002", "--lock-timeout", "0.3", "--lock-tries", "2")
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1, stderr
        assert "migrate gave up on lockprobe.0002_task_index after 2 tries" in stderr, stderr
        # CREATE INDEX CONCURRENTLY recorded the index, then timed out waiting for the claim's writer.
        assert _state(db_url)["index_valid"] is False
        assert "dropping the INVALID index lockprobe_task_idx" in stdout, stdout
    finally:
        holder.commit()
        holder.close()
    again = _migrate(probe_env, "0002")
    stdout, stderr = again.communicate(timeout=120)
    assert again.returncode == 0, stderr
    assert "dropping the INVALID index lockprobe_task_idx" in stdout
    assert _state(db_url) == {"table": True, "column": True, "index_valid": True,
                              "applied": ["0001_task_column", "0002_task_index"]}


# Pure parts: the backoff, the index name, the error sorting.

@given(timeout=st.floats(min_value=0.001, max_value=600), tries=st.integers(min_value=1, max_value=100),
       attempt=st.integers(min_value=2, max_value=100))
def test_the_pause_before_a_try_is_positive_doubling_and_capped(timeout, tries, attempt):
    policy = LockPolicy(timeout_s=timeout, tries=tries)
    assert 0 < policy.pause_before(attempt) <= policy.backoff_cap_s
    assert policy.pause_before(attempt + 1) in (2 * policy.pause_before(attempt), policy.backoff_cap_s)
    assert policy.timeout_sql.startswith("SET lock_timeout = '") and policy.timeout_sql.endswith("ms'")


@pytest.mark.parametrize(("timeout", "tries"), [(0, 3), (-1, 3), (float("nan"), 3), (2, 0)])
def test_a_policy_without_a_positive_timeout_or_a_try_is_refused(timeout, tries):
    with pytest.raises(ValueError, match="lock timeout|at least 1 try"):
        LockPolicy(timeout_s=timeout, tries=tries)


identifiers = st.from_regex(r"[a-z_][a-z0-9_$]{0,40}", fullmatch=True)


@given(name=identifiers, quoted=st.booleans(), unique=st.booleans(), if_not_exists=st.booleans(),
       spaces=st.sampled_from([" ", "  ", "\n "]))
def test_the_index_a_concurrent_build_makes_is_named(name, quoted, unique, if_not_exists, spaces):
    sql = (f"CREATE{spaces}{'UNIQUE ' if unique else ''}INDEX CONCURRENTLY {'IF NOT EXISTS ' if if_not_exists else ''}"
           f"{f'{chr(34)}{name}{chr(34)}' if quoted else name.upper()} ON accs_task (id)")
    assert concurrent_index_name(sql) == name
    assert concurrent_index_name(sql.replace("CONCURRENTLY ", "")) is None


def test_only_the_lock_timeout_counts_as_a_lock_wait(db_url):
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '50ms'")
        with psycopg.connect(db_url) as holder:
            holder.execute("LOCK TABLE accs_task IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(psycopg.errors.LockNotAvailable) as timed_out:
                conn.execute("SELECT 1 FROM accs_task LIMIT 1")
        with pytest.raises(psycopg.errors.UndefinedTable) as other:
            conn.execute("SELECT 1 FROM no_such_table")
    assert is_lock_timeout(timed_out.value) and not is_lock_timeout(other.value)


@pytest.mark.django_db
@pytest.mark.parametrize(("option", "value", "problem"), [("lock_timeout", 0, "lock timeout must be above 0"),
                                                          ("lock_tries", 0, "at least 1 try")])
def test_migrate_refuses_a_lock_option_that_bounds_nothing(option, value, problem):
    with pytest.raises(CommandError, match=problem):
        call_command("migrate", "--check", **{option: value})
