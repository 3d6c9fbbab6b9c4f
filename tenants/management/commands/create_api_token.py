"""Create an HTTP API token for a user and print it once: ``manage.py create_api_token USER NAME [--scope ...]``."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from tenants.accounts import AccountError, issue_token


class Command(BaseCommand):
    help = "Create a bearer token for the HTTP API. The token is printed once; only its digest is stored."

    def add_arguments(self, parser) -> None:
        parser.add_argument("user", help="username of the token's owner")
        parser.add_argument("name", help="what the token is for, e.g. 'ci-webhook'")
        parser.add_argument("--scope", action="append", default=None, dest="scopes",
                            help="read, run, approve, definitions (repeat or separate by commas); "
                                 "default: read,run,approve")

    def handle(self, *args, user: str, name: str, scopes: list[str] | None = None, **options) -> None:
        try:
            token, raw = issue_token(user, name, scopes=",".join(scopes) if scopes else None)
        except AccountError as exc:
            raise CommandError(str(exc)) from None
        self.stderr.write(f"token {token.name!r} for {user} (prefix {token.prefix}, scopes {','.join(token.scopes)}); "
                          "store it now, it is not shown again:")
        self.stdout.write(raw)
