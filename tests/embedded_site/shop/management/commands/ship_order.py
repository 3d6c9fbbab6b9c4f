"""``manage.py ship_order REF``: start the shop's code-defined ``ship-order`` workflow; print the job id."""

from django.core.management.base import BaseCommand

from jobs import api


class Command(BaseCommand):
    def add_arguments(self, parser) -> None:
        parser.add_argument("reference")

    def handle(self, *args, reference: str, **options) -> None:
        job = api.start_workflow("ship-order", step_params={"pick": {"reference": reference},
                                                            "label": {"reference": reference},
                                                            "ship": {"reference": reference}})
        self.stdout.write(str(job.id))
