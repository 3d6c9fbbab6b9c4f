"""System checks: every ACC_* setting is parsed at start-up, so a bad value stops the process.

The production checks run with ``manage.py check --deploy``, which the web unit of ``deploy/`` runs
before gunicorn starts: only the web signs sessions and serves /metrics, so agents and builders
start without the secret key and the metrics token.
"""

from django.conf import settings
from django.core.checks import INFO, WARNING, CheckMessage, Error, Tags, Warning, register

from accs_site.conf import ANY, SettingError, accs, is_placeholder, is_set, is_weak_secret_key
from accs_site.version import VERSION, release_key


@register()
def check_accs_settings(app_configs=None, **kwargs) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    for name in accs.all_properties():
        try:
            getattr(accs, name)
        except SettingError as exc:
            errors.append(
                Error(
                    str(exc),
                    hint=f"Fix or unset {exc.variable}; .env.example documents every ACC_* variable.",
                    id="accs.E001",
                )
            )
    minio = accs.minio if not errors else None
    if minio is not None and minio.endpoint and not minio.configured:
        errors.append(
            Error(
                "ACC_MINIO_ENDPOINT is set but ACC_MINIO_ACCESS_KEY or ACC_MINIO_SECRET_KEY is missing",
                hint="Set both keys, or unset ACC_MINIO_ENDPOINT to run without artifact storage.",
                id="accs.E002",
            )
        )
    if not errors:
        errors += _retention_problems()
    return errors


def _retention_problems() -> list[Error | Warning]:
    problems: list[Error | Warning] = []
    if accs.retention_export and not accs.minio.configured:
        problems.append(
            Error(
                "ACC_RETENTION_EXPORT is on but artifact storage is not configured: "
                "no finished job would ever be pruned",
                hint="Set ACC_MINIO_ENDPOINT, ACC_MINIO_ACCESS_KEY and ACC_MINIO_SECRET_KEY, "
                "or turn ACC_RETENTION_EXPORT off.",
                id="accs.E003",
            )
        )
    days, dead = accs.retention_days, accs.retention_dead_days
    if dead and (days == 0 or dead < days):
        kept = "for ever" if days == 0 else f"for {days} days"
        problems.append(
            Warning(
                f"ACC_RETENTION_DEAD_DAYS={dead} prunes dead letters sooner than other finished jobs, "
                f"which are kept {kept} "
                "(ACC_RETENTION_DAYS)",
                hint="Dead letters are kept longer, for investigation: raise ACC_RETENTION_DEAD_DAYS or set it to 0.",
                id="accs.W001",
            )
        )
    return problems


# The apps a site must install for ACCS, each with what it brings (for the error's words).
REQUIRED_APPS = {
    "django.contrib.postgres": "PostgreSQL features the engine's models use",
    "tenants": "tenants, memberships and API tokens (moved out of jobs in 0.2.0)",
    "workflows": "services and workflows",
    "jobs": "the engine",
    "nodes": "agents and hosts",
    "events": "the timeline and artifacts",
    "ops": "the operators' dashboard, metrics and accs_status (moved out of events in 0.2.0)",
}


@register()
def check_accs_apps(app_configs=None, **kwargs) -> list[Error]:
    """Name an ACCS app the site does not install, with what it brings.

    Where ``ops`` goes relative to the admin is the site's choice (above it, the admin's pages get
    the Dashboard link and ACCS's styles; below it, ACCS's own pages still carry theirs), so its
    order is not checked.
    """
    from django.conf import settings

    installed = list(settings.INSTALLED_APPS)
    problems: list[Error] = []
    for app, what in REQUIRED_APPS.items():
        if app not in installed and not any(entry.startswith(f"{app}.apps.") for entry in installed):
            problems.append(Error(
                f"INSTALLED_APPS lacks {app!r} ({what})",
                hint=f"Add {app!r} to INSTALLED_APPS; docs/embedding.md shows the full list in its order.",
                id="accs.E004"))
    return problems


@register(Tags.urls)
def check_ops_urls(app_configs=None, **kwargs) -> list[Warning]:
    """Warn when the operators' pages are not wired into the site's URLs (they moved in 0.2.0)."""
    from django.conf import settings
    from django.urls import NoReverseMatch, reverse

    if "ops" not in settings.INSTALLED_APPS or not getattr(settings, "ROOT_URLCONF", None):
        return []
    try:
        reverse("ops:dashboard")
    except NoReverseMatch:
        return [Warning(
            "the operators' pages (ops.urls: dashboard, job page downloads, attempt logs) are not in the "
            "site's URLs; the dashboard is no longer registered on admin.site",
            hint='Add path("admin/", include("ops.urls")) before path("admin/", admin.site.urls) '
                 "(docs/embedding.md).",
            id="accs.W003")]
    return []


