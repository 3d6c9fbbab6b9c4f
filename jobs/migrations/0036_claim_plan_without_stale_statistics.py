"""The claim function plans without sorts where an index gives the order (``SET enable_sort = off``).

Its generic plan is made from the statistics of a connection's first call. Statistics that said nothing was
queued (after a TRUNCATE, or a backlog that came and went since the last ANALYZE) made the plan read each
of the node's hosts' heads through task_job_open_idx, every queued task sorted per host: 150 ms a claim on a
node of 500 hosts, for as long as the connection lived, instead of 5 ms through task_claim_host_idx.

``accs_claim_plain`` keeps its text, name, arguments and result (jobs.claim.plain_claim_function_sql carries
the setting): only the setting it runs under changes, so the previous release's agents call it as before,
and a connection's next call plans again. Going back removes the setting.
"""

from django.db import migrations

ARGS = ("bigint[], int[], int[], int[], text[], text, text, int, text, timestamptz, int, int, int, float8, bigint[],"
        " uuid[], int, boolean")


class Migration(migrations.Migration):
    dependencies = [("jobs", "0035_host_claim_locks_what_it_takes")]

    operations = [migrations.RunSQL(f"ALTER FUNCTION accs_claim_plain({ARGS}) SET enable_sort = off",
                                    f"ALTER FUNCTION accs_claim_plain({ARGS}) RESET enable_sort")]
