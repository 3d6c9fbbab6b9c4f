"""Which node, which service is sick: attempts that succeeded and failed per node and per service over a
time range (:mod:`ops.timerange`), on the dashboard, a node's page and a service's page.

The read is bounded whatever the range: the newest attempts of the range are read backwards through
``attempt_started_idx``, at most :data:`RATES_SAMPLE`; for one node, its attempts between the range's
first and last id (one probe of ``attempt_started_idx`` each) through ``attempt_node_idx``. A range
holding more says so (``partial``) and the figures are those of its newest attempts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode

from accs_site.dbrouter import read_connection
from jobs.attempt_refs import refs_complete
from ops.overview import _tenant_filter
from ops.timerange import current_range, picker
from tenants.scoping import tenant_ids_for

#: The range a node's or a service's page counts over until the operator picks one (the dashboard's).
PAGE_RANGE = "6h"

#: Attempts read at most for one table of rates.
RATES_SAMPLE = 50_000
#: Statuses counted as failures (an interrupted attempt is the agent's shutdown, retried: not the work's fault).
FAILED = ("failed", "timeout")

BOUNDS_SQL = """
-- The first and the last attempt started inside the range: one descent of attempt_started_idx each.
SELECT (SELECT a.id FROM accs_attempt a WHERE a.started_at >= %(since)s AND a.started_at < %(until)s
         ORDER BY a.started_at LIMIT 1),
       (SELECT a.id FROM accs_attempt a WHERE a.started_at >= %(since)s AND a.started_at < %(until)s
         ORDER BY a.started_at DESC LIMIT 1)
"""

#: Every node: the range's newest attempts by start, attempt_started_idx read backwards from the
#: range's end, stopping at the sample.
EVERY_NODE = ("a.started_at >= %(since)s AND a.started_at < %(until)s", "a.started_at DESC")
#: One node: its attempts between the range's first and last id, attempt_node_idx read backwards (the
#: node's rows only, however many other nodes ran in the range).
ONE_NODE = ("a.node = %(node)s AND a.id BETWEEN %(lo)s AND %(hi)s", "a.id DESC")

RATES_SQL = """
-- The range's newest attempts (see EVERY_NODE and ONE_NODE), at most the sample, then counted per node
-- and per service (a grouping set each). The service and tenant are the attempt's own copy of its task's
-- (ATTEMPT_REFS: the attempts alone, heap rows in start order), or its task's while some attempts lack the copy
-- (TASK_REFS: one primary-key lookup per attempt; inlined, not materialized, so the planner sees it).
WITH recent AS NOT MATERIALIZED (
    SELECT a.node, a.status, {refs} FROM accs_attempt a {join} WHERE {where} ORDER BY {order} LIMIT %(sample)s
)
SELECT GROUPING(r.node), r.node, r.service_id,
       count(*) FILTER (WHERE r.status = 'succeeded'),
       count(*) FILTER (WHERE r.status IN ('failed', 'timeout')),
       count(*), (SELECT count(*) FROM recent)
  FROM recent r
 WHERE {tenants} {service}
 GROUP BY GROUPING SETS ((r.node), (r.service_id))
