"""The router renders and tokenizes a turn's prompt itself, as vLLM does, where it can.

Before a turn the router needs the prompt's token ids: to check that it extends what decode
holds for the conversation, and to choose whether decode computes the new tokens itself.
Asking prefill's ``/tokenize`` costs a round trip through vLLM's API server, queued behind
its other requests, all of it before the turn's first leg is sent; the same rendering and
tokenizing in the router's own process costs only the work itself.

:class:`PromptTokenizer` does it for the requests whose rendering it mirrors exactly (vLLM
0.32's ``parse_chat_messages`` and ``safe_apply_chat_template``, then the tokenizer with the
request's ``add_special_tokens``):

* chat completions whose messages are text: roles ``system``, ``user``, ``assistant`` and
  ``tool``; content a string, text parts (joined by newlines, vLLM's "string" content format)
  or none; ``name``; assistant ``tool_calls`` of functions (arguments parsed from JSON, as
  vLLM does); ``tool_call_id``; the request's ``tools`` as vLLM dumps them;
  ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``;
* completions with a string prompt.

Anything else (images, a ``chat_template`` or ``chat_template_kwargs`` in the request,
``reasoning_effort``, ``developer`` messages, reasoning in the history, truncation) goes to
prefill's ``/tokenize`` as before, and so does every request until the tokenizer has loaded
(in a thread, after the router starts).

Not trusted blindly: vLLM reports every chat and completions turn's prompt token ids, and the
router compares them with its own (:meth:`PromptTokenizer.check`). The first difference (a
chat template vLLM was started with, ``--chat-template``, or a rendering detail this module
does not know) switches it off for the router's lifetime, with a warning naming the first
token that differs, and ``kvtether_router_tokenizer_mismatches`` counts it. A wrong token list
cannot make anyone read wrong KV: prefill's connector checks the prompt against the handle's
block hashes, and decode's prefix cache is found by hash.

Decode does not render a chat prompt again where it is given its ids (vLLM's
``kv_transfer_params["prompt_token_ids"]``, kept for a prefill stage's ids; 25-40 ms of a
30 K-token prompt on a loaded 2-core host). A turn through prefill forwards the ids prefill
rendered; a turn decode computes itself (local prefill) forwards the router's, once a check has
agreed (:meth:`PromptTokenizer.vouches`), except every eighth, which decode renders so that the
check goes on. A rendering detail this module gets wrong for a message shape that comes later
in a conversation can so reach the model on a few turns before its first check switches it off.

A conversation's next prompt repeats its last one, so the encoding is cached by the text
between special tokens (:class:`_SegmentEncoder`): a turn encodes only its new messages. A
tokenizer splits on its special tokens before anything else, so the pieces' encodings joined
are the whole text's; a tokenizer for which that does not hold on a sample (a normalizer or
pre-tokenizer that looks across them, such as SentencePiece's leading-space marker) encodes
whole texts, as without the cache.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PromptTokenizer"]

# Body fields that change what vLLM renders and are not mirrored here.
_UNMIRRORED_CHAT = frozenset({
    "chat_template", "chat_template_kwargs", "reasoning_effort", "documents",
    "truncate_prompt_tokens", "mm_processor_kwargs", "media_io_kwargs", "prompt_embeds",
})
_UNMIRRORED_COMPLETION = frozenset({"truncate_prompt_tokens", "prompt_embeds", "suffix"})
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
# vLLM drops Claude Code's attribution line from system text (vllm.renderers.chat_utils).
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


class _NotMirrored(Exception):
    """The request uses something this module does not render as vLLM does."""


class PromptTokenizer:
    """A served model's tokenizer and chat template, loaded from its directory."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        template = tokenizer.chat_template
        self._template: str | None = template if isinstance(template, str) else None
        # vLLM passes its template kwargs that the template reads or apply_chat_template takes;
        # of those it always sets, these two are None unless the request says otherwise.
        accept = ((_template_vars(self._template) if self._template else frozenset())
                  | _base_params(tokenizer))
        self._unset_kwargs = {k: None for k in ("documents", "reasoning_effort") if k in accept}
        # One thread: the event loop never waits for a long prompt's encoding, and the
        # tokenizer is never used from two threads at once.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtether-tokenize")
        self._segments = _SegmentEncoder.for_tokenizer(tokenizer)
        self.enabled = True
        self._agreed = 0  # checks that found the router's ids equal to vLLM's
        self._vouched = 0

    @classmethod
    def load(cls, path: Path | str) -> PromptTokenizer | None:
        """The tokenizer in ``path`` (a model directory), or None with a warning when it cannot
        be loaded there (``transformers`` missing, no tokenizer files): the router then asks
        prefill, as without one."""
        try:
            import transformers
        except ImportError:
            logger.warning("tokenizer %s: transformers is not installed; prompts are tokenized "
                           "by prefill's /tokenize", path)
            return None
        # A generic fast tokenizer (what vLLM's AutoTokenizer gets for it) loads without
        # AutoTokenizer's model config, which imports torch: 1.5 s and ~130 MiB instead of
        # 6 s and ~480 MiB in the router's process.
        generic = _tokenizer_class(Path(path)) in _GENERIC_CLASSES
        loader = transformers.PreTrainedTokenizerFast if generic else transformers.AutoTokenizer
        try:
            loaded = cls(loader.from_pretrained(str(path), local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure means: ask prefill instead
            logger.warning("tokenizer %s could not be loaded (%s); prompts are tokenized by "
                           "prefill's /tokenize", path, exc)
            return None
        logger.info("prompts are tokenized in the router with the tokenizer in %s", path)
        return loaded

    async def atoken_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """:meth:`token_ids` in the tokenizer's own thread."""
        if not self.enabled:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.token_ids, endpoint, body)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as vLLM will compute them, or None where this module does
        not mirror the request (or is switched off): ask prefill then."""
        if not self.enabled:
            return None
        try:
            if endpoint.endswith("/chat/completions"):
                return self._chat(body)
            return self._completion(body)
        except _NotMirrored:
            return None
        except Exception as exc:  # noqa: BLE001 - a template error: vLLM reports its own
            logger.debug("prompt not tokenized in the router: %r", exc)
            return None

    def check(self, mirrored: list[int], reported: list[int]) -> bool:
        """Compare the router's token ids with those vLLM reported for the same prompt; on the
        first difference, switch off for good. True when they are the same."""
        if mirrored == reported:
            self._agreed += 1
            return True
        if self.enabled:
            at = next((i for i, (a, b) in enumerate(zip(mirrored, reported, strict=False))
                       if a != b), min(len(mirrored), len(reported)))
            logger.warning(
                "the router's tokenization of a prompt differs from vLLM's (%d vs %d tokens, "
                "first difference at token %d); prompts are tokenized by prefill's /tokenize "
                "from now on. Was vLLM started with its own --chat-template?",
                len(mirrored), len(reported), at)
        self.enabled = False
        return False

    def vouches(self) -> bool:
        """Whether this turn's decode leg may take the router's token ids instead of rendering
        the chat again (``kv_transfer_params["prompt_token_ids"]``): once a check has agreed,
        and not on every :attr:`RECHECK_EVERY`-th turn asked about, which vLLM renders
        itself so that :meth:`check` keeps comparing (a turn with forwarded ids reports them
        back unchanged, which checks nothing)."""
        if not self.enabled or not self._agreed:
            return False
        self._vouched += 1
        return self._vouched % self.RECHECK_EVERY != 0

    RECHECK_EVERY = 8

    # ------------------------------------------------------------------ rendering
    def _completion(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or _UNMIRRORED_COMPLETION & body.keys():
            raise _NotMirrored
        return self._encode(prompt, _flag(body, "add_special_tokens", True))

    def _chat(self, body: dict[str, Any]) -> list[int]:
        if self._template is None or _UNMIRRORED_CHAT & body.keys():
            raise _NotMirrored
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _NotMirrored
        conversation = [_message(m) for m in messages]
        tools = body.get("tools")
        text = self._tok.apply_chat_template(
            conversation=conversation,
            tools=_tool_dicts(tools) if tools is not None else None,
            chat_template=self._template,
            tokenize=False,
            return_dict=False,
            add_generation_prompt=_flag(body, "add_generation_prompt", True),
            continue_final_message=_flag(body, "continue_final_message", False),
            **self._unset_kwargs,
        )
        if not isinstance(text, str):
            raise _NotMirrored
        return self._encode(text, _flag(body, "add_special_tokens", False))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(text)
        ids = self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return list(ids)


class _SegmentEncoder:
    """A tokenizer's encoding without special tokens added, cached by the text between the
    special tokens the text holds (a chat template puts them around every message).

    An agent's prompt of 30 K tokens took 25-40 ms to encode whole on a 2-core host, every
    turn, while its turns add a few hundred to a few thousand tokens; its cached messages cost
    a dictionary look-up each.
    """

    # Characters of text whose encodings are kept, least recently used dropped first: about
    # 30 MiB (the text and its ids), the messages of ~100 conversations of 30 K tokens.
    MAX_CACHED_CHARS = 12_000_000
    # Shorter pieces are encoded each time: caching them costs more than it saves.
    MIN_CACHED_CHARS = 64

    def __init__(self, tokenizer: Any, specials: dict[str, int]) -> None:
        self._tok = tokenizer
        self._specials = specials
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._cached_chars = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> _SegmentEncoder | None:
        """The encoder for ``tokenizer``, or None where piecewise encoding is not exact: an
        added token matched after normalization or with whitespace stripped around it, or a
        sample whose pieces encode differently from the whole."""
        try:
            added = dict(tokenizer.added_tokens_decoder)
        except AttributeError:
            return None
        specials: dict[str, int] = {}
        for token_id, token in added.items():
            content = getattr(token, "content", None)
            if not isinstance(content, str) or not content:
                return None
            if (getattr(token, "normalized", True) or getattr(token, "lstrip", True)
                    or getattr(token, "rstrip", True) or getattr(token, "single_word", True)):
                return None
            specials[content] = int(token_id)
        if not specials:
            return None
        encoder = cls(tokenizer, specials)
        return encoder if encoder._agrees_on_samples() else None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._specials[piece])
            elif len(piece) < self.MIN_CACHED_CHARS:
                out.extend(self._encode(piece) if piece else ())
            else:
                out.extend(self._cached(piece))
        return out

    def _cached(self, piece: str) -> array[int]:
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            return ids
        ids = array("l", self._encode(piece))
        self._cache[piece] = ids
        self._cached_chars += len(piece)
        while self._cached_chars > self.MAX_CACHED_CHARS:
            dropped, _ = self._cache.popitem(last=False)
            self._cached_chars -= len(dropped)
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def _agrees_on_samples(self) -> bool:
        first, *rest = self._specials
        last = rest[-1] if rest else first
        samples = [
            f"{first}system\nYou are a  helpful assistant.{last}\n{first}user\n Hi there!\n\n",
            f"plain text first{last} then\tmore{first}{first}  spaced  out  {last}",
            f"a{first}a{last}b a {first}\n\n{last}\n ünïcödé 日本語 ",
        ]
        try:
            return all(self.encode(s) == self._encode(s) for s in samples)
        except Exception:  # noqa: BLE001 - any failure: encode whole texts
            return False


_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _tokenizer_class(path: Path) -> str | None:
    """``tokenizer_class`` in the directory's ``tokenizer_config.json``, if it says one."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise _NotMirrored
    return value


def _message(msg: Any) -> dict[str, Any]:
    """One message as vLLM's ``_parse_chat_message_content`` turns it into the template's
    conversation ("string" content format, no multimodal parts)."""
    if not isinstance(msg, dict) or not msg.keys() <= _MESSAGE_KEYS:
        raise _NotMirrored
    role = msg.get("role")
    if role not in _ROLES:
        raise _NotMirrored
    out: dict[str, Any] = {"role": role, "content": _text(msg.get("content"), role)}
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(calls)
    elif "tool_calls" in msg:
        raise _NotMirrored
    if role == "tool" and "tool_call_id" in msg:
        if not isinstance(msg["tool_call_id"], str):
            raise _NotMirrored
        out["tool_call_id"] = msg["tool_call_id"]
    elif "tool_call_id" in msg:
        raise _NotMirrored
    if "name" in msg:
        if not isinstance(msg["name"], str):
            raise _NotMirrored
        out["name"] = msg["name"]
    return out


def _text(content: Any, role: str) -> str:
    if content is None:
        parts: list[str] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and part.keys() <= {"type", "text"} and isinstance(part.get("text"), str)):
                raise _NotMirrored  # images, audio, files, refusals ...
            parts.append(part["text"])
    else:
        raise _NotMirrored
    if role == "system" and any(t.startswith(_CLAUDE_CODE_BILLING_HEADER) for t in parts):
        raise _NotMirrored
    return "\n".join(parts)


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """Assistant tool calls as vLLM's ``_postprocess_messages`` leaves them: arguments parsed
    from JSON into an object ({} when empty, not JSON, or not an object)."""
    if not isinstance(calls, list):
        raise _NotMirrored
    out = []
    for call in calls:
        if not isinstance(call, dict) or not call.keys() <= {"id", "type", "function"}:
            raise _NotMirrored
        function = call.get("function")
        if (call.get("type", "function") != "function" or not isinstance(function, dict)
                or not function.keys() <= {"name", "arguments"}
                or not isinstance(function.get("name"), str)):
            raise _NotMirrored
        arguments = function.get("arguments")
        if not isinstance(arguments, (str, type(None))):
            raise _NotMirrored
        parsed: Any = {}
        if arguments:
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = {}
            if not isinstance(parsed, dict):
                parsed = {}
        item: dict[str, Any] = {}
        if "id" in call:
            item["id"] = call["id"]
        item["function"] = {"name": function["name"], "arguments": parsed}
        if "type" in call:
            item["type"] = call["type"]
        out.append(item)
    return out


