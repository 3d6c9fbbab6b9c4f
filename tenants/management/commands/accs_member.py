"""``manage.py accs_member add USER TENANT [--role admin|viewer]`` · ``remove USER TENANT`` · ``list``."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from tenants.accounts import AccountError, add_member, remove_member
from tenants.models import TenantMembership, TenantRole


class Command(BaseCommand):
    help = "Give users roles in tenants (admin: read and act; viewer: read), remove them, or list them."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="Add a membership (or change its role).")
        add.add_argument("user")
        add.add_argument("tenant")
        add.add_argument("--role", default=TenantRole.ADMIN, choices=TenantRole.values)
        remove = sub.add_parser("remove", help="Remove a membership.")
        remove.add_argument("user")
        remove.add_argument("tenant")
        listing = sub.add_parser("list", help="List memberships.")
        listing.add_argument("--tenant", default=None)

    def handle(self, *args, action: str, **options) -> None:
        try:
            if action == "add":
                m = add_member(options["user"], options["tenant"], role=options["role"])
                self.stdout.write(f"{m.user.username} is {m.role} of {m.tenant.slug}")
            elif action == "remove":
                gone = remove_member(options["user"], options["tenant"])
                self.stdout.write("removed" if gone else f"{options['user']} was not a member of {options['tenant']}")
            else:
                rows = (TenantMembership.objects.select_related("user", "tenant")
                        .order_by("tenant__slug", "user__username"))
                if options["tenant"]:
                    rows = rows.filter(tenant__slug=options["tenant"])
                for m in rows:
                    self.stdout.write(f"{m.tenant.slug:<24} {m.user.username:<24} {m.role}")
        except AccountError as exc:
            raise CommandError(str(exc)) from None
