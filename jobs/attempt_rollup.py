"""The attempts rolled up per time bucket, for the dashboard's charts and rates (``ops.charts``, ``ops.rates``).

Two tables (``jobs.0043``), each an attempt count per bucket of its start:

- ``accs_attempt_rollup``: per :data:`SERVICE_GRID` (20 min), service and tenant: attempts, succeeded,
  failed (failed or timed out), and a histogram of the queue wait (``started_at − claimable_at``) in
  :data:`WAIT_BOUNDS`' bins (the charts' median wait is read from it, :func:`wait_median`);
- ``accs_attempt_node_rollup``: per :data:`NODE_GRID` (1 h), node, service and tenant: attempts,
  succeeded, failed (the rates per node and per service).

The builder's leader folds finished attempts in (:func:`fold`, the duty ``fold_attempt_rollup``), off the
claim and report path: the attempts started in ``[folded_until, end)`` that have finished are counted,
those still running are remembered (``pending``) and counted by a later fold once they finish (an attempt's
status leaves ``running`` once and never changes again). The counts and the mark move in one statement, so
a fold that fails or is fenced leaves both as they were, and the next one does the same window again.

A reader takes, in one statement (one snapshot), the mark and the rollup for the buckets in
``[lo, hi)`` (:func:`zone`) and the raw attempts for the rest: the range's edges outside whole buckets, the
tail from ``folded_until`` on, and the pending attempts. The sum is the count over the attempts themselves.

``end`` stays :data:`LAG` behind the clock: an attempt is written by a claim with the claim transaction's
time, so one that commits late could carry a start before the mark; a claim is one short statement, under
the daemons' 30 s statement timeout, far inside the lag.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection, transaction

from accs_site.clock import db_now

#: The buckets of the service rollup (the charts: a bar of the 24 h and 7 d ranges is a whole number of them).
SERVICE_GRID = timedelta(minutes=20)
#: The buckets of the node rollup (the rates: only the range's two edges are read raw).
NODE_GRID = timedelta(hours=1)
#: How far behind the clock the fold stays (see the module's docstring).
LAG = timedelta(minutes=5)
#: Attempts folded per batch, about (a batch is at least one bucket of the service grid).
FOLD_BATCH = 20_000
#: Rollup buckets older than this are deleted (the longest range the dashboard draws is 92 days).
KEEP = timedelta(days=100)
#: The mark's name (one row).
MARK = "attempts"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: The queue wait's histogram: bin 0 below the first bound, bin i from bound i−1 up to bound i, the last
#: bin from the last bound up (seconds; 1-2-5 steps up to a day). Changing them needs a new migration.
WAIT_BOUNDS: tuple[float, ...] = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200,
                                  21600, 86400)
WAIT_BINS = len(WAIT_BOUNDS) + 1
WAIT_COLUMNS = tuple(f"wait_{i}" for i in range(WAIT_BINS))


def floor_to(when: datetime, grid: timedelta) -> datetime:
    """Return the start of the ``grid`` bucket holding ``when`` (buckets counted from the Unix epoch, UTC)."""
    return EPOCH + (when - EPOCH) // grid * grid


def ceil_to(when: datetime, grid: timedelta) -> datetime:
    """Return the first ``grid`` boundary at or after ``when``."""
    down = floor_to(when, grid)
    return down if down == when else down + grid


def zone(since: datetime, until: datetime, grid: timedelta, *, aligned: bool = True) -> dict[str, datetime]:
    """Return a reader's parameters ``lo`` and ``top``: the whole ``grid`` buckets inside ``since``..``until``.

    The rollup serves ``[lo, hi)`` where ``hi`` is the mark when it lies inside the range, else ``top``
    (:data:`ZONE_SQL`); ``aligned=False`` (bars the grid does not divide) reads every attempt raw.
    """
    lo, top = ceil_to(since, grid), floor_to(until, grid)
    if not aligned or lo >= top:
        lo = top = until
    return {"lo": lo, "top": top}


#: A reader's CTE: ``hi``, where the rollup's part of the range ends, and the attempts still pending, read
#: with the rollup in the same statement (a fold committing between two statements would count twice).
ZONE_SQL = """
zone AS MATERIALIZED (
    SELECT greatest(%(lo)s, CASE WHEN m.folded_until <= %(until)s THEN m.folded_until ELSE %(top)s END) AS hi,
           m.pending
      FROM (SELECT coalesce(max(folded_until), '-infinity') AS folded_until,
                   coalesce(max(pending), ARRAY[]::bigint[]) AS pending
              FROM accs_attempt_rollup_mark WHERE name = 'attempts') m
)"""

#: A reader's raw attempts (``columns`` of ``accs_attempt a`` and what ``join`` adds, ``where`` more conditions;
#: ``{part}`` in the columns numbers the branch): the range's part before the rollup's, the tail after it
#: (each its newest ``sample``, read backwards through attempt_started_idx) and the pending attempts inside
#: it (a primary-key lookup each, kept apart by ``OFFSET 0``: as ``id = ANY(...)`` or a join beside the
#: range, the planner may walk the range's attempts in attempt_started_idx instead, the whole week's).
RAW_SQL = """
raw AS (
    (SELECT {columns1} FROM accs_attempt a {join}
      WHERE a.started_at >= %(since)s AND a.started_at < %(lo)s {where}
      ORDER BY a.started_at DESC LIMIT %(sample)s)
    UNION ALL
    (SELECT {columns2} FROM accs_attempt a {join}
      WHERE a.started_at >= (SELECT hi FROM zone) AND a.started_at < %(until)s {where}
      ORDER BY a.started_at DESC LIMIT %(sample)s)
    UNION ALL
    SELECT {columns3}
      FROM unnest((SELECT pending FROM zone)) AS p(id)
     CROSS JOIN LATERAL (SELECT * FROM accs_attempt x WHERE x.id = p.id OFFSET 0) a {join}
     WHERE a.started_at >= %(lo)s AND a.started_at < (SELECT hi FROM zone) {where}
)"""


def raw_sql(columns: str, *, join: str = "", where: str = "") -> str:
    """Return the ``raw`` CTE (:data:`RAW_SQL`) selecting ``columns`` (``{part}``: the branch, 1 to 3)."""
    return RAW_SQL.format(join=join, where=where,
                          **{f"columns{i}": columns.replace("{part}", str(i)) for i in (1, 2, 3)})


#: An attempt's queue wait, where it is known (the time it became claimable no later than its start).
WAIT_SQL = "CASE WHEN {claimable} <= a.started_at THEN date_part('epoch', a.started_at - {claimable}) END"
#: Its bin in the histogram (1 + WAIT_BINS: none when the wait is unknown).
WAIT_BIN_SQL = "coalesce(width_bucket({wait}, %(bounds)s::float8[]), {none})".format(wait="{wait}", none=WAIT_BINS)


def wait_bin_counts(column: str = "wait_bin") -> str:
    """Return the select list counting rows per bin of ``column``, named as the rollup's columns."""
    return ", ".join(f"count(*) FILTER (WHERE {column} = {i}) AS {name}" for i, name in enumerate(WAIT_COLUMNS))


