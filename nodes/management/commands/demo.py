"""``manage.py demo``: run sample jobs through a builder and two agents, then summarise."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from accs_site.cli import OperatorCommand
from nodes.demo import Demo


class Command(OperatorCommand):
    help = "Run the end-to-end demo (builder + two agents as processes) and print a summary."
    needs_ready_database = True

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--timeout", type=float, default=180.0, help="Seconds to wait for the demo jobs.")

    def handle(self, *args: Any, **options: Any) -> None:
        raise SystemExit(Demo(out=self.stdout, timeout=options["timeout"]).run())
