"""One coding-agent-shaped session through its whole life, on a `cpu-agents` stack.

The shape of the public Claude Code and Codex traces (docs/coding-agents.md): a system prompt
of several thousand tokens, then turn after turn that appends the model's answer and a tool's
output. Past ``--compact-at-tokens`` the agent compacts its history, as the harnesses do: the
same system prompt, a summary and the last request, under the same conversation id. It then
goes on with larger tool outputs until a prompt no longer fits the model's context, which vLLM
refuses; the session ends with a release (``DELETE``).

After every request it records the turn's outcome and the KV the conversation retains on
decode (all its branches together); ``--out DIR`` writes ``long-session.json``, a table and a
plot of retained tokens per turn. tests/integration/test_long_session_real.py runs it and
checks what it recorded.

    kvtether stack up --profile cpu-agents --detach
    python -m benchmarks.long_session --out docs/benchmarks/long-session
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

# Words the `agents` model's tokenizer knows: one token each.
_WORDS = ("read file test build fix bug error result output function class module import "
          "return value path tool tools call run shell command repo files tests code python "
          "write edit check find show make use need see look get set list done plan step").split()


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))


@dataclass
class Step:
    turn: int
    phase: str  # "growing", "compaction", "compacted", "over_limit"
    status: int
    outcome: str | None
    prompt_tokens: int
    reused_tokens: int
    retained_tokens: int  # on decode, the conversation's branches together, after the turn
    branches_holding: int  # how many of its branches hold KV then
    seconds: float
    error: str | None = None


@dataclass
class LongSession:
    conversation_id: str
    max_model_len: int
    steps: list[Step] = field(default_factory=list)
    released_tokens: int = 0  # what the final DELETE freed

    def to_json(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "max_model_len": self.max_model_len,
                "released_tokens": self.released_tokens,
                "steps": [asdict(s) for s in self.steps]}


def _retained(client: httpx.Client, cid: str) -> tuple[int, int]:
    status = client.get(f"/v1/sessions/{cid}").json()
    holding = [b["retained_tokens"] for b in [status, *status.get("branches", [])]
               if b["retained_tokens"]]
    return sum(holding), len(holding)


def run(base_url: str, model: str, *, conversation_id: str | None = None, seed: int = 7,
        system_tokens: int = 8000, growth_tokens: int = 800, compact_at_tokens: int = 42000,
        compacted_growth_tokens: int = 4000, max_model_len: int = 65536,
        timeout_s: float = 600) -> LongSession:
    rng = random.Random(seed)
    cid = conversation_id or f"long-{seed}-{int(time.time())}"
    system = {"role": "system", "content": "You are a coding agent. " + _text(rng, system_tokens)}
    messages: list[dict[str, Any]] = [system, {"role": "user", "content": "fix the failing test"}]
    session = LongSession(cid, max_model_len)
    phase, growth, turn = "growing", growth_tokens, 0
    with httpx.Client(base_url=base_url, timeout=timeout_s,
                      headers={"X-Conversation-Id": cid}) as client:
        while True:
            turn += 1
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions",
                            json={"model": model, "messages": messages, "max_tokens": 256})
            seconds = time.perf_counter() - t0
            retained, holding = _retained(client, cid)
            if r.status_code != 200:
                session.steps.append(Step(turn, "over_limit", r.status_code, None, 0, 0,
                                          retained, holding, seconds, r.text[:500]))
                break
            body = r.json()
            session.steps.append(Step(
                turn, phase, 200, r.headers.get("X-KVTether-Reuse"),
                body["usage"]["prompt_tokens"], int(r.headers.get("X-KVTether-Reused-Tokens", 0)),
                retained, holding, seconds))
            prompt = body["usage"]["prompt_tokens"]
            messages.append({"role": "assistant",
                             "content": body["choices"][0]["message"]["content"] or ""})
            if phase == "growing" and prompt >= compact_at_tokens:
                # Compaction: the harness rewrites its history into a summary.
                phase, growth = "compaction", compacted_growth_tokens
                messages = [system,
                            {"role": "user", "content": "Summary of the session so far: "
                                                        + _text(rng, 600)},
                            {"role": "user", "content": "go on from the summary"}]
                continue
            if phase == "compaction":
                phase = "compacted"
            messages.append({"role": "user", "content": "tool output: " + _text(rng, growth)})
            if turn > 400:  # a bound, whatever the sizes
                break
        r = client.delete(f"/v1/sessions/{cid}")
        session.released_tokens = r.json().get("retained_tokens_freed", 0) if r.is_success else 0
    return session


def load(path: Path) -> LongSession:
    data = json.loads(path.read_text())
    return LongSession(data["conversation_id"], data["max_model_len"],
                       [Step(**s) for s in data["steps"]], data["released_tokens"])


def write(session: LongSession, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "long-session.json").write_text(json.dumps(session.to_json(), indent=1) + "\n")
    rows = ["| turn | phase | status | outcome | prompt tokens | reused | retained (all branches) "
            "| branches holding KV |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {s.turn} | {s.phase} | {s.status} | {s.outcome or '-'} | {s.prompt_tokens} | "
             f"{s.reused_tokens} | {s.retained_tokens} | {s.branches_holding} |"
             for s in session.steps]
    (out / "long-session.md").write_text("\n".join(rows) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ok = [s for s in session.steps if s.status == 200]
    ax.plot([s.turn for s in ok], [s.prompt_tokens for s in ok], label="prompt tokens",
            color="#555555", linestyle="--")
    end = session.steps[-1].turn + 1  # the release
    ax.plot([s.turn for s in session.steps] + [end],
            [s.retained_tokens for s in session.steps] + [0],
            label="KV retained on decode (all branches)", color="#2e7d32")
    ax.annotate("over the limit (400),\nthen DELETE", (end, 0),
                xytext=(end + 1, session.max_model_len * 0.3), fontsize=8, color="#2e7d32",
                arrowprops={"arrowstyle": "->", "color": "#2e7d32"})
    for s in session.steps:
        if s.phase == "compaction":
            ax.axvline(s.turn, color="#ef6c00", linewidth=1)
            ax.annotate("compaction", (s.turn, session.max_model_len), xytext=(-62, -14),
                        textcoords="offset points", color="#ef6c00", fontsize=8)
    ax.axhline(session.max_model_len, color="#999999", linewidth=0.8)
    ax.set_xlabel("turn")
    ax.set_ylabel("tokens")
    ax.set_title("One coding-agent session on cpu-agents: KV held per conversation")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "long-session.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="agents")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    session = run(args.url, args.model)
    for s in session.steps:
        print(f"{s.turn:3d} {s.phase:10s} {s.status} {s.outcome or '-':18s} "
              f"prompt {s.prompt_tokens:6d} reused {s.reused_tokens:6d} "
              f"retained {s.retained_tokens:6d} ({s.branches_holding} branch) {s.seconds:.2f} s")
    print(f"released at the end: {session.released_tokens} tokens")
    if args.out:
        write(session, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