def _fold_sql() -> str:
    plus = ", ".join(f"{c} = r.{c} + excluded.{c}" for c in ("attempts", "succeeded", "failed", *WAIT_COLUMNS))
    node_plus = ", ".join(f"{c} = r.{c} + excluded.{c}" for c in ("attempts", "succeeded", "failed"))
    columns = """a.id, a.status, a.started_at, a.node, coalesce(a.service_id, t.service_id) AS service_id,
           coalesce(a.tenant_id, t.tenant_id) AS tenant_id, {bin} AS wait_bin""".format(
        bin=WAIT_BIN_SQL.format(wait=WAIT_SQL.format(
            claimable="coalesce(a.claimable_at, CASE WHEN a.attempt_no = t.attempt THEN t.next_attempt_at END)")))
    # An attempt written before jobs.0038/0040 filled it in is read through its task, as the readers do.
    join = "LEFT JOIN accs_task t ON t.id = a.task_id AND (a.service_id IS NULL OR a.claimable_at IS NULL)"
    outcome = ("count(*), count(*) FILTER (WHERE status = 'succeeded'), "
               "count(*) FILTER (WHERE status IN ('failed', 'timeout'))")
    return f"""
-- The attempts started in [start, end) (attempt_started_idx) and those left running by an earlier fold
-- (primary-key lookups), read once (MATERIALIZED: one snapshot for what is folded and what stays pending);
-- the finished ones are added to both rollups and the still running ones become the mark's pending list,
-- the mark moving to ``end`` in the same statement.
WITH cand AS MATERIALIZED (
    SELECT {columns} FROM accs_attempt a {join} WHERE a.started_at >= %(start)s AND a.started_at < %(end)s
    UNION ALL
    SELECT {columns} FROM accs_attempt a {join} WHERE a.id = ANY(%(pending)s::bigint[])
), done AS MATERIALIZED (
    SELECT * FROM cand WHERE status <> 'running'
), by_service AS (
    INSERT INTO accs_attempt_rollup AS r (bucket, service_id, tenant_id, attempts, succeeded, failed,
                                          {", ".join(WAIT_COLUMNS)})
    SELECT date_bin(%(service_grid)s, started_at, %(epoch)s), service_id, tenant_id, {outcome}, {wait_bin_counts()}
      FROM done GROUP BY 1, 2, 3
    ON CONFLICT (bucket, service_id, tenant_id) DO UPDATE SET {plus}
), by_node AS (
    INSERT INTO accs_attempt_node_rollup AS r (bucket, node, service_id, tenant_id, attempts, succeeded, failed)
    SELECT date_bin(%(node_grid)s, started_at, %(epoch)s), node, service_id, tenant_id, {outcome}
      FROM done GROUP BY 1, 2, 3, 4
    ON CONFLICT (bucket, node, service_id, tenant_id) DO UPDATE SET {node_plus}
)
UPDATE accs_attempt_rollup_mark
   SET folded_until = %(end)s, folded_at = now(),
       pending = ARRAY(SELECT id FROM cand WHERE status = 'running' ORDER BY id)
 WHERE name = '{MARK}'
RETURNING (SELECT count(*) FROM done)
"""


