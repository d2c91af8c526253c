"""Helpers the tests share (a plain module: the repo's own ``tests`` package is imported too)."""

from __future__ import annotations

from openai import AsyncOpenAI

from kvtether.session import SessionSettings

FAST = SessionSettings(heartbeat_interval_s=0.05, request_timeout_s=1.0)


def plain_client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="router-key", max_retries=0)
