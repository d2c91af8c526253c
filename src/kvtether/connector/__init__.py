"""The kvtether vLLM KV connector (loaded inside vLLM; the only package that imports vLLM).

vLLM loads :mod:`kvtether.connector.nixl` through ``kv_connector_module_path``; importing this
package itself does not import vLLM. Parts:

* ``nixl`` — the connector: vLLM's NIXL pull connector plus leases, handle publication and
  the prefill-side prefix check (imports vLLM; checks its version first).
* ``scheduler`` — vLLM ``--scheduler-cls``: ``TetherScheduler`` reports engine steps and
  answers prefix-cache lookups; ``IdleSleepScheduler`` also lets an engine that only holds KV
  for a remote reader sleep until there is work (imports vLLM).
* ``worker`` — ``WatchedCPUWorker`` (vLLM ``--worker-cls``): vLLM's CPU worker with each
  engine-step RPC watched for a stall (imports vLLM).
* ``_sides`` — the prefill and decode sides of a turn that the connector's scheduler hands
  each request to.
* ``_timings`` — a request's leg timings inside the engine; the step in flight.
* ``_idle`` — when a sleeping engine wakes (deadlines, control operations, a slow tick).
* ``_quiet`` — worker-process idle settings: NIXL progress-thread delay, RPC spin window.
* ``_stall`` — a worker step that does not end is logged with every thread's stack.
* ``_leases`` — the lease table shared by the engine loop and the control channel.
* ``_control`` — the HTTP control channel (``/kvtether/v1/...``, see :mod:`kvtether.protocol`).
* ``_prefix`` — block-hash prefix identity: what decode adds to a handle, what prefill checks.
* ``_settings`` — ``kvtether_*`` keys of ``kv_connector_extra_config``.
* ``_compat`` — the one vLLM version this targets (no vLLM import); ``_compat.upstream``
  every private vLLM name the connector uses, imported after the version check;
  ``_compat.cpu`` vLLM's CPU worker, likewise.
"""

from kvtether.connector._compat import TARGET_VLLM_VERSION, VLLMVersionError, check_vllm_version

__all__ = ["TARGET_VLLM_VERSION", "VLLMVersionError", "check_vllm_version"]
