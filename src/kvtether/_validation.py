"""The first problem of a pydantic validation, as the pieces of a user-facing message.

Not part of the wire contract: a helper that every layer (CLI, router, connector, protocol
models) uses to turn a ``ValidationError`` into one clear sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

__all__ = ["FieldError", "first_field_error"]


@dataclass(frozen=True)
class FieldError:
    """The first problem pydantic found, in the pieces every user-facing message is made of.

    ``str()`` gives ``"<loc>: <msg>"``; callers prefix what was being validated
    (``"invalid heartbeat: ..."``) or, like the CLI, turn ``path`` into a flag name.
    """

    path: tuple[str, ...]  # pydantic's loc, as strings; empty for the whole value
    msg: str
    input: Any = None
    cause: BaseException | None = None  # an exception a validator raised, if any

    @property
    def loc(self) -> str:
        return ".".join(self.path) or "body"

    def __str__(self) -> str:
        return f"{self.loc}: {self.msg}"


def first_field_error(exc: ValidationError) -> FieldError:
    """The first error of ``exc``: one clear problem is more useful to a user than a list."""
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    return FieldError(
        path=tuple(str(x) for x in err["loc"]),
        msg=err["msg"],
        input=err.get("input"),
        cause=cause if isinstance(cause, BaseException) else None,
    )
