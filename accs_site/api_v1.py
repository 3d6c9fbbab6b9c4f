"""The HTTP API under /api/v1/ (django-ninja; OpenAPI at /api/v1/openapi.json)."""

from ninja import NinjaAPI

api = NinjaAPI(title="ACCS API", version="1.0.0", urls_namespace="api-v1")


@api.get("/health", auth=None, summary="Liveness probe")
def health(request) -> dict:
    return {"status": "ok"}
