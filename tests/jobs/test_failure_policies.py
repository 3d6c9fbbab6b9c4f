"""DAG failure policies per step: fail the job, continue independent branches, always-run steps.

Driven through the engine's real claim and report path (no daemons), on a real PostgreSQL. Each
step has its own service that gives up after one attempt, so one failed report is a final failure.
"""

from __future__ import annotations

from typing import Any

import pytest

from events.models import Event
from events.timeline import unfold
from jobs import api, transitions
from jobs.models import Job, JobStep, Task
from nodes.models import Host, HostBlock, Node
from ops.dag import job_dag_svg, render_svg, steps_from
from tests.engine_helpers import claim_for, run_fail, run_ok
from workflows.api import create_workflow
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db


def step(key: str, *deps: str, **policy: Any) -> dict[str, Any]:
    return {"key": key, "service": f"svc-{key}", "depends_on": list(deps), **policy}


@pytest.fixture
def flow(make_service):
    """Create a workflow of ``steps`` (one single-attempt service per step) and start one job of it."""

    def make(*steps: dict[str, Any], name: str = "wf") -> Job:
        for s in steps:
            if not Service.objects.filter(key=s["service"]).exists():
                make_service(s["service"], max_attempts=1)
        create_workflow(name=name, steps=list(steps))
        return api.start_workflow(name)

    return make


def run(key: str, *, ok: bool = True) -> None:
    """Claim the one queued task of step ``key`` and report it succeeded or failed."""
    tasks = claim_for(Service.objects.get(key=f"svc-{key}"))
    assert len(tasks) == 1, f"step {key} should have exactly one claimable task, got {len(tasks)}"
    (run_ok if ok else run_fail)(tasks)


def statuses(job: Job) -> dict[str, str]:
    return dict(Task.objects.filter(job=job).values_list("step_key", "status"))


def job_state(job: Job) -> tuple[str, str]:
    job.refresh_from_db()
    return job.status, job.error_code


def job_lines(job: Job) -> list[Event]:
    """The job's own status lines, as the timeline shows them (a report folds them into its tasks' rows)."""
    return [line for e in Event.objects.filter(job_id=job.id, type="status").order_by("id")
            for line in unfold(e) if line.task_id is None]


def job_messages(job: Job) -> list[str]:
    return [line.message for line in job_lines(job)]


def diamond(**b_policy: Any) -> list[dict[str, Any]]:
    return [step("a"), step("b", "a", **b_policy), step("c", "a"), step("d", "b", "c")]


# --------------------------------------------------------------------------------------------
# fail_job (the default)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [{}, {"on_failure": "fail_job"}, {"on_failure": "fail_job", "always": False}],
                         ids=["no-policy-fields", "explicit-fail_job", "explicit-fail_job-always-false"])
def test_fail_job_step_failing_for_good_fails_the_job_at_once_and_skips_its_unstarted_tasks(flow, policy):
    job = flow(*diamond(**policy))
    run("a")
    run("b", ok=False)
    assert job_state(job) == ("error", "task_failed")
    assert statuses(job) == {"a": "done", "b": "error", "c": "skipped", "d": "skipped"}
    assert job.finished_at is not None and "failed" in job.error_message
    assert job_messages(job)[-1] == "job running → error"
    assert set(JobStep.objects.filter(job=job).values_list("on_failure", "always")) == {("fail_job", False)}


def test_workflow_without_policy_fields_writes_the_same_timeline_as_before(flow):
    """Regression: the events of a default workflow whose step fails are exactly today's."""
    job = flow(step("first"), step("second", "first"))
    run("first", ok=False)
    events = [(line.type, line.message) for e in Event.objects.filter(job_id=job.id).exclude(type="log").order_by("id")
              for line in unfold(e)]
    assert events == [
        ("status", "job created queued"), ("status", "job queued → waiting (tasks created)"),
        ("status", "task created queued"), ("status", "task created waiting"),
        ("status", "task queued → starting"), ("status", "job waiting → running"),
        ("status", "task starting → running"),
        ("status", "task running → error (final after 1/1 attempts): boom"),
        ("status", "job running → error"),
        ("status", "task waiting → skipped (job failed)"),
    ]
    assert not Event.objects.filter(job_id=job.id, type="policy").exists()


