"""Least privilege on the agent's side: what a task can see, what a site lets agents run, what a
token may do, and the HTTP executor's reach (through real agents where the agent decides)."""

from __future__ import annotations

import io
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from accs_site.conf import reload
from events.artifacts import read_artifact
from events.models import Artifact, Event
from jobs import api
from jobs.models import Attempt, Task
from nodes.executors import HttpExecutor, RunContext, render_argv, secrets_in
from tenants.models import ApiToken, TenantRole
from tests.api_helpers import client_for, user_with_token
from tests.daemons import Daemons, wait_all_final
from workflows.api import save_service
from workflows.models import Service
from workflows.validation import DefinitionError

SECRET_KEY = "sk-test-secret-key-that-must-not-leak"
METRICS_TOKEN = "metrics-token-that-must-not-leak"

# Prints the whole environment to stderr, then the param it was given, and fails (so the last
# stderr line also becomes the attempt's error text).
ENV_PROBE = (
    "import os, sys\n"
    "for k, v in sorted(os.environ.items()): print(k + '=' + v, file=sys.stderr)\n"
    "print('param ' + sys.argv[1], file=sys.stderr)\n"
    "sys.exit(3)\n"
)


@pytest.fixture
def allow(monkeypatch):
    """Set ACC_ALLOWED_* for this process (validation) and return the env for agents."""
    def set_(**names: str) -> dict[str, str]:
        for name, value in names.items():
            monkeypatch.setenv(name, value)
        reload()
        return names

    yield set_
    monkeypatch.undo()
    reload()


# --------------------------------------------------------------------------------------------
# What a task can see
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_task_printing_its_environment_shows_no_agent_setting_or_secret(s3, default_tenant, db_url, tmp_path):
    save_service(key="probe", executor="command", max_attempts=1,
                 executor_config={"argv": ["python", "-c", ENV_PROBE, "{note}"], "env": {"GREETING": "hello"}},
                 params_schema={"type": "object", "properties": {"note": {"type": "string"},
                                                                 "api_token": {"type": "array"}}})
    # The note carries the agent's metrics token (a value the task could have got anywhere);
    # api_token is a secret param whose values are in a list.
    job = api.start_service("probe", params={"note": f"see {METRICS_TOKEN}", "api_token": ["tok-aaa-111", "tok-b"]})
    env = {**os.environ, "ACC_DB_URL": db_url, "ACC_POLL_INTERVAL_SEC": "0.5", "PYTHONUNBUFFERED": "1",
           "ACC_SECRET_KEY": SECRET_KEY, "ACC_METRICS_TOKEN": METRICS_TOKEN}
    daemons = Daemons(env, tmp_path)  # after the s3 fixture: the agent has ACC_MINIO_SECRET_KEY too
    try:
        daemons.agent("n1", "probe")
        wait_all_final(db_url, timeout=60)
    finally:
        daemons.stop_all()
    attempt = Attempt.objects.get(task__job=job)
    secrets = [SECRET_KEY, METRICS_TOKEN, os.environ["ACC_MINIO_SECRET_KEY"], db_url]
    task = Task.objects.get(job=job)
    events = " ".join(Event.objects.filter(job=job).values_list("message", flat=True))
    viewer = user_with_token("viewer", tenants={default_tenant: TenantRole.VIEWER})[1]
    listing = client_for(viewer).get(f"/api/v1/jobs/{job.id}/attempts")
    assert listing.status_code == 200
    log = Artifact.objects.get(task=task, kind="log")
    stored = {"stderr_tail": attempt.stderr_tail, "stdout_tail": attempt.stdout_tail, "error": attempt.error_text,
              "task error": task.error_message, "events": events, "api": listing.content.decode(),
              "log artifact": read_artifact(log).decode()}
    for where, text in stored.items():
        assert "ACC_" not in text.replace("ACCS_", ""), f"an ACC_* setting reached the {where}"
        for secret in secrets:
            assert secret not in text, f"{secret[:12]}… reached the {where}"
        assert "tok-aaa-111" not in text, f"a secret param inside a list reached the {where}"
    assert "param see ***" in attempt.stderr_tail, "a secret value the task printed is redacted"
    assert "param see ***" in attempt.error_text, "the error text is redacted too"
    assert "GREETING=hello" in attempt.stderr_tail, "the service's own env reaches the task"
    assert "ACCS_TASK_ID=" in attempt.stderr_tail and "PATH=" in attempt.stderr_tail, "the contract and PATH do"


