"""The terminal picture of ``manage.py accs_status``: the dashboard's figures as readable tables.

:func:`status_lines` turns an :class:`~ops.overview.Overview` into the lines the command prints
(the command is a thin shell: options, the refresh loop, errors), so tests read the picture
without a terminal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from django.core.management.color import Style, no_style
from django.db import connection

from accs_site.admin_kit import human_age, when_text
from accs_site.version import VERSION
from jobs.ids import short_id
from ops.overview import Overview


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: frozenset[int] | set[int] = frozenset()
          ) -> list[str]:
    """Format rows as aligned columns (``right`` holds the indexes of right-aligned columns)."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(headers), line(["─" * w for w in widths]), *[line(r) for r in rows]]


def _secs(value: float | None) -> str:
    return human_age(value)


def database_label() -> str:
    """Name the database the picture was read from: ``accs on db.example:5432``."""
    db = connection.settings_dict
    return f"{db['NAME']} on {db['HOST'] or 'local socket'}:{db['PORT'] or 5432}"


def status_lines(data: Overview, *, took: float, database: str = "", style: Style | None = None) -> list[str]:
    """Return the status picture: summary, why work is stuck, queues, services, nodes, conditions, failures.

    ``took`` is how long reading the figures took; ``style`` colours headings, warnings and errors
    (Django's terminal style; none by default).
    """
    style = style or no_style()
    return [*_summary(data, style, database=database), *_stuck(data, style), *_tenants(data, style),
            *_services(data, style), *_nodes(data, style), *_paused_tenants(data, style), *_conditions(data, style),
            *_failures(data, style, took=took)]


def _heading(out: Callable[[str], None], style: Style, text: str) -> None:
    out("")
    out(style.MIGRATE_HEADING(text))


def _summary(data: Overview, style: Style, *, database: str) -> list[str]:
    """The title and the one-line totals and timings."""
    lines: list[str] = []
    out = lines.append
    out(style.MIGRATE_HEADING(f"ACCS {VERSION} status at {when_text(data.generated_at)}"
                              f" — database {database}"))
    t, s = data.totals, data.stats.overall
    summary = (f"jobs: not started {t.jobs_queued} · awaiting approval {t.awaiting_approval}"
               f" · waiting {t.jobs_waiting} · running {t.jobs_running} · failed 24 h {t.failed_24h}"
               f" | tasks: queued {t.queued} · running {t.running} · retrying {t.retrying} · waiting {t.waiting}"
               f" · dead letter {t.dead_letter} · oldest queued {_secs(t.oldest_queued_age)}")
    out(style.ERROR(summary) if t.dead_letter else summary)
    out(f"last {_secs(data.stats.window_seconds)}: {s.finished} attempts finished"
        f" ({s.per_minute:.1f}/min), {s.failed} failed · queue latency p50 {_secs(s.latency_p50)}"
        f" p95 {_secs(s.latency_p95)} · run time p50 {_secs(s.run_p50)} p95 {_secs(s.run_p95)}")
    return lines


def _stuck(data: Overview, style: Style) -> list[str]:
    """Why queued work is not moving, each reason with its fix."""
    lines: list[str] = []
    out = lines.append
    _heading(out, style, "Why isn't it moving?")
    for r in data.stuck:
        out(style.WARNING(f"{r.message}" + (f" — {r.detail}" if r.detail else "")))
    if not data.stuck:
        out("(nothing stuck: every service with queued tasks has a live agent and room)")
    return lines


def _tenants(data: Overview, style: Style) -> list[str]:
    """Jobs and tasks per tenant."""
    lines: list[str] = []
    out = lines.append
    _heading(out, style, "Queues per tenant (jobs | tasks)")
    rows = [[c.tenant, str(c.jobs_queued), str(c.awaiting_approval), str(c.jobs_waiting), str(c.jobs_running),
             str(c.failed_24h), str(c.waiting), str(c.queued), str(c.running), str(c.retrying), str(c.dead_letter),
             _secs(c.oldest_queued_age)] for c in data.tenants]
    for line in table(["tenant", "jobs: not started", "approval", "waiting", "running", "failed 24h",
                       "tasks: waiting", "queued", "running", "retrying", "dead letter", "oldest"], rows,
                      right=set(range(1, 12))):
        out(line)
    return lines


