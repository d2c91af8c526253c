"""Growth prediction: how big the next prompt will be, and how long until it arrives.

The router sizes a lease from these hints, and heartbeats carry them while a tool runs. Tool
durations and tool-result sizes are heavy-tailed (p50 0.3 s, p99 3.6 min for durations), so
every estimate is a running median in log space: robust to the rare huge value and the right
point estimate when the cost of an error is its absolute size. Estimates are hierarchical:
a tool called with a recognisable command (``bash`` running ``pytest``) starts from what the
tool in general did, which starts from a prior by tool name, then each learns from its own runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtether.protocol import Phase

__all__ = ["GrowthPredictor", "Prediction", "PromptSizer", "tool_key"]

# (name fragment, typical duration s, typical result tokens); first match wins. Rough shapes
# of coding-agent tools; the session replaces them with what it observes after one run.
_TOOL_PRIORS: tuple[tuple[str, float, float], ...] = (
    ("test", 30.0, 1500.0),
    ("build", 30.0, 1000.0),
    ("install", 20.0, 500.0),
    ("fetch", 3.0, 2500.0),
    ("web", 3.0, 2500.0),
    ("http", 3.0, 2500.0),
    ("browse", 5.0, 2500.0),
    ("bash", 2.0, 400.0),
    ("shell", 2.0, 400.0),
    ("exec", 2.0, 400.0),
    ("search", 1.0, 500.0),
    ("grep", 0.3, 400.0),
    ("find", 0.3, 300.0),
    ("read", 0.05, 900.0),
    ("cat", 0.05, 900.0),
    ("edit", 0.1, 60.0),
    ("write", 0.1, 60.0),
)
_DEFAULT_TOOL_S = 0.3  # TraceLab p50 over 432k tool calls
_DEFAULT_RESULT_TOKENS = 500.0
_DEFAULT_IDLE_S = 84.0  # human think time p50 (1.4 min)
_DEFAULT_USER_TOKENS = 150.0
_DEFAULT_OUTPUT_TOKENS = 250.0
_MAX_VARIANTS_PER_TOOL = 64
# Keys (tools and their variants) learned per table: a conversation that never ends may call
# ever more distinct tools (generated names, MCP servers coming and going); the least recently
# observed key is forgotten and falls back to its tool's estimate, else to the prior.
_MAX_TOOL_KEYS = 512
# Tool runs since the last reply whose keys learn its growth (a session used only for tools
# may never see a reply); the share of each is still taken over all of them.
_MAX_PENDING_TOOLS = 64
_ALPHA = 0.15  # EWMA weight of the newest sample once a key has a few of them
_RATE_ALPHA = 0.3  # tool-call rate: few samples per conversation, follow them quickly


def tool_key(name: str, args: Mapping[str, Any] | Sequence[Any] | None = None) -> str:
    """``name``, or ``name:word`` when the first string argument starts with a short word.

    ``bash("pytest -x")`` and ``bash("ls")`` take very different times; the first word of the
    command tells them apart. Paths and patterns also become variants, which costs nothing: a
    variant seen once is mostly its tool's estimate (see ``_LogStat.blend``).
    """
    values = args.values() if isinstance(args, Mapping) else (args or ())
    first = next((v for v in values if isinstance(v, str) and v.strip()), None)
    if first is None:
        return name
    word = first.split(None, 1)[0][:32]
    return f"{name}:{word}" if word.isprintable() else name


class _LogStat:
    """Running median of a positive, log-normal-ish quantity (EWMA of logs)."""

    __slots__ = ("n", "mean_log")

    def __init__(self, prior: float) -> None:
        self.n = 0
        self.mean_log = math.log(max(prior, 1e-3))

    def observe(self, value: float) -> None:
        self.n += 1
        weight = max(1.0 / self.n, _ALPHA)
        self.mean_log += weight * (math.log(max(value, 1e-3)) - self.mean_log)

    def blend(self, parent_log: float) -> float:
        # Shrink toward the parent while this key has few samples (half a sample's worth).
        w = self.n / (self.n + 0.5)
        return w * self.mean_log + (1.0 - w) * parent_log

    @property
    def value(self) -> float:
        return math.exp(self.mean_log)


@dataclass(frozen=True, slots=True)
class Prediction:
    next_prompt_tokens: int
    next_turn_gap_s: float
    phase: Phase


def _prior(name: str) -> tuple[float, float]:
    lowered = name.lower()
    for fragment, duration_s, result_tokens in _TOOL_PRIORS:
        if fragment in lowered:
            return duration_s, result_tokens
    return _DEFAULT_TOOL_S, _DEFAULT_RESULT_TOKENS


class GrowthPredictor:
    """Learns one conversation's rhythm: tool durations, tool-result sizes, output lengths."""

    def __init__(self) -> None:
        self._duration: dict[str, _LogStat] = {}
        self._appended: dict[str, _LogStat] = {}
        self._tool_gap = _LogStat(_DEFAULT_TOOL_S)
        self._idle_gap = _LogStat(_DEFAULT_IDLE_S)
        self._tool_appended = _LogStat(_DEFAULT_RESULT_TOKENS)
        self._user_appended = _LogStat(_DEFAULT_USER_TOKENS)
        self._output = _LogStat(_DEFAULT_OUTPUT_TOKENS)
        self._tool_call_rate = 0.8  # agents mostly call tools; learned per conversation
        self._last: tuple[int, int] | None = None  # (prompt, output) tokens of the last turn
        self._pending_tools: list[str] = []
        self._pending_count = 0  # tool runs since the last reply, listed or not

    # --- observations ---------------------------------------------------------------------
    def observe_tool(self, key: str, duration_s: float) -> None:
        self._update(self._duration, key, 0, duration_s)
        self._pending_count += 1
        if len(self._pending_tools) < _MAX_PENDING_TOOLS:
            self._pending_tools.append(key)

    def observe_gap(self, gap_s: float, *, after_tool_calls: bool) -> None:
        (self._tool_gap if after_tool_calls else self._idle_gap).observe(gap_s)

    def observe_turn(self, prompt_tokens: int, output_tokens: int, called_tools: bool) -> None:
        """A reply arrived: learn how much the prompt grew since the last one, and from what."""
        if self._last is not None and prompt_tokens > 0:
            appended = prompt_tokens - self._last[0] - self._last[1]
            if appended >= 0 and self._pending_tools:
                share = appended / self._pending_count
                for key in self._pending_tools:
                    self._update(self._appended, key, 1, share)
                self._tool_appended.observe(appended)
            elif appended >= 0:
                self._user_appended.observe(appended)
        if prompt_tokens > 0:
            self._last = (prompt_tokens, output_tokens)
        self._pending_tools.clear()
        self._pending_count = 0
        self._output.observe(output_tokens)
        self._tool_call_rate += _RATE_ALPHA * (float(called_tools) - self._tool_call_rate)

    # --- predictions ----------------------------------------------------------------------
    def tool_duration_s(self, key: str) -> float:
        return math.exp(self._estimate(self._duration, key, 0))

    def at_request(self, prompt_tokens: int, *, tools_offered: bool) -> Prediction:
        """Before the reply: guess whether a tool or a person comes next, and the growth."""
        if tools_offered and self._tool_call_rate >= 0.5:
            phase, gap, appended = Phase.TOOL_RUNNING, self._tool_gap, self._tool_appended
        else:
            phase, gap, appended = Phase.IDLE, self._idle_gap, self._user_appended
        tokens = prompt_tokens + self._output.value + appended.value
        return Prediction(round(tokens), gap.value, phase)

    def at_tool(
        self, key: str, *, elapsed_s: float = 0.0, eta_s: float | None = None
    ) -> Prediction:
        """While a tool runs: the reply is known, the tool is known; only its result is not."""
        expected_s = eta_s if eta_s is not None else self.tool_duration_s(key)
        # Heavy tails: a call that outlived its estimate is likely to run a while longer yet.
        remaining_s = max(expected_s - elapsed_s, 0.5 * elapsed_s)
        prompt, output = self._last or (0, 0)
        appended = math.exp(self._estimate(self._appended, key, 1))
        return Prediction(round(prompt + output + appended), remaining_s, Phase.TOOL_RUNNING)

    # --- internals ------------------------------------------------------------------------
    @staticmethod
    def _keys(key: str) -> tuple[str, ...]:
        name = key.split(":", 1)[0]
        return (name,) if name == key else (name, key)

    def _update(self, table: dict[str, _LogStat], key: str, which: int, value: float) -> None:
        stats = {id(s): s for s in (self._stat(table, k, which) for k in self._keys(key))}
        for stat in stats.values():
            stat.observe(value)

    def _stat(self, table: dict[str, _LogStat], key: str, which: int) -> _LogStat:
        """``key``'s statistic, moved to the end of ``table`` (kept in observation order)."""
        stat = table.pop(key, None)
        if stat is None:
            name = key.split(":", 1)[0]
            if key != name and sum(k.startswith(name + ":") for k in table) >= (
                _MAX_VARIANTS_PER_TOOL
            ):
                # Unbounded distinct arguments (paths, patterns): learn into the tool instead.
                return self._stat(table, name, which)
            if len(table) >= _MAX_TOOL_KEYS:
                del table[next(iter(table))]  # the least recently observed
            stat = _LogStat(_prior(name)[which])
        table[key] = stat
        return stat

    def _estimate(self, table: dict[str, _LogStat], key: str, which: int) -> float:
        name = key.split(":", 1)[0]
        prior_log = math.log(_prior(name)[which])
        by_name = table.get(name)
        name_log = by_name.blend(prior_log) if by_name is not None else prior_log
        by_variant = table.get(key) if key != name else None
        return by_variant.blend(name_log) if by_variant is not None else name_log


