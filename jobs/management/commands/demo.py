"""``manage.py demo``: load the sample services and workflows and show them."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from workflows.api import import_definitions
from workflows.demo import definitions
from workflows.models import Service, Workflow


class Command(BaseCommand):
    help = "Load the demo services and workflows and show them."

    def handle(self, *args, **options) -> None:
        services, workflows = import_definitions(definitions())
        self.stdout.write(self.style.MIGRATE_HEADING(f"Loaded {len(services)} services and {len(workflows)} workflows"))
        for service in Service.objects.order_by("key"):
            self.stdout.write(f"  service  {service.key:<12} {service.executor:<8} {service.description}")
        for workflow in Workflow.objects.order_by("name", "version"):
            chain = " → ".join(s["key"] for s in workflow.steps)
            self.stdout.write(f"  workflow {workflow.name} v{workflow.version}: {chain}")
