"""Claude Code, Codex and OpenCode as installed from npm (pinned in scripts/harnesses), run
non-interactively and offline against the real `cpu-agents` stack, configured as the README's
coding-agent section says: a first run, then a continued one whose turn reuses the first's KV.

Also the README's curl lines (what Claude Code sends for a main agent and a subagent).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.harnesses import Harness, Run, installed, readme_curl_lines

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not installed() and not os.environ.get("CI"),
                       reason="the harnesses are installed by `make test` "
                              "(scripts/setup-harnesses.sh)"),
]


def _session(stack, cid: str) -> dict:
    r = httpx.get(f"{stack.base_url}/v1/sessions/{cid}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _main_turns(status: dict) -> list[dict]:
    """The turns of the conversation's main branch (a side request's branch left out)."""
    main = status.get("main_branch") or status["conversation_id"]
    if main == status["conversation_id"]:
        return status["turns"]
    return next(b["turns"] for b in status["branches"] if b["conversation_id"] == main)


def _assert_answered(run: Run) -> None:
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    assert "API Error" not in said and '"is_error":true' not in said, said[-3000:]
    assert run.session_id, run.stdout[-2000:]


@pytest.mark.parametrize("name", ["claude", "codex", "opencode"])
def test_a_harness_as_shipped_runs_and_its_continued_run_fires(
    agents_stack, tmp_path: Path, name: str
) -> None:
    harness = Harness(name, agents_stack.base_url, agents_stack.model, tmp_path / name)
    first = harness.run("list the files in this directory")
    _assert_answered(first)
    turns = _main_turns(_session(agents_stack, first.session_id))
    assert turns[0]["outcome"] == "miss:first_turn", turns
    # A harness's first request holds its whole system prompt and tool schemas.
    assert turns[0]["prompt_tokens"] > 4000, turns[0]
    # Every later turn of the first run (a harness may take several steps) reused the KV.
    assert all(t["outcome"] == "fired" for t in turns[1:]), turns
    n = len(turns)

    again = harness.run("now run the tests", cont=True)
    _assert_answered(again)
    assert again.session_id == first.session_id
    status = _session(agents_stack, first.session_id)
    later = _main_turns(status)[n:]
    assert later and all(t["outcome"] == "fired" for t in later), later
    assert later[0]["reused_tokens"] >= turns[-1]["prompt_tokens"] - agents_stack.block_size_tokens


@pytest.mark.parametrize("name", ["claude", "opencode"])
def test_with_kvtether_s_hooks_the_kv_is_released_when_the_harness_exits(
    agents_stack, tmp_path: Path, name: str
) -> None:
    harness = Harness(name, agents_stack.base_url, agents_stack.model, tmp_path / name,
                      hooks=True)
    run = harness.run("list the files in this directory")
    _assert_answered(run)
    status = _session(agents_stack, run.session_id)
    assert status["turns"] or status["branches"], status
    # Released at the session's end (Claude Code's SessionEnd hook, OpenCode's plugin on exit).
    assert all(b["retained_tokens"] == 0 for b in [status, *status["branches"]]), status
    assert status["lease_state"] == "released", status


def test_the_readme_curl_lines_run_as_written(agents_stack) -> None:
    import json

    script = readme_curl_lines()
    host = agents_stack.base_url.removeprefix("http://")
    script = script.replace("localhost:8000", host)
    try:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                             text=True, timeout=600, check=True).stdout
        decoder, values, i = json.JSONDecoder(), [], 0
        while i < len(out):  # curl prints the JSON values one after another
            if out[i].isspace():
                i += 1
                continue
            value, i = decoder.raw_decode(out, i)
            values.append(value)
        *answers, status = values
        assert all(a["type"] == "message" for a in answers), answers
        assert status["conversation_id"] == "cc-1:agent:explore"
        assert status["parent_id"] == "cc-1" and status["turn_count"] == 1
    finally:
        for cid in ("cc-1", "cc-1:agent:explore"):
            httpx.delete(f"{agents_stack.base_url}/v1/sessions/{cid}", timeout=60)
