"""A turn as data (:mod:`kvtether.router.turn_plan`): the decode leg's request and the
turn's outcome follow from the plan alone."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvtether import protocol as p
from kvtether.protocol import _kv_params as kv_keys
from kvtether.router.backends import Backend
from kvtether.router.reuse import ReusePlan
from kvtether.router.settings import RouterSettings
from kvtether.router.turn_plan import Compute, TurnPlan, decode_body, prompt_work, turn_outcome

S = RouterSettings(prefill_urls=["http://p0"], decode_urls=["http://d0"],
                   kv_block_size_tokens=16, kv_recompute_threshold_tokens=16)
PREVIOUS = list(range(100))
PROMPT = PREVIOUS + [500, 501, 502, 503]


def backend(name: str) -> Backend:
    return Backend(name, name.split("-")[0], "http://x", None, None)  # type: ignore[arg-type]


def plan(compute: Compute, **kw: Any) -> TurnPlan:
    fields: dict[str, Any] = dict(
        reuse=ReusePlan({"do_remote_decode": True}, 100, None, prompt_token_ids=PROMPT),
        compute=compute, prefill=backend("prefill-0"), refused=frozenset(),
        holder=backend("decode-0"), taken=None, preferred="decode-0", work_tokens=4,
        previous=PREVIOUS, conversation=True, had_retained=True, store_down=False)
    return TurnPlan(**{**fields, **kw})


class Leg:
    """What :func:`turn_outcome` and :func:`decode_body` read of a prefill leg."""

    def __init__(self, cached_tokens: int) -> None:
        self.params = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
        self.prompt_token_ids = PROMPT
        self.cached_tokens = cached_tokens
        self.prefill = backend("prefill-0")


def test_a_local_prefill_is_a_hit_on_its_instance_and_a_loss_elsewhere() -> None:
    local = plan(Compute.LOCAL)
    assert turn_outcome(local, None, backend("decode-0"), S).label == "fired"
    moved = turn_outcome(local, None, backend("decode-1"), S)
    assert moved.cause is p.MissCause.DECODE_UNAVAILABLE


def test_a_prefill_leg_s_outcome_is_what_prefill_reports() -> None:
    leg = plan(Compute.PREFILL_LEG)
    hit = turn_outcome(leg, Leg(96), backend("decode-0"), S)  # type: ignore[arg-type]
    assert hit.label == "fired"
    failed = turn_outcome(leg, Leg(0), backend("decode-0"), S)  # type: ignore[arg-type]
    assert failed.cause is p.MissCause.TRANSFER_FAILED


def test_decode_alone_lost_what_the_handle_covered() -> None:
    alone = turn_outcome(plan(Compute.DECODE_ALONE), None, backend("decode-0"), S)
    assert alone.cause is p.MissCause.TRANSFER_FAILED and alone.reused_tokens == 0
    first = turn_outcome(plan(Compute.DECODE_ALONE, previous=None), None, backend("decode-0"), S)
    assert first.cause is p.MissCause.FIRST_TURN
    down = turn_outcome(plan(Compute.DECODE_ALONE, store_down=True), None, backend("decode-0"), S)
    assert down.cause is p.MissCause.STORE_UNAVAILABLE


def test_the_decode_leg_reads_what_the_plan_says_and_keeps_it_under_the_key() -> None:
    body = {"messages": [], "stream": True}
    local = decode_body(body, True, plan(Compute.LOCAL), None, "k", 60.0)
    assert local["return_token_ids"] is True
    assert local["kv_transfer_params"] == {kv_keys.KV_PARAM_LOCAL_PREFILL: True,
                                           kv_keys.KV_PARAM_HANDLE_KEY: "k",
                                           kv_keys.KV_PARAM_LEASE_TTL_S: 60.0}
    leg = decode_body(body, False, plan(Compute.PREFILL_LEG),
                      Leg(96), None, 60.0)  # type: ignore[arg-type]
    assert leg["kv_transfer_params"] == {"do_remote_prefill": True, "remote_block_ids": [[1]],
                                         kv_keys.KV_PARAM_REPORT_TOKEN_IDS: True}
    assert "kv_transfer_params" not in decode_body(body, True, plan(Compute.DECODE_ALONE),
                                                   None, None, 60.0)
    assert body == {"messages": [], "stream": True}  # the client's request is not changed


def test_a_leg_s_work_is_its_new_tokens_or_a_guess_from_the_request_size() -> None:
    reuse = ReusePlan(None, 0, p.MissCause.FIRST_TURN)
    assert prompt_work({}, replace(reuse, prompt_token_ids=PROMPT), None) == len(PROMPT)
    assert prompt_work({}, reuse, PROMPT) == len(PROMPT)
    assert prompt_work({"prompt": "x" * 400}, reuse, None) == 103  # ~4 bytes a token
