"""Settings that were optional stay optional for one release: their warnings print as INFO under
``check --upgrade-grace`` until the release :data:`accs_site.checks.OPTIONAL_UNTIL` names."""

from __future__ import annotations

from django.core import checks
from hypothesis import given, strategies as st

from accs_site.checks import OPTIONAL_UNTIL, upgrade_grace
from accs_site.version import VERSION, release_key

ids = st.one_of(st.sampled_from(sorted(OPTIONAL_UNTIL)), st.sampled_from(["accs.W001", "security.W009", "accs.E010"]),
                st.text(max_size=12))
levels = st.sampled_from([checks.DEBUG, checks.INFO, checks.WARNING, checks.ERROR, checks.CRITICAL])
releases = st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(0, 5)).map(lambda t: ".".join(map(str, t)))


@given(check_id=ids, level=levels, version=releases)
def test_only_an_optional_warning_before_its_release_is_lowered_to_info(check_id, level, version):
    message = checks.CheckMessage(level, "something is unset", hint="set it", id=check_id)
    graced = upgrade_grace(message, version=version)
    until = OPTIONAL_UNTIL.get(check_id)
    if until is not None and level == checks.WARNING and release_key(version) < release_key(until):
        assert graced.level == checks.INFO and graced.id == check_id and graced.hint == "set it"
        assert graced.msg.startswith("something is unset") and f"optional until ACCS {until}" in graced.msg
    else:
        assert graced is message


def test_the_grace_lasts_one_release():
    assert all(release_key(VERSION) < release_key(until) for until in OPTIONAL_UNTIL.values()), \
        "a grace that ended: remove its entry from OPTIONAL_UNTIL (and --upgrade-grace when none is left)"
    assert all(release_key(until)[:2] == (release_key(VERSION)[0], release_key(VERSION)[1] + 1)
               for until in OPTIONAL_UNTIL.values()), "one release, not more"


def test_a_bad_release_is_refused_with_its_value():
    import pytest

    with pytest.raises(ValueError, match="not a release: 'next'"):
        release_key("next")
