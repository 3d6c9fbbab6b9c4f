"""What a task can reach of its agent and of other attempts: the agent is not dumpable (its
environment is closed to tasks of the same OS user), attempts' scratch folders are unguessable in a
folder other users cannot list, and a service may ask for a bubblewrap sandbox in which a task sees
its own folders and the system's read-only paths only (real agents, real processes)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from jobs import api
from jobs.claim import ClaimedTask
from jobs.models import Attempt, Task
from nodes.executors import RunContext, run_process
from nodes.executors.sandbox import wrap
from nodes.scratch import scratch_dir, scratch_root
from tests.daemons import ROOT, wait_all_final, wait_for
from workflows.models import Service
from workflows.validation import DefinitionError, sandbox_problems

NOBODY = 65534

# Reads its agent's environment (the agent started it: its parent) and a sibling's (a process of the
# same user that is dumpable, as any program is after exec); prints what it could read as results.
PEEK = r"""
import json, os, subprocess, sys
def read(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return "read" if fh.read() else "empty"
    except OSError as exc:
        return f"refused: {exc.strerror}"
sibling = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE)
sibling.stdout.readline()  # it runs its program now (its environment is its own from here)
try:
    print(json.dumps({"agent": read(os.getppid()), "sibling": read(sibling.pid), "uid": os.getuid()}))
finally:
    sibling.kill()
"""

# Tries what a nosy task would: another attempt's file, the agent's environment, listing the scratch
# folders; writes and reads a file of its own; prints what happened as results.
PROBE = r"""
import json, os, sys
other, agent_pid, scratch_parent = sys.argv[1], sys.argv[2], sys.argv[3]
def attempt(action):
    try:
        return ["ok", action()]
    except OSError as exc:
        return ["refused", type(exc).__name__]
def read_text(path, limit=200):
    with open(path, "rb") as fh:
        return fh.read(limit).decode(errors="replace")
own = os.path.join(os.environ["ACCS_OUTPUT_DIR"], "mine.txt")
with open(own, "w") as fh:
    fh.write("my own")
print(json.dumps({
    "other_attempt": attempt(lambda: read_text(other)),
    "agent_environ": attempt(lambda: "ACC_DB_URL" in read_text(f"/proc/{agent_pid}/environ", 1 << 20)),
    "scratch_listing": attempt(lambda: sorted(os.listdir(scratch_parent))),
    "own_folders": sorted(os.path.basename(p) for p in (os.environ["ACCS_OUTPUT_DIR"],
                                                        os.path.dirname(os.environ["ACCS_PARAMS_FILE"]))),
    "own_file": attempt(lambda: read_text(own)),
    "params": attempt(lambda: json.loads(read_text(os.environ["ACCS_PARAMS_FILE"], 1 << 20))),
    "params_write": attempt(lambda: open(os.environ["ACCS_PARAMS_FILE"], "a").close()),
    "home": attempt(lambda: len(os.listdir("/root"))),
}))
"""

# Holds a file in its scratch folder until the test's release file appears (bounded).
HOLDER = r"""
import os, pathlib, sys, time
(pathlib.Path(os.environ["ACCS_OUTPUT_DIR"]) / "secret.txt").write_text("another attempt's secret")
deadline = time.monotonic() + 120
while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def literal(code: str) -> str:
    """Return ``code`` as an argv element that renders as itself (braces doubled)."""
    return code.replace("{", "{{").replace("}", "}}")


def require_bwrap() -> str:
    """Return bwrap's path; fail (never skip) where it is missing: scripts/sandbox_deps.sh installs it."""
    tool = shutil.which("bwrap")
    if tool is None:
        pytest.fail("bubblewrap (bwrap) is missing: run scripts/sandbox_deps.sh (make test does)")
    return tool


