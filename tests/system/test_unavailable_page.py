"""The admin while its database cannot serve: the production server (gunicorn through scripts/serve.sh)
started on a database that was never migrated, and on a PostgreSQL that is not running, answers an
operator's log-in with a 503 page in the admin's look that says what is wrong and what to do; the
API answers the same in JSON."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
import requests

from tests.browser import click, css, wait
from tests.conftest import ROOT
from tests.daemons import free_port, http_server

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SERVE = ROOT / "scripts" / "serve.sh"


def serve_on(database_url: str, env: dict[str, str], tmp_path: Path, name: str):
    port = free_port()
    env = {**env, "ACC_DB_URL": database_url, "ACCS_WEB_HOST": "127.0.0.1", "ACCS_WEB_PORT": str(port),
           "ACCS_WEB_WORKERS": "1"}
    return http_server([str(SERVE)], env=env, port=port, log_path=tmp_path / f"{name}.log", name=name)


def log_in_and_read_the_page(browser, url: str) -> dict[str, str]:
    """Log in through the form (the first step that reads the database) and return what the page shows."""
    browser.get(f"{url}/admin/login/?next=/admin/")
    wait(browser, lambda d: css(d, "#id_username"), "the login form (it needs no database)")
    css(browser, "#id_username")[0].send_keys("root")
    css(browser, "#id_password")[0].send_keys("whatever")
    click(browser, "input[type=submit]")
    wait(browser, lambda d: css(d, "#accs-unavailable"), "the 503 page")
    return browser.execute_script(
        "const h = document.getElementById('header');"
        "return {header_bg: getComputedStyle(h).backgroundColor, font: getComputedStyle(document.body).fontFamily,"
        " site: h.textContent.trim(), title: document.querySelector('#content h1').textContent,"
        " detail: document.getElementById('accs-unavailable').textContent,"
        " what: document.getElementById('accs-unavailable-what').textContent};")


def assert_styled(shown: dict[str, str]) -> None:
    assert shown["header_bg"] not in ("rgba(0, 0, 0, 0)", "transparent"), shown
    assert "Times" not in shown["font"], shown
    assert shown["site"] == "ACCS operations" and shown["title"] == "The database cannot answer", shown


def test_an_unmigrated_database_gets_a_styled_503_naming_the_migration_step(browser, db_url, subprocess_env,
                                                                            tmp_path):
    empty = f"{db_url.rsplit('/', 1)[1]}_unmigrated"
    server = db_url.rsplit("/", 1)[0]
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{empty}"')
        conn.execute(f'CREATE DATABASE "{empty}"')
    try:
        with serve_on(f"{server}/{empty}", subprocess_env, tmp_path, "unmigrated") as url:
            shown = log_in_and_read_the_page(browser, url)
            assert_styled(shown)
            assert "is missing migration" in shown["detail"], shown
            assert "manage.py migrate" in shown["what"], shown
            api = requests.get(f"{url}/api/v1/jobs", headers={"Authorization": "Bearer accs_x"}, timeout=30)
            assert api.status_code == 503 and "is missing migration" in api.json()["detail"], api.text
    finally:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{empty}" WITH (FORCE)')


def test_a_database_that_is_down_gets_a_styled_503_saying_to_start_it(browser, db, subprocess_env, tmp_path):
    closed = free_port()  # nothing listens there: PostgreSQL is not running
    with serve_on(f"postgres://postgres@127.0.0.1:{closed}/accs", subprocess_env, tmp_path, "down") as url:
        # A signed-in operator's session is read from the database on every page.
        answer = requests.get(f"{url}/admin/jobs/job/", cookies={"sessionid": "s" * 32}, timeout=30)
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "5", answer.status_code
        assert answer.headers["Content-Type"].startswith("text/html"), answer.headers
        shown = log_in_and_read_the_page(browser, url)
        assert_styled(shown)
        assert f"PostgreSQL at 127.0.0.1:{closed} could not answer" in shown["detail"], shown
        assert "Start PostgreSQL" in shown["what"], shown
        api = requests.get(f"{url}/api/v1/jobs/summary", headers={"Authorization": "Bearer x" * 8}, timeout=30)
        assert api.status_code == 503 and api.headers["Retry-After"] == "1", api.text
        assert api.json()["detail"].startswith("database temporarily unavailable, retry:"), api.text
    # An outage is an expected condition: each such answer is one warning in the server's log, no error line.
    log = (tmp_path / "down.log").read_text()
    assert "transient database error on /api/v1/jobs/summary" in log, log[-2000:]
    assert "Service Unavailable" not in log, log[-2000:]
