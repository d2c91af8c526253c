"""benchmarks/lone_pairs.py: how it pairs the two deployments' turns (no vLLM)."""

from __future__ import annotations

from benchmarks import lone_pairs
from kvtether.bench.metrics import TurnResult


def _turn(session: str, turn: int, ttft: float | None, *, fired: bool = True,
          stream: bool = True, new: int = 100) -> TurnResult:
    return TurnResult(session=session, turn=turn, stream=stream, started_s=0.0, ttft_s=ttft,
                      fired=fired,
                      prompt_tokens=1000 + new, reused_tokens=1000)


def test_fired_streamed_turns_are_paired_with_colocated_s_same_turn() -> None:
    colocated = [_turn("s1", 2, 0.50), _turn("s1", 3, 1.00), _turn("s2", 2, 0.40),
                 _turn("s2", 3, None)]
    kvtether = [
        _turn("s1", 2, 0.54, new=120),  # +40 ms: within
        _turn("s1", 3, 1.20, new=500),  # +200 ms: over
        _turn("s2", 2, 0.30, new=80),  # faster
        _turn("s2", 3, 0.30),  # colocated has no TTFT for it
        _turn("s1", 4, 0.30),  # colocated never ran it
        _turn("s3", 2, 0.30, fired=False),
        _turn("s3", 3, 0.30, stream=False),
    ]
    rows = lone_pairs.pair(colocated, kvtether, 0.05)
    assert [(r["session"], r["turn"], r["new_tokens"], r["within"]) for r in rows] == [
        ("s2", 2, 80, True), ("s1", 2, 120, True), ("s1", 3, 500, False)]
    assert rows[2]["diff_s"] == 0.2
    assert lone_pairs.summary(rows, 0.05) == (
        "2 of 3 fired streamed turns within +50 ms of colocated; difference median +0.040 s, "
        "largest +0.200 s")
    assert lone_pairs.summary([], 0.05) == "no fired streamed turn to compare"


def test_repeats_are_summed_up_by_each_turn_s_medians() -> None:
    rows = []
    for rep, (c, k) in enumerate([(0.50, 0.70), (0.60, 0.58), (0.55, 0.57)]):
        pairs = lone_pairs.pair([_turn("s1", 2, c)], [_turn("s1", 2, k)], 0.05)
        rows += [dict(r, repeat=rep) for r in pairs]
    rows += lone_pairs.pair([_turn("s2", 2, 0.4)], [_turn("s2", 2, 0.5, new=50)], 0.05)
    out = lone_pairs.medians(rows, 0.05)
    assert [(r["session"], r["pairs"], r["within"]) for r in out] == [
        ("s2", 1, False), ("s1", 3, True)]
    # One slow repeat (+0.20 s) does not make the turn over the margin: its median is +0.02 s.
    assert out[1]["diff_s"] == 0.02
    assert (out[1]["colocated_ttft_s"], out[1]["kvtether_ttft_s"]) == (0.55, 0.58)


def test_each_repeat_after_the_first_has_a_system_prompt_of_its_own() -> None:
    from kvtether.bench.scenario import generate_scenario

    base = generate_scenario(sessions=2, seed=1)
    assert lone_pairs.repeated(base, 0) is base
    second = lone_pairs.repeated(base, 1)
    assert second.system_prompt == f"Repeat 2.\n{base.system_prompt}"
    assert second.sessions == base.sessions


def test_lockstep_runs_each_turn_on_every_deployment_before_the_next_one_at_a_time() -> None:
    import asyncio

    calls: list[tuple[str, int, str]] = []
    in_flight = 0

    async def replay(gate: lone_pairs._LockstepGate, name: str, turns: int,
                     fail_at: int | None = None) -> None:
        nonlocal in_flight
        try:
            for k in range(1, turns + 1):
                try:
                    async with gate.turn("s1", k):
                        in_flight += 1
                        assert in_flight == 1, "two model calls at once"
                        calls.append((name, k, "start"))
                        await asyncio.sleep(0.01 if name == "a" else 0)
                        in_flight -= 1
                        if k == fail_at:
                            raise RuntimeError("turn failed")
                except RuntimeError:
                    return  # a failed turn ends its session, as in the replay
                await asyncio.sleep(0.02 if name == "b" else 0)  # gaps of different lengths
        finally:
            gate.ended("s1")

    async def run(fail_at: int | None) -> None:
        lockstep = lone_pairs.Lockstep(["b", "a"])
        await asyncio.wait_for(asyncio.gather(
            replay(lockstep.of("a"), "a", 3, fail_at), replay(lockstep.of("b"), "b", 3)), 5)

    asyncio.run(run(None))
    assert [(n, k) for n, k, _ in calls] == [("b", 1), ("a", 1), ("b", 2), ("a", 2), ("b", 3),
                                             ("a", 3)]
    calls.clear()
    # "a" fails its second turn: "b" goes on alone instead of waiting for it.
    asyncio.run(run(2))
    assert [(n, k) for n, k, _ in calls] == [("b", 1), ("a", 1), ("b", 2), ("a", 2), ("b", 3)]


