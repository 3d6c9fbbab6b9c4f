"""The previous release's code creates API tokens on this release's schema: it inserts a token row
without ``scopes`` (a column it does not know), and the database default fills it in."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from django.db import connection
from hypothesis import HealthCheck, given, settings, strategies as st

from tenants.models import DEFAULT_TOKEN_SCOPES, ApiToken, TokenScope
from tests.ops_helpers import make_user

# The columns the previous release's ApiToken wrote (it had no scopes).
PREVIOUS_RELEASE_INSERT = """
INSERT INTO accs_api_token (user_id, name, prefix, digest, created_at, last_used_at, revoked_at, expires_at)
VALUES (%s, %s, %s, %s, now(), NULL, NULL, NULL) RETURNING id
"""


def _insert_as_previous_release(*, user_id: int, name: str, raw: str) -> int:
    digest = hashlib.sha256(f"{raw}{uuid.uuid4()}".encode()).hexdigest()  # unique per row, as a real token's
    with connection.cursor() as cursor:
        cursor.execute(PREVIOUS_RELEASE_INSERT, [user_id, name, raw[:12], digest])
        return cursor.fetchone()[0]


def test_a_token_inserted_without_scopes_gets_the_default_scopes(old_code_user):
    token_id = _insert_as_previous_release(user_id=old_code_user.pk, name="ci", raw="accs_previous-release-token")
    assert ApiToken.objects.get(pk=token_id).scopes == list(DEFAULT_TOKEN_SCOPES)
    assert TokenScope.DEFINITIONS not in DEFAULT_TOKEN_SCOPES


@pytest.fixture
def old_code_user(db):
    return make_user("old-code")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=1, max_size=100).filter(lambda s: "\x00" not in s),
       raw=st.text(alphabet=st.characters(codec="ascii", exclude_characters="\x00"), min_size=12, max_size=80))
def test_any_token_the_previous_release_inserts_reads_back_with_the_python_default(old_code_user, name, raw):
    token_id = _insert_as_previous_release(user_id=old_code_user.pk, name=name, raw=raw)
    token = ApiToken.objects.get(pk=token_id)
    # The database default and the model's default give one answer, whichever code made the row.
    assert token.scopes == ApiToken._meta.get_field("scopes").get_default()
    assert token.name == name
