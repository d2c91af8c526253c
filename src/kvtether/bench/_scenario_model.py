"""What a scenario is: the model of a scenario file, shared by the generator and the readers
(:mod:`kvtether.bench.scenario`, :mod:`kvtether.bench.traces`), and the vocabulary their
made-up text is drawn from."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtether.errors import ScenarioError

__all__ = ["GapKind", "Message", "Scenario", "ScenarioSession", "ScenarioTurn", "read_json",
           "vocabulary_text"]

SCENARIO_VERSION = 1
GapKind = Literal["tool", "human", "end"]

# Words that tokenizers mostly keep whole: about one token per word (plus its space).
VOCABULARY = (
    "the a to of and in is it for on with as at by from this that file line test error value "
    "function class module return import call result output input data list map key item "
    "read write open close path name type size count index start end next time step plan "
    "check update build run pass fail log trace stack cache token lease block decode prefill "
    "router request response model agent tool user system message turn session history"
).split()


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ScenarioTurn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    append: list[Message] = Field(min_length=1, description="messages added before the call")
    max_tokens: int = Field(ge=1, description="output cap of the model call")
    gap_s: float = Field(default=0.0, ge=0, description="workload seconds until the next turn")
    gap_kind: GapKind = "end"
    tool: str | None = Field(default=None, description="the tool that runs during the gap")


class ScenarioSession(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(min_length=1, max_length=200)
    start_s: float = Field(default=0.0, ge=0, description="workload seconds after the run starts")
    stream: bool = True
    turns: list[ScenarioTurn] = Field(min_length=1)


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kvtether_scenario: Literal[1] = SCENARIO_VERSION
    name: str
    source: dict[str, Any] = Field(default_factory=dict, description="how it was made")
    system_prompt: str
    sessions: list[ScenarioSession] = Field(min_length=1)

    # --- facts about it ------------------------------------------------------------------
    @property
    def turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def gaps(self, kind: GapKind) -> list[float]:
        return [t.gap_s for s in self.sessions for t in s.turns if t.gap_kind == kind]

    def summary(self, fixed_ttl_s: float | None = None) -> dict[str, Any]:
        tools, humans = self.gaps("tool"), self.gaps("human")
        out: dict[str, Any] = {
            "sessions": len(self.sessions),
            "turns": self.turns,
            "streamed_sessions": sum(s.stream for s in self.sessions),
            "tool_gaps": len(tools),
            "human_gaps": len(humans),
            "longest_tool_s": round(max(tools, default=0.0), 1),
            "longest_human_s": round(max(humans, default=0.0), 1),
        }
        if fixed_ttl_s is not None:
            out["gaps_longer_than_fixed_ttl"] = sum(g > fixed_ttl_s for g in tools + humans)
        return out

    def under_own_prompt(self, label: str) -> Scenario:
        """This scenario with ``label`` ahead of its system prompt. For replaying it again on
        the same engines: fresh conversation ids keep the replays' retained KV apart, but a
        prefix cache (colocated's, prefill's) matches prompts, not ids, and would serve a later
        replay whole prompts an earlier one computed."""
        return self.model_copy(update={"system_prompt": f"{label}.\n{self.system_prompt}"})

    # --- files ---------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1) + "\n")


def read_json(path: Path, what: str) -> Any:
    """``path``'s JSON; a :class:`ScenarioError` naming ``what`` when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"cannot read {what} {path}: {exc}") from None


def vocabulary_text(rng: random.Random, words: int) -> str:
    """``words`` words (at least one) drawn from :data:`VOCABULARY`: about as many tokens."""
    return " ".join(rng.choice(VOCABULARY) for _ in range(max(1, words)))
