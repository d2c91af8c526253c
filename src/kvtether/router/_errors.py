"""OpenAI-style error responses of the router."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.responses import JSONResponse, Response

from kvtether.protocol import error_body

__all__ = ["RouterHTTPError", "UpstreamError", "error_response"]

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


class RouterHTTPError(Exception):
    """Raised inside the router to answer with an OpenAI-style error and status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


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

    def to_response(self) -> Response:
        if isinstance(self.body, dict) and "error" in self.body:
            return JSONResponse(self.body, status_code=self.status)
        return error_response(self.status, self.message)


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    type_ = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, type_, param=param, code=code), status_code=status)
