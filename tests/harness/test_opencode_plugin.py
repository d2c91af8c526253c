"""The OpenCode plugin, run by Node.js against the fake router: the hooks OpenCode 1.18.33
calls, with the inputs it was seen to pass (``tool.execute.before``: tool, sessionID, callID;
``session.created`` with ``info.parentID`` for a subagent's session; ``session.idle``;
``dispose`` at exit). The session id is OpenCode's ``x-session-id`` header."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.fake_router import FakeRouter

from .conftest import hold

PLUGIN = Path(__file__).parents[2] / "src" / "kvtether" / "harness" / "opencode-plugin.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js (OpenCode's plugins are JS)")

DRIVER = """
const { KVTether } = await import(process.argv[2])
const hooks = await KVTether({ directory: "/tmp" })
const wait = (ms) => new Promise((r) => setTimeout(r, ms))
const tool = (sessionID, callID, name) => ({ tool: name, sessionID, callID })
await hooks["chat.headers"]({ sessionID: "ses_main", agent: "build" }, { headers: {} })
await hooks["tool.execute.before"](tool("ses_main", "call_read", "read"), { args: {} })
const result = { title: "", output: "", metadata: {} }
await hooks["tool.execute.after"](tool("ses_main", "call_read", "read"), result)
await hooks["tool.execute.before"](tool("ses_main", "call_task", "task"), { args: {} })
await hooks.event({ event: { type: "session.created", properties: { sessionID: "ses_child",
  info: { id: "ses_child", parentID: "ses_main" } } } })
await hooks["chat.headers"]({ sessionID: "ses_child", agent: "general" }, { headers: {} })
await hooks["tool.execute.before"](tool("ses_child", "call_bash", "bash"), { args: {} })
await wait(Number(process.argv[3]))
await hooks["tool.execute.after"](tool("ses_child", "call_bash", "bash"), result)
await hooks.event({ event: { type: "session.idle", properties: { sessionID: "ses_child" } } })
await hooks["tool.execute.after"](tool("ses_main", "call_task", "task"), result)
await hooks.event({ event: { type: "session.idle", properties: { sessionID: "ses_main" } } })
await hooks.dispose()
console.log("done")
"""


def drive(tmp_path: Path, url: str, wait_ms: int = 2000) -> subprocess.CompletedProcess[str]:
    module = tmp_path / "kvtether.mjs"  # .mjs: Node reads it as the ES module OpenCode loads
    shutil.copy(PLUGIN, module)
    driver = tmp_path / "driver.mjs"
    driver.write_text(DRIVER)
    assert NODE is not None
    return subprocess.run([NODE, str(driver), module.as_uri(), str(wait_ms)], capture_output=True,
                          text=True, timeout=60, env={"KVTETHER_URL": url, "PATH": "/usr/bin:/bin"})


def test_heartbeats_running_tools_and_releases_subagents_and_sessions(
        router: FakeRouter, tmp_path: Path) -> None:
    hold(router, "ses_main", "ses_child")
    router.lease_remaining_s = 1.5  # a heartbeat every 0.5 s after the first, at 1 s
    done = drive(tmp_path, router.url)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "done", "")

    beats = router.requests_to("/heartbeat")
    by_session = {cid: [b.body for b in beats if b.path == f"/v1/sessions/{cid}/heartbeat"]
                  for cid in ("ses_main", "ses_child")}
    assert len(by_session["ses_main"]) >= 2 and len(by_session["ses_child"]) >= 2
    assert len(beats) == sum(map(len, by_session.values()))
    assert {json.dumps(b) for b in by_session["ses_main"]} == {
        json.dumps({"phase": "tool_running", "tool_name": "task"})}  # never the quick read
    assert {json.dumps(b) for b in by_session["ses_child"]} == {
        json.dumps({"phase": "tool_running", "tool_name": "bash"})}
    # The subagent's session when it went idle, the main one only when OpenCode exits.
    assert [(r.method, r.path) for r in router.received if r.method == "DELETE"] == [
        ("DELETE", "/v1/sessions/ses_child"), ("DELETE", "/v1/sessions/ses_main")]
    assert router.received[-1].method == "DELETE"  # nothing after


def test_a_session_without_kv_is_heartbeated_once(router: FakeRouter, tmp_path: Path) -> None:
    router.lease_remaining_s = 1.5
    done = drive(tmp_path, router.url)  # the router knows neither session: 404
    assert done.returncode == 0, done.stderr
    assert len(router.requests_to("/heartbeat")) == 2  # one per tool, then no more


def test_a_router_that_is_down_changes_nothing(dead_url: str, tmp_path: Path) -> None:
    done = drive(tmp_path, dead_url, wait_ms=1500)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "done", "")
