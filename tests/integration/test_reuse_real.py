"""Issue 2 on real vLLM P/D (tiny model): reuse fires across turns, output never changes."""

from __future__ import annotations

import json
import random
import time
import uuid

import httpx
import pytest

pytestmark = pytest.mark.vllm

SYSTEM = "you are a helpful agent. " * 12
TOOL_RESULT = "ok tests run result found file path value true " * 4


def _chat(
    base_url: str, body: dict, *, cid: str | None, stream: bool
) -> tuple[dict, list[int], str]:
    """One chat turn; returns (headers, output token ids, text)."""
    body = dict(body, stream=stream, return_token_ids=True, temperature=0)
    headers = {"X-Conversation-Id": cid} if cid else {}
    if not stream:
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=600)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return dict(r.headers), choice["token_ids"], choice["message"]["content"] or ""
    ids: list[int] = []
    text = ""
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=600
    ) as r:
        assert r.status_code == 200, r.read()
        h = dict(r.headers)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids.extend(c.get("token_ids") or [])
                    text += c["delta"].get("content") or ""
    return h, ids, text


def _from_prefill(stack) -> float:
    """Streamed turns whose first token the router sent from prefill's answer."""
    text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
    name = "kvtether_first_token_from_prefill_total "
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _release(stack, cid: str) -> None:
    # Idle retained KV keeps vLLM's CPU decode engine stepping: free it for the next test.
    httpx.delete(f"{stack.base_url}/v1/sessions/{cid}", timeout=60)


def _conversation(n_turns: int):
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "please read the files and run the tests then tell me"},
    ]
    return msgs


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_four_turns_fire_and_match_reference(pd_stack, reference_vllm, stream):
    cid = f"it-{uuid.uuid4().hex[:8]}"
    msgs = _conversation(4)
    bs = pd_stack.block_size_tokens
    prev_total = 0
    led_before = _from_prefill(pd_stack)
    for turn in range(1, 5):
        body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 12}
        h, ids, text = _chat(pd_stack.base_url, body, cid=cid, stream=stream)
        _, ref_ids, _ = _chat(reference_vllm.base_url, body, cid=None, stream=False)
        assert ids == ref_ids, f"turn {turn}: output differs from the colocated reference"
        outcome, reused = h["x-kvtether-reuse"], int(h["x-kvtether-reused-tokens"])
        if turn == 1:
            assert outcome == "miss:first_turn"
        else:
            assert outcome == "fired", f"turn {turn}: {outcome}"
            # D retains prompt + output minus the last sampled token, whose KV never existed.
            assert reused >= ((prev_total - 1) // bs) * bs, (turn, reused, prev_total)
        prev_total = int(h["x-kvtether-prompt-tokens"]) + len(ids)
        if stream:
            # Greedy and streamed: the first token came from prefill's answer (the router
            # dropped decode's copy), and the stream still equals the reference.
            assert _from_prefill(pd_stack) - led_before == turn
        msgs = msgs + [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": TOOL_RESULT},
        ]
    _release(pd_stack, cid)


def test_rewritten_history_salvages_the_matching_prefix_and_is_correct(pd_stack, reference_vllm):
    cid = f"it-{uuid.uuid4().hex[:8]}"
    msgs = _conversation(2)
    body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 12}
    _, _, text = _chat(pd_stack.base_url, body, cid=cid, stream=False)
    # The client rewrites history: the user message changes after the long system prompt.
    edited = [
        msgs[0],
        {"role": "user", "content": "please list the files and run the tests then tell me"},
        {"role": "assistant", "content": text},
        {"role": "tool", "content": TOOL_RESULT},
    ]
    body = {"model": pd_stack.model, "messages": edited, "max_tokens": 12}
    h, ids, _ = _chat(pd_stack.base_url, body, cid=cid, stream=False)
    _, ref_ids, _ = _chat(reference_vllm.base_url, body, cid=None, stream=False)
    assert ids == ref_ids
    salvaged = int(h["x-kvtether-salvaged-tokens"])
    assert salvaged % pd_stack.block_size_tokens == 0
    assert salvaged > 0  # the long system prompt still matches
    # Everything before the edit was reused (decode's whole blocks, or prefill's own cache):
    # nothing reusable was lost, so reuse fired.
    reused, reusable = int(h["x-kvtether-reused-tokens"]), int(h["x-kvtether-reusable-tokens"])
    assert h["x-kvtether-reuse"] == "fired", h
    assert reused >= salvaged and 0 <= reusable - reused < pd_stack.block_size_tokens, h
    _release(pd_stack, cid)


