"""Fixtures of the bench tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvtether.bench.strategies import Endpoints, Strategy, StrategyOptions
from tests.support.fake_vllm import Cluster, FakeVLLM
from tests.support.replays import endpoints, serving


@dataclass
class FakeStarts:
    """A ``start`` hook for the bench's runs: every strategy is the one fake vLLM, served over
    HTTP; ``started`` lists the strategies in the order they were started."""

    fake: FakeVLLM
    started: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def start(self, strategy: Strategy, opts: StrategyOptions) -> Iterator[Endpoints]:
        self.started.append(strategy.name)
        yield endpoints(self.fake)


@pytest.fixture
def fake_starts() -> Iterator[FakeStarts]:
    with serving(lambda port: FakeVLLM(Cluster(), "fake", "127.0.0.1", port)) as fake:
        yield FakeStarts(fake)
