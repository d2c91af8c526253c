"""The wire contract: names are public, parsing is strict, prefix identity is exact."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtether import protocol as p
from kvtether.protocol._prefix import common_prefix_tokens, matching_prefix_tokens
from kvtether.protocol import _kv_params as kv_keys
from kvtether._validation import first_field_error


def test_public_names_are_pinned():
    # Renaming any of these breaks clients and routers of another version.
    assert p.PROTOCOL_VERSION == "1"
    assert p.HEADER_CONVERSATION_ID == "X-Conversation-Id"
    assert p.CONVERSATION_ID_HEADER_ALIASES == ("X-Session-Id",)
    assert p.BODY_CONVERSATION_ID == "conversation_id"
    assert p.HEADER_REUSE == "X-KVTether-Reuse"
    assert p.HEADER_REUSED_TOKENS == "X-KVTether-Reused-Tokens"
    assert {c.value for c in p.MissCause} >= {
        "first_turn", "no_conversation_id", "below_threshold", "prefix_break", "lease_expired",
        "released", "evicted", "decode_unavailable", "transfer_failed",
    }
    assert set(p.__all__) <= set(dir(p))


@pytest.mark.parametrize(
    "outcome",
    [p.ReuseOutcome.hit(640), p.ReuseOutcome.miss(p.MissCause.PREFIX_BREAK, 96)],
)
def test_reuse_header_round_trips(outcome):
    parsed = p.parse_reuse_header(p.format_reuse_header(outcome), str(outcome.reused_tokens))
    assert parsed == outcome


@pytest.mark.parametrize("value", [None, "", "hit", "miss:nonsense"])
def test_foreign_reuse_headers_are_ignored(value):
    assert p.parse_reuse_header(value, "12") is None


def test_hints_parse_and_reject_bad_values():
    h = p.parse_hints_header('{"next_prompt_tokens": 900, "next_turn_gap_s": 12.5, "phase": "tool_running"}')
    assert h.phase is p.Phase.TOOL_RUNNING and h.next_prompt_tokens == 900
    for bad, words in [
        ("not json", "JSON object"),
        ('{"next_turn_gap_s": -1}', "next_turn_gap_s"),
        ('{"phase": "sleeping"}', "phase"),
        ('{"surprise": 1}', "surprise"),
    ]:
        with pytest.raises(ValueError, match=words):
            p.parse_hints_header(bad)


def test_heartbeat_rejects_negative_durations():
    with pytest.raises(ValueError):
        p.HeartbeatRequest(expected_duration_s=-3)
    assert p.HeartbeatRequest().phase is p.Phase.TOOL_RUNNING


def test_block_hashes_are_chained():
    a = p.block_hashes(list(range(100)), 32)
    b = p.block_hashes([999] + list(range(1, 100)), 32)
    assert len(a) == 3  # only whole blocks
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 changes every later hash
    assert p.block_hashes(list(range(64)), 32) == a[:2]


@pytest.mark.parametrize(
    ("cached", "prompt", "expected"),
    [
        (list(range(100)), list(range(120)), 96),  # prompt extends the cache
        (list(range(100)), list(range(40)) + [7] * 80, 32),  # break at 40 → one whole block
        (list(range(100)), [5] + list(range(1, 120)), 0),  # break at token 0
        (list(range(64)), list(range(64)), 32),  # last prompt token must be computed
    ],
)
def test_matching_prefix_is_whole_blocks(cached, prompt, expected):
    assert matching_prefix_tokens(cached, prompt, 32) == expected


def test_truncate_handle_cuts_a_copy_to_whole_blocks():
    handle = {"remote_block_ids": [[10, 11, 12, 13]], "remote_num_tokens": 60, "other": {"x": 1}}
    cut = p.truncate_handle(handle, 2, 16)
    assert cut == {"remote_block_ids": [[10, 11]], "remote_num_tokens": 32, "other": {"x": 1}}
    assert handle["remote_block_ids"] == [[10, 11, 12, 13]]  # the original is untouched
    cut["other"]["x"] = 2
    assert handle["other"]["x"] == 1


def test_truncate_handle_cuts_the_prefix_identity_too():
    handle = {"remote_block_ids": [[10, 11, 12]], "remote_num_tokens": 40,
              kv_keys.KV_PARAM_BLOCK_SIZE: 16, kv_keys.KV_PARAM_BLOCK_HASHES: ["a", "b"],
              kv_keys.KV_PARAM_TAIL_HASH: "t"}
    cut = p.truncate_handle(handle, 1, 16)
    assert cut is not None
    assert cut[kv_keys.KV_PARAM_BLOCK_HASHES] == ["a"] and kv_keys.KV_PARAM_TAIL_HASH not in cut
    assert cut[kv_keys.KV_PARAM_BLOCK_SIZE] == 16


@pytest.mark.parametrize(
    "groups",
    [
        [[1, 2, 3], [7, 8, 9]],  # hybrid model: a group may hold only a window's tail
        [1, 2, 3],  # not nested per KV cache group
        [],
        None,
    ],
)
def test_truncate_handle_refuses_what_it_cannot_cut_exactly(groups):
    assert p.truncate_handle({"remote_block_ids": groups, "remote_num_tokens": 48}, 1, 16) is None


def test_truncate_handle_of_no_blocks_is_nothing_to_read():
    assert p.truncate_handle({"remote_block_ids": [[1, 2]], "remote_num_tokens": 32}, 0, 16) is None


def test_first_field_error_names_the_field_and_the_problem():
    with pytest.raises(ValidationError) as info:
        p.HeartbeatRequest.model_validate({"expected_duration_s": -3, "phase": "nope"})
    err = first_field_error(info.value)
    assert err.path == ("phase",) and err.input == "nope"
    assert str(err).startswith("phase: Input should be")

    with pytest.raises(ValidationError) as info:
        p.HeartbeatRequest.model_validate([1])
    assert first_field_error(info.value).loc == "body"  # the whole value was wrong


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 5000])
def test_common_prefix_tokens(n: int) -> None:
    from array import array

    a = list(range(6000))
    b = a[:n] + [-1] + a[n + 1:]
    assert common_prefix_tokens(a, b) == n
    assert common_prefix_tokens(array("I", a), b) == n
    assert common_prefix_tokens(a[:n], a) == n  # a prefix of the other
    assert common_prefix_tokens([], a) == 0


def test_a_turn_record_s_outcome_is_typed_too() -> None:
    rec = p.TurnRecord(turn=2, outcome="miss:lease_expired", reused_tokens=3, reusable_tokens=90)
    assert rec.reuse == p.ReuseOutcome.miss(p.MissCause.LEASE_EXPIRED, 3, 90)
    assert rec.reuse.eligible and not rec.reuse.fired
    assert p.TurnRecord(turn=1, outcome="miss:first_turn").reuse.eligible is False
    assert p.TurnRecord(turn=1, outcome="from a later version").reuse is None
    assert "reuse" not in rec.model_dump()  # the wire shape is unchanged


@pytest.mark.parametrize("reusable, reused, verdict", [
    (0, 0, (False, False)), (15, 15, (False, False)), (16, 0, (True, False)),
    (100, 70, (True, False)), (100, 69 + 16, (True, True)), (100, 100, (True, True)),
])
def test_the_one_eligible_and_fired_rule(reusable: int, reused: int, verdict: tuple) -> None:
    assert p.reuse_verdict(reusable, reused, block_size=16,
                           recompute_threshold_tokens=16) == verdict


@pytest.mark.parametrize("value, ok", [
    ("kvt-0a1b", True), ("a" * 256, True), ("user@host:thread.1+x=y~z", True),
    ("", False), ("a" * 257, False), ("two words", False), ("caf\u00e9", False), (42, False),
])
def test_the_one_conversation_id_rule(value: object, ok: bool) -> None:
    assert (p.conversation_id_problem(value) is None) is ok


def test_the_contract_s_public_names_are_pinned() -> None:
    # The wire contract's surface: adding a name is a contract change (README, docs/wire-
    # contract.md); removing or renaming one breaks clients, routers and connectors.
    assert sorted(p.__all__) == [
        "BODY_CONVERSATION_ID",
        "BODY_HINTS",
        "BranchStatus",
        "CONTROL_API_PREFIX",
        "CONTROL_SECRET_ENV",
        "CONVERSATION_ID_CHARACTERS",
        "CONVERSATION_ID_HEADER_ALIASES",
        "ConnectorStatus",
        "EngineTimings",
        "ErrorBody",
        "HEADER_CONVERSATION_ID",
        "HEADER_DECODE_INSTANCE",
        "HEADER_END",
        "HEADER_HINTS",
        "HEADER_PARENT_CONVERSATION_ID",
        "HEADER_PROMPT_TOKENS",
        "HEADER_REUSABLE_TOKENS",
        "HEADER_REUSE",
        "HEADER_REUSED_TOKENS",
        "HEADER_ROUTER",
        "HEADER_SALVAGED_TOKENS",
        "HEADER_TIMINGS",
        "HEADER_TURN",
        "HandleResponse",
        "HeartbeatRequest",
        "HeartbeatResponse",
        "IdleInfo",
        "KVTETHER_BODY_FIELDS",
        "LeaseInfo",
        "LeaseList",
        "LeaseRenewRequest",
        "LeaseState",
        "LeaseTotals",
        "MAX_CONVERSATION_ID_LEN",
        "MissCause",
        "NOT_ELIGIBLE_CAUSES",
        "PREFILL_READ_MARGIN_S",
        "PROTOCOL_VERSION",
        "Phase",
        "PrefixCacheAnswer",
        "PrefixCacheQuery",
        "PullOutcome",
        "ReuseOutcome",
        "SessionStatus",
        "TurnHints",
        "TurnRecord",
        "TurnTimings",
        "block_hashes",
        "conversation_id_problem",
        "error_body",
        "format_reuse_header",
        "parse_hints_header",
        "parse_reuse_header",
        "parse_timings_header",
        "reusable_prefix_tokens",
        "reuse_verdict",
        "tail_block_hash",
        "truncate_handle",
    ]
    assert all(getattr(p, name) is not None for name in p.__all__)
