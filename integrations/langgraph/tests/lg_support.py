"""Helpers shared by the integration's tests (a plain module: the test folder is no package,
so it cannot clash with the core's ``tests`` package it imports the fake router from)."""

from __future__ import annotations

import json
from typing import Any

from langchain_openai import ChatOpenAI

from tests.support.fake_router import FAST, FakeRouter, heartbeat_threads  # noqa: F401



def chat_model(router: FakeRouter, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model="fake", base_url=router.url + "/v1", api_key="test", max_retries=0, **kwargs
    )


def tool_call_reply(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        ]
    }
