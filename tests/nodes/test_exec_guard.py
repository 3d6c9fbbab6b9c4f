"""What runs is what the site allowed, checked on what is actually executed.

Each attack a reviewer ran against a live site is replayed here through a real agent and real
processes: a param that walks out of the allowed tool directory, a symlink out of it, a service
``env`` that makes bash or Python run a command, a param that becomes an option of the tool, a
site that never set its allow-list, and a node's wake script and provider URL. The marker files
the attacks would create (or the file they would empty) are the proof that nothing ran.
Generated inputs (hypothesis) then try the paths, option-looking values and variable names a
reviewer would try next against the same functions the agent calls.
"""

from __future__ import annotations

import os
import string
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from hypothesis import HealthCheck, given, settings, strategies as st

from accs_site.conf import reload
from jobs import api
from jobs.models import Attempt, Job, Task
from nodes import wake
from nodes.executors.base import OptionInjection, render_argv
from nodes.executors.guard import Refused, check_env, check_process, resolve
from nodes.models import Node, WakeMethod
from tests.daemons import Daemons, wait_all_final, wait_for
from workflows.api import save_service
from workflows.models import Service
from workflows.validation import LOADER_ENV_NAMES, DefinitionError, env_name_refusal

TOUCH = "/usr/bin/touch"


