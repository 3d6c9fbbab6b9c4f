"""A claim waits for a lock only for a bounded time (``lock_wait``), on both claim paths.

A second connection holds the lock the claim needs: the capped service's advisory lock
(``accs:service:<id>``), as a slow claimer or a site pausing the service does, or the node's.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager

import psycopg
import pytest
from django.db import connection
from hypothesis import given, strategies as st

from accs_site.conf import AccsSettings, SettingError
from jobs import api
from jobs.claim import claim_round
from jobs.locks import LOCK_WAIT_MAX_MS, is_lock_timeout, lock_wait_ms
from jobs.models import Task
from tests.engine_helpers import NODE, spec

pytestmark = pytest.mark.django_db(transaction=True)

LOCK_WAIT = 0.3


def _claim(services, **options):
    began = time.monotonic()
    answer = claim_round([spec(s) for s in services], NODE, agent_id="agent-w", free_slots=5, lease_seconds=60,
                         lock_wait=LOCK_WAIT, **options)
    return answer, time.monotonic() - began


def _lock_timeout_now() -> str:
    with connection.cursor() as cur:
        cur.execute("SHOW lock_timeout")
        return cur.fetchone()[0]


@pytest.mark.parametrize("limits", [{"max_concurrent": 1}, {"max_concurrent": 1, "rate_limit": 100}],
                         ids=["capped (the claim function)", "capped and rated (the general path)"])
def test_a_claim_gives_up_on_a_held_service_lock_after_its_bound_and_claims_nothing(make_service, db_url, limits):
    svc = make_service("held", **limits)
    api.start_service("held")
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{svc.id}"])
        answer, took = _claim([svc])
        assert answer.waited_out and answer.tasks == [] and answer.contended == {svc.id}
        assert LOCK_WAIT <= took < LOCK_WAIT + 5, f"gave up after {took:.2f}s"
        assert Task.objects.get().status == "queued", "the claim's transaction rolled back"
    assert _lock_timeout_now() == "0", "the bound lasted only for the claim's transaction"
    answer, _ = _claim([svc])
    assert not answer.waited_out and len(answer.tasks) == 1, "the lock free, the next claim takes the task"


def test_a_claim_that_only_tries_capped_locks_still_bounds_its_wait_for_the_nodes_lock(make_service, db_url):
    capped, plain = make_service("held", max_concurrent=1), make_service("free")
    api.start_service("held"), api.start_service("free")
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:node:{NODE.name}"])
        answer, took = _claim([capped, plain], try_capped=True)
        assert answer.waited_out and answer.tasks == [], "another agent of the node held its lock"
        assert took < LOCK_WAIT + 5
    answer, _ = _claim([capped, plain], try_capped=True)
    assert {t.service_key for t in answer.tasks} == {"held", "free"}


def test_a_claim_that_only_tries_the_busy_lock_claims_the_other_services(make_service, db_url):
    capped, plain = make_service("held", max_concurrent=1), make_service("free")
    api.start_service("held"), api.start_service("free")
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{capped.id}"])
        answer, _ = _claim([capped, plain])
        assert answer.waited_out and answer.tasks == []
        answer, _ = _claim([capped, plain], try_capped=True)  # as the agent claims after a wait that ran out
        assert not answer.waited_out and answer.contended == {capped.id}
        assert [t.service_key for t in answer.tasks] == ["free"]


@given(st.floats(min_value=1e-9, max_value=1e12, allow_nan=False))
def test_a_lock_wait_becomes_a_positive_whole_number_of_milliseconds_never_shorter(seconds):
    text = lock_wait_ms(seconds)
    assert text.endswith("ms")
    ms = int(text[:-2])
    assert 1 <= ms <= LOCK_WAIT_MAX_MS
    assert ms >= min(LOCK_WAIT_MAX_MS, math.ceil(seconds * 1000) - 1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_lock_wait_that_would_not_bound_anything_is_refused(bad):
    with pytest.raises(ValueError, match="a lock wait must be a positive number of seconds"):
        lock_wait_ms(bad)


SETTING_TEXT = st.one_of(st.floats().map(repr), st.text(st.characters(blacklist_characters="\x00",
                                                                      blacklist_categories=("Cs",)), max_size=12))


@given(SETTING_TEXT)
def test_the_claim_lock_wait_setting_takes_finite_seconds_in_range_and_names_anything_else(raw):
    with _environ("ACC_CLAIM_LOCK_WAIT_SEC", raw):
        try:
            value = AccsSettings().claim_lock_wait_sec
        except SettingError as exc:
            assert "ACC_CLAIM_LOCK_WAIT_SEC" in str(exc)
            try:
                parsed = float(raw)
            except ValueError:
                return
            assert not math.isfinite(parsed) or not 0.01 <= parsed <= 3600, f"{raw!r} refused"
            return
    assert value == (float(raw) if raw.strip() else 5.0)
    assert math.isfinite(value) and 0.01 <= value <= 3600


@contextmanager
def _environ(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def test_a_lock_timeout_is_recognised_through_djangos_wrapping(make_service, db_url):
    svc = make_service("held", max_concurrent=1)
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url) as waiter:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{svc.id}"])
        waiter.execute("SET LOCAL lock_timeout = '50ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable) as caught:
            waiter.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{svc.id}"])
    assert is_lock_timeout(caught.value)
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = caught.value
    assert is_lock_timeout(wrapped) and not is_lock_timeout(RuntimeError("other"))