def _services(data: Overview, style: Style) -> list[str]:
    """Queue depth and timings per service."""
    lines: list[str] = []
    out = lines.append
    _heading(out, style, "Services")
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
        out(line)
    if not rows:
        out("(nothing queued, running or finished recently)")
    return lines


def _nodes(data: Overview, style: Style) -> list[str]:
    """Every node: presence (suspect ones flagged), state, services, disk."""
    lines: list[str] = []
    out = lines.append
    _heading(out, style, f"Nodes (an online node is SUSPECT after {_secs(data.stale_after)} without a heartbeat)")
    rows = []
    for n in data.nodes:
        seen = "never" if n.seen_ago is None else f"{_secs(n.seen_ago)} ago"
        disk = "—" if n.disk_used_pct is None else f"{n.disk_used_pct:.0f} % {n.disk_level}"
        presence = n.presence + (" SUSPECT" if n.stale else "") + (" asleep" if n.awake_state == "sleep" else "")
        rows.append([n.name, presence, seen, n.state, ",".join(n.services) or "—", str(n.running), disk,
                     n.version])
    node_lines = table(["node", "presence", "last seen", "state", "services", "running", "disk", "version"], rows,
                  right={5})
    for i, line in enumerate(node_lines):
        node = data.nodes[i - 2] if i >= 2 else None
        bad = node is not None and (node.stale or node.presence == "lost"
                                    or node.disk_level in ("critical", "emergency"))
        warn = node is not None and (node.state == "draining" or node.presence == "offline"
                                     or node.disk_level == "warning")
        out(style.ERROR(line) if bad else style.WARNING(line) if warn else line)
    if not rows:
        out("(no node has registered; start manage.py runagent)")
    older = [f"{n.name} ({n.version or 'no release'})" for n in data.nodes
             if n.presence == "online" and n.version != VERSION]
    if older:
        out(style.WARNING(f"online on another release than this code ({VERSION}): {', '.join(older)}"))
    return lines


def _paused_tenants(data: Overview, style: Style) -> list[str]:
    """The tenants an operator paused (nothing when none is): no agent claims their tasks."""
    lines: list[str] = []
    if not data.paused_tenants:
        return lines
    _heading(lines.append, style, "Paused tenants")
    for p in data.paused_tenants:
        until = f"until {when_text(p.expires_at)}" if p.expires_at else "until resumed"
        since = f" at {when_text(p.raised_at)}" if p.raised_at else ""
        lines.append(style.WARNING(f"{p.tenant}: paused by {p.raised_by or 'api'}{since}, {until}: {p.reason}"))
    return lines


def _conditions(data: Overview, style: Style) -> list[str]:
    """The governor conditions that hold."""
    lines: list[str] = []
    out = lines.append
    _heading(out, style, "Governor conditions")
    holding = [c for c in data.conditions if c.holds]
    if holding:
        for c in holding:
            until = f"until {when_text(c.expires_at)}" if c.expires_at else "until cleared"
            out(style.WARNING(
                f"{c.name}: holds since {when_text(c.raised_at) if c.raised_at else '—'} by {c.raised_by or 'api'},"
                f" {until}{': ' + c.reason if c.reason else ''}"))
    else:
        out("(none holds)")
    return lines


def _failures(data: Overview, style: Style, *, took: float) -> list[str]:
    """The newest failed attempts, and how long the picture took to read."""
    lines: list[str] = []
    out = lines.append
    _heading(out, style, "Recent failures")
    rows = [[when_text(f.at) if f.at else "—", short_id(f.job_id), f.task_key, f.service,
             f.node, f"{f.attempt}/{f.max_attempts}" + (" DEAD" if f.final else ""),
             f.said[:70]]
            for f in data.failures]
    for line in table(["at", "job", "task", "service", "node", "attempt", "error"], rows):
        out(line)
    if not rows:
        out("(no failed attempts among the newest)")
    out("")
    out(f"read in {took * 1000:.0f} ms")
    return lines
