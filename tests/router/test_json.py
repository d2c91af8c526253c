"""The router's hot-path JSON (:mod:`kvtether.router._json`): orjson's speed, the standard
library's results where orjson would refuse or differ."""

from __future__ import annotations

import json

import pytest

from kvtether.router import _json


@pytest.mark.parametrize("value", [
    {"model": "m", "messages": [{"role": "user", "content": "héllo 日本"}], "max_tokens": 8},
    {"kv_transfer_params": {"prompt_token_ids": list(range(3000))}},
    {"seed": 2**70},  # past 64 bits: orjson refuses, the standard library writes it
    {"text": "\ud800"},  # a lone surrogate, as json.loads can return one
    {"x": 1.5e-7, "y": None, "z": [True, False]},
])
def test_what_is_written_reads_back_as_the_same_value(value: object) -> None:
    assert json.loads(_json.dumps(value)) == value


def test_what_vllm_wrote_parses_as_with_the_standard_library() -> None:
    line = '{"id":"c","choices":[{"delta":{"content":"é"},"token_ids":[5]}],"prompt_token_ids":[1,2]}'
    assert _json.loads(line) == json.loads(line) == _json.loads(line.encode())
    assert _json.loads('{"s": "\\ud800"}') == {"s": "\ud800"}  # orjson refuses; json reads it


@pytest.mark.parametrize("raw", [b"{", b"\xff", b"", b"[1,]"])
def test_what_is_not_json_raises_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        _json.loads(raw)
