"""Small time-series charts for the dashboard: throughput, failures and queue latency over the last
hours, overall and per service, drawn as inline SVG (no script, no CDN).

The figures come from the newest attempts by primary key (as the dashboard's timings do), so the
read is bounded whatever the size of the history; a busy site whose sample does not reach back the
whole span says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from uuid import UUID

from django.utils import timezone
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

from accs_site.admin_kit import human_age
from accs_site.dbrouter import read_connection
from jobs.attempt_refs import refs_complete
from ops.overview import _tenant_filter
from ops.rates import range_ids

#: How far back the charts reach by default, and the width of one bar; a chosen range keeps the number of bars.
CHART_SPAN, CHART_BUCKET = timedelta(hours=6), timedelta(minutes=10)
CHART_BARS = int(CHART_SPAN / CHART_BUCKET)


def chart_span(since: datetime, until: datetime, *, bars: int = CHART_BARS) -> tuple[timedelta, timedelta]:
    """Return the span and bar width that draw ``since``..``until`` in ``bars`` bars (a bar at least a second)."""
    bucket = timedelta(seconds=max(1, round((until - since).total_seconds() / bars)))
    return bucket * bars, bucket
#: Attempts read at most (the newest by primary key).
CHART_SAMPLE = 50_000
#: Services drawn one by one (the busiest); the rest are in the overall charts.
CHART_SERVICES = 8

CHART_SQL = """
-- The newest attempts by primary key up to the span's last one (ops.rates.range_ids), then those
-- started inside the span, counted per bar (and per service): attempts started, those that failed or
-- timed out, and the median queue wait (claim time − the time the task became claimable for it).
-- The service, tenant and claimable time are the attempt's own copy of its task's (ATTEMPT_SOURCE: the
-- attempts alone), or its task's while some attempts lack the copy (TASK_SOURCE: one primary-key lookup
-- per attempt in the span, and a wait for the task's current attempt only, the one whose time it holds).
-- The sample is read twice (inlined: a materialized copy would hide its size from the planner,
-- which then hashes the whole task table instead of looking each task up by its key). Seconds are
-- date_part's double precision, not extract's numeric: numeric arithmetic and sorting on 50,000 rows
-- took a third of the statement.
WITH recent AS NOT MATERIALIZED (
    SELECT a.task_id, a.attempt_no, a.status, a.started_at, a.service_id, a.tenant_id, a.claimable_at
      FROM accs_attempt a WHERE a.id <= %(last)s ORDER BY a.id DESC LIMIT %(sample)s
), r AS (
    SELECT {service} AS service_id, r.status,
           floor(date_part('epoch', r.started_at - %(since)s) / %(bucket)s)::int AS bar,
           CASE WHEN {known} THEN date_part('epoch', r.started_at - {claimable}) END AS latency
      FROM recent r {join}
     WHERE r.started_at >= %(since)s AND {tenants}
)
SELECT service_id, bar, count(*), count(*) FILTER (WHERE status IN ('failed', 'timeout')),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY latency), min(bar) OVER (), (SELECT count(*) FROM recent)
  FROM r GROUP BY GROUPING SETS ((bar), (service_id, bar))
"""

#: Where the charts read an attempt's service, tenant and claimable time: its copy (jobs.attempt_refs) ...
ATTEMPT_SOURCE = {"service": "r.service_id", "tenant": "r.tenant_id", "join": "", "claimable": "r.claimable_at",
                  "known": "r.claimable_at <= r.started_at"}
#: ... or its task, while some attempts lack the copy.
TASK_SOURCE = {"service": "t.service_id", "tenant": "t.tenant_id", "join": "JOIN accs_task t ON t.id = r.task_id",
               "claimable": "t.next_attempt_at",
               "known": "r.attempt_no = t.attempt AND t.next_attempt_at <= r.started_at"}


def chart_sql(source: dict[str, str], tenants: str) -> str:
    """Return the charts' statement reading ``source`` (:data:`ATTEMPT_SOURCE` or :data:`TASK_SOURCE`)."""
    return CHART_SQL.format(tenants=tenants, **{k: v for k, v in source.items() if k != "tenant"})


@dataclass
class Series:
    """One service's (or, with ``service`` empty, every service's) figures per bar, oldest first."""

    service: str
    started: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    latency: list[float | None] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.started)


@dataclass
class Charts:
    """The dashboard's charts: the overall series, the busiest services', and the bars' times."""

    since: datetime
    bucket_seconds: int
    bars: int
    overall: Series
    services: list[Series]
    partial: bool  # the sample did not reach back to the start of the span

    @property
    def span_seconds(self) -> int:
        return self.bars * self.bucket_seconds


