"""Create an HTTP API token for a user and print it once: ``manage.py create_api_token USER NAME``."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs.auth import create_token


class Command(BaseCommand):
    help = "Create a bearer token for the HTTP API. The token is printed once; only its digest is stored."

    def add_arguments(self, parser) -> None:
        parser.add_argument("user", help="username of the token's owner")
        parser.add_argument("name", help="what the token is for, e.g. 'ci-webhook'")

    def handle(self, *args, user: str, name: str, **options) -> None:
        owner = get_user_model().objects.filter(username=user).first()
        if owner is None:
            raise CommandError(f"no user {user!r}; create it first (manage.py createsuperuser or the admin)")
        if not owner.is_active:
            raise CommandError(f"user {user!r} is not active")
        if not name.strip() or len(name) > 100:
            raise CommandError("NAME must be 1-100 characters")
        token, raw = create_token(owner, name.strip())
        self.stderr.write(f"token {token.name!r} for {owner.username} (prefix {token.prefix}); "
                          "store it now, it is not shown again:")
        self.stdout.write(raw)