@pytest.mark.django_db(transaction=True)
def test_an_agent_needs_neither_the_secret_key_nor_the_metrics_token(default_tenant, make_service, subprocess_env,
                                                                     db_url, tmp_path):
    make_service("plain")
    job = api.start_service("plain")
    env = {k: v for k, v in subprocess_env.items() if k not in ("ACC_SECRET_KEY", "ACC_METRICS_TOKEN")}
    daemons = Daemons({**env, "ACC_DEBUG": "false"}, tmp_path)  # production mode, as deployed
    try:
        daemons.agent("n1", "plain")
        wait_all_final(db_url, timeout=60)
    finally:
        daemons.stop_all()
    assert Task.objects.get(job=job).status == "done"


@pytest.mark.django_db
def test_a_log_line_bound_for_the_timeline_is_scrubbed_of_the_processs_secrets(make_service, monkeypatch):
    import logging

    from django.conf import settings

    monkeypatch.setenv("ACC_METRICS_TOKEN", METRICS_TOKEN)
    reload()
    make_service("svc")
    job = api.start_service("svc")
    try:
        raise RuntimeError(f"connect failed with key {settings.SECRET_KEY}")
    except RuntimeError:
        logging.getLogger("accs.test").exception("scrape with %s failed", METRICS_TOKEN, extra={"job_id": job.id})
    event = Event.objects.get(type="log", job_id=job.id)
    assert event.message == "scrape with *** failed"
    assert settings.SECRET_KEY not in event.data["exc"] and "connect failed with key ***" in event.data["exc"]
    monkeypatch.undo()
    reload()


def test_secret_params_are_found_in_lists_and_nested_values():
    found = secrets_in({"api_keys": ["key-one", {"x": "key-two"}], "plain": ["visible"],
                        "nested": [{"password": "hunter2"}], "token": 12345})
    assert set(found) == {"key-one", "key-two", "hunter2", "12345"}


# --------------------------------------------------------------------------------------------
# What a site lets agents run
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_row_naming_a_disallowed_executable_is_refused_by_the_agent(default_tenant, db_url, tmp_path, daemons):
    marker = tmp_path / "ran"
    # Written straight into the database: no validation stands between the row and the agent.
    Service.objects.create(key="shell", executor="command", max_attempts=3, params_schema={"type": "object"},
                           executor_config={"argv": ["/bin/sh", "-c", f"touch {marker}"]})
    job = api.start_service("shell")
    daemons.agent("n1", "shell", env={"ACC_ALLOWED_EXECUTABLES": "python,/opt/tools/"})
    wait_all_final(db_url, timeout=60)
    task = Task.objects.get(job=job)
    attempt = Attempt.objects.get(task=task)
    assert (task.status, task.error_code) == ("error", "not_allowed"), task.error_message
    assert "'/bin/sh' is not an executable this site allows" in attempt.error_text
    assert "ACC_ALLOWED_EXECUTABLES" in attempt.error_text
    assert Attempt.objects.filter(task=task).count() == 1, "a refusal is final, not retried"
    assert not marker.exists(), "the command never ran"


