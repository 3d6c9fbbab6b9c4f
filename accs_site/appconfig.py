"""What every ACCS app needs from Django, whichever site installs it.

Each ACCS AppConfig derives from :class:`AccsAppConfig`: it fixes the primary-key type its
migrations were written with (so a site on Django's default ``AutoField`` gets no "Alter field id"
migrations for ACCS) and registers ACCS's system checks, so a malformed ``ACC_*`` value stops
``manage.py`` at start in any site, not only in ``accs_site``.
"""

from __future__ import annotations

from django.apps import AppConfig


class AccsAppConfig(AppConfig):
    """Base of the ACCS apps' configurations."""

    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registering the same check function twice is a no-op, so every app may do it.
        from accs_site import checks  # noqa: F401
