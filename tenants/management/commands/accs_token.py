"""``manage.py accs_token create USER NAME [--scope read,run,approve,definitions]
[--expires-in 90d | --expires-at ISO]`` · ``revoke --prefix accs_AbC1234`` · ``list``."""

from __future__ import annotations

from datetime import UTC, datetime

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tenants.accounts import AccountError, issue_token, parse_duration, revoke_tokens
from tenants.models import ApiToken


class Command(BaseCommand):
    help = "Create (printed once), revoke or list HTTP API tokens; an expired token is refused by the API."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="Create a token; only the token goes to stdout.")
        create.add_argument("user")
        create.add_argument("name", help="what the token is for, e.g. ci-webhook")
        when = create.add_mutually_exclusive_group()
        when.add_argument("--expires-in", default=None, help="e.g. 90d, 12h, 2w")
        when.add_argument("--expires-at", default=None, help="ISO 8601 time, e.g. 2027-01-31T00:00:00Z")
        create.add_argument("--scope", action="append", default=None, dest="scopes",
                            help="read, run, approve, definitions (repeat or separate by commas); "
                                 "default: read,run,approve")
        revoke = sub.add_parser("revoke", help="Revoke tokens by prefix, or all of a user's (optionally by name).")
        revoke.add_argument("--prefix", default=None, help="the token's full 12-character prefix (accs_token list)")
        revoke.add_argument("--user", default=None)
        revoke.add_argument("--name", default=None)
        listing = sub.add_parser("list", help="List tokens (never the secret).")
        listing.add_argument("--user", default=None)

    def handle(self, *args, action: str, **options) -> None:
        try:
            getattr(self, f"_{action}")(**options)
        except AccountError as exc:
            raise CommandError(str(exc)) from None

    def _create(self, *, user: str, name: str, expires_in: str | None, expires_at: str | None,
                scopes: list[str] | None, **_) -> None:
        token, raw = issue_token(user, name, expires_at=_expiry(expires_in, expires_at),
                                 scopes=",".join(scopes) if scopes else None)
        until = f", expires {token.expires_at.isoformat()}" if token.expires_at else ""
        self.stderr.write(f"token {token.name!r} for {user} (prefix {token.prefix}, scopes {','.join(token.scopes)}"
                          f"{until}); "
                          "store it now, it is not shown again:")
        self.stdout.write(raw)

    def _revoke(self, *, prefix: str | None, user: str | None, name: str | None, **_) -> None:
        self.stdout.write(f"revoked {revoke_tokens(prefix=prefix, username=user, name=name)} token(s)")

    def _list(self, *, user: str | None, **_) -> None:
        tokens = ApiToken.objects.select_related("user").order_by("user__username", "created_at")
        if user:
            tokens = tokens.filter(user__username=user)
        now = timezone.now()
        for t in tokens:
            state = ("revoked" if t.revoked_at else "expired" if t.expires_at and t.expires_at <= now else "active")
            expires = t.expires_at.isoformat() if t.expires_at else "never"
            self.stdout.write(f"{t.prefix:<13} {t.user.username:<20} {t.name:<24} {state:<8} "
                              f"{','.join(t.scopes):<28} expires {expires}")


def _expiry(expires_in: str | None, expires_at: str | None) -> datetime | None:
    if expires_in:
        return timezone.now() + parse_duration(expires_in)
    if expires_at:
        parsed = parse_datetime(expires_at)
        if parsed is None:
            raise AccountError(f"--expires-at: expected an ISO 8601 time, got {expires_at!r}")
        return parsed if timezone.is_aware(parsed) else timezone.make_aware(parsed, UTC)
    return None