def test_lockstep_starts_each_turn_settle_s_after_the_turn_before_it_ended() -> None:
    import asyncio
    import time

    spans: list[tuple[float, float]] = []

    async def replay(gate: lone_pairs._LockstepGate) -> None:
        try:
            for k in (1, 2):
                async with gate.turn("s1", k):
                    start = time.monotonic()
                    await asyncio.sleep(0.01)
                    spans.append((start, time.monotonic()))
        finally:
            gate.ended("s1")

    async def run() -> None:
        lockstep = lone_pairs.Lockstep(["b", "a"], settle_s=0.05)
        await asyncio.wait_for(asyncio.gather(replay(lockstep.of("a")),
                                              replay(lockstep.of("b"))), 5)

    asyncio.run(run())
    assert len(spans) == 4
    assert all(nxt[0] - prev[1] >= 0.049 for prev, nxt in zip(spans, spans[1:]))


async def test_two_replays_of_a_session_in_lockstep_alternate_turn_by_turn() -> None:
    import asyncio

    from starlette.requests import Request
    from starlette.responses import Response

    from kvtether.bench.replay import replay
    from kvtether.bench.strategies import STRATEGIES
    from tests.support.replays import COMPRESS, endpoints, serving, small_scenario
    from tests.support.fake_vllm import Cluster, FakeVLLM

    arrivals: list[tuple[str, int]] = []

    class Recording(FakeVLLM):
        async def completions(self, request: Request) -> Response:
            messages = (await request.json())["messages"]
            arrivals.append((self.name, sum(m["role"] == "assistant" for m in messages) + 1))
            return await super().completions(request)

    one = small_scenario(1)
    lockstep = lone_pairs.Lockstep(["b", "a"])
    with serving(lambda port: Recording(Cluster(), "a", "127.0.0.1", port, delay_s=0.02)) as a, \
            serving(lambda port: Recording(Cluster(), "b", "127.0.0.1", port)) as b:
        done = await asyncio.wait_for(asyncio.gather(*(
            replay(one, endpoints(fake), STRATEGIES["colocated"], compress=COMPRESS,
                   run_id="t", sample_every_s=0.05, drain_cap_s=0, gate=lockstep.of(name))
            for name, fake in (("a", a), ("b", b)))), 60)
    turns = len(one.sessions[0].turns)
    assert arrivals == [(name, k) for k in range(1, turns + 1) for name in ("b", "a")]
    assert all(t.error is None for result in done for t in result.turns)


def _served(ttft: float, stages: dict[str, float] | None) -> TurnResult:
    t = _turn("s1", 2, ttft)
    t.timings = stages
    return t


def test_each_pair_names_the_way_the_router_served_the_turn() -> None:
    assert lone_pairs.path(_served(0.5, {"plan": 0.01, "prefill_leg": 0.3})) == "prefill"
    assert lone_pairs.path(_served(0.5, {"plan_prefix_cache": 0.002})) == "lapsed"
    assert lone_pairs.path(_served(0.5, {"decode_first_token": 0.4})) == "decode"
    assert lone_pairs.path(_served(0.5, None)) == "?"
    rows = []
    for rep, (k, stages) in enumerate([(0.52, {"decode_first_token": 0.5}),
                                       (0.60, {"plan_prefix_cache": 0.002}),
                                       (0.53, {"plan_prefix_cache": 0.002})]):
        pairs = lone_pairs.pair([_turn("s1", 2, 0.50)], [_served(k, stages)], 0.05)
        rows += [dict(r, repeat=rep) for r in pairs]
    assert lone_pairs.by_path(rows) == "decode 1 of 1, lapsed 1 of 2"
    assert lone_pairs.medians(rows, 0.05)[0]["path"] == "decode/lapsed/lapsed"
