"""Which node, which service is sick: attempts that succeeded and failed per node and per service over a
time range (:mod:`ops.timerange`), on the dashboard, a node's page and a service's page.

The read is bounded by the range's hours, not its attempts: the whole hours the builder has folded are
read from the rollup (jobs.attempt_rollup), and only the rest from the attempts, backwards through
``attempt_started_idx``: the range's first part hour and the tail since the mark (a few minutes), each
at most :data:`RATES_SAMPLE`, and the attempts that were still running when their hour was folded. A
raw part holding more says so (``partial``) and the figures are those of its newest attempts.
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
from jobs.attempt_rollup import NODE_GRID, ZONE_SQL, raw_sql, zone
from ops.overview import _tenant_filter
from ops.timerange import current_range, picker
from tenants.scoping import tenant_ids_for

#: The range a node's or a service's page counts over until the operator picks one (the dashboard's).
PAGE_RANGE = "6h"

#: Attempts read raw at most in each part of the range the rollup does not cover (the newest).
RATES_SAMPLE = 50_000
#: Statuses counted as failures (an interrupted attempt is the agent's shutdown, retried: not the work's fault).
FAILED = ("failed", "timeout")

RATES_SQL = """
-- The range's attempts counted per node and per service (a grouping set each): the whole hours the builder
-- has folded from accs_attempt_node_rollup (jobs.attempt_rollup), the rest from the attempts themselves
-- (the raw CTE: the range's first part hour, the tail since the mark, the attempts pending in between), in
-- one statement so that a fold cannot commit in between. A raw attempt's service and tenant are its own
-- copy of its task's (ATTEMPT_REFS), or its task's while some attempts lack the copy (TASK_REFS).
WITH {zone}, {raw}, counted AS (
    SELECT node, service_id, count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE status IN ('failed', 'timeout')) AS failed, count(*) AS attempts
      FROM raw GROUP BY node, service_id
    UNION ALL
    SELECT u.node, u.service_id, sum(u.succeeded), sum(u.failed), sum(u.attempts)
      FROM accs_attempt_node_rollup u
     WHERE u.bucket >= %(lo)s AND u.bucket < (SELECT hi FROM zone) AND {rolled}
     GROUP BY u.node, u.service_id
)
SELECT GROUPING(c.node), c.node, c.service_id, sum(c.succeeded)::bigint, sum(c.failed)::bigint, sum(c.attempts)::bigint,
       (SELECT max(n) FROM (SELECT count(*) AS n FROM raw GROUP BY part) p)
  FROM counted c
 GROUP BY GROUPING SETS ((c.node), (c.service_id))
"""

#: Where a raw attempt's service and tenant are read: the attempt's copy (jobs.attempt_refs), or its task.
ATTEMPT_REFS = {"service": "a.service_id", "tenant": "a.tenant_id", "join": ""}
TASK_REFS = {"service": "t.service_id", "tenant": "t.tenant_id", "join": "JOIN accs_task t ON t.id = a.task_id"}


def refs_source(cur: Any) -> dict[str, str]:
    """The attempts' own service and tenant once every attempt carries them, else their tasks'."""
    return ATTEMPT_REFS if refs_complete(cur) else TASK_REFS


def rates_sql(refs: dict[str, str], *, tenant_ids: set[UUID] | None, node: bool, service: bool) -> tuple[str, dict]:
    """Return the rates' statement reading raw attempts through ``refs`` and its tenants' parameters;
    ``node`` and ``service`` narrow both parts to ``%(node)s`` and ``%(service)s``."""

    def where(node_column: str, service_column: str, tenant_column: str) -> tuple[str, dict]:
        tenants, params = _tenant_filter(tenant_column, tenant_ids)
        return " AND ".join([tenants, *([f"{node_column} = %(node)s"] if node else []),
                             *([f"{service_column} = %(service)s"] if service else [])]), params

    raw_where, params = where("a.node", refs["service"], refs["tenant"])
    rolled, _same = where("u.node", "u.service_id", "u.tenant_id")
    columns = f"a.node, a.status, {refs['service']} AS service_id, {{part}} AS part"
    return RATES_SQL.format(zone=ZONE_SQL, raw=raw_sql(columns, join=refs["join"], where=f"AND {raw_where}"),
                            rolled=rolled), params


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
    with read_connection().cursor() as cur:
        cur.execute("SELECT id, key FROM accs_service")
        names = dict(cur.fetchall())
        sql, params = rates_sql(refs_source(cur), tenant_ids=tenant_ids, node=bool(node), service=bool(service_id))
        cur.execute(sql, {"since": since, "until": until, "sample": sample, "node": node, "service": service_id,
                          **zone(since, until, NODE_GRID), **params})
        rows = cur.fetchall()
    nodes, services = [], []
    read = rows[0][-1] or 0 if rows else 0  # the most a raw part read (the same on every row)
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


__all__ = ["page_rates", "RATES_SAMPLE", "Rate", "Rates", "attempts_url", "rates", "rates_sql"]
