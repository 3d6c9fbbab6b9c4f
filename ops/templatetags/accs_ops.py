"""Template filters for the operators' pages: status pills, ages, durations, percentages, short ids."""

from __future__ import annotations

from django import template
from django.utils.html import format_html

from accs_site.admin_kit import human_age, status_pill, when_html
from jobs import ids
from jobs.admin import attempt_pill as pill_of

register = template.Library()


@register.filter
def pill(status: str) -> str:
    """Render a status as a coloured pill (colours in admin/accs/_styles.html)."""
    return status_pill(status)


@register.filter
def attempt_pill(attempt) -> str:
    """Render an attempt's status pill; an interrupted one says whether an outage or a shutdown stopped it."""
    return pill_of(attempt)


@register.filter
def when(value, precision: str = "") -> str:
    """Render a moment the admin's one way (``2026-11-28 13:04:39 UTC``; ``when:"ms"`` adds milliseconds),
    shown in the operator's chosen zone by ops/static/ops/timezone.js."""
    return when_html(value, ms=precision == "ms")


@register.filter
def short_id(value: object) -> str:
    """Render a job's or task's id in its short form (the end of the id, see ``jobs.ids.short_id``)."""
    return ids.short_id(str(value))


@register.filter
def age(seconds: float | None) -> str:
    """Render seconds as a human duration (``42 s``, ``7 min``, ``3 h 5 min``)."""
    return human_age(seconds)


@register.filter
def percent(ratio: float | None) -> str:
    """Render a 0..1 ratio as a percentage."""
    return "—" if ratio is None else f"{ratio * 100:.0f} %"


@register.filter
def rate(per_minute: float | None) -> str:
    """Render a per-minute rate per hour, always (one unit beside another: no "/h" next to "/min"):
    ``1,240/h``, ``0.5/h`` under one an hour, ``0/h``."""
    per_hour = (per_minute or 0.0) * 60
    if per_hour and per_hour < 9.95:
        return f"{per_hour:.1f}/h"
    return f"{per_hour:,.0f}/h"


@register.filter
def attempt_duration(attempt) -> str:
    """Render how long a finished attempt took."""
    if not attempt.finished_at:
        return ""
    return human_age((attempt.finished_at - attempt.started_at).total_seconds())


DISK_COLOURS = {"ok": "#16a34a", "warning": "#f59e0b", "critical": "#ea580c", "emergency": "#dc2626"}


@register.filter
def disk_colour(level: str) -> str:
    """Return the bar colour of a disk level."""
    return DISK_COLOURS.get(level or "ok", "#64748b")


@register.filter
def share(part: int, whole: int) -> float:
    """Return ``part`` as a percentage of ``whole`` (for bar widths)."""
    return 0.0 if not whole else round(100.0 * part / whole, 2)


@register.simple_tag
def figure(n: int, url: str) -> str:
    """Render a count linking to the list it counts (a zero stays plain text)."""
    return format_html('<a href="{}">{}</a>', url, n) if n else "0"


STUCK_LABELS = {"no_agent": "no agent", "suspect": "suspect node", "draining": "draining", "labels": "labels",
                "governor": "governor", "paused": "paused",
                "at_cap": "at cap", "quarantined_host": "quarantine", "rate_limit": "rate limit",
                "key_rate_limit": "key rate", "key_cap": "key cap", "approval": "approval", "scheduled": "scheduled",
                "admission": "admission", "backoff": "backoff"}


@register.filter
def stuck_pill(reason: str) -> str:
    """Render a stuck reason's kind as a short pill."""
    return format_html('<span class="accs-pill accs-stuck-{}">{}</span>', reason, STUCK_LABELS.get(reason, reason))

