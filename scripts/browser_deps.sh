#!/usr/bin/env bash
# Install what the browser tests drive (Debian's chromium-headless-shell, chromium and chromium-driver) when
# it is missing; without root or sudo, say what to run and leave the tests to skip (or, under CI, to fail
# with the same hint).
exec "$(dirname "$0")/apt_deps.sh" "the browser tests (tests/system/test_browser.py)" \
  "chromium chromium-headless-shell chromedriver" \
  chromium chromium-headless-shell chromium-driver
