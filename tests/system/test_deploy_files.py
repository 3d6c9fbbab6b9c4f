"""The deployment files under deploy/ name only commands, modules, files and variables that exist."""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from django.core.management import get_commands

from tests import forkserver

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ENV_FILES = {p.name: p for p in (DEPLOY / "env").glob("*.env")}
ACC_VAR = re.compile(r"\bACC_[A-Z0-9_]+\b")
REF_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def documented_acc_variables() -> set[str]:
    """ACC_* names .env.example documents (commented or not)."""
    return set(ACC_VAR.findall((ROOT / ".env.example").read_text()))


def env_file_values(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


def check_argv(argv: list[str], where: str) -> None:
    """A manage.py command must exist; gunicorn must be installed and its WSGI module importable."""
    words = [Path(w).name for w in argv]
    if "manage.py" in words:
        command = argv[words.index("manage.py") + 1]
        assert command in get_commands(), f"{where}: manage.py {command} does not exist"
    if "gunicorn" in words:
        assert importlib.util.find_spec("gunicorn"), f"{where}: gunicorn is not installed (requirements.txt)"
        module = argv[words.index("gunicorn") + 1].split(":")[0]
        assert importlib.util.find_spec(module), f"{where}: WSGI module {module} does not exist"
        if "-c" in argv:
            config = argv[argv.index("-c") + 1].removeprefix("/opt/accs/")
            assert (ROOT / config).is_file(), f"{where}: gunicorn config {config} does not exist"


def unit(path: Path) -> configparser.RawConfigParser:
    """Parse a systemd unit; repeated keys (EnvironmentFile, ExecStartPre) keep every value, one a line."""

    class Multi(dict):
        def __setitem__(self, key, value):
            if key in self and isinstance(value, list):
                self[key].extend(value)
            else:
                super().__setitem__(key, value)

    parser = configparser.RawConfigParser(strict=False, dict_type=Multi, delimiters=("=",))
    parser.optionxform = str
    parser.read(path)
    return parser


def test_env_files_name_only_documented_acc_variables():
    documented = documented_acc_variables()
    for name, path in ENV_FILES.items():
        unknown = sorted(set(env_file_values(path)) & {v for v in ACC_VAR.findall(path.read_text())} - documented)
        assert not unknown, f"deploy/env/{name} sets {unknown}, which .env.example does not document"


@pytest.mark.parametrize("path", UNITS, ids=[p.name for p in UNITS])
def test_systemd_unit_commands_files_and_variables_exist(path):
    parsed = unit(path)
    service = parsed["Service"]
    env_files = [Path(v).name for v in service.get("EnvironmentFile", "").split("\n") if v]
    for name in env_files:
        assert name in ENV_FILES, f"{path.name}: EnvironmentFile {name} has no deploy/env/{name}"
    defined = {k for name in env_files for k in env_file_values(ENV_FILES[name])}
    for key in ("ExecStart", "ExecStartPre"):
        for line in filter(None, service.get(key, "").split("\n")):
            check_argv(shlex.split(line), f"{path.name} {key}")
            for var in REF_VAR.findall(line):
                if var != "MAINPID":
                    assert var in defined, f"{path.name}: ${{{var}}} is not set by {env_files}"
    assert service["User"] and parsed["Install"]["WantedBy"]
    if path.name.startswith("accs-agent") or path.name.startswith("accs-builder"):
        assert service["Restart"] == "always"


def test_builder_unit_is_a_template_for_two_instances():
    assert (DEPLOY / "systemd" / "accs-builder@.service").exists()
    assert "accs-builder@1 accs-builder@2" in (ROOT / "docs" / "deploy.md").read_text()


def test_compose_file_services_commands_and_variables_exist():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"db", "minio", "web", "builder-1", "builder-2", "agent"} <= set(services)
    documented = documented_acc_variables()
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for env_file in svc.get("env_file", []):
            assert (DEPLOY / env_file).exists(), f"{name}: env_file {env_file} missing"
        for var in svc.get("environment", {}):
            assert not var.startswith("ACC_") or var in documented, f"{name}: {var} is not in .env.example"
        command = svc.get("command")
        if command and svc.get("image") == "accs":
            argv = shlex.split(command[-1]) if command[0] == "sh" else command
            check_argv(argv, f"compose {name}")
            env_defined = {k for f in svc.get("env_file", []) for k in env_file_values(DEPLOY / f)}
            for var in REF_VAR.findall(" ".join(command).replace("$$", "$")):
                assert var in env_defined, f"compose {name}: ${var} is not set by its env files"
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()


