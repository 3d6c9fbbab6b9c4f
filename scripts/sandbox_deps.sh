#!/usr/bin/env bash
# Install bubblewrap (bwrap), which makes the per-service sandbox ("sandbox": "bwrap") and which its tests
# need, when it is missing. Needs root or password-less sudo and apt-get; otherwise says what to run
# (the sandbox tests then fail with the same hint: a sandbox that cannot be tested is not skipped).
set -euo pipefail
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "sandbox: bubblewrap (bwrap) is missing and apt-get is not here; install it to run tests/nodes/test_sandbox.py" >&2
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "sandbox: run 'sudo apt-get install bubblewrap' to run tests/nodes/test_sandbox.py" >&2
  exit 0
fi
echo "installing bubblewrap for the per-service sandbox and its tests (apt-get)"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq bubblewrap >/dev/null
