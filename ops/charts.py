"""Small time-series charts for the dashboard: throughput, failures and queue latency over the last
hours, overall and per service, drawn as inline SVG (no script, no CDN).

The figures come from the attempts rolled up per 20 minutes (jobs.attempt_rollup) for the bars that are
whole rollup buckets and that the builder has folded, and from the attempts themselves for the rest (the
last minutes, the attempts still running, and every bar of a range shorter than a few hours), so the
read is bounded by the span's buckets, not its attempts. A raw part is read up to a sample of its newest
attempts; a busy site whose sample does not reach back that whole part says so. The median queue wait
of a bar holding folded attempts is estimated from a histogram (jobs.attempt_rollup.wait_median).
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
from jobs import attempt_rollup as rollup
from jobs.attempt_refs import refs_complete
from ops.overview import _tenant_filter

#: How far back the charts reach by default, and the width of one bar; a chosen range keeps the number of bars.
CHART_SPAN, CHART_BUCKET = timedelta(hours=6), timedelta(minutes=10)
CHART_BARS = int(CHART_SPAN / CHART_BUCKET)


def chart_span(since: datetime, until: datetime, *, bars: int = CHART_BARS) -> tuple[timedelta, timedelta]:
    """Return the span and bar width that draw ``since``..``until`` in ``bars`` bars (a bar at least a second;
    one at least a rollup bucket wide is a whole number of them, so that it is read from the rollup)."""
    bucket = timedelta(seconds=max(1, round((until - since).total_seconds() / bars)))
    if bucket >= rollup.SERVICE_GRID:
        bucket = max(1, round(bucket / rollup.SERVICE_GRID)) * rollup.SERVICE_GRID
    return bucket * bars, bucket
#: Attempts read raw at most in each part of the span the rollup does not cover (the newest).
CHART_SAMPLE = 50_000
#: Services drawn one by one (the busiest); the rest are in the overall charts.
CHART_SERVICES = 8

CHART_SQL = """
-- The span's attempts per bar (and per service): attempts started, those that failed or timed out, and
-- the median queue wait (claim time − the time the task became claimable for it). Whole buckets the
-- builder has folded come from accs_attempt_rollup (jobs.attempt_rollup), the rest from the attempts
-- themselves (the raw CTE: the tail since the mark, the pending attempts, or the whole span when its bars
-- do not fall on the rollup's buckets), in one statement so that a fold cannot commit in between. A raw
-- attempt's service, tenant and claimable time are its own copy of its task's (ATTEMPT_SOURCE), or its
-- task's while some attempts lack the copy (TASK_SOURCE). Seconds are date_part's double precision, not
-- extract's numeric: numeric arithmetic and sorting on 50,000 rows took a third of the statement.
WITH {zone}, {raw}, r AS (
    SELECT service_id, status, part, latency, {wait_bin} AS wait_bin,
           floor(date_part('epoch', started_at - %(since)s) / %(bucket)s)::int AS bar
      FROM raw
), counted AS (
    SELECT service_id, bar, count(*) AS attempts, count(*) FILTER (WHERE status IN ('failed', 'timeout')) AS failed,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY latency) AS median, false AS rolled, {raw_bins}
      FROM r GROUP BY GROUPING SETS ((bar), (service_id, bar))
    UNION ALL
    SELECT service_id, bar, sum(attempts), sum(failed), NULL, true, {rolled_bins}
      FROM (SELECT u.*, floor(date_part('epoch', u.bucket - %(since)s) / %(bucket)s)::int AS bar
              FROM accs_attempt_rollup u
             WHERE u.bucket >= %(lo)s AND u.bucket < (SELECT hi FROM zone) AND {rolled_tenants}) u
     GROUP BY GROUPING SETS ((bar), (service_id, bar))
)
SELECT c.*, (SELECT max(n) FROM (SELECT count(*) AS n FROM raw GROUP BY part) p) FROM counted c
"""

#: Where the charts read a raw attempt's service, tenant and claimable time: its copy (jobs.attempt_refs) ...
ATTEMPT_SOURCE = {"service": "a.service_id", "tenant": "a.tenant_id", "join": "", "claimable": "a.claimable_at"}
#: ... or its task, while some attempts lack the copy (the task holds the time for its last attempt only).
TASK_SOURCE = {"service": "t.service_id", "tenant": "t.tenant_id", "join": "JOIN accs_task t ON t.id = a.task_id",
               "claimable": "CASE WHEN a.attempt_no = t.attempt THEN t.next_attempt_at END"}


def chart_sql(source: dict[str, str], tenants: str, rolled_tenants: str) -> str:
    """Return the charts' statement reading raw attempts through ``source`` (:data:`ATTEMPT_SOURCE` or
    :data:`TASK_SOURCE`), ``tenants`` and ``rolled_tenants`` restricting the raw rows and the rollup's."""
    columns = (f"{source['service']} AS service_id, a.status, a.started_at, "
               f"{rollup.WAIT_SQL.format(claimable=source['claimable'])} AS latency, {{part}} AS part")
    raw = rollup.raw_sql(columns, join=source["join"], where=f"AND {tenants}")
    return CHART_SQL.format(zone=rollup.ZONE_SQL, raw=raw,
                            wait_bin=rollup.WAIT_BIN_SQL.format(wait="latency"), raw_bins=rollup.wait_bin_counts(),
                            rolled_bins=", ".join(f"sum({c})" for c in rollup.WAIT_COLUMNS),
                            rolled_tenants=rolled_tenants)


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
    partial: bool  # a part of the span read raw held more attempts than the sample: its newest only

    @property
    def span_seconds(self) -> int:
        return self.bars * self.bucket_seconds


