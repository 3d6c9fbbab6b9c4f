"""``manage.py accs_tasks [MODULE ...] [--queue Q] [--keys]``: create the services of ``@task`` functions."""

from __future__ import annotations

import importlib
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError

from jobs.tasks_backend import tasks_in


class Command(BaseCommand):
    help = ("Create the ACCS service of every @task function on an ACCS Tasks backend (in the given modules, "
            "else in each installed app's tasks module) and list their keys for runagent --services.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("modules", nargs="*", help="Dotted modules to scan (default: <app>.tasks of every app).")
        parser.add_argument("--queue", action="append", default=None, help="Only tasks of this queue (repeatable).")
        parser.add_argument("--keys", action="store_true",
                            help="Print only the comma-separated service keys (for runagent --services).")

    def handle(self, *args, **options) -> None:
        tasks: list[Any] = []
        for name in options["modules"] or _app_task_modules():
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise CommandError(f"cannot import {name}: {exc}") from exc
            tasks.extend(t for t in tasks_in(module) if not options["queue"] or t.queue_name in options["queue"])
        if not tasks:
            raise CommandError("no @task functions on an ACCS Tasks backend found; name their modules")
        keys = []
        for task in tasks:
            service = task.get_backend().ensure_service(task)
            keys.append(service.key)
            if not options["keys"]:
                self.stdout.write(f"{service.key:<56} {task.module_path} (queue {task.queue_name}; "
                                  f"{service.max_attempts} attempt(s), timeout {service.timeout_seconds}s, "
                                  f"{service.executor_config.get('isolation', 'thread')})")
        if options["keys"]:
            self.stdout.write(",".join(sorted(set(keys))))


def _app_task_modules() -> list[str]:
    """Return ``<app>.tasks`` for every installed app that has one."""
    found = []
    for config in apps.get_app_configs():
        name = f"{config.name}.tasks"
        if importlib.util.find_spec(name) is not None:
            found.append(name)
    return found
