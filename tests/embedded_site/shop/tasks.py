try:  # Django 6 ships the Tasks framework; Django 5.2 has it from the django-tasks backport
    from django.tasks import task
except ImportError:
    from django_tasks import task


@task()
def receipt(reference: str, inputs: dict | None = None) -> str:
    """Return the receipt line of an order; as a step of the shop's pipeline, ``inputs`` holds what ``pick``
    returned (ACCS gives a ``@task`` step that declares ``inputs`` its parents' outputs there)."""
    if inputs is None:
        return f"receipt for {reference}"
    return f"receipt for {reference}: {inputs['pick']['items']} item(s)"