# --------------------------------------------------------------------------------------------
# continue
# --------------------------------------------------------------------------------------------

def test_continue_step_failing_in_a_diamond_skips_its_dependent_lets_the_sibling_finish_and_ends_partial(flow):
    job = flow(*diamond(on_failure="continue"))
    run("a")
    run("b", ok=False)
    assert statuses(job) == {"a": "done", "b": "error", "c": "queued", "d": "skipped"}
    assert job_state(job) == ("waiting", ""), "the job goes on while the independent sibling can run"
    run("c")
    assert statuses(job) == {"a": "done", "b": "error", "c": "done", "d": "skipped"}
    assert job_state(job) == ("partial", "steps_failed")
    assert job.error_message == ('1 task(s) of 1 step(s) with on_failure "continue" failed; '
                                 "their dependents were skipped")
    assert job_messages(job)[-1] == ('job running → partial (1 task(s) of 1 step(s) with on_failure "continue" '
                                     "failed; their dependents were skipped)")
    (end,) = [line for line in job_lines(job) if line.data["to"] == "partial"]
    assert (end.level, end.data["continue_failed"], end.data["continue_failed_steps"]) == ("warn", 1, 1)
    policy = Event.objects.get(job_id=job.id, type="policy")
    assert policy.task_id == Task.objects.get(job=job, step_key="b").id
    assert "step b failed for good; on_failure continue" in policy.message
    skipped = Event.objects.get(job_id=job.id, task__step_key="d", data__to="skipped")
    assert skipped.message == "task waiting → skipped (a dependency did not succeed)"


def test_continue_failure_skips_every_transitive_dependent_while_an_independent_branch_completes(flow):
    job = flow(step("a", on_failure="continue"), step("b", "a"), step("c", "b"), step("d", "c"),
               step("x"), step("y", "x"))
    run("a", ok=False)
    assert statuses(job) == {"a": "error", "b": "skipped", "c": "skipped", "d": "skipped",
                             "x": "queued", "y": "waiting"}
    run("x")
    run("y")
    assert statuses(job)["y"] == "done"
    assert job_state(job) == ("partial", "steps_failed")


def test_a_fail_job_failure_beside_a_continue_failure_ends_the_job_in_error(flow):
    job = flow(step("a", on_failure="continue"), step("x"), step("y", "x"))
    run("a", ok=False)
    assert job_state(job)[0] == "waiting"
    run("x", ok=False)
    assert job_state(job) == ("error", "task_failed")
    assert statuses(job) == {"a": "error", "x": "error", "y": "skipped"}


def test_continue_fan_out_with_a_failed_and_a_blocked_host_ends_partial_naming_both(make_service):
    """Fan-out jobs are instantiated by the builder's path: the policy reaches its step rows too."""
    ping = make_service("svc-ping", max_attempts=1)
    make_service("svc-report")
    make_service("svc-notify")
    create_workflow(name="fan", steps=[step("ping", fan_out="hosts", on_failure="continue"),
                                       step("report", "ping"), step("notify", "ping", always=True)])
    Node.objects.create(name="node-t")
    hosts = [Host.objects.create(name=n, node_id="node-t") for n in ("h1", "h2", "h3")]
    HostBlock.objects.create(host=hosts[2], service=ping)
    job = api.start_workflow("fan", options={"hosts": ["h1", "h2", "h3"]})
    assert dict(JobStep.objects.filter(job=job).values_list("step_key", "on_failure")) == {
        "ping": "continue", "report": "fail_job", "notify": "fail_job"}
    assert dict(Task.objects.filter(job=job).values_list("task_key", "status")) == {
        "ping@h1": "queued", "ping@h2": "queued", "ping@h3": "blocked", "report": "skipped", "notify": "waiting"}
    first, second = sorted(claim_for(ping), key=lambda t: t.task_key)
    run_fail([first])
    assert statuses(job)["notify"] == "waiting", "an always step waits for every task of its dependency"
    run_ok([second])
    run("notify")
    assert job_state(job) == ("partial", "steps_failed")
    assert job.error_message == ('1 task(s) of 1 step(s) with on_failure "continue" failed; their dependents were '
                                 "skipped; 1 of 5 task(s) blocked on their host")