class PromptSizer:
    """This turn's prompt tokens, estimated before the router counts them (no tokenizer here).

    When the turn extends the last one: the last prompt and reply (counted by the server) plus
    the new characters at a learned tokens-per-character rate. Otherwise: the request body size
    at a learned tokens-per-byte rate (JSON syntax and tool schemas carry few tokens).
    """

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None  # (prompt, output) tokens of the last turn
        self._per_char = 0.25
        self._per_byte = 0.2

    def estimate(self, *, extends: bool, new_chars: int, request_bytes: int) -> int:
        if extends and self._last is not None:
            return round(sum(self._last) + new_chars * self._per_char)
        return round(request_bytes * self._per_byte)

    def learn(
        self, prompt_tokens: int, output_tokens: int, *, new_chars: int, request_bytes: int
    ) -> None:
        if not prompt_tokens:
            return
        if request_bytes:
            self._per_byte += _RATE_ALPHA * (prompt_tokens / request_bytes - self._per_byte)
        if self._last is not None and new_chars > 100:  # too few characters: mostly template
            per_char = (prompt_tokens - sum(self._last)) / new_chars
            self._per_char += _RATE_ALPHA * (min(max(per_char, 0.05), 1.0) - self._per_char)
        self._last = (prompt_tokens, output_tokens)
