"""Template filters for the job page and attempt logs: times to the millisecond, short checksums."""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils import timezone

register = template.Library()


@register.filter
def ms_time(value: datetime | None) -> str:
    """Render a time of day in the site's time zone to the millisecond (``11:04:39.123``)."""
    if value is None:
        return ""
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return f"{value:%H:%M:%S}.{value.microsecond // 1000:03d}"


@register.filter
def short_checksum(checksum: str) -> str:
    """Shorten ``sha256:<hex>`` to its algorithm and first 12 hex digits (the title shows it whole)."""
    algorithm, _, digest = (checksum or "").partition(":")
    return f"{algorithm}:{digest[:12]}…" if digest and len(digest) > 12 else checksum