@dataclass
class _Bar:
    attempts: int = 0
    failed: int = 0
    median: float | None = None  # the raw attempts' exact median, while none of the bar is rolled up
    rolled: bool = False
    bins: list[int] = field(default_factory=lambda: [0] * rollup.WAIT_BINS)

    def add(self, attempts: int, failed: int, median: float | None, rolled: bool, bins: tuple[int, ...]) -> None:
        self.attempts, self.failed = self.attempts + attempts, self.failed + failed
        self.median, self.rolled = (median if not rolled else self.median), self.rolled or rolled
        self.bins = [a + b for a, b in zip(self.bins, bins, strict=True)]

    @property
    def latency(self) -> float | None:
        # Once a bar holds folded attempts, its median comes from the histogram of all of them.
        return rollup.wait_median(self.bins) if self.rolled else self.median


def chart_data(*, tenant_ids: set[UUID] | None = None, now: datetime | None = None,
               span: timedelta = CHART_SPAN, bucket: timedelta = CHART_BUCKET, sample: int = CHART_SAMPLE) -> Charts:
    """Count attempts, failures and queue latency per bar over ``span``, overall and per service.

    Bars a whole number of rollup buckets wide (:data:`jobs.attempt_rollup.SERVICE_GRID`) end on the
    bucket boundary at or after ``now``, so that each bar is whole buckets; narrower ones end at ``now``.
    """
    now = now or timezone.now()
    bars = int(span / bucket)
    aligned = bucket % rollup.SERVICE_GRID == timedelta(0)
    until = rollup.ceil_to(now, rollup.SERVICE_GRID) if aligned else now
    since = until - bars * bucket
    rows: list[tuple] = []
    with read_connection().cursor() as cur:
        cur.execute("SELECT id, key FROM accs_service")
        names = dict(cur.fetchall())
        source = ATTEMPT_SOURCE if refs_complete(cur) else TASK_SOURCE
        where, params = _tenant_filter(source["tenant"], tenant_ids)
        rolled_where, _same = _tenant_filter("u.tenant_id", tenant_ids)
        cur.execute(chart_sql(source, where, rolled_where),
                    {"sample": sample, "since": since, "until": until, "bucket": bucket.total_seconds(), **params,
                     **rollup.zone(since, until, rollup.SERVICE_GRID, aligned=aligned), **rollup.fold_params()})
        rows = cur.fetchall()
    found: dict[tuple[int | None, int], _Bar] = {}
    full_sample = False
    for service_id, bar, attempts, failed, median, rolled, *rest in rows:
        *bins, read = rest
        full_sample = full_sample or (read or 0) >= sample
        if 0 <= bar < bars:
            found.setdefault((service_id, bar), _Bar()).add(attempts, failed, median, rolled, tuple(bins))
    series: dict[int | None, Series] = {}
    for (service_id, bar), b in found.items():
        s = series.setdefault(service_id, Series(service=names.get(service_id, "") if service_id else "",
                                                 started=[0] * bars, failed=[0] * bars, latency=[None] * bars))
        s.started[bar], s.failed[bar], s.latency[bar] = b.attempts, b.failed, b.latency
    overall = series.pop(None, Series(service="", started=[0] * bars, failed=[0] * bars, latency=[None] * bars))
    busiest = sorted(series.values(), key=lambda s: (-s.total, s.service))[:CHART_SERVICES]
    return Charts(since=since, bucket_seconds=int(bucket.total_seconds()), bars=bars, overall=overall,
                  services=sorted(busiest, key=lambda s: s.service), partial=full_sample)


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
