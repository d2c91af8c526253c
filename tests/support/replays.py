"""The bench's replay against the fake vLLM over real HTTP, for the bench tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvtether.bench.scenario import Scenario, generate_scenario
from kvtether.bench.strategies import Endpoints
from tests.support.fake_vllm import BLOCK_SIZE, MODEL, FakeVLLM
from tests.support.servers import AppServer

__all__ = ["COMPRESS", "endpoints", "serving", "small_scenario"]

COMPRESS = 200.0  # tool and think gaps of a few workload minutes last about a second


@contextlib.contextmanager
def serving(make: Any) -> Iterator[FakeVLLM]:
    """``make(port)`` -> a fake, served over HTTP on that port from a thread."""
    with AppServer() as server:
        fake = make(server.port)
        server.start(fake.app, name="fake-vllm", lifespan="off")
        yield fake


def endpoints(fake: FakeVLLM) -> Endpoints:
    return Endpoints(openai_base_url=f"{fake.url}/v1", router_url=None, kv_urls=[],
                     served_model_name=MODEL, block_size=BLOCK_SIZE, recompute_threshold=16)


def small_scenario(sessions: int, *, arrival_s: float = 3600.0) -> Scenario:
    return generate_scenario(sessions, seed=2, turns=(3, 4), context_tokens=700,
                             system_tokens=200, max_output_tokens=16, long_tools=0,
                             arrival_s=arrival_s)