def chart_data(*, tenant_ids: set[UUID] | None = None, now: datetime | None = None,
               span: timedelta = CHART_SPAN, bucket: timedelta = CHART_BUCKET, sample: int = CHART_SAMPLE) -> Charts:
    """Count attempts, failures and queue latency per bar over ``span``, overall and per service."""
    now = now or timezone.now()
    bars = int(span / bucket)
    since = now - bars * bucket
    rows: list[tuple] = []
    with read_connection().cursor() as cur:
        cur.execute("SELECT id, key FROM accs_service")
        names = dict(cur.fetchall())
        if bounds := range_ids(cur, since=since, until=now):
            source = ATTEMPT_SOURCE if refs_complete(cur) else TASK_SOURCE
            where, params = _tenant_filter(source["tenant"], tenant_ids)
            cur.execute(chart_sql(source, where), {"sample": sample, "since": since, "last": bounds[1],
                                                   "bucket": bucket.total_seconds(), **params})
            rows = cur.fetchall()
    series: dict[int | None, Series] = {}
    first_bar, full_sample = bars, False
    for service_id, bar, started, failed, latency, earliest, read in rows:
        full_sample = read >= sample
        if not 0 <= bar < bars:
            continue
        first_bar = min(first_bar, earliest if earliest is not None else bars)
        s = series.setdefault(service_id, Series(service=names.get(service_id, "") if service_id else "",
                                                 started=[0] * bars, failed=[0] * bars, latency=[None] * bars))
        s.started[bar], s.failed[bar], s.latency[bar] = started, failed, latency
    overall = series.pop(None, Series(service="", started=[0] * bars, failed=[0] * bars, latency=[None] * bars))
    busiest = sorted(series.values(), key=lambda s: (-s.total, s.service))[:CHART_SERVICES]
    return Charts(since=since, bucket_seconds=int(bucket.total_seconds()), bars=bars, overall=overall,
                  services=sorted(busiest, key=lambda s: s.service), partial=bool(full_sample and first_bar > 0))


def bar_stamps(*, since: datetime, bucket_seconds: int, bars: int) -> list[str]:
    """Return each bar's start in the display zone, as precise as a bar is narrow (seconds for a quarter
    hour, the day for a week), HTML-escaped: computed once for every chart of the page."""
    stamp = "%H:%M:%S" if bucket_seconds < 60 else ("%Y-%m-%d %H:%M" if bucket_seconds >= 3600 else "%H:%M")
    return [escape(timezone.localtime(since + timedelta(seconds=i * bucket_seconds)).strftime(stamp))
            for i in range(bars)]


def bars_svg(values: list[float | None], *, since: datetime, bucket_seconds: int, colour: str, unit: str,
             width: int = 288, height: int = 44, label: str = "", stamps: list[str] | None = None) -> SafeString:
    """Draw values as bars (oldest left), each with a tooltip naming its time and value.

    ``stamps``: the bars' times from :func:`bar_stamps` (the page's charts share them). The markup is
    joined as plain strings, each text escaped once: through ``format_html`` per bar, the dashboard's
    900 bars took longer than all its queries.
    """
    top = max((v for v in values if v), default=0) or 1
    stamps = stamps or bar_stamps(since=since, bucket_seconds=bucket_seconds, bars=len(values))
    step = width / max(len(values), 1)
    bar_width, fill = f"{max(step - 1, 1):.1f}", escape(colour)

    def text(v: float | None) -> str:
        if v is None:
            return "—"
        return escape(human_age(v)) if unit == "s" else f"{v:.0f} {escape(unit)}"

    rects = []
    for i, v in enumerate(values):
        tall = (v or 0) / top * (height - 2)
        rects.append(f'<rect x="{i * step:.1f}" y="{height - tall:.1f}" width="{bar_width}" height="{tall:.1f}" '
                     f'fill="{fill}"><title>{stamps[i]} {text(v)}</title></rect>')
    return format_html('<svg xmlns="http://www.w3.org/2000/svg" class="accs-chart" width="{}" height="{}" '
                       'viewBox="0 0 {} {}" role="img" aria-label="{}">'
                       '<rect class="accs-chart-bg" width="{}" height="{}" fill="#f8fafc"/>'
                       '{}</svg>', width, height, width, height, label, width, height, mark_safe("".join(rects)))


def chart_rows(charts: Charts) -> list[dict[str, object]]:
    """Return one row per series (every service first) with its three charts drawn, for the template."""
    stamps = bar_stamps(since=charts.since, bucket_seconds=charts.bucket_seconds, bars=charts.bars)

    def draw(values: list, colour: str, unit: str, label: str) -> SafeString:
        return bars_svg(values, since=charts.since, bucket_seconds=charts.bucket_seconds, colour=colour, unit=unit,
                        label=label, stamps=stamps)

    rows = []
    for s in [charts.overall, *charts.services]:
        name = s.service or "every service"
        rows.append({
            "service": name, "started": s.total, "failed": sum(s.failed),
            "throughput": draw(s.started, "#2563eb", "attempts", f"attempts started per bar, {name}"),
            "failures": draw(s.failed, "#dc2626", "failed", f"attempts failed per bar, {name}"),
            "latency": draw(s.latency, "#d97706", "s", f"median queue latency per bar, {name}"),
        })
    return rows


__all__ = ["ATTEMPT_SOURCE", "CHART_BARS", "TASK_SOURCE", "Charts", "Series", "bar_stamps", "bars_svg", "chart_data",
           "chart_rows", "chart_span", "chart_sql"]
