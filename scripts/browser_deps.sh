#!/usr/bin/env bash
# Install what the browser tests drive (Debian's chromium and chromium-driver) when it is missing.
# Needs root or password-less sudo and apt-get; otherwise says what to run and leaves the tests to
# skip (or, under CI, to fail with the same hint).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "browser tests: chromium and chromedriver are missing and apt-get is not here; install them to run tests/system/test_browser.py" >&2
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "browser tests: run 'sudo apt-get install chromium chromium-driver' to run tests/system/test_browser.py" >&2
  exit 0
fi
echo "installing chromium and chromium-driver for the browser tests (apt-get)"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq chromium chromium-driver >/dev/null
