"""Prometheus metrics endpoint (OPS4). Placeholder until the operators' capability lands."""

from django.http import HttpRequest, HttpResponse


def metrics_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("", content_type="text/plain; version=0.0.4")
