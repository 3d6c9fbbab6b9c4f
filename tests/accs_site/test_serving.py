"""The production server as ``make serve`` runs it (gunicorn through ``scripts/serve.sh``) on the test
database: bursts of webhooks, oversized bodies, a styled admin and Swagger UI without the network.
Also, in process: every error under ``/api/`` is JSON.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urljoin

import pytest
import requests

from jobs.models import Job
from tests import forkserver
from tests.api_helpers import client_for, user_with_token
from tests.browser import css, wait
from tests.daemons import ROOT, free_port, http_server, stop_process, wait_for

SERVE = ROOT / "scripts" / "serve.sh"


def test_make_serve_runs_the_serve_script_and_it_runs_gunicorn_on_loopback():
    """The fixture below starts what ``make serve`` starts; this keeps the two from drifting apart."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/serve.sh" in recipe
    script = SERVE.read_text()
    assert "-m gunicorn accs_site.wsgi:application" in script
    assert '"${ACCS_WEB_HOST:-127.0.0.1}:${ACCS_WEB_PORT:-8000}"' in script


@pytest.fixture
def production_server(subprocess_env, tmp_path: Path):
    """Run ``scripts/serve.sh`` (gunicorn, default workers and threads) on a free loopback port; yield its URL."""
    port = free_port()
    env = {**subprocess_env, "ACCS_WEB_HOST": "127.0.0.1", "ACCS_WEB_PORT": str(port)}
    with http_server([str(SERVE)], env=env, port=port, log_path=tmp_path / "gunicorn.log", name="gunicorn") as url:
        yield url


# --------------------------------------------------------------------------------------------
# Under load and abuse
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_hundred_concurrent_webhooks_all_get_answers_from_the_production_server(
        make_service, default_tenant, production_server):
    make_service("deploy")
    _, token = user_with_token("hook", superuser=True)
    barrier = threading.Barrier(100)
    answers: list[int] = []
    errors: list[BaseException] = []

    def fire(i: int) -> None:
        try:
            with requests.Session() as session:  # one connection per sender
                barrier.wait(timeout=60)
                r = session.post(f"{production_server}/api/v1/jobs",
                                 json={"service": "deploy", "external_id": f"gh-{i}"},
                                 headers={"Authorization": f"Bearer {token}"}, timeout=120)
                answers.append(r.status_code)
        except BaseException as exc:  # noqa: BLE001 - asserted below (a reset connection lands here)
            errors.append(exc)

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, f"{len(errors)} senders got no answer: {errors[:3]}"
    assert sorted(answers) == [201] * 100, sorted(answers)
    assert Job.objects.filter(external_id__startswith="gh-").count() == 100


def _reload_under_a_stream(argv: list[str], *, env: dict[str, str], tmp_path: Path, reloads: int) -> tuple[int, list]:
    """Serve with ``argv`` (pid file in ``tmp_path``), HUP it ``reloads`` times under four streams of requests.

    Each request opens a new connection, as webhooks do. Returns (requests answered, errors).
    """
    port, pidfile, log = free_port(), tmp_path / "gunicorn.pid", tmp_path / "gunicorn.log"
    answered: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            try:
                answered.append(requests.get(f"{url}/api/v1/health", timeout=30).status_code)
            except requests.RequestException as exc:
                errors.append(exc)

    with http_server([*argv, "--pid", str(pidfile)], env={**env, "ACCS_WEB_PORT": str(port)}, port=port,
                     log_path=log, name="gunicorn") as url:
        master = int(pidfile.read_text())
        senders = [threading.Thread(target=stream) for _ in range(4)]
        for sender in senders:
            sender.start()
        try:
            for n in range(1, reloads + 1):
                before = len(answered)
                os.kill(master, signal.SIGHUP)
                # A reload is over when every old worker has exited and requests flow again.
                wait_for(lambda n=n, before=before: log.read_text().count("Worker exiting") >= 2 * n
                         and len(answered) > before + 20, timeout=60, message=f"reload {n} done and answering")
        finally:
            stop.set()
            for sender in senders:
                sender.join(60)
    assert set(answered) <= {200}, set(answered)
    return len(answered), errors


@pytest.mark.slow  # four reloads of a two-worker gunicorn: about a minute
def test_a_graceful_reload_refuses_no_request(subprocess_env, tmp_path: Path):
    """``kill -HUP`` (``systemctl reload accs-web``, the upgrade's web step) under a stream of new connections.

    gunicorn's own threaded worker, told to stop, accepts what arrives during its last poll and exits
    without answering it (a reset connection); deploy/gunicorn.conf.py's worker answers it.
    """
    env = {**subprocess_env, "ACCS_WEB_HOST": "127.0.0.1"}
    answered, errors = _reload_under_a_stream([str(SERVE)], env=env, tmp_path=tmp_path, reloads=4)
    assert not errors, f"{len(errors)} of {answered + len(errors)} requests refused across 4 reloads: {errors[:3]}"