# --------------------------------------------------------------------------------------------
# always
# --------------------------------------------------------------------------------------------

def test_always_step_after_a_fail_job_failure_runs_once_every_dependency_is_final_then_the_job_ends_error(flow):
    job = flow(step("build"), step("deploy", "build"), step("slow"),
               step("cleanup", "build", "slow", always=True))
    slow = claim_for(Service.objects.get(key="svc-slow"))
    transitions.mark_running([(t.id, t.attempt, 1) for t in slow], agent_id="agent-t", source="agent:test")
    run("build", ok=False)
    assert statuses(job) == {"build": "error", "deploy": "skipped", "slow": "running", "cleanup": "waiting"}
    assert job_state(job)[0] == "running", "the job waits for its always step"
    assert Event.objects.filter(job_id=job.id, type="policy", message__contains="always-run steps run").exists()
    assert claim_for(Service.objects.get(key="svc-cleanup")) == [], "not before every dependency is final"
    transitions.report([transitions.Outcome(task_id=slow[0].id, attempt=slow[0].attempt, status="succeeded")],
                       agent_id="agent-t", source="agent:test")
    assert statuses(job)["cleanup"] == "queued"
    promoted = Event.objects.get(job_id=job.id, task__step_key="cleanup", data__to="queued")
    assert promoted.data["from"] == "waiting"
    run("cleanup")
    assert statuses(job) == {"build": "error", "deploy": "skipped", "slow": "done", "cleanup": "done"}
    assert job_state(job) == ("error", "task_failed")
    assert job_messages(job)[-1] == 'job running → error (1 task(s) of on_failure "fail_job" steps failed)'


def test_always_step_after_a_continue_failure_runs_and_the_job_ends_partial(flow):
    job = flow(step("build", on_failure="continue"), step("deploy", "build"),
               step("cleanup", "deploy", always=True))
    run("build", ok=False)
    assert statuses(job) == {"build": "error", "deploy": "skipped", "cleanup": "queued"}
    run("cleanup")
    assert job_state(job) == ("partial", "steps_failed")


def test_always_step_after_a_successful_path_runs_normally_and_the_job_is_done(flow):
    job = flow(step("work"), step("notify", "work", always=True))
    assert statuses(job) == {"work": "queued", "notify": "waiting"}
    run("work")
    assert statuses(job)["notify"] == "queued"
    run("notify")
    assert job_state(job) == ("done", "")
    assert not Event.objects.filter(job_id=job.id, type="policy").exists()


def test_failing_always_step_follows_its_own_policy(flow):
    job = flow(step("work"), step("cleanup", "work", always=True, on_failure="continue"))
    run("work")
    run("cleanup", ok=False)
    assert job_state(job) == ("partial", "steps_failed")
    job = flow(step("work2"), step("cleanup2", "work2", always=True), name="wf2")
    run("work2")
    run("cleanup2", ok=False)
    assert job_state(job) == ("error", "task_failed")


def test_canceling_the_job_cancels_its_always_steps_too(flow):
    job = flow(step("work"), step("cleanup", "work", always=True))
    assert transitions.cancel_job(job.id, by="op").changed
    assert statuses(job) == {"work": "canceled", "cleanup": "canceled"}
    assert job_state(job)[0] == "canceled"


