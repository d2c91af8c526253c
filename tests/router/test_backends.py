"""A backend's load counts (:class:`kvtether.router.backends.Slot`): what a request takes of
``inflight`` and ``prompt_backlog_tokens`` is given back exactly once."""

from __future__ import annotations

import pytest

from kvtether.router.backends import Backend


def backend() -> Backend:
    return Backend("prefill-0", "prefill", "http://p", None, None)  # type: ignore[arg-type]


def test_a_slot_counts_a_request_and_its_prompt_until_released() -> None:
    b = backend()
    with b.slot(prompt_tokens=300) as slot:
        assert (b.inflight, b.prompt_backlog_tokens) == (1, 300)
        slot.prompt_computed()
        assert (b.inflight, b.prompt_backlog_tokens) == (1, 0)
        slot.prompt_computed()
        assert b.prompt_backlog_tokens == 0
    assert (b.inflight, b.prompt_backlog_tokens) == (0, 0)
    slot.release()  # a stream's end may come twice
    assert (b.inflight, b.prompt_backlog_tokens) == (0, 0)


def test_a_slot_is_given_back_when_the_request_fails() -> None:
    b = backend()
    with pytest.raises(ConnectionError), b.slot(prompt_tokens=50):
        raise ConnectionError
    assert (b.inflight, b.prompt_backlog_tokens) == (0, 0)


def test_prompt_work_counts_the_backlog_alone() -> None:
    b = backend()
    work = b.prompt_work(120)
    other = b.slot(prompt_tokens=30)
    assert (b.inflight, b.prompt_backlog_tokens) == (1, 150)
    work.release()
    assert (b.inflight, b.prompt_backlog_tokens) == (1, 30)
    other.release()
    assert (b.inflight, b.prompt_backlog_tokens) == (0, 0)
