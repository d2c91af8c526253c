"""`pd-oneway` on vLLM's own router: vllm-router's P/D mode in front of the stack's engines
(no vLLM, no vllm-router process: command lines, settings and the start/stop order)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvtether.bench import _upstream, _vllm_router
from kvtether.bench.strategies import (
    STRATEGIES,
    Strategy,
    StrategyOptions,
    stack_settings,
    start_strategy,
)
from kvtether.stack._commands import kv_transfer_config
from kvtether.stack._plan import plan_processes

PREFILL = ["http://127.0.0.1:9600"]
DECODE = ["http://127.0.0.1:9601"]


def _opts(tmp_path: Path, **kw: Any) -> StrategyOptions:
    return StrategyOptions(profile="cpu-tiny", compress=16.0, port=9500, state_dir=tmp_path, **kw)


def test_pd_oneway_is_routed_by_vllm_router_and_the_others_by_kvtether() -> None:
    assert STRATEGIES["pd-oneway"].router == "vllm-router"
    assert STRATEGIES["pd-oneway"].reuse_policy == "off"
    assert {s.router for n, s in STRATEGIES.items() if n != "pd-oneway"} == {"kvtether"}


def test_the_command_line_is_vllm_routers_pd_mode_without_bootstrap_ports() -> None:
    argv = _vllm_router.router_argv(
        [], host="127.0.0.1", port=9500, metrics_port=9800, policy=_upstream.PD_POLICY,
        extra_args=_upstream.pd_router_args(PREFILL + ["http://127.0.0.1:9602"], DECODE),
        python="py")
    assert "--worker-urls" not in argv
    tail = argv[argv.index("--vllm-pd-disaggregation"):]
    assert tail == ["--vllm-pd-disaggregation", "--prefill", PREFILL[0],
                    "--prefill", "http://127.0.0.1:9602", "--decode", DECODE[0]]
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--port") + 1] == "9500"


def test_vllm_routers_own_parser_reads_it_as_pd_mode() -> None:
    launch = pytest.importorskip("vllm_router.launch_router")
    argv = _vllm_router.router_argv(
        [], host="127.0.0.1", port=9500, metrics_port=9800, policy=_upstream.PD_POLICY,
        extra_args=_upstream.pd_router_args(PREFILL, DECODE), python="py")
    args = launch.parse_router_args(argv[3:])  # after `python -m vllm_router.launch_router`
    assert args.vllm_pd_disaggregation
    assert args.prefill_urls == [(PREFILL[0], None)]  # NIXL: no bootstrap port
    assert args.decode_urls == DECODE
    assert args.policy == "round_robin" and args.port == 9500


@pytest.mark.parametrize("connector", ["kvtether", "nixl"])
def test_the_engines_run_one_way_with_no_kvtether_router(tmp_path: Path, connector: str) -> None:
    settings = _upstream.pd_settings(stack_settings(
        STRATEGIES["pd-oneway"], _opts(tmp_path, baseline_connector=connector)))
    assert not settings.start_router and not settings.warm_up
    assert settings.connector == connector
    plans = plan_processes(settings, tmp_path, "served", "secret")
    assert sorted(p.role for p in plans) == ["decode", "prefill"]  # no router, no store
    for plan in plans:
        extra = kv_transfer_config(plan, settings)["kv_connector_extra_config"]
        assert extra["bidirectional_kv_xfer"] is False  # decode frees a turn's KV at its end
    # vllm-router takes the kvtether router's port; the engines keep theirs above it.
    assert settings.port == 9500 and all(p.port > 9500 for p in plans)


class _FakeStack:
    prefill_urls = PREFILL
    decode_urls = DECODE
    served_model_name = "served"

    def __init__(self, settings: Any, log: list[str]) -> None:
        self.settings = settings
        self.log = log

    def __enter__(self) -> _FakeStack:
        self.log.append(f"stack up (router={self.settings.start_router})")
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append("stack down")


def _fakes(monkeypatch: pytest.MonkeyPatch, log: list[str], calls: dict[str, Any],
           router_fails: bool = False) -> None:
    import kvtether.stack._warmup as warmup
    import kvtether.stack.launcher as launcher

    monkeypatch.setattr(_vllm_router, "require_vllm_router", lambda: log.append("checked"))
    monkeypatch.setattr(launcher, "Stack", lambda settings: _FakeStack(settings, log))

    @contextmanager
    def router(worker_urls: list[str], **kw: Any) -> Iterator[str]:
        calls.update(kw, worker_urls=worker_urls)
        if router_fails:
            raise RuntimeError("vllm-router never answered /health")
        log.append("router up")
        try:
            yield f"http://{kw['host']}:{kw['port']}"
        finally:
            log.append("router down")

    monkeypatch.setattr(_vllm_router, "start_vllm_router", router)

    def warm(url: str, model: str, **kw: Any) -> warmup.WarmUpReport:
        log.append(f"warm-up {url} x{kw['conversations']}")
        return warmup.WarmUpReport(conversations=1, outcomes=[""])

    monkeypatch.setattr(warmup, "warm_up", warm)


def test_start_order_endpoints_and_stop_order(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    calls: dict[str, Any] = {}
    _fakes(monkeypatch, log, calls)
    with start_strategy(STRATEGIES["pd-oneway"], _opts(tmp_path)) as endpoints:
        log.append("replay")
    assert log == ["checked", "stack up (router=False)", "router up",
                   "warm-up http://127.0.0.1:9500 x1", "replay", "router down", "stack down"]
    assert calls["worker_urls"] == [] and calls["policy"] == "round_robin"
    assert calls["extra_args"] == _upstream.pd_router_args(PREFILL, DECODE)
    assert calls["metrics_port"] == 9501
    # The replay talks to vllm-router, samples decode's held KV, and asks no kvtether router.
    assert endpoints.openai_base_url == "http://127.0.0.1:9500/v1"
    assert endpoints.router_url is None and endpoints.kv_urls == DECODE
    assert endpoints.instances == 2


def test_a_router_that_fails_to_start_stops_the_engines(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    _fakes(monkeypatch, log, {}, router_fails=True)
    with pytest.raises(RuntimeError, match="never answered"):
        with start_strategy(STRATEGIES["pd-oneway"], _opts(tmp_path)):
            pass
    assert log == ["checked", "stack up (router=False)", "stack down"]


def test_without_vllm_router_nothing_starts(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtether.errors import ConfigError

    log: list[str] = []
    _fakes(monkeypatch, log, {})

    def missing() -> None:
        raise ConfigError("vLLM's router is not installed")

    monkeypatch.setattr(_vllm_router, "require_vllm_router", missing)
    with pytest.raises(ConfigError, match="not installed"):
        with start_strategy(Strategy("x", "", reuse_policy="off", router="vllm-router"),
                            _opts(tmp_path)):
            pass
    assert log == []


# --- what vllm-router itself sends (the real binary, fake engines) ---------------------------
class _Engine:
    """A fake vLLM instance: answers /health, records each chat request, answers like a NIXL
    prefill (kv_transfer_params for decode) or decode."""

    def __init__(self, role: str) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # /health, and whatever else it probes
                self._send(200, b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                answer: dict[str, Any] = {
                    "id": "x", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [7],
                                 "message": {"role": "assistant", "content": role}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
                if role == "prefill":
                    answer["kv_transfer_params"] = {
                        "do_remote_prefill": True, "do_remote_decode": False,
                        "remote_engine_id": "p-engine", "remote_block_ids": [[1, 2]],
                        "remote_request_id": "p-req", "remote_host": "127.0.0.1",
                        "remote_port": 7001}
                self._send(200, json.dumps(answer).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_vllm_router_sends_prefill_a_fresh_one_way_leg_and_decode_prefills_answer(
    tmp_path: Path,
) -> None:
    """What pd-oneway relies on, and why pd-upstream cannot run on it: the prefill leg gets
    max_tokens=1, stream false and the fresh do_remote_decode params, whatever the client sent
    (a handle from an earlier turn is overwritten); decode gets the client's request with
    prefill's answer; return_token_ids passes through."""
    pytest.importorskip("vllm_router")
    import httpx

    from kvtether.stack._procs import free_port

    prefill, decode = _Engine("prefill"), _Engine("decode")
    try:
        with _vllm_router.start_vllm_router(
            [], host="127.0.0.1", port=free_port(), metrics_port=free_port(),
            log_path=tmp_path / "vllm-router.log", health_timeout_s=60, stop_timeout_s=5,
            policy=_upstream.PD_POLICY,
            extra_args=_upstream.pd_router_args([prefill.url], [decode.url]),
        ) as url:
            handle = {"do_remote_decode": True, "remote_block_ids": [[9]],
                      "remote_engine_id": "d-engine", "remote_request_id": "d-req",
                      "remote_host": "127.0.0.1", "remote_port": 7002}
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5, "temperature": 0, "return_token_ids": True,
                "conversation_id": "c1", "kv_transfer_params": handle})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "decode"
    finally:
        prefill.server.shutdown()
        decode.server.shutdown()
    [(p_headers, p_body)] = prefill.requests
    [(d_headers, d_body)] = decode.requests
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "p-engine"
    assert d_body["kv_transfer_params"]["remote_port"] == 7001
    assert d_body["max_tokens"] == 5 and d_body["return_token_ids"] is True
    assert p_headers["x-request-id"] == d_headers["x-request-id"]