@pytest.mark.django_db(transaction=True)
def test_a_ten_megabyte_body_is_a_json_413_naming_the_limit(make_service, default_tenant, production_server):
    make_service("deploy")
    _, token = user_with_token("hook", superuser=True)
    body = b'{"service": "deploy", "params": {"blob": "' + b"x" * (10 * 2**20) + b'"}}'
    r = requests.post(f"{production_server}/api/v1/jobs", data=body, timeout=60,
                      headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:500]
    assert r.headers["Content-Type"] == "application/json"
    detail = r.json()["detail"]
    assert "request body too large" in detail and "the limit is 2,621,440 bytes" in detail, detail
    assert not Job.objects.exists()
    # The connection and the server are fine afterwards.
    assert requests.get(f"{production_server}/api/v1/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.django_db(transaction=True)
def test_runserver_with_debug_off_serves_the_admins_styles(subprocess_env, tmp_path):
    """The README's development server, DEBUG off as by default: the app serves its static files itself."""
    port = free_port()
    log_path = tmp_path / "runserver.log"
    with open(log_path, "wb") as log:
        proc = forkserver.Popen([sys.executable, str(ROOT / "manage.py"), "runserver", "--noreload",
                                 f"127.0.0.1:{port}"],
                                cwd=ROOT, env={**subprocess_env, "ACC_DEBUG": "false"}, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            def css_answer() -> list[requests.Response]:
                if proc.poll() is not None:
                    pytest.fail(f"runserver exited: {log_path.read_text()[-2000:]}")
                try:  # a list, since an error response is falsy and must still end the wait
                    return [requests.get(f"http://127.0.0.1:{port}/static/admin/css/base.css", timeout=5)]
                except requests.RequestException:
                    return []

            [response] = wait_for(css_answer, timeout=60, message="runserver answering")
            assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/css")
        finally:
            stop_process(proc)


# --------------------------------------------------------------------------------------------
# Every error under /api/ is JSON (in process)
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path", "status", "needle"), [
    ("get", "/api/v1/no-such-thing", 404, "not found: GET /api/v1/no-such-thing"),
    ("get", "/api/v2/jobs", 404, "not found"),
    ("delete", "/api/v1/health", 405, "method DELETE not allowed; allowed: GET"),
])
def test_errors_outside_the_api_views_are_json_too(client, method, path, status, needle):
    response = getattr(client, method)(path)
    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    assert needle in response.json()["detail"]


@pytest.mark.django_db
def test_a_bad_host_header_under_api_is_a_json_400(client):
    response = client.get("/api/v1/health", HTTP_HOST="evil.example")
    assert response.status_code == 400 and response.json() == {"detail": "bad request"}


@pytest.mark.django_db
def test_an_oversized_body_is_413_in_process_too(make_service, default_tenant, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    make_service("deploy")
    _, token = user_with_token("hook", superuser=True)
    response = client_for(token).post("/api/v1/jobs", '{"service": "deploy", "params": {"x": "' + "y" * 2000 + '"}}',
                                      content_type="application/json")
    assert response.status_code == 413
    assert response.json()["detail"].endswith("the limit is 1,000 bytes (DATA_UPLOAD_MAX_MEMORY_SIZE)")


@pytest.mark.django_db
def test_pages_outside_the_api_keep_djangos_error_pages(client):
    response = client.get("/no-such-page/")
    assert response.status_code == 404 and "json" not in response["Content-Type"]


# --------------------------------------------------------------------------------------------
# In a browser, under the production server
# --------------------------------------------------------------------------------------------

LOCAL_ASSET = re.compile(r'(?:src|href)="([^"]+)"')


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_admin_login_is_styled_under_the_production_server(browser, production_server):
    html = requests.get(f"{production_server}/admin/login/", timeout=10).text
    stylesheets = [u for u in LOCAL_ASSET.findall(html) if u.endswith(".css")]
    assert "/static/admin/css/base.css" in stylesheets
    for url in stylesheets:
        r = requests.get(urljoin(production_server, url), timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/css"), url
        assert len(r.content) > 100, f"{url} is empty"

    browser.get(f"{production_server}/admin/login/")
    wait(browser, lambda d: css(d, "#id_username"), "the login form")
    header_bg = browser.execute_script("return getComputedStyle(document.getElementById('header')).backgroundColor")
    body_font = browser.execute_script("return getComputedStyle(document.body).fontFamily")
    assert header_bg not in ("rgba(0, 0, 0, 0)", "transparent"), "the admin's header has its colour"
    assert "Times" not in body_font, f"the admin's font, not the browser default: {body_font}"
    loaded = browser.execute_script(
        "return Array.from(document.styleSheets).filter(s => s.href).map(s => [s.href, s.cssRules.length])")
    assert loaded and all(rules > 0 for _, rules in loaded), loaded


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_swagger_ui_loads_from_local_assets_only(browser, production_server):
    html = requests.get(f"{production_server}/api/v1/docs", timeout=10).text
    assets = LOCAL_ASSET.findall(html)
    assert assets and all(a.startswith("/static/") for a in assets), assets
    for url in assets:
        assert requests.get(urljoin(production_server, url), timeout=10).status_code == 200, url
    assert "cdn" not in html.lower()

    browser.get(f"{production_server}/api/v1/docs")
    wait(browser, lambda d: css(d, ".swagger-ui .info .title"), "Swagger UI rendering the API's title")
    assert "ACCS API" in css(browser, ".swagger-ui .info .title")[0].text
    wait(browser, lambda d: css(d, ".swagger-ui .opblock"), "the operations from openapi.json")
    fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    outside = [u for u in fetched if not u.startswith(production_server)]
    assert not outside, f"requests left the server: {outside}"
