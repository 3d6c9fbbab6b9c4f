"""System checks: every ACC_* setting is parsed at start-up, so a bad value stops the process."""

from django.core.checks import Error, register

from accs_site.conf import SettingError, accs


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
    return errors
