"""`kvtether hook install`: one command, run again at will, that leaves the user's other
settings alone."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtether.cli import main as cli
from kvtether.errors import ConfigError
from kvtether.harness import install_claude_code, install_opencode
from kvtether.harness.install import claude_code_command, claude_code_hooks

EVENTS = ["PreToolUse", "PostToolUse", "PostToolUseFailure", "SubagentStop", "SessionEnd"]


def commands(settings: dict, event: str) -> list[str]:
    return [h["command"] for group in settings["hooks"].get(event, []) for h in group["hooks"]]


def test_writes_the_hooks_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / ".claude" / "settings.json"
    assert cli(["hook", "install", "claude-code", "--settings", str(path)]) == 0
    assert cli(["hook", "install", "claude-code", "--settings", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"kvtether hooks for Claude Code: installed in {path}",
                   f"kvtether hooks for Claude Code: already installed in {path}"]
    settings = json.loads(path.read_text())
    assert list(settings["hooks"]) == EVENTS
    for event in EVENTS:
        assert commands(settings, event) == [claude_code_command()]
    # Only the tool-end hooks (they only touch a file) and the session's release (one DELETE,
    # which must land before `claude -p` exits) hold the harness up.
    hooks = {e: settings["hooks"][e][0]["hooks"][0] for e in EVENTS}
    assert {e for e, h in hooks.items() if not h.get("async")} == {
        "PostToolUse", "PostToolUseFailure", "SessionEnd"}
    assert {settings["hooks"][e][0].get("matcher") for e in EVENTS[:3]} == {"*"}


def test_keeps_other_settings_and_replaces_its_own_older_entries(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    mine = {"type": "command", "command": "notify-send done"}
    path.write_text(json.dumps({
        "model": "smol",
        "env": {"ANTHROPIC_BASE_URL": "http://127.0.0.1:8000"},
        "hooks": {
            "PreToolUse": [{"matcher": "Bash", "hooks": [mine]},
                           {"matcher": "*", "hooks": [
                               {"type": "command", "command": "kvtether hook claude-code"}]}],
            "Stop": [{"hooks": [mine]}],
            "SessionEnd": [{"hooks": [
                {"type": "command", "command": "/old/venv/bin/python -m kvtether.harness "
                                               "claude-code", "async": True}, mine]}],
        },
    }))
    assert install_claude_code(path, command="/new/python -m kvtether.harness claude-code").changed
    settings = json.loads(path.read_text())
    assert settings["model"] == "smol" and settings["env"]["ANTHROPIC_BASE_URL"]
    assert settings["hooks"]["Stop"] == [{"hooks": [mine]}]
    assert settings["hooks"]["PreToolUse"][0] == {"matcher": "Bash", "hooks": [mine]}
    for event in EVENTS:
        ours = [c for c in commands(settings, event) if "kvtether" in c]
        assert ours == ["/new/python -m kvtether.harness claude-code"], event
    assert "notify-send done" in commands(settings, "SessionEnd")


@pytest.mark.parametrize("content", ["{not json", "[]", '{"hooks": []}'])
def test_a_file_that_is_not_claude_settings_is_left_alone(tmp_path: Path, content: str) -> None:
    path = tmp_path / "settings.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="settings"):
        install_claude_code(path)
    assert path.read_text() == content
    assert cli(["hook", "install", "claude-code", "--settings", str(path)]) == 1


def test_the_default_file_is_claude_codes_user_settings(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude"))
    assert install_claude_code().path == tmp_path / "claude" / "settings.json"
    monkeypatch.delenv("CLAUDE_CONFIG_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert install_claude_code().path == tmp_path / ".claude" / "settings.json"


def test_the_command_it_writes_runs_the_hook(hook_env: dict[str, str]) -> None:
    command = claude_code_hooks()["PostToolUse"][0]["hooks"][0]["command"]
    assert shlex.split(command)[0] == sys.executable
    event = {"hook_event_name": "PostToolUse", "session_id": "s-1", "tool_use_id": "toolu_1"}
    done = subprocess.run(command, shell=True, input=json.dumps(event), capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert (Path(hook_env["KVTETHER_HOOK_STATE_DIR"]) / "s-1" / "toolu_1.done").exists()


def test_the_kvtether_cli_runs_the_same_hook(hook_env: dict[str, str]) -> None:
    event = {"hook_event_name": "PostToolUse", "session_id": "s-2", "tool_use_id": "toolu_2"}
    done = subprocess.run([sys.executable, "-m", "kvtether", "hook", "claude-code"],
                          input=json.dumps(event), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (Path(hook_env["KVTETHER_HOOK_STATE_DIR"]) / "s-2" / "toolu_2.done").exists()


def test_copies_the_opencode_plugin_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = tmp_path / ".opencode" / "plugins"
    assert cli(["hook", "install", "opencode", "--dir", str(plugins)]) == 0
    assert cli(["hook", "install", "opencode", "--dir", str(plugins)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"kvtether plugin for OpenCode: installed in {plugins / 'kvtether.js'}",
        f"kvtether plugin for OpenCode: already installed in {plugins / 'kvtether.js'}"]
    source = Path(__file__).parents[2] / "src" / "kvtether" / "harness" / "opencode-plugin.js"
    assert (plugins / "kvtether.js").read_text() == source.read_text()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert install_opencode().path == tmp_path / "xdg" / "opencode" / "plugins" / "kvtether.js"
