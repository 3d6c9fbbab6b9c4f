"""Serve ACCS over HTTP for live-server tests: ``python tests/wsgi_server.py HOST PORT``.

Django's threaded development server, as ``manage.py runserver --noreload`` runs it, but with a
listen backlog that absorbs a burst of simultaneous connections (runserver's 10 resets them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "accs_site.settings")
    import django

    django.setup()
    from django.core.servers.basehttp import WSGIServer, run
    from django.core.wsgi import get_wsgi_application

    class BurstServer(WSGIServer):
        request_queue_size = 256

    run(host, port, get_wsgi_application(), threading=True, server_cls=BurstServer)


if __name__ == "__main__":
    # The repository root, not tests/: the test folders named after the apps (tests/jobs/, ...) would
    # shadow the apps themselves.
    sys.path[0] = str(ROOT)
    main()
