"""Worker-process idle settings: NIXL's progress-thread delay and vLLM's RPC spin window."""

from __future__ import annotations

import types

import pytest

from kvtether.connector._quiet import progress_thread_delay, shorten_rpc_spin

# A stand-in for nixl's _api module: its agent builds the binding's config and agent from the
# module-global ``nixlBind``, exactly the way nixl 1.5.1's ``nixl_agent.__init__`` does.
_FAKE_API = '''
class _Config:
    pthrDelay = None

class nixlBind:
    nixlAgentConfig = _Config
    built = []

    @staticmethod
    def nixlAgent(name, config):
        nixlBind.built.append((name, config.pthrDelay))
        return object()

class nixl_agent:
    def __init__(self, name):
        config = nixlBind.nixlAgentConfig()
        config.pthrDelay = 0
        self.agent = nixlBind.nixlAgent(name, config)
'''


@pytest.fixture
def fake_api() -> types.ModuleType:
    module = types.ModuleType("fake_nixl_api")
    exec(_FAKE_API, module.__dict__)
    return module


def test_agents_built_inside_get_the_delay_and_nixl_is_restored(fake_api) -> None:
    original = fake_api.nixlBind
    with progress_thread_delay(fake_api.nixl_agent, 2000):
        fake_api.nixl_agent("inside")
    fake_api.nixl_agent("after")
    assert fake_api.nixlBind is original
    assert original.built == [("inside", 2000), ("after", 0)]


def test_none_leaves_nixl_alone(fake_api) -> None:
    with progress_thread_delay(fake_api.nixl_agent, None):
        fake_api.nixl_agent("a")
    assert fake_api.nixlBind.built == [("a", 0)]


def test_restored_even_when_the_worker_fails_to_build(fake_api) -> None:
    original = fake_api.nixlBind
    with pytest.raises(RuntimeError), progress_thread_delay(fake_api.nixl_agent, 5):
        raise RuntimeError("worker init failed")
    assert fake_api.nixlBind is original


def test_an_agent_class_without_a_binding_is_reported_not_broken(caplog) -> None:
    class Other:
        def __init__(self) -> None:
            pass

    with progress_thread_delay(Other, 2000):
        Other()
    assert "busy-poll" in caplog.text


def test_real_nixl_agent_class_has_the_binding_this_relies_on() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.nixl_utils import NixlWrapper

    binding = NixlWrapper.__init__.__globals__.get("nixlBind")
    assert binding is not None and hasattr(binding.nixlAgentConfig(), "pthrDelay")


def test_rpc_readers_spin_no_longer_than_asked() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    # Built without __init__ (no zmq sockets): only the attributes vLLM 0.32's wait() reads.
    reader = SpinCondition.__new__(SpinCondition)
    reader.is_reader, reader.busy_loop_s = True, 1.0  # vLLM 0.32's default window
    writer = SpinCondition.__new__(SpinCondition)
    writer.is_reader, writer.busy_loop_s = False, 0
    assert shorten_rpc_spin(0.02) >= 1
    assert reader.busy_loop_s == 0.02 and writer.busy_loop_s == 0
    assert shorten_rpc_spin(None) == 0


def test_the_engine_core_side_shortens_its_spin_too(tmp_path, monkeypatch) -> None:
    # The engine core spins on the worker's response queue for every step of a loaded engine;
    # the connector's scheduler side (built in the engine-core process) shortens it there.
    pytest.importorskip("vllm")
    import kvtether.connector.nixl as nixl

    from .harness import Harness

    calls: list[float | None] = []
    monkeypatch.setattr(nixl, "shorten_rpc_spin", lambda s: calls.append(s) or 0)
    Harness(tmp_path, extra={"kvtether_rpc_busy_loop_s": 0.02})
    assert calls == [0.02]
