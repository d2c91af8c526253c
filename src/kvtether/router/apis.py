"""The four request APIs the router serves, and what differs between them.

One turn pipeline (:mod:`.turns`) runs every API; an :class:`Api` says only how a request is
checked and cut down for the prefill leg, where a turn's token ids come from, how its stream is
framed and how an error looks to that API's clients:

* ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI): vLLM returns token ids in the
  answer (``return_token_ids``); streams are ``data:`` lines ending with ``data: [DONE]``.
* ``/v1/responses`` (OpenAI Responses) and ``/v1/messages`` (Anthropic Messages): vLLM 0.32
  returns no token ids there, so the kvtether connector reports them in
  ``kv_transfer_params`` (``KV_PARAM_REPORT_TOKEN_IDS``) and prefill checks the prompt
  against decode's KV itself (block hashes); streams are named events (``event:`` +
  ``data:``) with no ``[DONE]``. Messages errors use Anthropic's shape.

Responses are stateless through the router: ``previous_response_id``, ``conversation`` and
``background`` are refused (400) because a stored response lives in one vLLM instance and the
two legs of a turn run on two; send the whole input each turn (what the Agents SDK and Codex do
with ``store=false``). ``store`` itself is accepted and, as vLLM does by default, not stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtether.router._errors import RouterHTTPError

__all__ = ["API_PATHS", "Api", "api_for"]


@dataclass(frozen=True)
class Api:
    path: str
    name: str  # "chat" | "completions" | "responses" | "messages"
    max_tokens_field: str  # what the prefill leg sets to 1
    token_ids_in_answer: bool  # chat/completions: ``return_token_ids``; else the connector
    named_events: bool  # SSE frames with ``event:`` lines, no ``[DONE]``
    terminal_events: frozenset[str] = frozenset()  # the turn is settled before these go out
    delta_events: frozenset[str] = frozenset()  # the first of these is the first token
    anthropic_errors: bool = False
    # vLLM shows ``kv_transfer_params: null`` in this API's answers (else leaves it out).
    shows_null_kv_params: bool = True
    # Fields of the client's body that make no sense for a one-token prefill request.
    not_for_prefill: tuple[str, ...] = ()

    def check(self, body: dict[str, Any]) -> None:
        """Refuse what the router cannot run or vLLM would refuse only after the prefill leg
        (which runs with ``max_tokens`` 1): everything else is vLLM's to accept or refuse."""
        _CHECKS[self.name](body)

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        leg = {k: v for k, v in body.items() if k not in self.not_for_prefill}
        leg[self.max_tokens_field] = 1
        if self.token_ids_in_answer:
            leg.update(n=1, return_token_ids=True)
        return leg


def _check_chat(body: dict[str, Any]) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RouterHTTPError(400, "'messages' must be a non-empty list", param="messages")


def _check_completions(body: dict[str, Any]) -> None:
    if "prompt" not in body:
        raise RouterHTTPError(400, "'prompt' is required", param="prompt")


# Stateful Responses fields: the router serves the stateless subset.
_STATEFUL = {
    "previous_response_id": "a stored earlier response",
    "conversation": "a stored conversation",
    "background": "a background response",
}


def _check_responses(body: dict[str, Any]) -> None:
    for field, what in _STATEFUL.items():
        if body.get(field) not in (None, False):
            raise RouterHTTPError(
                400, f"'{field}' is not supported through kvtether: it names {what}, which "
                     "lives in one vLLM instance while a turn runs on two. The router serves "
                     "stateless Responses: send the whole conversation as 'input' each turn "
                     "(store=false); kvtether reuses its KV from decode.", param=field,
                code="unsupported_parameter",
            )
    _check_max(body, "max_output_tokens", required=False)
    # The input items are vLLM's to validate (on the prefill leg): routing needs none of them.


def _check_messages(body: dict[str, Any]) -> None:
    # Routing needs nothing of the messages (prefill's connector checks the rendered prompt
    # against decode's KV): vLLM validates them on the prefill leg and its refusal comes back
    # in Anthropic's shape. Roles and block types vLLM accepts (``system`` messages, which
    # Claude Code sends mid-conversation; thinking and tool blocks) pass unchanged.
    _check_max(body, "max_tokens", required=True)


def _check_max(body: dict[str, Any], field: str, *, required: bool) -> None:
    value = body.get(field)
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RouterHTTPError(400, f"{field}: {'is required and ' if required else ''}must be "
                                   "a positive integer", param=field)


_CHECKS = {
    "chat": _check_chat,
    "completions": _check_completions,
    "responses": _check_responses,
    "messages": _check_messages,
}

_OPENAI_STREAM = ("stream", "stream_options", "max_completion_tokens", "min_tokens")

_APIS = (
    Api("/v1/chat/completions", "chat", "max_tokens", token_ids_in_answer=True,
        named_events=False, not_for_prefill=_OPENAI_STREAM),
    Api("/v1/completions", "completions", "max_tokens", token_ids_in_answer=True,
        named_events=False, not_for_prefill=_OPENAI_STREAM),
    Api("/v1/responses", "responses", "max_output_tokens", token_ids_in_answer=False,
        named_events=True,
        terminal_events=frozenset({"response.completed", "response.incomplete",
                                   "response.failed"}),
        delta_events=frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                                "response.function_call_arguments.delta"}),
        not_for_prefill=("stream", "stream_options")),
    Api("/v1/messages", "messages", "max_tokens", token_ids_in_answer=False,
        named_events=True, terminal_events=frozenset({"message_stop"}),
        delta_events=frozenset({"content_block_delta"}), anthropic_errors=True,
        shows_null_kv_params=False, not_for_prefill=("stream",)),
)
_BY_PATH = {api.path: api for api in _APIS}
API_PATHS = tuple(_BY_PATH)


def api_for(path: str) -> Api:
    """The API served at ``path`` (one of :data:`API_PATHS`)."""
    return _BY_PATH[path]