# --------------------------------------------------------------------------------------------
# Operator retry of a partial job
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", ["retry_job", "retry_task"])
def test_retrying_a_partial_job_reruns_the_failed_step_and_its_skipped_dependents_and_ends_done(flow, verb):
    job = flow(*diamond(on_failure="continue"))
    run("a")
    run("b", ok=False)
    run("c")
    assert job_state(job)[0] == "partial"
    if verb == "retry_job":
        result = transitions.retry_job(job.id, by="op")
    else:
        result = transitions.retry_task(Task.objects.get(job=job, step_key="b").id, by="op")
    assert result.changed, result.message
    assert statuses(job) == {"a": "done", "b": "queued", "c": "done", "d": "waiting"}
    assert job_state(job) == ("waiting", "")
    run("b")
    assert statuses(job)["d"] == "queued"
    run("d")
    assert job_state(job) == ("done", "")
    assert statuses(job) == dict.fromkeys("abcd", "done")


def test_retrying_a_failed_continue_step_while_the_job_still_runs_gives_its_skipped_dependents_another_chance(flow):
    job = flow(*diamond(on_failure="continue"))
    run("a")
    c = claim_for(Service.objects.get(key="svc-c"))
    transitions.mark_running([(t.id, t.attempt, 1) for t in c], agent_id="agent-t", source="agent:test")
    run("b", ok=False)
    assert statuses(job) == {"a": "done", "b": "error", "c": "running", "d": "skipped"}
    assert transitions.retry_task(Task.objects.get(job=job, step_key="b").id, by="op").changed
    assert statuses(job) == {"a": "done", "b": "queued", "c": "running", "d": "waiting"}
    run("b")
    transitions.report([transitions.Outcome(task_id=c[0].id, attempt=c[0].attempt, status="succeeded")],
                       agent_id="agent-t", source="agent:test")
    run("d")
    assert job_state(job) == ("done", "")


# --------------------------------------------------------------------------------------------
# Validation and the DAG picture
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("policy", "expected"), [
    ({"on_failure": "explode"},
     "step 'b': on_failure must be one of ['fail_job', 'continue'] or absent, got 'explode'"),
    ({"on_failure": True}, "step 'b': on_failure must be one of ['fail_job', 'continue']"),
    ({"always": "yes"}, "step 'b': always must be true or false (a JSON boolean) or absent, got 'yes'"),
    ({"always": 1}, "step 'b': always must be true or false"),
])
def test_bad_policy_fields_are_rejected_naming_the_step_and_field_and_nothing_is_saved(make_service, policy, expected):
    make_service("svc-a")
    make_service("svc-b")
    with pytest.raises(DefinitionError) as info:
        create_workflow(name="wf", steps=[step("a"), step("b", "a", **policy)])
    assert expected in "\n".join(str(p) for p in info.value.problems)
    assert Workflow.objects.count() == 0


def test_dag_picture_marks_continue_and_always_steps_and_explains_them_in_the_legend(flow):
    definition = [step("a"), step("b", "a", on_failure="continue"), step("c", "b", always=True)]
    svg = render_svg(steps_from(definition, []))
    assert 'data-step="b" data-status="pending" data-on-failure="continue" data-always="false"' in svg
    assert 'data-step="c" data-status="pending" data-on-failure="fail_job" data-always="true"' in svg
    assert 'class="step status-pending policy-continue"' in svg
    assert 'class="step status-pending policy-always"' in svg
    assert svg.count('class="policy-tag"') == 2, "only the steps with a policy carry a tag"
    assert svg.count('class="policy-legend"') == 2
    assert "↷ continue" in svg and "⟳ always" in svg
    job = flow(*definition)
    run("a")
    run("b", ok=False)
    page = job_dag_svg(job)
    assert 'class="step status-error policy-continue"' in page
    assert 'class="step status-queued policy-always"' in page


# --------------------------------------------------------------------------------------------
# What a retry re-admits
# --------------------------------------------------------------------------------------------

