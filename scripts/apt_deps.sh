#!/usr/bin/env bash
# Install Debian packages a part of the tests needs when one of its commands is missing:
#   scripts/apt_deps.sh "<what needs them>" "<commands that must exist>" <package>...
# Needs root or password-less sudo and apt-get; otherwise says what to run and leaves those tests to
# skip or fail with the same hint (each test module says which).
set -euo pipefail
what=$1 commands=$2
shift 2
missing=0
for command in $commands; do
  command -v "$command" >/dev/null 2>&1 || missing=1
done
[ "$missing" = 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "$what: $commands missing and apt-get is not here; install $* to run them" >&2
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "$what: run 'sudo apt-get install $*' to run them" >&2
  exit 0
fi
echo "installing $* for $what (apt-get)"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq "$@" >/dev/null
