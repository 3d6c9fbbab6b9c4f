"""``manage.py place_order REF [--rollback]``: an order and its packing job in one transaction."""

from django.core.management.base import BaseCommand
from django.db import transaction

from jobs import api
from shop.models import Order
from shop.tasks import receipt
from workflows.api import save_service


class Rollback(Exception):
    pass


class Command(BaseCommand):
    def add_arguments(self, parser) -> None:
        parser.add_argument("reference")
        parser.add_argument("--rollback", action="store_true", help="Fail after starting the job.")

    def handle(self, *args, reference: str, rollback: bool, **options) -> None:
        save_service(key="shop-pack", executor="python", executor_config={"callable": "shop.work:pack"},
                     params_schema={"type": "object", "required": ["reference"]})
        try:
            with transaction.atomic():
                job = api.start_service("shop-pack", params={"reference": reference}, external_id=f"order-{reference}")
                Order.objects.create(reference=reference, job=job)
                result = receipt.enqueue(reference)
                if rollback:
                    raise Rollback
        except Rollback:
            self.stdout.write("rolled back")
            return
        self.stdout.write(f"{job.id} {result.id}")