def test_validation_refuses_what_the_allow_lists_do_not_name(db, allow):
    allow(ACC_ALLOWED_EXECUTABLES="python,/opt/tools/", ACC_ALLOWED_CALLABLES="tests,myapp.jobs",
          ACC_ALLOWED_HTTP_URLS="http://127.0.0.1:8080/run")
    refused = {
        "executor_config.argv": {"executor": "command", "executor_config": {"argv": ["/bin/sh", "-c", "id"]}},
        "executor_config.callable": {"executor": "python", "executor_config": {"callable": "os:system"}},
        "executor_config.task": {"executor": "python", "executor_config": {"callable": "tests.callables:noop",
                                                                          "task": "os.system"}},
        "executor_config.url": {"executor": "http", "executor_config": {"url": "http://127.0.0.1:9999/run"}},
        "executor_config.start_command": {"executor": "http", "executor_config": {
            "url": "http://127.0.0.1:8080/run", "start_command": ["bash", "-c", "serve"]}},
    }
    for field, fields in refused.items():
        with pytest.raises(DefinitionError) as caught:
            save_service(key="x", params_schema={"type": "object"}, **fields)
        assert any(p.where == field and "allows" in p.message for p in caught.value.problems), caught.value.problems
    for fields in ({"executor": "command", "executor_config": {"argv": ["/opt/tools/thumb"]}},
                   {"executor": "command", "executor_config": {"argv": ["python", "-m", "x"]}},
                   {"executor": "python", "executor_config": {"callable": "myapp.jobs.resize:run"}},
                   {"executor": "http", "executor_config": {"url": "http://127.0.0.1:8080/run/thumb"}}):
        save_service(key="ok", params_schema={"type": "object"}, **fields)
    with pytest.raises(DefinitionError, match="not an executable"):
        save_service(key="y", executor="command", executor_config={"argv": ["/opt/tools/../../bin/sh"]},
                     params_schema={"type": "object"})
    with pytest.raises(DefinitionError, match="not from a module"):
        save_service(key="y", executor="python", executor_config={"callable": "myapp.jobsx:run"},
                     params_schema={"type": "object"})


@pytest.mark.parametrize(("variable", "value"), [
    ("ACC_ALLOWED_EXECUTABLES", "bin/sh"), ("ACC_ALLOWED_EXECUTABLES", "/opt/../bin/"),
    ("ACC_ALLOWED_CALLABLES", "os:system"), ("ACC_ALLOWED_HTTP_URLS", "ftp://127.0.0.1/"),
    ("ACC_ALLOWED_HTTP_URLS", " , "),
])
def test_a_bad_allow_list_stops_manage_py_with_the_variable_named(variable, value, allow):
    from accs_site.checks import check_accs_settings

    allow(**{variable: value})
    errors = check_accs_settings()
    assert [e.id for e in errors] == ["accs.E001"] and errors[0].msg.startswith(variable), errors


def test_check_deploy_warns_while_agents_may_run_anything(allow):
    from accs_site.checks import check_allow_lists

    assert {w.id for w in check_allow_lists()} == {"accs.W020"}, "the development default is *"
    allow(ACC_ALLOWED_EXECUTABLES="python", ACC_ALLOWED_CALLABLES="myapp")
    assert check_allow_lists() == []


# --------------------------------------------------------------------------------------------
# argv templates
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arg", ["{msg.__class__.__mro__}", "{msg:>{width}}", "{msg!r}", "{msg[0]}",
                                 "{msg:>200000000}"])
def test_argv_templates_accept_only_plain_names(db, arg):
    with pytest.raises(DefinitionError) as caught:
        save_service(key="t", executor="command", executor_config={"argv": ["tool", arg]},
                     params_schema={"type": "object", "properties": {"msg": {}, "width": {}}})
    (problem,) = caught.value.problems
    assert problem.where == "executor_config.argv" and "not a plain {name} placeholder" in problem.message
    with pytest.raises(ValueError, match="plain"):
        render_argv(["tool", arg], {"msg": "hi", "width": 10})  # a row that skipped validation
    assert render_argv(["tool", "--m={msg}", "{{literal}}"], {"msg": "hi"}) == ["tool", "--m=hi", "{literal}"]


# --------------------------------------------------------------------------------------------
# The http executor's reach
# --------------------------------------------------------------------------------------------