FOLD_SQL = _fold_sql()

#: The end of a batch: the start of the ``limit``-th attempt from ``start`` on (attempt_started_idx).
BATCH_END_SQL = """
SELECT a.started_at FROM accs_attempt a WHERE a.started_at >= %(start)s ORDER BY a.started_at OFFSET %(limit)s LIMIT 1
"""


def fold(*, limit: int = FOLD_BATCH, now: datetime | None = None) -> int:
    """Fold the finished attempts of the next window (about ``limit`` attempts) and the pending ones that
    finished since into the rollups, and move the mark; return how many attempts were folded.

    Call it inside the caller's transaction (the builder's fenced one) or on its own (it opens one).
    """
    if limit < 1:
        raise ValueError(f"a fold takes at least one attempt, got {limit}")
    with transaction.atomic(), connection.cursor() as cur:
        # PostgreSQL's clock, which the claims write the attempts' starts with: a builder's clock running
        # ahead would move the mark past attempts not yet written, and no page would ever count them.
        cap = floor_to((now or db_now(cur)) - LAG, SERVICE_GRID)
        cur.execute("INSERT INTO accs_attempt_rollup_mark (name, pending) VALUES (%s, '{}') ON CONFLICT DO NOTHING",
                    [MARK])
        cur.execute("SELECT folded_until, pending FROM accs_attempt_rollup_mark WHERE name = %s FOR UPDATE", [MARK])
        start, pending = cur.fetchone()
        if start is None:  # the first fold: from the oldest attempt's bucket
            cur.execute("SELECT min(started_at) FROM accs_attempt")
            oldest = cur.fetchone()[0]
            start = min(floor_to(oldest, SERVICE_GRID), cap) if oldest is not None else cap
        cur.execute(BATCH_END_SQL, {"start": start, "limit": limit})
        row = cur.fetchone()
        # Up to the bucket holding the limit-th attempt, included: a batch folds at least ``limit`` attempts
        # but those still running, so the builder's next batch follows at once while more is behind.
        end = cap if row is None else min(cap, floor_to(row[0], SERVICE_GRID) + SERVICE_GRID)
        end = max(end, start)  # the clock went back: fold the pending ones only
        params: dict[str, Any] = {"start": start, "end": end, "pending": pending, "service_grid": SERVICE_GRID,
                                  "node_grid": NODE_GRID, "epoch": EPOCH, **fold_params()}
        cur.execute(FOLD_SQL, params)
        folded = cur.fetchone()[0]
        cur.execute("DELETE FROM accs_attempt_rollup WHERE bucket < %(old)s", {"old": cap - KEEP})
        cur.execute("DELETE FROM accs_attempt_node_rollup WHERE bucket < %(old)s", {"old": cap - KEEP})
    return folded


def behind(*, now: datetime | None = None) -> bool:
    """Whether the mark is more than a bucket short of where the next fold would take it."""
    with connection.cursor() as cur:
        cap = floor_to((now or db_now(cur)) - LAG, SERVICE_GRID)
        cur.execute("SELECT folded_until FROM accs_attempt_rollup_mark WHERE name = %s", [MARK])
        row = cur.fetchone()
    return row is None or row[0] is None or row[0] < cap


def wait_median(bins: Sequence[int]) -> float | None:
    """Return the median wait a histogram (counts per bin of :data:`WAIT_BOUNDS`) gives, None when empty.

    As Prometheus's ``histogram_quantile``: the bin holding the middle rank, linearly between its bounds
    (the first bin from 0; the last, open, bin gives its lower bound). Exact to within the bin.
    """
    total = sum(bins)
    if not total:
        return None
    rank, seen = total / 2, 0
    for i, n in enumerate(bins):
        if n and seen + n >= rank:
            if i == WAIT_BINS - 1:
                return float(WAIT_BOUNDS[-1])
            low = 0.0 if i == 0 else float(WAIT_BOUNDS[i - 1])
            return low + (float(WAIT_BOUNDS[i]) - low) * (rank - seen) / n
        seen += n
    return None  # not reached: the ranks add up to the total


def wait_bin(seconds: float) -> int:
    """Return the histogram bin of a wait of ``seconds`` (as the fold's ``width_bucket`` does)."""
    return bisect.bisect_right(WAIT_BOUNDS, seconds)


def fold_params() -> dict[str, Any]:
    """The parameters a reader's statement needs besides its own (the histogram's bounds)."""
    return {"bounds": [float(b) for b in WAIT_BOUNDS]}


__all__ = ["FOLD_BATCH", "LAG", "NODE_GRID", "RAW_SQL", "SERVICE_GRID", "WAIT_BINS", "WAIT_BOUNDS", "WAIT_COLUMNS",
           "ZONE_SQL", "behind", "ceil_to", "floor_to", "fold", "fold_params", "raw_sql", "wait_bin", "wait_bin_counts",
           "wait_median", "zone"]
