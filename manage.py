#!/usr/bin/env python
"""Django's command-line utility for ACCS."""
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # A malformed setting (ACC_DB_URL, say) is the operator's to fix: one line, not a traceback.
        if "--traceback" in sys.argv:
            raise
        sys.stderr.write(f"configuration error: {' '.join(str(exc).split())}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        # Ctrl-C before a daemon installed its own signal handlers (during start-up).
        sys.exit(130)


if __name__ == "__main__":
    main()
