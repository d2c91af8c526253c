"""Claude Code, Codex and OpenCode as installed from npm (``scripts/setup-harnesses.sh``), run
non-interactively against a kvtether router, offline: each in a home of its own, with its
telemetry, update checks, plugin sync and model-list fetches switched off by its documented
settings (docs/coding-agents.md, "Running them offline").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS_DIR = Path(os.environ.get("KVTETHER_HARNESS_DIR", ROOT / ".kvtether" / "harnesses"))
BIN = HARNESS_DIR / "node_modules" / ".bin"
HARNESSES = ("claude", "codex", "opencode")


def installed() -> bool:
    return all((BIN / name).exists() for name in HARNESSES)


@dataclass
class Run:
    harness: str
    returncode: int
    stdout: str
    stderr: str
    session_id: str | None  # the id the harness sends as its session header

    def events(self) -> list[dict]:
        out = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out


class Harness:
    """One harness with a home of its own, pointed at ``base_url`` (a kvtether router)."""

    def __init__(self, name: str, base_url: str, model: str, home: Path,
                 api_key: str = "kvtether-test", *, hooks: bool = False) -> None:
        self.name, self.base_url, self.model, self.home = name, base_url, model, home
        self.api_key = api_key
        self.work = home / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        getattr(self, f"_configure_{name}")()
        if hooks:  # kvtether's hook integration, installed as docs/coding-agents.md says
            self.env.update(KVTETHER_URL=base_url, KVTETHER_API_KEY=api_key)
            where = (["--settings", str(home / ".claude" / "settings.json")] if name == "claude"
                     else ["--dir", str(home / ".config" / "opencode" / "plugins")])
            target = {"claude": "claude-code", "opencode": "opencode"}[name]
            subprocess.run([sys.executable, "-m", "kvtether", "hook", "install", target, *where],
                           check=True, capture_output=True, timeout=120)

    # ----------------------------------------------------------------- configuration
    def _base_env(self) -> dict[str, str]:
        keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env.update(HOME=str(self.home), XDG_CONFIG_HOME=str(self.home / ".config"),
                   XDG_DATA_HOME=str(self.home / ".local" / "share"),
                   XDG_CACHE_HOME=str(self.home / ".cache"),
                   XDG_STATE_HOME=str(self.home / ".local" / "state"), NO_COLOR="1", CI="1")
        return env

    def _configure_claude(self) -> None:
        self.env = {
            **self._base_env(), **claude_env(self.base_url, self.model),
            "ANTHROPIC_AUTH_TOKEN": self.api_key,
            "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
            # As root, skipping permission prompts needs a declared sandbox.
            "IS_SANDBOX": "1",
        }

    def _configure_codex(self) -> None:
        codex_home = self.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(self.base_url, self.model))
        self.env = {**self._base_env(), "CODEX_HOME": str(codex_home),
                    "KVTETHER_API_KEY": self.api_key}

    def _configure_opencode(self) -> None:
        config_dir = self.home / ".config" / "opencode"
        config_dir.mkdir(parents=True, exist_ok=True)
        config = config_dir / "opencode.json"
        config.write_text(json.dumps(opencode_config(self.base_url, self.model), indent=2))
        # OpenCode runs npm against the registry at every start unless its plugin API is in the
        # config directory's node_modules and its package-lock.json's root package lists it.
        plugin = HARNESS_DIR / "node_modules" / "@opencode-ai"
        target = config_dir / "node_modules" / "@opencode-ai"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(plugin, target, symlinks=True)
        version = json.loads((plugin / "plugin" / "package.json").read_text())["version"]
        deps = {"@opencode-ai/plugin": version}
        (config_dir / "package.json").write_text(json.dumps({"dependencies": deps}))
        (config_dir / "package-lock.json").write_text(json.dumps(
            {"lockfileVersion": 3, "packages": {"": {"dependencies": deps}}}))
        self.env = {
            **self._base_env(), "OPENCODE_CONFIG": str(config), "KVTETHER_API_KEY": self.api_key,
            "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_AUTOCOMPACT": "1",
        }

    # ----------------------------------------------------------------- runs
    def run(self, prompt: str, *, cont: bool = False, timeout_s: float = 600) -> Run:
        argv = getattr(self, f"_argv_{self.name}")(prompt, cont)
        done = subprocess.run(argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s)
        run = Run(self.name, done.returncode, done.stdout, done.stderr, None)
        run.session_id = getattr(self, f"_session_{self.name}")(run)
        return run

    def _argv_claude(self, prompt: str, cont: bool) -> list[str]:
        return [str(BIN / "claude"), *(["-c"] if cont else []), "-p", prompt,
                "--output-format", "stream-json", "--verbose",
                "--dangerously-skip-permissions"]

    def _argv_codex(self, prompt: str, cont: bool) -> list[str]:
        head = [str(BIN / "codex"), "exec", *(["resume", "--last"] if cont else [])]
        return [*head, "--json", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", prompt]

    def _argv_opencode(self, prompt: str, cont: bool) -> list[str]:
        return [str(BIN / "opencode"), "run", *(["--continue"] if cont else []),
                "--format", "json", "--model", f"kvtether/{self.model}", prompt]

    @staticmethod
    def _session_claude(run: Run) -> str | None:
        return next((e["session_id"] for e in run.events() if e.get("session_id")), None)

    @staticmethod
    def _session_codex(run: Run) -> str | None:
        return next((e["thread_id"] for e in run.events() if e.get("thread_id")), None)

    @staticmethod
    def _session_opencode(run: Run) -> str | None:
        return next((e["sessionID"] for e in run.events() if e.get("sessionID")), None)


def readme_section(title: str) -> dict[str, list[str]]:
    """The code blocks of one README section, by language."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        blocks.setdefault(lang, []).append(code)
    return blocks


