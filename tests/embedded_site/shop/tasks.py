try:  # Django 6 ships the Tasks framework; Django 5.2 has it from the django-tasks backport
    from django.tasks import task
except ImportError:
    from django_tasks import task


@task()
def receipt(reference: str) -> str:
    """Return the receipt line of an order."""
    return f"receipt for {reference}"
