"""Warm-up: open the NIXL connections before the first user turn needs them.

Each direction of a P/D pair handshakes on its first transfer: decode reads from prefill on a
conversation's first turn, prefill reads decode-held KV on the next. vLLM 0.32 waits 5 s for a
handshake reply (hard-coded); a busy CPU instance can miss that, and the turn then recomputes
(``miss:transfer_failed``). So ``stack up`` runs short throw-away conversations through the
router until a turn reports ``fired`` with more reused tokens than the previous turn's whole
prompt (only a read of decode's KV gives that: prefill's own cache holds at most that prompt),
which proves both directions work, before it says the stack is ready. It first waits for the
router to load its own tokenizer (``RouterSettings.tokenizer``), so that these turns check it
against vLLM's token ids too. With reuse policy
``off`` one turn (prefill → decode) is all there is to open. Best effort: a failure is logged,
never fatal.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx

from kvtether import protocol as p

logger = logging.getLogger(__name__)

_USER = "hello there agent please run the tests and read the files"


@dataclass
class WarmUpReport:
    conversations: int = 0
    outcomes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    pulled: bool = False  # a turn read decode-held KV
    tokenizer: str | None = None  # who tokenizes prompts: the router's /health "tokenizer"

    @property
    def fired(self) -> bool:
        return self.pulled


def warm_up(
    router_url: str,
    model: str,
    *,
    conversations: int = 1,
    max_turns: int = 4,
    max_tokens: int = 24,
    timeout_s: float = 300.0,
    transport: httpx.BaseTransport | None = None,
    api_key: str | None = None,
) -> WarmUpReport:
    """Run ``conversations`` short conversations; each stops at its first turn that read
    decode-held KV. ``max_tokens`` per answer: enough new tokens that prefill reads them
    (above ``kv_recompute_threshold_tokens``) rather than recompute them."""
    report = WarmUpReport()
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=router_url, timeout=timeout_s, trust_env=False,
                      transport=transport, headers=headers) as client:
        report.tokenizer = _tokenizer_loaded(client, t0 + timeout_s)
        for _ in range(conversations):
            report.conversations += 1
            cid = f"kvtether-warmup-{uuid.uuid4().hex[:8]}"
            try:
                _converse(client, model, cid, max_turns, max_tokens, report)
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                logger.warning("warm-up conversation %s failed: %s", cid, exc)
            finally:
                try:
                    client.delete(f"/v1/sessions/{cid}")
                except httpx.HTTPError:
                    pass
    report.seconds = time.monotonic() - t0
    return report


def _tokenizer_loaded(client: httpx.Client, deadline: float) -> str | None:
    """Wait while the router loads its own tokenizer (``/health``'s "tokenizer" is
    "loading"), so that the warm-up's turns, and the first user turns, use it; what it says
    then."""
    while True:
        try:
            state = client.get("/health").json().get("tokenizer")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if state != "loading" or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def _converse(client: httpx.Client, model: str, cid: str, max_turns: int, max_tokens: int,
              report: WarmUpReport) -> None:
    messages = [{"role": "user", "content": _USER}]
    previous_prompt_tokens: int | None = None
    for _ in range(max_turns):
        r = client.post("/v1/chat/completions", headers={p.HEADER_CONVERSATION_ID: cid},
                        json={"model": model, "messages": messages, "max_tokens": max_tokens,
                              "temperature": 0})
        r.raise_for_status()
        outcome = r.headers.get(p.HEADER_REUSE, "")
        report.outcomes.append(outcome)
        reused = _int(r.headers.get(p.HEADER_REUSED_TOKENS))
        if (outcome == "fired" and previous_prompt_tokens is not None
                and reused > previous_prompt_tokens):
            report.pulled = True
            return
        previous_prompt_tokens = _int(r.headers.get(p.HEADER_PROMPT_TOKENS))
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "ok thanks, go on"}]


def _int(value: str | None) -> int:
    return int(value) if value and value.isdigit() else 0