def test_acc_variables_the_deploy_files_name_are_read_by_accs():
    source = "\n".join(p.read_text() for p in ROOT.glob("*/*.py") if ".venv" not in p.parts)
    named = set()
    for path in [*UNITS, *ENV_FILES.values(), DEPLOY / "compose.yaml"]:
        named |= set(ACC_VAR.findall(path.read_text()))
    unread = sorted(v for v in named if f'"{v}"' not in source)
    assert not unread, f"deploy files set {unread}, which no ACCS module reads"


def _seconds(text: str) -> float:
    """Parse a systemd or compose duration: 660, 660s, 11m, 1h."""
    number, unit_ = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|m|min|h)?", text.strip()).groups()
    return float(number) * {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600}[unit_]


def _drain_seconds(argv: list[str], where: str) -> float:
    assert "--drain-seconds" in argv, f"{where}: the agent needs --drain-seconds below its stop timeout"
    return float(argv[argv.index("--drain-seconds") + 1])


def test_the_agent_hands_tasks_back_before_its_supervisor_kills_it():
    """A task longer than the stop timeout is handed back interrupted by the agent, not SIGKILLed with it."""
    agent = unit(DEPLOY / "systemd" / "accs-agent.service")["Service"]
    drain = _drain_seconds(shlex.split(agent["ExecStart"]), "accs-agent.service")
    assert agent["KillMode"] == "mixed", "systemd's SIGTERM goes to the agent alone, not to its tasks"
    assert _seconds(agent["TimeoutStopSec"]) >= drain + 30, "time past the drain to stop tasks and report them"
    compose_agent = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["agent"]
    compose_drain = _drain_seconds(shlex.split(compose_agent["command"][-1]), "compose agent")
    assert _seconds(compose_agent["stop_grace_period"]) >= compose_drain + 30
    recipe = (ROOT / "docs" / "deploy.md").read_text()
    assert f"--drain-seconds {drain:g}" in recipe and f"TimeoutStopSec={agent['TimeoutStopSec']}" in recipe, \
        "docs/deploy.md's recipe gives the unit's own figures"
    comment = (DEPLOY / "systemd" / "accs-agent.service").read_text()
    assert "A second SIGTERM hands them back at once" in comment
    assert "one SIGTERM hands" not in comment.lower()