"""

#: Where an attempt's service and tenant are read: the attempt's copy (jobs.attempt_refs), or its task.
ATTEMPT_REFS = {"refs": "a.service_id, a.tenant_id", "join": ""}
TASK_REFS = {"refs": "t.service_id, t.tenant_id", "join": "JOIN accs_task t ON t.id = a.task_id"}


def refs_source(cur: Any) -> dict[str, str]:
    """The attempts' own service and tenant once every attempt carries them, else their tasks'."""
    return ATTEMPT_REFS if refs_complete(cur) else TASK_REFS


@dataclass
class Rate:
    """Attempts of one node or service in the range: succeeded, failed or timed out, and all of them."""

    name: str
    succeeded: int
    failed: int
    total: int
    url: str = ""  # the attempts list of this node or service, in the range

    @property
    def other(self) -> int:
        """Attempts still running, canceled, blocked or interrupted."""
        return self.total - self.succeeded - self.failed

    @property
    def success_rate(self) -> float | None:
        """Succeeded out of those that ended either way (None: none ended yet)."""
        ended = self.succeeded + self.failed
        return self.succeeded / ended if ended else None

    @property
    def failure_rate(self) -> float | None:
        ended = self.succeeded + self.failed
        return self.failed / ended if ended else None

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "succeeded": self.succeeded, "failed": self.failed, "total": self.total,
                "success_rate": self.success_rate}


@dataclass
class Rates:
    """Rates per node and per service over ``since``..``until``; ``partial``: only the newest attempts."""

    since: datetime
    until: datetime
    nodes: list[Rate]
    services: list[Rate]
    partial: bool


def range_ids(cur: Any, *, since: datetime, until: datetime) -> tuple[int, int] | None:
    """Return the lowest and highest id of the attempts started in ``since``..``until`` (None: there are none)."""
    cur.execute(BOUNDS_SQL, {"since": since, "until": until})
    lo, hi = cur.fetchone()
    return None if lo is None else (min(lo, hi), max(lo, hi))


def attempts_url(*, node: str = "", service_id: int | None = None, status: str = "",
                 range_params: dict[str, str] | None = None) -> str:
    """Return the attempts list filtered to a node or a service (and a status), in the given range."""
    params = {**({"node": node} if node else {}), **({"service": str(service_id)} if service_id else {}),
              **({"status__exact": status} if status else {}), **(range_params or {})}
    return f"{reverse('admin:jobs_attempt_changelist')}?{urlencode(params)}"


def rates(*, since: datetime, until: datetime, tenant_ids: set[UUID] | None = None, node: str = "",
          service_id: int | None = None, sample: int = RATES_SAMPLE,
          range_params: dict[str, str] | None = None) -> Rates:
    """Count the attempts started in ``since``..``until`` that succeeded and failed, per node and per service.

    ``node`` or ``service_id`` narrow the count to one node or service (their pages); ``tenant_ids``
    to the viewer's tenants (None: every tenant).
    """
    if since >= until:
        raise ValueError(f"a range must start before it ends: {since.isoformat()} is not before {until.isoformat()}")
    if sample < 1:
        raise ValueError(f"the sample must be at least one attempt, got {sample}")
    where, params = _tenant_filter("r.tenant_id", tenant_ids)
    with read_connection().cursor() as cur:
        bounds = range_ids(cur, since=since, until=until)
        if bounds is None:
            return Rates(since=since, until=until, nodes=[], services=[], partial=False)
        cur.execute("SELECT id, key FROM accs_service")
        names = dict(cur.fetchall())
        among, order = ONE_NODE if node else EVERY_NODE
        cur.execute(RATES_SQL.format(tenants=where, where=among, order=order, **refs_source(cur),
                                     service="AND r.service_id = %(service)s" if service_id else ""),
                    {"lo": bounds[0], "hi": bounds[1], "since": since, "until": until, "sample": sample,
                     "node": node, "service": service_id, **params})
        rows = cur.fetchall()
    nodes, services = [], []
    read = rows[0][-1] if rows else 0  # the attempts the sample read (the same on every row)
    for by_service, node_name, sid, ok, bad, total, _read in rows:
        if by_service:
            services.append(Rate(names.get(sid, str(sid)), ok, bad, total,
                                 url=attempts_url(service_id=sid, range_params=range_params)))
        else:
            nodes.append(Rate(node_name or "(no node)", ok, bad, total,
                              url=attempts_url(node=node_name, range_params=range_params) if node_name else ""))

    def worst_first(r: Rate) -> tuple[float, int, str]:
        return (-(r.failure_rate or 0.0), -r.total, r.name)

    return Rates(since=since, until=until, nodes=sorted(nodes, key=worst_first),
                 services=sorted(services, key=worst_first), partial=read >= sample)


def page_rates(request: HttpRequest, *, node: str = "", service_id: int | None = None) -> dict[str, Any]:
    """Return a node's or a service's page context: its rates over the viewer's range, and the range's picker."""
    now = timezone.now()
    chosen = current_range(request, default=PAGE_RANGE, now=now)
    since, until = chosen.bounded(now=now)
    found = rates(since=since, until=until, tenant_ids=tenant_ids_for(request.user), node=node,
                  service_id=service_id, range_params=chosen.params())
    return {"rates": found, "range": chosen, "picker": picker(request, chosen)}


__all__ = ["page_rates", "RATES_SAMPLE", "Rate", "Rates", "attempts_url", "range_ids", "rates"]
