"""Tests of ops/: what operators read, the admin cockpit, job page, dashboard, metrics, accs_status."""
