"""What the operators' management commands share: bounded option types and one-line errors.

Exit codes of ``runagent``, ``runbuilder`` and ``accs_status`` (docs/operators.md lists them):

* 0 — stopped cleanly (a signal, or ``--once`` found no work left), or printed;
* 2 — the command line or the configuration is wrong (a bad option, a malformed ``ACC_*``
  variable, an unknown service or tenant), or an operator's command (``accs_status``,
  ``accs_redrive``, ``demo``) finds the database down or missing a migration: one line on
  stderr, nothing started;
* 1 — anything unexpected (a bug): Django's usual report.

For a daemon, a database that is down at start is not an error: it says so in one line and waits.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from django.core.management.base import BaseCommand, CommandError, CommandParser, SystemCheckError

from accs_site.daemon import database_not_ready

EXIT_USAGE = 2


def bounded(kind: type[int] | type[float], *, minimum: float, maximum: float,
            above: float | None = None) -> Callable[[str], int | float]:
    """Return an argparse ``type`` that parses ``kind`` and refuses values outside the bounds.

    ``above`` is an exclusive lower bound (``above=0``: "greater than 0"), checked before
    ``minimum`` so that 0 and negative values get the plainer message.
    """
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if kind is float and value != value:  # NaN compares false with every bound
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be greater than {above:g}, got {text}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {text}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def usage_error(message: str) -> CommandError:
    """Return the error a command raises for a bad option or setting: one line, exit code 2."""
    return CommandError(" ".join(message.split()), returncode=EXIT_USAGE)


@contextmanager
def _checks_skipped(tags: tuple[str, ...]) -> Iterator[None]:
    """Leave the registered checks of ``tags`` out of the checks run inside (Django's ``tags`` argument
    would also leave out every untagged check)."""
    from django.core.checks.registry import registry

    kept = {name: getattr(registry, name) for name in ("registered_checks", "deployment_checks")}
    for name, checks in kept.items():
        setattr(registry, name, {check for check in checks if not set(getattr(check, "tags", ())) & set(tags)})
    try:
        yield
    finally:
        for name, checks in kept.items():
            setattr(registry, name, checks)


def _one_line_parser_error(parser: CommandParser, message: str) -> NoReturn:
    if not parser.called_from_command_line:
        raise usage_error(f"Error: {message}")
    parser.exit(EXIT_USAGE, f"{parser.prog}: error: {message}\n")


class OperatorCommand(BaseCommand):
    """Base of the operators' commands: every expected error is one line on stderr and exit code 2.

    argparse would print the whole usage before its error and Django the system checks' report
    over several lines; an operator reading a unit's journal wants the one line that says what
    to fix.
    """

    #: Check before running that PostgreSQL answers and has every ACCS migration, and stop with one
    #: line (exit code 2) if not, instead of a traceback from the first query. The daemons wait for
    #: the database themselves and leave this off.
    needs_ready_database = False

    #: System checks of these tags are not run at start: a command serves no URL, and the URL checks
    #: import the whole HTTP API (about half a second of CPU at every start; ``manage.py check`` still
    #: runs them, as the web unit does before it starts). Every other check runs, the untagged ones
    #: (ACCS's settings, a site's own) included.
    skipped_check_tags: tuple[str, ...] = ("urls",)

    def execute(self, *args, **options):
        if self.needs_ready_database:
            problem = database_not_ready()
            if problem is not None:
                raise usage_error(problem)
        return super().execute(*args, **options)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # argparse calls ``self.error``; the instance attribute takes precedence over the method.
        parser.error = lambda message: _one_line_parser_error(parser, message)  # type: ignore[method-assign]
        return parser

    def check(self, *args, **kwargs) -> None:
        try:
            with _checks_skipped(self.skipped_check_tags):
                super().check(*args, **kwargs)
        except SystemCheckError:
            raise usage_error(self._check_errors_in_one_line()) from None

    def _check_errors_in_one_line(self) -> str:
        from django.core import checks

        with _checks_skipped(self.skipped_check_tags):
            errors = [m for m in checks.run_checks() if m.is_serious() and not m.is_silenced()]
        if not errors:
            return "system checks failed (run manage.py check)"
        parts = [f"{m.msg} ({m.hint})" if m.hint else m.msg for m in errors]
        return "configuration: " + "; ".join(parts)
