"""Fold finished attempts into the dashboard's rollups (jobs.attempt_rollup), off the claim and report path."""

from __future__ import annotations

from jobs.attempt_rollup import FOLD_BATCH, fold
from jobs.duties.base import Duty


def duty() -> Duty:
    # Every 30 s: the dashboard reads the attempts since the mark raw, at most a bucket (20 min) and the
    # lag (5 min) behind plus this. A backlog (the first folds after the upgrade) goes 5 batches a tick.
    return Duty("fold_attempt_rollup", every=30.0, limit=FOLD_BATCH, run=lambda limit: fold(limit=limit),
                max_batches=5)