def _deploy_check(env_values: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``manage.py check --deploy`` with only the given variables (and what a shell needs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACC_", "DJANGO_"))}
    env.update(env_values, PYTHONPATH=str(ROOT))
    return forkserver.run([sys.executable, str(ROOT / "manage.py"), "check", "--deploy", "--fail-level", "WARNING"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _web_env() -> dict[str, str]:
    """The web unit's environment as deploy/ documents it (accs.env, then web.env)."""
    return {**env_file_values(ENV_FILES["accs.env"]), **env_file_values(ENV_FILES["web.env"])}


def test_check_deploy_reports_nothing_with_the_documented_production_env_once_its_secrets_are_set():
    values = _web_env()
    # What docs/deploy.md tells the operator to do: replace every change-me with a generated value.
    filled = {k: (secrets.token_urlsafe(50) if "change-me" in v and k != "ACC_DB_URL" else v)
              for k, v in values.items()}
    done = _deploy_check(filled)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues (0 silenced)." in done.stdout, done.stdout + done.stderr


def test_check_deploy_refuses_the_placeholder_secret_key_and_metrics_token_when_debug_is_off():
    done = _deploy_check(_web_env())
    assert done.returncode != 0
    assert "accs.E010" in done.stderr and "Set ACC_SECRET_KEY to 50 or more random characters" in done.stderr
    assert "accs.E011" in done.stderr
    unset = {k: v for k, v in _web_env().items() if k not in ("ACC_SECRET_KEY", "ACC_METRICS_TOKEN")}
    done = _deploy_check(unset)
    assert "accs.E010" in done.stderr and "accs.E011" in done.stderr, "the development key is refused too"
    # An agent's plain `check` needs neither.
    agent = {**env_file_values(ENV_FILES["accs.env"]), **env_file_values(ENV_FILES["agent.env"])}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACC_", "DJANGO_"))}
    plain = forkserver.run([sys.executable, str(ROOT / "manage.py"), "check"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**env, **agent, "PYTHONPATH": str(ROOT)})
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "ACC_SECRET_KEY" not in agent and "ACC_METRICS_TOKEN" not in agent


def test_the_image_leaves_local_secrets_and_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".env", ".local/", ".venv", ".git/"):
        assert entry in ignored, f".dockerignore must keep {entry} out of the image"


def test_deploy_docs_install_the_env_files_readable_by_the_service_only():
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert "install -m 0640 -g accs deploy/env/*.env /etc/accs/" in text
    assert "cp deploy/env/*.env" not in text


def test_production_settings_name_a_malformed_value():
    from accs_site.conf import SettingError, proxy_ssl_header, trusted_origins

    assert proxy_ssl_header("ACC_PROXY_SSL_HEADER", "X-Forwarded-Proto: https") == ("HTTP_X_FORWARDED_PROTO", "https")
    assert proxy_ssl_header("ACC_PROXY_SSL_HEADER", "") is None
    with pytest.raises(SettingError, match="ACC_PROXY_SSL_HEADER: expected 'Header-Name: value'"):
        proxy_ssl_header("ACC_PROXY_SSL_HEADER", "X-Forwarded-Proto")
    assert trusted_origins("ACC_CSRF_TRUSTED_ORIGINS", ["https://a.example.com"]) == ["https://a.example.com"]
    with pytest.raises(SettingError, match="ACC_CSRF_TRUSTED_ORIGINS: expected origins"):
        trusted_origins("ACC_CSRF_TRUSTED_ORIGINS", ["a.example.com"])


# The production settings deploy/env/web.env gained in 0.2.0, and the allow-lists: the previous
# release's settings have none of them.
NEW_IN_0_2_0 = ("ACC_PROXY_SSL_HEADER", "ACC_CSRF_TRUSTED_ORIGINS", "ACC_SECURE_COOKIES", "ACC_SSL_REDIRECT",
                "ACC_HSTS_SECONDS", "ACC_HSTS_INCLUDE_SUBDOMAINS", "ACC_HSTS_PRELOAD", "ACC_ALLOWED_EXECUTABLES",
                "ACC_ALLOWED_CALLABLES")


def _web_unit_check_argv() -> list[str]:
    """The web unit's ExecStartPre that runs ``manage.py check``, as this Python runs it."""
    pre = unit(DEPLOY / "systemd" / "accs-web.service")["Service"]["ExecStartPre"]
    [line] = [x for x in pre.split("\n") if " check " in f" {x} "]
    argv = shlex.split(line)
    return [sys.executable, str(ROOT / "manage.py"), *argv[argv.index("manage.py") + 1:]]


def _previous_release_web_env(**extra: str) -> dict[str, str]:
    filled = {k: (secrets.token_urlsafe(50) if "change-me" in v and k != "ACC_DB_URL" else v)
              for k, v in _web_env().items() if k not in NEW_IN_0_2_0}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACC_", "DJANGO_"))}
    return {**env, **filled, **extra, "PYTHONPATH": str(ROOT)}


def test_the_web_unit_starts_on_the_previous_release_settings_and_prints_what_to_set():
    done = forkserver.run(_web_unit_check_argv(), cwd=ROOT, env=_previous_release_web_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = done.stdout + done.stderr
    for check_id in ("security.W004", "security.W008", "security.W012", "security.W016", "accs.W021"):
        assert f"({check_id})" in printed, (check_id, printed)
    assert printed.count("optional until ACCS 0.3.0") == 6, printed


def test_the_web_unit_still_fails_on_a_warning_that_is_not_optional():
    env = _previous_release_web_env(ACC_RETENTION_DAYS="30", ACC_RETENTION_DEAD_DAYS="7")
    done = forkserver.run(_web_unit_check_argv(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "accs.W001" in done.stderr, done.stdout + done.stderr