def as_unprivileged_user() -> list[str]:
    """Return the argv prefix that runs a program as an unprivileged user ([] when this is not root).

    Root reads every process's /proc files whatever their dumpable flag says, so the agent and its
    task run as 'nobody'. They keep one capability, to read files (the interpreter and the checkout may
    sit in folders 'nobody' cannot enter, as /root); it lets nothing read another process's
    environment, which the kernel checks as ptrace access, not as file access.
    """
    if os.getuid() != 0:
        return []
    tool = shutil.which("setpriv")
    if tool is None:
        pytest.fail("this test runs the agent as an unprivileged user with setpriv (util-linux): install it")
    return [tool, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search"]


def agent(args: list[str], *, env: dict[str, str], log: Path, prefix: list[str] = ()) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([*prefix, sys.executable, str(ROOT / "manage.py"), "runagent", *args], cwd="/",
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------------
# The agent is not dumpable
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_task_of_the_agents_own_user_cannot_read_the_agents_environment(make_service, subprocess_env, tmp_path,
                                                                           db_url):
    make_service("peek", executor="command", max_attempts=1, executor_config={"argv": ["python", "-c", literal(PEEK)]})
    job = api.start_service("peek")
    proc = agent(["--node", "n1", "--services", "peek", "--once"], env=subprocess_env, log=tmp_path / "agent.log",
                 prefix=as_unprivileged_user())
    try:
        wait_all_final(db_url, timeout=90)
        assert proc.wait(timeout=30) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        stop(proc)
    task = Task.objects.get(job=job)
    assert task.status == "done", (task.error_message, (tmp_path / "agent.log").read_text()[-3000:])
    results = task.results
    assert results["uid"] == os.getuid() or results["uid"] == NOBODY
    # The same reader reads a same-user process that is dumpable: the refusal is the agent's flag.
    assert results["sibling"] == "read", results
    assert results["agent"] == "refused: Permission denied", results


# --------------------------------------------------------------------------------------------
# Scratch folders
# --------------------------------------------------------------------------------------------

def _task() -> ClaimedTask:
    return ClaimedTask(id=uuid.uuid4(), job_id=uuid.uuid4(), task_key="t", attempt=1, params={},
                       timeout_seconds=60, host=None, service_key="s")


def test_scratch_folders_are_unguessable_and_others_cannot_list_them(monkeypatch):
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # where another user may pass, as the temp folder
    base.chmod(0o755)
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    try:
        folders = [Path(scratch_dir(_task())) for _ in range(3)]
        parent = folders[0].parent
        assert parent == scratch_root() == base / f"accs-scratch-{os.getuid()}"
        assert stat.S_IMODE(parent.stat().st_mode) == 0o711
        for folder in folders:
            assert folder.parent == parent and stat.S_IMODE(folder.stat().st_mode) == 0o700
            # accs-<task>-<attempt>-<agent pid>-<32 random hex digits><mkdtemp's own>
            int(folder.name.split("-")[4][:32], 16)
        assert len({f.name.split("-")[4][:32] for f in folders}) == 3
        (folders[0] / "file").write_text("x")
        if os.getuid() == 0:  # another user may pass through the parent, never list it
            nobody = [*as_unprivileged_user()[:4]]
            listing = subprocess.run([*nobody, "ls", str(parent)], capture_output=True, text=True)
            assert listing.returncode != 0 and "Permission denied" in listing.stderr, listing
            passing = subprocess.run([*nobody, "ls", str(folders[0])], capture_output=True, text=True)
            assert passing.returncode != 0 and "Permission denied" in passing.stderr, passing
            parent_entry = subprocess.run([*nobody, "stat", str(parent)], capture_output=True, text=True)
            assert parent_entry.returncode == 0, "the parent is passable (0711), only not listable"
    finally:
        shutil.rmtree(base)


def test_a_scratch_parent_someone_else_made_is_refused(tmp_path):
    taken = tmp_path / f"accs-scratch-{os.getuid()}"
    taken.symlink_to(tmp_path)
    with pytest.raises(OSError, match="is not a folder of this OS user"):
        scratch_root(base=str(tmp_path))


# --------------------------------------------------------------------------------------------
# The sandbox
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_sandboxed_task_reaches_neither_another_attempts_folder_nor_the_agent(make_service, daemons, db_url,
                                                                               tmp_path):
    require_bwrap()
    release = tmp_path / "release"
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in ("other", "pid", "parent", "go")}}
    make_service("holder", executor="command", max_attempts=1, params_schema=schema,
                 executor_config={"argv": ["python", "-c", HOLDER, "{go}"]})
    probe_argv = ["python", "-c", literal(PROBE), "{other}", "{pid}", "{parent}"]
    make_service("open", executor="command", max_attempts=1, params_schema=schema,
                 executor_config={"argv": probe_argv})
    make_service("boxed", executor="command", max_attempts=1, params_schema=schema,
                 executor_config={"argv": probe_argv, "sandbox": "bwrap"})
    holder = api.start_service("holder", params={"go": str(release)})
    proc = daemons.agent("n1", "holder,open,boxed")
    parent = Path(tempfile.gettempdir()) / f"accs-scratch-{os.getuid()}"
    secret = wait_for(lambda: next(iter(parent.glob("accs-*/secret.txt")), None), timeout=60,
                      message="the holder's scratch file")
    params = {"other": str(secret), "pid": str(proc.pid), "parent": str(parent)}
    jobs = {name: api.start_service(name, params=params) for name in ("open", "boxed")}
    wait_for(lambda: Task.objects.filter(job__in=jobs.values(), status__in=("done", "error")).count() == 2,
             timeout=90, message="both probes to end")
    release.touch()
    wait_all_final(db_url, timeout=60)
    results = {}
    for name, job in jobs.items():
        task = Task.objects.get(job=job)
        assert task.status == "done", (name, task.error_message, Attempt.objects.filter(task=task).first())
        results[name] = task.results
    # Unsandboxed, an attempt of the same OS user finds and reads another's folder (the parent is its own).
    assert results["open"]["other_attempt"] == ["ok", "another attempt's secret"], results
    assert results["open"]["scratch_listing"][0] == "ok" and len(results["open"]["scratch_listing"][1]) >= 3, results
    if os.getuid() == 0:  # root reads any process's environment, dumpable or not
        assert results["open"]["agent_environ"] == ["ok", True], results
    # In the sandbox: its own folder only; the agent's processes are not in its process namespace.
    assert results["boxed"]["own_file"] == ["ok", "my own"], results
    assert results["boxed"]["other_attempt"] == ["refused", "FileNotFoundError"], results
    assert results["boxed"]["agent_environ"] == ["refused", "FileNotFoundError"], results
    assert results["boxed"]["scratch_listing"] == ["ok", results["boxed"]["own_folders"]], \
        "its own folders (its output and its params) are all it finds there"
    # It reads its params from their file, which it cannot change.
    assert results["boxed"]["params"] == ["ok", params], results
    assert results["boxed"]["params_write"] == ["refused", "OSError"], results
    assert results["boxed"]["home"][0] == "refused" or results["boxed"]["home"] == ["ok", 1], results
    assert Task.objects.get(job=holder).status == "done"


