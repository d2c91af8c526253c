"""The session layer on the real stack: an agent loop through the router to P/D vLLM.

The loop uses the plain OpenAI SDK, wrapped, with ``@session.step`` and ``@session.tool``. One
tool outlives the router's lease TTL; heartbeats must keep the decode-held KV alive across it,
so every turn after the first reads the previous turns' KV ("fired").
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from openai import OpenAI

from kvtether import Session
from kvtether.errors import SessionNotFound

pytestmark = pytest.mark.vllm


def test_reuse_fires_on_every_turn_across_a_tool_longer_than_the_lease(short_lease: Any) -> None:
    session = Session(short_lease.base_url)
    base = OpenAI(base_url=short_lease.base_url + "/v1", api_key="-", max_retries=0)
    client = session.wrap(base)

    @session.tool
    def look_up(topic: str, sleep_s: float) -> str:
        time.sleep(sleep_s)
        return f"Notes on {topic}: caches keep recent results close to where they are used."

    @session.step
    def step(messages: list[Any]) -> list[Any]:
        reply = client.chat.completions.create(
            model=short_lease.model, messages=messages, max_tokens=16, temperature=0
        )
        # Send the reply back exactly as the model produced it, so the prefix stays stable.
        return session.stable_history([*messages, reply.choices[0].message])

    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "Explain in one sentence what a KV cache is."},
    ]
    gaps_s = [0.2, short_lease.lease_ttl_s + 5, 0.2]  # the middle tool outlives the lease
    with session:
        for turn in range(4):
            messages = step(messages)
            if turn < len(gaps_s):
                result = look_up("caching", sleep_s=gaps_s[turn])
                messages.append({"role": "user", "content": result + " Say more."})
        report = session.report()

    outcomes = [t.outcome for t in session.turns]
    assert outcomes[0].startswith("miss:") and outcomes[1:] == ["fired"] * 3, report
    assert all(t.reused_tokens > 0 for t in session.turns[1:]), report
    assert all(t.reusable_tokens > 0 for t in session.turns[1:]), report
    assert [t.prefix_status for t in session.turns] == ["first"] + ["extends"] * 3, report
    assert [t.step for t in session.turns] == [1, 2, 3, 4]
    long_run = session.tool_runs[1]
    assert long_run.duration_s > short_lease.lease_ttl_s
    assert long_run.heartbeats >= 2 and long_run.heartbeat_failures == 0, session.events
    assert "fired 3/3 eligible turns (100%), 4 in all" in report

    # close() (the with-block exit) released the KV at once.
    assert session.released
    try:
        status = session.status()
    except SessionNotFound:
        pass
    else:
        assert status.lease_state == "released" and status.retained_tokens == 0
    base.close()