@pytest.fixture
def site(monkeypatch, tmp_path):
    """A site whose allow-list is one tools directory (with an allowed script and a symlink out of it)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    script = tools / "record.sh"
    script.write_text('#!/bin/sh\nhere="$(dirname "$0")/.."\nenv > "$here/wake-env.txt"\n'
                      'echo "$@" > "$here/args.txt"\n')
    script.chmod(0o755)
    (tools / "escape").symlink_to(TOUCH)
    settings_ = {"ACC_ALLOWED_EXECUTABLES": f"{tools}/,/usr/bin/sort,/bin/bash", "ACC_ALLOWED_CALLABLES": "tests",
                 "ACC_ALLOWED_TASK_ENV": "GREETING"}
    for name, value in settings_.items():
        monkeypatch.setenv(name, value)
    reload()
    yield tools, settings_
    monkeypatch.undo()
    reload()


def _raw_service(key: str, executor: str, config: dict, schema: dict | None = None) -> Service:
    """Write a service row as someone with database access would: no validation."""
    return Service.objects.create(key=key, executor=executor, executor_config=config, max_attempts=1,
                                  params_schema=schema or {"type": "object"})


def _run(services: str, env: dict[str, str], tmp_path: Path, db_url: str) -> None:
    (tmp_path / "logs").mkdir(exist_ok=True)
    daemons = Daemons(env, tmp_path / "logs")
    try:
        daemons.agent("n1", services)
        wait_all_final(db_url, timeout=90)
    finally:
        daemons.stop_all()


def _attempt(job: Job) -> Attempt:
    return Attempt.objects.get(task__job=job)


def _code(job: Job) -> str:
    return Task.objects.get(job=job).error_code


@pytest.mark.django_db(transaction=True)
def test_params_env_and_options_cannot_run_what_the_allow_list_refuses(site, default_tenant, subprocess_env,
                                                                       db_url, tmp_path):
    tools, allow = site
    walked, linked, bash_marker, py_marker = (tmp_path / n for n in ("walked", "linked", "bash-env", "py-env"))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    # A template with the program chosen by a param no longer validates; a row written straight
    # into the database is refused by the agent when the rendered program resolves elsewhere.
    _raw_service("traverse", "command", {"argv": [f"{tools}/{{tool}}", "{target}"]})
    walk = api.start_service("traverse", params={"tool": "../../../../../../usr/bin/touch", "target": str(walked)})
    # A symlink inside the allowed directory that points out of it passes a check of the path's text.
    save_service(key="linked", executor="command", max_attempts=1,
                 executor_config={"argv": [f"{tools}/escape", "{target}"]},
                 params_schema={"type": "object", "properties": {"target": {"type": "string"}}})
    link = api.start_service("linked", params={"target": str(linked)})
    # Start-up variables that make an allowed program run another.
    _raw_service("bash-env", "command", {"argv": ["/bin/bash", "-c", "true"],
                                         "env": {"BASH_ENV": f"$(touch {bash_marker})"}})
    bash = api.start_service("bash-env")
    _raw_service("py-env", "python", {"callable": "tests.callables:noop", "isolation": "process", "warm": False,
                                      "env": {"PYTHONWARNINGS": "ignore::antigravity.Foo",
                                              "BROWSER": f"touch {py_marker}"}})
    py = api.start_service("py-env")
    # A param that starts with '-' would be an option of the allowed tool: sort --output=<file>.
    save_service(key="sorter", executor="command", max_attempts=1,
                 executor_config={"argv": ["/usr/bin/sort", "{path}"]},
                 params_schema={"type": "object", "properties": {"path": {"type": "string"}}})
    option = api.start_service("sorter", params={"path": f"--output={victim}"})
    # After a literal "--" the same value is a file name: sort runs and fails on a missing file.
    save_service(key="sorter-sep", executor="command", max_attempts=1,
                 executor_config={"argv": ["/usr/bin/sort", "--", "{path}"]},
                 params_schema={"type": "object", "properties": {"path": {"type": "string"}}})
    separated = api.start_service("sorter-sep", params={"path": f"--output={victim}"})

    _run("traverse,linked,bash-env,py-env,sorter,sorter-sep", {**subprocess_env, **allow}, tmp_path, db_url)

    # The program a param names is refused before anything resolves it (the guard would refuse the path too:
    # the generated test below walks such paths through it).
    assert _code(walk) == "bad_params" and "never choose the program" in _attempt(walk).error_text
    for job, what in ((walk, "'..' in a param"), (link, "a symlink out of the directory"),
                      (bash, "BASH_ENV"), (py, "PYTHONWARNINGS and BROWSER")):
        attempt = _attempt(job)
        assert job is walk or _code(job) == "not_allowed", f"{what}: {_code(job)} {attempt.error_text}"
        assert attempt.pid is None, f"{what}: a process was started"
    assert "/usr/bin/touch" in _attempt(link).error_text, "the message names what would have run"
    assert "BASH_ENV" in _attempt(bash).error_text
    for marker in (walked, linked, bash_marker, py_marker):
        assert not marker.exists(), f"{marker.name}: a refused program ran"
    assert _code(option) == "bad_params"
    assert "starts with '-'" in _attempt(option).error_text
    assert _attempt(separated).exit_code == 2, "after '--' the value reached sort as a file name"
    assert victim.read_text() == "precious\n", "no option reached sort"


@pytest.mark.django_db(transaction=True)
def test_with_no_allow_list_set_an_agent_runs_only_the_demo_tool(default_tenant, subprocess_env, db_url,
                                                                   tmp_path, monkeypatch):
    marker = tmp_path / "shell-ran"
    for name in ("ACC_ALLOWED_EXECUTABLES", "ACC_ALLOWED_CALLABLES"):
        monkeypatch.delenv(name)
    reload()
    try:
        with pytest.raises(DefinitionError, match="ACC_ALLOWED_EXECUTABLES"):
            save_service(key="shell", executor="command", executor_config={"argv": ["/bin/sh", "-c", "true"]})
        _raw_service("shell", "command", {"argv": ["/bin/sh", "-c", f"touch {marker}"]})
        _raw_service("callable", "python", {"callable": "tests.callables:noop"})
        save_service(key="demo-echo", executor="command", max_attempts=1,
                     executor_config={"argv": ["python", "-m", "workflows.demo.tool", "echo", "--message", "{m}"]},
                     params_schema={"type": "object", "properties": {"m": {"type": "string"}}})
    finally:
        monkeypatch.undo()
        reload()
    shell, call, demo = (api.start_service("shell"), api.start_service("callable"),
                         api.start_service("demo-echo", params={"m": "hi"}))
    env = {k: v for k, v in subprocess_env.items() if k not in ("ACC_ALLOWED_EXECUTABLES", "ACC_ALLOWED_CALLABLES")}
    _run("shell,callable,demo-echo", env, tmp_path, db_url)
    assert _code(shell) == "not_allowed"
    assert "ACC_ALLOWED_EXECUTABLES" in _attempt(shell).error_text
    assert _code(call) == "not_allowed"
    assert "ACC_ALLOWED_CALLABLES" in _attempt(call).error_text
    assert not marker.exists()
    assert Task.objects.get(job=demo).status == "done", _attempt(demo).error_text


@pytest.mark.django_db
def test_a_service_env_may_set_only_listed_names_and_never_a_loader(site):
    for name in ("BASH_ENV", "PYTHONWARNINGS", "BROWSER", "PATH", "LD_PRELOAD", "DJANGO_SETTINGS_MODULE",
                 "NOT_LISTED"):
        with pytest.raises(DefinitionError, match=name):
            save_service(key="e", executor="command", executor_config={"argv": ["/usr/bin/sort"], "env": {name: "x"}})
    save_service(key="e", executor="command", executor_config={"argv": ["/usr/bin/sort"], "env": {"GREETING": "x"}})


@pytest.mark.django_db
def test_params_never_choose_the_program(site):
    tools, _ = site
    with pytest.raises(DefinitionError, match=r"argv\[0\].*placeholder"):
        save_service(key="t", executor="command", executor_config={"argv": [f"{tools}/{{tool}}"]},
                     params_schema={"type": "object", "properties": {"tool": {"type": "string"}}})
    with pytest.raises(ValueError, match="placeholder"):
        render_argv([f"{tools}/{{tool}}"], {"tool": "record.sh"})


# --------------------------------------------------------------------------------------------
# Waking a node: the builder's host
# --------------------------------------------------------------------------------------------

class _Recorder(BaseHTTPRequestHandler):
    hits: list[str]
    location = ""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        self.send_response(302 if self.location else 200)
        if self.location:
            self.send_header("Location", self.location)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _server(hits: list[str], location: str = "") -> HTTPServer:
    handler = type("Handler", (_Recorder,), {"hits": hits, "location": location})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.django_db
def test_a_wake_script_or_url_outside_the_allow_lists_is_refused_when_saved_and_when_used(site, tmp_path,
                                                                                          monkeypatch):
    tools, _ = site
    node = Node(name="sleepy", wake_method=WakeMethod.SCRIPT, script=TOUCH)
    with pytest.raises(ValidationError, match="ACC_ALLOWED_EXECUTABLES"):
        node.full_clean()
    with pytest.raises(Refused, match="ACC_ALLOWED_EXECUTABLES"):
        wake.ShellScript().wake(node)
    # Allowed by its text, but a symlink to touch: refused where it runs.
    with pytest.raises(Refused, match="/usr/bin/touch"):
        wake.ShellScript().wake(Node(name=str(tmp_path / "linked"), wake_method=WakeMethod.SCRIPT,
                                     script=str(tools / "escape")))
    assert not (tmp_path / "linked").exists()
    with pytest.raises(Refused, match="starts with '-'"):
        wake.ShellScript().wake(Node(name="--help", wake_method=WakeMethod.SCRIPT, script=str(tools / "record.sh")))
    # An allowed script runs with a task's inherited environment, not the builder's settings.
    monkeypatch.setenv("ACC_DB_PASSWORD_PROBE", "builder-secret-value")
    assert wake.ShellScript().wake(Node(name="sleepy", wake_method=WakeMethod.SCRIPT, script=str(tools / "record.sh")))
    seen = (tmp_path / "wake-env.txt").read_text()
    assert "builder-secret-value" not in seen and "ACC_" not in seen
    assert (tmp_path / "args.txt").read_text().strip() == "sleepy"

    far = Node(name="sleepy", wake_method=WakeMethod.PROVIDER, provider_ref="http://192.0.2.1/wake")
    with pytest.raises(ValidationError, match="ACC_ALLOWED_HTTP_URLS"):
        far.full_clean()
    with pytest.raises(Refused, match="ACC_ALLOWED_HTTP_URLS"):
        wake.ProviderApi().wake(far)
    # A redirect from the allowed URL is not followed.
    elsewhere: list[str] = []
    target = _server(elsewhere)
    first: list[str] = []
    redirecting = _server(first, location=f"http://127.0.0.1:{target.server_port}/elsewhere")
    try:
        with pytest.raises(OSError):
            wake.ProviderApi().wake(Node(name="sleepy", wake_method=WakeMethod.PROVIDER,
                                         provider_ref=f"http://127.0.0.1:{redirecting.server_port}/wake"))
    finally:
        target.shutdown()
        redirecting.shutdown()
    assert first == ["/wake"] and elsewhere == [], "the redirect was followed"


# --------------------------------------------------------------------------------------------
# Generated inputs
# --------------------------------------------------------------------------------------------

PATH_PARTS = st.sampled_from(["..", ".", "", "record.sh", "escape", "tools", "usr", "bin", "touch", "sort",
                              "-x", "a b", "\x00", "é"])


@pytest.mark.django_db
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(PATH_PARTS, min_size=1, max_size=8), absolute=st.booleans())
def test_whatever_path_a_param_writes_only_a_program_really_inside_the_allowed_directory_runs(site, parts,
                                                                                              absolute):
    tools, _ = site
    program = (str(tools) + "/" if absolute else "") + "/".join(parts)
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    try:
        check_process([program, "arg"], env)
    except Refused:
        return
    real = os.path.realpath(resolve(program, env) or "")
    inside = os.path.realpath(tools) + "/"
    listed = ("/usr/bin/sort", os.path.realpath("/bin/bash"))
    assert real.startswith(inside) or real in listed, f"{program!r} ran {real!r}"


OPTION_VALUES = st.one_of(st.text(min_size=1, max_size=12).map(lambda t: "-" + t),
                          st.text(alphabet=string.printable, max_size=12))


@given(values=st.lists(OPTION_VALUES, min_size=1, max_size=4), separator_at=st.integers(min_value=-1, max_value=4),
       prefix=st.sampled_from(["", "--name=", "x", "-"]))
@settings(max_examples=300, deadline=None)
def test_no_param_value_becomes_an_option_unless_after_a_separator(values, separator_at, prefix):
    template = ["/usr/bin/tool"]
    params = {}
    for i, value in enumerate(values):
        if i == separator_at:
            template.append("--")
        template.append(f"{prefix}{{p{i}}}")
        params[f"p{i}"] = value
    try:
        argv = render_argv(template, params)
    except OptionInjection:
        return
    separated = False
    for element, rendered in zip(template, argv, strict=True):
        if element == "--":
            separated = True
        elif element.startswith("{") and rendered.startswith("-"):
            assert separated, f"{rendered!r} reached the tool as an option"


LOADERS = st.one_of(st.sampled_from(sorted(LOADER_ENV_NAMES)),
                    st.tuples(st.sampled_from(["LD_", "PYTHON", "PERL5", "DYLD_", "BASH_FUNC_"]),
                              st.text(alphabet=string.ascii_uppercase + "_", max_size=8)).map("".join))


@pytest.mark.django_db
@given(name=LOADERS, value=st.text(max_size=20))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_loader_variable_passes_whatever_the_site_lists(site, monkeypatch, name, value):
    monkeypatch.setenv("ACC_ALLOWED_TASK_ENV", f"{name},{name[:2]}*")
    reload()
    assert env_name_refusal(name) is not None
    if os.environ.get(name) == value:
        return  # the agent's own variable, passed on unchanged
    with pytest.raises(Refused):
        check_env({name: value})


def test_the_agents_own_interpreter_runs_only_as_the_agents_runner():
    check_process([sys.executable, "-c", "pass"], {}, program="agent")
    with pytest.raises(Refused):
        check_process(["/bin/sh", "-c", "true"], {}, program="agent")
    with pytest.raises(Refused, match="NUL"):
        check_process(["/usr/bin/sort", "a\x00b"], {})


# --------------------------------------------------------------------------------------------
# What runs is the file that was checked
# --------------------------------------------------------------------------------------------

@pytest.fixture
def swapped_after_check(site, tmp_path, monkeypatch):
    """An allowed tool reached through a symlink, and a guard that swaps the symlink to a program outside
    the allowed directory right after it checked the tool: the window between check and exec, made
    certain instead of raced. Return the symlink, the markers the checked and the outside program
    create, and the wrapper that makes a guard swap the symlink after its check."""
    tools, _ = site
    marker, ran = tmp_path / "swapped-program-ran", tmp_path / "checked-program-ran"
    (tools / "checked.sh").write_text(f"#!/bin/sh\ntouch {ran}\necho '\"checked\"'\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.sh").write_text(f"#!/bin/sh\ntouch {marker}\necho '\"swapped\"'\n")
    for script in (tools / "checked.sh", outside / "evil.sh"):
        script.chmod(0o755)
    link = tools / "tool"
    link.symlink_to(tools / "checked.sh")

    def swap() -> None:
        (tools / "tool.new").symlink_to(outside / "evil.sh")
        os.replace(tools / "tool.new", link)  # atomic, as an attacker racing the agent would do it

    def checked_then_swapped(real_check):
        def check(*args, **kwargs):
            try:
                return real_check(*args, **kwargs)
            finally:
                swap()
        return check

    return link, marker, ran, checked_then_swapped


@pytest.mark.parametrize("sandbox", [False, True], ids=["plain", "bwrap"])
def test_a_symlink_swapped_after_the_check_cannot_change_what_a_task_runs(swapped_after_check, monkeypatch, sandbox):
    import uuid

    from jobs.claim import ClaimedTask
    from nodes.executors import RunContext, processes, run_process
    from nodes.executors.base import remove_scratch

    link, marker, _, checked_then_swapped = swapped_after_check
    monkeypatch.setattr(processes, "check_process", checked_then_swapped(processes.check_process))
    task = ClaimedTask(id=uuid.uuid4(), job_id=uuid.uuid4(), task_key="t", attempt=1, params={},
                       timeout_seconds=60, host=None, service_key="s")
    ctx = RunContext(task=task, service_config={"sandbox": "bwrap"} if sandbox else {}, on_started=lambda pid: None,
                     on_progress=lambda value: None, on_log=lambda level, text: None)
    try:
        outcome = run_process(task, ctx, [str(link)])
    finally:
        remove_scratch(ctx)
    assert outcome.status == "succeeded", (outcome.error, outcome.stderr_tail)
    assert outcome.results == "checked", "the program run is not the one the guard checked"
    assert not marker.exists()
    assert os.path.realpath(link).endswith("evil.sh"), "the swap happened before the exec"


def test_a_wake_script_swapped_after_the_check_does_not_run(swapped_after_check, monkeypatch):
    link, marker, _, checked_then_swapped = swapped_after_check
    monkeypatch.setattr(wake, "check_process", checked_then_swapped(wake.check_process))
    assert wake.ShellScript().wake(Node(name="sleepy", wake_method=WakeMethod.SCRIPT, script=str(link)))
    assert not marker.exists(), "the wake ran a script the allow-list never saw"


def test_an_http_start_command_swapped_after_the_check_does_not_run(swapped_after_check, monkeypatch):
    from nodes.executors import http as http_executor

    link, marker, ran, checked_then_swapped = swapped_after_check
    monkeypatch.setattr(http_executor, "check_process", checked_then_swapped(http_executor.check_process))
    server = _server([])  # answers at once: the service counts as started
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/run"
        http_executor.HttpExecutor()._ensure_started({"url": url, "start_command": [str(link)]})
        wait_for(lambda: ran.exists() or marker.exists(), timeout=30, message="the start command to run")
    finally:
        server.shutdown()
    assert ran.exists() and not marker.exists(), "the start command run is not the one the guard checked"
