"""What the session layer costs per request, and how well it predicts the next turn.

    python -m benchmarks.bench_session [--requests 300] [--sessions 200]

Overhead: the same OpenAI SDK calls against an in-process mock server (no network), with and
without ``session.wrap``; the difference of medians is the wrapper's cost per request (prefix
check, hints, header and body accounting, stream filtering). Prediction: ``GrowthPredictor``
replayed over synthetic agent sessions (``kvtether.bench.workload``) against naive baselines.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from openai import OpenAI

from kvtether.bench.workload import generate_sessions, score_predictions
from kvtether.session import Session, SessionSettings

_HEADERS = {
    "X-KVTether-Reuse": "fired",
    "X-KVTether-Reused-Tokens": "4096",
    "X-KVTether-Prompt-Tokens": "4200",
    "content-type": "application/json",
}


def _http_module() -> Any:
    """The HTTP library the installed SDK uses by default (httpx2 for openai 3, else httpx)."""
    probe = OpenAI(api_key="-", base_url="http://mock/v1")
    for name in ("httpx2", "httpx"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if isinstance(probe._client, mod.Client):
            return mod
    raise RuntimeError("unknown HTTP client in the OpenAI SDK")


def _handler(mod: Any, output_tokens: int) -> Callable[[Any], Any]:
    usage = {"prompt_tokens": 4200, "completion_tokens": output_tokens, "total_tokens": 4200}

    def handle(request: Any) -> Any:
        body = json.loads(request.content)
        if not body.get("stream"):
            message = {"role": "assistant", "content": "word " * output_tokens}
            return mod.Response(
                200,
                headers=_HEADERS,
                json={
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": usage,
                },
            )
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        events = [
            b"data: "
            + json.dumps(
                {**chunk, "choices": [{"index": 0, "delta": {"content": "word "}}]}
            ).encode()
            + b"\n\n"
            for _ in range(output_tokens)
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(
                b"data: " + json.dumps({**chunk, "choices": [], "usage": usage}).encode() + b"\n\n"
            )
        events.append(b"data: [DONE]\n\n")
        headers = {**_HEADERS, "content-type": "text/event-stream"}
        return mod.Response(200, headers=headers, content=iter(events))

    return handle


def _history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 50}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"tool output {i} " + "x " * 600})
        messages.append({"role": "assistant", "content": f"step {i} " + "y " * 150})
    messages.append({"role": "user", "content": "continue"})
    return messages


def _call(client: OpenAI, messages: list[dict[str, Any]], stream: bool) -> float:
    # CPU time of this thread: the mock server runs in it too, and other processes on a
    # busy machine do not count against either side.
    t0 = time.thread_time()
    if stream:
        for _ in client.chat.completions.create(
            model="m",
            messages=messages,  # type: ignore
            stream=True,
        ):
            pass
    else:
        client.chat.completions.create(model="m", messages=messages)  # type: ignore
    return time.thread_time() - t0


def overhead(requests: int) -> None:
    mod = _http_module()
    print(
        f"wrapper overhead per request (openai SDK over {mod.__name__}, in-process mock, "
        "200 output tokens, median CPU µs)"
    )
    print(f"{'messages':>9} {'body KB':>8} {'mode':>7} {'plain':>8} {'wrapped':>8} {'overhead':>9}")
    for turns in (1, 10, 30):
        messages = _history(turns)
        body_kb = len(json.dumps(messages)) / 1024
        for stream in (False, True):
            http = mod.Client(transport=mod.MockTransport(_handler(mod, 200)))
            plain = OpenAI(api_key="-", base_url="http://mock/v1", http_client=http)
            session = Session(
                "http://mock",
                settings=SessionSettings(release_at_exit=False, on_prefix_break="ignore"),
            )
            wrapped = session.wrap(plain)
            a: list[float] = []
            b: list[float] = []
            for i in range(requests + 10):  # interleaved, so drift hits both alike
                pa, pb = _call(plain, messages, stream), _call(wrapped, messages, stream)
                if i >= 10:
                    a.append(pa)
                    b.append(pb)
            ma, mb = statistics.median(a), statistics.median(b)
            mode = "stream" if stream else "json"
            print(
                f"{len(messages):>9} {body_kb:>8.0f} {mode:>7} {ma * 1e6:>8.0f} "
                f"{mb * 1e6:>8.0f} {(mb - ma) * 1e6:>9.0f}"
            )
            http.close()


def prediction(sessions: int) -> None:
    scores = score_predictions(generate_sessions(sessions, seed=0))
    print(f"\nprediction error over {sessions} synthetic sessions (predictor vs naive)")
    for point, s in scores.items():
        print(
            f"  at {point:<8} n={s.samples:<6} "
            f"next-prompt MAPE {s.tokens_mape:.1%} vs {s.tokens_mape_naive:.1%}, "
            f"median abs {s.tokens_median_abs_error:.0f} vs "
            f"{s.tokens_median_abs_error_naive:.0f} tokens; "
            f"gap median abs {s.gap_median_abs_error_s:.2f} vs "
            f"{s.gap_median_abs_error_naive_s:.2f} s, median |ln ratio| "
            f"{s.gap_median_abs_log_ratio:.2f} vs {s.gap_median_abs_log_ratio_naive:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--sessions", type=int, default=200)
    args = parser.parse_args()
    overhead(args.requests)
    prediction(args.sessions)


if __name__ == "__main__":
    main()
