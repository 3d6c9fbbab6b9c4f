"""Template filters for the job page and attempt logs: short checksums (times: ``accs_ops.when``)."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def short_checksum(checksum: str) -> str:
    """Shorten ``sha256:<hex>`` to its algorithm and first 12 hex digits (the title shows it whole)."""
    algorithm, _, digest = (checksum or "").partition(":")
    return f"{algorithm}:{digest[:12]}…" if digest and len(digest) > 12 else checksum
