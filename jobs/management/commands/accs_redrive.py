"""``manage.py accs_redrive [--service S] [--tenant T] [--error-contains X] [--since ISO] [--until ISO]
[--node N] [--jobs [--include partial|canceled]] [--dry-run] [--batch 500] [--limit N] [--by NAME]``.

Retry every dead-lettered task (or, with ``--jobs``, failed job) matching the options, in
batches (:mod:`jobs.redrive`). It prints how many match first, then a line per batch. Exit
codes: 0 done (or counted); 2 a bad option, an unknown service or tenant: one line on stderr,
nothing written.
"""

from __future__ import annotations

import argparse
import getpass
from datetime import datetime

from accs_site.cli import OperatorCommand, bounded, usage_error
from jobs import redrive
from jobs.redrive import RedriveFilter, RedriveResult
from workflows.validation import DefinitionError

OPTION_OF = {"error_contains": "--error-contains", "include": "--include", "batch": "--batch", "limit": "--limit"}


def iso_time(text: str) -> datetime:
    """Parse an ISO 8601 time for argparse (naive means UTC, as in the HTTP API)."""
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO 8601 time such as 2025-03-01T12:00:00Z, got {text!r}") from None


class Command(OperatorCommand):
    help = ("Retry every dead-lettered task (or, with --jobs, failed job) matching the filter, in batches; "
            "prints the count first. --dry-run only counts.")
    needs_ready_database = True

    def add_arguments(self, parser) -> None:
        parser.add_argument("--service", help="Only this service (key).")
        parser.add_argument("--tenant", help="Only this tenant (slug or id).")
        parser.add_argument("--error-contains", help="Only errors containing this text (case-insensitive).")
        parser.add_argument("--since", type=iso_time, help="Only those finished at or after this ISO 8601 time.")
        parser.add_argument("--until", type=iso_time, help="Only those finished before this ISO 8601 time.")
        parser.add_argument("--node", help="Only tasks last held by this node (with --jobs: a task of the job).")
        parser.add_argument("--jobs", action="store_true", help="Redrive failed jobs instead of dead-lettered tasks.")
        parser.add_argument("--include", action="append", choices=sorted(redrive.JOB_EXTRA), default=[],
                            help="With --jobs, also redrive jobs in this state (repeatable).")
        parser.add_argument("--dry-run", action="store_true", help="Only print how many match.")
        parser.add_argument("--batch", type=bounded(int, minimum=1, maximum=redrive.MAX_BATCH), default=500,
                            help=f"Tasks or jobs per transaction, 1-{redrive.MAX_BATCH} (default: %(default)s).")
        parser.add_argument("--limit", type=bounded(int, minimum=1, maximum=2**31 - 1), default=None,
                            help="Redrive at most this many.")
        parser.add_argument("--by", default=None, help="Operator name for the timeline (default: your login).")

    def handle(self, *args, **options) -> None:
        flt = RedriveFilter(
            jobs=options["jobs"], service=options["service"], tenant=options["tenant"],
            error_contains=options["error_contains"], since=options["since"], until=options["until"],
            node=options["node"], include=frozenset(options["include"]))
        noun = "failed job(s)" if flt.jobs else "dead-lettered task(s)"
        try:
            matched = redrive.dry_run(flt, limit=options["limit"]).matched
        except DefinitionError as exc:
            raise usage_error("; ".join(f"{OPTION_OF.get(p.where, '--' + p.where)}: {p.message}"
                                        for p in exc.problems)) from None
        self.stdout.write(f"{matched} {noun} match")
        if options["dry_run"] or not matched:
            return

        def progress(totals: RedriveResult) -> None:
            self.stdout.write(f"batch {totals.batches}: {totals.redriven} redriven, {totals.skipped} skipped"
                              f" ({totals.matched} of {matched})")

        totals = redrive.redrive(flt, by=options["by"] or getpass.getuser(), batch=options["batch"],
                                 limit=options["limit"], on_batch=progress)
        self.stdout.write(f"redrove {totals.redriven} {noun} in {totals.batches} batch(es); "
                          f"{totals.skipped} skipped (no longer applicable)")
        for reason, n in sorted(totals.reasons.items()):
            self.stdout.write(f"  {n} skipped: {reason}")
