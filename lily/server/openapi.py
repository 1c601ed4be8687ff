"""The published OpenAPI schema: FastAPI's, with the errors this server really returns (never its 422)
and the model ids it serves."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi


ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def openapi_schema(app: FastAPI, model_names: list[str]) -> dict:
    """FastAPI's schema, with the errors this server really returns instead of its 422, and the
    model ids this server serves."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for body in ("ChatCompletionRequest", "CompletionRequest"):
        if body in comps:
            comps[body]["properties"]["model"]["enum"] = list(model_names)
    for op in schema.get("paths", {}).get("/v1/models/{model}", {}).values():
        for param in op.get("parameters", []):
            if param.get("name") == "model":
                param["schema"]["enum"] = list(model_names)
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps["ErrorResponse"] = ERROR_SCHEMA
    err = {"description": "an OpenAI-shaped error",
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    statuses = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model or path",
                "405": "method not allowed", "413": "body over the limit", "429": "queue full",
                "500": "internal fault", "503": "engine stopped"}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code, text in statuses.items():
                responses[code] = {**err, "description": text}
            responses["429"]["headers"] = {"Retry-After": {
                "description": "seconds to wait before trying again", "schema": {"type": "integer"}}}
            if method == "post":
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {}).setdefault("text/event-stream", {"schema": {
                    "type": "object", "description": "one server-sent event; data is a JSON chunk or [DONE]",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}})
    app.openapi_schema = schema
    return schema
