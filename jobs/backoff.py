"""Retry delays: exponential backoff with a cap, plus jitter."""

from __future__ import annotations

import random

JITTER_FRACTION = 0.1


def backoff_delay(attempt: int, *, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Return seconds to wait before retrying after failed attempt number ``attempt`` (1-based).

    ``min(cap, base · 2^(attempt−1))`` plus a jitter drawn uniformly from
    ``[0, 10 % of that delay)``, so retries of tasks that failed together spread out.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be at least 1, got {attempt}")
    delay = min(cap, base * (2 ** (attempt - 1)))
    return delay + (rng or random).uniform(0.0, JITTER_FRACTION * delay)
