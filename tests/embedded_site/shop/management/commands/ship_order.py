"""``manage.py ship_order REF [--items N]``: start the shop's code-defined ``ship-order`` workflow; print the job id."""

from django.core.management.base import BaseCommand

from jobs import api


class Command(BaseCommand):
    def add_arguments(self, parser) -> None:
        parser.add_argument("reference")
        parser.add_argument("--items", type=int, default=None, help="the items to pick (the step's default: 2)")

    def handle(self, *args, reference: str, items: int | None, **options) -> None:
        picked = {"reference": reference} if items is None else {"reference": reference, "items": items}
        job = api.start_workflow("ship-order", step_params={"pick": picked,
                                                            "label": {"reference": reference},
                                                            "ship": {"reference": reference}})
        self.stdout.write(str(job.id))
