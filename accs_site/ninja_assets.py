"""django-ninja's templates and static files (Swagger UI's bundled copy), without importing django-ninja.

Listing ``"ninja"`` in ``INSTALLED_APPS`` makes Django import the whole of django-ninja (pydantic,
and through it ``django.test`` and Jinja2) in every process at start: in the daemons, the commands
and the task children too, which never serve the API. This app config gives the template and static
file finders django-ninja's folder under the label ``ninja`` and leaves the import to the processes
that load the API's URLs. :class:`accs_site.api_v1.BundledSwagger` renders the bundled page for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured


def _package_folder(name: str) -> str:
    """Return the folder of the installed package ``name``, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImproperlyConfigured(f"the package {name!r} is not installed (pip install django-ninja)")
    return str(Path(next(iter(spec.submodule_search_locations))))


class NinjaAssetsConfig(AppConfig):
    """django-ninja's ``templates/`` and ``static/`` folders as an installed app labelled ``ninja``."""

    name = "accs_site.ninja_assets"
    label = "ninja"
    verbose_name = "django-ninja's templates and static files"
    path = _package_folder("ninja")
