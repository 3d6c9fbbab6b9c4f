"""The admin and the API's session stay inside what the signed-in user may do.

A tenant admin (staff, not a superuser) tries, over HTTP, what the issue found open: minting a
``definitions`` token for a superuser, granting themselves another tenant, reading other
tenants' memberships, learning another tenant's error count from the job search, and using the
API from the admin's session without a throttle; a bad token on a POST must answer 401.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api
from jobs.models import Job
from tenants.admin import membership_problem, minting_problem
from tenants.models import ApiToken, TenantMembership, TokenScope
from tests.ops_helpers import make_user, signed_in_session

pytestmark = pytest.mark.django_db


def _with_permissions(user, *codenames: str):
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


@pytest.fixture
def alice(tenants):
    """A staff tenant admin of acme (viewer of nothing else) with the token and membership model permissions."""
    user = make_user("alice", tenants={tenants.acme: "admin"})
    return _with_permissions(user, "add_apitoken", "view_apitoken", "delete_apitoken", "view_tenantmembership",
                             "add_tenantmembership", "change_tenantmembership", "delete_tenantmembership")


def _signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


# --------------------------------------------------------------------------------------------
# API tokens
# --------------------------------------------------------------------------------------------

def _mint(browser: Client, owner, scopes: list[str]):
    return browser.post(reverse("admin:tenants_apitoken_add"),
                        {"user": owner.pk, "name": "minted", "scopes": scopes, "expires_at": ""})


def test_a_tenant_admin_cannot_mint_a_token_for_a_superuser_or_a_definitions_token(alice):
    root = make_user("root", superuser=True)
    browser = _signed_in(alice)
    refused = _mint(browser, root, [TokenScope.DEFINITIONS, TokenScope.READ])
    assert refused.status_code == 200 and not ApiToken.objects.filter(user=root).exists()
    assert _mint(browser, alice, [TokenScope.DEFINITIONS]).status_code == 200
    assert not ApiToken.objects.filter(user=alice, scopes__contains=[TokenScope.DEFINITIONS]).exists()
    # Her own token with ordinary scopes is hers to make.
    assert _mint(browser, alice, [TokenScope.READ, TokenScope.RUN]).status_code == 302
    assert ApiToken.objects.filter(user=alice, name="minted").exists()


def test_a_tenant_admin_lists_only_their_own_tokens_and_a_superuser_mints_for_anyone(alice, tenants):
    root = make_user("root", superuser=True)
    assert _mint(_signed_in(root), root, [TokenScope.DEFINITIONS]).status_code == 302
    listing = _signed_in(alice).get(reverse("admin:tenants_apitoken_changelist"))
    assert listing.status_code == 200 and "root" not in listing.content.decode()
    assert _mint(_signed_in(root), alice, [TokenScope.READ]).status_code == 302


RANKS = st.sampled_from(["superuser", "staff", "plain"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(minter=RANKS, owner=RANKS, same=st.booleans(),
       scopes=st.lists(st.sampled_from(TokenScope.values), min_size=1, unique=True))
def test_nobody_mints_a_token_beyond_their_own_reach(minter, owner, same, scopes):
    def person(rank: str, pk: int) -> Any:
        return type("Person", (), {"pk": pk, "is_superuser": rank == "superuser"})()

    minting, owning = person(minter, 1), person(minter if same else owner, 1 if same else 2)
    allowed = minting_problem(minting, owning, scopes) is None
    if allowed:
        assert minting.is_superuser or owning.pk == minting.pk, "minted for someone else"
        assert TokenScope.DEFINITIONS not in scopes or (minting.is_superuser and owning.is_superuser)
    if minting.is_superuser and owning.is_superuser:
        assert allowed, "a superuser may mint anything for a superuser"


# --------------------------------------------------------------------------------------------
# Memberships
# --------------------------------------------------------------------------------------------

def test_a_tenant_admin_sees_and_grants_memberships_of_their_tenants_only(alice, tenants):
    make_user("bob", tenants={tenants.globex: "admin"})
    carol = make_user("carol")
    browser = _signed_in(alice)
    listing = browser.get(reverse("admin:tenants_tenantmembership_changelist")).content.decode()
    assert "bob" not in listing and "globex" not in listing.lower()
    add = reverse("admin:tenants_tenantmembership_add")
    # Herself into another tenant, or her own role: refused.
    browser.post(add, {"user": alice.pk, "tenant": tenants.globex.pk, "role": "admin"})
    assert not TenantMembership.objects.filter(user=alice, tenant=tenants.globex).exists()
    own = TenantMembership.objects.get(user=alice, tenant=tenants.acme)
    browser.post(reverse("admin:tenants_tenantmembership_change", args=[own.pk]),
                 {"user": alice.pk, "tenant": tenants.globex.pk, "role": "admin"})
    own.refresh_from_db()
    assert own.tenant == tenants.acme
    # Someone else into another tenant: refused; into her own tenant: granted.
    browser.post(add, {"user": carol.pk, "tenant": tenants.globex.pk, "role": "viewer"})
    assert not TenantMembership.objects.filter(user=carol).exists()
    assert browser.post(add, {"user": carol.pk, "tenant": tenants.acme.pk, "role": "viewer"}).status_code == 302
    assert TenantMembership.objects.filter(user=carol, tenant=tenants.acme, role="viewer").exists()
    bobs = TenantMembership.objects.get(user__username="bob")
    assert browser.get(reverse("admin:tenants_tenantmembership_change", args=[bobs.pk])).status_code in (302, 404)


def test_membership_rules_hold_for_every_granter_and_membership(tenants):
    admin_of_acme = make_user("amy", tenants={tenants.acme: "admin"})
    viewer_of_acme = make_user("val", tenants={tenants.acme: "viewer"})
    root = make_user("root", superuser=True)
    other = make_user("oscar")
    for granter in (admin_of_acme, viewer_of_acme, root):
        for user in (admin_of_acme, viewer_of_acme, other):
            for tenant in (tenants.acme, tenants.globex):
                problem = membership_problem(granter, TenantMembership(user=user, tenant=tenant, role="admin"))
                expected = granter == root or (granter == admin_of_acme and user != granter
                                               and tenant == tenants.acme)
                assert (problem is None) == expected, (granter, user, tenant, problem)


# --------------------------------------------------------------------------------------------
# The job search by error text
# --------------------------------------------------------------------------------------------

def test_the_error_search_counts_and_shows_the_viewers_own_tenant_only(tenants, make_service, monkeypatch):
    monkeypatch.setattr("jobs.admin.ERROR_SEARCH_LIMIT", 2)
    make_service("sync")
    for _ in range(3):
        api.start_service("sync", tenant=tenants.globex)
    mine = api.start_service("sync", tenant=tenants.acme)
    Job.objects.update(error_message="exit 3: disk full on /srv")
    viewer = make_user("vic", tenants={tenants.acme: "viewer"})
    page = _signed_in(viewer).get(reverse("admin:jobs_job_changelist"), {"q": "disk full"}).content.decode()
    assert "more than" not in page, "the warning counts another tenant's matches"
    assert mine.id.hex[-10:] in page.replace("-", ""), "the viewer's own match is listed"


# --------------------------------------------------------------------------------------------
# The API from the admin's session: throttled per user; a bad token on a POST is 401
# --------------------------------------------------------------------------------------------

def test_api_calls_from_the_admin_session_are_throttled_per_user(tenants, monkeypatch):
    from accs_site.conf import reload

    monkeypatch.setenv("ACC_API_RATE_LIMIT", "3")
    monkeypatch.setenv("ACC_API_RATE_WINDOW_SEC", "3600")
    reload()
    try:
        user = make_user("sam", tenants={tenants.acme: "admin"})
        first, second = _signed_in(user), _signed_in(user)  # two browsers share the user's count
        answers = [first.get("/api/v1/jobs").status_code for _ in range(2)]
        answers += [second.get("/api/v1/jobs").status_code for _ in range(2)]
        assert answers == [200, 200, 200, 429]
        assert _signed_in(make_user("tom", tenants={tenants.acme: "admin"})).get("/api/v1/jobs").status_code == 200
    finally:
        monkeypatch.delenv("ACC_API_RATE_LIMIT")
        monkeypatch.delenv("ACC_API_RATE_WINDOW_SEC")
        reload()


@pytest.mark.django_db(transaction=True)
def test_a_missing_or_bad_token_on_a_post_is_401_not_a_csrf_failure(tenants, live_server_url):
    url = f"{live_server_url}/api/v1/jobs"
    for headers in ({}, {"Authorization": "Bearer accs_not-a-token"}, {"Authorization": "Basic eDp5"}):
        answer = requests.post(url, json={"service": "x"}, headers=headers, timeout=30)
        assert answer.status_code == 401, (headers, answer.status_code, answer.text)
        assert answer.json() == {"detail": "Unauthorized"}
    # A staff session without its CSRF token is still refused, by the CSRF check (not served).
    make_user("sue", tenants={tenants.acme: "admin"})
    http = signed_in_session(live_server_url, "sue")
    assert http.post(url, json={"service": "x"}, timeout=30).status_code == 403
    # A bad token sent with that session is the token's answer: 401, and the session does not step in.
    assert http.post(url, json={"service": "x"}, headers={"Authorization": "Bearer accs_bad"},
                     timeout=30).status_code == 401


# --------------------------------------------------------------------------------------------
# Tenants
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["viewer", "admin"])
def test_only_a_tenants_admin_changes_its_limits_and_nobody_but_a_superuser_adds_or_deletes(tenants, role):
    """``change_tenant`` alone is not enough: the role in that very tenant decides."""
    user = _with_permissions(make_user("tess", tenants={tenants.acme: role, tenants.globex: "viewer"}),
                             "view_tenant", "change_tenant", "add_tenant", "delete_tenant")
    browser = _signed_in(user)

    def post_limit(tenant, value: int):
        return browser.post(reverse("admin:tenants_tenant_change", args=[tenant.pk]),
                            {"slug": tenant.slug, "name": tenant.name, "timezone": tenant.timezone,
                             "max_in_flight": value, "min_priority": tenant.min_priority,
                             "max_priority": tenant.max_priority, "retention_days": tenant.retention_days or "",
                             "retention_dead_days": tenant.retention_dead_days or "",
                             "created_at_0": tenant.created_at.strftime("%Y-%m-%d"),
                             "created_at_1": tenant.created_at.strftime("%H:%M:%S")})

    own = post_limit(tenants.acme, 7)
    tenants.acme.refresh_from_db()
    assert (tenants.acme.max_in_flight == 7) is (role == "admin"), own.status_code
    post_limit(tenants.globex, 9)
    tenants.globex.refresh_from_db()
    assert tenants.globex.max_in_flight != 9, "a viewer of another tenant never changes it"
    assert browser.get(reverse("admin:tenants_tenant_add")).status_code == 403
    deleted = browser.post(reverse("admin:tenants_tenant_delete", args=[tenants.acme.pk]), {"post": "yes"})
    assert deleted.status_code == 403
    assert type(tenants.acme).objects.filter(pk=tenants.acme.pk).exists()
