"""``manage.py accs_tenant create SLUG [--name N] [--timezone Z] [--max-in-flight K] [--min-priority P]
[--max-priority P]`` · ``accs_tenant list``."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from tenants.accounts import AccountError, create_tenant
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Create, update or list tenants."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="Create a tenant (or update an existing one's fields).")
        create.add_argument("slug")
        create.add_argument("--name", default="")
        create.add_argument("--timezone", default="UTC", help="IANA zone for its schedules (default UTC).")
        create.add_argument("--max-in-flight", type=int, default=None,
                            help="Running jobs at once; 0 = unlimited (new tenants: ACC_TENANT_MAX_IN_FLIGHT).")
        create.add_argument("--min-priority", type=int, default=None,
                            help="Lowest priority its jobs get (default -1000).")
        create.add_argument("--max-priority", type=int, default=None,
                            help="Highest priority its jobs get (default 1000).")
        sub.add_parser("list", help="List tenants.")

    def handle(self, *args, action: str, **options) -> None:
        if action == "list":
            for t in Tenant.objects.order_by("slug"):
                self.stdout.write(f"{t.slug:<24} {t.name:<32} {t.timezone:<20} max_in_flight={t.max_in_flight}"
                                  f" priority={t.min_priority}..{t.max_priority}")
            return
        try:
            tenant, created = create_tenant(options["slug"], name=options["name"], tz=options["timezone"],
                                            max_in_flight=options["max_in_flight"],
                                            min_priority=options["min_priority"], max_priority=options["max_priority"])
        except AccountError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{'created' if created else 'updated'} tenant {tenant.slug} ({tenant.id})")
