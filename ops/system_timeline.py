"""The system timeline: what happened to the whole system in a window, beside a job's own timeline.

Four kinds of entry, each linking to what it concerns:

* ``outage``: PostgreSQL was out of reach (``accs_outage``, recorded by :mod:`jobs.pulse`), with how
  long it lasted ("database reachable again after 50.5 s"); links to the outage's admin page.
* ``leader``: another builder took the leadership (``accs_leader_term``); links to the term's page.
* ``deploy``: a leadership term whose holder names another release than the term before it (builders
  write their release in their holder, :func:`jobs.leader.default_holder`), or a node whose agent
  started on another release than the node last reported (``accs_node_deploy``, written by
  :func:`nodes.api.register_node`); links to the term's or the node's page.
* ``pause`` / ``resume`` / ``condition``: a service or a tenant paused or resumed, a governor condition raised
  (``accs_governor_condition``: one row per condition, its last raise and clear); links to the condition.

Each query reads an index (outages by their end, terms and node deploys by their start) or the small
conditions table, and every list is capped at ``limit`` entries, so the dashboard and the job page stay
fast however long the history.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.urls import reverse

from accs_site.admin_kit import human_age
from jobs.leader import holder_version
from jobs.pulse import outage_words
from tenants.models import Tenant
from workflows.governor import paused_service_key, paused_tenant_id
from workflows.models import GovernorCondition

#: Entries a timeline shows at most (the newest).
SYSTEM_TIMELINE_LIMIT = 50

# Outages that overlap the window, newest first (outage_ended_idx: those that ended after it began).
OUTAGES_SQL = """
SELECT id, began_at, ended_at, cause FROM accs_outage
 WHERE ended_at >= %(since)s AND began_at <= %(until)s
 ORDER BY ended_at DESC LIMIT %(limit)s
"""
# Terms that began in the window, and the one before it (its release tells a deploy), by
# leader_term_acquired_idx.
TERMS_SQL = """
(SELECT fence, holder, acquired_at FROM accs_leader_term
  WHERE acquired_at >= %(since)s AND acquired_at <= %(until)s ORDER BY acquired_at DESC LIMIT %(limit)s)
UNION ALL
(SELECT fence, holder, acquired_at FROM accs_leader_term
  WHERE acquired_at < %(since)s ORDER BY acquired_at DESC LIMIT 1)
ORDER BY acquired_at
"""

# Nodes' deploys in the window, newest first (node_deploy_started_idx).
NODE_DEPLOYS_SQL = """
SELECT node_name, version, previous_version, started_at FROM accs_node_deploy
 WHERE started_at >= %(since)s AND started_at <= %(until)s
 ORDER BY started_at DESC LIMIT %(limit)s
"""


@dataclass(frozen=True)
class SystemEntry:
    """One line of the system timeline: when, what kind, what happened, the page it concerns."""

    at: datetime
    kind: str
    text: str
    url: str


def system_timeline(*, since: datetime, until: datetime, limit: int = SYSTEM_TIMELINE_LIMIT) -> list[SystemEntry]:
    """Return the system's outages, leader changes, deploys and pauses between ``since`` and ``until``,
    newest first, at most ``limit``."""
    if until < since:
        raise ValueError(f"a timeline's window must not end ({until}) before it begins ({since})")
    window = {"since": since, "until": until, "limit": limit}
    entries = [*_outages(window), *_terms(window), *_node_deploys(window), *_conditions(since=since, until=until)]
    return sorted(entries, key=lambda e: e.at, reverse=True)[:limit]


def _read(sql: str, window: dict) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, window)
        return cur.fetchall()


def _outages(window: dict) -> list[SystemEntry]:
    rows = _read(OUTAGES_SQL, window)
    return [SystemEntry(at=began, kind="outage", url=reverse("admin:jobs_outage_change", args=[pk]),
                        text=f"PostgreSQL out of reach ({cause}): {outage_words(began_at=began, ended_at=ended)}")
            for pk, began, ended, cause in rows]


def _terms(window: dict) -> list[SystemEntry]:
    rows = _read(TERMS_SQL, window)  # oldest first; the first may be the term before the window
    entries, before = [], None
    for fence, holder, acquired in rows:
        if acquired >= window["since"]:
            url = reverse("admin:jobs_leaderterm_change", args=[fence])
            entries.append(SystemEntry(at=acquired, kind="leader", url=url,
                                       text=f"builder {holder} leads (term {fence})"))
            if before is not None and holder_version(holder) != holder_version(before):
                entries.append(SystemEntry(at=acquired, kind="deploy", url=url,
                                           text=f"builders run ACCS {release_words(holder_version(holder))} "
                                                f"(was {release_words(holder_version(before))})"))
        before = holder
    return entries


def _node_deploys(window: dict) -> list[SystemEntry]:
    rows = _read(NODE_DEPLOYS_SQL, window)
    return [SystemEntry(at=at, kind="deploy", url=reverse("admin:nodes_node_change", args=[node]),
                        text=f"node {node} runs ACCS {release_words(version)} (was {release_words(previous)})")
            for node, version, previous, at in rows]


def release_words(version: str) -> str:
    """Name a release a holder carries ("" from builders that wrote none)."""
    return version or "0.1.0 or older"


def _conditions(*, since: datetime, until: datetime) -> list[SystemEntry]:
    # One row per condition (a few dozen): read whole.
    entries = []
    conditions = list(GovernorCondition.objects.only("pk", "name", "reason", "raised_at", "cleared_at", "raised_by"))
    tenants = dict(Tenant.objects.filter(pk__in=[t for c in conditions if (t := paused_tenant_id(c.name))])
                   .values_list("pk", "slug"))
    for c in conditions:
        url = reverse("admin:workflows_governorcondition_change", args=[c.pk])
        paused = _paused_words(c.name, tenants)
        if c.raised_at and since <= c.raised_at <= until:
            said = f"{paused} paused" if paused else f"condition {c.name} raised"
            entries.append(SystemEntry(at=c.raised_at, kind="pause" if paused else "condition", url=url,
                                       text=f"{said} by {c.raised_by or 'someone'}: {c.reason or 'no reason given'}"))
        if c.cleared_at and since <= c.cleared_at <= until and (c.raised_at is None or c.cleared_at >= c.raised_at):
            held = human_age((c.cleared_at - c.raised_at).total_seconds()) if c.raised_at else "?"
            said = f"{paused} resumed" if paused else f"condition {c.name} cleared"
            entries.append(SystemEntry(at=c.cleared_at, kind="resume" if paused else "condition", url=url,
                                       text=f"{said} after {held}"))
    return entries


def _paused_words(name: str, tenants: dict) -> str | None:
    """Name what a condition pauses ("service resize", "tenant acme"), or None for any other condition."""
    if (service := paused_service_key(name)) is not None:
        return f"service {service}"
    tenant = paused_tenant_id(name)
    if tenant is not None:
        return f"tenant {tenants.get(tenant, tenant)}"
    return None