def _tool_dicts(tools: Any) -> list[dict[str, Any]]:
    """The request's tools as vLLM passes them to the template (``ChatCompletionToolsParam``
    dumped, ``strict`` only when set); a field vLLM would drop or add (``defer_loading``) is
    not mirrored."""
    if not isinstance(tools, list):
        raise _NotMirrored
    out = []
    for tool in tools:
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                or not tool.keys() <= {"type", "function"}):
            raise _NotMirrored
        function = tool.get("function")
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not function.keys() <= {"name", "description", "parameters", "strict"}):
            raise _NotMirrored
        description, parameters = function.get("description"), function.get("parameters")
        if not isinstance(description, (str, type(None))) or not isinstance(
                parameters, (dict, type(None))):
            raise _NotMirrored
        dumped: dict[str, Any] = {"name": function["name"], "description": description,
                                  "parameters": parameters}
        if function.get("strict") is not None:
            if not isinstance(function["strict"], bool):
                raise _NotMirrored
            dumped["strict"] = function["strict"]
        out.append({"type": "function", "function": dumped})
    return out


def _template_vars(template: str) -> frozenset[str]:
    """The variables a chat template reads (vLLM passes only those, and apply_chat_template's
    own parameters, of its template kwargs)."""
    import jinja2
    import jinja2.meta
    import jinja2.sandbox
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    class _Generation(Extension):  # transformers' {% generation %} tag, parsed only
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_g"), [], [], body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


def _base_params(tokenizer: Any) -> frozenset[str]:
    """``apply_chat_template``'s own named parameters."""
    params: Iterable[inspect.Parameter] = inspect.signature(
        tokenizer.apply_chat_template).parameters.values()
    return frozenset(p.name for p in params
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
