"""Counts that stay cheap on tables with millions of rows: exact up to a limit, then PostgreSQL's estimate."""

from __future__ import annotations

import json

from django.db.models import QuerySet

#: Up to this many rows a count is exact; beyond, it is the planner's estimate.
EXACT_COUNT_LIMIT = 10_000


def estimated_count(queryset: QuerySet, *, exact_up_to: int = EXACT_COUNT_LIMIT) -> tuple[int, bool]:
    """Return ``(count, estimated)``: the exact count when it is at most ``exact_up_to``, else the
    planner's row estimate (never below the rows already counted) and True.

    An exact ``COUNT(*)`` of a million rows costs more than the page that shows it; counting stops
    at ``exact_up_to + 1`` rows, which an index or the first heap pages answer.
    """
    capped = queryset.order_by()[: exact_up_to + 1].count()
    if capped <= exact_up_to:
        return capped, False
    try:
        plan = json.loads(queryset.order_by().explain(format="json"))
        return max(int(plan[0]["Plan"]["Plan Rows"]), capped), True
    except Exception:  # noqa: BLE001 - an estimate is optional; the capped count is still a lower bound
        return capped, True
