"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, one clear line each."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from lily.server.protocol import unknown_format_field, unknown_structured_field

log = logging.getLogger("lily.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # sent with the answer (429's Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        headers = {**(self.headers or {}), **(headers or {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def _is_field_name(part) -> bool:
    """Pydantic error locations mix field names with union-branch tags ('str', 'list[TextPart]')."""
    if isinstance(part, int):
        return True
    return (isinstance(part, str) and part.isidentifier() and part.islower()
            and part not in ("str", "int", "float", "bool", "list", "dict", "none", "body"))


# messages are a union tagged by role, Responses input items one tagged by type; pydantic puts the tag in the
# location (messages.0.user.content, input.2.function_call_output.output)
UNION_TAGS = frozenset({"system", "developer", "user", "assistant", "tool", "function",
                        "message", "function_call", "function_call_output", "reasoning"})


# response_format (text.format on the Responses API) is a union tagged by type: response_format.json_schema.schema
# comes as response_format.json_schema.json_schema.schema, text.format.schema as text.format.json_schema.schema
FORMAT_FIELDS = frozenset({"response_format", "format"})
FORMAT_TAGS = frozenset({"text", "json_object", "json_schema"})


def _clean(loc) -> list:
    parts = [p for p in loc if _is_field_name(p)]
    tagged = bool(parts) and parts[0] in ("messages", "input")  # (tools[0].function is a field, not a tag)
    return [p for i, p in enumerate(parts)
            if not (i > 0 and ((tagged and p in UNION_TAGS and isinstance(parts[i - 1], int))
                               or (p in FORMAT_TAGS and parts[i - 1] in FORMAT_FIELDS)))]


def field_path(loc) -> str:
    out = ""
    for part in _clean(loc):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def validation_error(errors: list[dict]) -> APIError:
    """The most specific of pydantic's errors as one 400 line naming the field."""
    if not errors:
        return APIError(400, "invalid request body")
    # the deepest; at one depth, a union branch that took the value's type says what is wrong with it (input: []
    # is a list too short, not "a valid string")
    err = max(errors, key=lambda e: (len(_clean(e.get("loc", ()))), not str(e.get("type", "")).endswith("_type")))
    kind = err.get("type", "")
    path = field_path(err.get("loc", ()))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + str(detail) if detail else ''}")
    if not path:
        if kind == "missing":
            return APIError(400, "the request body is missing (expected a JSON object)")
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return APIError(400, "the request body must be a JSON object")
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # a tagged union: name the tag field
        ctx = err.get("ctx") or {}
        tag = str(ctx.get("discriminator", "")).strip("'\"")
        if tag.endswith("()"):  # a function tags the union (protocol._item_type): it reads the type field
            tag = "type"
        path = f"{path}.{tag}" if path else tag
        if kind == "union_tag_not_found":
            return APIError(400, f"{path}: field required", param=path)
        return APIError(400, f"{path}: {ctx.get('tag')!r} is not one of {ctx.get('expected_tags')}", param=path)
    if kind == "extra_forbidden":  # (only response_format's and structured_outputs' objects forbid unknown fields)
        loc = err.get("loc", ())
        why = unknown_structured_field(loc) if "structured_outputs" in loc else unknown_format_field(loc)
        return APIError(400, f"{path}: {why}", param=path or None)
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "missing":
        msg = "field required"
    elif "input" in err and kind not in ("missing",):
        shown = _short(err["input"])
        if shown is not None:
            msg += f" (got {shown})"
    return APIError(400, f"{path}: {msg}" if path else msg, param=path or None)


def is_json_type(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def wrong_content_type(content_type: str | None) -> APIError:
    """A JSON body sent as a form (curl -d) or without a type: the body is not read as JSON, so say why."""
    got = f"it came as {content_type.split(';')[0].strip()!r}" if content_type else "it came without one"
    return APIError(400, f"the request body must be JSON sent with 'Content-Type: application/json'; {got}")


def _short(value) -> str | None:
    if isinstance(value, (dict, list)) and len(json.dumps(value, default=str)) > 60:
        return None
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        return None
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app) -> None:
    """Every response that is not a success is an OpenAI-shaped error: validation never answers 422, and
    an unexpected fault answers a generic 500 and is logged."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        if err.param is None and not is_json_type(request.headers.get("content-type")):
            err = wrong_content_type(request.headers.get("content-type"))
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"no such endpoint: {request.method} {request.url.path}").response()
        if exc.status_code == 405:
            return APIError(405, f"method {request.method} is not allowed on {request.url.path}").response(
                headers=dict(exc.headers or {}))
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error").response()
