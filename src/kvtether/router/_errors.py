"""OpenAI-style error responses of the router."""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response

from kvtether.errors import KVTetherError
from kvtether.protocol import error_body

__all__ = ["RouterHTTPError", "UpstreamError", "anthropic_error_body", "error_response",
           "is_anthropic_path", "parse_json_body"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class RouterHTTPError(KVTetherError):
    """Raised inside the router to answer with an OpenAI-style error and status (the
    application maps it to the API's own error shape at the edge)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _no_constant(name: str) -> Any:
    # Python's json accepts NaN / Infinity; JSON (and the request sent on to vLLM) does not.
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(raw: bytes, what: str = "request body") -> Any:
    """A client's JSON body, or a 400 that says why not: not UTF-8, not JSON, or a number
    JSON has no spelling for (NaN, Infinity)."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RouterHTTPError(400, f"{what} is not valid JSON: {exc}") from None


class UpstreamError(RouterHTTPError):
    """vLLM answered with an error: relay its status and OpenAI-style body unchanged."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(status, message)
        self.body = body

    @classmethod
    def from_response(cls, response: httpx.Response) -> UpstreamError:
        """From an upstream answer whose body has been read."""
        try:
            body = response.json()
            message = body.get("error", {}).get("message") or body.get("message") or str(body)
        except ValueError:
            body, message = None, response.text[:500]
        return cls(response.status_code, message, body)

    def to_response(self, *, anthropic: bool = False) -> Response:
        if isinstance(self.body, dict) and "error" in self.body:
            if not anthropic or self.body.get("type") == "error":
                return JSONResponse(self.body, status_code=self.status)
        return error_response(self.status, self.message, anthropic=anthropic)


# Anthropic's error types (https://docs.anthropic.com/en/api/errors), by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_anthropic_path(path: str | None) -> bool:
    """Requests the router answers in Anthropic's shape (the Messages API)."""
    return bool(path) and path.startswith("/v1/messages")  # type: ignore[union-attr]


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    type_ = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type_, "message": message}}


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None,
    anthropic: bool = False,
) -> JSONResponse:
    """An OpenAI-style error (``{"error": {...}}``), or Anthropic's shape for ``anthropic``."""
    if anthropic:
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    type_ = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, type_, param=param, code=code), status_code=status)