class _Metadata(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        type(self).hits.append(self.path)
        body = b'{"AccessKeyId": "AKIA-FAKE", "SecretAccessKey": "fake"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args) -> None:
        pass


def _serve(host: str, handler: type) -> HTTPServer:
    server = HTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def redirecting_service():
    """A local service that answers 302 to a metadata look-alike on another loopback address."""
    _Metadata.hits = []
    metadata = _serve("127.0.0.2", _Metadata)
    target = f"http://127.0.0.2:{metadata.server_port}/latest/meta-data/iam/security-credentials/role"

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    service = _serve("127.0.0.1", Redirect)
    yield f"http://127.0.0.1:{service.server_port}/run"
    service.shutdown()
    metadata.shutdown()


@pytest.mark.django_db(transaction=True)
def test_the_http_executor_does_not_follow_a_redirect_off_the_service(redirecting_service, default_tenant, db_url,
                                                                      daemons):
    save_service(key="remote", executor="http", executor_config={"url": redirecting_service},
                 params_schema={"type": "object"})
    job = api.start_service("remote")
    daemons.agent("n1", "remote")
    wait_all_final(db_url, timeout=60)
    task = Task.objects.get(job=job)
    assert (task.status, task.error_code) == ("error", "http_redirect"), task.error_message
    assert "redirects are not followed" in task.error_message and "127.0.0.2" in task.error_message
    assert task.results is None and _Metadata.hits == [], "the redirect's target was never asked"


class _Big(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"x": "' + b"a" * 3_000_000 + b'"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_the_http_executor_caps_the_response_size():
    from jobs.claim import ClaimedTask

    server = _serve("127.0.0.1", _Big)
    try:
        task = ClaimedTask(id="00000000-0000-0000-0000-000000000001", job_id="j", task_key="t", attempt=1,
                           params={}, timeout_seconds=10, host=None, service_key="big")
        config = {"url": f"http://127.0.0.1:{server.server_port}/run"}
        ctx = RunContext(task=task, service_config=config, on_started=lambda pid: None,
                         on_progress=lambda v: None, on_log=lambda level, m: None)
        outcome = HttpExecutor().run(task, ctx)
    finally:
        server.shutdown()
    assert (outcome.status, outcome.error_code, outcome.retryable) == ("failed", "bad_output", False)
    assert "larger than 1000000 bytes" in outcome.error


def test_health_url_is_validated_like_url(db):
    with pytest.raises(DefinitionError) as caught:
        save_service(key="h", executor="http", params_schema={"type": "object"},
                     executor_config={"url": "http://127.0.0.1:8080/run", "health_url": "http://169.254.169.254/"})
    assert [p.where for p in caught.value.problems] == ["executor_config.health_url"]
    assert "loopback" in caught.value.problems[0].message


# --------------------------------------------------------------------------------------------
# Token scopes, revoking by prefix, the admin
# --------------------------------------------------------------------------------------------

SERVICE_BODY = {"key": "render", "executor": "command", "executor_config": {"argv": ["python", "-V"]},
                "params_schema": {"type": "object"}}


def test_token_scopes_limit_what_the_api_does(db, default_tenant):
    root_default = user_with_token("root", superuser=True, scopes=["read", "run", "approve"])[1]  # the default
    refused = client_for(root_default).post("/api/v1/services", SERVICE_BODY, content_type="application/json")
    assert refused.status_code == 403 and "'definitions' scope" in refused.json()["detail"]
    out, err = io.StringIO(), io.StringIO()
    call_command("accs_token", "create", "root", "deployer", "--scope", "definitions,read", stdout=out, stderr=err)
    assert "scopes definitions,read" in err.getvalue()
    definer = client_for(out.getvalue().strip())
    assert definer.post("/api/v1/services", SERVICE_BODY, content_type="application/json").status_code == 201
    started = definer.post("/api/v1/jobs", {"service": "render"}, content_type="application/json")
    assert started.status_code == 403 and "'run' scope" in started.json()["detail"], "definitions is not run"
    reader = user_with_token("reader", tenants={default_tenant: TenantRole.ADMIN}, scopes=["read"])[1]
    assert client_for(reader).get("/api/v1/jobs").status_code == 200
    assert client_for(reader).post("/api/v1/jobs", {"service": "render"},
                                   content_type="application/json").status_code == 403
    runner = user_with_token("runner", tenants={default_tenant: TenantRole.ADMIN}, scopes=["run"])[1]
    job = client_for(runner).post("/api/v1/jobs", {"service": "render"}, content_type="application/json")
    assert job.status_code == 201
    approve = client_for(runner).post(f"/api/v1/jobs/{job.json()['id']}/approve")
    assert approve.status_code == 403 and "'approve' scope" in approve.json()["detail"]
    assert client_for(runner).get("/api/v1/jobs").status_code == 403, "run does not include read"


def test_new_tokens_never_get_definitions_unless_asked_and_only_for_superusers(db):
    user_with_token("staffer")
    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_token", "staffer", "ci", stdout=out, stderr=err)
    assert ApiToken.objects.get(name="ci").scopes == ["read", "run", "approve"]
    with pytest.raises(CommandError, match="definitions scope is for superusers"):
        call_command("accs_token", "create", "staffer", "x", "--scope", "definitions", stdout=out, stderr=err)
    with pytest.raises(CommandError, match="unknown token scope.*'admin'"):
        call_command("create_api_token", "staffer", "x", "--scope", "admin", stdout=out, stderr=err)


def test_revoke_by_prefix_needs_the_full_prefix(db):
    for name in ("a", "b", "c"):
        user_with_token(name)
    out = io.StringIO()
    for short in ("accs_", "accs_ab", "x" * 12):
        with pytest.raises(CommandError, match="first 12 characters"):
            call_command("accs_token", "revoke", "--prefix", short, stdout=out)
    assert ApiToken.objects.filter(revoked_at__isnull=True).count() == 3, "nothing revoked"
    one = ApiToken.objects.order_by("id").first()
    call_command("accs_token", "revoke", "--prefix", one.prefix, stdout=out)
    assert "revoked 1 token(s)" in out.getvalue()
    assert list(ApiToken.objects.filter(revoked_at__isnull=False)) == [one]


def test_the_admin_lets_only_superusers_change_definitions(db, client):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    staff = get_user_model().objects.create_user("staff", "s@example.test", "pw", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(codename__in=[
        "add_service", "change_service", "view_service", "add_workflow", "change_workflow"]))
    client.force_login(staff)
    assert client.get("/admin/workflows/service/add/").status_code == 403
    assert client.post("/admin/workflows/service/add/", {"key": "evil", "executor": "python"}).status_code == 403
    assert client.get("/admin/workflows/workflow/add/").status_code == 403
    assert not Service.objects.filter(key="evil").exists()
    assert client.get("/admin/workflows/service/").status_code == 200, "viewing stays a model permission"


# --------------------------------------------------------------------------------------------
# An output file name with a control character
# --------------------------------------------------------------------------------------------

BAD_NAME = (
    "import os, pathlib, sys; "
    "d = pathlib.Path(os.environ['ACCS_OUTPUT_DIR']); "
    "(d / ('bad' + chr(1) + 'name.txt')).write_text('x'); (d / 'good.txt').write_text('y'); "
    "print('working', file=sys.stderr); print(chr(123) + chr(125))"
)


@pytest.mark.django_db(transaction=True)
def test_an_output_file_name_with_a_control_character_keeps_the_attempts_log(s3, default_tenant, db_url, tmp_path):
    save_service(key="files", executor="command", executor_config={"argv": ["python", "-c", BAD_NAME]},
                 params_schema={"type": "object"})
    job = api.start_service("files")
    env = {**os.environ, "ACC_DB_URL": db_url, "ACC_POLL_INTERVAL_SEC": "0.5", "PYTHONUNBUFFERED": "1"}
    daemons = Daemons(env, tmp_path)
    try:
        daemons.agent("n1", "files")
        wait_all_final(db_url, timeout=60)
    finally:
        daemons.stop_all()
    task = Task.objects.get(job=job)
    assert task.status == "done", task.error_message
    keys = sorted(Artifact.objects.filter(task=task).values_list("key", flat=True))
    assert keys == [f"logs/{job.id}/files/attempt-1.jsonl", f"outputs/{job.id}/files/bad%01name.txt",
                    f"outputs/{job.id}/files/good.txt"], "the odd name is escaped; the other file and the log are kept"