@register(deploy=True)
def check_allow_lists(app_configs=None, **kwargs) -> list[Warning]:
    """Warn (under ``check --deploy``) when agents may run any program or any Python callable, and when
    an allow-list is unset, so agents run nothing of the site's own (only the demo tool)."""
    warnings: list[Warning] = []
    for variable, name in (("ACC_ALLOWED_EXECUTABLES", "allowed_executables"),
                           ("ACC_ALLOWED_CALLABLES", "allowed_callables")):
        try:
            entries = getattr(accs, name)
        except SettingError:
            continue  # check_accs_settings reports it
        example = "/opt/accs/tools/" if name == "allowed_executables" else "myapp.tasks,myapp.jobs"
        if ANY in entries:
            warnings.append(Warning(
                f"{variable} allows anything (*): whoever may define services chooses what agents run",
                hint=f"List what your services need, e.g. {variable}={example} (docs/executors.md, Site allow-lists).",
                id="accs.W020"))
        elif not is_set(variable):
            refused = ("every program but the project's demo tool" if name == "allowed_executables"
                       else "every Python callable, the Tasks framework's @task functions included")
            warnings.append(Warning(
                f"{variable} is not set, so agents refuse {refused} (not_allowed)",
                hint=f"List what your services need, e.g. {variable}={example}; * allows anything, and only "
                     "when written (docs/executors.md, Site allow-lists).",
                id="accs.W021"))
    return warnings


@register(Tags.security, deploy=True)
def check_production_secrets(app_configs=None, **kwargs) -> list[Error]:
    """Refuse the development key or a placeholder, and an open /metrics, when DEBUG is off."""
    if settings.DEBUG:
        return []
    errors: list[Error] = []
    if is_weak_secret_key(settings.SECRET_KEY):
        errors.append(Error(
            "SECRET_KEY is the development key, a placeholder or too weak, and DEBUG is off: anyone could forge "
            "sessions and signed values",
            hint="Set ACC_SECRET_KEY to 50 or more random characters, e.g. "
                 "python -c 'import secrets; print(secrets.token_urlsafe(50))'.",
            id="accs.E010",
        ))
    try:
        token = accs.metrics_token
    except SettingError:
        token = None  # reported by check_accs_settings
    if is_placeholder(token):
        errors.append(Error(
            "ACC_METRICS_TOKEN is unset or a placeholder and DEBUG is off: /metrics refuses every scrape",
            hint="Set ACC_METRICS_TOKEN to a random value and give it to Prometheus as a bearer token.",
            id="accs.E011",
        ))
    return errors


# Warnings about settings the CHANGELOG calls optional for one release, with the release from which
# they count again: until then `check --deploy --fail-level WARNING --upgrade-grace` (the web
# unit's) prints them as INFO instead of failing, so the previous release's settings still start
# the web. Django's own ids are the production settings deploy/env/web.env now sets.
OPTIONAL_UNTIL = {
    "security.W004": "0.3.0",  # ACC_HSTS_SECONDS
    "security.W008": "0.3.0",  # ACC_SSL_REDIRECT
    "security.W012": "0.3.0",  # ACC_SECURE_COOKIES (session cookie)
    "security.W016": "0.3.0",  # ACC_SECURE_COOKIES (CSRF cookie)
    "accs.W020": "0.3.0",  # ACC_ALLOWED_EXECUTABLES / ACC_ALLOWED_CALLABLES = * (the previous behaviour)
    "accs.W021": "0.3.0",  # ACC_ALLOWED_EXECUTABLES / ACC_ALLOWED_CALLABLES unset
}


def upgrade_grace(message: CheckMessage, *, version: str = VERSION) -> CheckMessage:
    """Return the message as INFO when it is a warning :data:`OPTIONAL_UNTIL` still tolerates, else itself."""
    until = OPTIONAL_UNTIL.get(message.id or "")
    if until is None or message.level != WARNING or release_key(version) >= release_key(until):
        return message
    return CheckMessage(INFO, f"{message.msg} [optional until ACCS {until}: set it before upgrading to {until}, "
                              "when this warning fails the web unit's start]",
                        hint=message.hint, obj=message.obj, id=message.id)
