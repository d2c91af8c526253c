"""Helpers the tests share (a plain module: the repo's own ``tests`` package is imported too)."""

from __future__ import annotations

from openai import AsyncOpenAI

from tests.support.fake_router import FAST  # noqa: F401 (re-exported)



def plain_client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="router-key", max_retries=0)