def test_retrying_one_failed_task_readmits_its_dependents_only_not_tasks_skipped_by_another_failure(flow):
    job = flow(step("a"), step("b", "a"), step("x"), step("y", "x"), step("z"))
    x = claim_for(Service.objects.get(key="svc-x"))
    transitions.mark_running([(t.id, t.attempt, 1) for t in x], agent_id="agent-t", source="agent:test")
    run("a", ok=False)
    run_fail(x)
    assert statuses(job) == {"a": "error", "b": "skipped", "x": "error", "y": "skipped", "z": "skipped"}
    assert job_state(job)[0] == "error"

    assert transitions.retry_task(Task.objects.get(job=job, step_key="a").id, by="op").changed
    # x's failure still fails the job: what the job's failure skipped, and x's dependent, stay skipped.
    assert statuses(job) == {"a": "queued", "b": "waiting", "x": "error", "y": "skipped", "z": "skipped"}
    assert claim_for(Service.objects.get(key="svc-z")) == []
    run("a")
    run("b")
    assert job_state(job) == ("error", "task_failed")
    assert statuses(job)["z"] == "skipped"

    assert transitions.retry_task(Task.objects.get(job=job, step_key="x").id, by="op").changed
    # No fail_job failure is left: what the job's failure skipped gets its chance now.
    assert statuses(job) == {"a": "done", "b": "done", "x": "queued", "y": "waiting", "z": "queued"}
    run("x")
    run("y")
    run("z")
    assert job_state(job) == ("done", "")


def test_an_always_step_queued_after_a_failure_waits_again_while_a_retried_dependency_runs(flow):
    job = flow(step("build"), step("slow"), step("cleanup", "build", "slow", always=True))
    run("slow")
    run("build", ok=False)
    assert statuses(job) == {"build": "error", "slow": "done", "cleanup": "queued"}
    assert transitions.retry_task(Task.objects.get(job=job, step_key="build").id, by="op").changed
    assert statuses(job) == {"build": "queued", "slow": "done", "cleanup": "waiting"}
    assert claim_for(Service.objects.get(key="svc-cleanup")) == [], "not before every dependency is final again"
    assert Event.objects.filter(job_id=job.id, task__step_key="cleanup", data__from="queued",
                                data__to="waiting").exists()
    run("build")
    assert statuses(job)["cleanup"] == "queued"
    run("cleanup")
    assert job_state(job) == ("done", "")


@pytest.mark.parametrize("verb", ["retry_task", "retry_job"])
def test_a_task_retried_after_its_service_was_blocked_on_its_host_becomes_blocked_not_queued(make_service, verb):
    ping = make_service("svc-ping", max_attempts=1)
    create_workflow(name="fan", steps=[step("ping", fan_out="hosts")])
    Node.objects.create(name="node-t")
    hosts = [Host.objects.create(name=n, node_id="node-t") for n in ("h1", "h2")]
    job = api.start_workflow("fan", options={"hosts": ["h1", "h2"]})
    first, second = sorted(claim_for(ping), key=lambda t: t.task_key)
    run_ok([second])
    run_fail([first])
    assert job_state(job)[0] == "error"
    HostBlock.objects.create(host=hosts[0], service=ping, reason="disk replaced")  # placed while it was failed
    if verb == "retry_task":
        result = transitions.retry_task(first.id, by="op")
        assert result.message == "task blocked: svc-ping is blocked on h1; remove the block to run it"
    else:
        assert transitions.retry_job(job.id, by="op").changed
    task = Task.objects.get(id=first.id)
    assert (task.status, task.error_code) == ("blocked", "host_blocked")
    assert claim_for(ping) == []
    assert job_state(job) == ("partial", "hosts_blocked")
    HostBlock.objects.all().delete()
    assert transitions.retry_task(first.id, by="op").changed, "once the block is gone, a retry runs it"
    run_ok(claim_for(ping))
    assert job_state(job) == ("done", "")
