"""``manage.py accs_status [--tenant SLUG] [--failures N] [--watch SECONDS] [--json]``.

A terminal summary of why queued work is stuck, queues, services, nodes, governor conditions and
recent failures: the same figures as the admin dashboard (:mod:`ops.overview`), as readable
tables. ``--json`` prints them as JSON (the stuck reasons under ``stuck``).

Exit codes: 0 printed; 2 a bad option, an unknown tenant, or the database unreachable (one line
on stderr naming the address). With ``--watch``, an outage after the first picture is shown as a
line and retried at the next refresh.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from django.db import InterfaceError, OperationalError, close_old_connections, connection
from django.utils import timezone

from accs_site.cli import OperatorCommand, bounded, usage_error
from accs_site.daemon import close_django_connection, database_address, first_line
from ops.overview import Overview, human_age, overview, recent_failures
from tenants.models import Tenant


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: frozenset[int] | set[int] = frozenset()
          ) -> list[str]:
    """Format rows as aligned columns (``right`` holds the indexes of right-aligned columns)."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), line(["─" * w for w in widths]), *[line(r) for r in rows]]


def _unreachable(exc: BaseException) -> str:
    return f"database unreachable at {database_address()}: {first_line(exc)}"


def _secs(value: float | None) -> str:
    return human_age(value)


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

    def heading(self, text: str) -> None:
        self.stdout.write("")
        self.stdout.write(self.style.MIGRATE_HEADING(text))

    def render(self, data: Overview, *, took: float) -> None:
        db = connection.settings_dict
        self.stdout.write(self.style.MIGRATE_HEADING(
            f"ACCS status at {timezone.localtime(data.generated_at):%Y-%m-%d %H:%M:%S %Z}"
            f" — database {db['NAME']} on {db['HOST'] or 'local socket'}:{db['PORT'] or 5432}"))
        t, s = data.totals, data.stats.overall
        summary = (f"jobs: not started {t.jobs_queued} · awaiting approval {t.awaiting_approval}"
                   f" · waiting {t.jobs_waiting} · running {t.jobs_running} · failed 24 h {t.failed_24h}"
                   f" | tasks: queued {t.queued} · running {t.running} · retrying {t.retrying} · waiting {t.waiting}"
                   f" · dead letter {t.dead_letter} · oldest queued {_secs(t.oldest_queued_age)}")
        self.stdout.write(self.style.ERROR(summary) if t.dead_letter else summary)
        self.stdout.write(f"last {_secs(data.stats.window_seconds)}: {s.finished} attempts finished"
                          f" ({s.per_minute:.1f}/min), {s.failed} failed · queue latency p50 {_secs(s.latency_p50)}"
                          f" p95 {_secs(s.latency_p95)} · run time p50 {_secs(s.run_p50)} p95 {_secs(s.run_p95)}")

        self.heading("Why isn't it moving?")
        for r in data.stuck:
            self.stdout.write(self.style.WARNING(f"{r.message}" + (f" — {r.detail}" if r.detail else "")))
        if not data.stuck:
            self.stdout.write("(nothing stuck: every service with queued tasks has a live agent and room)")

        self.heading("Queues per tenant (jobs | tasks)")
        rows = [[c.tenant, str(c.jobs_queued), str(c.awaiting_approval), str(c.jobs_waiting), str(c.jobs_running),
                 str(c.failed_24h), str(c.waiting), str(c.queued), str(c.running), str(c.retrying), str(c.dead_letter),
                 _secs(c.oldest_queued_age)] for c in data.tenants]
        for line in table(["tenant", "jobs: not started", "approval", "waiting", "running", "failed 24h",
                           "tasks: waiting", "queued", "running", "retrying", "dead letter", "oldest"], rows,
                          right=set(range(1, 12))):
            self.stdout.write(line)

        self.heading("Services")
        timing = {x.service: x for x in data.stats.services}
        names = sorted({r.service for r in data.services} | set(timing))
        depth: dict[str, list[int]] = {}
        for r in data.services:
            d = depth.setdefault(r.service, [0, 0, 0, 0])
            d[0] += r.queued
            d[1] += r.starting + r.running
            d[2] += r.retrying
            d[3] += r.dead_letter
        rows = []
        for name in names:
            d, x = depth.get(name, [0, 0, 0, 0]), timing.get(name)
            rows.append([name, str(d[0]), str(d[1]), str(d[2]), str(d[3]),
                         f"{x.per_minute:.1f}/min" if x else "—", str(x.failed) if x else "—",
                         f"{_secs(x.latency_p50)} / {_secs(x.latency_p95)}" if x else "—",
                         f"{_secs(x.run_p50)} / {_secs(x.run_p95)}" if x else "—"])
        for line in table(["service", "queued", "running", "retrying", "dead letter", "throughput", "failed",
                           "latency p50/p95", "run p50/p95"], rows, right={1, 2, 3, 4, 5, 6}):
            self.stdout.write(line)
        if not rows:
            self.stdout.write("(nothing queued, running or finished recently)")

        self.heading(f"Nodes (an online node is LATE after {_secs(data.stale_after)} without a heartbeat)")
        rows = []
        for n in data.nodes:
            seen = "never" if n.seen_ago is None else f"{_secs(n.seen_ago)} ago"
            disk = "—" if n.disk_used_pct is None else f"{n.disk_used_pct:.0f} % {n.disk_level}"
            presence = n.presence + (" LATE" if n.stale else "") + (" asleep" if n.awake_state == "sleep" else "")
            rows.append([n.name, presence, seen, n.state, ",".join(n.services) or "—", str(n.running), disk,
                         n.version])
        lines = table(["node", "presence", "last seen", "state", "services", "running", "disk", "version"], rows,
                      right={5})
        for i, line in enumerate(lines):
            node = data.nodes[i - 2] if i >= 2 else None
            bad = node is not None and (node.stale or node.presence == "lost"
                                        or node.disk_level in ("critical", "emergency"))
            warn = node is not None and (node.state == "draining" or node.presence == "offline"
                                         or node.disk_level == "warning")
            self.stdout.write(self.style.ERROR(line) if bad else self.style.WARNING(line) if warn else line)
        if not rows:
            self.stdout.write("(no node has registered; start manage.py runagent)")

        holding = [c for c in data.conditions if c.holds]
        self.heading("Governor conditions")
        if holding:
            for c in holding:
                until = f"until {timezone.localtime(c.expires_at):%Y-%m-%d %H:%M}" if c.expires_at else "until cleared"
                self.stdout.write(self.style.WARNING(
                    f"{c.name}: holds since {timezone.localtime(c.raised_at):%H:%M:%S} by {c.raised_by or 'api'},"
                    f" {until}{': ' + c.reason if c.reason else ''}"))
        else:
            self.stdout.write("(none holds)")

        self.heading("Recent failures")
        rows = [[timezone.localtime(f.at).strftime("%H:%M:%S") if f.at else "—", f.job_id[:8], f.task_key, f.service,
                 f.node, f"{f.attempt}/{f.max_attempts}" + (" DEAD" if f.final else ""),
                 (f.status + (f" exit {f.exit_code}" if f.exit_code is not None else "") + ": " + f.error)[:70]]
                for f in data.failures]
        for line in table(["at", "job", "task", "service", "node", "attempt", "error"], rows):
            self.stdout.write(line)
        if not rows:
            self.stdout.write("(no failed attempts among the newest)")
        self.stdout.write("")
        self.stdout.write(f"read in {took * 1000:.0f} ms")
