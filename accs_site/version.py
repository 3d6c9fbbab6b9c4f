"""The ACCS release this code is: the one version string, bumped once per release.

``pyproject.toml`` and the CHANGELOG's top heading carry the same string
(tests/accs_site/test_versions.py holds them together). Every daemon reports it where an operator
reads it: agents on their node row, builders in their leader lease's holder and start-up line, the
web in ``/metrics`` (``accs_build_info``).
"""

import re

VERSION = "0.2.0"

# A release as daemons write it: three numbers, optionally a suffix (0.2.0, 0.3.0rc1).
VERSION_PATTERN = re.compile(r"\d+\.\d+\.\d+[0-9A-Za-z.+-]*")


def release_key(version: str) -> tuple[int, int, int]:
    """Return a release's three numbers, to compare releases ("0.10.0" comes after "0.9.0")."""
    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if numbers is None or not VERSION_PATTERN.fullmatch(version):
        raise ValueError(f"not a release: {version!r} (expected three numbers, e.g. 0.2.0)")
    major, minor, patch = numbers.groups()
    return int(major), int(minor), int(patch)
