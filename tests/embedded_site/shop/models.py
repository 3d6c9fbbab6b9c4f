from django.db import models


class Order(models.Model):
    """An order whose packing runs as an ACCS job started in the same transaction."""

    reference = models.CharField(max_length=50, unique=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, null=True, related_name="orders")
