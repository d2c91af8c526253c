"""Error bodies (OpenAI's shape)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


# --- errors -------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """OpenAI-style error body."""

    error: ErrorDetail


def error_body(message: str, type_: str, *, param: str | None = None, code: Any = None) -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()
