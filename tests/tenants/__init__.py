"""Tests of tenants/: tenants, memberships, API tokens, scoping and authentication."""
