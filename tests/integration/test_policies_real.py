"""The baseline reuse policies on real vLLM P/D (tiny model), non-streamed turns.

``upstream`` (vLLM's NixlConnector, bidirectional, the last handle forwarded as is) reads
decode's KV on every non-streamed turn; ``off`` (one-way, prefill without a prefix cache)
never reuses anything and decode keeps nothing. Both answer exactly like the colocated
reference. Each test starts its own small stack (one at a time: 2-core machines).
"""

from __future__ import annotations

import random
import uuid

import httpx
import pytest

from tests.support.stacks import PORT_BASE
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm

WORDS = "please read the files and run the tests then tell me you are a helpful agent".split()
NO_SPECIAL = {"logit_bias": {str(i): -100 for i in range(4)}}  # replies re-send exactly
MAX_TOKENS = 24  # beyond prefill's cached prompt, more than the threshold to read


def _turns(base_url: str, reference_url: str, model: str, n: int,
           cid: str) -> list[httpx.Headers]:
    rng = random.Random(uuid.uuid4().int)
    msgs = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(30))},
            {"role": "user", "content": "run the tests"}]
    out = []
    for turn in range(1, n + 1):
        body = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0,
                **NO_SPECIAL}
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600,
                       headers={"X-Conversation-Id": cid})
        assert r.status_code == 200, r.text
        ref = httpx.post(f"{reference_url}/v1/chat/completions", json=body, timeout=600)
        text = r.json()["choices"][0]["message"]["content"]
        assert text == ref.json()["choices"][0]["message"]["content"], f"turn {turn} differs"
        out.append(r.headers)
        msgs = msgs + [{"role": "assistant", "content": text},
                       {"role": "user", "content": "ok " + rng.choice(WORDS)}]
    return out


def _kv_usage(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:kv_cache_usage_perc")]
    assert values, "vLLM exports no vllm:kv_cache_usage_perc"
    return max(values)


def _stack(tmp_path_factory: pytest.TempPathFactory, offset: int, **overrides):
    """A stack on its own ports (beside the session's pd_stack, if one runs)."""
    from kvtether.stack.launcher import Stack
    from kvtether.stack.settings import StackSettings

    settings = StackSettings(
        profile="cpu-tiny", state_dir=tmp_path_factory.mktemp("policy"), health_timeout_s=900,
        port=PORT_BASE + offset, base_port=PORT_BASE + 100 + offset,
        control_base_port=PORT_BASE + 200 + offset,
        side_channel_base_port=PORT_BASE - 2000 + 10 * offset, **overrides,
    )
    return Stack(settings, die_with_parent=True)


def test_upstream_reads_decode_kv_on_non_streamed_turns(tmp_path_factory, reference_vllm):
    # The upstream policy on kvtether's (idle-sleeping) connector, as `kvtether bench` runs
    # its baselines, with decode's fixed 480 s hold as the lease. On vLLM's own connector
    # (the policy's default) both engines busy-poll on CPU (docs/cpu-hosts.md):
    # in a CI run beside three other vLLM processes on 2 cores its first NIXL handshake
    # missed vLLM's fixed 5 s and the turn waiting on it hung for 10 minutes. vLLM's own
    # connector is exercised on the real stack by tests/bench/test_idle_bench.py.
    with _stack(tmp_path_factory, 20, reuse_policy="upstream", connector="kvtether",
                lease_ttl_s=480) as stack:
        cid = f"it-upstream-{uuid.uuid4().hex[:8]}"
        headers = _turns(stack.router_url, reference_vllm.base_url, stack.served_model_name, 3,
                         cid)
        assert [h["x-kvtether-reuse"] for h in headers] == ["miss:first_turn", "fired", "fired"]
        for prev, h in zip(headers, headers[1:], strict=False):
            # More than the previous prompt was not computed: only decode's KV holds that.
            assert int(h["x-kvtether-reused-tokens"]) > int(prev["x-kvtether-prompt-tokens"])
        # vLLM keeps the last turn's KV on decode under its own TTL; nobody frees it.
        assert _kv_usage(stack.decode_urls[0]) > 0
        r = httpx.delete(f"{stack.router_url}/v1/sessions/{cid}", timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "no_leases"


def test_off_never_reuses_and_decode_holds_nothing(tmp_path_factory, reference_vllm):
    # On kvtether's (idle-sleeping) connector, as `kvtether bench` runs pd-oneway: vLLM's own
    # busy-polls on CPU, and one CI run spent 283 s here on it (82 s in the run before).
    with _stack(tmp_path_factory, 30, reuse_policy="off", connector="kvtether",
                prefill_prefix_caching=False) as stack:
        headers = _turns(stack.router_url, reference_vllm.base_url, stack.served_model_name, 3,
                         f"it-off-{uuid.uuid4().hex[:8]}")
        assert [h["x-kvtether-reuse"] for h in headers] == [
            "miss:first_turn", "miss:not_retained", "miss:not_retained"]
        assert all(int(h["x-kvtether-reused-tokens"]) == 0 for h in headers)
        assert all(int(h["x-kvtether-reusable-tokens"]) > 16 for h in headers[1:])
        wait_for(lambda: _kv_usage(stack.decode_urls[0]) == 0, timeout_s=10, interval_s=0.5,
                 message="decode's KV cache to empty")

