"""`kvtether` CLI: flags come from the settings models; user errors are one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvtether.stack.cli as stack_cli
from kvtether.cli import main
from kvtether.router.settings import RouterSettings
from kvtether.stack.settings import StackSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KVTETHER_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def captured_up(monkeypatch: pytest.MonkeyPatch) -> list[StackSettings]:
    seen: list[StackSettings] = []

    def fake_run_up(settings: StackSettings, commands: object = None) -> int:
        seen.append(settings)
        return 0

    monkeypatch.setattr(stack_cli, "run_up", fake_run_up)
    return seen


def test_stack_up_flags(captured_up: list[StackSettings]) -> None:
    argv = "stack up --profile cpu-smol --prefill 2 --decode 3 --port 8300 --detach"
    argv += " --lease-ttl-s 10 --max-retained-tokens 5000 --connector kvtether"
    assert main(argv.split()) == 0
    (s,) = captured_up
    assert (s.profile, s.prefill, s.decode, s.port, s.detach) == ("cpu-smol", 2, 3, 8300, True)
    assert (s.lease_ttl_s, s.max_retained_tokens, s.connector) == (10, 5000, "kvtether")
    assert s.max_model_len_tokens == 2048  # from the profile


def test_stack_up_flag_beats_env_beats_file(
    captured_up: list[StackSettings], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = tmp_path / "stack.toml"
    cfg.write_text("port = 9001\ndecode = 2\nprefill = 2\n")
    monkeypatch.setenv("KVTETHER_PORT", "9002")
    monkeypatch.setenv("KVTETHER_DECODE", "4")
    assert main(["stack", "up", "--config", str(cfg), "--port", "9003"]) == 0
    (s,) = captured_up
    assert (s.port, s.decode, s.prefill) == (9003, 4, 2)


def test_every_stack_setting_is_a_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtether", "stack", "up", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in StackSettings.model_fields:
        assert "--" + name.replace("_", "-") in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["stack", "up", "--prefill", "0"], "error: invalid --prefill: Input should be greater"),
        (["stack", "up", "--profile", "tpu"], "error: invalid --profile"),
        # The router it would start rejects 0 too: caught before anything starts.
        (["stack", "up", "--max-retained-tokens", "0"], "error: invalid --max-retained-tokens"),
        (["stack", "up", "--config", "absent.toml"], "config file absent.toml does not exist"),
        (["stack", "status"], "error: no stack is recorded in"),
        (["stack", "down"], "error: no stack is recorded in"),
    ],
)
def test_user_errors_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_model_dir_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stack", "up", "--model", "no/such/dir", "--state-dir", "st"]) == 1
    err = capsys.readouterr().err
    assert "has no config.json" in err and "kvtether model prepare" in err


def test_model_prepare(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls = []
    fake = lambda name, out=None, force=False: calls.append((name, out, force)) or Path("/m")  # noqa: E731
    monkeypatch.setattr("kvtether.stack.models.prepare_model", fake)
    assert main(["model", "prepare", "smol", "--out", "d", "--force"]) == 0
    assert calls == [("smol", Path("d"), True)]
    assert capsys.readouterr().out.strip() == "/m"


def test_router_builds_router_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[RouterSettings] = []
    import kvtether.router as router_pkg

    monkeypatch.setattr(router_pkg, "serve", served.append, raising=False)
    argv = [
        "router",
        "--port",
        "8311",
        "--prefill-urls",
        '["http://a:1"]',
        "--decode-urls",
        "http://b:2",
    ]
    assert main(argv) == 0
    (settings,) = served
    assert type(settings) is RouterSettings
    assert (settings.port, settings.prefill_urls, settings.decode_urls) == (
        8311,
        ["http://a:1"],
        ["http://b:2"],
    )


@pytest.mark.parametrize(
    ("argv", "code", "out", "err"),
    [
        (["bench", "--help"], 0, "usage: kvtether bench", ""),
        (["--log-level", "debug", "bench", "-h"], 0, "--strategies", ""),
        (["bench", "idle", "--help"], 0, "usage: kvtether bench idle", ""),
        (["bench", "generate", "--help"], 0, "usage: kvtether bench generate", ""),
        (["bench", "nope"], 2, "", "unrecognized arguments: nope"),
        (["bench", "--strategies", "fast"], 2, "", "invalid choice: 'fast'"),
    ],
)
def test_bench_gets_its_own_arguments(
    argv: list[str], code: int, out: str, err: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        assert main(argv) == code
    except SystemExit as exit_:  # argparse exits by itself
        assert exit_.code == code
    captured = capsys.readouterr()
    assert out in captured.out and err in captured.err


@pytest.mark.parametrize(
    ("argv", "code", "stream", "text"),
    [
        (["demo", "--help"], 0, "out", "usage: kvtether demo"),
        (["--log-level", "debug", "demo", "--help"], 0, "out", "--router-url"),
        (["demo", "--nope"], 2, "err", "unrecognized arguments: --nope"),
    ],
)
def test_demo_gets_its_own_arguments(
    argv: list[str], code: int, stream: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:  # argparse exits by itself
        main(argv)
    assert exit_.value.code == code
    assert text in getattr(capsys.readouterr(), stream)


@pytest.mark.parametrize(
    ("command", "module"), [("bench", "kvtether.bench.cli"), ("demo", "kvtether.demo")]
)
def test_passthrough_that_cannot_load_is_a_clear_error(
    command: str, module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # type: ignore[arg-type]  # import fails
    assert main([command, "--help"]) == 2
    err = capsys.readouterr().err
    assert f"error: `kvtether {command}` cannot start" in err and module in err
