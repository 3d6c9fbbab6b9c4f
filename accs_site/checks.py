"""System checks: every ACC_* setting is parsed at start-up, so a bad value stops the process."""

from django.core.checks import Error, Warning, register

from accs_site.conf import ANY, SettingError, accs


@register()
def check_accs_settings(app_configs=None, **kwargs) -> list[Error]:
    errors: list[Error] = []
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
                "ACC_RETENTION_EXPORT is on but artifact storage is not configured: no finished job would ever be pruned",
                hint="Set ACC_MINIO_ENDPOINT, ACC_MINIO_ACCESS_KEY and ACC_MINIO_SECRET_KEY, or turn ACC_RETENTION_EXPORT off.",
                id="accs.E003",
            )
        )
    days, dead = accs.retention_days, accs.retention_dead_days
    if dead and (days == 0 or dead < days):
        kept = "for ever" if days == 0 else f"for {days} days"
        problems.append(
            Warning(
                f"ACC_RETENTION_DEAD_DAYS={dead} prunes dead letters sooner than other finished jobs, which are kept {kept} "
                "(ACC_RETENTION_DAYS)",
                hint="Dead letters are kept longer, for investigation: raise ACC_RETENTION_DEAD_DAYS or set it to 0.",
                id="accs.W001",
            )
        )
    return problems


@register(deploy=True)
def check_allow_lists(app_configs=None, **kwargs) -> list[Warning]:
    """Warn (under ``check --deploy``) when agents may run any program or any Python callable."""
    warnings: list[Warning] = []
    for variable, name in (("ACC_ALLOWED_EXECUTABLES", "allowed_executables"),
                           ("ACC_ALLOWED_CALLABLES", "allowed_callables")):
        try:
            entries = getattr(accs, name)
        except SettingError:
            continue  # check_accs_settings reports it
        if ANY in entries:
            warnings.append(
                Warning(
                    f"{variable} allows anything (*): whoever may define services chooses what agents run",
                    hint=f"List what your services need, e.g. {variable}="
                         + ("python,/opt/tools/" if name == "allowed_executables" else "myapp.tasks,myapp.jobs")
                         + " (docs/executors.md, Site allow-lists).",
                    id="accs.W020",
                )
            )
    return warnings
