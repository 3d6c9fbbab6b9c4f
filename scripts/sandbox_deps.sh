#!/usr/bin/env bash
# Install bubblewrap (bwrap), which makes the per-service sandbox ("sandbox": "bwrap") and which its tests
# need, when it is missing; without root or sudo, say what to run (the sandbox tests then fail with the
# same hint: a sandbox that cannot be tested is not skipped).
exec "$(dirname "$0")/apt_deps.sh" "the sandbox tests (tests/nodes/test_sandbox.py)" "bwrap" bubblewrap