README_SECTION = "Point a coding agent at kvtether"
_README_URL = "http://127.0.0.1:8000"


def claude_env(base_url: str, model: str) -> dict[str, str]:
    """The environment the README's Claude Code line sets, at this router."""
    block = readme_section(README_SECTION)["bash"][-1].replace("\\\n", " ")
    line = next(x for x in block.splitlines() if x.rstrip().endswith(" claude"))
    env = dict(word.split("=", 1) for word in line.split() if "=" in word)
    assert env["ANTHROPIC_BASE_URL"] == _README_URL and env["ANTHROPIC_MODEL"] == model, env
    return {**env, "ANTHROPIC_BASE_URL": base_url}


def readme_curl_lines() -> str:
    """The README's curl lines (what Claude Code sends), without the line that starts it."""
    block = readme_section(README_SECTION)["bash"][-1]
    return block[block.index("\ncurl") + 1:]


def codex_config(base_url: str, model: str) -> str:
    """Codex's config.toml: the README's, at this router, plus the switches that keep it
    offline (plugin sync, analytics) and a key from the environment."""
    readme = readme_section(README_SECTION)["toml"][0]
    assert f'model = "{model}"' in readme and _README_URL in readme, readme
    config = readme.replace(_README_URL, base_url)
    return config.replace('wire_api = "responses"\n',
                          'wire_api = "responses"\nenv_key = "KVTETHER_API_KEY"\n') + """
[features]
plugins = false
remote_plugin = false

[analytics]
enabled = false
"""


def opencode_config(base_url: str, model: str) -> dict:
    """OpenCode's opencode.json: the README's, at this router, with autoupdate and sharing
    off and a key from the environment."""
    config = json.loads(readme_section(README_SECTION)["json"][0])
    assert config["model"] == f"kvtether/{model}", config
    options = config["provider"]["kvtether"]["options"]
    assert options["baseURL"] == f"{_README_URL}/v1", options
    options.update(baseURL=f"{base_url}/v1", apiKey="{env:KVTETHER_API_KEY}")
    return {**config, "autoupdate": False, "share": "disabled"}