def test_a_remainder_below_the_threshold_after_a_local_hit_fired(pd_stack, reference_vllm):
    """Prefill's own prefix cache holds turn 1's prompt; decode holds it plus one answer token:
    fewer new tokens than vLLM's kv_recompute_threshold, so prefill recomputes them rather than
    read them. That is all it could reuse, so the turn fired (it used to say below_threshold)."""
    bs = pd_stack.block_size_tokens
    words = "please read the files and run the tests then tell me".split()
    rng = random.Random(uuid.uuid4().int)
    msgs = None
    small = min(bs, 16) - 4  # below vLLM's kv_recompute_threshold (16) with the answer token
    for _ in range(200):  # a prompt whose last partial block is short: 2..small tokens
        user = " ".join(rng.choice(words) for _ in range(rng.randint(12, 40)))
        candidate = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        r = httpx.post(f"{pd_stack.prefill_urls[0]}/tokenize", timeout=60, json={
            "model": pd_stack.model, "messages": candidate, "add_generation_prompt": True})
        n = len(r.json()["tokens"])
        if 2 <= n % bs <= small:
            msgs, prompt1 = candidate, n
            break
    assert msgs is not None
    cid = f"it-{uuid.uuid4().hex[:8]}"
    # No special token as the one-token answer: its text would not be re-sent.
    no_special = {"logit_bias": {str(i): -100 for i in range(4)}}
    body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 1, **no_special}
    _, ids1, text = _chat(pd_stack.base_url, body, cid=cid, stream=False)
    msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 12}
    h, ids, _ = _chat(pd_stack.base_url, body, cid=cid, stream=False)
    _, ref_ids, _ = _chat(reference_vllm.base_url, body, cid=None, stream=False)
    assert ids == ref_ids
    reused, reusable = int(h["x-kvtether-reused-tokens"]), int(h["x-kvtether-reusable-tokens"])
    assert h["x-kvtether-reuse"] == "fired", h
    assert reused >= (prompt1 // bs) * bs, h  # at least prefill's own cache of turn 1
    assert prompt1 <= reusable <= prompt1 + len(ids1), h
    assert 0 < reusable - reused <= small + 1, h  # a few tokens recomputed, by design
    _release(pd_stack, cid)


def test_turn_without_conversation_id_is_plain_pd(pd_stack, reference_vllm):
    body = {"model": pd_stack.model, "messages": _conversation(1), "max_tokens": 12}
    h, ids, _ = _chat(pd_stack.base_url, body, cid=None, stream=False)
    _, ref_ids, _ = _chat(reference_vllm.base_url, body, cid=None, stream=False)
    assert h["x-kvtether-reuse"] == "miss:no_conversation_id"
    assert ids == ref_ids


def test_bad_input_gets_openai_errors_and_router_stays_up(pd_stack):
    url = f"{pd_stack.base_url}/v1/chat/completions"
    good = {"model": pd_stack.model, "messages": _conversation(1), "max_tokens": 2}
    cases = [
        (dict(content=b"{not json", headers={"content-type": "application/json"}), 400),
        (dict(json={"model": pd_stack.model}), 400),
        (dict(json=dict(good, model="no-such-model")), 404),
        (dict(json=dict(good, messages=[{"role": "user", "content": "test " * 5000}])), 400),
    ]
    for kwargs, status in cases:
        r = httpx.post(url, timeout=600, **kwargs)
        assert r.status_code == status, (kwargs, r.text)
        assert r.json()["error"]["message"]
        assert httpx.post(url, json=good, timeout=600).status_code == 200


def _prefill_requests(stack) -> float:
    """Requests prefill's engine has finished (vLLM's own counter)."""
    text = httpx.get(f"{stack.prefill_urls[0]}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_short_turns_are_computed_on_decode_with_its_kv_and_match_reference(
    pd_stack, reference_vllm, stream
):
    """local_prefill_max_tokens: turns 2+ add fewer tokens than the limit, so no prefill leg
    runs; decode finds the KV it retains in its own prefix cache, computes the rest, retains
    the result under a new lease and the old lease is released. Output equals the reference."""
    from tests.support.stacks import serve_router

    bs = pd_stack.block_size_tokens
    started = time.time()
    with serve_router(pd_stack, local_prefill_max_tokens=256) as url:
        cid = f"it-local-{uuid.uuid4().hex[:8]}"
        msgs = _conversation(4)
        prev_total = 0
        for turn in range(1, 5):
            body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 12}
            prefilled = _prefill_requests(pd_stack)
            h, ids, text = _chat(url, body, cid=cid, stream=stream)
            _, ref_ids, _ = _chat(reference_vllm.base_url, body, cid=None, stream=False)
            assert ids == ref_ids, f"turn {turn}: output differs from the colocated reference"
            outcome, reused = h["x-kvtether-reuse"], int(h["x-kvtether-reused-tokens"])
            if turn > 1:
                assert outcome == "fired", f"turn {turn}: {outcome}"
                assert reused == ((prev_total - 1) // bs) * bs, (turn, reused, prev_total)
                assert _prefill_requests(pd_stack) == prefilled  # no prefill leg
            prev_total = int(h["x-kvtether-prompt-tokens"]) + len(ids)
            msgs = msgs + [
                {"role": "assistant", "content": text},
                {"role": "tool", "content": TOOL_RESULT},
            ]
        status = httpx.get(f"{url}/v1/sessions/{cid}", timeout=30).json()
        assert [t["local_prefill"] for t in status["turns"]] == [False, True, True, True]
        # What decode's engine reported it did not compute is what the headers said.
        assert all(t["outcome"] == "fired" for t in status["turns"][1:]), status["turns"]
        # One lease holds the conversation's KV: each earlier one was released, not left to lapse.
        leases = httpx.get(f"{pd_stack.decode_control_urls[0]}/kvtether/v1/leases",
                           headers=pd_stack.control_headers, timeout=10).json()
        mine = [lease for lease in leases["leases"] + leases["recently_ended"]
                if lease["created_unix_s"] >= started]
        assert sorted(lease["state"] for lease in mine) == ["active", "released",
                                                            "released", "released"], mine
        active = next(lease for lease in mine if lease["state"] == "active")
        assert active["retained_tokens"] == status["retained_tokens"] == prev_total - 1
        _release_at(url, cid)


def test_a_released_conversation_comes_back_to_decodes_prefix_cache(pd_stack, reference_vllm):
    """A conversation whose lease ended (released here; lapsed in an agent's long pause) is
    computed on the decode instance that held it when vLLM has not reused the freed blocks
    yet: the router asks decode's prefix cache first (``POST /kvtether/v1/prefix-cache``)."""
    from tests.support.stacks import serve_router

    bs = pd_stack.block_size_tokens
    control = pd_stack.decode_control_urls[0]
    with serve_router(pd_stack, local_prefill_max_tokens=256) as url:
        cid = f"it-back-{uuid.uuid4().hex[:8]}"
        msgs = _conversation(3)
        body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 12}
        h, ids, text = _chat(url, body, cid=cid, stream=False)
        prev_total = int(h["x-kvtether-prompt-tokens"]) + len(ids)
        held = httpx.get(f"{url}/v1/sessions/{cid}", timeout=30).json()
        assert held["retained_tokens"] == prev_total - 1
        _release_at(url, cid)  # the lease ends; vLLM keeps the blocks until it needs them

        # The lookup itself: decode's cache still has turn 1's sequence, and not a stranger's.
        prompt = httpx.post(f"{pd_stack.decode_urls[0]}/tokenize", json={
            "model": pd_stack.model, "messages": msgs, "add_generation_prompt": True,
        }, timeout=30).json()["tokens"]
        ask = lambda ids: httpx.post(  # noqa: E731
            f"{control}/kvtether/v1/prefix-cache", json={"token_ids": ids},
            headers=pd_stack.control_headers, timeout=10)
        found = ask(prompt)
        assert found.status_code == 200, found.text
        assert found.json() == {"cached_tokens": len(prompt) // bs * bs, "block_size": bs}
        assert ask([7] * (4 * bs)).json()["cached_tokens"] == 0

        msgs = msgs + [{"role": "assistant", "content": text},
                       {"role": "tool", "content": TOOL_RESULT}]
        body = {"model": pd_stack.model, "messages": msgs, "max_tokens": 12}
        prefilled = _prefill_requests(pd_stack)
        h, ids, _ = _chat(url, body, cid=cid, stream=True)
        _, ref_ids, _ = _chat(reference_vllm.base_url, body, cid=None, stream=False)
        assert ids == ref_ids, "output differs from the colocated reference"
        assert h["x-kvtether-reuse"] == "fired"
        assert int(h["x-kvtether-reused-tokens"]) == ((prev_total - 1) // bs) * bs
        assert _prefill_requests(pd_stack) == prefilled  # no prefill leg
        status = httpx.get(f"{url}/v1/sessions/{cid}", timeout=30).json()
        last = status["turns"][-1]
        assert last["local_prefill"] and last["outcome"] == "fired", last
        assert last["timings"]["plan_prefix_cache_s"] is not None
        assert status["retained_tokens"]  # held again, under a new lease
        _release_at(url, cid)


def _release_at(url: str, cid: str) -> None:
    httpx.delete(f"{url}/v1/sessions/{cid}", timeout=60)
