"""Test support: the fakes and helpers that tests, the integrations' tests and the benchmarks
share, imported as ``tests.support.<module>`` from the repository root (``python -m pytest``,
``python -m benchmarks.<script>``). Fixtures stay in the conftest files; those of the fake
router are defined next to it and imported into each conftest that serves it.

- :mod:`~tests.support.waiting`: ``wait_for`` / ``await_for``, polling a condition with a deadline.
- :mod:`~tests.support.servers`: ASGI apps under uvicorn in a thread, on a socket bound first.
- :mod:`~tests.support.fake_router`: a stand-in kvtether router for the session layer and the
  integrations, with its fixtures.
- :mod:`~tests.support.fake_vllm`: fake vLLM P/D instances, their ``Cluster`` and the
  ``RoutingTransport`` that reaches them in-process.
- :mod:`~tests.support.fake_servers`: those fakes over real HTTP, in a process of their own.
- :mod:`~tests.support.router_harness`: the router in-process over the fakes (``make_router``).
- :mod:`~tests.support.load`: many agent conversations at once through that router.
- :mod:`~tests.support.redis_server`: a real redis-server for the store tests.
- :mod:`~tests.support.harness_replay`: the recorded coding-agent sessions
  (``tests/fixtures/harnesses``) replayed on a router, each earlier answer replaced by the
  stack's.
- :mod:`~tests.support.stacks`: what the real-vLLM tests share (ports, stack handles,
  supervision, in-process routers over a stack).
- :mod:`~tests.support.public_api`: the static check that the integrations read no other
  package's private names.
"""
