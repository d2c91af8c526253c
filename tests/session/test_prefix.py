"""Prefix tracking: history rewrites are caught client-side, and stable_history() avoids them."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
from openai import OpenAI

from kvtether.errors import PrefixBreakWarning
from kvtether.session import PrefixStatus, Session, SessionSettings
from kvtether.session._prefix import PrefixTracker
from tests.support.fake_router import FakeRouter

SYSTEM: Any = {"role": "system", "content": "You are a coding agent."}
USER: Any = {"role": "user", "content": "fix the bug"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "grep", "arguments": '{"pattern": "bug"}'},
}
REPLY = {
    "role": "assistant",
    "content": None,
    "reasoning_content": "grep first",
    "tool_calls": [CALL],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "src/a.py:3: bug"}


def tracked(history: list[Any], reply: dict[str, Any], tools: Any = None) -> PrefixTracker:
    tracker = PrefixTracker()
    _, sent, _ = tracker.check_chat(history, tools)
    tracker.commit_chat(sent, reply, tools)
    return tracker


def check(tracker: PrefixTracker, messages: list[Any], tools: Any = None) -> Any:
    return tracker.check_chat(messages, tools)[0]


def test_appending_to_history_and_reply_extends_it() -> None:
    tracker = tracked([SYSTEM, USER], REPLY)
    result = check(tracker, [SYSTEM, USER, REPLY, RESULT])
    assert result.status is PrefixStatus.EXTENDS and result.label == "extends"


def test_sdk_objects_and_equivalent_spellings_do_not_break_the_prefix() -> None:
    from openai.types.chat import ChatCompletionMessage

    tracker = tracked(
        [SYSTEM, USER], {"role": "assistant", "content": "done", "tool_calls": [], "refusal": None}
    )
    echoed = ChatCompletionMessage(role="assistant", content="done")
    parts = {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}
    assert check(tracker, [SYSTEM, parts, echoed, USER]).status is PrefixStatus.EXTENDS


def test_resending_the_same_prompt_is_not_a_break() -> None:
    tracker = tracked([SYSTEM, USER], REPLY)
    assert check(tracker, [SYSTEM, USER]).status is PrefixStatus.RESENT


@pytest.mark.parametrize(
    ("messages", "index", "cause"),
    [
        (
            [{"role": "system", "content": "You are terse."}, USER, REPLY, RESULT],
            0,
            "system_prompt_changed",
        ),
        (
            [SYSTEM, USER, {k: v for k, v in REPLY.items() if k != "reasoning_content"}, RESULT],
            2,
            "reasoning_stripped",
        ),
        (
            [
                SYSTEM,
                USER,
                {
                    **REPLY,
                    "tool_calls": [
                        {**CALL, "function": {"name": "grep", "arguments": '{"pattern":"bug"}'}}
                    ],
                },
                RESULT,
            ],
            2,
            "assistant_edited",
        ),
        ([SYSTEM, REPLY, RESULT], 1, "message_dropped"),
        ([SYSTEM, {"role": "user", "content": "fix the bug please"}, REPLY], 1, "message_edited"),
    ],
)
def test_rewrites_are_found_with_index_and_cause(
    messages: list[Any], index: int, cause: str
) -> None:
    result = check(tracked([SYSTEM, USER], REPLY), messages)
    assert (result.status, result.break_index, result.cause) == (PrefixStatus.BREAK, index, cause)


def test_reordered_tool_results_are_named() -> None:
    second = {"role": "tool", "tool_call_id": "call_2", "content": "b"}
    history = [SYSTEM, USER, REPLY, RESULT, second]
    tracker = tracked(history, {"role": "assistant", "content": "ok"})
    result = check(tracker, [SYSTEM, USER, REPLY, second, RESULT])
    assert (result.break_index, result.cause) == (3, "tool_results_reordered")


def test_a_changed_tools_list_breaks_at_the_start() -> None:
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
    tracker = tracked([SYSTEM, USER], REPLY, tools)
    result = check(tracker, [SYSTEM, USER, REPLY, RESULT], tools=tools[:0])
    assert (result.break_index, result.cause) == (0, "tools_changed")


def test_completion_prompts_are_tracked_by_text() -> None:
    tracker = PrefixTracker()
    tracker.check_completion("Q: 2+2?")
    tracker.commit_completion("Q: 2+2?", " A: 4")
    assert tracker.check_completion("Q: 2+2? A: 4\nQ: 3+3?")[0].status is PrefixStatus.EXTENDS
    edited = tracker.check_completion("Q: 2+3? A: 4")[0]
    assert (edited.break_index, edited.cause) == (5, "prompt_edited")
    assert tracker.check_completion(["batch", "prompt"])[0].status is PrefixStatus.UNTRACKED


def agent_turns(client: OpenAI, session: Session, *, stable: bool) -> None:
    """Two turns where the agent rebuilds the assistant message the usual lossy way."""
    messages: list[Any] = [SYSTEM, USER]
    reply = client.chat.completions.create(model="fake", messages=messages).choices[0].message
    rebuilt = {
        "role": "assistant",
        "content": reply.content,
        "tool_calls": [c.model_dump() for c in reply.tool_calls or []],
    }
    messages += [rebuilt, RESULT]
    if stable:
        messages = session.stable_history(messages)
    client.chat.completions.create(model="fake", messages=messages)


def test_stripped_reasoning_warns_before_the_request_leaves(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    router.replies.append({"content": None, "reasoning": "grep first", "tool_calls": [CALL]})
    with pytest.warns(PrefixBreakWarning, match="reasoning_stripped") as caught:
        agent_turns(client, session, stable=False)
    assert caught[0].filename == __file__  # points at the agent's code, not at the SDK
    assert session.turns[1].prefix_status == "break@2:reasoning_stripped"
    assert session.events[0].kind.value == "prefix_break"


def test_stable_history_restores_the_exact_reply(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    router.replies.append({"content": None, "reasoning": "grep first", "tool_calls": [CALL]})
    agent_turns(client, session, stable=True)  # warnings are errors in this suite
    assert session.turns[1].prefix_status == "extends"
    sent = router.requests_to("/chat/completions")[1].body["messages"][2]
    assert sent["reasoning_content"] == "grep first" and sent["tool_calls"][0]["id"] == "call_1"


def test_streamed_replies_are_assembled_for_tracking(
    router: FakeRouter, session: Session, client: OpenAI
) -> None:
    router.replies.append({"content": "let me look", "reasoning": "hmm", "tool_calls": [CALL]})
    stream = client.chat.completions.create(model="fake", messages=[SYSTEM, USER], stream=True)
    for _ in stream:
        pass
    history = session.stable_history(
        [SYSTEM, USER, {"role": "assistant", "content": "x", "tool_calls": [CALL]}, RESULT]
    )
    assert history[2]["reasoning_content"] == "hmm" and history[2]["content"] == "let me look"
    client.chat.completions.create(model="fake", messages=history)
    assert session.turns[1].prefix_status == "extends"


def test_prefix_breaks_can_be_logged_instead(
    router: FakeRouter, client: OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    s = Session(router.url, settings=SessionSettings(on_prefix_break="log"))
    wrapped = s.wrap(client)
    router.replies.append({"content": None, "reasoning": "grep first", "tool_calls": [CALL]})
    # Record warnings instead of raising them: under "warn" a PrefixBreakWarning would be
    # issued (and, as an error, logged too), so only its absence shows the "log" branch ran.
    with caplog.at_level(logging.WARNING, logger="kvtether"), warnings.catch_warnings(
        record=True
    ) as issued:
        warnings.simplefilter("always")
        agent_turns(wrapped, s, stable=False)
    assert [w for w in issued if issubclass(w.category, PrefixBreakWarning)] == []
    assert "reasoning_stripped" in caplog.text
    assert s.turns[1].prefix.cause == "reasoning_stripped"
    s.close()


def test_warnings_as_errors_never_fail_the_request(
    router: FakeRouter, session: Session, client: OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    router.replies.append({"content": None, "reasoning": "grep first", "tool_calls": [CALL]})
    with caplog.at_level(logging.WARNING, logger="kvtether"):
        agent_turns(client, session, stable=False)  # this suite runs with -W error
    assert [t.outcome for t in session.turns] == ["miss:first_turn", "fired"]
    assert "reasoning_stripped" in caplog.text
