"""The router and the front keep idle client connections longer than clients keep them."""

from __future__ import annotations

from typing import Any

import httpx
import openai._constants
import pytest

from kvtether import router
from kvtether.router import front


def test_servers_outlast_the_client_pools_idle_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    runs: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    router.serve(router.RouterSettings(decode_urls=["http://127.0.0.1:9"]))
    front.serve_front(front.FrontSettings(upstream_urls=["http://127.0.0.1:9"]))
    clients = max(httpx.Limits().keepalive_expiry or 0,
                  openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry or 0)
    # equal timers let a client send on a connection the server is closing
    assert [kw["timeout_keep_alive"] > clients for kw in runs] == [True, True]
