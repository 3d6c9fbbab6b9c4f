from django_tasks import task


@task()
def receipt(reference: str) -> str:
    """Return the receipt line of an order."""
    return f"receipt for {reference}"
