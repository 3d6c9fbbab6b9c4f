#!/usr/bin/env python
"""The embedded test site's manage.py: a team's own Django site with ACCS's apps installed."""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Stand-in for `pip install accs`: the ACCS apps come from the repository root.
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
