"""``manage.py check``: Django's, with ``--upgrade-grace`` for the web unit's start.

With ``--upgrade-grace``, the warnings about settings the CHANGELOG calls optional for one
release (:data:`accs_site.checks.OPTIONAL_UNTIL`) are printed as INFO, so ``check --deploy
--fail-level WARNING`` still fails on every other warning but starts the web on the previous
release's settings. From the release named there on, they fail again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core import checks
from django.core.management.commands.check import Command as DjangoCheck

from accs_site.checks import upgrade_grace


@contextmanager
def _optional_warnings_as_info() -> Iterator[None]:
    # Django's command reads the messages from checks.run_checks and decides the exit from their
    # levels; wrapping it for this one call is the only hook between the two.
    run = checks.run_checks

    def run_checks(app_configs: Any = None, tags: Any = None, include_deployment_checks: bool = False,
                   databases: Any = None) -> list[checks.CheckMessage]:
        return [upgrade_grace(message) for message in run(app_configs=app_configs, tags=tags, databases=databases,
                                                          include_deployment_checks=include_deployment_checks)]

    checks.run_checks = run_checks
    try:
        yield
    finally:
        checks.run_checks = run


class Command(DjangoCheck):
    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("--upgrade-grace", action="store_true",
                            help="Print the warnings of settings optional for one more release as INFO "
                                 "(accs_site.checks.OPTIONAL_UNTIL) instead of failing on them.")

    def handle(self, *app_labels: Any, **options: Any) -> None:
        if not options["upgrade_grace"]:
            return super().handle(*app_labels, **options)
        with _optional_warnings_as_info():
            return super().handle(*app_labels, **options)
