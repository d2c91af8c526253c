"""JSON on the router's hot path: the legs' requests, vLLM's answers and every streamed chunk.

An agent's request is hundreds of kilobytes (a 30 K-token conversation), and the first chunk of
a decode leg carries the prompt's token ids: with the standard library, writing and parsing
them cost the router several milliseconds a turn on a loaded 2-core host, several times what
orjson takes. Where orjson refuses something the standard library accepts (an integer past 64
bits, a lone surrogate), the standard library does it. Only what vLLM wrote is parsed here:
orjson reads an integer past 64 bits as a float, so a client's body is parsed by the standard
library (:func:`kvtether.router._errors.parse_json_body`).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps", "loads"]


def loads(raw: bytes | str) -> Any:
    """What vLLM wrote, parsed; raises ``ValueError`` where ``json.loads`` does."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON, UTF-8."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: a big integer, a lone surrogate, a subclass
        return json.dumps(obj, separators=(",", ":")).encode()