def test_a_service_asking_for_the_sandbox_on_a_node_without_bwrap_is_refused_not_run(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap in it
    task = _task()
    ctx = RunContext(task=task, service_config={"sandbox": "bwrap"}, on_started=lambda pid: None,
                     on_progress=lambda value: None, on_log=lambda level, text: None)
    outcome = run_process(task, ctx, ["/usr/bin/touch", str(marker)])
    assert (outcome.status, outcome.error_code, outcome.retryable) == ("failed", "not_allowed", False)
    assert "bubblewrap (bwrap) is not installed" in outcome.error
    assert not marker.exists()


@pytest.mark.parametrize("config", [{"sandbox": "firejail"}, {"sandbox": ""}])
def test_an_unknown_sandbox_in_an_unvalidated_row_is_refused_not_run(config, tmp_path):
    marker = tmp_path / "ran"
    task = _task()
    ctx = RunContext(task=task, service_config=config, on_started=lambda pid: None,
                     on_progress=lambda value: None, on_log=lambda level, text: None)
    outcome = run_process(task, ctx, ["/usr/bin/touch", str(marker)])
    assert (outcome.status, outcome.error_code) == ("failed", "not_allowed"), outcome.error
    assert not marker.exists()


def test_only_command_services_may_ask_for_the_sandbox_and_others_are_refused_at_run_time():
    from nodes.executors import HttpExecutor, PythonExecutor

    task = _task()
    for executor, config in ((PythonExecutor(), {"callable": "tests.callables:noop", "sandbox": "bwrap"}),
                             (HttpExecutor(), {"url": "http://127.0.0.1:9/", "sandbox": "bwrap"})):
        ctx = RunContext(task=task, service_config=config, on_started=lambda pid: None,
                         on_progress=lambda value: None, on_log=lambda level, text: None)
        outcome = executor.run(task, ctx)
        assert (outcome.status, outcome.error_code) == ("failed", "not_allowed"), outcome.error


def test_validation_names_what_is_wrong_with_a_sandbox(db, make_service):
    make_service("boxed", executor="command",
                 executor_config={"argv": ["python", "-c", "1"], "sandbox": "bwrap", "sandbox_paths": ["/opt/data"],
                                  "sandbox_network": True})
    for executor, config, where in [
        ("command", {"argv": ["python"], "sandbox": "docker"}, "executor_config.sandbox"),
        ("python", {"callable": "tests.callables:noop", "sandbox": "bwrap"}, "executor_config.sandbox"),
        ("command", {"argv": ["python"], "sandbox": "bwrap", "sandbox_paths": ["data"]},
         "executor_config.sandbox_paths"),
        ("command", {"argv": ["python"], "sandbox": "bwrap", "sandbox_network": "yes"},
         "executor_config.sandbox_network"),
        ("command", {"argv": ["python"], "sandbox_paths": ["/opt"]}, "executor_config.sandbox_paths"),
    ]:
        with pytest.raises(DefinitionError) as refused:
            make_service(f"bad-{executor}", executor=executor, executor_config=config)
        assert where in str(refused.value), (config, str(refused.value))
    assert not Service.objects.filter(key__startswith="bad-").exists()


@given(paths=st.lists(st.text(alphabet="/.apx-", max_size=12) | st.sampled_from(["/", "/proc", "/tmp/x", "/usr/a"]),
                      max_size=4))
def test_every_accepted_sandbox_path_is_absolute_normalised_and_bound_read_only(paths):
    problems = sandbox_problems("command", {"sandbox": "bwrap", "sandbox_paths": paths})
    hidden = ("/proc", "/sys", "/dev", "/tmp")
    expected = all(p.startswith("/") and os.path.normpath(p) == p and p != "/"
                   and not any(p == h or p.startswith(h + "/") for h in hidden) for p in paths)
    assert (not problems) == expected, problems
    if not problems:
        _, argv = wrap(["/usr/bin/true"], config={"sandbox": "bwrap", "sandbox_paths": paths},
                       executable="/usr/bin/true", folders=[])
        bound = {argv[i + 1] for i, option in enumerate(argv) if option == "--ro-bind"}
        assert all(p in bound or p.startswith("/usr/") for p in paths), (paths, argv)
        assert not {argv[i + 1] for i, option in enumerate(argv) if option == "--bind"}, "nothing else is writable"
