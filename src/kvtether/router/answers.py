"""How an answer ends: in tool calls the client will run, or handed back to a person.

The router relays every answer (:mod:`.relay`); :class:`AnswerReader` watches what goes by,
sans I/O, so that a client that sends no hints (a coding-agent harness) still gets a lease
sized for what comes next (:mod:`.tool_leases`). Every API, streamed and not:

* chat completions: ``message.tool_calls`` / ``finish_reason: "tool_calls"``; streamed, the
  ``delta.tool_calls`` fragments (the name first, the arguments in pieces);
* completions: never tool calls;
* Responses: output items of a ``*_call`` type the client runs (``function_call``,
  ``custom_tool_call``, ``local_shell_call``, ``shell_call``, ...; not the tools the server
  itself ran, such as ``web_search_call``), in the body or the stream's ``response.completed``;
* Messages: ``tool_use`` content blocks / ``stop_reason: "tool_use"``; streamed,
  ``content_block_start`` of a ``tool_use`` block, its ``input_json_delta`` pieces and
  ``message_delta``'s ``stop_reason``.

Each call is kept as a key for learning its duration: the tool's name, or ``name:command`` for
a shell-like tool (arguments ``command`` or ``cmd``, a string or an argv list: Claude Code's
``Bash``, OpenCode's ``bash``, Codex's ``shell`` / ``exec_command`` / ``local_shell_call``),
the command's first word, with a runner's subcommand (``pytest -x`` -> ``pytest``,
``cd src && uv run pytest -q`` -> ``uv run pytest``, ``bash -lc 'cargo test'`` ->
``cargo test``).

Cheap by design: a streamed answer is parsed only where a tool call can be (chat chunks are
parsed by the relay anyway; of named events, a few per answer), and arguments are kept up to
:data:`MAX_ARGUMENT_CHARS` (a command is at their start; a file's content is not needed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AnswerEnd", "AnswerReader", "MAX_ARGUMENT_CHARS", "tool_call_key"]

# Arguments longer than this are not parsed (the tool is then known by its name alone).
MAX_ARGUMENT_CHARS = 4096
_MAX_NAME_CHARS = 64
_MAX_COMMAND_CHARS = 40
_MAX_CALLS = 16  # parallel calls remembered per answer

# Tools the server runs itself (vLLM's built-in tools): no client is waited for.
_SERVER_RUN = frozenset({"web_search_call", "file_search_call", "code_interpreter_call",
                         "image_generation_call", "mcp_call"})
_SHELLS = frozenset({"bash", "sh", "zsh", "dash", "ksh", "fish", "pwsh", "powershell"})
# First words that do not name what runs: skipped (with a numeric argument, for timeout).
_WRAPPERS = frozenset({"sudo", "env", "time", "timeout", "nohup", "nice", "exec", "command"})
_SETUP = frozenset({"cd", "pushd", "export", "source", ".", "set", "unset", "alias"})
# Runners whose first word says little: the next word that is not a flag goes with it (and
# after a ``run``-like subcommand, the one after that).
_RUNNERS = frozenset({"python", "python3", "uv", "uvx", "poetry", "pip", "npm", "npx", "pnpm",
                      "yarn", "bun", "node", "cargo", "go", "make", "git", "docker", "kubectl",
                      "dotnet", "mvn", "gradle", "gradlew", "bazel", "just", "tox", "nox"})
_RUN = frozenset({"run", "exec", "x", "dlx"})


@dataclass(frozen=True, slots=True)
class AnswerEnd:
    """How one answer ended: the tool calls the client will run (none: a person's turn)."""

    tool_keys: tuple[str, ...] = ()

    @property
    def tool_calls(self) -> bool:
        return bool(self.tool_keys)


def tool_call_key(name: Any, arguments: Any = None) -> str:
    """``name``, or ``name:command`` for a shell-like call (see the module's docstring).

    ``arguments``: a mapping, or its JSON text (unparsed beyond :data:`MAX_ARGUMENT_CHARS`).
    """
    tool = _clean(name if isinstance(name, str) else "", _MAX_NAME_CHARS) or "tool"
    if isinstance(arguments, str):
        if len(arguments) > MAX_ARGUMENT_CHARS or not (
                "command" in arguments or "cmd" in arguments):
            return tool
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return tool
    if not isinstance(arguments, dict):
        return tool
    command = arguments.get("command", arguments.get("cmd"))
    if command is None and isinstance(arguments.get("commands"), list):  # shell_call
        command = next(iter(arguments["commands"]), None)
    words = _command_words(command)
    return f"{tool}:{words}" if words else tool


def _clean(text: str, limit: int) -> str:
    text = text.strip()[:limit]
    return text if text.isprintable() else ""


def _command_words(command: Any, depth: int = 0) -> str:
    """The first word(s) of a shell command, given as a string or an argv list."""
    if isinstance(command, list):
        argv = [w for w in command if isinstance(w, str)]
        if depth == 0 and _shell_script(argv) is not None:
            return _command_words(argv[2], depth + 1)
        return _words(argv) if argv else ""
    if not isinstance(command, str):
        return ""
    head = command.split(None, 2)
    if depth == 0 and _shell_script(head) is not None:  # bash -lc 'cd x && make test'
        return _command_words(head[2].strip().strip("'\""), depth + 1)
    for segment in command.replace("||", ";").replace("&&", ";").replace("\n", ";").split(";"):
        argv = segment.split("|", 1)[0].split()
        if argv and argv[0] not in _SETUP:
            return _words(argv)
    return ""


def _shell_script(argv: list[str]) -> str | None:
    """The script of ``bash -c SCRIPT`` (``-lc``, ``-ec`` ...), else None."""
    if len(argv) >= 3 and _base(argv[0]) in _SHELLS and argv[1].startswith("-") and (
            "c" in argv[1]):
        return argv[2]
    return None


def _words(argv: list[str]) -> str:
    i = 0
    while i < len(argv) and (_base(argv[i]) in _WRAPPERS or "=" in argv[i]
                             or argv[i].startswith("-") or argv[i].replace(".", "").isdigit()):
        i += 1  # sudo, env X=1, timeout 60, their flags
    if i >= len(argv):
        return ""
    words = [_base(argv[i])]
    rest = argv[i + 1:]
    # A runner takes its subcommand (``cargo test``, ``python -m pytest``), and a script
    # runner the script's name too (``uv run pytest``, ``npm run build``).
    while words[-1] in _RUNNERS or (len(words) == 2 and words[-1] in _RUN):
        if words[-1] in ("python", "python3") and rest[:1] == ["-m"]:
            words.append("-m")
        nxt = next((j for j, w in enumerate(rest) if not w.startswith("-")), None)
        if nxt is None or len(words) >= 4:
            break
        words.append(_base(rest[nxt]))
        rest = rest[nxt + 1:]
        if words[-2] == "-m":
            break
    return _clean(" ".join(words), _MAX_COMMAND_CHARS)


def _base(word: str) -> str:
    """``/usr/bin/pytest`` -> ``pytest`` (a path's last part; quotes dropped)."""
    return word.strip("'\"").rstrip("/").rsplit("/", 1)[-1]


@dataclass
class AnswerReader:
    """Watches one answer go by (a JSON body, chat/completions chunks, or named SSE events)
    and says how it ended (:meth:`end`)."""

    # Calls whose arguments came whole (a JSON body, a finished Responses output item).
    _keys: list[str] = field(default_factory=list)
    # Calls streamed in pieces, by their place in the answer: [name, arguments so far].
    _pieces: dict[tuple[int | None, ...], list[str]] = field(default_factory=dict)
    _says_tool_use: bool = False  # finish_reason / stop_reason named tool calls

    # ---------------------------------------------------------------- whole answers
    def body(self, api: str, data: Any) -> None:
        """A non-streamed answer of API ``api`` (``chat``, ``completions``, ``responses``,
        ``messages``)."""
        if not isinstance(data, dict):
            return
        if api == "chat":
            for choice in _dicts(data.get("choices")):
                self._says_tool_use |= choice.get("finish_reason") == "tool_calls"
                message = choice.get("message")
                if isinstance(message, dict):
                    for call in _dicts(message.get("tool_calls")):
                        fn = call.get("function")
                        if isinstance(fn, dict):
                            self._add(tool_call_key(fn.get("name"), fn.get("arguments")))
        elif api == "responses":
            self._output_items(data.get("output"))
        elif api == "messages":
            self._says_tool_use |= data.get("stop_reason") == "tool_use"
            for block in _dicts(data.get("content")):
                if block.get("type") == "tool_use":
                    self._add(tool_call_key(block.get("name"), block.get("input")))

    # ---------------------------------------------------------------- chat / completions SSE
    def chunk(self, chunk: dict[str, Any]) -> None:
        """One chat or completions stream chunk (parsed by the relay)."""
        for choice in _dicts(chunk.get("choices")):
            if choice.get("finish_reason") == "tool_calls":
                self._says_tool_use = True
            delta = choice.get("delta")
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            for call in _dicts(calls):
                fn = call.get("function")
                if isinstance(fn, dict):
                    self._piece(_place(choice.get("index"), call.get("index")),
                                fn.get("name"), fn.get("arguments"))

    # ---------------------------------------------------------------- named events
    def event(self, name: str, frame: list[str]) -> None:
        """One named SSE event (Responses, Messages): its name and its lines as relayed.
        Only the few events that can carry a tool call are parsed."""
        if name == "content_block_delta":
            # One per token: parsed only when it continues a tool_use block's input.
            if not self._pieces or not any("input_json_delta" in ln for ln in frame):
                return
        elif name == "response.output_item.done":
            if not any('_call"' in ln for ln in frame):  # a message or reasoning item
                return
        elif name not in _WATCHED_EVENTS:
            return
        data = _data(frame)
        if data is None:
            return
        if name in ("response.completed", "response.incomplete"):
            response = data.get("response")
            if isinstance(response, dict) and isinstance(response.get("output"), list):
                self._keys.clear()  # the whole output says it all
                self._output_items(response["output"])
        elif name == "response.output_item.done":
            self._output_items([data.get("item")])
        elif name == "content_block_start":
            block = data.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                start = block.get("input")
                self._piece(_place(data.get("index")), block.get("name"),
                            json.dumps(start) if isinstance(start, dict) and start else None)
        elif name == "content_block_delta":
            delta = data.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "input_json_delta":
                self._piece(_place(data.get("index")), None, delta.get("partial_json"))
        elif name == "message_delta":
            delta = data.get("delta")
            self._says_tool_use |= isinstance(delta, dict) and (
                delta.get("stop_reason") == "tool_use")

    # ---------------------------------------------------------------- the result
    def end(self) -> AnswerEnd:
        """How the answer ended, from what was seen of it."""
        keys = list(self._keys)
        keys += (tool_call_key(name, arguments) for name, arguments in self._pieces.values())
        if not keys and self._says_tool_use:
            keys.append("tool")  # the client runs something; the answer did not say what
        return AnswerEnd(tuple(keys[:_MAX_CALLS]))

    # ---------------------------------------------------------------- internals
    def _add(self, key: str) -> None:
        if len(self._keys) < _MAX_CALLS:
            self._keys.append(key)

    def _piece(self, where: tuple[int | None, ...], name: Any, arguments: Any) -> None:
        call = self._pieces.get(where)
        if call is None:
            if len(self._pieces) >= _MAX_CALLS:
                return
            call = self._pieces[where] = ["", ""]
        if isinstance(name, str) and name:
            call[0] = name
        if isinstance(arguments, str) and len(call[1]) <= MAX_ARGUMENT_CHARS:
            call[1] += arguments

    def _output_items(self, items: Any) -> None:
        for item in _dicts(items):
            kind = item.get("type")
            if not isinstance(kind, str) or not kind.endswith("_call") or kind in _SERVER_RUN:
                continue
            action = item.get("action")  # local_shell_call, shell_call: what they run
            self._add(tool_call_key(item.get("name") or kind[: -len("_call")],
                                    action if isinstance(action, dict) else item.get("arguments")))


_WATCHED_EVENTS = frozenset({"response.completed", "response.incomplete",
                             "response.output_item.done", "content_block_start",
                             "message_delta"})


def _place(*indexes: Any) -> tuple[int | None, ...]:
    """Where a streamed call is in the answer (its choice, its index), as a key."""
    return tuple(i if isinstance(i, int) else None for i in indexes)


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _data(frame: list[str]) -> dict[str, Any] | None:
    text = "\n".join(line[5:].lstrip() for line in frame if line.startswith("data:"))
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
