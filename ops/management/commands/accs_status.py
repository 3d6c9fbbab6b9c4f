"""``manage.py accs_status [--tenant SLUG] [--failures N] [--watch SECONDS] [--json]``.

A terminal summary of why queued work is stuck, queues, services, nodes, governor conditions and
recent failures: the same figures as the admin dashboard (:mod:`ops.overview`), as readable
tables (drawn by :mod:`ops.status`). ``--json`` prints them as JSON (the stuck reasons under ``stuck``).

Exit codes: 0 printed; 2 a bad option, an unknown tenant, or the database unreachable (one line
on stderr naming the address). With ``--watch``, an outage after the first picture is shown as a
line and retried at the next refresh.
"""

from __future__ import annotations

import json
import sys
import time

from django.db import InterfaceError, OperationalError, close_old_connections

from accs_site.cli import OperatorCommand, bounded, usage_error
from accs_site.daemon import close_django_connection, database_address, first_line
from ops.overview import Overview, overview, recent_failures
from ops.status import database_label, status_lines
from tenants.models import Tenant


def _unreachable(exc: BaseException) -> str:
    return f"database unreachable at {database_address()}: {first_line(exc)}"


class Command(OperatorCommand):
    help = "Show queues, nodes and recent failures as tables (the admin dashboard's figures)."
    needs_ready_database = True

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", action="append", default=[], help="Only this tenant (slug); repeatable.")
        parser.add_argument("--failures", type=bounded(int, minimum=0, maximum=1000), default=10,
                            help="Recent failed attempts to list, 0-1000 (default: %(default)s).")
        parser.add_argument("--watch", type=bounded(float, minimum=0.5, maximum=3600), default=None, metavar="SECONDS",
                            help="Refresh every SECONDS (0.5-3600) until interrupted.")
        parser.add_argument("--json", action="store_true", help="Print the figures as JSON instead of tables.")

    def handle(self, *args, **options) -> None:
        try:
            tenant_ids = self._tenants(options["tenant"])
        except (OperationalError, InterfaceError) as exc:
            raise usage_error(_unreachable(exc)) from None
        shown = False
        while True:
            started = time.monotonic()
            self._progress("reading queues, timings, nodes and failures…")
            try:
                data = overview(tenant_ids=tenant_ids)
                data.failures = (recent_failures(tenant_ids=tenant_ids, limit=options["failures"])
                                 if options["failures"] else [])
            except (OperationalError, InterfaceError) as exc:
                self._progress("")
                close_django_connection()
                if not (options["watch"] and shown):
                    raise usage_error(_unreachable(exc)) from None
                self.stderr.write(f"{_unreachable(exc)}; retrying")
                time.sleep(options["watch"])
                continue
            shown = True
            self._progress("")
            if options["json"]:
                self.stdout.write(json.dumps(data.as_json(), indent=2, default=str))
            else:
                if options["watch"]:
                    self.stdout.write("\x1b[2J\x1b[H", ending="")  # clear the screen between refreshes
                self.render(data, took=time.monotonic() - started)
            if not options["watch"]:
                return
            close_old_connections()
            try:
                time.sleep(options["watch"])  # a display refresh interval, not a wait for a condition
            except KeyboardInterrupt:
                return

    @staticmethod
    def _tenants(slugs: list[str]) -> set | None:
        """Return the ids of the named tenants (None: all); an unknown slug is a usage error."""
        if not slugs:
            return None
        found = dict(Tenant.objects.filter(slug__in=slugs).values_list("slug", "id"))
        missing = sorted(set(slugs) - set(found))
        if missing:
            known = ", ".join(Tenant.objects.values_list("slug", flat=True)) or "none"
            raise usage_error(f"no tenant {', '.join(missing)} (known: {known})")
        return set(found.values())

    def _progress(self, message: str) -> None:
        """Show what is being read on an interactive terminal (stderr, erased afterwards)."""
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K" + message)
            sys.stderr.flush()

    def render(self, data: Overview, *, took: float) -> None:
        for line in status_lines(data, took=took, database=database_label(), style=self.style):
            self.stdout.write(line)
