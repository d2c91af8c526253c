"""benchmarks.soak, run for a few seconds against the kvtether router over fake vLLM P/D."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import soak
from kvtether.router import RouterSettings, create_app
from tests.support.fake_vllm import BLOCK_SIZE, Cluster, FakeVLLM, RoutingTransport
from tests.support.servers import serve_app

# A soak of a few seconds: three conversations, tool gaps of ~10 ms, a window a second.
QUICK = ["--conversations", "3", "--minutes", "0.05", "--window-s", "1", "--tool-s", "0.01",
         "--turns", "2", "4", "--prompt-tokens", "20", "--turn-timeout-s", "30"]


@contextlib.contextmanager
def fake_stack() -> Iterator[tuple[str, FakeVLLM]]:
    """The kvtether router on a loopback port, over one fake prefill and one fake decode
    instance (with the kvtether control channel, so heartbeats renew and close releases)."""
    cluster = Cluster()
    prefill = cluster.add(FakeVLLM(cluster, "prefill0", "prefill0", 8100), "prefill0:8100")
    decode = FakeVLLM(cluster, "decode0", "decode0", 8200, control=True, side_channel_port=5700)
    cluster.add(decode, "decode0:8200", "decode0-control:9200")

    def make_app(port: int) -> Any:
        settings = RouterSettings(
            port=port, prefill_urls=[prefill.url], decode_urls=[decode.url],
            decode_control_urls=[decode.control_url], kv_block_size_tokens=BLOCK_SIZE,
            kv_recompute_threshold_tokens=16)
        return create_app(settings, transport=RoutingTransport(cluster))

    with serve_app(make_app) as url:
        yield url, prefill


def test_a_short_soak_completes_and_records_every_turn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "soak.json"
    with fake_stack() as (url, _):
        code = soak.main(["--url", url, "--state-dir", str(tmp_path), "--json", str(out),
                          *QUICK])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(out.read_text())
    turns, summary = data["turns"], data["summary"]
    assert turns and summary["turns"] == len(turns) and summary["failed"] == 0
    assert data["model"] == "tiny"
    # Conversations ended and new ones took their slots, each released on the way.
    assert summary["conversations"] > 3
    assert {t["slot"] for t in turns} == {0, 1, 2}
    assert max(t["turn"] for t in turns) >= 2
    # Every later turn extends its history (the model's own answer appended) and reuses KV.
    assert summary["fired"] > 0 and summary["fired"] == summary["eligible"]
    assert {t["outcome"] for t in turns if t["turn"] >= 2} == {"fired"}
    assert any(t["stream"] and t["turn"] >= 2 and t["ttft_s"] for t in turns)
    assert len(data["windows"]) >= 3  # three seconds of one-second windows, then the drain
    assert sum(w["stats"]["turns"] for w in data["windows"]) == len(turns)
    assert "soak" in data["windows"][0]["rss_mib"]
    assert "reuse" in printed and "result: OK" in printed


def test_failed_turns_are_counted_and_fail_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "soak.json"
    with fake_stack() as (url, prefill):
        prefill.fail_next("500", times=3)  # the next three turns: HTTP 500 from the router
        code = soak.main(["--url", url, "--state-dir", str(tmp_path), "--json", str(out),
                          *QUICK])
    printed = capsys.readouterr().out
    assert code == 1
    data = json.loads(out.read_text())
    failed = [t for t in data["turns"] if t["error"]]
    assert len(failed) == 3 and data["summary"]["failed"] == 3
    assert all("InternalServerError" in t["error"] for t in failed)
    assert any(not t["error"] for t in data["turns"])  # the soak went on after them
    assert "failed turns: 3" in printed and "result: FAILED" in printed


def test_a_stall_report_in_a_stack_log_fails_the_run(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.log"
    log.write_text("INFO started\n")
    record = SimpleNamespace(name="decode-0", pid=os.getpid(), create_time=None, log_path=log)
    watch = soak.StackWatch(lambda: [record])
    opts = soak.SoakOptions(conversations=2, duration_s=2.0, window_s=1.0, turns=(2, 3),
                            tool_median_s=0.01, prompt_tokens=10, turn_timeout_s=30.0)
    with fake_stack() as (url, _), log.open("a") as f:
        f.write("WARNING kvtether: this worker's engine step has run for 60 s (vLLM ends ...\n")
        f.flush()
        result = asyncio.run(soak.run(url, opts, watch=watch, say=lambda line: None))
    assert result.turns and result.failed == 0
    assert len(result.stalls) == 1 and result.stalls[0].startswith("decode-0: WARNING")
    assert result.exit_code() == 1
    assert set(result.windows[-1].rss_mib) == {"decode-0", "soak"}
    # Where py-spy is installed (the dev extra), the stalled process's stacks were dumped.
    if Path(sys.executable).with_name("py-spy").is_file():
        dump = Path(result.stack_dumps[0])
        assert dump.parent == tmp_path / "stall-dumps" and dump.name.startswith("decode-0-")
        assert f"Process {os.getpid()}" in dump.read_text()


def test_without_url_it_starts_the_bench_stack_watches_it_and_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvtether.stack

    log = tmp_path / "decode-0.log"
    log.write_text("INFO Timeout (0:01:00)!\n")  # faulthandler's watchdog fired in warm-up
    seen: dict[str, Any] = {}

    class FakeStack:
        """Stands in for kvtether.stack.Stack: serves the fake router, records its lifecycle."""

        def __init__(self, settings: Any, **kwargs: Any) -> None:
            seen["settings"], seen["kwargs"] = settings, kwargs
            self._serving = fake_stack()
            self.state: Any = None

        def __enter__(self) -> FakeStack:
            self.router_url, _ = self._serving.__enter__()
            record = SimpleNamespace(name="decode-0", pid=os.getpid(), create_time=None,
                                     log_path=log)
            self.state = SimpleNamespace(processes=[record])
            seen["up"] = True
            return self

        def __exit__(self, *exc: object) -> None:
            self.state = None
            self._serving.__exit__(None, None, None)
            seen["down"] = True

    monkeypatch.setattr(kvtether.stack, "Stack", FakeStack)
    code = soak.main(["--conversations", "2", "--minutes", "0.02", "--window-s", "1",
                      "--tool-s", "0.01", "--turns", "2", "2", "--prompt-tokens", "10"])
    printed = capsys.readouterr().out
    assert seen.get("up") and seen.get("down")
    settings = seen["settings"]
    assert (settings.profile, settings.port, settings.prefill, settings.decode) == (
        "cpu-bench", 8800, 1, 1)
    assert settings.prefill_prefix_caching is False
    assert Path(settings.state_dir) == Path(".kvtether/soak")
    assert seen["kwargs"]["die_with_parent"] is True
    assert code == 1  # the stall report in the stack's log
    assert "stall reports: 1" in printed and "decode-0: INFO Timeout (0:01:00)!" in printed
    assert "rss MiB decode-0 " in printed


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        soak.main(["--url", "http://127.0.0.1:9", "--turns", "5", "2"])
    assert exc.value.code == 2
    assert "--turns needs 1 <= MIN <= MAX" in capsys.readouterr().err


def test_turns_without_answer_fail_at_their_timeout_and_the_run_still_ends(
    tmp_path: Path,
) -> None:
    out = tmp_path / "soak.json"
    quick = [*QUICK[:-2], "--turn-timeout-s", "1", "--conversations", "1"]
    with fake_stack() as (url, prefill):
        prefill.queue_delay_s = 2.0  # every turn waits 2 s before the engine takes it
        code = soak.main(["--url", url, "--state-dir", str(tmp_path), "--json", str(out),
                          *quick])
    data = json.loads(out.read_text())
    assert code == 1
    errors = [t["error"] for t in data["turns"]]
    assert len(errors) >= 2 and set(errors) == {"no answer within 1 s"}
    assert data["summary"]["failed"] == len(errors)


def test_with_url_it_watches_the_stack_recorded_for_that_url_from_now_on(tmp_path: Path) -> None:
    from kvtether.stack._state import ProcessRecord, StackState, save_state

    log = tmp_path / "prefill-0.log"
    log.write_text("WARNING kvtether: this worker's engine step has run for 60 s\n")  # before
    record = ProcessRecord(name="prefill-0", role="prefill", url="http://127.0.0.1:8100",
                           port=8100, pid=os.getpid(), log_path=log)
    save_state(tmp_path, StackState(router_url="http://127.0.0.1:8000", processes=[record]))

    other = soak.StackWatch.for_url("http://127.0.0.1:9000", tmp_path)
    assert set(other.rss_mib()) == {"soak"} and "no stack state" in other.source
    watch = soak.StackWatch.for_url("http://localhost:8000/", tmp_path)
    assert watch.scan_logs() == []  # what the log said before the soak is not counted
    with log.open("a") as f:
        f.write("ERROR No available shared memory broadcast block found in 60 seconds\nINFO x")
    assert watch.scan_logs() == [
        "prefill-0: ERROR No available shared memory broadcast block found in 60 seconds"]
    assert set(watch.rss_mib()) == {"prefill-0", "soak"}


def test_a_failed_turn_says_what_the_sdk_s_error_wraps() -> None:
    import httpx
    import openai

    try:
        try:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        except httpx.RemoteProtocolError as cause:
            raise openai.APIConnectionError(request=httpx.Request("POST", "http://x")) from cause
    except openai.APIConnectionError as exc:
        said = soak._describe(exc)
    assert said == ("APIConnectionError: Connection error. (from RemoteProtocolError: Server "
                    "disconnected without sending a response.)")
    assert soak._describe(ValueError("x" * 400)) == f"ValueError: {'x' * 288}"
